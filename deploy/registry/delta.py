"""Lossless weight deltas: the bytes that move a policy version from the learner to the fleet.

Every receiver already holds one end of a delta, so the codec models the change *given that end*
(``deploy.registry.kernels`` explains the model): elements are grouped by their exponent, which decides how likely
an optimizer step is to survive rounding, and each group codes which of its elements changed (gaps, Rice
codes) and by how many steps on the ordered-integer line. On real RL steps that beats XOR + zstd several
times over and the order-0 entropy bound too (BENCHMARKS.md). A chunk where most elements changed is
coded the classic way when that is smaller: XOR with the base, bytes split into planes, zstd. One delta
takes A to B and B back to A, so a rollback needs no download.

A delta is a ``deploy.registry.container`` blob whose header names the base and target versions and their
checksums, the chunk size, and per tensor its name, dtype, shape, 32-bit digests of both ends and, per
chunk, (method, length, changed elements). Tensors are coded in chunks of ``CHUNK_ELEMENTS`` elements,
each independently (threads code chunks in parallel and memory stays bounded by a few chunks plus the
output, not the model; ``deploy.registry.snapshot.open_safetensors`` maps models larger than RAM).

Safety. Before any weight changes: the container's framing and both hashes, that the weights are exactly
at one end of the delta (names, dtypes, shapes, and the whole-state checksum, or, for a caller that
already knows its checksum, the digests of the tensors the delta touches). Decoding writes nothing until
a chunk decoded consistently; after applying, the touched tensors are hashed against the other end, and
any mismatch undoes every applied chunk (the same frames run backwards) before ``DeltaError`` is raised.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from deploy.registry.container import (
    DELTA_MAGIC,
    DTYPES,
    FORMAT_VERSION,
    Blob,
    DeltaError,
    ElementType,
    Output,
    checksum,
    combine_checksums,
    dtype_name,
    element_view,
    from_planes,
    open_container,
    pack_container,
    tensor_checksum,
    to_planes,
    zstd_compress,
)

# checksum, tensor_checksum, DTYPES and DeltaError live in deploy.registry.container; callers of the codec get them here
__all__ = [
    "CHUNK_ELEMENTS",
    "DTYPES",
    "FORMAT_VERSION",
    "Chunk",
    "DeltaError",
    "DeltaHeader",
    "DeltaPlan",
    "DeltaResult",
    "TensorEntry",
    "apply_delta",
    "apply_delta_inplace",
    "checksum",
    "encode_delta",
    "plan_delta",
    "read_header",
    "tensor_checksum",
    "warm_up",
]
CHUNK_ELEMENTS = 1 << 22  # elements per independently coded chunk (8 MiB of bf16)
_DIGEST_CHARS = 8  # hex chars of each per-tensor digest kept in a delta header (32 bits: they locate a
# mismatch; the full 256-bit checksums of both ends are in the header too)
_TRY_XOR_ABOVE = 0.2  # changed share of a chunk above which the XOR + planes + zstd coding is also tried

# method codes in the header
COND, XORZ = "c", "x"
METHOD_NAMES = {COND: "base-conditioned", XORZ: "xor+planes+zstd"}


def _threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def _short(s: str) -> str:
    return s[:12] + "…"


# ---------------------------------------------------------------------------------------------- chunk codecs


_scratch = threading.local()


def _work(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A per-thread buffer reused from chunk to chunk, in its own anonymous mapping.

    Reuse avoids fresh large allocations per chunk (which fragment the heap and keep touched pages
    resident), and a plain mapping only costs the pages actually written: numpy's own large arrays ask
    for transparent huge pages, which makes a few written bytes cost megabytes.
    """
    buf = getattr(_scratch, name, None)
    if buf is None or buf.shape[:-1] != shape[:-1] or buf.shape[-1] < shape[-1] or buf.dtype != dtype:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        mem = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = np.frombuffer(mem, dtype, count=int(np.prod(shape))).reshape(shape)
        setattr(_scratch, name, buf)
    return buf


