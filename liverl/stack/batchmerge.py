"""Merging a partition's small record batches in the embedded broker's folder, so that a fetch stays cheap as the
log grows.

Why: Tansu's object-store engine keeps each produced record batch as one object (``.../records/<base offset>.batch``)
and, at every fetch of a partition, lists all of that partition's objects. The demo's gateway sends each generation
as it is served, about 2 records a batch, so after 20 minutes a generations partition held ~7,000 objects; one
listing was 1.4 MB of XML and took 0.7 s, and ingest fell minutes behind its input (``BENCHMARKS.md``, "An hour on
the durable embedded broker"). Kafka itself writes batches into segment files and never lists them.

What: once a partition has ``min_batches`` small batches that are older than ``min_age_s`` and not among its
``keep_newest`` newest, runs of adjacent ones are rewritten as one Kafka record batch (v2) each, of at most
``MERGE_BYTES``, under the first one's key; the others are deleted. Every record keeps its offset, timestamp, key,
value and headers (kafka-python's record codec decodes and encodes them; each source batch's CRC is checked first,
and a batch that fails it is left alone). Only what a merge cannot change for any reader is merged: batches with no
producer id (liverl's producers are not idempotent: ``liverl_sdk.client.PRODUCER_ORDER``), not transactional, not
control batches, create-time timestamps, uncompressed, of one leader epoch, and contiguous in offsets. A merged
object's time is its newest source's, so retention (``liverl.stack.objstore.sweep``) deletes it when Kafka would delete
a segment: once its newest record is past ``retention.ms``. The listing of a partition then grows by one key per
``MERGE_BYTES`` of old records instead of one per produced batch.

Readers see one log or the other, never a mix. Tansu serves a fetch as one listing followed by reads of the listed
batches, and a fetch that listed before a merge and read after it would get a merged batch and the batches it
replaced (each record twice, which librdkafka and kafka-python both pass on: checked), or miss records. So a merge
holds the partition's new listings, waits until its reads have been quiet for ``quiet_s`` (the fetches that listed
before are done), applies every merge of the partition with no await in between, and then answers the held
listings with the new view. The partition's consumers wait that long (about ``quiet_s``) once per merge.

Crash safety: before any object changes, a journal under ``<root>/.merges`` names each merge (the surviving key, the
last offset it will cover, the keys it replaces). At start, ``recover`` finishes a merge whose surviving object
already covers its range (deletes the replaced keys, which it holds) and drops the journal of one whose object was
never written. A kill -9 at any point leaves one log, with every record once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

log = logging.getLogger("liverl.stack.objstore.merge")

MERGE_BYTES = 512 << 10
"""The most bytes of one merged batch: half the default ``max.partition.fetch.bytes`` of the Java client, librdkafka,
kafka-python and aiokafka (1 MiB), so a consumer with default settings always takes a merged batch whole."""

HEADER_BYTES = 61
"""A v2 record batch's header: base offset, length, leader epoch, magic, CRC, attributes, last offset delta, first
and max timestamps, producer id and epoch, base sequence, record count."""

RECORDS = "/records/"
BATCH = ".batch"


class Folder(Protocol):
    """What a merge uses of ``liverl.stack.objstore.Folder`` (which imports this module, so this one names it here)."""

    root: Path
    tmp: Path
    fsync: bool
    index: dict[str, list[str]]
    meta: dict[tuple[str, str], tuple[int, float, str]]

    def path(self, bucket: str, key: str) -> Path | None: ...
    def write(self, bucket: str, key: str, data: bytes, mtime: float | None = None) -> str: ...
    def replace_file(self, path: Path, data: bytes, mtime: float | None = None) -> None: ...
    def delete(self, bucket: str, key: str) -> None: ...


@dataclass
class Source:
    """One batch object: its key, base offset (from the key, as Tansu reads it), last offset, bytes and time."""

    key: str
    base: int
    last: int
    data: bytes
    mtime: float


@dataclass
class Merge:
    """A run of adjacent batches to rewrite as one under ``sources[0].key``."""

    sources: list[Source] = field(default_factory=list)
    data: bytes = b""  # the merged batch, once made

    @property
    def size(self) -> int:
        return sum(len(s.data) for s in self.sources)


def partition_of(key: str) -> str | None:
    """The records prefix (``.../partitions/<p>/records/``) of a batch object's key, or None for any other object."""
    i = key.rfind(RECORDS)
    if i < 0 or not key.endswith(BATCH):
        return None
    return key[: i + len(RECORDS)]


def base_offset(key: str) -> int:
    return int(key.rsplit("/", 1)[1][: -len(BATCH)])


