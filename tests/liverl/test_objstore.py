"""``liverl.stack.objstore``, the folder the embedded broker keeps its log in, through a real S3 client (boto3): what
Tansu's object-store engine relies on: whole and ranged reads, conditional writes, listings that page, deletes, and the
objects still there after the server restarts (a kill -9 included)."""

from __future__ import annotations

import signal

import boto3
import pytest
from botocore.exceptions import ClientError

from core import procs
from liverl.stack.stack import BROKER_BUCKET, start_object_store


def _client(port: int):
    return boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name="us-east-1",
        aws_access_key_id="liverl",
        aws_secret_access_key="liverl",
    )


def _code(e: pytest.ExceptionInfo) -> str:
    return e.value.response["Error"]["Code"]


def test_reads_writes_conditions_listings_and_a_restart(tmp_path):
    proc, port = start_object_store(tmp_path / "broker", tmp_path / "logs")
    try:
        s3, b = _client(port), BROKER_BUCKET
        etag = s3.put_object(Bucket=b, Key="clusters/c/meta.json", Body=b'{"v": 1}')["ETag"]
        assert s3.get_object(Bucket=b, Key="clusters/c/meta.json")["Body"].read() == b'{"v": 1}'
        head = s3.head_object(Bucket=b, Key="clusters/c/meta.json")
        assert head["ContentLength"] == 8 and head["ETag"] == etag and head["LastModified"]
        assert s3.get_object(Bucket=b, Key="clusters/c/meta.json", Range="bytes=1-3")["Body"].read() == b'"v"'
        with pytest.raises(ClientError) as e:  # create-only
            s3.put_object(Bucket=b, Key="clusters/c/meta.json", Body=b"x", IfNoneMatch="*")
        assert _code(e) == "PreconditionFailed"
        new = s3.put_object(Bucket=b, Key="clusters/c/meta.json", Body=b'{"v": 2}', IfMatch=etag)["ETag"]
        assert new != etag
        with pytest.raises(ClientError) as e:  # an update from a stale read loses
            s3.put_object(Bucket=b, Key="clusters/c/meta.json", Body=b'{"v": 3}', IfMatch=etag)
        assert _code(e) == "PreconditionFailed"
        for off in (0, 269, 537, 801, 1065):
            s3.put_object(Bucket=b, Key=f"clusters/c/t/0/records/{off:020}.batch", Body=b"b" * off)
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=b, Prefix="clusters/c/t/0/records/", PaginationConfig={"PageSize": 2}
        )
        listed = [o["Key"] for page in pages for o in page.get("Contents", [])]
        assert listed == [f"clusters/c/t/0/records/{off:020}.batch" for off in (0, 269, 537, 801, 1065)]
        top = s3.list_objects_v2(Bucket=b, Prefix="clusters/c/", Delimiter="/")
        assert [p["Prefix"] for p in top["CommonPrefixes"]] == ["clusters/c/t/"]
        assert [o["Key"] for o in top["Contents"]] == ["clusters/c/meta.json"]
        s3.delete_object(Bucket=b, Key="clusters/c/t/0/records/00000000000000000000.batch")
        with pytest.raises(ClientError) as e:
            s3.get_object(Bucket=b, Key="clusters/c/t/0/records/00000000000000000000.batch")
        assert _code(e) == "NoSuchKey"
        with pytest.raises(ClientError):
            s3.get_object(Bucket=b, Key="../escape")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc, port = start_object_store(tmp_path / "broker", tmp_path / "logs")
        s3 = _client(port)
        assert s3.get_object(Bucket=b, Key="clusters/c/meta.json")["Body"].read() == b'{"v": 2}'
        assert s3.head_object(Bucket=b, Key="clusters/c/meta.json")["ETag"] == new  # the same object, the same tag
        listed = [o["Key"] for o in s3.list_objects_v2(Bucket=b, Prefix="clusters/c/t/")["Contents"]]
        assert len(listed) == 4
    finally:
        procs.stop([("objstore", proc)], timeout=5)


def test_a_listing_shows_each_object_as_it_is_now_in_pages_as_large_as_asked(tmp_path):
    """Listings are joined from entries rendered once per object version (Tansu lists a partition's batches at every
    fetch): an overwrite or a delete shows at once. A client that names no page size gets every key in one page (one
    round trip per fetch, not one per thousand batches); one that asks gets at most S3's 1,000."""
    proc, port = start_object_store(tmp_path / "broker", tmp_path / "logs")
    try:
        s3, b, prefix = _client(port), BROKER_BUCKET, "clusters/c/t/0/records/"
        keys = [f"{prefix}{i:020}.batch" for i in range(1500)]
        for k in keys:
            s3.put_object(Bucket=b, Key=k, Body=b"x")
        whole = s3.list_objects_v2(Bucket=b, Prefix=prefix)
        assert whole["KeyCount"] == 1500 and not whole["IsTruncated"]
        assert [o["Key"] for o in whole["Contents"]] == keys and {o["Size"] for o in whole["Contents"]} == {1}
        asked = s3.list_objects_v2(Bucket=b, Prefix=prefix, MaxKeys=5000)
        assert asked["KeyCount"] == 1000 and asked["IsTruncated"]
        s3.put_object(Bucket=b, Key=keys[7], Body=b"longer")
        s3.delete_object(Bucket=b, Key=keys[8])
        now = {o["Key"]: o for o in s3.list_objects_v2(Bucket=b, Prefix=prefix)["Contents"]}
        assert len(now) == 1499 and keys[8] not in now
        assert now[keys[7]]["Size"] == 6 and now[keys[7]]["LastModified"] >= now[keys[6]]["LastModified"]
    finally:
        procs.stop([("objstore", proc)], timeout=5)


