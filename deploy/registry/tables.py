"""The registry's tables (SQLAlchemy ORM) and its engine; the schema the Alembic migrations manage.

Statuses of a version: candidate | rejected | stable (the served one) | retired (was stable before) | rolled_back.
"""

from __future__ import annotations

import hashlib
import json

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.db import make_engine  # noqa: F401 (re-exported: the registry's engine)

STATUSES = ("candidate", "canary", "rejected", "stable", "retired", "rolled_back")


class Base(DeclarativeBase):
    pass


class Version(Base):
    __tablename__ = "versions"

    version: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    parent: Mapped[int | None] = mapped_column(sa.Integer, sa.ForeignKey("versions.version"), index=True)
    status: Mapped[str] = mapped_column(sa.String(16), index=True)
    status_reason: Mapped[str | None] = mapped_column(sa.Text)
    created_at: Mapped[float] = mapped_column(sa.Float)
    promoted_at: Mapped[float | None] = mapped_column(sa.Float)
    checksum: Mapped[str] = mapped_column(sa.String(64))
    blob_key: Mapped[str | None] = mapped_column(
        sa.String(64), doc="delta from the parent, or the snapshot for version 0; NULL: a rejected version's, pruned"
    )
    blob_kind: Mapped[str] = mapped_column(sa.String(8), doc="delta | snapshot")
    snapshot_key: Mapped[str | None] = mapped_column(sa.String(64), doc="full snapshot of this version, if stored")
    snapshot_base: Mapped[int] = mapped_column(sa.Integer, doc="nearest version up the chain with a snapshot")
    chain_depth: Mapped[int] = mapped_column(sa.Integer, doc="deltas between snapshot_base and this version")
    raw_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    delta_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    snapshot_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)
    ratio: Mapped[float | None] = mapped_column(sa.Float, doc="raw_bytes / delta_bytes")
    changed_fraction: Mapped[float | None] = mapped_column(sa.Float, doc="fraction of elements whose bits changed")
    learner_step: Mapped[int | None] = mapped_column(sa.Integer)
    rollback_seen: Mapped[int | None] = mapped_column(
        sa.Integer,
        doc="audit id of the last rollback the candidate's weights account for (0: none yet); the gate refuses a "
        "candidate that predates a later one. NULL: registered without it (judged by created_at)",
    )
    model_dir: Mapped[str | None] = mapped_column(sa.Text)
    metrics: Mapped[dict] = mapped_column(sa.JSON, default=dict)
    sample_offsets: Mapped[dict] = mapped_column(sa.JSON, default=dict)

    def __repr__(self) -> str:
        return f"Version({self.version}, parent={self.parent}, status={self.status!r}, checksum={self.checksum[:12]}…)"


class GateResult(Base):
    __tablename__ = "gate_results"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("versions.version"), index=True)
    check: Mapped[str] = mapped_column(sa.String(64))
    value: Mapped[float | None] = mapped_column(sa.Float)
    threshold: Mapped[float | None] = mapped_column(sa.Float)
    passed: Mapped[bool] = mapped_column(sa.Boolean)
    detail: Mapped[str | None] = mapped_column(sa.Text)
    at: Mapped[float] = mapped_column(sa.Float)


