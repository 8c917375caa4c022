"""The delta codec is lossless in both directions, bit for bit, and refuses anything it cannot verify."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deploy.registry.delta import (
    DeltaError,
    apply_delta,
    apply_delta_inplace,
    checksum,
    encode_delta,
    plan_delta,
    read_header,
    tensor_checksum,
)
from deploy.registry.snapshot import decode_snapshot, encode_snapshot
from tests.deploy.conftest import perturb, tiny_model

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def from_bits(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = bits.astype(UINT[itemsize]).view(np.uint8).copy()
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def bits_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bits_of(a[k]) == bits_of(b[k]) for k in a
    )


shapes = st.one_of(
    st.just(()), st.just((0,)), st.just((3, 0)), st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES), shape=shapes, frac=st.sampled_from([0.0, 0.03, 0.5, 1.0]), seed=st.integers(0, 2**31)
)
def test_round_trip_both_directions_any_bits(dtype, shape, frac, seed):
    """Arbitrary bit patterns (NaN payloads, ±0, inf, subnormals included) survive A→B and B→A exactly."""
    rng = np.random.default_rng(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64))
    a_bits = rng.integers(0, 2 ** (8 * itemsize), size=n, dtype=np.uint64)
    b_bits = np.where(rng.random(n) < frac, rng.integers(0, 2 ** (8 * itemsize), size=n, dtype=np.uint64), a_bits)
    a = {"t": from_bits(a_bits, dtype, shape), "fixed": torch.ones(3, dtype=torch.bfloat16)}
    b = {"t": from_bits(b_bits, dtype, shape), "fixed": a["fixed"]}
    blob = encode_delta(a, b, 4, 5)
    fwd, v = apply_delta(a, blob)
    assert v == 5 and same_bits(fwd, b) and checksum(fwd) == checksum(b)
    back, v = apply_delta(b, blob)
    assert same_bits(back, a)
    assert v == (4 if checksum(a) != checksum(b) else 5)  # identical ends: the delta leads "forward"
    snap = decode_snapshot(encode_snapshot(b))
    assert same_bits(snap, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values_are_changes(dtype):
    """+0 vs -0 and two NaN payloads compare equal or unordered as numbers, but their bits differ: they are changes."""
    if dtype == torch.float32:
        base_bits, target_bits = (
            [0x00000000, 0x7FC00000, 0x00000001, 0x7F800000],
            [0x80000000, 0x7FC00001, 0x00000002, 0xFF800000],
        )
    else:  # bf16 and fp16 share the 16-bit patterns' roles closely enough for this test
        base_bits, target_bits = [0x0000, 0x7FC0, 0x0001, 0x7F80], [0x8000, 0x7FC1, 0x0002, 0xFF80]
    a = {"x": from_bits(np.array(base_bits, dtype=np.uint64), dtype, (4,))}
    b = {"x": from_bits(np.array(target_bits, dtype=np.uint64), dtype, (4,))}
    blob = encode_delta(a, b, 0, 1)
    assert read_header(blob).changed_fraction == 1.0
    assert same_bits(apply_delta(a, blob)[0], b) and same_bits(apply_delta(b, blob)[0], a)


def test_unchanged_tensors_cost_nothing_and_header_reports_sizes():
    a = tiny_model()
    b = {**a, "lm_head.weight": perturb({"w": a["lm_head.weight"]}, 0.05)["w"]}
    blob = encode_delta(a, b, 0, 1)
    h = read_header(blob)
    assert [e.name for e in h.changed] == ["lm_head.weight"]
    assert h.base_checksum == checksum(a) and h.target_checksum == checksum(b)
    assert h.raw_bytes == sum(t.numel() * 2 for t in a.values())
    assert 0 < h.changed_fraction < 0.1
    e = {e.name: e for e in h.tensors}["lm_head.weight"]
    assert e.base_digest == tensor_checksum(a["lm_head.weight"])[:8]
    assert e.target_digest == tensor_checksum(b["lm_head.weight"])[:8]
    assert h.method_bytes and sum(h.method_bytes.values()) == h.payload_bytes


def test_delta_beats_plain_zstd_on_sparse_bf16_updates():
    import zstandard

    g = torch.Generator().manual_seed(0)
    master = {f"w{i}": torch.randn(256, 256, generator=g) * 0.02 for i in range(4)}
    a = {k: v.to(torch.bfloat16) for k, v in master.items()}
    b = {k: (v + v.abs() * 3e-4 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in master.items()}
    raw = sum(t.numel() * 2 for t in a.values())
    blob = encode_delta(a, b, 0, 1)
    plain = sum(len(zstandard.ZstdCompressor(level=3).compress(bits_of(t))) for t in b.values())
    assert 0.02 < read_header(blob).changed_fraction < 0.10
    assert raw / len(blob) > 10 * (raw / plain)  # ~20x vs ~1.3x


def test_plan_delta_returns_only_changed_tensors_and_where_they_lead():
    a = tiny_model()
    b = {**a, "odd": perturb({"w": a["odd"]}, 0.5)["w"]}
    blob = encode_delta(a, b, 2, 3)
    plan = plan_delta(a, blob)
    assert [n for n, _ in plan] == ["odd"] and plan.version == 3 and plan.from_version == 2
    assert plan.checksum == checksum(b) and bits_of(plan[0][1]) == bits_of(b["odd"])
    # with a known checksum, only the touched tensors are needed and hashed
    plan = plan_delta({"odd": b["odd"]}, blob, known_checksum=checksum(b))
    assert plan.version == 2 and bits_of(plan[0][1]) == bits_of(a["odd"])
    with pytest.raises(DeltaError, match="does not match"):
        plan_delta({"odd": a["odd"]}, blob, known_checksum=checksum(b))


# ------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def pair():
    a = tiny_model(0)
    b = perturb(a, 0.05)
    return a, b, encode_delta(a, b, 3, 4)


def _refused(state, blob, match):
    before = {k: (id(t), bits_of(t)) for k, t in state.items()}
    with pytest.raises(DeltaError, match=match):
        apply_delta(state, blob)
    assert {k: (id(t), bits_of(t)) for k, t in state.items()} == before  # input untouched


def test_wrong_base_is_refused_with_versions_and_checksums(pair):
    a, _b, blob = pair
    other = perturb(a, 0.05, seed=9)
    _refused(
        other,
        blob,
        rf"delta is for base version 3 \(checksum {checksum(a)[:12]}….*but the weights are at "
        rf"checksum {checksum(other)[:12]}",
    )


def test_truncated_is_refused(pair):
    a, _, blob = pair
    _refused(a, blob[:-1], f"delta truncated: expected {len(blob)} bytes, got {len(blob) - 1}")
    _refused(a, blob[:20], "delta truncated")
    _refused(a, blob[:100], "delta truncated")


@pytest.mark.parametrize("where", ["header", "payload", "trailer"])
def test_corrupted_is_refused(pair, where):
    a, _, blob = pair
    hlen, plen = int.from_bytes(blob[12:16], "little"), int.from_bytes(blob[16:24], "little")
    pos = {"header": 56 + plen + hlen // 2, "payload": 56 + 1, "trailer": len(blob) - 3}[where]
    bad = bytearray(blob)
    bad[pos] ^= 0x40
    _refused(a, bytes(bad), f"delta corrupted: {where if where != 'trailer' else 'payload'} checksum mismatch")


def test_other_refusals(pair):
    a, b, blob = pair
    _refused(a, blob + b"\0", "unexpected bytes after the end")
    _refused(a, encode_snapshot(a), "not delta")
    _refused({k: v for k, v in a.items() if k != "odd"}, blob, "missing \\['odd'\\]")
    _refused({**a, "odd": a["odd"].float()}, blob, "tensor 'odd' is torch.float32")
    with pytest.raises(ValueError, match="differ in tensor names"):
        encode_delta(a, {**b, "extra": b["odd"]}, 0, 1)
    with pytest.raises(TypeError, match="unsupported dtype"):
        checksum({"i": torch.zeros(3, dtype=torch.int64)})


def test_snapshot_corruption_and_truncation_are_refused():
    a = tiny_model()
    snap = encode_snapshot(a, version=0)
    with pytest.raises(DeltaError, match="snapshot truncated"):
        decode_snapshot(snap[:-5])
    bad = bytearray(snap)
    bad[56 + 1] ^= 1  # inside the payload
    with pytest.raises(DeltaError, match="snapshot corrupted: payload checksum mismatch"):
        decode_snapshot(bytes(bad))


def test_checksum_covers_names_dtypes_shapes_and_bits():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum({"a": t})
    assert base == checksum({"a": t.clone()})
    assert base != checksum({"b": t})
    assert base != checksum({"a": t.reshape(2, 3)})
    assert base != checksum({"a": t.to(torch.float16)})
    assert checksum({"a": torch.tensor([0.0])}) != checksum({"a": torch.tensor([-0.0])})
    assert checksum({"a": t[::2]}) == checksum({"a": t[::2].contiguous()})  # layout does not matter, bits do


# ------------------------------------------------------------------------------- base-conditioned coding

SPECIAL = {  # bit patterns every float format has trouble with: ±0, ±inf / max, NaN payloads, subnormals
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFF81, 0x7F81, 0x0001, 0x807F, 0x7F7F],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFD55, 0x0001, 0x83FF, 0x7BFF],
    torch.float32: [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF, 1, 0x807FFFFF, 0x7F7FFFFF],
    torch.float8_e4m3fn: [0x00, 0x80, 0x7F, 0xFF, 0x01, 0x87, 0x7E],
    torch.float8_e5m2: [0x00, 0x80, 0x7C, 0xFC, 0x7D, 0xFF, 0x01, 0x83],
}


def _steps(bits: np.ndarray, width: int, steps: np.ndarray) -> np.ndarray:
    """Move float bit patterns ``steps`` places along the ordered-integer line (how optimizer steps look)."""
    sign, allm = 1 << (width - 1), (1 << width) - 1
    key = np.where(bits & sign, ~bits & allm, bits | sign)
    key = (key + steps) & allm
    return np.where(key & sign, key ^ sign, ~key & allm)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 700),
    frac=st.sampled_from([0.0, 0.01, 0.1, 0.6, 1.0]),
    special=st.floats(0, 1),
    chunk=st.sampled_from([7, 64, 1 << 22]),
    seed=st.integers(0, 2**31),
)
def test_round_trip_realistic_steps_in_place_and_chunked(dtype, n, frac, special, chunk, seed):
    """Optimizer-like changes (a few ulps, exponent and sign crossings, specials) round-trip in place, both ways."""
    rng = np.random.default_rng(seed)
    width = 8 * torch.empty((), dtype=dtype).element_size()
    a_bits = rng.integers(0, 2**width, size=n, dtype=np.uint64)
    if dtype is not torch.float32:  # weight-like magnitudes for the wide formats; all patterns for narrow ones
        a_bits = np.where(rng.random(n) < special, rng.choice(SPECIAL[dtype], size=n), a_bits).astype(np.uint64)
    steps = rng.choice([-3, -2, -1, 1, 1, 2, 5, 200], size=n).astype(np.uint64)
    moved = rng.random(n) < frac
    b_bits = np.where(moved, _steps(a_bits, width, steps), a_bits)
    b_bits = np.where(rng.random(n) < special * frac, rng.choice(SPECIAL[dtype], size=n), b_bits).astype(np.uint64)
    a = {"t": from_bits(a_bits, dtype, (n,)), "same": torch.ones(2, dtype=dtype)}
    b = {"t": from_bits(b_bits, dtype, (n,)), "same": a["same"].clone()}
    blob = encode_delta(a, b, 7, 8, chunk_elements=chunk)
    h = read_header(blob)
    assert h.changed_fraction == pytest.approx(int((a_bits != b_bits).sum()) / (n + 2))
    state = {k: v.clone() for k, v in a.items()}
    r = apply_delta_inplace(state, blob)
    assert same_bits(state, b) and (r.version, r.checksum, r.from_version) == (8, checksum(b), 7)
    r = apply_delta_inplace(state, blob)  # and back (identical ends: the weights are at both, "target" wins)
    back = (8, checksum(b), 7) if (a_bits == b_bits).all() else (7, checksum(a), 8)
    assert same_bits(state, a) and (r.version, r.checksum, r.from_version) == back


def test_conditioned_coding_beats_xor_zstd_on_optimizer_like_steps():
    """The bf16 change of an Adam-like step: the base-conditioned coder is picked and is several times smaller."""
    import zstandard

    g = torch.Generator().manual_seed(0)
    master = {f"w{i}": torch.randn(256, 512, generator=g) * 0.02 for i in range(4)}
    a = {k: v.to(torch.bfloat16) for k, v in master.items()}
    b = {k: (v + 5e-7 * torch.randn(v.shape, generator=g).sign()).to(torch.bfloat16) for k, v in master.items()}
    blob = encode_delta(a, b, 0, 1)
    h = read_header(blob)
    assert 0.005 < h.changed_fraction < 0.05
    assert set(h.method_bytes) == {"base-conditioned"}
    xor_zstd = sum(
        len(
            zstandard.ZstdCompressor(level=3).compress(
                np.bitwise_xor(a[k].view(torch.int16).numpy(), b[k].view(torch.int16).numpy()).tobytes()
            )
        )
        for k in a
    )
    assert len(blob) * 2 < xor_zstd
    state = {k: v.clone() for k, v in a.items()}  # big chunks carry their group sizes: round-trip them too
    apply_delta_inplace(state, blob)
    assert same_bits(state, b)
    apply_delta_inplace(state, blob)
    assert same_bits(state, a)


@pytest.mark.parametrize("dtype", DTYPES)
def test_big_chunks_round_trip_every_dtype(dtype):
    """Chunks of >= 64Ki elements take the stream's group sizes instead of counting: both ways, every dtype."""
    g = torch.Generator().manual_seed(3)
    master = torch.randn(70_001, generator=g) * 0.05
    a = {"w": master.to(dtype)}
    b = {"w": (master + 1e-3 * torch.randn(70_001, generator=g)).to(dtype)}
    blob = encode_delta(a, b, 0, 1, chunk_elements=65_536)  # one big chunk and one small one
    assert len(read_header(blob).tensors[0].chunks) == 2
    assert same_bits(apply_delta(a, blob)[0], b) and same_bits(apply_delta(b, blob)[0], a)