def test_the_sweep_deletes_expired_batches_from_the_oldest_on_and_keeps_each_partitions_newest(tmp_path):
    """Retention, unit by unit: a ``delete`` topic with ``retention.ms`` loses its batches older than that from the
    start of each partition (not a newer one behind an older one kept), never the newest of a partition; a compacted
    topic, a topic without ``retention.ms`` and one with -1 keep everything."""
    import asyncio
    import json
    import os

    from liverl.stack.objstore import Folder, sweep

    folder = Folder(tmp_path / "broker", fsync=False)
    folder.make_bucket(BROKER_BUCKET)
    configs = {
        "del": [{"name": "retention.ms", "value": "60000"}],
        "cmp": [{"name": "retention.ms", "value": "60000"}, {"name": "cleanup.policy", "value": "compact"}],
        "none": [],
        "ever": [{"name": "retention.ms", "value": "-1"}],
    }
    meta = {"producers": {}, "topics": {t: {"topic": {"name": t, "configs": c}} for t, c in configs.items()}}
    folder.write(BROKER_BUCKET, "clusters/c/meta.json", json.dumps(meta).encode())
    now = 1_000_000.0
    ages = {0: [500, 400, 300], 1: [500, 30, 400], 2: [300]}  # seconds old, oldest batch first

    def batch(topic, p, off):
        return f"clusters/c/topics/{topic}/partitions/{p:010}/records/{off:020}.batch"

    for topic in configs:
        for p, per in ages.items():
            folder.write(BROKER_BUCKET, f"clusters/c/topics/{topic}/partitions/{p:010}/watermark.json", b"{}")
            for off, age in enumerate(per):
                folder.write(BROKER_BUCKET, batch(topic, p, off), b"x")
                path = folder.path(BROKER_BUCKET, batch(topic, p, off))
                os.utime(path, (now - age, now - age))
                folder.meta[(BROKER_BUCKET, batch(topic, p, off))] = folder._stat(path)
    assert asyncio.run(sweep(folder, now=now)) == 3
    left = set(folder.keys(BROKER_BUCKET, "clusters/c/topics/del/"))
    # partition 0: all three expired, the newest stays; 1: the 30-s-old one stops the run, the older one behind it stays
    assert {k for k in left if k.endswith(".batch")} == {
        batch("del", 0, 2),
        batch("del", 1, 1),
        batch("del", 1, 2),
        batch("del", 2, 0),
    }
    assert not (tmp_path / "broker" / BROKER_BUCKET / batch("del", 0, 0)).exists()
    for topic in ("cmp", "none", "ever"):
        assert len([k for k in folder.keys(BROKER_BUCKET, f"clusters/c/topics/{topic}/") if k.endswith(".batch")]) == 7
    assert asyncio.run(sweep(folder, now=now)) == 0  # nothing more: idempotent


def test_the_embedded_broker_deletes_records_past_the_topics_retention_and_serves_the_rest(tmp_path):
    """Through Tansu: records older than their topic's ``retention.ms`` (1 hour) leave the folder (users' content, and
    the length every fetch lists), a new consumer reads from the oldest record left, and the broker goes on taking
    and serving records; the compacted topic keeps its old records. The three first records are made two hours old
    while the stack is down (their files' times), so no step waits on a clock."""
    import json
    import os
    import time

    from core.bus import ensure_topics, make_consumer, make_producer
    from liverl.stack.stack import broker_env, start_broker
    from tests.conftest import free_port

    logs, port = tmp_path / "logs", free_port()
    records = tmp_path / "broker" / BROKER_BUCKET

    def batches(topic):
        return sorted(records.glob(f"clusters/*/topics/{topic}/partitions/*/records/*.batch"))

    def start():
        storage, storage_port = start_object_store(tmp_path / "broker", logs, retention_sweep_s=0.5)
        running = [("broker storage", storage)]
        try:
            running.append(("broker", start_broker(port, logs, f"s3://{BROKER_BUCKET}/", broker_env(storage_port))))
        except BaseException:
            procs.stop(running, timeout=10)
            raise
        return running

    bootstrap = f"127.0.0.1:{port}"
    running = start()
    try:
        ensure_topics(bootstrap, ["r.short"], 1, configs={"retention.ms": "3600000"})
        ensure_topics(bootstrap, ["r.changelog"], 1, configs={"retention.ms": "3600000", "cleanup.policy": "compact"})
        producer = make_producer(bootstrap, linger_ms=0)
        for i in range(3):
            for topic in ("r.short", "r.changelog"):
                producer.send(topic, key=f"k{i}", value=json.dumps({"i": i}).encode()).get(30)
        producer.close()
    finally:
        procs.stop(list(reversed(running)), timeout=10)
    old = time.time() - 7200
    for path in batches("r.short") + batches("r.changelog"):
        os.utime(path, (old, old))
    assert len(batches("r.short")) == 3
    running = start()
    try:
        producer = make_producer(bootstrap, linger_ms=0)
        for i in (3, 4):
            producer.send("r.short", key=f"k{i}", value=json.dumps({"i": i}).encode()).get(30)
        producer.close()
        deadline = time.monotonic() + 60
        while len(batches("r.short")) > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.name for p in batches("r.short")] == [f"{3:020}.batch", f"{4:020}.batch"]
        assert len(batches("r.changelog")) == 3  # compacted: never deleted by age
        consumer = make_consumer(bootstrap, "r-new", ["r.short"])
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=500).values():
                got += [json.loads(m.value)["i"] for m in msgs]
        consumer.close()
        assert got == [3, 4]
    finally:
        procs.stop(list(reversed(running)), timeout=10)
