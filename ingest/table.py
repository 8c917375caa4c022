"""The join table and the worker's output path: one database per input partition, each kept by its changelog.

The table is the join's state (``ingest.join``: one entry per generation id). It lives in one key-value database
per input partition the worker is assigned, under ``<state_dir>/ingest/join-<partition>`` (RocksDB through
rocksdict, ``ingest.store = "rocksdb"``) or in memory (``"memory"``), and every change to it is a record on the
compacted changelog topic ``<prefix>-ingest-join-changelog`` (key: the generation id, value: the entry, a tombstone
for a deletion), partitioned like the inputs (murmur2 of the generation id). The changelog is the truth: a
database stores, in the same atomic write as the changes, the changelog offset it has applied, so a restarted
worker reads only the changelog's tail, and a worker given a partition another one kept reads it all.

Writes are buffered for a batch: reads see them at once, the databases and the changelog only at ``flush``. The
worker flushes after the broker has the batch's samples and dead letters, so the table never says "judged" for a
sample the broker does not have (``ingest.join``).

``Outbox`` is how records leave the worker: ``send`` queues one and hands back a future, ``flush`` builds one
record batch per partition (aiokafka's ``create_batch`` / ``send_batch``) and resolves the futures once the broker
has acknowledged them. A record costs a few microseconds this way, against ~16 through a per-record ``send``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import struct

log = logging.getLogger("liverl.ingest")

OFFSET_KEY = b"\x00liverl:changelog-offset"  # a key no generation id can be (ids are [A-Za-z0-9_.:-]+)
MAX_BATCH_BYTES = 256 * 1024  # one produce batch; a single larger record still goes alone (up to the request size)
MAX_REQUEST_BYTES = 1_048_576  # the broker's default message.max.bytes
RECOVERY_READ_TIMEOUT_S = 120.0
WRITE_BUFFER_BYTES = 16 << 20  # per partition database, two of them
BLOCK_CACHE_BYTES = 16 << 20  # per partition database


_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2), as aiokafka and kafka-python compute it, in half
    their time: four bytes at a time from one ``struct`` call (tests/ingest/test_bounds.py checks it against both)."""
    n = len(data)
    h = (0x9747B28C ^ n) & _MASK
    n4 = n >> 2
    if n4:
        for k in struct.unpack_from(f"<{n4}I", data):
            k = (k * _M) & _MASK
            k ^= k >> 24
            h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    rest = n & 3
    if rest:
        tail = n & ~3
        if rest >= 3:
            h ^= data[tail + 2] << 16
        if rest >= 2:
            h ^= data[tail + 1] << 8
        h = ((h ^ data[tail]) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def murmur2_many(keys: list[bytes]) -> list[int]:
    """``murmur2`` of many keys at once: numpy over the keys of each length, a fiftieth of the per-key time on a
    batch (the worker hashes every new generation id it reads). tests/ingest/test_bounds.py checks it against
    ``murmur2``."""
    import numpy as np

    m = np.uint32(_M)
    out = [0] * len(keys)
    by_len: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_len.setdefault(len(k), []).append(i)
    for n, idx in by_len.items():
        h = np.full(len(idx), (0x9747B28C ^ n) & _MASK, dtype=np.uint32)
        if n:
            rows = np.frombuffer(b"".join([keys[i] for i in idx]), dtype=np.uint8).reshape(len(idx), n)
            n4 = n >> 2
            if n4:
                words = np.ascontiguousarray(rows[:, :n4 * 4]).view("<u4")
                for j in range(n4):
                    k = words[:, j] * m
                    k ^= k >> np.uint32(24)
                    k *= m
                    h *= m
                    h ^= k
            rest, tail = n & 3, n & ~3
            if rest:
                if rest >= 3:
                    h ^= rows[:, tail + 2].astype(np.uint32) << np.uint32(16)
                if rest >= 2:
                    h ^= rows[:, tail + 1].astype(np.uint32) << np.uint32(8)
                h ^= rows[:, tail].astype(np.uint32)
                h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        for i, v in zip(idx, h.tolist(), strict=True):
            out[i] = v
    return out


_HASHES: dict[bytes, int] = {}  # murmur2 is pure Python (~3 us); a batch asks for the same keys several times
_HASHES_OLD: dict[bytes, int] = {}  # the previous generation of the cache: a key hashed just before it filled still hits
_HASHES_MAX = 65_536  # keys per generation (two generations)


def _cached_hash(key: bytes) -> int | None:
    h = _HASHES.get(key)
    return _HASHES_OLD.get(key) if h is None else h


def _new_generation() -> None:
    global _HASHES, _HASHES_OLD
    _HASHES_OLD, _HASHES = _HASHES, {}


def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives ``key``: Java client, aiokafka, kafka-python."""
    h = _HASHES.get(key)
    if h is None:
        h = _HASHES_OLD.get(key)
        if h is None:
            if len(_HASHES) >= _HASHES_MAX:
                _new_generation()
            h = _HASHES[key] = murmur2(key) & 0x7FFFFFFF
    return h % partitions


def partitions_of(keys: list[bytes], partitions: int) -> list[int]:
    """``partition_of`` of many keys: cached ones looked up in place, the rest hashed at once (``murmur2_many``)."""
    cur = _HASHES
    hashes = [cur.get(k) for k in keys]
    if None not in hashes:
        return [h % partitions for h in hashes]
    warm_hashes([k for k, h in zip(keys, hashes, strict=True) if h is None])
    return [h % partitions if h is not None else partition_of(k, partitions)
            for k, h in zip(keys, hashes, strict=True)]


def warm_hashes(keys: list[bytes]) -> None:
    """Put the hashes of many keys in the partitioner's cache in one pass (``murmur2_many``)."""
    todo = list({k for k in keys if _cached_hash(k) is None})
    if len(todo) < 64:  # the per-key path is as fast for a few
        return
    todo = todo[:_HASHES_MAX]
    if len(_HASHES) + len(todo) > _HASHES_MAX:
        _new_generation()
    for k, h in zip(todo, murmur2_many(todo), strict=True):
        _HASHES[k] = h & 0x7FFFFFFF


def changelog_topic(prefix: str) -> str:
    return f"{prefix}-ingest-join-changelog"


class _Part:
    """One partition's database: a rocksdict ``Rdict`` or a dict, and the changelog offset it has applied."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is None:
            self.db: Any = {}
        else:
            from rocksdict import BlockBasedOptions, Cache, Options, Rdict

            opts = Options(raw_mode=True)
            opts.create_if_missing(True)
            # RocksDB's defaults are sized for a dedicated machine; one partition's join table needs far less
            opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
            opts.set_max_write_buffer_number(2)
            table_opts = BlockBasedOptions()
            table_opts.set_block_cache(Cache(BLOCK_CACHE_BYTES))
            opts.set_block_based_table_factory(table_opts)
            self.db = Rdict(str(path), options=opts)
            # No write-ahead log (Kafka Streams runs its RocksDB stores the same way): the changelog is the log. A
            # crash loses at most the writes still in the memtables, together with the changelog offset written in
            # the same batch, so the database reopens at an earlier offset and ``JoinTable.recover`` reads the
            # changelog from there. A clean close flushes the memtables.
            from rocksdict import WriteOptions

            self._write_opts = WriteOptions()
            self._write_opts.disable_wal = True
        raw = self.db.get(OFFSET_KEY)
        self.offset: int | None = int(raw) if raw is not None else None  # the last changelog offset applied

    def get(self, key: bytes) -> bytes | None:
        return self.db.get(key)

    def keys(self) -> Iterator[bytes]:
        for k in self.db.keys():  # noqa: SIM118 - an Rdict, not a dict
            if k != OFFSET_KEY:
                yield k

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        for k, v in self.db.items():
            if k != OFFSET_KEY:
                yield k, v

    def apply(self, changes: list[tuple[bytes, bytes | None]], offset: int | None) -> None:
        """Write ``changes`` (None deletes) and the changelog offset they end at, all or nothing."""
        if self.path is None:
            for k, v in changes:
                if v is None:
                    self.db.pop(k, None)
                else:
                    self.db[k] = v
        else:
            from rocksdict import WriteBatch

            wb = WriteBatch(raw_mode=True)
            for k, v in changes:
                if v is None:
                    wb.delete(k)
                else:
                    wb.put(k, v)
            if offset is not None:
                wb.put(OFFSET_KEY, str(offset).encode())
            self.db.write(wb, self._write_opts)
        if offset is not None:
            self.offset = offset

    def wipe(self) -> int:
        keys = list(self.keys())
        self.apply([(k, None) for k in keys], None)
        if self.path is None:
            self.db.pop(OFFSET_KEY, None)
        else:
            self.db.delete(OFFSET_KEY)
        self.offset = None
        return len(keys)

    def close(self) -> None:
        if self.path is not None:
            self.db.close()


class Outbox:
    """Records on their way to the broker, sent as one batch per partition when flushed."""

    def __init__(self, producer):
        self.producer = producer
        self._queued: list[tuple[str, bytes, bytes | None]] = []  # send: (topic, key, value), partitioned by key
        self._grouped: list[tuple[str, int, list[tuple[bytes, bytes | None]]]] = []  # put_many: a partition's records
        self._partitions: dict[str, int] = {}
        self._done: asyncio.Future | None = None  # what every queued record's sender waits on (one per flush)
        self._sending: set[asyncio.Future] = set()  # flushes in flight

    async def partitions(self, topic: str) -> int:
        n = self._partitions.get(topic)
        if n is None:
            n = len(await self.producer.partitions_for(topic) or ())
            if not n:
                raise RuntimeError(f"topic {topic} has no partitions")
            self._partitions[topic] = n
        return n

    def send(self, topic: str, key: str, value: bytes) -> asyncio.Future:
        """Queue a record (partitioned by murmur2 of its key); the future resolves when ``flush`` has it acked (one
        future for everything queued before the flush)."""
        self._queued.append((topic, key.encode(), value))
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        return self._done

    def put_many(self, topic: str, partition: int, records: list[tuple[bytes, bytes | None]]) -> None:
        """Queue (key, value) records for one partition, in order (after what ``send`` queued)."""
        self._grouped.append((topic, partition, records))

    def flush(self) -> asyncio.Future:
        """Send everything queued so far (records queued after this call wait for the next flush). The future resolves
        to the last offset written per (topic, partition), or raises if the broker refused any of it (the queued
        records' futures get the error too)."""
        queued, self._queued = self._queued, []
        grouped, self._grouped = self._grouped, []
        done, self._done = self._done, None
        task = asyncio.ensure_future(self._send(queued, done, grouped))
        self._sending.add(task)  # the loop holds tasks weakly: one nobody awaits could vanish mid-send
        task.add_done_callback(self._sending.discard)
        return task

    async def _send(self, queued, done: asyncio.Future | None, grouped=()) -> dict[tuple[str, int], int]:
        if not queued and not grouped:
            return {}
        by_tp: dict[tuple[str, int], list[tuple[bytes, bytes | None]]] = {}
        for topic, key, value in queued:
            partition = partition_of(key, await self.partitions(topic))
            by_tp.setdefault((topic, partition), []).append((key, value))
        for topic, partition, records in grouped:
            by_tp.setdefault((topic, partition), []).extend(records)
        sent: list[tuple[tuple[str, int], int, asyncio.Future]] = []  # (tp, records in the batch, batch future)
        try:
            now_ms = int(time.time() * 1000)
            for (topic, partition), records in by_tp.items():
                batch, n = self.producer.create_batch(), 0
                for key, value in records:
                    if batch.append(key=key, value=value, timestamp=now_ms) is None:
                        batch.close()
                        sent.append(((topic, partition), n, await self.producer.send_batch(batch, topic,
                                                                                          partition=partition)))
                        batch, n = self.producer.create_batch(), 0
                        if batch.append(key=key, value=value, timestamp=now_ms) is None:
                            raise RuntimeError(f"a {len(value or b'')}-byte record does not fit a batch")
                    n += 1
                batch.close()
                sent.append(((topic, partition), n, await self.producer.send_batch(batch, topic, partition=partition)))
            results = await asyncio.gather(*(f for _, _, f in sent))
        except BaseException as e:
            if done is not None and not done.done():
                done.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                done.exception()  # retrieved here: the caller raises ``e`` itself
            raise
        last: dict[tuple[str, int], int] = {}
        for (tp, n, _), meta in zip(sent, results, strict=True):
            if meta is not None and n:
                last[tp] = max(last.get(tp, -1), meta.offset + n - 1)
        if done is not None and not done.done():
            done.set_result(None)
        return last

    def __len__(self) -> int:
        return len(self._queued) + sum(len(r) for _, _, r in self._grouped)


class JoinTable(MutableMapping[str, bytes]):
    """``generation_id -> entry`` over the assigned partitions' databases, with this batch's writes on top."""

    def __init__(self, topic: str, partitions: int, state_dir: Path | None):
        self.topic = topic  # the changelog
        self.partitions = partitions
        self.state_dir = state_dir  # None: in memory
        self.parts: dict[int, _Part] = {}
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

    def items(self):  # one pass over each database (the join rebuilds its indexes from this)
        if self._writes or self._flushing:
            return [(k, self[k]) for k in self]
        return [(k.decode(), v) for part in self.parts.values() for k, v in part.items()]

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
            offsets = await outbox.flush()
        except BaseException:
            self._writes = {**writes, **self._writes}  # not written anywhere: the caller stops the worker anyway
            self._flushing = {}
            raise
        try:
            for p, changes in by_part.items():
                part = self.parts.get(p)
                if part is None:  # a partition a rebalance took away: its new owner reads the changelog
                    log.warning("join table: %d changes to partition %d, which this worker no longer holds, went to "
                                "the changelog only", len(changes), p)
                    continue
                part.apply(changes, offsets.get((self.topic, p)))
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

    async def recover(self, bootstrap: str, security: dict[str, Any]) -> dict[str, Any]:
        """Read each held partition's changelog from the offset its database has applied to the changelog's end.

        A database ahead of its changelog belongs to another broker history (the demo's embedded broker keeps its
        log in memory; the state folder outlives it): it is emptied and read from the start. Returns what was read.
        """
        from aiokafka import AIOKafkaConsumer, TopicPartition

        if not self.parts:
            return {"read": 0, "dropped": 0, "partitions": []}
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                    fetch_max_wait_ms=100, max_partition_fetch_bytes=4 << 20, **security)
        await consumer.start()
        read = dropped = 0
        try:
            tps = {p: TopicPartition(self.topic, p) for p in self.parts}
            ends = await _true_end_offsets(consumer, tps)
            start: dict[int, int] = {}
            for p, part in self.parts.items():
                end = ends[p]
                if part.offset is not None and part.offset >= end:
                    was = part.offset
                    n = part.wipe()
                    dropped += n
                    log.warning("join table partition %d: local state (changelog offset %d) is ahead of the changelog "
                                "(end %d), so it is from another broker history; dropped its %d entries", p, was, end, n)
                nxt = 0 if part.offset is None else part.offset + 1
                if nxt < end:
                    start[p] = nxt
            if start:
                consumer.assign([tps[p] for p in start])
                for p, off in start.items():
                    consumer.seek(tps[p], off)
                left = dict(start)
                deadline = time.monotonic() + RECOVERY_READ_TIMEOUT_S
                while left:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the changelog {self.topic} was not read to its end within "
                                           f"{RECOVERY_READ_TIMEOUT_S:g} s (partitions {sorted(left)})")
                    got = await consumer.getmany(*[tps[p] for p in left], timeout_ms=200, max_records=20_000)
                    for tp, msgs in got.items():
                        p = tp.partition
                        msgs = [m for m in msgs if m.offset < ends[p]]
                        if msgs:
                            self.parts[p].apply([(m.key, m.value) for m in msgs if m.key is not None], msgs[-1].offset)
                            read += len(msgs)
                    for p in list(left):
                        if await consumer.position(tps[p]) >= ends[p]:
                            left.pop(p)
        finally:
            await consumer.stop()
        return {"read": read, "dropped": dropped, "partitions": sorted(self.parts)}

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
        self.parts.clear()


