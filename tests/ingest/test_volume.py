"""At production volume, recovery and expiry do work proportional to what they need, not to the table.

A join table of ``ENTRIES`` generations (waiting and judged, ``PAYLOAD`` bytes each) plus a few pending feedback
events, in the real RocksDB store (and the in-memory one). Counted, not timed: the keys the store's indexes visit
(``JoinTable.reads``) and the Python memory allocated at peak (tracemalloc), so the test does not depend on the
machine's load. Redis and the broker are the real ones.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import resource
import time
import tracemalloc
import uuid

import pytest
import redis

from core.config import load_config
from core.schemas import FeedbackEvent
from ingest.entry import JUDGED, PENDING, WAITING, pack, unpack
from ingest.join import Ingest, Source
from ingest.metrics import IngestMetrics
from ingest.table import JoinTable, partition_of
from tests.ingest.test_fuzz import Broker

NOW = 1.8e9
# the volume, 2,000,000 entries of 5 KB (10 GB on disk), runs with LIVERL_VOLUME_ENTRIES=2000000
# LIVERL_VOLUME_PAYLOAD=5120 (BENCHMARKS.md); CI's run is a tenth of the entries at a tenth of the size
ENTRIES = int(os.environ.get("LIVERL_VOLUME_ENTRIES", 200_000))
PAYLOAD = int(os.environ.get("LIVERL_VOLUME_PAYLOAD", 512))
PARTS = 2


@pytest.fixture
def env(stack, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cfg = load_config(
        env={}, state_dir=str(tmp_path), redis__url=stack.redis_url, topics__prefix=prefix, ingest__heldout_share=0.0
    )
    metrics = IngestMetrics(prefix, stack.redis_url)
    yield cfg, metrics
    r = redis.Redis.from_url(stack.redis_url)
    for k in r.scan_iter(f"{prefix}:*", count=1000):
        r.delete(k)
    r.close()


def _write(table: JoinTable, entries) -> None:
    """Put entries (an iterable: 2 M of 5 KB do not fit in memory at once) straight into the partition databases (as
    a changelog restore does), 10,000 at a time."""
    entries = iter(entries)
    while chunk := list(itertools.islice(entries, 10_000)):
        by_part: dict[int, list] = {}
        for gid, v in chunk:
            by_part.setdefault(partition_of(gid.encode(), PARTS), []).append((gid.encode(), v))
        for p, changes in by_part.items():
            table.parts[p].apply(changes, None)


def _pending(i: int, t: float) -> bytes:
    fb = FeedbackEvent(feedback_id=f"f-p{i}", generation_id=f"p{i}", kind="accept", ts=NOW)
    meta = {"f": fb.feedback_id, "kts": t, "src": ["feedback", partition_of(f"p{i}".encode(), PARTS), i, f"p{i}"]}
    return pack(PENDING, t, meta, fb.model_dump_json().encode())


def test_recovery_reads_only_the_pending_feedback_of_a_large_table(env, tmp_path):
    """200,000 entries of half a kilobyte (100 MB) and 2,000 pending: a rebalance's recovery visits the 2,000 pending
    index keys and allocates a few megabytes at peak. Before the pending index, it read the whole table into one
    list (over 100 MB here, at 100 generations/s of 5 KB tens of GB) on the event loop."""
    cfg, metrics = env
    pending = 2000
    # incompressible payloads, as token ids and log-probs nearly are: each entry a different slice of random bytes
    # (a repeated byte compressed 10 GB to 0.7 GB on disk)
    noise = random.Random(0).randbytes(1 << 20)
    table = JoinTable("unused-changelog", PARTS, tmp_path / "ingest")
    table.hold(set(range(PARTS)))
    meta = {"v": 1, "f": "x", "k": "accept"}
    at = [(i * 7919) % (len(noise) - PAYLOAD) for i in range(4096)]
    _write(
        table,
        (
            (f"g{i}", pack(WAITING if i % 2 else JUDGED, NOW - i * 0.01, meta, noise[at[i % 4096] :][:PAYLOAD]))
            for i in range(ENTRIES)
        ),
    )
    _write(table, [(f"p{i}", _pending(i, NOW - 100.0 + i * 0.01)) for i in range(pending)])
    table.close()  # a restart: the databases are read back from disk
    table.hold(set(range(PARTS)))

    async def run():
        ing = Ingest(cfg, metrics, table, Broker())
        try:
            before = table.reads()
            tracemalloc.start()
            t0 = time.monotonic()
            await ing.restore()
            took = time.monotonic() - t0
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (MB, the whole test process's peak)
            disk = sum(f.stat().st_size for f in (tmp_path / "ingest").rglob("*") if f.is_file()) / 1e9
            print(
                f"\nrecovery of {ENTRIES:,} entries ({disk:.2f} GB on disk) of {PAYLOAD:,} B and {pending:,} pending: "
                f"{took:.2f} s, {table.reads() - before:,} keys read, {peak / 1e6:.1f} MB allocated at peak, "
                f"process peak RSS {rss:.0f} MB"
            )
            return ing, table.reads() - before, peak
        finally:
            await metrics.close()

    try:
        ing, reads, peak = asyncio.run(run())
        assert reads == pending  # the pending index only: no waiting or judged entry visited
        assert ing.pending == pending and list(ing.index.entries)[:3] == ["p0", "p1", "p2"]  # oldest first
        assert peak < 2000 * pending, f"recovery allocated {peak} bytes at peak for {pending} pending entries"
    finally:
        table.close()


@pytest.mark.parametrize("store", ["rocksdb", "memory"])
def test_expiry_visits_only_the_entries_due(env, stack, tmp_path, store):
    """The expiry timer reads the expiry index up to the entries due: it drops the waiting generations and
    judgements past their TTLs, cuts the sample out of accepts judged more than ``revert_sample_ttl_s`` ago, and
    deletes the index keys of entries that moved on (a waiting entry judged since), visiting nothing else. A second
    run visits nothing."""
    cfg, metrics = env
    ic = cfg.ingest
    due = 300
    body = b"x" * PAYLOAD
    judged = {"f": "x", "v": 1, "k": "accept"}
    fresh = [
        (f"g{i}", pack(WAITING if i % 2 else JUDGED, NOW - 60.0, judged, b"" if i % 2 == 0 else body))
        for i in range(ENTRIES // 4)
    ]
    old_waiting = [(f"w{i}", pack(WAITING, NOW - ic.generation_ttl_s - 10, None, body)) for i in range(due)]
    old_judged = [(f"j{i}", pack(JUDGED, NOW - ic.judged_ttl_s - 10, judged)) for i in range(due)]
    kept_sample = [(f"a{i}", pack(JUDGED, NOW - ic.revert_sample_ttl_s - 10, judged, body)) for i in range(due)]
    moved_on = [(f"m{i}", pack(WAITING, NOW - ic.generation_ttl_s - 10, None, body)) for i in range(due)]
    judged_since = [(f"m{i}", pack(JUDGED, NOW - 60.0, judged)) for i in range(due)]
    table = JoinTable("unused-changelog", PARTS, tmp_path / "ingest" if store == "rocksdb" else None)
    table.hold(set(range(PARTS)))

    async def run():
        from aiokafka import AIOKafkaProducer

        from core.bus import ensure_topics
        from ingest.table import Outbox, changelog_topic

        table.topic = changelog_topic(cfg.topics.prefix)
        ensure_topics(stack.bootstrap, [table.topic], PARTS)
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        ing = Ingest(cfg, metrics, table, Broker())
        try:
            before = table.reads()
            dropped = await ing.evict_old(now=NOW, chunk=97)
            first = table.reads() - before
            changes = dict(table.buffered)
            await table.flush(Outbox(producer))
            before = table.reads()
            again = await ing.evict_old(now=NOW)
            return dropped, first, changes, again, table.reads() - before
        finally:
            await producer.stop()
            await metrics.close()

    _write(table, fresh + old_waiting + old_judged + kept_sample + moved_on)
    _write(table, judged_since)
    try:
        dropped, first, changes, again, second = asyncio.run(run())
        assert dropped == 2 * due and again == 0
        assert first == 4 * due and second == 0  # the due entries and the stale keys of those judged since, only
        assert {g for g, v in changes.items() if v is None} == {g for g, _ in old_waiting + old_judged}
        cut = {g: v for g, v in changes.items() if v is not None}
        assert set(cut) == {g for g, _ in kept_sample}
        assert all(unpack(v)[3] == b"" and unpack(v)[2] == judged for v in cut.values())  # the judgement stays
        assert all(table.get(g) == v for g, v in judged_since)
    finally:
        table.close()


def test_a_revert_after_the_sample_is_cut_is_counted_and_trains_nothing(env):
    cfg, metrics = env
    broker = Broker()
    table: dict = {}
    gid = "gen-late-revert"

    async def run():
        ing = Ingest(cfg, metrics, table, broker)
        ing.recovered()
        table[gid] = pack(
            JUDGED, NOW - cfg.ingest.revert_sample_ttl_s - 1, {"f": "f1", "v": 3, "k": "accept"}, b'{"sample": 1}'
        )
        await ing.evict_old(now=NOW)
        fb = FeedbackEvent(feedback_id="f2", generation_id=gid, kind="revert", ts=NOW)
        await ing.process([(Source(cfg.topics.feedback, 0, 1, gid), fb.to_bytes())], now=NOW)
        await metrics.close()

    asyncio.run(run())
    assert unpack(table[gid])[2].get("r") == "f2"  # counted as reverted
    assert broker.of(cfg.topics.samples) == [] and broker.of(cfg.topics.dead_letters) == []


def test_a_database_from_before_the_indexes_is_read_again_from_the_changelog(tmp_path):
    """A partition database written before the stores kept their indexes has none: it is emptied (its files removed,
    no per-key work) so that the restore reads the changelog from the start and rebuilds entries and indexes."""
    from rocksdict import Options, Rdict

    from ingest.store import OFFSET_KEY, open_store

    path = tmp_path / "join-0"
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    old = Rdict(str(path), options=opts)
    old[b"gen-a"] = _pending(0, NOW)
    old[OFFSET_KEY] = b"41"
    old.close()
    store = open_store(path)
    try:
        assert store.offset is None and store.get(b"gen-a") is None and list(store.pending()) == []
        store.apply([(b"gen-a", _pending(0, NOW))], 41)
        store.close()
        store = open_store(path)  # the new format stays
        assert store.offset == 41 and [k for k, _ in store.pending()] == [b"gen-a"]
    finally:
        store.close()
