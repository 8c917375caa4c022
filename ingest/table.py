"""The join table: ``generation_id -> entry`` over one database per assigned input partition, with a write buffer.

The table is the join's state (``ingest.join``: one entry per generation id). It lives in one database per input
partition the worker is assigned (``ingest.store``: RocksDB under ``<state_dir>/ingest/join-<partition>``, or in
memory), and every change to it is a record on the compacted changelog topic ``<prefix>-ingest-join-changelog``
(key: the generation id, value: the entry, a tombstone for a deletion), partitioned like the inputs
(``ingest.partitioner``). The changelog is the truth: a database stores, in the same atomic write as the changes,
the changelog offset it has applied, so a restarted worker reads only the changelog's tail (``ingest.restore``).

Writes are buffered (Kafka Streams' record cache): reads see them at once, the changelog and then the databases only
at ``flush``. The worker flushes after the broker has the samples and dead letters of the batches the buffer holds,
so the table never says "judged" for a sample the broker does not have (``ingest.join``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from core.config import BrokerConfig
from ingest.entry import PENDING, ms, pending_info
from ingest.outbox import MAX_BATCH_BYTES, MAX_REQUEST_BYTES, Outbox, Span
from ingest.partitioner import murmur2, murmur2_many, partition_of, partitions_of, warm_hashes
from ingest.restore import restore
from ingest.store import PendingInfo, Store, open_store

log = logging.getLogger("liverl.ingest")

# (re-exported: the names the worker and the tests import from here)
__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_REQUEST_BYTES",
    "JoinTable",
    "Outbox",
    "changelog_topic",
    "murmur2",
    "murmur2_many",
    "partition_of",
    "partitions_of",
    "warm_hashes",
]


def changelog_topic(prefix: str) -> str:
    return f"{prefix}-ingest-join-changelog"


def _Part(path: Path | None) -> Store:  # (the name tests/ingest/test_restart.py opens a database by)
    return open_store(path)


def applied_through(applied: int | None, spans: list[Span] | None) -> int | None:
    """The changelog offset a database that has applied its partition up to ``applied`` (None: nothing) may claim
    once it has applied this worker's own writes, ``spans`` (``Outbox.flush``): their last offset when they follow
    ``applied`` with no gap; else None, and it keeps ``applied``. A gap is another writer's records: the partition's
    new owner while this worker, cut off from the group (a stalled event loop, a cut link), still wrote as its old
    one. Claiming past them would make a later restore of this database skip them: their pending feedback, read and
    committed by that owner, would be nowhere."""
    if not spans:
        return None
    nxt = 0 if applied is None else applied + 1
    for first, n in spans:
        if first != nxt:
            return None
        nxt = first + n
    return nxt - 1


class JoinTable(MutableMapping[str, bytes]):
    """``generation_id -> entry`` over the assigned partitions' databases, with this batch's writes on top."""

    def __init__(self, topic: str, partitions: int, state_dir: Path | None):
        self.topic = topic  # the changelog
        self.partitions = partitions
        self.state_dir = state_dir  # None: in memory
        self.parts: dict[int, Store] = {}
        self._writes: dict[str, bytes | None] = {}  # the write buffer: changes not yet sent to the changelog
        self._write_bytes = 0
        self._flushing: dict[str, bytes | None] = {}  # writes on their way to the changelog: still read from here

    def partition(self, key: str) -> int:
        return partition_of(key.encode(), self.partitions)

    # -- the mapping the join reads and writes ----------------------------------------------------

    def __getitem__(self, key: str) -> bytes:
        if key in self._writes:
            v = self._writes[key]
        elif key in self._flushing:
            v = self._flushing[key]
        else:
            part = self.parts.get(self.partition(key))
            v = None if part is None else part.get(key.encode())
        if v is None:
            raise KeyError(key)
        return v

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __setitem__(self, key: str, value: bytes) -> None:
        self._writes[key] = value
        self._write_bytes += len(value)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._writes[key] = None

    def __iter__(self) -> Iterator[str]:
        seen = set()
        over = {**self._flushing, **self._writes}
        for part in list(self.parts.values()):
            for k in part.keys():
                key = k.decode()
                seen.add(key)
                if over.get(key, b"") is not None:
                    yield key
        for key, v in over.items():
            if v is not None and key not in seen:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # -- what the timers and recovery read: the indexes, never the whole table ------------------------

    def pending_entries(self) -> Iterator[tuple[str, PendingInfo]]:
        """The pending feedback of the held partitions, (generation id, (t, kts, partition)), from each database's
        pending index (O(pending)), with this batch's writes on top."""
        over = {**self._flushing, **self._writes}
        for part in list(self.parts.values()):
            for k, info in part.pending():
                key = k.decode()
                if key not in over:
                    yield key, info
        for key, v in over.items():
            if v is not None and v[:1] == PENDING:
                yield key, pending_info(v)

    def due(self, cls: bytes, before: float) -> Iterator[str]:
        """Generation ids whose entry is of expiry class ``cls`` (``ingest.entry.expiry_class``) and was written
        before ``before`` (seconds), oldest first per partition, from each database's expiry index: a candidate to
        check (``get``), not a promise. Read it with nothing buffered (the timers run after a flush)."""
        before_ms = ms(before)
        for part in list(self.parts.values()):
            for k in part.due(cls, before_ms):
                yield k.decode()

    def estimate(self) -> int:
        """About how many keys the held databases hold (RocksDB's estimate, index keys included): for a gauge."""
        return sum(part.estimate() for part in self.parts.values())

    def reads(self) -> int:
        """Keys the indexes have visited so far (tests count them)."""
        return sum(part.reads for part in self.parts.values())

    # -- the batch ---------------------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return bool(self._writes)

    @property
    def buffered(self) -> dict[str, bytes | None]:
        """The changes not yet sent to the changelog (read-only: write through the mapping)."""
        return self._writes

    @property
    def buffered_bytes(self) -> int:
        """Bytes of values written to the buffer since it was last flushed (an overwrite counts again: a bound)."""
        return self._write_bytes

    async def flush(self, outbox: Outbox) -> int:
        """Write this batch's changes to the changelog, then, once the broker has them, to the databases."""
        if not self._writes:
            return 0
        if self._flushing:
            raise RuntimeError("join table: a flush while another is in flight (flushes must be one at a time)")
        writes, self._writes = self._writes, {}
        self._write_bytes = 0
        self._flushing = writes  # readable until the databases have them
        by_part: dict[int, list[tuple[bytes, bytes | None]]] = {}
        keys = [key.encode() for key in writes]
        for k, value, p in zip(keys, writes.values(), partitions_of(keys, self.partitions), strict=True):
            if p in by_part:
                by_part[p].append((k, value))
            else:
                by_part[p] = [(k, value)]
        for p, changes in by_part.items():
            outbox.put_many(self.topic, p, changes)
        try:
            spans = await outbox.flush()
        except BaseException:
            self._writes = {**writes, **self._writes}  # not written anywhere: the caller stops the worker anyway
            self._flushing = {}
            raise
        try:
            for p, changes in by_part.items():
                part = self.parts.get(p)
                if part is None:  # a partition a rebalance took away: its new owner reads the changelog
                    log.warning(
                        "join table: %d changes to partition %d, which this worker no longer holds, went to "
                        "the changelog only",
                        len(changes),
                        p,
                    )
                    continue
                offset = applied_through(part.offset, spans.get((self.topic, p)))
                if offset is None:
                    log.warning(
                        "join table partition %d: another writer's changelog records came between this database's "
                        "(offset %s) and these %d changes (%s): it keeps its offset, so a restore reads what it missed",
                        p,
                        part.offset,
                        len(changes),
                        spans.get((self.topic, p)),
                    )
                part.apply(changes, offset)
        finally:
            self._flushing = {}
        return len(writes)

    # -- assignment --------------------------------------------------------------------------------

    def _path(self, p: int) -> Path | None:
        return None if self.state_dir is None else self.state_dir / f"join-{p}"

    def hold(self, partitions: set[int]) -> None:
        """Open the databases of ``partitions`` and close the others."""
        for p in set(self.parts) - partitions:
            self.parts.pop(p).close()
        for p in partitions - set(self.parts):
            if self.state_dir is not None:
                self.state_dir.mkdir(parents=True, exist_ok=True)
            self.parts[p] = _Part(self._path(p))

    async def recover(self, bootstrap: str, broker: BrokerConfig | None) -> dict[str, Any]:
        """Bring the held partitions' databases up to their changelog's end (``ingest.restore``)."""
        return await restore(self.topic, self.parts, bootstrap, broker)

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
        self.parts.clear()
