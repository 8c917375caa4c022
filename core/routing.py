"""The routing of a generation on the wire: which experts the server's router chose, per token and MoE layer.

An MoE router is a hard top-k: a difference in the last bits between the server's kernels and the learner's flips
some tokens to other experts, and those tokens' log-probs then differ between the sampler and the trainer. With
``learner.routing_replay = "rollout"`` the learner takes each token's experts from the sample (the R3 paper's
"Rollout Routing Replay"); this module is how they travel.

What a blob holds, for a sequence of P prompt and C completion tokens: the experts of each of its first P + C - 1
positions (every position whose output the sampler computed; the last sampled token is never fed back), for each
MoE layer in the order of the model's layers (dense layers are left out), ``top_k`` expert indices each, in the
order the router gave them. Each index takes ``bits_for(n_experts)`` bits, packed big-endian without gaps; a
16-byte header in front (little-endian):

=====  ======  =====================================================================
bytes  type    field
=====  ======  =====================================================================
0-1    2s      magic ``b"LR"``
2      u8      format (1)
3      u8      top_k
4-5    u16     MoE layers
6-7    u16     experts per layer
8-11   u32     positions
12-15  u32     CRC-32 of the packed indices
=====  ======  =====================================================================

The payload is exactly ``ceil(positions * layers * top_k * bits / 8)`` bytes, its padding bits zero. ``decode``
refuses, with a ``RoutingError`` that says what is wrong, a blob of another length, a checksum that does not match,
an index out of range, an expert repeated within one token's top-k, or a shape other than the one asked for: a
sample whose routing is refused is dead-lettered by ingest, never trained.

In JSON (``GenerationRecord.routed_experts``, ``TrainingSample.routed_experts``) a blob is standard base64
(``to_text`` / ``from_text``). The demo's model (2 MoE layers, 8 experts, top-2) takes 1.5 bytes a position, 2 in
base64; the test families (2 layers, 4 experts, top-2) 1 byte; Qwen3-30B-A3B (48 layers, 128 experts, top-8) 336
(``bytes_per_position``).

numpy only, imported when a blob is encoded or decoded: the CLI and the config never load it.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"LR"
FORMAT = 1
_HEADER = struct.Struct("<2sBBHHII")
HEADER_BYTES = _HEADER.size  # 16
MAX_EXPERTS = 65535


class RoutingError(ValueError):
    """A routing blob that cannot be used: the message says what is wrong with it."""


def bits_for(n_experts: int) -> int:
    """Bits per expert index: ceil(log2(n_experts)), at least 1."""
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise RoutingError(f"{n_experts} experts: a layer has 1..{MAX_EXPERTS}")
    return max(1, math.ceil(math.log2(n_experts)))


def payload_bytes(positions: int, layers: int, top_k: int, n_experts: int) -> int:
    """Size of the packed indices of that many positions."""
    return (positions * layers * top_k * bits_for(n_experts) + 7) // 8


def bytes_per_position(layers: int, top_k: int, n_experts: int) -> float:
    """Bytes a position adds to a blob (before base64, which takes 4/3 of it)."""
    return layers * top_k * bits_for(n_experts) / 8


def encode(experts_PLK: np.ndarray, n_experts: int) -> bytes:
    """A blob of ``experts_PLK`` [positions, MoE layers, top_k] (integers in 0..n_experts-1)."""
    import numpy as np  # noqa: PLC0415 numpy: only where a blob is made or read

    a = np.asarray(experts_PLK)
    if a.ndim != 3 or a.shape[1] < 1 or a.shape[2] < 1:
        raise RoutingError(f"routing must be [positions, layers, top_k] with layers and top_k >= 1, not {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise RoutingError(f"expert indices must be integers, not {a.dtype}")
    P, L, K = a.shape
    bits = bits_for(n_experts)
    if L > 0xFFFF or K > 0xFF or P > 0xFFFFFFFF:
        raise RoutingError(f"routing of shape {a.shape} does not fit the header (layers < 65536, top_k < 256)")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= n_experts):
        raise RoutingError(f"expert indices must lie in 0..{n_experts - 1}, got {int(a.min())}..{int(a.max())}")
    flat = a.reshape(-1).astype(np.uint32)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint32)
    payload = np.packbits(((flat[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)).tobytes()
    return _HEADER.pack(MAGIC, FORMAT, K, L, n_experts, P, zlib.crc32(payload)) + payload


def header(blob: bytes) -> tuple[int, int, int, int]:
    """(positions, layers, top_k, n_experts) of a blob, from its header alone (checked for magic and format)."""
    if len(blob) < HEADER_BYTES:
        raise RoutingError(f"routing blob of {len(blob)} bytes: shorter than its {HEADER_BYTES}-byte header")
    magic, fmt, K, L, E, P, _ = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise RoutingError(f"not a routing blob: it starts with {magic!r}, not {MAGIC!r}")
    if fmt != FORMAT:
        raise RoutingError(f"routing blob format {fmt}: this build reads format {FORMAT}")
    if K < 1 or L < 1:
        raise RoutingError(f"routing blob of {L} layers and top-{K}: both must be at least 1")
    bits_for(E)
    return P, L, K, E


def decode(
    blob: bytes,
    positions: int | None = None,
    layers: int | None = None,
    top_k: int | None = None,
    n_experts: int | None = None,
) -> np.ndarray:
    """The expert indices of a blob, [positions, layers, top_k] (int64). Every check in the module docstring;
    each of ``positions``, ``layers``, ``top_k``, ``n_experts`` given must equal the blob's."""
    import numpy as np  # noqa: PLC0415 numpy: only where a blob is made or read

    P, L, K, E = header(blob)
    for name, want, got in (("positions", positions, P), ("layers", layers, L), ("top_k", top_k, K)):
        if want is not None and want != got:
            raise RoutingError(f"routing blob holds {got} {name}, expected {want}")
    if n_experts is not None and n_experts != E:
        raise RoutingError(f"routing blob is for {E} experts per layer, the model has {n_experts}")
    payload = memoryview(blob)[HEADER_BYTES:]
    bits = bits_for(E)
    want_bytes = payload_bytes(P, L, K, E)
    if len(payload) != want_bytes:
        how = "truncated" if len(payload) < want_bytes else "too long"
        raise RoutingError(
            f"routing blob {how}: {len(payload)} payload bytes for {P} positions x {L} layers x top-{K} at {bits} "
            f"bits (expected {want_bytes})"
        )
    _, _, _, _, _, _, crc = _HEADER.unpack_from(blob)
    if zlib.crc32(payload) != crc:
        raise RoutingError("routing blob corrupt: the CRC-32 of its indices does not match its header")
    n = P * L * K
    unpacked = np.unpackbits(np.frombuffer(payload, dtype=np.uint8))
    if unpacked[n * bits :].any():
        raise RoutingError("routing blob corrupt: its padding bits are not zero")
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.int64)
    out = unpacked[: n * bits].reshape(n, bits).astype(np.int64) @ weights
    out = out.reshape(P, L, K)
    if n and int(out.max()) >= E:
        raise RoutingError(f"routing blob corrupt: expert index {int(out.max())} out of range (0..{E - 1})")
    if K > 1 and n:
        s = np.sort(out, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            p, layer = np.argwhere((s[..., 1:] == s[..., :-1]).any(-1))[0]
            raise RoutingError(f"routing blob corrupt: position {p}, MoE layer {layer} names an expert twice")
    return out


def to_text(blob: bytes) -> str:
    """A blob as it travels in JSON: standard base64."""
    return base64.b64encode(blob).decode("ascii")


def from_text(text: str) -> bytes:
    """A blob from its base64 text; ``RoutingError`` if it is not base64."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise RoutingError(f"routing is not base64: {e}") from None


def check_text(text: str, positions: int) -> tuple[int, int, int, int]:
    """Refuse (``RoutingError``) the base64 routing of a sequence of ``positions`` positions unless it decodes whole
    (every check of ``decode``); returns its (positions, layers, top_k, n_experts). What ingest applies to a
    generation record: the model's own shape is checked by the learner."""
    blob = from_text(text)
    decode(blob, positions=positions)
    return header(blob)
