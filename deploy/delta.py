"""Lossless weight deltas and snapshots: the bytes that move a policy version from the learner to the fleet.

Why this codec: between consecutive RL versions most bf16 elements are bit-identical (FIELD_NOTES: >98%
per step at small learning rates), so ``base XOR target`` is mostly zero bytes. Splitting each element's
bytes into planes (all high bytes, then all low bytes: "byte grouping", as in ZipNN) puts the sign/exponent
bytes together and the noisy mantissa bytes together, which zstd compresses much better than interleaved.
Unchanged tensors are skipped outright. XOR is its own inverse, so one delta takes A→B and B→A: a rollback
needs no second blob.

Container (format version 1, all integers little-endian)::

    prefix  : magic (8 bytes) | format_version u16 | flags u16 (0) | header_len u32 | sha256(header) (32 bytes)
    header  : UTF-8 JSON, see ``encode_delta`` / ``encode_snapshot``
    payload : one zstd frame per changed tensor, at the header's offset/length
    trailer : sha256(payload) (32 bytes)

Verification happens before anything is built: container framing and both checksums, then that the input
weights are exactly at one end of the delta (names, dtypes, shapes, per-tensor sha256), then each decoded
tensor against its recorded sha256. Only then is the output assembled. Inputs are never mutated.

Checksums: ``tensor_checksum`` is sha256 over the dtype name, the shape and the raw little-endian bytes;
``checksum`` (THE checksum of a version) is sha256 over the sorted ``name<TAB>tensor_checksum`` lines, so
it covers names, dtypes, shapes and bytes and can be recomputed from a delta header without the weights.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

FORMAT_VERSION = 1
DELTA_MAGIC = b"LRLDELTA"
SNAPSHOT_MAGIC = b"LRLSNAPS"
_PREFIX = struct.Struct("<8sHHI32s")
_TRAILER = 32
_THREADED_ABOVE = 8 << 20  # bytes of one tensor above which zstd compresses with worker threads

# dtype name -> (torch dtype, unsigned int numpy type of the same width, used to count changed elements)
DTYPES: dict[str, tuple[torch.dtype, type]] = {
    "bfloat16": (torch.bfloat16, np.uint16),
    "float16": (torch.float16, np.uint16),
    "float32": (torch.float32, np.uint32),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8),
    "float8_e5m2": (torch.float8_e5m2, np.uint8),
}
_NAME_OF = {dt: name for name, (dt, _) in DTYPES.items()}

if sys.byteorder != "little":  # the format stores raw little-endian bytes
    raise ImportError("deploy.delta supports little-endian hosts only")


class DeltaError(ValueError):
    """A delta or snapshot that cannot be applied: wrong base, truncated, corrupted or malformed."""


# ---------------------------------------------------------------------------------------------- checksums


def _dtype_name(t: torch.Tensor) -> str:
    try:
        return _NAME_OF[t.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {t.dtype}; deltas support {sorted(DTYPES)}") from None


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view when the tensor is already contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex over the dtype name, the shape and the raw bytes of one tensor."""
    h = hashlib.sha256(f"{_dtype_name(t)}:{','.join(map(str, t.shape))}\n".encode())
    h.update(_raw(t))
    return h.hexdigest()


def _combine(tensor_sums: Mapping[str, str]) -> str:
    h = hashlib.sha256(b"liverl-weights-v1\n")
    for name in sorted(tensor_sums):
        if "\t" in name or "\n" in name:
            raise ValueError(f"tensor name {name!r} contains a tab or newline")
        h.update(f"{name}\t{tensor_sums[name]}\n".encode())
    return h.hexdigest()


def checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """THE checksum of a set of weights: sha256 over sorted names and each tensor's ``tensor_checksum``."""
    return _combine({name: tensor_checksum(t) for name, t in state_dict.items()})


# ---------------------------------------------------------------------------------------------- planes


