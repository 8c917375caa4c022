"""One input partition's join table database, with the two indexes that keep recovery and expiry O(what they need).

A store holds ``generation id -> entry`` (``ingest.entry``) and the changelog offset it has applied, written in the
same atomic batch as the changes. RocksDB (rocksdict) on disk, or a dict in memory (``ingest.store = "memory"``):
``open_store`` picks. Beside the entries, derived from each write (never sent to the changelog, rebuilt from it with
the entries):

- the pending index, ``\\x01P<gid> -> [t, kts, partition]``: the feedback waiting for its generation. Recovery after a
  rebalance reads only this (``pending``): O(pending entries), never the whole table.
- the expiry index, ``\\x01<class><t in ms, 8 bytes big-endian><gid>`` for waiting entries (``W``), judgements
  (``J``) and judgements that still keep an accepted sample (``A``), in time order: a timer reads only the entries due
  (``due``), never every key.

An entry's index key is written with the entry; the old one is not deleted then (that would cost a read per write):
``due`` checks each index key against its entry and deletes it when the entry moved on (a stale key). A due key's
deletion goes into the next ``apply``, the one that writes the caller's decision on its entry, so the two change
together. Index keys sort before every generation id (ids are ``[A-Za-z0-9_.:-]+``), and ``\\x00`` keys (offset,
format) before those.
"""

from __future__ import annotations

import heapq
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch, WriteOptions

from ingest.entry import PENDING, expiry_class, from_json, pending_info, to_json

log = logging.getLogger("liverl.ingest")

OFFSET_KEY = b"\x00liverl:changelog-offset"  # a key no generation id can be
FORMAT_KEY = b"\x00liverl:format"
FORMAT = b"2"  # 2: entries with their pending and expiry indexes (1, before: entries only)
PENDING_PREFIX = b"\x01P"
WRITE_BUFFER_BYTES = 16 << 20  # per partition database, two of them
BLOCK_CACHE_BYTES = 16 << 20  # per partition database

PendingInfo = tuple[float, float, int | None]  # (time written, the feedback's Kafka time, its input partition)


def _expiry_key(cls: bytes, t_ms: int, gid: bytes) -> bytes:
    return b"\x01" + cls + t_ms.to_bytes(8, "big") + gid


