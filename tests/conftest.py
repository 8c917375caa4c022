"""Shared fixtures: real services, each test isolated by its own names.

- ``stack``: one embedded Tansu broker per test session on a free port, the local Redis, a temp folder.
- ``cfg``: a LiverlConfig whose topic prefix, Redis namespace, SQLite file and blob folder are unique to
  the test, so tests never see each other's data.
- ``pg_url``: a fresh PostgreSQL database per test (skips, saying why, when no server answers).
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import redis

from core.config import LiverlConfig, load_config
from core.services import port_open
from liverl.stack.stack import Stack, start_stack


def free_port() -> int:
    from core.services import free_port as pick

    return pick()


def pipeline_env(prefix: str, **settings: str) -> dict[str, str]:
    """The environment for a whole pipeline (`liverl up`, `demo`, `chaos`) run by a test as a user runs it: this
    process's environment, every port the pipeline opens free, its own topic prefix, no Hugging Face downloads, the
    tests' model cache, and ``settings`` (``LIVERL__SECTION__FIELD``: value)."""
    env = dict(os.environ)
    env.update(
        {
            "LIVERL__BROKER__EMBEDDED_PORT": str(free_port()),
            "LIVERL__REDIS__EMBEDDED_PORT": str(free_port()),
            "LIVERL__SERVING__GATEWAY_PORT": str(free_port()),
            "LIVERL__SERVING__VLLM_PORT": str(free_port()),
            "LIVERL__SERVING__AGENT_PORT": str(free_port()),
            "LIVERL__INGEST__WEB_PORT": str(free_port()),
            "LIVERL__GATE__METRICS_PORT": str(free_port()),
            "LIVERL__TOPICS__PREFIX": f"{prefix}{os.getpid()}",
            "HF_HUB_OFFLINE": "1",
            **settings,
        }
    )
    if os.environ.get("LIVERL_TEST_MODEL_CACHE"):
        env["LIVERL__MODEL__CACHE_DIR"] = os.environ["LIVERL_TEST_MODEL_CACHE"]
    return env


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    state = tmp_path_factory.mktemp("stack")
    # memory storage: the suite's topics are throwaway, and the folder storage's cost (liverl.stack.objstore) would land
    # on every test; the durable default has its own tests (tests/liverl/test_stack.py, test_objstore.py)
    cfg = load_config(
        env={},
        state_dir=str(state),
        broker__embedded_port=free_port(),
        broker__embedded_storage="memory",
        redis__embedded_port=free_port(),
    )
    st = start_stack(cfg)
    yield st
    st.close()


@pytest.fixture
def cfg(stack: Stack, tmp_path) -> LiverlConfig:
    """A config unique to this test, pointing at the session's real services."""
    tag = uuid.uuid4().hex[:10]
    return load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{tag}",
        model__cache_dir=os.environ.get("LIVERL_TEST_MODEL_CACHE", str(tmp_path / "models")),
    )


@pytest.fixture
def pg_url():
    """A throwaway PostgreSQL database (the machine's server at 127.0.0.1:5432)."""
    if not port_open("127.0.0.1", 5432):
        pytest.skip("PostgreSQL is not listening on 127.0.0.1:5432 (set up by scripts/services.sh)")
    import sqlalchemy as sa

    admin_url = os.environ.get("LIVERL_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    name = f"liverl_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves non-daemon threads running (a leaked consumer, server or pool)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t.name for t in leaked if t.is_alive()]
    assert not leaked, f"test leaked threads: {leaked}"


@pytest.fixture
def rds(cfg):
    """The test's Redis (decoded strings); every key under the test's prefix is deleted afterwards."""
    r = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
    yield r
    for key in r.scan_iter(match=f"{cfg.topics.prefix}:*", count=1000):  # one round trip per 1,000 keys
        r.delete(key)
    r.close()


# scripts/test.sh runs the suite on two workers (pytest-xdist, --dist loadgroup). Each unit of work goes whole to one
# worker, which takes the next unit when it is done with one:
# - a unit is a file, so a module's fixtures start once;
# - or a whole package, where the package shares a package-scoped fixture (tests/serving: one vLLM node for all its
#   files), so that it starts once and not once per worker.
# The longest units start first (seconds each, serial, on a 2-core CI machine, 2026-11-29). That keeps both workers
# busy to the end, instead of one finishing the e2e demo alone while the other has nothing left. The order is only a
# schedule: any order passes, and a plain `pytest` (one process) ignores the groups.
LONGEST_FIRST = (
    "packaging/",  # the CPU image's build (from scratch: the base and every layer) and the compose deployment
    "test_e2e.py",  # 350: the real `liverl demo`
    "test_model_families.py",  # 387: one vLLM start per family
    "test_up.py",  # 257: the whole pipeline twice
    "test_up_onenode.py",  # 312 on a machine shared with other jobs: one-node `liverl up` until a promotion
    "demo/test_base_policy.py",  # 205: vLLM serves the base exactly
    "ingest/test_partition.py",  # 190: hosts on network namespaces, two 35-s cuts (root only)
    "learner/test_dist.py",  # 179: gloo ranks, kill -9 of one
    "ingest/test_restart.py",  # 179: kill -9 of the worker
    "serving/",  # 110: one vLLM node behind the gateway for the package
    "learner/test_fastpath.py",  # 126 cold, 28 warm: one torch.compile
)


def _unit(item) -> str:
    """The file of a test, or its package where one of its fixtures is package-scoped."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for d in defs:
            if d.scope == "package":
                return d.baseid or "."
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        for i, name in enumerate(LONGEST_FIRST):
            if path.endswith(name) or (name.endswith("/") and f"/{name}" in path):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
