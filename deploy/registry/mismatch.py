"""Each version's sampler/trainer mismatch (``tables.Mismatch``): the learner adds its measurements, the gate, ``liverl
versions`` and the on-call page read them. The learner's role may insert and update this table only
(``deploy.registry.roles``): sums, never a status."""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import select

from deploy.registry.regdb import RegistryDB
from deploy.registry.tables import Mismatch, Version

FIELDS = ("own_tokens", "own_abs", "own_kl", "replay_tokens", "replay_abs", "replay_kl")


class Mismatches:
    def __init__(self, db: RegistryDB):
        self.db = db

    def add_mismatch(self, sums: Mapping[int, Mapping[str, float]]) -> list[int]:
        """Add ``sums`` (version -> some of ``FIELDS``) to each version's row; versions the registry does not hold are
        left out. Returns the versions written."""
        bad = {k for v in sums.values() for k in v} - set(FIELDS)
        if bad:
            raise ValueError(f"mismatch sums name unknown fields {sorted(bad)}; known: {FIELDS}")
        written = []
        now = time.time()
        with self.db.tx() as s:
            for version in sorted(sums):
                if s.get(Version, version) is None:
                    continue
                row = s.get(Mismatch, version, with_for_update=True)
                if row is None:
                    row = Mismatch(version=version, **dict.fromkeys(FIELDS, 0))
                    s.add(row)
                for k, v in sums[version].items():
                    setattr(row, k, (getattr(row, k) or 0) + (int(v) if k.endswith("tokens") else float(v)))
                row.updated_at = now
                written.append(version)
        return written

    def mismatch(self, version: int | None = None) -> dict[int, dict[str, float | None]]:
        """Version -> its per-token means (``Mismatch.means``), for every version measured or one."""
        q = select(Mismatch).order_by(Mismatch.version)
        if version is not None:
            q = q.where(Mismatch.version == version)
        with self.db.session() as s:
            return {m.version: m.means() for m in s.execute(q).scalars()}
