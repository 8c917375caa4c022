"""The registry database's engine: SQLite (the default, one WAL file) or PostgreSQL, made one way by every process
that opens it (the registry, and ``core.shred``'s users' keys)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event

CONNECT_TIMEOUT_S = 5
"""How long a connection to a PostgreSQL registry may take (unless the URL sets ``connect_timeout``): a database
host cut off would otherwise hold each caller for the kernel's whole SYN retry, about two minutes."""


TCP_USER_TIMEOUT_MS = 15_000
"""How long a PostgreSQL connection's unacknowledged data (a query, a keepalive probe) may wait before the kernel
drops the connection (libpq's ``tcp_user_timeout``; keepalives probe an idle one every 5 s). A link cut while a query
is out would otherwise hold its caller until the kernel gives up retransmitting, many minutes, or until a
retransmission after the heal gets through: an ingest worker stalled so on its keys' query lost its group membership
and wrote on as a partition's old owner."""
TCP_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 5, "keepalives_count": 3}


def make_engine(url: str) -> sa.Engine:
    """An engine for the registry; on SQLite a WAL database whose writers begin with ``BEGIN IMMEDIATE`` when
    the connection has the ``sqlite_begin="IMMEDIATE"`` execution option."""
    if not url.startswith("sqlite"):
        parsed = sa.engine.make_url(url)
        connect_args: dict[str, int] = {}
        if parsed.get_backend_name() == "postgresql":
            defaults = {"connect_timeout": CONNECT_TIMEOUT_S, "tcp_user_timeout": TCP_USER_TIMEOUT_MS, **TCP_KEEPALIVE}
            connect_args = {k: v for k, v in defaults.items() if k not in parsed.query}
        return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    db = sa.engine.make_url(url).database
    if db and db != ":memory:":
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # WAL: readers never block the writer; one writer at a time
        dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA secure_delete=ON")  # a deleted row's bytes are zeroed (a destroyed user key, core.shred)
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # writers take the write lock up front (see RegistryDB.tx): no busy-upgrade failures
        conn.exec_driver_sql("BEGIN " + conn.get_execution_options().get("sqlite_begin", "DEFERRED"))

    return engine