def _to_planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes of n elements -> itemsize planes, most significant byte plane first."""
    if itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize)[:, ::-1].T).reshape(-1)


def _from_planes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1:
        return planes
    return np.ascontiguousarray(planes.reshape(itemsize, -1)[::-1].T).reshape(-1)


def _compress(data: np.ndarray, level: int) -> bytes:
    threads = -1 if data.nbytes > _THREADED_ABOVE else 0
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(data)


def _decompress(frame: bytes | memoryview, nbytes: int, what: str) -> np.ndarray:
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta corrupted: tensor {what!r} does not decompress ({e})") from None
    if len(out) != nbytes:
        raise DeltaError(f"delta corrupted: tensor {what!r} decompressed to {len(out)} bytes, expected {nbytes}")
    return np.frombuffer(out, dtype=np.uint8)


def _build(raw: np.ndarray, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """A fresh, writable, contiguous tensor from raw bytes (copies, so the result owns its memory)."""
    dtype = DTYPES[dtype_name][0]
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------- container


def _pack(magic: bytes, header: dict, chunks: list[bytes]) -> bytes:
    payload = b"".join(chunks)
    header["payload_bytes"] = len(payload)
    hjson = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    prefix = _PREFIX.pack(magic, FORMAT_VERSION, 0, len(hjson), hashlib.sha256(hjson).digest())
    return b"".join([prefix, hjson, payload, hashlib.sha256(payload).digest()])


def _unpack_header(blob: bytes, magic: bytes, what: str) -> tuple[dict, int]:
    """Check the prefix and header checksum; return (header, payload offset). Does not read the payload."""
    if len(blob) < _PREFIX.size:
        raise DeltaError(f"{what} truncated: expected at least {_PREFIX.size} bytes, got {len(blob)}")
    got_magic, version, _flags, hlen, hsum = _PREFIX.unpack_from(blob)
    if got_magic != magic:
        other = {DELTA_MAGIC: "a delta", SNAPSHOT_MAGIC: "a snapshot"}.get(got_magic, "unknown data")
        raise DeltaError(f"not {what}: magic {got_magic!r} ({other})")
    if version != FORMAT_VERSION:
        raise DeltaError(f"{what} format version {version} is not supported by this build (reads {FORMAT_VERSION})")
    end = _PREFIX.size + hlen
    if len(blob) < end:
        raise DeltaError(f"{what} truncated: expected at least {end} bytes, got {len(blob)}")
    hjson = bytes(blob[_PREFIX.size:end])
    if hashlib.sha256(hjson).digest() != hsum:
        raise DeltaError(f"{what} corrupted: header checksum mismatch")
    return json.loads(hjson), end


def _payload(blob: bytes, header: dict, start: int, what: str) -> memoryview:
    """Check total length and the payload checksum; return the payload."""
    expected = start + header["payload_bytes"] + _TRAILER
    if len(blob) < expected:
        raise DeltaError(f"{what} truncated: expected {expected} bytes, got {len(blob)}")
    if len(blob) > expected:
        raise DeltaError(f"{what} corrupted: {len(blob) - expected} unexpected bytes after the end (expected {expected})")
    view = memoryview(blob)
    payload = view[start:start + header["payload_bytes"]]
    if hashlib.sha256(payload).digest() != bytes(view[expected - _TRAILER:]):
        raise DeltaError(f"{what} corrupted: payload checksum mismatch")
    return payload


# ---------------------------------------------------------------------------------------------- deltas


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a delta. ``offset`` is None when the tensor is bit-identical at both ends."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    base_sha256: str
    target_sha256: str
    offset: int | None
    length: int
    changed_elements: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype][0].itemsize


@dataclass(frozen=True)
class DeltaHeader:
    format_version: int
    base_version: int
    target_version: int
    base_checksum: str
    target_checksum: str
    tensors: tuple[TensorEntry, ...]
    payload_bytes: int

    @property
    def changed(self) -> tuple[TensorEntry, ...]:
        return tuple(e for e in self.tensors if e.offset is not None)

    @property
    def raw_bytes(self) -> int:
        """Size of the full weights (what a snapshot would hold before compression)."""
        return sum(e.nbytes for e in self.tensors)

    @property
    def changed_fraction(self) -> float:
        """Fraction of elements whose bits differ between base and target."""
        total = sum(e.numel for e in self.tensors)
        return sum(e.changed_elements for e in self.tensors) / total if total else 0.0


def encode_delta(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], base_version: int,
                 target_version: int, level: int = 3) -> bytes:
    """Encode target as (base XOR target) in byte planes, zstd per changed tensor; unchanged tensors cost only a header line.

    Both ends must have the same names, dtypes and shapes (an architecture change needs a snapshot).
    """
    if set(base) != set(target):
        missing, extra = sorted(set(base) - set(target)), sorted(set(target) - set(base))
        raise ValueError(f"base and target differ in tensor names: only in base {missing[:5]}, only in target {extra[:5]}")
    entries, chunks, offset = [], [], 0
    base_sums, target_sums = {}, {}
    for name in sorted(base):
        b, t = base[name], target[name]
        if b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
            raise ValueError(f"tensor {name!r}: base is {b.dtype}{tuple(b.shape)}, target is {t.dtype}{tuple(t.shape)}")
        dtype = _dtype_name(b)
        bsum, tsum = tensor_checksum(b), tensor_checksum(t)
        base_sums[name], target_sums[name] = bsum, tsum
        entry = {"name": name, "dtype": dtype, "shape": list(b.shape), "base_sha256": bsum, "target_sha256": tsum,
                 "offset": None, "length": 0, "changed_elements": 0}
        if bsum != tsum:
            xor = np.bitwise_xor(_raw(b), _raw(t))
            frame = _compress(_to_planes(xor, b.element_size()), level)
            entry.update(offset=offset, length=len(frame),
                         changed_elements=int(np.count_nonzero(xor.view(DTYPES[dtype][1]))))
            chunks.append(frame)
            offset += len(frame)
        entries.append(entry)
    header = {"kind": "delta", "codec": "xor-byteplanes-zstd", "base_version": int(base_version),
              "target_version": int(target_version), "base_checksum": _combine(base_sums),
              "target_checksum": _combine(target_sums), "tensors": entries}
    return _pack(DELTA_MAGIC, header, chunks)


def read_header(blob: bytes) -> DeltaHeader:
    """Parse and verify a delta's header (not its payload): cheap, for deciding whether a delta fits."""
    h, _ = _unpack_header(blob, DELTA_MAGIC, "delta")
    return _delta_header(h)