def test_dense_change_falls_back_to_xor_planes_when_smaller():
    g = torch.Generator().manual_seed(1)
    a = {"w": torch.randn(4096, generator=g).to(torch.bfloat16)}
    b = {"w": torch.randn(4096, generator=g).to(torch.bfloat16)}  # unrelated: nothing to condition on
    blob = encode_delta(a, b, 0, 1)
    assert set(read_header(blob).method_bytes) <= {"xor+planes+zstd", "base-conditioned"}
    assert same_bits(apply_delta(a, blob)[0], b) and same_bits(apply_delta(b, blob)[0], a)


def _repacked(blob: bytes, mutate) -> bytes:
    """A blob with valid hashes whose content was changed by ``mutate(header, payload_bytearray)``."""
    import json

    import zstandard

    from deploy.registry import container

    hlen, plen = int.from_bytes(blob[12:16], "little"), int.from_bytes(blob[16:24], "little")
    header = json.loads(zstandard.ZstdDecompressor().decompress(blob[56 + plen : 56 + plen + hlen]))
    payload = bytearray(blob[56 : 56 + plen])
    mutate(header, payload)
    header.pop("payload_bytes")
    return container.pack_container(container.DELTA_MAGIC, header, [bytes(payload)])


@pytest.mark.parametrize("how", ["flip a payload bit", "swap the digests", "wrong changed count"])
def test_consistent_looking_but_wrong_delta_is_undone(how):
    """A blob whose hashes are valid but whose content is wrong (an encoder bug) never leaves weights changed."""
    g = torch.Generator().manual_seed(2)
    master = torch.randn(3, 4096, generator=g) * 0.02
    a = {f"w{i}": master[i].to(torch.bfloat16) for i in range(3)}
    b = {k: (master[i] + 3e-6 * torch.randn(4096, generator=g).sign()).to(torch.bfloat16) for i, k in enumerate(a)}
    blob = encode_delta(a, b, 0, 1, chunk_elements=1024)

    def mutate(header, payload):
        last = header["tensors"][-1]
        if how == "flip a payload bit":
            payload[-3] ^= 0x10  # inside the last chunk
        elif how == "swap the digests":
            last["t"], last["b"] = last["b"], last["t"]
        else:
            last["k"][-1][2] += 1

    bad = _repacked(blob, mutate)
    state = {k: v.clone() for k, v in a.items()}
    with pytest.raises(DeltaError, match="delta corrupted"):
        apply_delta_inplace(state, bad)
    assert same_bits(state, a)  # the chunks applied before the failure were undone