def mergeable(data: bytes) -> DefaultRecordBatch | None:
    """The batch, if a merge may rewrite it (the module's docstring lists the conditions), else None."""
    if len(data) < HEADER_BYTES or data[16] != 2:  # magic at byte 16
        return None
    batch = DefaultRecordBatch(bytearray(data))
    if (
        batch.producer_id != -1
        or batch.is_transactional
        or batch.is_control_batch
        or batch.timestamp_type != 0
        or batch.compression_type != 0
        or not batch.validate_crc()
    ):
        return None
    return batch


def merge(sources: list[Source]) -> bytes:
    """One v2 record batch holding every record of ``sources`` (adjacent, in order) with the same offsets,
    timestamps, keys, values and headers, its offsets relative to the first source's base offset (Tansu sets a
    batch's base offset from its key)."""
    base = sources[0].base
    out = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 31,
    )
    expected = base
    for s in sources:
        batch = DefaultRecordBatch(bytearray(s.data))
        for r in batch:
            offset = s.base + r.offset  # r.offset is base (0, as Tansu stores it) + the record's delta
            if offset < expected:
                raise ValueError(f"batch {s.key}: offset {offset} after {expected - 1}: not in order")
            if out.append(offset - base, r.timestamp, r.key, r.value, list(r.headers)) is None:
                raise ValueError("the merged batch is full")
            expected = offset + 1
    data = bytearray(out.build())
    data[12:16] = sources[0].data[12:16]  # the partition leader epoch (outside the CRC), which every source shares
    return bytes(data)


def plan(folder: Folder, bucket: str, prefix: str, keys: list[str], min_age_s: float, now: float) -> list[Merge]:
    """The merges of one partition: runs of adjacent, mergeable, settled batches among ``keys`` (oldest first),
    each of at most ``MERGE_BYTES``, two batches or more. Reads the batches' files."""
    merges: list[Merge] = []
    run = Merge()

    def close():
        nonlocal run
        if len(run.sources) >= 2:
            merges.append(run)
        run = Merge()

    for key in keys:
        meta = folder.meta.get((bucket, key))
        if meta is None:
            close()
            continue
        size, mtime, _ = meta
        if mtime > now - min_age_s:
            break  # settled batches only, from the oldest: the rest of the partition is newer
        if size >= MERGE_BYTES // 2:
            close()  # already large (a merged batch, or a big produce): nothing to gain
            continue
        try:
            data = folder.path(bucket, key).read_bytes()
        except OSError:
            close()
            continue
        batch = mergeable(data)
        if batch is None:
            close()
            continue
        src = Source(key, base_offset(key), base_offset(key) + batch.last_offset_delta, data, mtime)
        prev = run.sources[-1] if run.sources else None
        if prev is not None and (
            src.base != prev.last + 1 or data[12:16] != prev.data[12:16] or run.size + len(data) > MERGE_BYTES
        ):
            close()
        run.sources.append(src)
    close()
    return merges


