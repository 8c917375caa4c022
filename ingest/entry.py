"""A join table entry's bytes: ``kind|t|meta-json\\npayload``.

One entry per generation id (``ingest.join`` says what each kind means). The kind and the time the entry was written
are read without parsing JSON (``head``), so the store derives its expiry index from every write cheaply
(``ingest.store``), and the timers check an entry's age without parsing it.

==========  ==========================================  ============================================================
kind        meta                                        payload
==========  ==========================================  ============================================================
``W``       what the join needs of the record           the sample's middle fields, serialised (``join.record_parts``)
``P``       feedback id ``f``, its Kafka time ``kts``,  the feedback event's canonical JSON
            where it came from ``src``
``J``       the judgement (``f``, ``v``, ``k``, ...)     an accept's sample, for ``revert_sample_ttl_s``; else empty
==========  ==========================================  ============================================================
"""

from __future__ import annotations

from pydantic_core import from_json, to_json  # compact JSON, a fifth of the json module's time

WAITING, PENDING, JUDGED = b"W", b"P", b"J"
ACCEPT_KEPT = b"A"  # (index only) a judgement that keeps its accepted sample: the payload expires first


def pack(kind: bytes, t: float, meta: dict | None = None, payload: bytes = b"") -> bytes:
    got = _HEADS.get(kind)
    if got is not None and got[0] == t:  # a batch writes its entries at one time: the head is the same
        head_ = got[1]
    else:
        head_ = kind + b"|" + repr(float(t)).encode() + b"|"
        _HEADS[kind] = (t, head_)
    return head_ + (to_json(meta) if meta is not None else b"") + b"\n" + payload


_HEADS: dict[bytes, tuple[float, bytes]] = {}  # the last head made per kind


def head(value: bytes) -> tuple[bytes, float]:
    """(kind, time written) of an entry, without parsing its JSON."""
    end = value.index(b"|", 2)
    return value[:1], float(value[2:end])


def unpack(value: bytes) -> tuple[bytes, float, dict, bytes]:
    end = value.index(b"|", 2)
    nl = value.index(b"\n", end)
    meta = value[end + 1 : nl]
    return value[:1], float(value[2:end]), (from_json(meta) if meta else {}), value[nl + 1 :]


def without_payload(value: bytes) -> bytes:
    """The entry with its payload cut (same kind, time and meta): a judgement that no longer keeps its sample."""
    return value[: value.index(b"\n", value.index(b"|", 2)) + 1]


def ms(t: float) -> int:
    """An entry's time as the store's expiry index orders it: whole milliseconds (never negative)."""
    return max(0, int(t * 1000.0))


def expiry_class(value: bytes) -> tuple[bytes, int] | None:
    """Where an entry sits in the expiry index: (``W``, ``J`` or ``ACCEPT_KEPT``, its time in ms); None for pending
    feedback (which has its own index and timer) and for bytes that are no entry."""
    kind = value[:1]
    if kind == PENDING or kind not in (WAITING, JUDGED):
        return None
    try:
        kind, t = head(value)
    except ValueError:
        return None
    if kind == JUDGED and not value.endswith(b"\n"):
        kind = ACCEPT_KEPT
    return kind, ms(t)


def pending_info(value: bytes) -> tuple[float, float, int | None]:
    """(time written, the feedback's Kafka time, its input partition) of a pending entry: what the sweep needs."""
    _, t, meta, _ = unpack(value)
    return t, meta["kts"], meta["src"][1]


__all__ = [
    "ACCEPT_KEPT",
    "JUDGED",
    "PENDING",
    "WAITING",
    "expiry_class",
    "head",
    "ms",
    "pack",
    "pending_info",
    "to_json",
    "unpack",
    "without_payload",
]
