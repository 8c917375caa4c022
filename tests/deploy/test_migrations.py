"""deploy/migrations: Alembic upgrade / downgrade on SQLite and PostgreSQL, schema == models, legacy stamping,
several processes opening one fresh database at once, and the migrations shipping with the package."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.migrations import (
    INITIAL_REVISION,
    MIGRATIONS_DIR,
    alembic_config,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from deploy.registry.registry import Registry
from deploy.registry.tables import Base, Counter, make_engine
from tests.deploy.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"versions", "gate_results", "audit_log", "fleet", "counters", "deployment"}


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'registry.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture
def engine(db_url):
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def schema_diff(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return current_revision(conn)


def test_upgrade_matches_models_then_downgrade_and_up_again(engine):
    assert upgrade(engine) == ""  # an empty database
    assert revision(engine) == head_revision() and TABLES <= tables(engine)
    assert schema_diff(engine) == []
    assert upgrade(engine) == head_revision()  # idempotent: already at head

    downgrade(engine, "base")
    assert revision(engine) is None and not (TABLES & tables(engine))
    upgrade(engine)
    assert revision(engine) == head_revision() and schema_diff(engine) == []


def test_registry_migrates_and_keeps_working(db_url, tmp_path):
    reg = Registry(db_url, LocalBlobStore(tmp_path / "blobs"))
    try:
        reg.init_base(tiny_model(), "m")
        assert revision(reg.engine) == head_revision() and schema_diff(reg.engine) == []
    finally:
        reg.close()
    again = Registry(db_url, LocalBlobStore(tmp_path / "blobs"))  # reopening: nothing to do, data intact
    try:
        assert again.stable().version == 0
    finally:
        again.close()


def test_database_made_by_create_all_is_stamped_not_recreated(engine, db_url, tmp_path):
    """A registry from before migrations (tables, no alembic_version) keeps its data and gets stamped."""
    from alembic import command

    from deploy.registry.migrations import INITIAL_REVISION, alembic_config

    with engine.begin() as conn:  # the schema create_all made before migrations existed: revision 0001, unstamped
        command.upgrade(alembic_config(connection=conn), INITIAL_REVISION)
        conn.execute(sa.text("DROP TABLE alembic_version"))
        conn.execute(sa.insert(Counter).values(name="version", value=42))
    assert revision(engine) is None
    reg = Registry(db_url, LocalBlobStore(tmp_path / "blobs"))
    try:
        assert revision(reg.engine) == head_revision()
        with reg.engine.connect() as conn:
            assert conn.execute(sa.select(Counter.value).where(Counter.name == "version")).scalar_one() == 42
        assert schema_diff(reg.engine) == []
    finally:
        reg.close()


def test_partial_schema_without_alembic_version_is_refused(engine, db_url, tmp_path):
    with engine.begin() as conn:
        Base.metadata.tables["fleet"].create(conn)
    with pytest.raises(RuntimeError, match="only some of its tables"):
        Registry(db_url, LocalBlobStore(tmp_path / "blobs"))


def test_several_processes_open_a_fresh_database_at_once(db_url, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from deploy.registry.blobstore import LocalBlobStore
        from deploy.registry.registry import Registry
        Registry({db_url!r}, LocalBlobStore({str(tmp_path / "blobs")!r})).close()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errors)
    eng = make_engine(db_url)
    try:
        assert revision(eng) == head_revision() and schema_diff(eng) == []
        with eng.connect() as conn:
            assert conn.execute(sa.select(Counter.name, Counter.value)).all() == [("version", 1)]
    finally:
        eng.dispose()


def test_offline_sql_for_postgresql(capsys):
    from alembic import command

    command.upgrade(alembic_config("postgresql+psycopg://nobody@localhost/none"), "head", sql=True)
    sql = capsys.readouterr().out
    assert "CREATE TABLE versions" in sql and "CREATE INDEX ix_gate_results_version" in sql
    assert "CREATE TABLE operators" in sql and f"version_num='{head_revision()}'" in sql.replace(" = ", "=")


def test_migrations_ship_with_the_package():
    assert INITIAL_REVISION == "0001"
    for name in ("__init__.py", "env.py", "script.py.mako", "versions/__init__.py", "versions/0001_initial.py"):
        assert (MIGRATIONS_DIR / name).is_file(), name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    from setuptools import find_packages

    packages = find_packages(str(ROOT), include=project["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {"deploy.registry.migrations", "deploy.registry.migrations.versions"} <= set(packages)
    assert "script.py.mako" in project["tool"]["setuptools"]["package-data"]["deploy.registry.migrations"]
    deps = " ".join(project["project"]["dependencies"])
    assert "alembic" in deps and "boto3" in deps