class Merger:
    """Merges the small batches of the folder's partitions (the module's docstring); the server calls ``read`` on
    every batch read, ``listed`` after every listing and awaits ``hold`` before a listing."""

    def __init__(
        self,
        folder: Folder,
        min_batches: int = 1000,
        keep_newest: int = 64,
        min_age_s: float = 30.0,
        quiet_s: float = 2.0,
        max_hold_s: float = 15.0,
    ):
        self.folder = folder
        self.min_batches, self.keep_newest, self.min_age_s = min_batches, keep_newest, min_age_s
        self.quiet_s, self.max_hold_s = quiet_s, max_hold_s
        self._held: dict[str, asyncio.Event] = {}  # records prefix -> set when its merge is done
        self._active: dict[str, float] = {}  # records prefix -> monotonic time of its last read or listing
        self.merged_batches = 0  # source batches replaced so far (for the log and the tests)

    def read(self, key: str) -> None:
        p = partition_of(key)
        if p is not None:
            self._active[p] = time.monotonic()

    def listed(self, prefix: str) -> None:
        if prefix.endswith(RECORDS):  # a fetch's listing: its reads follow
            self._active[prefix] = time.monotonic()

    async def hold(self, prefix: str) -> None:
        """Wait while a merge holds a partition this listing covers (its prefix is inside the listing's or the
        listing's inside it)."""
        while True:
            waits = [ev for p, ev in self._held.items() if p.startswith(prefix) or prefix.startswith(p)]
            if not waits:
                return
            await asyncio.gather(*(ev.wait() for ev in waits))

    def due(self, bucket: str) -> dict[str, list[str]]:
        """Partitions of ``bucket`` worth merging: their candidate keys (all but the newest ``keep_newest``), for
        those with at least ``min_batches`` candidates smaller than half of ``MERGE_BYTES``."""
        parts: dict[str, list[str]] = {}
        for key in self.folder.index.get(bucket, []):
            p = partition_of(key)
            if p is not None:
                parts.setdefault(p, []).append(key)
        out = {}
        for p, keys in parts.items():
            cands = keys[: max(0, len(keys) - self.keep_newest)]
            small = sum(1 for k in cands if self.folder.meta[(bucket, k)][0] < MERGE_BYTES // 2)
            if small >= self.min_batches:
                out[p] = cands
        return out

    async def run_once(self, now: float | None = None) -> int:
        """Merge every partition that is due; returns how many source batches were replaced."""
        total = 0
        for bucket in list(self.folder.index):
            for prefix, keys in self.due(bucket).items():
                total += await self.merge_partition(bucket, prefix, keys, now)
        return total

    async def merge_partition(self, bucket: str, prefix: str, keys: list[str], now: float | None = None) -> int:
        now = time.time() if now is None else now
        merges = await asyncio.to_thread(plan, self.folder, bucket, prefix, keys, self.min_age_s, now)
        if not merges:
            return 0
        for m in merges:
            m.data = await asyncio.to_thread(merge, m.sources)
        ev = self._held[prefix] = asyncio.Event()
        started = time.monotonic()
        try:
            while True:
                quiet_since = max(self._active.get(prefix, 0.0), started)
                if time.monotonic() - quiet_since >= self.quiet_s:
                    break
                if time.monotonic() - started > self.max_hold_s:
                    log.info("merge of %s put off: its reads were never quiet for %.1f s", prefix, self.quiet_s)
                    return 0
                await asyncio.sleep(0.05)
            # from here to the end, no await: the partition changes at once for every reader
            applied = apply(self.folder, bucket, merges)
        finally:
            del self._held[prefix]
            ev.set()
        n = sum(len(m.sources) for m in merges[:applied])
        self.merged_batches += n
        log.info(
            "merged %d record batches of %s%s into %d (held its listings %.1f s)",
            n,
            bucket + "/",
            prefix,
            applied,
            time.monotonic() - started,
        )
        return n


def _journal_dir(folder: Folder) -> Path:
    return folder.root / ".merges"


def apply(folder: Folder, bucket: str, merges: list[Merge]) -> int:
    """Write the merges: journal, each merged object (its time its newest source's), the replaced objects deleted,
    journal removed. Skips a merge whose sources changed since they were read. Returns how many were applied."""
    live = [
        m
        for m in merges
        if all(folder.meta.get((bucket, s.key), (None, None))[1] == s.mtime for s in m.sources)
        and all(folder.meta[(bucket, s.key)][0] == len(s.data) for s in m.sources)
    ]
    if not live:
        return 0
    jdir = _journal_dir(folder)
    jdir.mkdir(exist_ok=True)
    journal = jdir / f"{uuid.uuid4().hex}.json"
    entries = [
        {"key": m.sources[0].key, "last": m.sources[-1].last, "drop": [s.key for s in m.sources[1:]]} for m in live
    ]
    folder.replace_file(journal, json.dumps({"bucket": bucket, "merges": entries}).encode())
    for m in live:
        first = m.sources[0]
        folder.write(bucket, first.key, m.data, mtime=max(s.mtime for s in m.sources))
        for s in m.sources[1:]:
            folder.delete(bucket, s.key)
    journal.unlink()
    return len(live)


def recover(folder: Folder) -> int:
    """Finish or drop the merges a kill interrupted (the module's docstring); returns how many were finished."""
    jdir = _journal_dir(folder)
    if not jdir.is_dir():
        return 0
    finished = 0
    for journal in sorted(jdir.glob("*.json")):
        try:
            j = json.loads(journal.read_bytes())
        except (OSError, ValueError):
            journal.unlink(missing_ok=True)  # torn before it was renamed into place: nothing was changed after it
            continue
        bucket = j["bucket"]
        for m in j["merges"]:
            path = folder.path(bucket, m["key"])
            if path is None:
                continue  # not a key of this folder: nothing to finish
            try:
                head = path.read_bytes()[:HEADER_BYTES]
            except OSError:
                continue
            if len(head) < HEADER_BYTES:
                continue
            last = base_offset(m["key"]) + int.from_bytes(head[23:27], "big", signed=True)
            if last == m["last"]:  # the merged object is in place: the replaced batches are duplicates of it
                for key in m["drop"]:
                    folder.delete(bucket, key)
                finished += 1
        journal.unlink()
    if finished:
        log.info("finished %d merges a restart interrupted", finished)
    return finished