async def _true_end_offsets(consumer, tps: dict[int, Any], timeout_s: float = 10.0) -> dict[int, int]:
    """The log end offset of each partition, from a fetch response's high watermark.

    Why: the embedded Tansu broker answers ListOffsets(latest) with the base offset of the last record *batch* + 1,
    not the offset after its last record; reading a changelog up to that answer would silently lose the tail of its
    last batch (a batch of table changes is one record batch). A fetch response carries the correct high watermark.
    On Apache Kafka the two agree and this costs one short fetch per partition at rebalance time.
    """
    listed = await consumer.end_offsets(list(tps.values()))
    consumer.assign(list(tps.values()))
    for tp in tps.values():
        consumer.seek(tp, max((listed.get(tp) or 0) - 1, 0))
    deadline = time.monotonic() + timeout_s
    while any(consumer.highwater(tp) is None for tp in tps.values()) and time.monotonic() < deadline:
        await consumer.getmany(timeout_ms=200, max_records=1)
    out = {}
    for p, tp in tps.items():
        hw = consumer.highwater(tp)
        if hw is None:
            log.warning("no high watermark for %s within %g s; using the broker's end offset %s", tp, timeout_s,
                        listed.get(tp))
        out[p] = max(hw or 0, listed.get(tp) or 0)
    return out
