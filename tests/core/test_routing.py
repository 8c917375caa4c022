"""The routing codec (``core.routing``): blobs round-trip, take ceil(log2(experts)) bits an index, and every corrupt,
truncated or misshapen blob is refused with a message that says what is wrong."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from core import routing


def _routing(positions: int, layers: int, top_k: int, n_experts: int, seed: int = 0) -> np.ndarray:
    """Random routing: top_k distinct experts per position and layer."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((positions, layers, n_experts)), axis=-1)[..., :top_k]


def _with_payload(blob: bytes, payload: bytes) -> bytes:
    """``blob``'s header over another payload, its CRC made to match (corruption the CRC alone cannot see)."""
    head = bytearray(blob[: routing.HEADER_BYTES])
    struct.pack_into("<I", head, 12, zlib.crc32(payload))
    return bytes(head) + payload


@pytest.mark.parametrize(
    ("layers", "top_k", "n_experts", "bits"),
    [(2, 2, 4, 2), (2, 2, 8, 3), (3, 3, 5, 3), (48, 8, 128, 7), (1, 1, 1, 1), (2, 1, 2, 1), (4, 2, 300, 9)],
)
def test_a_blob_round_trips_at_ceil_log2_bits_an_index(layers, top_k, n_experts, bits):
    r = _routing(37, layers, top_k, n_experts, seed=layers + n_experts)
    blob = routing.encode(r, n_experts)
    assert routing.bits_for(n_experts) == bits
    assert len(blob) == routing.HEADER_BYTES + (37 * layers * top_k * bits + 7) // 8
    assert routing.header(blob) == (37, layers, top_k, n_experts)
    back = routing.decode(blob, positions=37, layers=layers, top_k=top_k, n_experts=n_experts)
    assert back.dtype == np.int64 and np.array_equal(back, r)
    assert routing.from_text(routing.to_text(blob)) == blob


def test_bytes_a_position_for_the_demo_the_test_families_and_a_large_model():
    assert routing.bytes_per_position(layers=2, top_k=2, n_experts=8) == 1.5  # the demo's model
    assert routing.bytes_per_position(layers=2, top_k=2, n_experts=4) == 1.0  # the tiny test families
    assert routing.bytes_per_position(layers=48, top_k=8, n_experts=128) == 336.0  # Qwen3-30B-A3B
    blob = routing.encode(_routing(1000, 2, 2, 8), 8)
    assert len(blob) == routing.HEADER_BYTES + 1500
    assert len(routing.to_text(blob)) == 4 * ((len(blob) + 2) // 3)  # base64: 2 bytes a position in JSON


def test_an_empty_routing_round_trips():
    blob = routing.encode(np.zeros((0, 2, 2), dtype=np.int64), 4)
    assert routing.decode(blob, positions=0).shape == (0, 2, 2)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[: routing.HEADER_BYTES + 2], "truncated"),
        (lambda b: b + b"\0", "too long"),
        (lambda b: b[:10], "shorter than its 16-byte header"),
        (lambda b: b"", "shorter than its 16-byte header"),
        (lambda b: b"XX" + b[2:], "not a routing blob"),
        (lambda b: b[:2] + b"\x07" + b[3:], "format 7"),
        (lambda b: b[:20] + bytes([b[20] ^ 0x10]) + b[21:], "CRC-32"),
        (lambda b: b[:3] + b"\0" + b[4:], "top-0"),
        (lambda b: b[:6] + struct.pack("<H", 0) + b[8:], "0 experts"),
    ],
)
def test_a_corrupt_or_truncated_blob_is_refused_with_what_is_wrong(damage, match):
    blob = routing.encode(_routing(11, 2, 2, 8), 8)
    with pytest.raises(routing.RoutingError, match=match):
        routing.decode(damage(blob))


def test_corruption_behind_a_matching_crc_is_still_refused():
    """An index out of range, an expert twice in one token's top-k, padding bits set: each refused by name."""
    blob = routing.encode(np.array([[[0, 1]], [[2, 3]], [[4, 0]]]), 5)  # 3 bits an index, 18 bits: 6 padding bits
    payload = bytearray(blob[routing.HEADER_BYTES :])
    out_of_range = bytearray(payload)
    out_of_range[0] |= 0b111_00000  # the first index: 7 of 5 experts
    with pytest.raises(routing.RoutingError, match="out of range"):
        routing.decode(_with_payload(blob, bytes(out_of_range)))
    twice = routing.encode(np.array([[[0, 1]], [[2, 3]], [[4, 0]]]), 5)
    twice_payload = bytearray(twice[routing.HEADER_BYTES :])
    twice_payload[0] = 0b001_001_00 | (twice_payload[0] & 0b11)  # position 0: experts 1 and 1
    with pytest.raises(routing.RoutingError, match="position 0, MoE layer 0 names an expert twice"):
        routing.decode(_with_payload(blob, bytes(twice_payload)))
    padded = bytearray(payload)
    padded[-1] |= 1
    with pytest.raises(routing.RoutingError, match="padding bits"):
        routing.decode(_with_payload(blob, bytes(padded)))


def test_a_blob_of_another_shape_is_refused():
    blob = routing.encode(_routing(9, 2, 2, 8), 8)
    for kw, match in (
        ({"positions": 10}, "holds 9 positions, expected 10"),
        ({"layers": 3}, "holds 2 layers, expected 3"),
        ({"top_k": 1}, "holds 2 top_k, expected 1"),
        ({"n_experts": 4}, "for 8 experts per layer, the model has 4"),
    ):
        with pytest.raises(routing.RoutingError, match=match):
            routing.decode(blob, **kw)


def test_encode_refuses_what_it_cannot_hold():
    with pytest.raises(routing.RoutingError, match="lie in 0..3"):
        routing.encode(np.array([[[0, 4]]]), 4)
    with pytest.raises(routing.RoutingError, match="positions, layers, top_k"):
        routing.encode(np.zeros((3, 2)), 4)
    with pytest.raises(routing.RoutingError, match="integers"):
        routing.encode(np.zeros((3, 2, 2)), 4)


def test_text_that_is_not_base64_is_refused():
    with pytest.raises(routing.RoutingError, match="not base64"):
        routing.from_text("not base64!")
    with pytest.raises(routing.RoutingError, match="not base64"):
        routing.from_text("é")
    good = routing.to_text(routing.encode(_routing(4, 2, 2, 4), 4))
    assert routing.check_text(good, positions=4) == (4, 2, 2, 4)
    with pytest.raises(routing.RoutingError, match="expected 5"):
        routing.check_text(good, positions=5)
