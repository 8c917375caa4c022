"""``liverl.stack.batchmerge``: the embedded broker's small record batches merged into larger ones, with every record
kept once, at its offset, for every Kafka client liverl uses, while they read; and a merge a kill interrupted finished
or dropped at the next start."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from core import procs
from liverl.stack import batchmerge
from liverl.stack.batchmerge import MERGE_BYTES, Source, merge, mergeable, plan
from liverl.stack.objstore import Folder
from liverl.stack.stack import BROKER_BUCKET, broker_env, start_broker, start_object_store
from tests.conftest import free_port

PREFIX = "clusters/c/topics/t/partitions/0000000000/records/"


def _batch(n: int, first_ts: int = 1_700_000_000_000, producer_id: int = -1, tag: str = "r") -> bytes:
    """A v2 batch of ``n`` records as Tansu stores it (base offset 0 in the bytes; the key names the real one)."""
    b = DefaultRecordBatchBuilder(2, 0, False, producer_id, 0 if producer_id >= 0 else -1, -1, 1 << 30)
    for i in range(n):
        key = None if i % 3 == 2 else f"{tag}{i}".encode()
        headers = [("h", f"{tag}{i}".encode())] if i % 2 else []
        b.append(i, first_ts + 7 * i, key, f"{tag}-value-{i}".encode() * (i + 1), headers)
    return bytes(b.build())


def _records(data: bytes, base: int) -> list[tuple]:
    return [
        (base + r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in DefaultRecordBatch(bytearray(data))
    ]


def test_a_merged_batch_holds_every_record_at_its_offset_with_its_time_key_value_and_headers():
    sources, base = [], 40
    for j, n in enumerate((1, 3, 2, 5)):
        data = _batch(n, first_ts=1_700_000_000_000 + 1000 * j, tag=f"b{j}-")
        batch = mergeable(data)
        assert batch is not None
        sources.append(Source(f"{PREFIX}{base:020}.batch", base, base + batch.last_offset_delta, data, 0.0))
        base += n
    merged = merge(sources)
    assert merged[12:16] == sources[0].data[12:16]  # the leader epoch, as Tansu wrote it
    out = DefaultRecordBatch(bytearray(merged))
    assert out.validate_crc() and out.last_offset_delta == 10 and out.producer_id == -1
    assert _records(merged, 40) == [r for s in sources for r in _records(s.data, s.base)]
    assert [r[0] for r in _records(merged, 40)] == list(range(40, 51))


def test_a_batch_a_merge_must_not_rewrite_is_left_alone():
    """Idempotent producers' batches (their sequence numbers), and a batch whose CRC fails: a merge would give a
    corrupt batch a valid checksum."""
    assert mergeable(_batch(3, producer_id=7)) is None
    corrupt = bytearray(_batch(3))
    corrupt[-2] ^= 0xFF
    assert mergeable(bytes(corrupt)) is None
    assert mergeable(b"\x00" * 10) is None


def _folder(tmp_path, sizes, mtime):
    folder = Folder(tmp_path / "broker", fsync=False)
    folder.make_bucket(BROKER_BUCKET)
    keys, base = [], 0
    for n in sizes:
        key = f"{PREFIX}{base:020}.batch"
        folder.write(BROKER_BUCKET, key, _batch(n, tag=f"{base}-"), mtime=mtime)
        keys.append(key)
        base += n
    return folder, keys


def test_the_plan_takes_runs_of_settled_adjacent_batches_and_stops_at_the_first_young_one(tmp_path):
    now = 1_000_000.0
    folder, keys = _folder(tmp_path, [2] * 10, now - 100)
    young = folder.write(BROKER_BUCKET, keys[6], _batch(2, tag="12-"), mtime=now - 1)
    assert young
    merges = plan(folder, BROKER_BUCKET, PREFIX, keys, min_age_s=30, now=now)
    assert [[s.key for s in m.sources] for m in merges] == [keys[:6]]
    # a gap in the offsets (a batch missing) ends a run
    folder.delete(BROKER_BUCKET, keys[2])
    merges = plan(folder, BROKER_BUCKET, PREFIX, keys[:6], min_age_s=30, now=now)
    assert [[s.key for s in m.sources] for m in merges] == [keys[:2], keys[3:6]]


def test_a_merge_a_kill_interrupted_is_finished_at_start_and_one_never_written_is_dropped(tmp_path):
    now = time.time()
    folder, keys = _folder(tmp_path, [2, 3, 1, 4], now - 100)
    before = [r for k in keys for r in _records(folder.path(BROKER_BUCKET, k).read_bytes(), batchmerge.base_offset(k))]
    merges = plan(folder, BROKER_BUCKET, PREFIX, keys, min_age_s=30, now=now)
    for m in merges:
        m.data = merge(m.sources)
    # killed after the journal and the merged object, before the replaced batches were deleted
    jdir = tmp_path / "broker" / ".merges"
    jdir.mkdir()
    entry = {"key": keys[0], "last": 9, "drop": keys[1:]}
    (jdir / "a.json").write_text(json.dumps({"bucket": BROKER_BUCKET, "merges": [entry]}))
    folder.write(BROKER_BUCKET, keys[0], merges[0].data, mtime=now - 100)
    folder.delete(BROKER_BUCKET, keys[1])
    again = Folder(tmp_path / "broker", fsync=False)
    assert [k for k in again.index[BROKER_BUCKET] if k.startswith(PREFIX)] == [keys[0]]
    assert _records(again.path(BROKER_BUCKET, keys[0]).read_bytes(), 0) == before
    assert not list(jdir.iterdir())

    # killed after the journal, before the merged object: nothing changes
    folder, keys = _folder(tmp_path / "b", [2, 3], now - 100)
    jdir = tmp_path / "b" / "broker" / ".merges"
    jdir.mkdir()
    (jdir / "b.json").write_text(
        json.dumps({"bucket": BROKER_BUCKET, "merges": [{"key": keys[0], "last": 4, "drop": keys[1:]}]})
    )
    again = Folder(tmp_path / "b" / "broker", fsync=False)
    assert [k for k in again.index[BROKER_BUCKET] if k.startswith(PREFIX)] == keys
    assert not list(jdir.iterdir())


def test_a_merged_object_keeps_its_newest_sources_time_for_retention(tmp_path):
    now = time.time()
    folder, keys = _folder(tmp_path, [2, 2, 2], now - 500)
    folder.write(BROKER_BUCKET, keys[1], folder.path(BROKER_BUCKET, keys[1]).read_bytes(), mtime=now - 200)
    merger = batchmerge.Merger(folder, min_batches=2, keep_newest=0, min_age_s=30, quiet_s=0.0)
    assert asyncio.run(merger.run_once(now)) == 3
    assert folder.index[BROKER_BUCKET][-1] == keys[0] and folder.meta[(BROKER_BUCKET, keys[0])][1] == pytest.approx(
        now - 200
    )


@pytest.mark.slow
def test_consumers_of_every_client_read_each_record_once_while_the_broker_merges_under_them(tmp_path):
    """Through Tansu on the folder, merging every partition with 20 small batches settled for 1 s. A producer sends
    records in batches of 1-3 for 20 s while confluent-kafka, kafka-python and aiokafka consumers read the topic
    again and again, from the start and from offsets inside merged batches, so their fetches list and read the
    batches being merged. Every pass of every reader sees each offset once, in order, with its own value; the merges
    happened while they read, no fetch failed on a batch a merge replaced, and the folder ends with far fewer objects
    than batches sent."""
    from confluent_kafka import Consumer, Producer
    from confluent_kafka import TopicPartition as CTP
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTP

    from core.bus import ensure_topics

    logs, port = tmp_path / "logs", free_port()
    extra = ["--merge-batches", "20", "--merge-every-s", "0.3", "--merge-min-age-s", "1", "--merge-quiet-s", "1"]
    storage, storage_port = start_object_store(tmp_path / "broker", logs, extra_args=extra)
    running = [("broker storage", storage)]
    bootstrap = f"127.0.0.1:{port}"
    stop = threading.Event()
    sent = [0]
    passes: dict[str, int] = {}
    errors: list[BaseException] = []

    def value(i: int) -> bytes:
        return f"record-{i}-".encode() * (1 + i % 5)

    def produce():
        p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all", "enable.idempotence": False})
        i = 0
        while not stop.is_set():
            for _ in range(1 + i % 3):
                p.produce("m", value=value(i), partition=0)
                i += 1
            p.flush(30)  # one batch per flush: many small objects
            sent[0] = i
            time.sleep(0.002)

    def check(name: str, got: list[tuple[int, bytes]], start: int, end: int) -> None:
        offsets = [o for o, _ in got]
        assert offsets[: end - start] == list(range(start, end)), f"{name}: {offsets[:50]}..."
        assert offsets == sorted(set(offsets)), f"{name}: an offset read twice"
        assert all(v == value(o) for o, v in got), f"{name}: a value not at its offset"
        passes[name] = passes.get(name, 0) + 1

    def confluent(start: int, name: str):
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": name, "enable.auto.commit": False})
        while not stop.is_set():
            end = sent[0]
            c.assign([CTP("m", 0, start)])
            got, deadline = [], time.monotonic() + 60
            while (not got or got[-1][0] < end - 1) and time.monotonic() < deadline:
                m = c.poll(0.2)
                if m is not None and not m.error():
                    got.append((m.offset(), m.value()))
            c.unassign()
            check(name, got, start, end)
        c.close()

    def kafka_python(start: int, name: str):
        c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        c.assign([KTP("m", 0)])
        while not stop.is_set():
            end = sent[0]
            c.seek(KTP("m", 0), start)
            got, deadline = [], time.monotonic() + 60
            while (not got or got[-1][0] < end - 1) and time.monotonic() < deadline:
                for msgs in c.poll(200).values():
                    got += [(m.offset, m.value) for m in msgs]
            check(name, got, start, end)
        c.close()

    def aio(start: int, name: str):
        from aiokafka import AIOKafkaConsumer
        from aiokafka import TopicPartition as ATP

        async def go():
            c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
            await c.start()
            c.assign([ATP("m", 0)])
            try:
                while not stop.is_set():
                    end = sent[0]
                    c.seek(ATP("m", 0), start)
                    got, deadline = [], time.monotonic() + 60
                    while (not got or got[-1][0] < end - 1) and time.monotonic() < deadline:
                        for msgs in (await c.getmany(timeout_ms=200)).values():
                            got.extend((m.offset, m.value) for m in msgs)
                    check(name, got, start, end)
            finally:
                await c.stop()

        asyncio.run(go())

    def run(fn, *args):
        def target():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                stop.set()

        t = threading.Thread(target=target, daemon=True)
        t.start()
        return t

    try:
        running.append(("broker", start_broker(port, logs, f"s3://{BROKER_BUCKET}/", broker_env(storage_port))))
        ensure_topics(bootstrap, ["m"], 1)
        threads = [run(produce)]
        while sent[0] < 300:
            time.sleep(0.1)
        threads += [run(confluent, 0, "c0"), run(kafka_python, 0, "k0"), run(aio, 0, "a0")]
        threads += [run(confluent, 101, "c101"), run(kafka_python, 201, "k201"), run(aio, 151, "a151")]
        stop.wait(20)
        stop.set()
        for t in threads:
            t.join(120)
        assert not errors, errors
        merges = (logs / "broker-storage.log").read_text().count("merged ")
        assert merges >= 5, f"{merges} merges while the consumers read"
        # a fetch that listed before a merge and read after it fails (a batch it listed is gone): the merge holds the
        # partition's listings until its reads are quiet, so none did (without the hold: 58 in one run)
        failed = [line for line in (logs / "broker.log").read_text().splitlines() if "NotFound" in line]
        assert not failed, f"{len(failed)} fetches read a batch a merge had replaced: {failed[0][:300]}"
        assert all(passes.get(n, 0) >= 2 for n in ("c0", "k0", "a0", "c101", "k201", "a151")), passes
        objects = list((tmp_path / "broker" / BROKER_BUCKET).glob("clusters/*/topics/m/partitions/*/records/*"))
        assert len(objects) < sent[0] / 2 / 4, f"{len(objects)} objects for {sent[0]} records in batches of 1-3"
        assert max(o.stat().st_size for o in objects) <= MERGE_BYTES + 4096
    finally:
        stop.set()
        procs.stop(list(reversed(running)), timeout=10)


def test_record_batch_crcs_are_computed_in_c():
    """kafka-python checks and writes CRC-32C with the ``crc32c`` package when it is installed and in pure Python
    otherwise. Pure Python, the merge of the join changelog's 1,000 batches (about 40 MB) took ~9 s of the object
    store's CPU in a thread that held the GIL from the server's event loop, and every kafka-python consumer paid the
    same per fetched batch. A dependency lost from the environment would bring that back silently: this says so."""
    from kafka.record import util

    assert util.crc32c_c is not None, "pip install crc32c (a liverl dependency): kafka-python fell back to pure Python"
    data = _batch(50)
    assert util.calc_crc32c(data[21:]) == util.crc32c_py(data[21:])  # the same CRC either way (from attributes on)
    assert mergeable(data) is not None  # and a batch the C path wrote validates
