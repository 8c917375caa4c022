"""The registry's versions: the base and its candidates, their status changes, gate results and queries.

Every version but the base (version 0, a full snapshot) stores a lossless delta from its parent, and every
``snapshot_every``-th version along a parent chain also a full snapshot (``deploy.registry.weights`` rebuilds any
version from them). Blobs are stored *before* the row that references them is committed (``deploy.registry.blobgc``
relies on that). A version becomes ``canary`` only with its rollout (``deploy.registry.rollouts``); ``promote`` and
``set_status`` end the rollout of a canary they change. ``Fleet`` records which node serves which version.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Mapping

import torch
from sqlalchemy import select

from deploy.registry.blobstore import BlobStore
from deploy.registry.delta import checksum, encode_delta, read_header
from deploy.registry.regdb import RegistryConflict, RegistryDB, RegistryError, lock, version_row
from deploy.registry.rollouts import end_rollouts_of
from deploy.registry.snapshot import encode_snapshot
from deploy.registry.tables import STATUSES, AuditEntry, FleetNode, GateResult, Served, Version
from deploy.registry.weights import Weights


class Versions:
    """Add, change and read the versions in ``db``, their blobs in ``blobs`` (a snapshot every ``snapshot_every``)."""

    def __init__(self, db: RegistryDB, blobs: BlobStore, weights: Weights, snapshot_every: int = 10):
        self.db, self.blobs, self.weights, self.snapshot_every = db, blobs, weights, snapshot_every

    # ------------------------------------------------------------------------------------------ writing

    def init_base(self, state_dict: Mapping[str, torch.Tensor], model_dir: str) -> Version:
        """Register the base policy as version 0 (stable, full snapshot). Idempotent for the same weights."""
        blob = encode_snapshot(state_dict, version=0)
        csum = checksum(state_dict)
        with self.db.tx() as s:
            existing = s.get(Version, 0)
            if existing is not None:
                if existing.checksum != csum:
                    raise RegistryError(
                        f"the registry at {self.db.url} already has a different base (checksum "
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
        with self.db.tx() as s:
            if s.get(Version, 0) is not None:  # another process won the race
                return version_row(s, 0)
            s.add(row)
            self.db.append_audit(s, "system", "init", 0, f"base policy from {model_dir}")
        return row

    def _allocate(self) -> int:
        with self.db.tx() as s:
            counter = lock(s)
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
        rollback_seen: int | None = None,
    ) -> Version:
        """Store a new candidate as a delta from ``parent`` (plus a snapshot every ``snapshot_every`` deltas).

        ``parent_state``: the parent's weights if the caller has them (verified by checksum), saving a rebuild.
        ``sample_offsets`` keys become strings (JSON). ``rollback_seen``: the audit id of the last rollback the
        weights account for (the learner's, as of the stable version it trained from); None: the last rollback as of
        this call's start. The gate refuses the candidate if a later rollback exists (``last_rollback``): ordered by
        the audit log's sequence, a rollback that lands while the weights are trained or stored is never missed.
        """
        if rollback_seen is None:
            rollback_seen = self.last_rollback()[0]
        prow = self.get(parent)
        if parent_state is None:
            parent_state = self.weights.materialize(parent)
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
            rollback_seen=int(rollback_seen),
            metrics=dict(metrics or {}),
            sample_offsets={str(k): v for k, v in (sample_offsets or {}).items()},
        )
        with self.db.tx() as s:
            s.add(row)
            self.db.append_audit(
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
        with self.db.tx() as s:
            version_row(s, version)
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
        with self.db.tx() as s:
            lock(s)
            row = version_row(s, version)
            if expect is not None and row.status != expect:
                raise RegistryConflict(f"version {version} is {row.status}, not {expect}: left as it is")
            if row.status == "stable" and status != "stable":
                raise RegistryConflict(
                    f"version {version} is the stable version; use promote or rollback to change that"
                )
            ended = end_rollouts_of(s, row, f"{actor} set v{version} {status}") if row.status == "canary" else ""
            row.status, row.status_reason = status, reason
            self.db.append_audit(
                s, actor, status if status == "rejected" else f"set_{status}", version, (reason or "") + ended
            )
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
        with self.db.tx() as s:
            lock(s)
            row = version_row(s, version)
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
            ended = end_rollouts_of(s, row, f"promoted by {actor}") if row.status == "canary" else ""
            for o in old:
                o.status, o.status_reason = "retired", f"replaced by {version}"
            row.status, row.status_reason, row.promoted_at = "stable", reason, time.time()
            prev = ",".join(str(o.version) for o in old) or "none"
            self.db.append_audit(s, actor, "promote", version, f"{reason or ''} (was {prev}){ended}".strip())
        return row

    def rollback(self, actor: str, reason: str | None = None, to: int | None = None) -> Version:
        """Mark the current stable rolled_back and make ``to`` (default: the previous stable) stable again."""
        with self.db.tx() as s:
            lock(s)
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
                target = version_row(s, to)
                if target.version == current.version:
                    raise RegistryError(f"version {to} is already the stable version")
                if target.status not in ("retired", "rolled_back"):
                    raise RegistryError(f"version {to} is {target.status}, it was never stable; use promote instead")
            current.status, current.status_reason = "rolled_back", reason
            target.status, target.status_reason, target.promoted_at = "stable", reason, time.time()
            self.db.append_audit(
                s, actor, "rollback", target.version, f"{reason or ''} (from {current.version})".strip()
            )
        return target

    # ------------------------------------------------------------------------------------------ reading

    def get(self, version: int) -> Version:
        return self.db.get(version)

    def list(self, status: str | None = None, limit: int | None = None) -> list[Version]:
        """Versions, newest first."""
        q = select(Version).order_by(Version.version.desc())
        if status is not None:
            q = q.where(Version.status == status)
        if limit is not None:
            q = q.limit(limit)
        with self.db.session() as s:
            return list(s.execute(q).scalars())

    def candidates(self) -> builtins.list[Version]:
        """Pending candidates, oldest first (the gate's queue)."""
        return self.list(status="candidate")[::-1]

    def stable(self) -> Version:
        rows = self.list(status="stable")
        if not rows:
            raise RegistryError("the registry has no stable version; register the base policy first")
        return rows[0]

    def gate_results(self, version: int | None = None) -> builtins.list[GateResult]:
        q = select(GateResult).order_by(GateResult.id)
        if version is not None:
            q = q.where(GateResult.version == version)
        with self.db.session() as s:
            return list(s.execute(q).scalars())

    def last_rollback(self) -> tuple[int, float]:
        """``(audit id, time)`` of the most recent rollback, or ``(0, 0.0)``: the learner rebases and the gate
        refuses candidates emitted before it, so a rolled-back change does not come back."""
        with self.db.session() as s:
            row = s.execute(
                select(AuditEntry.id, AuditEntry.at)
                .where(AuditEntry.action == "rollback")
                .order_by(AuditEntry.id.desc())
                .limit(1)
            ).first()
        return (int(row[0]), float(row[1])) if row else (0, 0.0)


class Fleet:
    """Which node serves which version: the fleet rows (now) and the served rows (when each node first served each)."""

    def __init__(self, db: RegistryDB):
        self.db = db

    def update_fleet(self, node: str, version: int, checksum_: str, at: float | None = None) -> None:
        """``node`` serves ``version`` since ``at`` (default now): the fleet row, and, the first time this node serves
        this version, its ``served`` row (kept for good: ``liverl lineage``'s first-served time)."""
        at = time.time() if at is None else float(at)
        with self.db.tx() as s:
            row = s.get(FleetNode, node) or FleetNode(node=node)
            row.version, row.checksum, row.updated_at = version, checksum_, at
            s.add(row)
            if s.get(Served, (version, node)) is None and s.get(Version, version) is not None:
                s.add(Served(version=version, node=node, first_at=at))

    def fleet(self) -> list[FleetNode]:
        with self.db.session() as s:
            return list(s.execute(select(FleetNode).order_by(FleetNode.node)).scalars())

    def served(self, version: int | None = None) -> list[Served]:
        """When each node first served each version (all versions, or one), earliest first."""
        q = select(Served).order_by(Served.first_at, Served.node)
        if version is not None:
            q = q.where(Served.version == version)
        with self.db.session() as s:
            return list(s.execute(q).scalars())
