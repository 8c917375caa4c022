"""The version registry: every policy version, how to rebuild its weights, what the gate said, who did what.

Storage plan (as Fireworks does for RL checkpoints): version 0 is a full snapshot; every other version stores a
lossless delta from its parent, and every ``snapshot_every``-th version along a parent chain also stores a
full snapshot, so rebuilding any version costs one snapshot decode plus at most ``snapshot_every - 1`` deltas.
Blobs live in a content-addressed ``BlobStore``; the database (SQLAlchemy 2.x, SQLite or PostgreSQL) holds the
metadata. Heavy work (encoding, blob writes) happens outside transactions; each transaction is short.

Concurrency: several processes (learner, gate, CLI) share the registry. Version numbers come from a counter
row locked for update (PostgreSQL ``SELECT … FOR UPDATE``; SQLite: every write transaction is ``BEGIN IMMEDIATE``
on a WAL database with a busy timeout), so concurrent writers never get the same number; a crash between
allocation and insert leaves a gap, as a sequence would. Status changes take the same lock, so two
concurrent promotions cannot leave two stable versions.

Schema: Alembic migrations in ``deploy.registry.migrations``; opening a registry upgrades its database to head (under a
lock, so several processes may open one database at once) and stamps a database made before migrations existed.

Garbage collection (``gc``): a blob no version row references is deleted once it is older than a grace period
(default one hour). Writers store blobs *before* committing the row that references them, so a young
unreferenced blob may be a version being added right now; age is the store's last-write time, which a re-put
of the same content refreshes. Deltas and snapshots name their version in their bytes and version numbers
are never reused, so a new version's blobs are always new content. The one remaining window: re-putting the
exact bytes of an old orphan (e.g. ``init_base`` after a crash) between a collector's age check and its delete.

Rejected candidates (``gc(prune_rejected_s=...)``): a rejected version whose whole subtree of descendants is
rejected too, and older than the given age, has its blobs unreferenced (``blob_key``/``snapshot_key`` set to
NULL, the row, its gate results and its audit entries kept) and then collected as above. A rejected version
with a descendant that is not rejected keeps its delta: the learner trains on, so later versions are deltas on top
of it and rebuilding them walks through it.

Rollouts (canaries): a version becomes ``canary`` only together with its ``Rollout`` row (``begin_rollout``, one
transaction), and leaves it only by ending that rollout (``finish_rollout_promote`` / ``finish_rollout_abort``, or an
operator's direct ``promote``/``set_status``, which end it as ``ended``). Every rollout write bumps its ``revision``:
the gate saves its evidence by compare-and-set on it (``save_rollout_evidence``) and promotes only a rollout that is
still ``running``, so an operator's ``pause`` or ``abort`` between the gate's read and its write is never overwritten.
``reap_orphan_canaries`` rejects a ``canary`` version no active rollout runs (a registry from before rollouts were
kept here, or a row edited by hand).

Audit log: every entry is chained by plain hash and, with an audit key (``security.audit_key``, never stored in the
database), by HMAC; the chain's head is anchored in Redis (``deploy.registry.auditchain`` says exactly what that detects).
Without a key a registry whose log is not keyed yet writes unkeyed entries (and says so in the log once); a registry
whose log is keyed refuses writes from a process without the key.

The tables and the engine are in ``deploy.registry.tables``; statuses are listed there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis
import sqlalchemy as sa
import torch
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from core.config import LiverlConfig
from core.services import setup_redis
from deploy.registry.auditchain import AuditCheck, AuditHead, audit_mac, check_chain, load_audit_key
from deploy.registry.blobstore import BlobError, BlobInfo, BlobStore, open_blob_store
from deploy.registry.delta import apply_delta, checksum, encode_delta, plan_delta, read_header
from deploy.registry.migrations import upgrade_connection
from deploy.registry.snapshot import decode_snapshot, encode_snapshot
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

log = logging.getLogger("liverl.registry")


class RegistryError(ValueError):
    """A registry operation that cannot be done as asked (unknown version, wrong status, ...)."""


class AuthError(RegistryError):
    """No operator with that token, a disabled one, or a role that may not do what was asked."""


class RegistryConflict(RegistryError):
    """The registry changed under a compare-and-set (another gate or an operator got there first)."""


@dataclass
class GcResult:
    """What a garbage collection found. ``removed``: deleted (or, on a dry run, would be)."""

    dry_run: bool
    grace_s: float
    removed: list[BlobInfo] = field(default_factory=list)
    recent: list[BlobInfo] = field(default_factory=list)  # unreferenced but younger than the grace period: kept
    referenced: int = 0  # blobs the registry references (kept)
    missing: list[str] = field(default_factory=list)  # referenced by a row but not in the store (a problem)
    pruned: list[int] = field(default_factory=list)  # rejected versions whose blobs were (or would be) unreferenced

    @property
    def removed_bytes(self) -> int:
        return sum(b.size for b in self.removed)


class Registry:
    """Versions, rollouts, gate results, audit log and fleet state over SQLAlchemy, with blobs in ``blobs``.

    ``audit_key``: the key of the audit log's HMAC chain (``deploy.registry.auditchain``; None: unkeyed, see the module doc).
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
        if audit_head is not None and audit_key is None:
            raise ValueError("an audit head anchor needs the audit key (security.audit_key) it is tagged with")
        self.url, self.blobs, self.snapshot_every = url, blobs, snapshot_every
        self.audit_key, self.audit_head = audit_key, audit_head
        self.anchor_failures = 0  # appends whose head could not be anchored (Redis down): verify reports a lag
        self._warned_unkeyed = False
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)  # reads
        writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        self._write_sessions = sessionmaker(writer, expire_on_commit=False)
        with writer.begin() as conn:  # one locked transaction: migrate (or stamp) and seed the counter
            upgrade_connection(conn)
            if conn.execute(select(Counter.value).where(Counter.name == "version")).first() is None:
                conn.execute(sa.insert(Counter).values(name="version", value=1))  # 0 is the base's

    def close(self) -> None:
        self.engine.dispose()
        if self.audit_head is not None:
            self.audit_head.close()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """A write transaction (SQLite: BEGIN IMMEDIATE, so it waits for the lock instead of failing later). Once it
        has committed, the audit head it appended (if any) is anchored."""
        with self._write_sessions() as s:
            with s.begin():
                yield s
            head = s.info.pop("audit_head", None)
        if head is not None:
            self._anchor(*head)

    def _anchor(self, seq: int, mac: str) -> None:
        if self.audit_head is None:
            return
        try:
            self.audit_head.advance(self.audit_key, seq, mac)
        except redis.RedisError as e:  # the entry is committed; the anchor lags until the next append, and says so
            self.anchor_failures += 1
            log.warning(
                "audit entry %d committed but its head not anchored in Redis (%s): `liverl history --verify` "
                "reports the anchor lagging until the next audited change",
                seq,
                e,
            )

    @staticmethod
    def _lock(s: Session) -> Counter:
        return s.execute(select(Counter).where(Counter.name == "version").with_for_update()).scalar_one()

    def _audit(self, s: Session, actor: str, action: str, version: int | None, reason: str | None) -> None:
        """Append one audit entry, chained to the previous one (under the registry lock, so the chain is linear):
        by plain hash, and by HMAC with the audit key (``deploy.registry.auditchain``)."""
        self._lock(s)
        last = s.execute(
            select(AuditEntry.seq, AuditEntry.mac, AuditEntry.entry_hash).order_by(AuditEntry.id.desc()).limit(1)
        ).first()
        if last is None:
            seq, prev, link = 1, "", ""
        else:
            seq = (
                last.seq + 1
                if last.seq is not None
                else s.execute(select(func.count()).select_from(AuditEntry)).scalar_one() + 1
            )
            prev, link = last.entry_hash or "", last.mac or last.entry_hash or ""
        at, mac = time.time(), None
        if self.audit_key is not None:
            mac = audit_mac(self.audit_key, link, seq, actor, action, version, reason, at)
            s.info["audit_head"] = (seq, mac)  # anchored once the transaction commits (``_tx``)
        elif last is not None and last.mac is not None:
            raise RegistryError(
                "the registry's audit log is keyed and this process has no audit key, so it may not "
                "change the registry: set security.audit_key to the key file its other writers use "
                "(`liverl up` makes <state_dir>/keys/audit.key)"
            )
        elif not self._warned_unkeyed:
            self._warned_unkeyed = True
            log.warning(
                "the audit log is not keyed (no security.audit_key): `liverl history --verify` cannot detect an "
                "entry rewritten with the chain recomputed, or a cut tail"
            )
        s.add(
            AuditEntry(
                actor=actor,
                action=action,
                version=version,
                reason=reason,
                at=at,
                prev_hash=prev,
                entry_hash=audit_hash(prev, actor, action, version, reason, at),
                seq=seq,
                mac=mac,
            )
        )

    @staticmethod
    def _row(s: Session, version: int) -> Version:
        row = s.get(Version, version)
        if row is None:
            raise RegistryError(f"unknown version {version}; `liverl versions` lists the known ones")
        return row

    # ------------------------------------------------------------------------------------------ writing

    def init_base(self, state_dict: Mapping[str, torch.Tensor], model_dir: str) -> Version:
        """Register the base policy as version 0 (stable, full snapshot). Idempotent for the same weights."""
        blob = encode_snapshot(state_dict, version=0)
        csum = checksum(state_dict)
        with self._tx() as s:
            existing = s.get(Version, 0)
            if existing is not None:
                if existing.checksum != csum:
                    raise RegistryError(
                        f"the registry at {self.url} already has a different base (checksum "
                        f"{existing.checksum[:12]}…, not {csum[:12]}…); use a fresh registry"
                    )
                return existing
        key = self.blobs.put(blob)
        raw = sum(t.numel() * t.element_size() for t in state_dict.values())
        row = Version(
            version=0,
            parent=None,
            status="stable",
            created_at=time.time(),
            promoted_at=time.time(),
            checksum=csum,
            blob_key=key,
            blob_kind="snapshot",
            snapshot_key=key,
            snapshot_base=0,
            chain_depth=0,
            raw_bytes=raw,
            snapshot_bytes=len(blob),
            model_dir=str(model_dir),
            metrics={},
            sample_offsets={},
        )
        with self._tx() as s:
            if s.get(Version, 0) is not None:  # another process won the race
                return self._row(s, 0)
            s.add(row)
            self._audit(s, "system", "init", 0, f"base policy from {model_dir}")
        return row

    def _allocate(self) -> int:
        with self._tx() as s:
            counter = self._lock(s)
            version, counter.value = counter.value, counter.value + 1
        return version

    def add_candidate(
        self,
        state_dict: Mapping[str, torch.Tensor],
        parent: int,
        metrics: dict | None = None,
        sample_offsets: dict | None = None,
        learner_step: int | None = None,
        parent_state: Mapping[str, torch.Tensor] | None = None,
    ) -> Version:
        """Store a new candidate as a delta from ``parent`` (plus a snapshot every ``snapshot_every`` deltas).

        ``parent_state``: the parent's weights if the caller has them (verified by checksum), saving a rebuild.
        ``sample_offsets`` keys become strings (JSON).
        """
        prow = self.get(parent)
        if parent_state is None:
            parent_state = self.materialize(parent)
        elif checksum(parent_state) != prow.checksum:
            raise RegistryError(f"parent_state is not version {parent}'s weights (checksum mismatch)")
        version = self._allocate()
        delta = encode_delta(parent_state, state_dict, parent, version)
        header = read_header(delta)
        delta_key = self.blobs.put(delta)
        depth = prow.chain_depth + 1
        snap_key, snap_bytes, snap_base = None, None, prow.snapshot_base
        if depth >= self.snapshot_every:
            snap = encode_snapshot(state_dict, version=version)
            snap_key, snap_bytes, snap_base, depth = self.blobs.put(snap), len(snap), version, 0
        row = Version(
            version=version,
            parent=parent,
            status="candidate",
            created_at=time.time(),
            checksum=header.target_checksum,
            blob_key=delta_key,
            blob_kind="delta",
            snapshot_key=snap_key,
            snapshot_base=snap_base,
            chain_depth=depth,
            raw_bytes=header.raw_bytes,
            delta_bytes=len(delta),
            snapshot_bytes=snap_bytes,
            ratio=header.raw_bytes / len(delta),
            changed_fraction=header.changed_fraction,
            learner_step=learner_step,
            metrics=dict(metrics or {}),
            sample_offsets={str(k): v for k, v in (sample_offsets or {}).items()},
        )
        with self._tx() as s:
            s.add(row)
            self._audit(
                s,
                "learner",
                "candidate",
                version,
                f"from {parent}, {header.changed_fraction:.2%} changed, delta {len(delta)} bytes",
            )
        return row

    def record_gate(
        self,
        version: int,
        check: str,
        value: float | None,
        threshold: float | None,
        passed: bool,
        detail: str | None = None,
    ) -> None:
        with self._tx() as s:
            self._row(s, version)
            s.add(
                GateResult(
                    version=version,
                    check=check,
                    value=value,
                    threshold=threshold,
                    passed=bool(passed),
                    detail=detail,
                    at=time.time(),
                )
            )

    def set_status(
        self, version: int, status: str, actor: str, reason: str | None = None, expect: str | None = None
    ) -> Version:
        """Low-level status change with an audit entry (use ``promote``/``rollback`` for stable changes).

        ``expect``: compare-and-set, raising ``RegistryConflict`` unless the row still has that status (the gate
        rejects only what is still a candidate). The stable version's status never changes here.
        """
        if status not in STATUSES:
            raise RegistryError(f"unknown status {status!r}; one of {STATUSES}")
        if status == "canary":
            raise RegistryError("a version becomes canary only together with its rollout: Registry.begin_rollout")
        with self._tx() as s:
            self._lock(s)
            row = self._row(s, version)
            if expect is not None and row.status != expect:
                raise RegistryConflict(f"version {version} is {row.status}, not {expect}: left as it is")
            if row.status == "stable" and status != "stable":
                raise RegistryConflict(
                    f"version {version} is the stable version; use promote or rollback to change that"
                )
            ended = self._end_rollouts_of(s, row, f"{actor} set v{version} {status}") if row.status == "canary" else ""
            row.status, row.status_reason = status, reason
            self._audit(s, actor, status if status == "rejected" else f"set_{status}", version, (reason or "") + ended)
        return row

    def promote(
        self,
        version: int,
        actor: str,
        reason: str | None = None,
        force: bool = False,
        expected_stable: int | None = None,
        from_candidate: bool = False,
    ) -> Version:
        """Make ``version`` the stable one; the previous stable becomes retired.

        A version the gate rejected needs ``force``. ``expected_stable`` and
        ``from_candidate`` make it a compare-and-set (the gate's promotion): ``RegistryConflict`` unless the stable
        version is still ``expected_stable`` and ``version`` is still a candidate, so an operator's promote or
        rollback during an evaluation is never overridden. A canary is promoted by the gate only through its rollout
        (``finish_rollout_promote``); an operator promoting it directly ends its rollout (state ``ended``).
        """
        with self._tx() as s:
            self._lock(s)
            row = self._row(s, version)
            if row.status == "stable":
                raise RegistryError(f"version {version} is already stable")
            old = s.execute(select(Version).where(Version.status == "stable")).scalars().all()
            if expected_stable is not None and [o.version for o in old] != [expected_stable]:
                raise RegistryConflict(
                    f"the stable version changed to {','.join(str(o.version) for o in old) or 'none'} "
                    f"(expected {expected_stable}); version {version} left as it is"
                )
            if from_candidate and row.status != "candidate":
                how = " (the gate promotes a canary with finish_rollout_promote)" if row.status == "canary" else ""
                raise RegistryConflict(f"version {version} is {row.status}, no longer a candidate{how}")
            if row.status == "rejected" and not force:
                raise RegistryError(
                    f"version {version} was rejected ({row.status_reason or 'no reason recorded'}); "
                    "pass --force to promote it anyway"
                )
            ended = self._end_rollouts_of(s, row, f"promoted by {actor}") if row.status == "canary" else ""
            for o in old:
                o.status, o.status_reason = "retired", f"replaced by {version}"
            row.status, row.status_reason, row.promoted_at = "stable", reason, time.time()
            prev = ",".join(str(o.version) for o in old) or "none"
            self._audit(s, actor, "promote", version, f"{reason or ''} (was {prev}){ended}".strip())
        return row

    def rollback(self, actor: str, reason: str | None = None, to: int | None = None) -> Version:
        """Mark the current stable rolled_back and make ``to`` (default: the previous stable) stable again."""
        with self._tx() as s:
            self._lock(s)
            current = s.execute(select(Version).where(Version.status == "stable")).scalars().first()
            if current is None:
                raise RegistryError("there is no stable version to roll back from")
            if to is None:
                target = (
                    s.execute(
                        select(Version)
                        .where(Version.status == "retired", Version.promoted_at.is_not(None))
                        .order_by(Version.promoted_at.desc())
                        .limit(1)
                    )
                    .scalars()
                    .first()
                )
                if target is None:
                    raise RegistryError(
                        f"no earlier stable version to roll back to from {current.version}; pass --to VERSION"
                    )
            else:
                target = self._row(s, to)
                if target.version == current.version:
                    raise RegistryError(f"version {to} is already the stable version")
                if target.status not in ("retired", "rolled_back"):
                    raise RegistryError(f"version {to} is {target.status}, it was never stable; use promote instead")
            current.status, current.status_reason = "rolled_back", reason
            target.status, target.status_reason, target.promoted_at = "stable", reason, time.time()
            self._audit(s, actor, "rollback", target.version, f"{reason or ''} (from {current.version})".strip())
        return target

    def update_fleet(self, node: str, version: int, checksum_: str, at: float | None = None) -> None:
        """``node`` serves ``version`` since ``at`` (default now): the fleet row, and, the first time this node serves
        this version, its ``served`` row (kept for good: ``liverl lineage``'s first-served time)."""
        at = time.time() if at is None else float(at)
        with self._tx() as s:
            row = s.get(FleetNode, node) or FleetNode(node=node)
            row.version, row.checksum, row.updated_at = version, checksum_, at
            s.add(row)
            if s.get(Served, (version, node)) is None and s.get(Version, version) is not None:
                s.add(Served(version=version, node=node, first_at=at))

    # ------------------------------------------------------------------------------------------ rollouts

    @staticmethod
    def _rollout_row(s: Session, rollout_id: int, lock: bool = True) -> Rollout:
        q = select(Rollout).where(Rollout.id == rollout_id).execution_options(populate_existing=True)
        ro = s.execute(q.with_for_update() if lock else q).scalars().first()
        if ro is None:
            raise RegistryError(f"unknown rollout {rollout_id}")
        return ro

    @staticmethod
    def _active_rows(s: Session, lock: bool = False) -> list[Rollout]:
        q = select(Rollout).where(Rollout.state.in_(ACTIVE_ROLLOUT_STATES)).order_by(Rollout.id)
        return list(s.execute(q.with_for_update() if lock else q).scalars())

    @staticmethod
    def _close(ro: Rollout, state: str, reason: str | None, verdict: str | None = None) -> None:
        ro.state, ro.ended_at, ro.revision = state, time.time(), ro.revision + 1
        if reason is not None:
            ro.reason = reason
        if verdict is not None:
            ro.verdict = verdict

    def _end_rollouts_of(self, s: Session, row: Version, why: str) -> str:
        """End (state ``ended``) the active rollouts of ``row``'s version, inside the caller's transaction; the text
        the caller's audit entry carries about it."""
        ended = [ro for ro in self._active_rows(s, lock=True) if ro.version == row.version]
        for ro in ended:
            self._close(ro, "ended", why)
        return "".join(f"; rollout {ro.id} ended" for ro in ended)

    def begin_rollout(
        self,
        version: int,
        stable_version: int,
        share: float,
        nodes: Sequence[str],
        unit: str,
        deadline_at: float,
        settings: Mapping | None,
        actor: str,
        reason: str,
    ) -> Rollout:
        """Start the canary of ``version`` against ``stable_version``: in one transaction the version goes from
        ``candidate`` to ``canary`` and its ``Rollout`` (state ``running``, revision 1) is inserted. ``settings`` (JSON,
        finite) is written once here: what must stay fixed for the rollout's life (e.g. the guardrails' nulls).

        ``RegistryConflict`` if another rollout is active, ``version`` is not a candidate, or the stable version is not
        ``stable_version`` any more; ``RegistryError`` for bad terms.
        """
        if not (isinstance(share, int | float) and 0.0 < share <= 1.0):
            raise RegistryError(f"a rollout's share is in (0, 1], got {share!r}")
        nodes = list(nodes)
        if not nodes or not all(isinstance(n, str) and n for n in nodes):
            raise RegistryError(f"a rollout needs its canary nodes, by name; got {nodes!r}")
        if unit not in ROLLOUT_UNITS:
            raise RegistryError(f"a rollout's unit is one of {ROLLOUT_UNITS}, got {unit!r}")
        if not math.isfinite(deadline_at):
            raise RegistryError(f"a rollout's deadline_at is a time (seconds since the epoch), got {deadline_at!r}")
        settings = _finite_json(dict(settings or {}), "settings")
        with self._tx() as s:
            self._lock(s)
            row = self._row(s, version)
            if row.status != "candidate":
                raise RegistryConflict(f"version {version} is {row.status}, not a candidate: no rollout begun")
            stable = s.execute(select(Version.version).where(Version.status == "stable")).scalars().all()
            if stable != [stable_version]:
                raise RegistryConflict(
                    f"the stable version is {','.join(map(str, stable)) or 'none'}, not "
                    f"{stable_version}: no rollout of v{version} begun"
                )
            if active := self._active_rows(s, lock=True):
                raise RegistryConflict(
                    f"rollout {active[0].id} (canary v{active[0].version}) is {active[0].state}: "
                    f"one rollout at a time, v{version} not begun"
                )
            ro = Rollout(
                version=version,
                checksum=row.checksum,
                stable_version=stable_version,
                share=float(share),
                nodes=nodes,
                unit=unit,
                state="running",
                started_at=time.time(),
                deadline_at=float(deadline_at),
                settings=settings,
                test_state={},
                looks=[],
                verdict=None,
                reason=reason,
                revision=1,
                ended_at=None,
            )
            s.add(ro)
            row.status, row.status_reason = "canary", reason
            s.flush()  # the rollout's id
            self._audit(
                s,
                actor,
                "canary_start",
                version,
                f"rollout {ro.id}: {share:.0%} of {unit}s on "
                f"{', '.join(nodes)}, against stable v{stable_version}; {reason}",
            )
        return ro

    def active_rollout(self) -> Rollout | None:
        """The rollout in progress (``running`` or ``paused``), or None."""
        with self._sessions() as s:
            rows = self._active_rows(s)
        return rows[-1] if rows else None

    def rollout(self, rollout_id: int) -> Rollout:
        with self._sessions() as s:
            return self._rollout_row(s, rollout_id, lock=False)

    def rollouts(self, limit: int | None = 20) -> list[Rollout]:
        """Rollouts, newest first."""
        q = select(Rollout).order_by(Rollout.id.desc())
        with self._sessions() as s:
            return list(s.execute(q if limit is None else q.limit(limit)).scalars())

    def save_rollout_evidence(
        self,
        rollout_id: int,
        expect_revision: int,
        test_state: Mapping,
        looks: Sequence[Mapping],
        verdict: str | None,
        reason: str | None,
    ) -> Rollout:
        """The gate's evidence after a look, by compare-and-set: written only if the rollout is still at
        ``expect_revision`` and active; ``RegistryConflict`` otherwise (re-read it and look again). Never changes the
        state. ``looks``: the whole list, of which the last ``MAX_LOOKS`` are kept. Returns the rollout as written."""
        test_state = _finite_json(dict(test_state), "test_state")
        looks = _finite_json(list(looks)[-MAX_LOOKS:], "looks")
        with self._tx() as s:
            done = s.execute(
                sa.update(Rollout)
                .where(
                    Rollout.id == rollout_id,
                    Rollout.revision == expect_revision,
                    Rollout.state.in_(ACTIVE_ROLLOUT_STATES),
                )
                .values(
                    test_state=test_state, looks=looks, verdict=verdict, reason=reason, revision=Rollout.revision + 1
                )
                .execution_options(synchronize_session=False)
            )
            ro = self._rollout_row(s, rollout_id, lock=False)
            if done.rowcount != 1:
                raise RegistryConflict(
                    f"rollout {rollout_id} is at revision {ro.revision} ({ro.state}), not "
                    f"{expect_revision}: evidence not saved; re-read the rollout"
                )
        return ro

    def set_rollout_state(self, rollout_id: int, state: str, actor: str, reason: str) -> Rollout:
        """An operator pauses (``paused``: evidence is still gathered and an abort still happens, but no promotion) or
        resumes (``running``) a rollout; audited, and the revision moves, so a gate step that read it before fails
        its compare-and-set."""
        if state not in ACTIVE_ROLLOUT_STATES:
            raise RegistryError(
                f"a rollout is set to one of {ACTIVE_ROLLOUT_STATES}, not {state!r} (ending it: "
                "finish_rollout_promote / finish_rollout_abort)"
            )
        if not reason:
            raise RegistryError("pausing or resuming a canary needs a reason for the audit log")
        with self._tx() as s:
            self._lock(s)
            ro = self._rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state}: it is over")
            if ro.state == state:
                raise RegistryError(f"the canary of v{ro.version} is already {state}")
            ro.state, ro.revision = state, ro.revision + 1
            self._audit(s, actor, "canary_pause" if state == "paused" else "canary_resume", ro.version, reason)
        return ro

    def finish_rollout_promote(
        self, rollout_id: int, expected_stable: int, actor: str, reason: str, expect_revision: int | None = None
    ) -> Rollout:
        """Promote the rollout's canary, in one transaction, only if the rollout is still ``running`` (not paused, not
        over), at ``expect_revision`` when given, its version still ``canary`` and the stable version still
        ``expected_stable``: rollout ``promoted``, the version ``stable``, the old stable ``retired`` (as ``promote``).
        ``RegistryConflict`` otherwise, with nothing changed: a decision taken on a stale read never lands."""
        with self._tx() as s:
            self._lock(s)
            ro = self._rollout_row(s, rollout_id)
            if ro.state != "running":
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state}: not promoted")
            if expect_revision is not None and ro.revision != expect_revision:
                raise RegistryConflict(
                    f"rollout {rollout_id} is at revision {ro.revision}, not {expect_revision}: "
                    "not promoted; re-read it"
                )
            row = self._row(s, ro.version)
            if row.status != "canary":
                raise RegistryConflict(f"version {ro.version} is {row.status}, not canary: not promoted")
            old = s.execute(select(Version).where(Version.status == "stable")).scalars().all()
            if [o.version for o in old] != [expected_stable]:
                raise RegistryConflict(
                    f"the stable version is {','.join(str(o.version) for o in old) or 'none'}, not "
                    f"{expected_stable}: v{ro.version} not promoted"
                )
            for o in old:
                o.status, o.status_reason = "retired", f"replaced by {ro.version}"
            row.status, row.status_reason, row.promoted_at = "stable", reason, time.time()
            self._close(ro, "promoted", reason, verdict="promote")
            self._audit(s, actor, "promote", ro.version, f"{reason} (was {expected_stable}; rollout {rollout_id})")
        return ro

    def finish_rollout_abort(self, rollout_id: int, actor: str, reason: str, verdict: str | None = None) -> Rollout:
        """Abort a rollout that is not over (running or paused), in one transaction: rollout ``aborted`` (with
        ``verdict`` when given, e.g. ``srm``), its version ``rejected`` if it is still ``canary``. Audited.
        ``RegistryConflict`` if the rollout is over already."""
        if not reason:
            raise RegistryError("aborting a canary needs a reason for the audit log")
        with self._tx() as s:
            self._lock(s)
            ro = self._rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state} already")
            row = self._row(s, ro.version)
            if row.status == "canary":
                row.status, row.status_reason = "rejected", reason
            self._close(ro, "aborted", reason, verdict=verdict)
            self._audit(
                s, actor, "canary_abort", ro.version, f"{reason} (rollout {rollout_id}; v{ro.version} {row.status})"
            )
        return ro

    def end_rollout(self, rollout_id: int, actor: str, reason: str) -> Rollout:
        """End a rollout that is not over as ``ended`` (its version is not canary any more, e.g. an operator promoted
        or rejected it directly) without touching the version. ``RegistryConflict`` if it is over already."""
        with self._tx() as s:
            self._lock(s)
            ro = self._rollout_row(s, rollout_id)
            if not ro.active:
                raise RegistryConflict(f"rollout {rollout_id} (v{ro.version}) is {ro.state} already")
            self._close(ro, "ended", reason)
            self._audit(s, actor, "canary_end", ro.version, f"{reason} (rollout {rollout_id})")
        return ro

    def reap_orphan_canaries(self, actor: str = "gate") -> list[int]:
        """Reject every ``canary`` version that no active rollout runs (N18: a gate stopped between its status change
        and its rollout plan under older code, a registry edited by hand), and end every active rollout whose version is
        not ``canary`` any more. Audited; returns the rejected versions. The gate calls it every step: it writes only
        when there is something to reap."""

        def orphans(s: Session, lock: bool) -> tuple[list[Version], list[Rollout]]:
            active = self._active_rows(s, lock=lock)
            canaries = s.execute(select(Version).where(Version.status == "canary")).scalars().all()
            running = {ro.version for ro in active}
            status = (
                {v.version: v.status for v in s.execute(select(Version).where(Version.version.in_(running))).scalars()}
                if running
                else {}
            )
            return (
                [v for v in canaries if v.version not in running],
                [ro for ro in active if status.get(ro.version) != "canary"],
            )

        with self._sessions() as s:
            if not any(orphans(s, lock=False)):
                return []
        with self._tx() as s:
            self._lock(s)
            versions, rollouts = orphans(s, lock=True)
            for v in versions:
                why = (
                    "orphan canary: no rollout in the registry runs it (a gate stopped between starting it and "
                    "recording its rollout, or the row was edited)"
                )
                v.status, v.status_reason = "rejected", why
                self._audit(s, actor, "rejected", v.version, why)
            for ro in rollouts:
                self._close(ro, "ended", f"v{ro.version} is not canary any more")
                self._audit(
                    s, actor, "canary_end", ro.version, f"rollout {ro.id} ended: v{ro.version} is not canary any more"
                )
        return [v.version for v in versions]

    # ------------------------------------------------------------------------------------------ reading

    def get(self, version: int) -> Version:
        with self._sessions() as s:
            return self._row(s, version)

    def list(self, status: str | None = None, limit: int | None = None) -> list[Version]:
        """Versions, newest first."""
        q = select(Version).order_by(Version.version.desc())
        if status is not None:
            q = q.where(Version.status == status)
        if limit is not None:
            q = q.limit(limit)
        with self._sessions() as s:
            return list(s.execute(q).scalars())

    def candidates(self) -> list[Version]:
        """Pending candidates, oldest first (the gate's queue)."""
        return self.list(status="candidate")[::-1]

    def stable(self) -> Version:
        rows = self.list(status="stable")
        if not rows:
            raise RegistryError("the registry has no stable version; register the base policy first")
        return rows[0]

    def gate_results(self, version: int | None = None) -> list[GateResult]:
        q = select(GateResult).order_by(GateResult.id)
        if version is not None:
            q = q.where(GateResult.version == version)
        with self._sessions() as s:
            return list(s.execute(q).scalars())

    def last_rollback(self) -> tuple[int, float]:
        """``(audit id, time)`` of the most recent rollback, or ``(0, 0.0)``: the learner rebases and the gate
        refuses candidates emitted before it, so a rolled-back change does not come back."""
        with self._sessions() as s:
            row = s.execute(
                select(AuditEntry.id, AuditEntry.at)
                .where(AuditEntry.action == "rollback")
                .order_by(AuditEntry.id.desc())
                .limit(1)
            ).first()
        return (int(row[0]), float(row[1])) if row else (0, 0.0)

    # ------------------------------------------------------------------------------------------ identity

    def add_operator(self, name: str, role: str, by: str, reason: str) -> str:
        """Create an operator and return their token (shown once; only its sha256 is stored)."""
        if role not in ROLES:
            raise RegistryError(f"unknown role {role!r}; one of {ROLES}")
        if not name or len(name) > 64:
            raise RegistryError("an operator name is 1 to 64 characters")
        token = "lvr_" + secrets.token_urlsafe(32)
        with self._tx() as s:
            self._lock(s)
            if s.get(Operator, name) is not None:
                raise RegistryError(f"operator {name!r} exists already (disable it first to re-issue a token)")
            s.add(
                Operator(
                    name=name,
                    role=role,
                    token_hash=hash_token(token),
                    created_at=time.time(),
                    created_by=by,
                    disabled=False,
                )
            )
            self._audit(s, by, "add_operator", None, f"{name} as {role}: {reason}")
        return token

    def disable_operator(self, name: str, by: str, reason: str) -> None:
        with self._tx() as s:
            op = s.get(Operator, name)
            if op is None:
                raise RegistryError(f"no operator {name!r}")
            op.disabled = True
            op.token_hash = f"disabled:{op.token_hash}"[:64]
            self._audit(s, by, "disable_operator", None, f"{name}: {reason}")

    def operators(self) -> list[Operator]:
        with self._sessions() as s:
            return list(s.execute(select(Operator).order_by(Operator.name)).scalars())

    def authenticate(self, token: str | None, need: str = "operator") -> Operator:
        """The operator whose token this is, if their role is at least ``need``; ``AuthError`` otherwise."""
        if not token:
            raise AuthError(
                "this command changes the registry and needs an operator token: set LIVERL_TOKEN or "
                "pass --token-file (an admin creates one with `liverl operator add NAME`)"
            )
        with self._sessions() as s:
            op = s.execute(select(Operator).where(Operator.token_hash == hash_token(token.strip()))).scalar()
        if op is None or op.disabled:
            raise AuthError("the operator token is unknown or disabled")
        if ROLES.index(op.role) < ROLES.index(need):
            raise AuthError(f"operator {op.name} is a {op.role}; this needs the {need} role")
        return op

    def verify_audit(self) -> AuditCheck:
        """Walk the audit chain (plain hash for unkeyed entries, HMAC for keyed ones) and compare its end with the
        head anchored in Redis: ``deploy.registry.auditchain.check_chain``; ``.ok``, ``.problem``, ``.bad_id``, ``.warnings``."""
        with self._sessions() as s:
            entries = list(s.execute(select(AuditEntry).order_by(AuditEntry.id)).scalars())
        return check_chain(entries, self.audit_key, self.audit_head)

    def log_action(self, actor: str, action: str, reason: str, version: int | None = None) -> None:
        """Record an operator action that changes no version row (e.g. holding the learner) in the audit log."""
        if not reason:
            raise RegistryError(f"{action} needs a reason for the audit log")
        with self._tx() as s:
            self._audit(s, actor, action, version, reason)

    def audit(self, version: int | None = None, limit: int | None = None) -> list[AuditEntry]:
        """Audit entries, oldest first (the last ``limit`` when given)."""
        q = select(AuditEntry).order_by(AuditEntry.id.desc())
        if version is not None:
            q = q.where(AuditEntry.version == version)
        if limit is not None:
            q = q.limit(limit)
        with self._sessions() as s:
            return list(s.execute(q).scalars())[::-1]

    def fleet(self) -> list[FleetNode]:
        with self._sessions() as s:
            return list(s.execute(select(FleetNode).order_by(FleetNode.node)).scalars())

    def served(self, version: int | None = None) -> list[Served]:
        """When each node first served each version (all versions, or one), earliest first."""
        q = select(Served).order_by(Served.first_at, Served.node)
        if version is not None:
            q = q.where(Served.version == version)
        with self._sessions() as s:
            return list(s.execute(q).scalars())

    # ------------------------------------------------------------------------------------------ weights

    def _delta(self, row: Version) -> bytes:
        if row.blob_key is None:
            raise RegistryError(
                f"version {row.version} was {row.status} and its delta was pruned by gc "
                "(--prune-rejected); it cannot be rebuilt"
            )
        return self.blobs.get(row.blob_key)

    def delta_for(self, version: int) -> bytes:
        """The delta between ``version`` and its parent (applies in either direction)."""
        row = self.get(version)
        if row.blob_kind != "delta":
            raise RegistryError(f"version {version} is the base snapshot and has no delta; use materialize()")
        return self._delta(row)

    def _chain(self, version: int) -> list[Version]:
        """[version, parent, grandparent, ..., 0]."""
        chain = [self.get(version)]
        while chain[-1].parent is not None:
            chain.append(self.get(chain[-1].parent))
        return chain

    def path(self, from_version: int, to_version: int) -> tuple[list[Version], list[Version]]:
        """The lineage walk between two versions: ``(up, down)``. ``up`` are the rows from ``from_version`` up to
        (not including) the common ancestor, whose deltas are applied backwards; ``down`` the rows from below the
        common ancestor down to ``to_version``, applied forwards. Their deltas, in ``up + down`` order, take
        ``from_version``'s weights to ``to_version``'s."""
        up, down = self._chain(from_version), self._chain(to_version)
        common = {r.version for r in up} & {r.version for r in down}
        return [r for r in up if r.version not in common], [r for r in down if r.version not in common][::-1]

    def deltas_between(self, from_version: int, to_version: int) -> list[bytes]:
        """Deltas that take ``from_version``'s weights to ``to_version``'s, in order (up to the common ancestor, then down).

        Apply each with ``apply_delta``/``plan_delta``: they detect the direction themselves.
        """
        up, down = self.path(from_version, to_version)
        return [self._delta(r) for r in up + down]

    def materialize(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of any version: nearest snapshot up the chain, then deltas forward, checksum-verified."""
        path = []
        row = target = self.get(version)
        while row.snapshot_key is None:
            path.append(row)
            row = self.get(row.parent)
        state = decode_snapshot(self.blobs.get(row.snapshot_key))
        state_sum = row.checksum
        for step in reversed(path):
            plan = plan_delta(state, self._delta(step), known_checksum=state_sum)
            if plan.version != step.version or plan.checksum != step.checksum:
                raise RegistryError(
                    f"delta of version {step.version} leads to version {plan.version} "
                    f"(checksum {plan.checksum[:12]}…); the registry row says {step.checksum[:12]}…"
                )
            state.update(plan)
            state_sum = plan.checksum
        final = checksum(state)
        if final != target.checksum:
            raise RegistryError(
                f"version {version} rebuilt to checksum {final[:12]}…, registry says {target.checksum[:12]}…"
            )
        return state

    def compose(self, from_version: int, to_version: int) -> bytes:
        """One delta taking ``from_version``'s weights to ``to_version``'s (either direction along the lineage).

        Rebuilds ``from_version``, walks ``deltas_between`` (each step checked against the registry), verifies
        the result against ``to_version``'s recorded checksum, then encodes a single delta between the ends.
        """
        src, dst = self.get(from_version), self.get(to_version)
        base = self.materialize(from_version)
        up, down = self.path(from_version, to_version)
        # (row whose delta to apply, the version it lands on): up to the common ancestor, then down to the target
        steps = [(r, r.parent) for r in up] + [(r, r.version) for r in down]
        state = base
        for row, expect in steps:
            state, at = apply_delta(state, self._delta(row))
            if at != expect:
                raise RegistryError(f"the delta of version {row.version} led to version {at}, expected {expect}")
        final = checksum(state)
        if final != dst.checksum:
            raise RegistryError(
                f"composing {from_version}->{to_version} gave checksum {final[:12]}…, the registry "
                f"says {dst.checksum[:12]}…"
            )
        blob = encode_delta(base, state, from_version, to_version)
        header = read_header(blob)
        assert header.base_checksum == src.checksum and header.target_checksum == dst.checksum
        return blob

    # ------------------------------------------------------------------------------------------ housekeeping

    def referenced_blobs(self) -> set[str]:
        """Every blob key a version row references (its delta or base snapshot, and its snapshot)."""
        with self._sessions() as s:
            rows = s.execute(select(Version.blob_key, Version.snapshot_key)).all()
        return {k for row in rows for k in row if k is not None}

    def prunable_rejected(self, older_than_s: float) -> list[int]:
        """Rejected versions older than ``older_than_s`` whose every descendant is prunable too (leaves first)."""
        cutoff = time.time() - older_than_s
        with self._sessions() as s:
            rows = s.execute(
                select(Version.version, Version.parent, Version.status, Version.created_at, Version.blob_key)
            ).all()
        children: dict[int, list[int]] = {}
        for r in rows:
            if r.parent is not None:
                children.setdefault(r.parent, []).append(r.version)
        info = {r.version: r for r in rows}
        memo: dict[int, bool] = {}
        for v in sorted(info, reverse=True):  # children have larger numbers than their parents
            r = info[v]
            memo[v] = (
                r.status == "rejected"
                and r.created_at < cutoff
                and v != 0
                and all(memo[c] for c in children.get(v, []))
            )
        return sorted((v for v, ok in memo.items() if ok and info[v].blob_key is not None), reverse=True)

    def gc(
        self,
        dry_run: bool = False,
        grace_s: float = 3600.0,
        actor: str = "admin",
        prune_rejected_s: float | None = None,
    ) -> GcResult:
        """Delete blobs no version references and older than ``grace_s`` seconds (see the module doc).

        ``prune_rejected_s``: first unreference the blobs of rejected versions older than this whose descendants
        are all rejected (``prunable_rejected``), so they are collected in the same pass.

        Order matters for concurrent writers: the store is listed *before* the referenced keys are read, so a
        row committed meanwhile protects its blobs; each candidate's age is read just before deleting it.
        A real collection (not ``dry_run``) that removes something writes an audit entry.
        """
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        pruned = self.prunable_rejected(prune_rejected_s) if prune_rejected_s is not None else []
        if pruned and not dry_run:
            with self._tx() as s:
                for v in pruned:
                    row = s.get(Version, v)
                    if row is None or row.status != "rejected":  # promoted or rejected-then-changed meanwhile
                        continue
                    row.blob_key, row.snapshot_key = None, None
                self._audit(
                    s,
                    actor,
                    "gc",
                    None,
                    f"pruned the deltas of {len(pruned)} rejected versions "
                    f"(no live descendants): {', '.join(map(str, pruned[:20]))}",
                )
        stored = set(self.blobs.list_keys())
        referenced = self.referenced_blobs()
        if dry_run and pruned:
            with self._sessions() as s:
                gone = s.execute(
                    select(Version.blob_key, Version.snapshot_key).where(Version.version.in_(pruned))
                ).all()
            referenced -= {k for row in gone for k in row if k is not None}
        result = GcResult(dry_run=dry_run, grace_s=grace_s, referenced=len(stored & referenced), pruned=pruned)
        result.missing = sorted(k for k in referenced - stored if not self.blobs.exists(k))
        cutoff = time.time() - grace_s
        for key in sorted(stored - referenced):
            try:
                info = self.blobs.stat(key)
            except BlobError:  # deleted meanwhile (another collector)
                continue
            if info.modified_at > cutoff:
                result.recent.append(info)
                continue
            if not dry_run:
                self.blobs.delete(key)
            result.removed.append(info)
        if result.removed and not dry_run:
            with self._tx() as s:
                self._audit(
                    s,
                    actor,
                    "gc",
                    None,
                    f"removed {len(result.removed)} unreferenced blobs ({result.removed_bytes} bytes)",
                )
        return result


def _finite_json(value, what: str):
    """``value`` if it is JSON without NaN or infinities (PostgreSQL's JSON has neither); ValueError otherwise."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"a rollout's {what} must be JSON with finite numbers only (leave out a -inf running maximum, "
            f"it is the default): {e}"
        ) from e
    return value


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_registry(cfg: LiverlConfig) -> Registry:
    """The registry the config names (``cfg.registry_url``), with its blobs at ``cfg.blob_location``, its audit key
    (``security.audit_key``, else ``<state_dir>/keys/audit.key`` if it exists) and, with a key, the audit head anchored
    in the configured Redis (``<prefix>:audit:head``)."""
    key = load_audit_key(cfg)
    head = None
    if key is not None:
        head = AuditHead(lambda: setup_redis(cfg), cfg.topics.prefix)
    return Registry(cfg.registry_url, open_blob_store(cfg.blob_location), audit_key=key, audit_head=head)
