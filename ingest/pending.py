"""The pending index: feedback waiting for its generation, and how far this worker has read each generations partition.

Both live in memory, are rebuilt after every rebalance (``PendingIndex.rebuild``, from the table's pending index:
``ingest.store``) and are bounded: the pending feedback by ``ingest.max_pending``, the progress by the partition
count. The join (``ingest.join``) keeps them up to date as batches settle; the pending sweep
(``Ingest.expire_pending``) asks them which feedback has waited long enough for its generation (``expired``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping, MutableMapping

from ingest.entry import PENDING, pending_info

PENDING_HARD_LIMIT_X = 10  # early feedback is dropped after this many TTLs even if generations still lag

Info = tuple[float, float, int | None]  # a pending entry's (time written, the feedback's Kafka time, input partition)


class PendingIndex:
    """The pending feedback of the settled batches, oldest first while callers' clocks do not go back, and what this
    worker has read of each generations partition since the last rebalance."""

    def __init__(self) -> None:
        self.entries: dict[str, Info] = {}  # generation id -> (t, kafka ts, input partition)
        self.in_order = True  # whether ``entries`` runs oldest first (it does unless a caller's clock jumps)
        self.newest = 0.0
        # Progress of the generations stream per partition: Kafka timestamp of the newest record processed, and the
        # offset after the last one processed.
        self.clock: dict[int, float] = {}
        self.next_offset: dict[int, int] = {}
        self.resumed = time.time()  # waiting counts from here (the last rebuild), if later than the feedback

    def __len__(self) -> int:
        return len(self.entries)

    def rebuild(self, found: list[tuple[str, Info]]) -> None:
        """Start over from the table's pending entries ``found`` (after a start or a rebalance): feedback that was
        pending gets a whole TTL again, and the generations stream counts as quiet only after a TTL of this worker's
        own reading."""
        found.sort(key=lambda f: f[1][0])  # oldest first: the sweep stops at the first entry too young to expire
        self.entries = dict(found)
        self.newest = found[-1][1][0] if found else 0.0
        self.in_order = True
        self.clock.clear()
        self.next_offset.clear()
        self.resumed = time.time()

    def put(self, gid: str, entry: bytes) -> None:
        """A settled table write of ``gid``: pending feedback is indexed, anything else is not pending."""
        if entry[:1] != PENDING:
            self.entries.pop(gid, None)
            return
        info = pending_info(entry)
        t = info[0]
        if gid in self.entries or t < self.newest:  # (only a caller's own clock goes back)
            self.in_order = False
        self.newest = max(self.newest, t)
        self.entries[gid] = info

    def pop(self, gid: str) -> None:
        self.entries.pop(gid, None)

    def settled(self) -> None:
        """A batch's writes are in (``put``, ``pop``): an empty index is in order again."""
        if not self.entries:
            self.in_order = True

    def read_generation(self, partition: int, ts: float, offset: int | None) -> None:
        """A generation record of ``partition`` (Kafka time ``ts``, at ``offset``) was decided."""
        self.clock[partition] = max(self.clock.get(partition, 0.0), ts)
        if offset is not None:
            self.next_offset[partition] = max(self.next_offset.get(partition, 0), offset + 1)

    def generations_read(self, partition: int) -> tuple[float | None, int | None]:
        """(timestamp of the newest generation record, offset after the last one) decided on ``partition`` since the
        last rebuild; None where none was."""
        return self.clock.get(partition), self.next_offset.get(partition)

    # -- what has waited long enough -----------------------------------------------------------------

    def waited(self, t: float, kts: float, part: int | None, now: float, ttl: float) -> str | None:
        """Has this feedback waited long enough for its generation? None, "hard", "clock" or "caught_up".

        Waiting ``ttl`` of wall time (counted from the last rebuild, if later; ``ttl`` is at least the producers'
        delivery timeout) is not enough on its own: when the generations stream lags the feedback stream (a backlog
        after a restart, a stalled worker, a slow partition) the record may still be unread. So either the
        generations partition co-partitioned with the feedback has moved ``ttl`` past the feedback's own timestamp
        ("clock"), or this worker has read that partition to its end ("caught_up": checked against the broker by the
        caller). A hard limit of ``PENDING_HARD_LIMIT_X`` x ``ttl`` (at least 10 min) bounds memory if a partition
        never catches up.
        """
        if now - t >= max(PENDING_HARD_LIMIT_X * ttl, 600.0):
            return "hard"
        if now - max(t, self.resumed) < ttl:
            return None
        clock = self.clock.get(part) if part is not None else None
        if clock is not None and clock >= kts + ttl:
            return "clock"
        return "caught_up"

    def due(self, now: float, ttl: float) -> list[tuple[str, Info]]:
        """The pending entries old enough to be considered: all of them, or, while they are kept oldest first, those
        before the first one that has not waited ``ttl`` yet (a sweep per second need not visit every entry)."""
        if not self.in_order:
            return list(self.entries.items())
        due = []
        for item in self.entries.items():
            if now - item[1][0] < ttl:
                break
            due.append(item)
        return due

    def caught_up(self, part: int | None, ends: Mapping[int, int | None] | None) -> bool:
        """Has this worker processed every generation record the broker has on ``part`` (``ends``: the generations
        partitions' end offsets, as the caller read them from the broker; None: no broker, every partition is)?"""
        if part is None or ends is None:
            return True
        end = ends.get(part)
        return end is not None and self.next_offset.get(part, 0) >= end

    def ends_needed(self, now: float, ttl: float, assigned: Collection[int] | None = None) -> set[int]:
        """The generations partitions whose end offset ``expired`` needs at ``now``: where feedback has waited
        ``ttl`` and the partition's clock has not passed it (whether it was read to its end then decides)."""
        return {
            part
            for _, (t, kts, part) in self.due(now, ttl)
            if part is not None
            and (assigned is None or part in assigned)
            and self.waited(t, kts, part, now, ttl) == "caught_up"
        }

    def expired(
        self,
        now: float,
        ttl: float,
        assigned: Collection[int] | None = None,
        ends: Mapping[int, int | None] | None = None,
    ) -> list[str]:
        """The generation ids whose feedback has waited long enough (``waited``), of the partitions ``assigned``
        (None: all), with ``ends`` as in ``caught_up``."""
        expired = []
        for gid, (t, kts, part) in self.due(now, ttl):
            if part is not None and assigned is not None and part not in assigned:
                continue
            why = self.waited(t, kts, part, now, ttl)
            if why == "caught_up" and not self.caught_up(part, ends):
                continue
            if why is not None:
                expired.append(gid)
        return expired


def pending_in(table: MutableMapping[str, bytes]) -> Iterator[tuple[str, Info]]:
    """The pending feedback of a table: from its pending index (``ingest.table.JoinTable``), or, for a plain mapping
    (the property tests' dict), a scan."""
    index = getattr(table, "pending_entries", None)
    if index is not None:
        return index()
    return ((gid, pending_info(v)) for gid, v in list(table.items()) if v[:1] == PENDING)