class AuditEntry(Base):
    """Append-only and chained twice: ``entry_hash`` = sha256 over the previous entry's hash and this entry's fields
    (``audit_hash``; anyone can recompute it), and ``mac`` = HMAC-SHA256 with the audit key, which the database never
    holds, over the previous entry's link, ``seq`` and the fields (``deploy.registry.auditchain``). ``seq``: the entry's
    position in the chain (1, 2, ...); ``mac`` is NULL on entries written without a key (``Registry.verify_audit``)."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    actor: Mapped[str] = mapped_column(sa.String(64))
    action: Mapped[str] = mapped_column(sa.String(32))
    version: Mapped[int | None] = mapped_column(sa.Integer, index=True)
    reason: Mapped[str | None] = mapped_column(sa.Text)
    at: Mapped[float] = mapped_column(sa.Float)
    prev_hash: Mapped[str | None] = mapped_column(sa.String(64))
    entry_hash: Mapped[str | None] = mapped_column(sa.String(64))
    seq: Mapped[int | None] = mapped_column(sa.Integer, unique=True, index=True)
    mac: Mapped[str | None] = mapped_column(sa.String(64))


def audit_hash(prev: str, actor: str, action: str, version: int | None, reason: str | None, at: float) -> str:
    """The chain link of one audit entry (canonical JSON of the previous hash and the entry's fields)."""
    blob = json.dumps([prev, actor, action, version, reason, repr(float(at))], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


ROLES = ("viewer", "operator", "admin")
"""viewer: read; operator: promote, rollback, hold; admin: also manage operators and collect garbage."""


class Operator(Base):
    """A person (or a CI job) allowed to change the registry. Only the sha256 of the token is stored: tokens are
    256-bit random strings handed out once, so a fast hash is enough and a leaked table gives nothing away."""

    __tablename__ = "operators"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    role: Mapped[str] = mapped_column(sa.String(16))
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True, index=True)
    created_at: Mapped[float] = mapped_column(sa.Float)
    created_by: Mapped[str] = mapped_column(sa.String(64))
    disabled: Mapped[bool] = mapped_column(sa.Boolean, default=False)


class FleetNode(Base):
    __tablename__ = "fleet"

    node: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    version: Mapped[int] = mapped_column(sa.Integer)
    checksum: Mapped[str] = mapped_column(sa.String(64))
    updated_at: Mapped[float] = mapped_column(sa.Float)


class Served(Base):
    """When each node first served each version: written once per (version, node) by the agent's first verified swap
    to it (``Registry.update_fleet``); never updated. Append-only, so the time a version first reached users survives
    its node swapping away again (``fleet`` keeps only the latest). ``liverl lineage`` reads it."""

    __tablename__ = "served"

    version: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("versions.version"), primary_key=True)
    node: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    first_at: Mapped[float] = mapped_column(sa.Float, doc="when the node resumed serving with this version's weights")


class Mismatch(Base):
    """Sampler/trainer mismatch of each version, on the live generations it served: per completion token the learner
    trained on, ``|logp_learner - logp_behaviour|`` and the k3 estimate of KL(behaviour || learner),
    ``exp(d) - 1 - d`` with ``d = logp_learner - logp_behaviour``, summed, with the learner's own MoE routing
    (``own_*``) and with the server's routing replayed (``replay_*``, only samples that carried routing). The
    learner adds to the sums (``Registry.add_mismatch``); the means are ``sum / tokens``. The learner's weights at
    the time it trains are not exactly the version's: the figures include the policy's own movement since then,
    the same in both columns, so the difference between them is the routing's."""

    __tablename__ = "mismatch"

    version: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("versions.version"), primary_key=True)
    own_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)
    own_abs: Mapped[float] = mapped_column(sa.Float, default=0.0, doc="sum of |logp difference|, own routing")
    own_kl: Mapped[float] = mapped_column(sa.Float, default=0.0, doc="sum of the k3 KL terms, own routing")
    replay_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)
    replay_abs: Mapped[float] = mapped_column(sa.Float, default=0.0, doc="sum of |logp difference|, replayed")
    replay_kl: Mapped[float] = mapped_column(sa.Float, default=0.0, doc="sum of the k3 KL terms, replayed")
    updated_at: Mapped[float] = mapped_column(sa.Float, default=0.0)

    def means(self) -> dict[str, float | None]:
        """``own_abs``, ``own_kl``, ``replay_abs``, ``replay_kl`` per token (None without tokens), and the counts."""
        o, r = self.own_tokens or 0, self.replay_tokens or 0
        return {
            "own_tokens": o,
            "own_abs": self.own_abs / o if o else None,
            "own_kl": self.own_kl / o if o else None,
            "replay_tokens": r,
            "replay_abs": self.replay_abs / r if r else None,
            "replay_kl": self.replay_kl / r if r else None,
        }


class DeploymentRow(Base):
    """The deployment this registry belongs to (one row, written once by ``liverl up`` or the demo): its id, which
    also claims its Redis prefix (``liverl.stack.deployment``). A standalone process (``liverl serve``, ``ingest``,
    ``learn``, ``gate`` on another machine, with no state dir in common) reads it here and refuses a prefix another
    deployment claims."""

    __tablename__ = "deployment"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    state_dir: Mapped[str] = mapped_column(sa.Text, doc="where `liverl up` made it")
    model: Mapped[str | None] = mapped_column(sa.Text, doc="the model directory of version 0")
    made_at: Mapped[float] = mapped_column(sa.Float)


