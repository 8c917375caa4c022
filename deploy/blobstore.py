"""Content-addressed blob storage for snapshots and deltas.

A blob's key is the sha256 hex of its bytes, so a key names exactly one content: writers never conflict,
a re-put is a no-op, and a reader can verify what it got. ``LocalBlobStore`` keeps blobs in a folder
(shared disk for one machine); an object store (S3, GCS) would implement the same four methods.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable


class BlobError(ValueError):
    """A blob is missing, or its content does not match its key."""


@runtime_checkable
class BlobStore(Protocol):
    def put(self, data: bytes) -> str:
        """Store ``data``; return its key (sha256 hex)."""

    def get(self, key: str) -> bytes:
        """The blob's bytes, verified against the key; ``BlobError`` if missing or corrupted."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...


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

    def put(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if path.exists():
            return key
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

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"
