"""What deltas and snapshots share: supported dtypes, checksums, and the checksummed container.

Container (format version 2, integers little-endian)::

    prefix  : magic (8 bytes) | format_version u16 | flags u16 (0) | header_len u32 | payload_len u64
              | blake3(header) (32 bytes)
    payload : the frames (a delta's chunks, a snapshot's tensors), back to back in header order
    header  : zstd-compressed UTF-8 JSON describing the frames
    trailer : blake3(payload) (32 bytes)

The header follows the payload so that an encoder streams frames into one buffer and never copies it.

Checksums. ``tensor_checksum``: xxh3-128 over the dtype name, the shape and the raw little-endian bytes
(~25 GB/s; an integrity check against corruption and mix-ups, not a signature; blobs at rest are also
keyed by sha256 in the blob store). ``checksum`` (THE checksum of a version): blake3 over the sorted
``name<TAB>tensor_checksum`` lines, so it covers names, dtypes, shapes and bytes.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import blake3
import numpy as np
import torch
import xxhash
import zstandard

FORMAT_VERSION = 2
DELTA_MAGIC = b"LRLDELTA"
SNAPSHOT_MAGIC = b"LRLSNAPS"
_PREFIX = struct.Struct("<8sHHIQ32s")  # magic, version, flags, header bytes, payload bytes, blake3(header)
_TRAILER = 32
_THREADED_ABOVE = 8 << 20  # bytes above which zstd compresses one frame with its own worker threads

Blob = bytes | bytearray
"""A container as read: bytes from a file or the blob store, or the bytearray ``pack_container`` builds."""


@dataclass(frozen=True)
class ElementType:
    torch: torch.dtype
    uint: type  # unsigned numpy type of the same width
    bits: int
    mbits: int  # mantissa bits (the exponent field starts here)
    ebits: int  # exponent bits


DTYPES: dict[str, ElementType] = {
    "bfloat16": ElementType(torch.bfloat16, np.uint16, 16, 7, 8),
    "float16": ElementType(torch.float16, np.uint16, 16, 10, 5),
    "float32": ElementType(torch.float32, np.uint32, 32, 23, 8),
    "float8_e4m3fn": ElementType(torch.float8_e4m3fn, np.uint8, 8, 3, 4),
    "float8_e5m2": ElementType(torch.float8_e5m2, np.uint8, 8, 2, 5),
}
_NAME_OF = {d.torch: name for name, d in DTYPES.items()}

if sys.byteorder != "little":  # the format stores raw little-endian bytes
    raise ImportError("deploy.registry.delta supports little-endian hosts only")


class DeltaError(ValueError):
    """A delta or snapshot that cannot be applied: wrong base, truncated, corrupted or malformed."""


# ---------------------------------------------------------------------------------------------- checksums


def dtype_name(t: torch.Tensor) -> str:
    try:
        return _NAME_OF[t.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {t.dtype}; deltas support {sorted(DTYPES)}") from None


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when the tensor is already contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def element_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width (a view; writes go to the tensor)."""
    return byte_view(t).view(DTYPES[dtype_name(t)].uint)


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-128 hex over the dtype name, the shape and the raw bytes of one tensor."""
    h = xxhash.xxh3_128(f"{dtype_name(t)}:{','.join(map(str, t.shape))}\n".encode())
    h.update(byte_view(t).data)  # .data: the array's buffer (numpy types ndarray as one from Python 3.12 only)
    return h.hexdigest()


def combine_checksums(tensor_sums: Mapping[str, str]) -> str:
    h = blake3.blake3(b"liverl-weights-v2\n")
    for name in sorted(tensor_sums):
        if "\t" in name or "\n" in name:
            raise ValueError(f"tensor name {name!r} contains a tab or newline")
        h.update(f"{name}\t{tensor_sums[name]}\n".encode())
    return h.hexdigest()


def checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """THE checksum of a set of weights: blake3 over sorted names and each tensor's ``tensor_checksum``."""
    return combine_checksums({name: tensor_checksum(t) for name, t in state_dict.items()})


# ---------------------------------------------------------------------------------------------- container


