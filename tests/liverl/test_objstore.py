"""``liverl.objstore``, the folder the embedded broker keeps its log in, through a real S3 client (boto3): what Tansu's
object-store engine relies on: whole and ranged reads, conditional writes, listings that page, deletes, and the
objects still there after the server restarts (a kill -9 included)."""

from __future__ import annotations

import signal

import boto3
import pytest
from botocore.exceptions import ClientError

from liverl.core import procs
from liverl.stack import BROKER_BUCKET, start_object_store


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