def _encode_chunk(b: np.ndarray, t: np.ndarray, dt: ElementType, level: int) -> tuple[str, bytes, int]:
    """(method, frame, changed elements) for one chunk that differs; the smaller of the codings tried."""
    from deploy.registry import kernels  # noqa: PLC0415 numba: its kernels load only when a delta is coded

    n = b.size
    best: tuple[str, bytes] | None = None
    out = _work("out", (n * dt.bits // 8 + 4096,), np.uint8)
    stats = np.zeros(1, np.int64)
    nb = kernels.cond_encode(
        b,
        t,
        dt.bits,
        dt.mbits,
        dt.ebits,
        out,
        stats,
        _work("rec", (4, n), np.int32),
        _work("dense", (2 * n + 64,), np.uint8),
    )
    changed = int(stats[0])
    if nb >= 0:
        best = (COND, out[:nb].tobytes())
    if best is None or changed > _TRY_XOR_ABOVE * n:
        frame = zstd_compress(to_planes(np.bitwise_xor(b, t).view(np.uint8), b.itemsize), level)
        if best is None or len(frame) < len(best[1]):
            best = (XORZ, frame)
    return best[0], best[1], changed


def _xor_chunk(
    x: np.ndarray, method: str, frame: memoryview, changed: int, dt: ElementType, forward: bool, what: str
) -> None:
    """Decode one chunk against ``x`` and, only once it decoded consistently, XOR the change into ``x``.

    Running it again with ``forward`` flipped undoes it. Raises DeltaError with ``x`` untouched.
    """
    from deploy.registry import kernels  # noqa: PLC0415 numba: its kernels load only when a delta is coded

    if method == COND:
        pos = _work("pos", (max(changed, 1),), np.int64)
        val = _work("val" + dt.uint.__name__, (max(changed, 1),), dt.uint)
        stream = np.frombuffer(frame, np.uint8)
        # read-only whatever holds the delta (bytes, a bytearray, a mapped file): numba compiles one kernel per
        # argument type, and a writable stream here once sent a gate into minutes of compiling mid-judgement
        stream.flags.writeable = False
        m = kernels.cond_decode(x, stream, dt.bits, dt.mbits, dt.ebits, forward, pos[:changed], val[:changed])
        if m < 0:
            why = {
                kernels.E_TRUNCATED: "the stream ends early",
                kernels.E_POSITION: "a position lies outside it",
                kernels.E_COUNTS: "its counts do not add up",
                kernels.E_TRAILING: "bytes are left over",
            }.get(m, m)
            raise DeltaError(f"delta corrupted or not for these weights: {what} does not decode ({why})")
        if m != changed:
            raise DeltaError(f"delta corrupted: {what} decodes {m} changed elements, the header says {changed}")
        kernels.xor_scatter(x, pos, val, m)
        return
    if method == XORZ:
        try:
            raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=x.nbytes)
        except zstandard.ZstdError as e:
            raise DeltaError(f"delta corrupted: {what} does not decompress ({e})") from None
        if len(raw) != x.nbytes:
            raise DeltaError(f"delta corrupted: {what} decompressed to {len(raw)} bytes, expected {x.nbytes}")
        np.bitwise_xor(x, from_planes(np.frombuffer(raw, np.uint8), x.itemsize).view(x.dtype), out=x)
        return
    raise DeltaError(f"delta uses unknown chunk method {method!r} ({what})")


# ---------------------------------------------------------------------------------------------- header model


@dataclass(frozen=True)
class Chunk:
    method: str
    offset: int
    length: int
    changed: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a delta. ``chunks`` is empty when the tensor is bit-identical at both ends."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    base_digest: str  # first 8 hex chars of tensor_checksum at the base
    target_digest: str
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].bits // 8

    @property
    def changed_elements(self) -> int:
        return sum(c.changed for c in self.chunks)

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True)
class DeltaHeader:
    format_version: int
    base_version: int
    target_version: int
    base_checksum: str
    target_checksum: str
    chunk_elements: int
    tensors: tuple[TensorEntry, ...]
    payload_bytes: int

    @property
    def changed(self) -> tuple[TensorEntry, ...]:
        return tuple(e for e in self.tensors if e.chunks)

    @property
    def raw_bytes(self) -> int:
        """Size of the full weights (what a snapshot would hold before compression)."""
        return sum(e.nbytes for e in self.tensors)

    @property
    def changed_fraction(self) -> float:
        """Fraction of elements whose bits differ between base and target."""
        total = sum(e.numel for e in self.tensors)
        return sum(e.changed_elements for e in self.tensors) / total if total else 0.0

    @property
    def method_bytes(self) -> dict[str, int]:
        """Payload bytes per coding method (names from METHOD_NAMES)."""
        out: dict[str, int] = {}
        for e in self.tensors:
            for c in e.chunks:
                out[METHOD_NAMES[c.method]] = out.get(METHOD_NAMES[c.method], 0) + c.length
        return out