def test_in_place_refuses_wrong_base_before_touching():
    a = tiny_model(0)
    b = perturb(a, 0.05)
    blob = encode_delta(a, b, 3, 4)
    other = {k: v.clone() for k, v in perturb(a, 0.05, seed=9).items()}
    before = {k: bits_of(v) for k, v in other.items()}
    with pytest.raises(DeltaError, match="but the weights are at checksum"):
        apply_delta_inplace(other, blob)
    assert {k: bits_of(v) for k, v in other.items()} == before


@settings(max_examples=60, deadline=None)
@example(dtype=torch.bfloat16, cut=0.0, flip=0.0234375, bit=0, seed=0)  # a bit of the prefix's flags (CI found it)
@given(
    dtype=st.sampled_from(DTYPES),
    cut=st.floats(0, 1, exclude_max=True),
    flip=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    seed=st.integers(0, 2**31),
)
def test_any_flipped_bit_or_truncation_is_refused_untouched(dtype, cut, flip, bit, seed):
    """Whatever byte is damaged or wherever the blob is cut, apply refuses and the weights stay as they were."""
    rng = np.random.default_rng(seed)
    width = 8 * torch.empty((), dtype=dtype).element_size()
    a_bits = rng.integers(0, 2**width, size=300, dtype=np.uint64)
    b_bits = np.where(rng.random(300) < 0.2, _steps(a_bits, width, np.ones(300, np.uint64)), a_bits)
    a = {"t": from_bits(a_bits, dtype, (300,))}
    b = {"t": from_bits(b_bits, dtype, (300,))}
    blob = bytes(encode_delta(a, b, 1, 2, chunk_elements=128))
    for bad in (
        blob[: int(cut * len(blob))],
        blob[: int(flip * len(blob))]
        + bytes([blob[int(flip * len(blob))] ^ (1 << bit)])
        + blob[int(flip * len(blob)) + 1 :],
    ):
        for state in ({"t": a["t"].clone()}, {"t": b["t"].clone()}):
            before = bits_of(state["t"])
            with pytest.raises(DeltaError):
                apply_delta_inplace(state, bad)
            assert bits_of(state["t"]) == before