class RocksStore:
    """A partition's entries in RocksDB (no write-ahead log: the changelog is the log)."""

    def __init__(self, path: Path):
        self.path = path
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        # RocksDB's defaults are sized for a dedicated machine; one partition's join table needs far less
        opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
        opts.set_max_write_buffer_number(2)
        table_opts = BlockBasedOptions()
        table_opts.set_block_cache(Cache(BLOCK_CACHE_BYTES))
        opts.set_block_based_table_factory(table_opts)
        self._opts = opts
        self.db: Any = Rdict(str(path), options=opts)
        # No write-ahead log (Kafka Streams runs its RocksDB stores the same way): the changelog is the log. A crash
        # loses at most the writes still in the memtables, together with the changelog offset written in the same
        # batch, so the database reopens at an earlier offset and ``JoinTable.recover`` reads the changelog from
        # there. A clean close flushes the memtables.
        self._write_opts = WriteOptions()
        self._write_opts.disable_wal = True  # type: ignore[method-assign,assignment]  # a property at run time; rocksdict's stub says a method
        self.reads = 0  # keys visited by ``pending`` and ``due`` (tests count them: recovery's work is O(pending))
        self._drop: list[bytes] = []  # due index keys, deleted with the next apply
        raw = self.db.get(OFFSET_KEY)
        if raw is not None and self.db.get(FORMAT_KEY) != FORMAT:
            log.warning(
                "join table %s has no indexes (written before they were kept): dropped, to be read again "
                "from the changelog",
                path,
            )
            self.wipe()
            raw = None
        self.db.put(FORMAT_KEY, FORMAT, self._write_opts)
        self.offset: int | None = int(raw) if raw is not None else None  # the last changelog offset applied

    def get(self, key: bytes) -> bytes | None:
        return self.db.get(key)

    def keys(self) -> Iterator[bytes]:
        """Every generation id held (a full scan: for tests and tools, never on the worker's path)."""
        yield from self.db.keys(from_key=b"\x02")

    def apply(self, changes: list[tuple[bytes, bytes | None]], offset: int | None) -> None:
        """Write ``changes`` (None deletes), their index keys and the changelog offset they end at, all or nothing."""
        wb = WriteBatch(raw_mode=True)
        for k in self._drop:
            wb.delete(k)
        self._drop = []
        for k, v in changes:
            if v is None:
                wb.delete(k)
                wb.delete(PENDING_PREFIX + k)
                continue
            wb.put(k, v)
            if v[:1] == PENDING:
                wb.put(PENDING_PREFIX + k, to_json(pending_info(v)))
                continue
            cls = expiry_class(v)
            if cls is not None:
                wb.put(_expiry_key(cls[0], cls[1], k), b"")
                if v[:1] != b"W":  # (a judgement: it may have been pending; a blind delete is cheap)
                    wb.delete(PENDING_PREFIX + k)
        if offset is not None:
            wb.put(OFFSET_KEY, str(offset).encode())
        self.db.write(wb, self._write_opts)
        if offset is not None:
            self.offset = offset

    def pending(self) -> Iterator[tuple[bytes, PendingInfo]]:
        """The pending feedback: (generation id, (t, kts, partition)), read from the pending index only."""
        n = len(PENDING_PREFIX)
        for k, v in self.db.items(from_key=PENDING_PREFIX):
            if not k.startswith(PENDING_PREFIX):
                break
            self.reads += 1
            t, kts, part = from_json(v)
            yield k[n:], (t, kts, part)

    def due(self, cls: bytes, before_ms: int) -> Iterator[bytes]:
        """Generation ids whose entry is of expiry class ``cls`` and was written before ``before_ms``, oldest first.

        Each index key visited is checked against its entry: a stale one is deleted at once; a due one with the next
        ``apply`` (the caller's write of its decision on the entry)."""
        prefix = b"\x01" + cls
        n = len(prefix) + 8
        stale = []
        try:
            for k, _ in self.db.items(from_key=prefix):
                if not k.startswith(prefix) or int.from_bytes(k[len(prefix) : n], "big") >= before_ms:
                    break
                self.reads += 1
                gid = k[n:]
                entry = self.db.get(gid)
                if entry is None or expiry_class(entry) != (cls, int.from_bytes(k[len(prefix) : n], "big")):
                    stale.append(k)
                    continue
                self._drop.append(k)
                yield gid
        finally:
            if stale:
                wb = WriteBatch(raw_mode=True)
                for k in stale:
                    wb.delete(k)
                self.db.write(wb, self._write_opts)

    def estimate(self) -> int:
        """RocksDB's estimate of the keys held (entries and index keys): a gauge, not a count."""
        return int(self.db.property_int_value("rocksdb.estimate-num-keys") or 0)

    def wipe(self) -> None:
        """Empty the database (its files removed: no per-key work)."""
        self.db.close()
        shutil.rmtree(self.path, ignore_errors=True)

        self.db = Rdict(str(self.path), options=self._opts)
        self.db.put(FORMAT_KEY, FORMAT, self._write_opts)
        self._drop = []
        self.offset = None

    def close(self) -> None:
        self.db.close()


class MemoryStore:
    """A partition's entries in a dict (rebuilt from the whole changelog on every start); the expiry index as heaps."""

    path = None

    def __init__(self) -> None:
        self.db: dict[bytes, bytes] = {}
        self._pending: dict[bytes, PendingInfo] = {}
        self._heaps: dict[bytes, list[tuple[int, bytes]]] = {}
        self.offset: int | None = None
        self.reads = 0

    def get(self, key: bytes) -> bytes | None:
        return self.db.get(key)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self.db))

    def apply(self, changes: list[tuple[bytes, bytes | None]], offset: int | None) -> None:
        for k, v in changes:
            if v is None:
                self.db.pop(k, None)
                self._pending.pop(k, None)
                continue
            self.db[k] = v
            if v[:1] == PENDING:
                self._pending[k] = pending_info(v)
                continue
            self._pending.pop(k, None)
            cls = expiry_class(v)
            if cls is not None:
                heapq.heappush(self._heaps.setdefault(cls[0], []), (cls[1], k))
        if offset is not None:
            self.offset = offset

    def pending(self) -> Iterator[tuple[bytes, PendingInfo]]:
        for k, info in list(self._pending.items()):
            self.reads += 1
            yield k, info

    def due(self, cls: bytes, before_ms: int) -> Iterator[bytes]:
        heap = self._heaps.get(cls, [])
        while heap and heap[0][0] < before_ms:
            t_ms, gid = heapq.heappop(heap)
            self.reads += 1
            entry = self.db.get(gid)
            if entry is not None and expiry_class(entry) == (cls, t_ms):
                yield gid

    def estimate(self) -> int:
        return len(self.db)

    def wipe(self) -> None:
        self.db.clear()
        self._pending.clear()
        self._heaps.clear()
        self.offset = None

    def close(self) -> None:
        pass


Store = RocksStore | MemoryStore


def open_store(path: Path | None) -> Store:
    """The database of one partition: RocksDB at ``path``, or in memory when ``path`` is None."""
    return MemoryStore() if path is None else RocksStore(path)