def _delta_header(h: dict) -> DeltaHeader:
    try:
        entries: list[TensorEntry] = []
        offset = 0
        for raw in h["tensors"]:
            chunks = []
            for method, length, changed in raw.get("k", ()):  # frames follow each other in header order
                chunks.append(Chunk(str(method), offset, int(length), int(changed)))
                offset += int(length)
            entries.append(
                TensorEntry(
                    name=raw["n"],
                    dtype=raw["d"],
                    shape=tuple(int(x) for x in raw["s"]),
                    base_digest=raw["b"],
                    target_digest=raw.get("t", raw["b"]),
                    chunks=tuple(chunks),
                )
            )
        tensors = tuple(entries)
        header = DeltaHeader(
            FORMAT_VERSION,
            int(h["base_version"]),
            int(h["target_version"]),
            h["base_checksum"],
            h["target_checksum"],
            int(h["chunk_elements"]),
            tensors,
            int(h["payload_bytes"]),
        )
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise DeltaError(f"delta corrupted: malformed header ({err!r})") from None
    bad = sorted({e.dtype for e in tensors if e.dtype not in DTYPES})
    if bad:
        raise DeltaError(f"delta uses unsupported dtypes {bad}")
    for e in tensors:
        n_chunks = -(-e.numel // header.chunk_elements) if e.chunks else 0
        if len(e.chunks) != n_chunks or any(
            c.length < 0 or c.changed < 0 or c.offset + c.length > header.payload_bytes for c in e.chunks
        ):
            raise DeltaError(f"delta corrupted: tensor {e.name!r} has inconsistent chunks")
    return header


def read_header(blob: Blob) -> DeltaHeader:
    """Parse and verify a delta's header (not its payload): cheap, for deciding whether a delta fits."""
    h, _ = open_container(blob, DELTA_MAGIC, "delta", check_payload=False)
    return _delta_header(h)


# ---------------------------------------------------------------------------------------------- encode


def _chunks(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, numel, chunk):
        yield lo, min(numel, lo + chunk)


def encode_delta(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    base_version: int,
    target_version: int,
    level: int = 3,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> bytearray:
    """The delta between two versions of the same architecture (same names, dtypes and shapes).

    Tensors are read chunk by chunk (views, no copies): memory is a few chunks plus the delta itself.
    """
    if set(base) != set(target):
        missing, extra = sorted(set(base) - set(target)), sorted(set(target) - set(base))
        raise ValueError(
            f"base and target differ in tensor names: only in base {missing[:5]}, only in target {extra[:5]}"
        )
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    entries, out = [], Output()
    base_sums, target_sums = {}, {}
    with ThreadPoolExecutor(_threads()) as pool:
        for name in sorted(base):
            b, t = base[name], target[name]
            if b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
                raise ValueError(
                    f"tensor {name!r}: base is {b.dtype}{tuple(b.shape)}, target is {t.dtype}{tuple(t.shape)}"
                )
            dtype = dtype_name(b)
            dt = DTYPES[dtype]
            base_sums[name], target_sums[name] = bsum, tsum = tensor_checksum(b), tensor_checksum(t)
            entry = {"n": name, "d": dtype, "s": list(b.shape), "b": bsum[:_DIGEST_CHARS]}
            if bsum != tsum:
                xb, xt = element_view(b), element_view(t)
                entry["t"] = tsum[:_DIGEST_CHARS]
                entry["k"] = []

                def take(fut, entry=entry):
                    method, frame, changed = fut.result()
                    entry["k"].append([method, len(frame), changed])
                    out.write(frame)

                window = []
                for lo, hi in _chunks(xb.size, chunk_elements):  # at most threads + 1 chunks in flight
                    window.append(pool.submit(_encode_chunk, xb[lo:hi], xt[lo:hi], dt, level))
                    if len(window) > _threads():
                        take(window.pop(0))
                for fut in window:
                    take(fut)
            entries.append(entry)
    header = {
        "kind": "delta",
        "codec": "liverl-delta-2",
        "base_version": int(base_version),
        "target_version": int(target_version),
        "base_checksum": combine_checksums(base_sums),
        "target_checksum": combine_checksums(target_sums),
        "chunk_elements": chunk_elements,
        "tensors": entries,
    }
    return pack_container(DELTA_MAGIC, header, out.finish())


# ---------------------------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class _Ends:
    forward: bool  # the weights are at the base (apply base -> target)
    sums: dict  # every tensor's checksum when the whole state was hashed, else empty
    version: int  # where they will be
    checksum: str
    from_version: int


def _locate(state: Mapping[str, torch.Tensor], header: DeltaHeader, known_checksum: str | None) -> _Ends:
    """Which end of the delta ``state`` is at; DeltaError if neither (nothing is modified)."""
    ends = (
        f"delta is for base version {header.base_version} (checksum {_short(header.base_checksum)}) "
        f"and target version {header.target_version} (checksum {_short(header.target_checksum)})"
    )
    names = {e.name for e in header.tensors}
    if known_checksum is None:  # check the whole state: names, dtypes, shapes, bytes
        missing, extra = sorted(names - set(state)), sorted(set(state) - names)
        if missing or extra:
            raise DeltaError(
                f"{ends} but the weights have different tensors: missing {missing[:5]}, unexpected {extra[:5]}"
            )
    for e in header.changed:
        if e.name not in state:
            raise DeltaError(f"{ends} but the weights lack tensor {e.name!r}")
    for e in header.tensors:
        t = state.get(e.name)
        if t is not None and (t.dtype != DTYPES[e.dtype].torch or tuple(t.shape) != e.shape):
            raise DeltaError(f"{ends} but tensor {e.name!r} is {t.dtype}{tuple(t.shape)}, not {e.dtype}{e.shape}")
    if known_checksum is None:
        sums = {e.name: tensor_checksum(state[e.name]) for e in header.tensors}
        state_sum = combine_checksums(sums)
    else:
        state_sum, sums = known_checksum, {}
    if state_sum == header.base_checksum:
        fwd = True
    elif state_sum == header.target_checksum:
        fwd = False
    else:
        raise DeltaError(f"{ends} but the weights are at checksum {_short(state_sum)}")
    if known_checksum is not None:  # the caller vouches for the state; still check what the delta touches
        for e in header.changed:
            want = e.base_digest if fwd else e.target_digest
            if tensor_checksum(state[e.name])[:_DIGEST_CHARS] != want:
                raise DeltaError(
                    f"{ends} but tensor {e.name!r} does not match (the weights are not at checksum "
                    f"{_short(known_checksum)} as claimed)"
                )
    if fwd:
        return _Ends(True, sums, header.target_version, header.target_checksum, header.base_version)
    return _Ends(False, sums, header.base_version, header.base_checksum, header.target_version)


def _run(
    state: Mapping[str, torch.Tensor], header: DeltaHeader, payload: memoryview, ends: _Ends, sums: dict[str, str]
) -> None:
    """Apply every chunk in place, then verify; on any failure undo what was applied and raise DeltaError."""
    jobs = []
    for e in header.changed:
        t = state[e.name]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise DeltaError(f"tensor {e.name!r} is not a contiguous CPU tensor; it cannot be updated in place")
        x = element_view(t)
        for (lo, hi), c in zip(_chunks(e.numel, header.chunk_elements), e.chunks, strict=True):
            jobs.append((x[lo:hi], e, c))

    def run(job, forward):
        x, e, c = job
        _xor_chunk(
            x,
            c.method,
            payload[c.offset : c.offset + c.length],
            c.changed,
            DTYPES[e.dtype],
            forward,
            f"tensor {e.name!r} chunk at {c.offset}",
        )

    applied: list = []
    failure: BaseException | None = None
    with ThreadPoolExecutor(_threads()) as pool:  # chunks are disjoint: threads decode and apply in parallel
        window: list = []

        def settle(job, fut):
            nonlocal failure
            try:
                fut.result()
                applied.append(job)
            except BaseException as err:  # noqa: BLE001 -- collect all: every chunk that did apply must be known
                failure = failure or err

        for job in jobs:  # bounded look-ahead
            if failure is not None:
                break
            window.append((job, pool.submit(run, job, ends.forward)))
            if len(window) > _threads():
                settle(*window.pop(0))
        for job, fut in window:
            settle(job, fut)
    try:
        if failure is not None:
            raise failure
        for e in header.changed:
            want = e.target_digest if ends.forward else e.base_digest
            digest = tensor_checksum(state[e.name])
            if digest[:_DIGEST_CHARS] != want:
                raise DeltaError(f"delta corrupted: tensor {e.name!r} decodes to the wrong checksum")
            if sums:
                sums[e.name] = digest
        if sums and combine_checksums(sums) != ends.checksum:
            raise DeltaError("delta corrupted: the weights do not add up to the checksum of the end they reached")
    except BaseException:
        for job in reversed(applied):  # undo: the same frames, run the other way
            run(job, not ends.forward)
        raise


@dataclass(frozen=True)
class DeltaResult:
    """Where ``apply_delta_inplace`` left the weights."""

    version: int
    checksum: str
    from_version: int
    changed: tuple[str, ...]


def apply_delta_inplace(
    state: Mapping[str, torch.Tensor], blob: Blob, known_checksum: str | None = None
) -> DeltaResult:
    """Move ``state`` (contiguous CPU tensors) to the other end of the delta, in place, chunk by chunk.

    Everything is verified first (see the module doc); ``known_checksum``: a caller that already knows the
    state's checksum passes it to skip hashing tensors the delta does not touch. Raises DeltaError with the
    weights unchanged when the delta is corrupt, truncated or for other weights.
    """
    raw_header, payload = open_container(blob, DELTA_MAGIC, "delta")
    header = _delta_header(raw_header)
    ends = _locate(state, header, known_checksum)
    _run(state, header, payload, ends, dict(ends.sums))
    return DeltaResult(ends.version, ends.checksum, ends.from_version, tuple(e.name for e in header.changed))


class DeltaPlan(list):
    """The changed tensors of a verified delta, as ``(name, new_tensor)`` pairs, plus where they lead.

    ``version`` / ``checksum``: the end the weights will be at after applying; ``from_version``: the end they are at.
    """

    def __init__(self, items: list[tuple[str, torch.Tensor]], version: int, checksum: str, from_version: int):
        super().__init__(items)
        self.version, self.checksum, self.from_version = version, checksum, from_version


def plan_delta(state: Mapping[str, torch.Tensor], blob: Blob, known_checksum: str | None = None) -> DeltaPlan:
    """Verify everything and decode the changed tensors into fresh copies, without touching ``state``.

    For callers that write the new tensors themselves (a serving worker pushing them through the model's
    ``load_weights``). ``known_checksum`` as in ``apply_delta_inplace``.
    """
    raw_header, payload = open_container(blob, DELTA_MAGIC, "delta")
    header = _delta_header(raw_header)
    ends = _locate(state, header, known_checksum)
    copies = {e.name: state[e.name].detach().cpu().contiguous().clone() for e in header.changed}
    _run(copies, header, payload, ends, dict(ends.sums))
    return DeltaPlan(list(copies.items()), ends.version, ends.checksum, ends.from_version)


def apply_delta(state: Mapping[str, torch.Tensor], blob: Blob) -> tuple[dict[str, torch.Tensor], int]:
    """Return (weights at the other end of the delta, that end's version). ``state`` is not modified.

    Unchanged tensors are shared with ``state`` (not copied); changed ones are new tensors. When both ends are
    identical (an empty delta), the weights are at both and the target version is returned.
    """
    plan = plan_delta(state, blob)
    out = dict(state)
    out.update(plan)
    return out, plan.version


def warm_up(dtypes: tuple[str, ...] = ("bfloat16",)) -> None:
    """Compile (or load from numba's on-disk cache) the coder's kernels for ``dtypes`` by coding a small delta.

    The first use in a fresh checkout compiles for tens of seconds per dtype; processes that apply deltas
    on a latency budget (a serving worker mid-swap) call this at start so no swap ever pays for it.
    """
    for name in dtypes:
        dt = DTYPES[name]
        bits = np.arange(1 << 17, dtype=np.uint64) % (1 << dt.bits)
        a = {"w": torch.from_numpy(bits.astype(dt.uint)).view(dt.torch)}
        b = {"w": torch.from_numpy(np.roll(bits, 1).astype(dt.uint)).view(dt.torch)}
        b["w"][: 1 << 16] = a["w"][: 1 << 16]
        blob = encode_delta(a, b, 0, 1, chunk_elements=1 << 16)  # one big chunk and one small: both decoders
        apply_delta_inplace({"w": a["w"].clone()}, blob)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (a view: no copy for a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def baseline_bytes(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """What the codec is measured against, on the same change: (plain zstd(3) of the target's bytes, zstd(3) of
    base XOR target), summed over tensors."""
    zc = zstandard.ZstdCompressor(level=3, threads=-1)
    zstd_bytes = xor_zstd_bytes = 0
    for name in sorted(target):
        rb, rt = raw_bytes(base[name]), raw_bytes(target[name])
        zstd_bytes += len(zc.compress(rt.data))
        xor_zstd_bytes += len(zc.compress(np.bitwise_xor(rb, rt).data))
    return zstd_bytes, xor_zstd_bytes