def _delta_header(h: dict) -> DeltaHeader:
    try:
        tensors = tuple(TensorEntry(name=e["name"], dtype=e["dtype"], shape=tuple(e["shape"]),
                                    base_sha256=e["base_sha256"], target_sha256=e["target_sha256"],
                                    offset=e["offset"], length=e["length"], changed_elements=e["changed_elements"])
                        for e in h["tensors"])
        header = DeltaHeader(FORMAT_VERSION, h["base_version"], h["target_version"], h["base_checksum"],
                             h["target_checksum"], tensors, h["payload_bytes"])
    except (KeyError, TypeError) as e:
        raise DeltaError(f"delta corrupted: malformed header ({e!r})") from None
    bad = [e.dtype for e in tensors if e.dtype not in DTYPES]
    if bad:
        raise DeltaError(f"delta uses unsupported dtypes {sorted(set(bad))}")
    if (_combine({e.name: e.base_sha256 for e in tensors}) != header.base_checksum
            or _combine({e.name: e.target_sha256 for e in tensors}) != header.target_checksum):
        raise DeltaError("delta corrupted: per-tensor checksums do not add up to the base/target checksums")
    return header


class DeltaPlan(list):
    """The changed tensors of a verified delta, as ``(name, new_tensor)`` pairs, plus where they lead.

    ``version`` / ``checksum``: the end the weights will be at after applying; ``from_version``: the end they are at.
    """

    def __init__(self, items: list[tuple[str, torch.Tensor]], version: int, checksum: str, from_version: int):
        super().__init__(items)
        self.version, self.checksum, self.from_version = version, checksum, from_version


def _short(s: str) -> str:
    return s[:12] + "…"


