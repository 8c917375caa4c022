"""Alembic environment for the registry: runs on a connection passed in ``config.attributes["connection"]``
(what ``deploy.registry.migrations.upgrade`` does), or on ``sqlalchemy.url`` (offline SQL with ``--sql`` too)."""

from __future__ import annotations

from alembic import context

from deploy.registry.tables import Base, make_engine

config = context.config
target_metadata = Base.metadata


def _configure(**kw) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode recreates the table instead.
    context.configure(target_metadata=target_metadata, render_as_batch=True, compare_type=True, **kw)


def run_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:  # the caller's connection and transaction (and its lock)
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise ValueError(
            "no database: set sqlalchemy.url or pass a connection (deploy.registry.migrations.alembic_config)"
        )
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
