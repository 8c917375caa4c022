"""Blob stores: the folder store, the S3 store and ``open_blob_store``.

S3BlobStore runs against moto's ThreadedMotoServer (fixture ``s3_endpoint``), a stand-in: this machine has no
S3 service, while moto speaks the S3 wire protocol over HTTP, so boto3's real request path is exercised
(signing, uploads with checksums, 404s, list pagination), not a mocked client.
"""

from __future__ import annotations

import hashlib
import os
import time

import boto3
import pytest

from deploy.registry.blobstore import BlobError, LocalBlobStore, S3BlobStore, open_blob_store


def test_local_list_keys_stat_and_reput_refreshes_mtime(tmp_path):
    store = LocalBlobStore(tmp_path)
    keys = {store.put(f"blob {i}".encode()) for i in range(5)}
    (tmp_path / keys.copy().pop()[:2] / ".abcd1234.x.tmp").write_bytes(b"half-written")  # a write in progress
    (tmp_path / "notes.txt").write_text("not a blob")
    assert set(store.list_keys()) == keys
    key = store.put(b"blob 0")
    info = store.stat(key)
    assert info.key == key and info.size == len(b"blob 0") and abs(info.modified_at - time.time()) < 60
    os.utime(store._path(key), (time.time() - 7200, time.time() - 7200))
    assert store.stat(key).modified_at < time.time() - 3600
    assert store.put(b"blob 0") == key and store.stat(key).modified_at > time.time() - 60  # re-put: fresh again
    store.delete(key)
    with pytest.raises(BlobError, match="not found"):
        store.stat(key)
    store.delete(key)  # idempotent


def s3_store(bucket: str, prefix: str, endpoint: str) -> S3BlobStore:
    return S3BlobStore(bucket, prefix=prefix, endpoint_url=endpoint)


def test_s3_round_trip_verify_list_and_stat(s3_bucket, s3_env):
    store = s3_store(s3_bucket, "liverl/blobs", s3_env)
    key = store.put(b"hello")
    assert key == hashlib.sha256(b"hello").hexdigest()
    assert store.put(b"hello") == key and store.exists(key) and store.get(key) == b"hello"
    info = store.stat(key)
    assert info.size == 5 and abs(info.modified_at - time.time()) < 120
    client = boto3.client("s3", endpoint_url=s3_env)
    assert client.head_object(Bucket=s3_bucket, Key=f"liverl/blobs/{key[:2]}/{key}")["ContentLength"] == 5

    # list_keys: paginates, and sees only this prefix's blobs
    other = s3_store(s3_bucket, "elsewhere", s3_env)
    other_key = other.put(b"not mine")
    client.put_object(Bucket=s3_bucket, Key="liverl/blobs/README", Body=b"not a blob")
    many = {store.put(f"blob {i}".encode()) for i in range(1005)}  # more than one 1000-key page
    assert set(store.list_keys()) == many | {key}
    assert set(other.list_keys()) == {other_key}

    # a corrupted object is refused, a missing one says so
    client.put_object(Bucket=s3_bucket, Key=f"liverl/blobs/{key[:2]}/{key}", Body=b"hellO")
    with pytest.raises(BlobError, match="corrupted"):
        store.get(key)
    store.delete(key)
    store.delete(key)  # idempotent
    assert not store.exists(key)
    with pytest.raises(BlobError, match="not found"):
        store.get(key)
    with pytest.raises(BlobError, match="not found"):
        store.stat(key)
    with pytest.raises(BlobError, match="invalid blob key"):
        store.get("../../etc/passwd")


def test_s3_without_prefix_and_with_a_given_client(s3_bucket, s3_env):
    client = boto3.client("s3", endpoint_url=s3_env)
    store = S3BlobStore(s3_bucket, client=client)
    key = store.put(b"x" * 10)
    assert client.get_object(Bucket=s3_bucket, Key=f"{key[:2]}/{key}")["Body"].read() == b"x" * 10
    assert list(store.list_keys()) == [key]
    with pytest.raises(ValueError, match="either a ready S3 client"):
        S3BlobStore(s3_bucket, client=client, endpoint_url=s3_env)
    with pytest.raises(ValueError, match="needs a bucket"):
        S3BlobStore("", client=client)


def test_open_blob_store_picks_the_store(tmp_path, s3_bucket, s3_env, monkeypatch):
    assert isinstance(open_blob_store(tmp_path / "a"), LocalBlobStore)
    assert open_blob_store(str(tmp_path / "b")).root == tmp_path / "b"
    assert open_blob_store(f"file://{tmp_path / 'c'}").root == tmp_path / "c"
    monkeypatch.chdir(tmp_path)
    assert open_blob_store("rel/blobs").root.resolve() == tmp_path / "rel" / "blobs"

    s3 = open_blob_store(f"s3://{s3_bucket}/deep/prefix/")  # endpoint from AWS_ENDPOINT_URL
    assert isinstance(s3, S3BlobStore) and (s3.bucket, s3.prefix, s3.endpoint_url) == (s3_bucket, "deep/prefix", s3_env)
    key = s3.put(b"via env")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3q = open_blob_store(f"s3://{s3_bucket}/deep/prefix?endpoint_url={s3_env}&region=us-east-1")
    assert s3q.endpoint_url == s3_env and s3q.get(key) == b"via env"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env)
    assert open_blob_store(f"s3://{s3_bucket}").endpoint_url == s3_env

    with pytest.raises(ValueError, match="unknown option"):
        open_blob_store(f"s3://{s3_bucket}/p?endpoint={s3_env}")
    with pytest.raises(ValueError, match="unsupported blob store URL"):
        open_blob_store("gs://bucket/prefix")
    with pytest.raises(ValueError, match="needs a bucket"):
        open_blob_store("s3:///prefix")
    with pytest.raises(ValueError, match="names no folder"):
        open_blob_store("file://")
    with pytest.raises(ValueError, match="empty"):
        open_blob_store("")


def test_config_blob_dir_goes_through_the_factory(cfg, s3_bucket, s3_env):
    """``registry.blob_dir`` (the existing field) may now be an s3:// URL; unset, blobs stay in the state folder."""
    assert isinstance(open_blob_store(cfg.blob_location), LocalBlobStore)
    cfg.registry.blob_dir = f"s3://{s3_bucket}/liverl"
    store = open_blob_store(cfg.blob_location)
    assert isinstance(store, S3BlobStore) and (store.bucket, store.prefix) == (s3_bucket, "liverl")