def plan_delta(state: Mapping[str, torch.Tensor], blob: bytes, known_checksum: str | None = None) -> DeltaPlan:
    """Verify everything and decode the changed tensors, without touching ``state``.

    ``state`` may be at either end of the delta. ``known_checksum``: a caller that already knows ``state``'s
    checksum (a serving worker that verified it at load time) passes it to skip hashing every tensor; the
    tensors the delta touches are still checked against their recorded sha256, and the results always are.
    Returns the changed tensors only (freshly allocated), for in-place application.
    """
    raw_header, start = _unpack_header(blob, DELTA_MAGIC, "delta")
    header = _delta_header(raw_header)
    payload = _payload(blob, raw_header, start, "delta")
    ends = (f"delta is for base version {header.base_version} (checksum {_short(header.base_checksum)}) "
            f"and target version {header.target_version} (checksum {_short(header.target_checksum)})")

    by_name = {e.name: e for e in header.tensors}
    if known_checksum is None:  # check the whole state: names, dtypes, shapes, bytes
        missing, extra = sorted(set(by_name) - set(state)), sorted(set(state) - set(by_name))
        if missing or extra:
            raise DeltaError(f"{ends} but the weights have different tensors: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, e in by_name.items():
            t = state[name]
            if t.dtype != DTYPES[e.dtype][0] or tuple(t.shape) != e.shape:
                raise DeltaError(f"{ends} but tensor {name!r} is {t.dtype}{tuple(t.shape)}, not {e.dtype}{e.shape}")
        state_sum = checksum(state)
    else:
        state_sum = known_checksum
    if state_sum == header.base_checksum:
        from_sha, to_sha = "base_sha256", "target_sha256"
        version, now_sum, from_version = header.target_version, header.target_checksum, header.base_version
    elif state_sum == header.target_checksum:
        from_sha, to_sha = "target_sha256", "base_sha256"
        version, now_sum, from_version = header.base_version, header.base_checksum, header.target_version
    else:
        raise DeltaError(f"{ends} but the weights are at checksum {_short(state_sum)}")

    plan = []
    for e in header.changed:
        if e.name not in state:
            raise DeltaError(f"{ends} but the weights lack tensor {e.name!r}")
        t = state[e.name]
        if known_checksum is not None and tensor_checksum(t) != getattr(e, from_sha):
            raise DeltaError(f"{ends} but tensor {e.name!r} does not match (the weights are not at checksum "
                             f"{_short(known_checksum)} as claimed)")
        if e.offset + e.length > len(payload):
            raise DeltaError(f"delta corrupted: tensor {e.name!r} lies outside the payload")
        xor = _from_planes(_decompress(payload[e.offset:e.offset + e.length], e.nbytes, e.name), DTYPES[e.dtype][0].itemsize)
        new = _build(np.bitwise_xor(_raw(t), xor), e.dtype, list(e.shape))
        if tensor_checksum(new) != getattr(e, to_sha):
            raise DeltaError(f"delta corrupted: tensor {e.name!r} decodes to the wrong checksum")
        plan.append((e.name, new))
    return DeltaPlan(plan, version, now_sum, from_version)


def apply_delta(state: Mapping[str, torch.Tensor], blob: bytes) -> tuple[dict[str, torch.Tensor], int]:
    """Return (weights at the other end of the delta, that end's version). ``state`` is not modified.

    Unchanged tensors are shared with ``state`` (not copied); changed ones are new tensors. When both ends are
    identical (an empty delta), the weights are at both and the target version is returned.
    """
    plan = plan_delta(state, blob)
    out = dict(state)
    out.update(plan)
    return out, plan.version


# ---------------------------------------------------------------------------------------------- snapshots


def encode_snapshot(state: Mapping[str, torch.Tensor], version: int | None = None, level: int = 3) -> bytes:
    """Full weights: byte planes + zstd per tensor, per-tensor and whole-state checksums."""
    entries, chunks, offset, sums = [], [], 0, {}
    for name in sorted(state):
        t = state[name]
        dtype = _dtype_name(t)
        sums[name] = tensor_checksum(t)
        frame = _compress(_to_planes(_raw(t), t.element_size()), level)
        entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "sha256": sums[name],
                        "offset": offset, "length": len(frame)})
        chunks.append(frame)
        offset += len(frame)
    header = {"kind": "snapshot", "codec": "byteplanes-zstd", "version": version, "checksum": _combine(sums),
              "tensors": entries}
    return _pack(SNAPSHOT_MAGIC, header, chunks)