def test_memory_mapped_safetensors_code_and_apply_in_place(tmp_path):
    """A model larger than RAM: tensors mapped from .safetensors files, coded and updated chunk by chunk."""
    from safetensors.torch import save_file

    from deploy.registry.snapshot import open_safetensors

    g = torch.Generator().manual_seed(4)
    master = {"a": torch.randn(300_000, generator=g) * 0.02, "b": torch.randn(64, 33, generator=g)}
    base = {k: v.to(torch.bfloat16) for k, v in master.items()}
    target = {k: (v + 3e-6 * torch.randn(v.shape, generator=g).sign()).to(torch.bfloat16) for k, v in master.items()}
    base["f"], target["f"] = torch.ones(5, dtype=torch.float32), torch.ones(5, dtype=torch.float32)
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(target, str(tmp_path / "target.safetensors"))
    before = (tmp_path / "base.safetensors").read_bytes()
    mapped = open_safetensors(tmp_path / "base.safetensors")
    blob = encode_delta(mapped, open_safetensors(tmp_path / "target.safetensors"), 0, 1, chunk_elements=65_536)
    assert same_bits(apply_delta(mapped, blob)[0], target)
    apply_delta_inplace(mapped, blob)  # a copy-on-write mapping: the file stays as it was
    assert (tmp_path / "base.safetensors").read_bytes() == before
    served = open_safetensors(tmp_path / "base.safetensors", writable=True)
    apply_delta_inplace(served, blob)
    del served
    from safetensors.torch import load_file

    assert same_bits(load_file(str(tmp_path / "base.safetensors")), target)  # the file itself moved to B
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        open_safetensors(tmp_path / "junk.safetensors")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_warm_up_covers_every_holder_of_a_delta_so_nothing_compiles_later(dtype):
    """The kernels ``warm_up`` compiles are the ones a delta from anywhere runs: bytes (the registry), a bytearray or
    a memoryview (a download, a mapped file). A gate once compiled a new read-only signature mid-judgement (numba
    keys kernels on writability): minutes on a loaded machine before its first verdict."""
    from deploy.registry import kernels
    from deploy.registry.delta import DTYPES, warm_up

    warm_up((dtype,))
    known = {k.__name__: set(k.signatures) for k in (kernels.cond_decode, kernels.xor_scatter, kernels.cond_encode)}
    dt = DTYPES[dtype]
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << dt.bits, size=1 << 12, dtype=np.uint64).astype(dt.uint)
    a = {"w": torch.from_numpy(bits.copy()).view(dt.torch)}
    t = bits.copy()
    t[::7] ^= 1
    b = {"w": torch.from_numpy(t).view(dt.torch)}
    blob = encode_delta(a, b, 0, 1)
    for holder in (bytes(blob), bytearray(blob), memoryview(bytearray(blob))):
        x = {"w": a["w"].clone()}
        apply_delta_inplace(x, holder)
        assert torch.equal(x["w"].view(torch.uint8), b["w"].view(torch.uint8))  # bit for bit (NaNs included)
    assert {
        k.__name__: set(k.signatures) for k in (kernels.cond_decode, kernels.xor_scatter, kernels.cond_encode)
    } == known