def pack_container(magic: bytes, header: dict, payload: bytearray | list[bytes]) -> bytearray:
    """prefix | payload | header | trailer, framed around a payload that was built in place.

    ``payload`` is a bytearray that starts with ``_PREFIX.size`` reserved bytes (see ``_payload_buffer``)
    or a list of frames. The header goes after the payload so that nothing is copied to make room for it.
    """
    if not isinstance(payload, bytearray):
        frames, payload = payload, _payload_buffer()
        for f in frames:
            payload += f
    body = memoryview(payload)[_PREFIX.size :]
    header["payload_bytes"] = len(body)
    trailer = blake3.blake3(body).digest()
    body.release()
    hjson = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hz = zstandard.ZstdCompressor(level=19).compress(hjson)
    payload[: _PREFIX.size] = _PREFIX.pack(
        magic, FORMAT_VERSION, 0, len(hz), header["payload_bytes"], blake3.blake3(hz).digest()
    )
    payload += hz
    payload += trailer
    return payload


def _payload_buffer() -> bytearray:
    return bytearray(_PREFIX.size)


class Output:
    """The growing payload of an encoder: one bytearray written in place behind a write index.

    Appending to a bytearray one frame at a time reallocates and copies it, and glibc keeps the pages of
    every old copy: resident memory reaches several times the output. Here the buffer is reserved large
    (a fresh mapping: its pages cost nothing until written), grows by doubling through ``realloc`` (which
    moves mappings without copying) and is cut to size at the end.
    """

    _RESERVE = 64 << 20

    def __init__(self) -> None:
        self.buf = bytearray()
        _resize(self.buf, self._RESERVE)
        self.n = _PREFIX.size

    def write(self, frame: bytes) -> None:
        end = self.n + len(frame)
        if end > len(self.buf):
            _resize(self.buf, max(end, 2 * len(self.buf)))
        self.buf[self.n : end] = frame
        self.n = end

    def finish(self) -> bytearray:
        _resize(self.buf, self.n)
        return self.buf


def _resize(buf: bytearray, size: int) -> None:
    """Resize a bytearray without initialising new bytes (CPython's PyByteArray_Resize)."""
    if ctypes.pythonapi.PyByteArray_Resize(ctypes.py_object(buf), ctypes.c_ssize_t(size)) != 0:
        raise MemoryError(f"cannot resize the delta buffer to {size} bytes")


def open_container(blob: Blob, magic: bytes, what: str, check_payload: bool = True) -> tuple[dict, memoryview]:
    """Check framing and hashes; return (header, payload). With ``check_payload=False`` only the header."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise DeltaError(f"{what} truncated: expected at least {_PREFIX.size} bytes, got {len(view)}")
    got_magic, version, flags, hlen, plen, hsum = _PREFIX.unpack_from(view)
    if got_magic != magic:
        other = {DELTA_MAGIC: "a delta", SNAPSHOT_MAGIC: "a snapshot"}.get(got_magic, "unknown data")
        raise DeltaError(f"not {what}: magic {got_magic!r} ({other})")
    if version != FORMAT_VERSION:
        raise DeltaError(f"{what} format version {version} is not supported by this build (reads {FORMAT_VERSION})")
    if flags != 0:  # no flag is defined in this version: a set bit is damage (hypothesis found one applying fine)
        raise DeltaError(
            f"{what} corrupted: flags {flags:#06x} set in the prefix (format {FORMAT_VERSION} defines none)"
        )
    expected = _PREFIX.size + plen + hlen + _TRAILER
    if len(view) < expected:
        raise DeltaError(f"{what} truncated: expected {expected} bytes, got {len(view)}")
    if len(view) > expected:
        raise DeltaError(
            f"{what} corrupted: {len(view) - expected} unexpected bytes after the end (expected {expected})"
        )
    hstart = _PREFIX.size + plen
    hz = view[hstart : hstart + hlen]
    if blake3.blake3(hz).digest() != hsum:
        raise DeltaError(f"{what} corrupted: header checksum mismatch")
    try:
        header = json.loads(zstandard.ZstdDecompressor().decompress(hz, max_output_size=1 << 30))
        if int(header["payload_bytes"]) != plen:
            raise ValueError("payload length differs from the prefix")
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as e:
        raise DeltaError(f"{what} corrupted: malformed header ({e})") from None
    payload = view[_PREFIX.size : hstart]
    if check_payload and blake3.blake3(payload).digest() != bytes(view[expected - _TRAILER :]):
        raise DeltaError(f"{what} corrupted: payload checksum mismatch")
    return header, payload


# ---------------------------------------------------------------------------------------------- byte planes


def to_planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes of n elements -> itemsize planes, most significant byte plane first."""
    if itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize)[:, ::-1].T).reshape(-1)


def from_planes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1)[::-1].T).reshape(-1)


def zstd_compress(data: np.ndarray, level: int) -> bytes:
    threads = -1 if data.nbytes > _THREADED_ABOVE else 0
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(data.data)