def snapshot_info(blob: bytes) -> dict:
    """The verified header of a snapshot (version, checksum, tensors) without decoding it."""
    return _unpack_header(blob, SNAPSHOT_MAGIC, "snapshot")[0]


def decode_snapshot(blob: bytes) -> dict[str, torch.Tensor]:
    """Decode and verify a snapshot; every tensor and the whole-state checksum are checked."""
    header, start = _unpack_header(blob, SNAPSHOT_MAGIC, "snapshot")
    payload = _payload(blob, header, start, "snapshot")
    out, sums = {}, {}
    try:
        for e in header["tensors"]:
            dtype, shape = e["dtype"], list(e["shape"])
            if dtype not in DTYPES:
                raise DeltaError(f"snapshot uses unsupported dtype {dtype!r}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][0].itemsize
            if e["offset"] + e["length"] > len(payload):
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} lies outside the payload")
            raw = _from_planes(_decompress(payload[e["offset"]:e["offset"] + e["length"]], nbytes, e["name"]),
                               DTYPES[dtype][0].itemsize)
            out[e["name"]] = t = _build(raw, dtype, shape)
            sums[e["name"]] = tensor_checksum(t)
            if sums[e["name"]] != e["sha256"]:
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} decodes to the wrong checksum")
        if _combine(sums) != header["checksum"]:
            raise DeltaError("snapshot corrupted: tensors do not add up to the recorded checksum")
    except (KeyError, TypeError) as e:
        raise DeltaError(f"snapshot corrupted: malformed header ({e!r})") from None
    return out


# ---------------------------------------------------------------------------------------------- benchmark


def _bench() -> None:
    """Print delta ratios on synthetic bf16 RL-like updates. Run: ``python -m deploy.delta``."""
    import time

    from rich.console import Console
    from rich.table import Table

    torch.manual_seed(0)
    shapes = [(4096, 1024), (1024, 4096), (8, 1024, 512), (151936 // 16, 1024), (1024,)]
    master = {f"w{i}": torch.randn(s) * 0.02 for i, s in enumerate(shapes)}
    base = {k: v.to(torch.bfloat16) for k, v in master.items()}
    raw_bytes = sum(t.numel() * 2 for t in base.values())
    table = Table(title=f"bf16 delta codec, {raw_bytes / 2**20:.0f} MiB of weights (python -m deploy.delta)")
    for col in ("rel. step", "changed", "zstd(3)", "xor+zstd", "xor+planes", "enc s", "apply s"):
        table.add_column(col, justify="right")
    for rel in (1e-4, 3e-4, 7e-4, 3e-3):
        target = {k: (v + v.abs() * rel * torch.randn_like(v)).to(torch.bfloat16) for k, v in master.items()}
        plain = sum(len(zstandard.ZstdCompressor(level=3).compress(_raw(t))) for t in target.values())
        xor_only = sum(len(zstandard.ZstdCompressor(level=3).compress(np.bitwise_xor(_raw(base[k]), _raw(t))))
                       for k, t in target.items())
        t0 = time.perf_counter()
        blob = encode_delta(base, target, 0, 1)
        t1 = time.perf_counter()
        apply_delta(base, blob)
        t2 = time.perf_counter()
        h = read_header(blob)
        table.add_row(f"{rel:g}", f"{h.changed_fraction:.1%}", f"{raw_bytes / plain:.2f}x", f"{raw_bytes / xor_only:.1f}x",
                      f"{raw_bytes / len(blob):.1f}x", f"{t1 - t0:.2f}", f"{t2 - t1:.2f}")
    Console().print(table)


if __name__ == "__main__":
    _bench()
