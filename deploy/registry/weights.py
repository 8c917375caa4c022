"""A version's weights, rebuilt from the registry's snapshots and deltas; the delta between any two versions.

Storage plan (as Fireworks does for RL checkpoints): version 0 is a full snapshot; every other version stores a
lossless delta from its parent, and every ``snapshot_every``-th version along a parent chain also stores a
full snapshot (``deploy.registry.versions``), so rebuilding any version costs one snapshot decode plus at most
``snapshot_every - 1`` deltas. Every step is checked against the checksums the version rows record.
"""

from __future__ import annotations

import torch

from deploy.registry.blobstore import BlobStore
from deploy.registry.delta import apply_delta, checksum, encode_delta, plan_delta, read_header
from deploy.registry.regdb import RegistryDB, RegistryError
from deploy.registry.snapshot import decode_snapshot
from deploy.registry.tables import Version


class Weights:
    """Walks the lineage of the versions in ``db`` and rebuilds weights from the blobs in ``blobs``."""

    def __init__(self, db: RegistryDB, blobs: BlobStore):
        self.db, self.blobs = db, blobs

    def _delta(self, row: Version) -> bytes:
        if row.blob_key is None:
            raise RegistryError(
                f"version {row.version} was {row.status} and its delta was pruned by gc "
                "(--prune-rejected); it cannot be rebuilt"
            )
        return self.blobs.get(row.blob_key)

    def delta_for(self, version: int) -> bytes:
        """The delta between ``version`` and its parent (applies in either direction)."""
        row = self.db.get(version)
        if row.blob_kind != "delta":
            raise RegistryError(f"version {version} is the base snapshot and has no delta; use materialize()")
        return self._delta(row)

    def _chain(self, version: int) -> list[Version]:
        """[version, parent, grandparent, ..., 0]."""
        chain = [self.db.get(version)]
        while chain[-1].parent is not None:
            chain.append(self.db.get(chain[-1].parent))
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
        """Deltas that take ``from_version``'s weights to ``to_version``'s, in order (up to the common ancestor, then
        down).

        Apply each with ``apply_delta``/``plan_delta``: they detect the direction themselves.
        """
        up, down = self.path(from_version, to_version)
        return [self._delta(r) for r in up + down]

    def materialize(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of any version: nearest snapshot up the chain, then deltas forward, checksum-verified."""
        path = []
        row = target = self.db.get(version)
        while row.snapshot_key is None:
            path.append(row)
            assert row.parent is not None  # only the base has no parent, and it has a snapshot
            row = self.db.get(row.parent)
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

    def compose(self, from_version: int, to_version: int) -> bytes | bytearray:
        """One delta taking ``from_version``'s weights to ``to_version``'s (either direction along the lineage).

        Rebuilds ``from_version``, walks ``deltas_between`` (each step checked against the registry), verifies
        the result against ``to_version``'s recorded checksum, then encodes a single delta between the ends.
        """
        src, dst = self.db.get(from_version), self.db.get(to_version)
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
