"""The version registry: every policy version, how to rebuild its weights, what the gate said, who did what.

Blobs (snapshots and deltas) live in a content-addressed ``BlobStore``; the database (SQLAlchemy 2.x, SQLite or
PostgreSQL) holds the metadata. ``Registry`` is the one object callers hold; each of its jobs is a part over one
shared database, and each part's module says how it works:

- ``deploy.registry.regdb``: the engine, sessions, the write lock, migrations on opening, the audit chain's append.
- ``deploy.registry.versions``: the base and the candidates, status changes (promote, reject, rollback), gate results,
  queries of versions; ``Fleet``: which node serves which version.
- ``deploy.registry.rollouts``: the canaries' rollouts, begun and ended together with their version's status.
- ``deploy.registry.operators``: operators, their tokens and roles; reading and verifying the audit log.
- ``deploy.registry.weights``: rebuilding any version's weights from snapshot and deltas; the delta between two
  versions.
- ``deploy.registry.blobgc``: garbage collection of unreferenced blobs, and pruning rejected versions' deltas.

The tables and the engine are in ``deploy.registry.tables``; statuses are listed there.
"""

from __future__ import annotations

from core.config import LiverlConfig
from core.services import setup_redis
from deploy.registry.auditchain import AuditHead, load_audit_key
from deploy.registry.blobgc import Collector, GcResult  # noqa: F401
from deploy.registry.blobstore import BlobStore, open_blob_store
from deploy.registry.mismatch import Mismatches
from deploy.registry.operators import Operators, hash_token  # noqa: F401
from deploy.registry.regdb import AuthError, RegistryConflict, RegistryDB, RegistryError  # noqa: F401
from deploy.registry.rollouts import Rollouts
from deploy.registry.tables import (  # noqa: F401
    ACTIVE_ROLLOUT_STATES,
    MAX_LOOKS,
    ROLES,
    ROLLOUT_STATES,
    ROLLOUT_UNITS,
    STATUSES,
    AuditEntry,
    Base,
    Counter,
    FleetNode,
    GateResult,
    Operator,
    Rollout,
    Served,
    Version,
    audit_hash,
    make_engine,
)
from deploy.registry.versions import Fleet, Versions
from deploy.registry.weights import Weights


class _Part:
    """An attribute of the registry that is one of its parts': ``registry.promote`` is ``registry._versions.promote``
    (the part's own bound method, with its signature and docstring)."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, registry: Registry | None, owner: type | None = None):
        if registry is None:
            return self
        return getattr(getattr(registry, self.part), self.name)


class Registry:
    """Versions, rollouts, gate results, audit log and fleet state over SQLAlchemy, with blobs in ``blobs``.

    ``snapshot_every``: a full snapshot every this many deltas along a parent chain (``deploy.registry.versions``).
    ``audit_key``: the key of the audit log's HMAC chain (``deploy.registry.auditchain``; None: unkeyed, see
    ``deploy.registry.regdb``).
    ``audit_head``: where the chain's head is anchored after every append (Redis; needs ``audit_key``).
    """

    def __init__(
        self,
        url: str,
        blobs: BlobStore,
        snapshot_every: int = 10,
        audit_key: bytes | None = None,
        audit_head: AuditHead | None = None,
    ):
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.blobs, self.snapshot_every = blobs, snapshot_every
        self.db = RegistryDB(url, audit_key=audit_key, audit_head=audit_head)
        self._weights = Weights(self.db, blobs)
        self._versions = Versions(self.db, blobs, self._weights, snapshot_every)
        self._fleet = Fleet(self.db)
        self._mismatch = Mismatches(self.db)
        self._rollouts = Rollouts(self.db)
        self._operators = Operators(self.db)
        self._collector = Collector(self.db, blobs)

    # the database: deploy.registry.regdb
    url = _Part("db")
    engine = _Part("db")
    audit_key = _Part("db")
    audit_head = _Part("db")
    anchor_failures = _Part("db")
    close = _Part("db")

    # versions: deploy.registry.versions
    init_base = _Part("_versions")
    add_candidate = _Part("_versions")
    record_gate = _Part("_versions")
    set_status = _Part("_versions")
    promote = _Part("_versions")
    rollback = _Part("_versions")
    get = _Part("_versions")
    list = _Part("_versions")
    candidates = _Part("_versions")
    stable = _Part("_versions")
    gate_results = _Part("_versions")
    last_rollback = _Part("_versions")

    # the fleet: deploy.registry.versions
    update_fleet = _Part("_fleet")
    fleet = _Part("_fleet")
    served = _Part("_fleet")

    # sampler/trainer mismatch per version: deploy.registry.mismatch
    add_mismatch = _Part("_mismatch")
    mismatch = _Part("_mismatch")

    # rollouts: deploy.registry.rollouts
    begin_rollout = _Part("_rollouts")
    active_rollout = _Part("_rollouts")
    rollout = _Part("_rollouts")
    rollouts = _Part("_rollouts")
    save_rollout_evidence = _Part("_rollouts")
    set_rollout_state = _Part("_rollouts")
    finish_rollout_promote = _Part("_rollouts")
    finish_rollout_abort = _Part("_rollouts")
    end_rollout = _Part("_rollouts")
    reap_orphan_canaries = _Part("_rollouts")

    # operators and the audit log: deploy.registry.operators
    add_operator = _Part("_operators")
    disable_operator = _Part("_operators")
    operators = _Part("_operators")
    authenticate = _Part("_operators")
    verify_audit = _Part("_operators")
    seal_audit = _Part("_operators")
    held = _Part("_operators")
    log_action = _Part("_operators")
    audit_seq = _Part("_operators")
    audit = _Part("_operators")

    # weights: deploy.registry.weights
    delta_for = _Part("_weights")
    path = _Part("_weights")
    deltas_between = _Part("_weights")
    materialize = _Part("_weights")
    compose = _Part("_weights")

    # housekeeping: deploy.registry.blobgc
    referenced_blobs = _Part("_collector")
    prunable_rejected = _Part("_collector")
    gc = _Part("_collector")


def open_registry(cfg: LiverlConfig) -> Registry:
    """The registry the config names (``cfg.registry_url``), with its blobs at ``cfg.blob_location``, its audit key
    (``security.audit_key``, else ``<state_dir>/keys/audit.key`` if it exists) and, with a key, the audit head anchored
    in the configured Redis (``<prefix>:audit:head``)."""
    key = load_audit_key(cfg)
    head = None
    if key is not None:
        head = AuditHead(lambda: setup_redis(cfg), cfg.topics.prefix)
    return Registry(cfg.registry_url, open_blob_store(cfg.blob_location), audit_key=key, audit_head=head)
