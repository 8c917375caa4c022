"""Content-addressed blob storage for snapshots and deltas.

A blob's key is the sha256 hex of its bytes, so a key names exactly one content: writers never conflict,
a re-put stores nothing new, and a reader can verify what it got. ``LocalBlobStore`` keeps blobs in a folder
(shared disk for one machine); ``S3BlobStore`` in an S3-compatible bucket (AWS, MinIO, Ceph, R2, ...).
``open_blob_store(url)`` picks one from a location string.

Garbage collection (``Registry.gc``) needs two more things from a store: ``list_keys()`` and ``stat(key)``
(size and last-write time). A re-put of an existing blob refreshes its last-write time, so a blob that a
writer has just (re-)stored is "recent" and survives a collection's grace period even before the writer
commits the registry row that references it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs, urlsplit

_KEY_RE = re.compile(r"[0-9a-f]{64}")


class BlobError(ValueError):
    """A blob is missing, or its content does not match its key."""


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int
    modified_at: float  # Unix time of the last write (or re-put) of the blob


@runtime_checkable
class BlobStore(Protocol):
    def put(self, data: bytes | bytearray) -> str:
        """Store ``data``; return its key (sha256 hex)."""

    def get(self, key: str) -> bytes:
        """The blob's bytes, verified against the key; ``BlobError`` if missing or corrupted."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove the blob; no error if it is not there."""

    def list_keys(self) -> Iterator[str]:
        """Every stored blob's key, in no particular order."""

    def stat(self, key: str) -> BlobInfo:
        """Size and last-write time; ``BlobError`` if missing."""


def _check_key(key: str) -> str:
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise BlobError(f"invalid blob key {key!r}: expected 64 lowercase hex characters (a sha256)")
    return key


class LocalBlobStore:
    """Blobs as files ``<root>/<key[:2]>/<key>``, written atomically (temp file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)[:2] / key

    def put(self, data: bytes | bytearray) -> str:
        key = hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if path.exists():
            try:
                os.utime(path)  # a re-put counts as a fresh write for garbage collection (see module doc)
                return key
            except FileNotFoundError:
                pass  # collected meanwhile: write it again
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return key

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobError(f"blob {key[:12]}… not found in {self.root}") from None
        if hashlib.sha256(data).hexdigest() != key:
            raise BlobError(f"blob {key[:12]}… in {self.root} is corrupted (content does not match its sha256)")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_keys(self) -> Iterator[str]:
        """Keys of the blob files (temp files of writes in progress are not blobs)."""
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if _KEY_RE.fullmatch(f.name) and f.name.startswith(sub.name):
                        yield f.name

    def stat(self, key: str) -> BlobInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise BlobError(f"blob {key[:12]}… not found in {self.root}") from None
        return BlobInfo(key, st.st_size, st.st_mtime)

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"


class S3BlobStore:
    """Blobs as objects ``<prefix>/<key[:2]>/<key>`` in an S3-compatible bucket, via boto3.

    ``client``: a ready boto3 S3 client (tests, custom sessions); otherwise one is made from the standard
    AWS credential chain with ``endpoint_url`` / ``region_name``. ``client_kwargs`` go to ``boto3.client``.
    Uploads carry the sha256 (``ChecksumSHA256``), so the service rejects a body damaged in transit; reads
    are verified against the key here. A re-put uploads again (objects are immutable and content-addressed,
    so this only refreshes the object's last-modified time, which garbage collection relies on).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client: Any = None,
        region_name: str | None = None,
        **client_kwargs: Any,
    ):
        if not bucket:
            raise ValueError("S3BlobStore needs a bucket name, e.g. s3://my-bucket/liverl/blobs")
        self.bucket, self.prefix, self.endpoint_url = bucket, prefix.strip("/"), endpoint_url
        if client is None:
            import boto3  # noqa: PLC0415 boto3: only the S3 store loads it

            client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region_name, **client_kwargs)
        elif endpoint_url is not None or region_name is not None or client_kwargs:
            raise ValueError("pass either a ready S3 client or endpoint_url/region_name/client options, not both")
        self.client = client

    def _key(self, key: str) -> str:
        name = f"{_check_key(key)[:2]}/{key}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @staticmethod
    def _is_missing(e: Exception) -> bool:
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def put(self, data: bytes | bytearray) -> str:
        digest = hashlib.sha256(data).digest()
        key = digest.hex()
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, ChecksumSHA256=base64.b64encode(digest).decode()
        )
        return key

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError  # noqa: PLC0415 botocore: only the S3 store loads it

        try:
            data = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if self._is_missing(e):
                raise BlobError(f"blob {key[:12]}… not found in {self._where()}") from None
            raise
        if hashlib.sha256(data).hexdigest() != key:
            raise BlobError(f"blob {key[:12]}… in {self._where()} is corrupted (content does not match its sha256)")
        return data

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError  # noqa: PLC0415 botocore: only the S3 store loads it

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if self._is_missing(e):
                return None
            raise

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list_keys(self) -> Iterator[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/" if self.prefix else ""
        )
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                if _KEY_RE.fullmatch(name) and obj["Key"] == self._key(name):
                    yield name

    def stat(self, key: str) -> BlobInfo:
        head = self._head(key)
        if head is None:
            raise BlobError(f"blob {key[:12]}… not found in {self._where()}")
        return BlobInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp())

    def __repr__(self) -> str:
        return f"S3BlobStore({self._where()!r}" + (
            f", endpoint_url={self.endpoint_url!r})" if self.endpoint_url else ")"
        )


_S3_OPTIONS = ("endpoint_url", "region")


def open_blob_store(url: str | os.PathLike) -> BlobStore:
    """The blob store at ``url``: a folder (``/path``, ``relative/path``, ``file:///path``) or
    ``s3://bucket[/prefix][?endpoint_url=http://host:9000&region=eu-west-1]``.

    S3 endpoint: the ``endpoint_url`` query parameter, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    from the environment, else AWS. Credentials come from the standard AWS chain (env, profile, role).
    """
    url = os.fspath(url)
    if not url:
        raise ValueError("empty blob store location; give a folder or s3://bucket/prefix")
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path:
            raise ValueError(f"blob store URL {url!r} names no folder; use file:///absolute/path")
        return LocalBlobStore(path)
    if url.startswith("s3://"):
        parts = urlsplit(url)
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
        unknown = sorted(set(query) - set(_S3_OPTIONS))
        if unknown:
            raise ValueError(f"blob store URL {url!r}: unknown option(s) {unknown}; supported: {list(_S3_OPTIONS)}")
        endpoint = (
            query.get("endpoint_url", [None])[-1]
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        return S3BlobStore(
            parts.netloc, prefix=parts.path, endpoint_url=endpoint, region_name=query.get("region", [None])[-1]
        )
    scheme = urlsplit(url).scheme
    if len(scheme) > 1 and "://" in url:  # (a one-letter "scheme" is a Windows drive)
        raise ValueError(f"unsupported blob store URL {url!r}: use a folder, file:///folder or s3://bucket/prefix")
    return LocalBlobStore(url)
