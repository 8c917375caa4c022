"""Garbage collection of the registry's blobs, and the pruning of rejected versions' deltas.

A blob no version row references is deleted once it is older than a grace period (default one hour). Writers store
blobs *before* committing the row that references them, so a young unreferenced blob may be a version being added
right now; age is the store's last-write time, which a re-put of the same content refreshes. Deltas and snapshots
name their version in their bytes and version numbers are never reused, so a new version's blobs are always new
content. The one remaining window: re-putting the exact bytes of an old orphan (e.g. ``init_base`` after a crash)
between a collector's age check and its delete.

Rejected candidates (``gc(prune_rejected_s=...)``): a rejected version whose whole subtree of descendants is
rejected too, and older than the given age, has its blobs unreferenced (``blob_key``/``snapshot_key`` set to
NULL, the row, its gate results and its audit entries kept) and then collected as above. A rejected version
with a descendant that is not rejected keeps its delta: the learner trains on, so later versions are deltas on top
of it and rebuilding them walks through it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import select

from deploy.registry.blobstore import BlobError, BlobInfo, BlobStore
from deploy.registry.regdb import RegistryDB
from deploy.registry.tables import Version


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


class Collector:
    """Collects the blobs in ``blobs`` that no version row in ``db`` references."""

    def __init__(self, db: RegistryDB, blobs: BlobStore):
        self.db, self.blobs = db, blobs

    def referenced_blobs(self) -> set[str]:
        """Every blob key a version row references (its delta or base snapshot, and its snapshot)."""
        with self.db.session() as s:
            rows = s.execute(select(Version.blob_key, Version.snapshot_key)).all()
        return {k for row in rows for k in row if k is not None}

    def prunable_rejected(self, older_than_s: float) -> list[int]:
        """Rejected versions older than ``older_than_s`` whose every descendant is prunable too (leaves first)."""
        cutoff = time.time() - older_than_s
        with self.db.session() as s:
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
            self._unreference(pruned, actor)
        stored = set(self.blobs.list_keys())
        referenced = self.referenced_blobs()
        if dry_run and pruned:
            with self.db.session() as s:
                gone = s.execute(
                    select(Version.blob_key, Version.snapshot_key).where(Version.version.in_(pruned))
                ).all()
            referenced -= {k for row in gone for k in row if k is not None}
        result = GcResult(dry_run=dry_run, grace_s=grace_s, referenced=len(stored & referenced), pruned=pruned)
        result.missing = sorted(k for k in referenced - stored if not self.blobs.exists(k))
        self._sweep(result, sorted(stored - referenced))
        if result.removed and not dry_run:
            with self.db.tx() as s:
                self.db.append_audit(
                    s,
                    actor,
                    "gc",
                    None,
                    f"removed {len(result.removed)} unreferenced blobs ({result.removed_bytes} bytes)",
                )
        return result

    def _unreference(self, pruned: list[int], actor: str) -> None:
        """Set the blob keys of the ``pruned`` versions that are still rejected to NULL, audited."""
        with self.db.tx() as s:
            for v in pruned:
                row = s.get(Version, v)
                if row is None or row.status != "rejected":  # promoted or rejected-then-changed meanwhile
                    continue
                row.blob_key, row.snapshot_key = None, None
            self.db.append_audit(
                s,
                actor,
                "gc",
                None,
                f"pruned the deltas of {len(pruned)} rejected versions "
                f"(no live descendants): {', '.join(map(str, pruned[:20]))}",
            )

    def _sweep(self, result: GcResult, unreferenced: list[str]) -> None:
        """Delete (unless ``result.dry_run``) each unreferenced blob older than the grace period, into ``result``."""
        cutoff = time.time() - result.grace_s
        for key in unreferenced:
            try:
                info = self.blobs.stat(key)
            except BlobError:  # deleted meanwhile (another collector)
                continue
            if info.modified_at > cutoff:
                result.recent.append(info)
                continue
            if not result.dry_run:
                self.blobs.delete(key)
            result.removed.append(info)