ROLLOUT_STATES = ("running", "paused", "promoted", "aborted", "ended")
ACTIVE_ROLLOUT_STATES = ("running", "paused")
ROLLOUT_UNITS = ("user", "request")
MAX_LOOKS = 500
"""Looks a rollout keeps (the on-call page's plot); the test's state does not need them."""


class Rollout(Base):
    """A canary rollout: its terms, the gate's evidence and its outcome. At most one is active (running or paused).

    Every write bumps ``revision``; the gate writes its evidence by compare-and-set on it, and promotes only a rollout
    still ``running`` (``Registry.finish_rollout_promote``), so an operator's pause or abort between the gate's read
    and its write wins. ``id`` salts the users' assignment (``core.fleet.bucket``); ids are never reused.
    States: running | paused (operator: evidence is still gathered, no promotion) | promoted | aborted (the version is
    rejected) | ended (an operator promoted or rejected the version directly, or the gate found it no longer canary).
    """

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(sa.Integer, sa.ForeignKey("versions.version"), index=True)
    checksum: Mapped[str] = mapped_column(sa.String(64))
    stable_version: Mapped[int] = mapped_column(sa.Integer, doc="the stable version the canary is compared with")
    share: Mapped[float] = mapped_column(sa.Float, doc="share of users (or requests) sent to the canary")
    nodes: Mapped[list] = mapped_column(sa.JSON, doc="the canary nodes, by name")
    unit: Mapped[str] = mapped_column(sa.String(16), doc="user | request: the unit of randomisation and analysis")
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    started_at: Mapped[float] = mapped_column(sa.Float)
    deadline_at: Mapped[float] = mapped_column(sa.Float)
    settings: Mapped[dict] = mapped_column(sa.JSON, doc="fixed at start (guardrail nulls etc.); never rewritten")
    test_state: Mapped[dict] = mapped_column(sa.JSON, doc="the always-valid tests' state (running maxima)")
    looks: Mapped[list] = mapped_column(sa.JSON, doc=f"the last {MAX_LOOKS} looks, oldest first")
    verdict: Mapped[str | None] = mapped_column(sa.String(32))
    reason: Mapped[str | None] = mapped_column(sa.Text)
    revision: Mapped[int] = mapped_column(sa.Integer, doc="bumped by every write (compare-and-set)")
    ended_at: Mapped[float | None] = mapped_column(sa.Float)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_ROLLOUT_STATES

    def __repr__(self) -> str:
        return (
            f"Rollout({self.id}, v{self.version} vs v{self.stable_version}, {self.state}, share={self.share}, "
            f"nodes={self.nodes}, revision={self.revision})"
        )


class UserKey(Base):
    """One user's data key (``core.shred``): 32 random bytes wrapped (AES-GCM) under the deployment's key-encryption
    key, which the database never holds. Everything liverl keeps of the user's text is sealed under it; deleting the
    row (``UserKeys.destroy``) makes all of it unreadable."""

    __tablename__ = "user_keys"

    unit: Mapped[str] = mapped_column(sa.Text, primary_key=True, doc="core.fleet.unit_id of the user's key")
    wrapped: Mapped[bytes] = mapped_column(sa.LargeBinary, doc="nonce + AES-GCM(key-encryption key, data key)")
    created_at: Mapped[float] = mapped_column(sa.Float)


class Erasure(Base):
    """A request to forget a user (one unit) and how it ended: written by the operators' ``liverl forget``."""

    __tablename__ = "erasures"

    id: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    unit: Mapped[str] = mapped_column(sa.Text, index=True)
    requested_by: Mapped[str] = mapped_column(sa.Text)
    reason: Mapped[str] = mapped_column(sa.Text)
    source: Mapped[str] = mapped_column(sa.Text)
    requested_at: Mapped[float] = mapped_column(sa.Float)
    state: Mapped[str] = mapped_column(sa.Text)
    finished_at: Mapped[float | None] = mapped_column(sa.Float)
    report: Mapped[str | None] = mapped_column(sa.Text)


class Counter(Base):
    """One row per counter; the 'version' row is also the registry-wide lock for status changes."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    value: Mapped[int] = mapped_column(sa.BigInteger)
