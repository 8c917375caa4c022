"""Erasure requests ("forget this user"): their rows in the registry's database, read and written without torch.

A row is written when an operator runs ``liverl forget USER`` (source ``cli``) or the product posts
``POST /v1/erasures`` to ingest (source ``api``), and is then driven to ``done`` by ``liverl.ops.forget``, one step
at a time, each step's result saved with its state, so that a run killed at any point is finished by the next one
(``liverl forget --resume``, any later ``liverl forget``, or the gate's loop). The table (``erasures``) is created by
the registry's migrations; this module only reads and writes its rows.

| column         | what                                                                                    |
|----------------|-----------------------------------------------------------------------------------------|
| ``id``         | ``er-`` and 16 hex digits                                                               |
| ``unit``       | the user's unit (``core.fleet.unit_id`` of the user key): the user key itself is never stored |
| ``requested_by`` | the operator's name (cli) or ``product`` (api)                                        |
| ``reason``     | why, as given                                                                           |
| ``source``     | ``cli`` or ``api``                                                                      |
| ``requested_at`` / ``finished_at`` | Unix times                                                          |
| ``state``      | ``STATES``, in order                                                                    |
| ``report``     | JSON: what each step found and did (``liverl.ops.forget``)                              |
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

import sqlalchemy as sa

STATES = ("pending", "key_destroyed", "sums_deleted", "lineage_read", "offered", "done")
"""An erasure's states, in order: each names the last step finished (``liverl.ops.forget`` runs the next)."""

SOURCES = ("cli", "api")

ID_PREFIX = "er-"

_META = sa.MetaData()
TABLE = sa.Table(
    "erasures",
    _META,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("unit", sa.Text),
    sa.Column("requested_by", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("source", sa.Text),
    sa.Column("requested_at", sa.Float),
    sa.Column("state", sa.Text),
    sa.Column("finished_at", sa.Float),
    sa.Column("report", sa.Text),
)
"""The columns this module uses (the migration owns the table and its indexes)."""


def new_id() -> str:
    return ID_PREFIX + secrets.token_hex(8)


def valid_id(text: str) -> bool:
    """``er-`` and 16 lowercase hex digits."""
    tail = text.removeprefix(ID_PREFIX)
    return text.startswith(ID_PREFIX) and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail)


@dataclass
class Erasure:
    id: str
    unit: str
    requested_by: str
    reason: str
    source: str
    requested_at: float
    state: str
    finished_at: float | None = None
    report: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "unit": self.unit,
            "requested_by": self.requested_by,
            "reason": self.reason,
            "source": self.source,
            "requested_at": self.requested_at,
            "state": self.state,
            "finished_at": self.finished_at,
            "report": self.report,
        }


def _row(m) -> Erasure:
    return Erasure(
        id=m["id"],
        unit=m["unit"],
        requested_by=m["requested_by"],
        reason=m["reason"],
        source=m["source"],
        requested_at=float(m["requested_at"]),
        state=m["state"],
        finished_at=None if m["finished_at"] is None else float(m["finished_at"]),
        report=json.loads(m["report"]) if m["report"] else {},
    )


def insert(conn: sa.Connection, unit: str, requested_by: str, reason: str, source: str) -> Erasure:
    """A new pending erasure, inserted on ``conn`` (inside the caller's transaction)."""
    if source not in SOURCES:
        raise ValueError(f"an erasure's source is one of {SOURCES}, not {source!r}")
    e = Erasure(new_id(), unit, requested_by, reason, source, time.time(), "pending")
    conn.execute(
        sa.insert(TABLE).values(
            id=e.id,
            unit=e.unit,
            requested_by=e.requested_by,
            reason=e.reason,
            source=e.source,
            requested_at=e.requested_at,
            state=e.state,
            finished_at=None,
            report="{}",
        )
    )
    return e


def get(conn: sa.Connection, erasure_id: str) -> Erasure | None:
    m = conn.execute(sa.select(TABLE).where(TABLE.c.id == erasure_id)).mappings().first()
    return None if m is None else _row(m)


def of_unit(conn: sa.Connection, unit: str) -> list[Erasure]:
    """The unit's erasures, oldest first."""
    q = sa.select(TABLE).where(TABLE.c.unit == unit).order_by(TABLE.c.requested_at)
    return [_row(m) for m in conn.execute(q).mappings()]


def unfinished(conn: sa.Connection, limit: int = 100) -> list[Erasure]:
    """Erasures not ``done``, oldest first."""
    q = sa.select(TABLE).where(TABLE.c.state != "done").order_by(TABLE.c.requested_at).limit(limit)
    return [_row(m) for m in conn.execute(q).mappings()]


def advance(conn: sa.Connection, e: Erasure, state: str, report: dict) -> bool:
    """Move ``e`` from its state to ``state`` with ``report``, compare-and-set: False (nothing written) when another
    runner moved it first. Updates ``e`` on success."""
    if STATES.index(state) <= STATES.index(e.state):
        raise ValueError(f"erasure {e.id}: {e.state} -> {state} goes backwards")
    finished = time.time() if state == "done" else None
    res = conn.execute(
        sa.update(TABLE)
        .where(TABLE.c.id == e.id, TABLE.c.state == e.state)
        .values(state=state, report=json.dumps(report, sort_keys=True), finished_at=finished)
    )
    if res.rowcount != 1:
        return False
    e.state, e.report, e.finished_at = state, report, finished
    return True
