"""What the join reads from its inputs and writes out: a record's parts, samples, dead letters, the held-out share.

Pure functions of validated data (``core.schemas``), no state: ``ingest.join`` calls them per event.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

from core import keys
from core.schemas import SCHEMA_VERSION, DeadLetter, FeedbackEvent, GenerationRecord
from ingest.entry import to_json

# Largest record ingest writes (table entry, sample, dead letter): under the 1,000,000-byte produce request limit
# of the worker's producer (and the broker's default 1 MiB message limit), with room for the record's framing.
MAX_RECORD_BYTES = 950_000
REVERT_SUFFIX = ":revert"  # the sample id of a revert's correction: <generation id>:revert
DEAD_VALUE_BYTES = 16 * 1024  # how much of a refused value a dead letter carries (plus its size and sha256)
DEAD_DETAIL_CHARS = 1000
KEY_CHARS = 256


class Source(NamedTuple):
    """Where an input came from (for dead letters, and to know when its offset is committed). A tuple: one is made
    per input record, and a frozen dataclass costs several times as much to build."""

    topic: str
    partition: int | None
    offset: int | None
    key: str | bytes | None = None  # the record's key as it came (``key_text`` where it is shown)
    ts: float | None = None  # the record's Kafka timestamp, seconds


def _guardrails(meta: dict) -> str:
    """The guardrail sums of a judgement (kept in its entry as ``n`` tokens and ``ms`` of latency), for its tally kind;
    an entry without them has none."""
    ms = meta.get("ms")
    return keys.judged_fields(meta.get("n"), None if ms is None else ms / 1000.0)


def _counted_again(meta: dict, t: float) -> tuple | None:
    """The live counters' entry (``Tally.live``) of a judged entry's judgement (``meta`` of an entry written at ``t``,
    its judgement's time), to count again: idempotent, it heals a crash between the join and the Redis write. None for
    a generation of mixed versions (``m``): it was never counted for any version."""
    if meta.get("m"):
        return None
    return meta["f"], meta["v"], meta["k"] + _guardrails(meta), unit_bucket_of(meta, t), meta.get("u")


def judged_bucket(feedback_ts: float, now: float) -> int:
    """The per-user sums' bucket (``keys.units``) of a judgement: the bucket of the user's own judgement time (the
    feedback's ``ts``), no later than ``now`` (a timestamp from the future cannot reach a bucket the canary has not
    read yet). Not ingest's clock: a worker that lags, or pacing that holds feedback back, would move judgements of
    answers served before a canary swap into the canary's first buckets of evidence, counted for stable's version
    (under load that is 26-34% canary events in a canary's first bucket against its 50% share: a sample-ratio
    mismatch that aborts the canary)."""
    return keys.unit_bucket(min(feedback_ts, now))


def unit_bucket_of(meta: dict, t: float) -> int:
    """The bucket a judged entry's judgement counts in (``b``, written by the join); an entry without ``b``: the
    bucket of the time it was written."""
    b = meta.get("b")
    return b if isinstance(b, int) else keys.unit_bucket(t)


def is_heldout(generation_id: str, share: float) -> bool:
    """Whether a joined sample goes to the held-out stream: a fixed hash-share of generation ids (the same answer on
    every replay and every worker)."""
    if share <= 0:
        return False
    h = _HELDOUT_HASH.copy()  # (a copy of the keyed state costs a third less than a new one)
    h.update(generation_id.encode())
    return int.from_bytes(h.digest(), "big") / 2**64 < share


_HELDOUT_HASH = hashlib.blake2b(digest_size=8, person=b"liverl-heldout")


def record_parts(rec: GenerationRecord) -> tuple[dict[str, Any], bytes]:
    """What a join needs of a validated record, as a waiting entry keeps it: the few values the judgement and the
    sample read (``meta``: version ``v``, time ``ts``, completion length ``n`` (``completion_tokens`` when the record
    was logged without its token lists), latency ``ms``, ``x`` when not trainable (``"too_large"`` for such a record,
    else 1), the user's ``unit`` as ``u``, ``m`` when more than one version sampled it, or which is unknown:
    ``GenerationRecord.mixed_versions``) and ``body``, the sample's middle fields already serialised
    (``sample_json`` splices them in, so a join neither parses the record again nor serialises its token lists)."""
    return _parts(
        rec.policy_version,
        rec.ts,
        rec.latency_s,
        rec.trainable,
        rec.prompt_token_ids,
        rec.completion_token_ids,
        rec.completion_logprobs,
        rec.sampling,
        rec.unit,
        rec.mixed_versions,
        tokens=rec.completion_tokens,
        too_large=rec.untrainable_reason == "too_large",
        routed=rec.routed_experts,
        sealed=rec.sealed,
    )


def _parts(
    version: int,
    ts: float,
    latency_s: float | None,
    trainable: bool,
    prompt_ids: list,
    completion_ids: list,
    logprobs: list,
    sampling: Any,
    unit: str | None = None,
    mixed: bool = False,
    tokens: int | None = None,
    too_large: bool = False,
    routed: str | None = None,
    sealed: str | None = None,
) -> tuple[dict[str, Any], bytes]:
    if sealed is not None:  # its length: one log-prob per completion token
        completion_ids, tokens = [], len(logprobs) if tokens is None else tokens
    meta: dict[str, Any] = {"v": version, "ts": ts, "n": len(completion_ids) if tokens is None else tokens}
    if mixed:
        meta["m"] = 1
    if latency_s is not None:
        meta["ms"] = round(latency_s * 1000.0)
    if not trainable:
        meta["x"] = "too_large" if too_large else 1
    if unit is not None:
        meta["u"] = unit
    fields = {
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "behaviour_logprobs": logprobs,
        "sampling": sampling,
        "routed_experts": routed,
    }
    if sealed is not None:  # kept sealed in the table and its changelog; the join opens it (ingest.sealing)
        meta["s"] = 1
        fields["sealed"] = sealed
    return meta, to_json(fields)[1:-1]


def sample_json(
    gid: str,
    meta: dict[str, Any],
    body: bytes,
    fb: FeedbackEvent,
    reward: float,
    joined_at: float,
    sealed: str | None = None,
) -> bytes:
    """The ``TrainingSample`` of a judged generation, as its wire JSON: byte for byte what
    ``TrainingSample(...).model_dump_json()`` gives (tests/ingest/test_fuzz.py checks it), built from data already
    validated (the record's ``record_parts``, the feedback) without validating it again: that would cost the join a
    fifth of its time. The reward is the product's code, so it is checked here. ``joined_at``: ingest's clock at the
    join (``ts_joined``). ``sealed``: the sample's text sealed under its user's key (``ingest.sealing``); ``body`` and
    the edit are then the empty fields a sealed sample carries."""
    if not math.isfinite(reward):
        raise ValueError(f"the product's reward for {fb.kind!r} is {reward}: rewards must be finite")
    head = to_json(
        {
            "schema_version": SCHEMA_VERSION,
            "sample_id": gid,
            "generation_id": gid,
            "feedback_id": fb.feedback_id,
            "policy_version": meta["v"],
            "kind": fb.kind,
            "reward": reward,
            "segment": fb.segment,
        }
    )
    tail = to_json(
        {
            "edited_text": None if sealed is not None else fb.edited_text,
            "ts_generation": meta["ts"],
            "ts_feedback": fb.ts,
            "ts_joined": joined_at,
            "unit": meta.get("u"),
            "sealed": sealed,
        }
    )
    return b"".join((head[:-1], b",", body, b",", tail[1:]))


def key_text(key: Any) -> str | None:
    if key is None:
        return None
    text = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else str(key)
    return text[:KEY_CHARS]


def dead_letter(reason: str, detail: str, src: Source, value: bytes | None) -> DeadLetter:
    """A dead letter whose size is bounded whatever the input: value cut to ``DEAD_VALUE_BYTES``, with its size
    and sha256 so the original can still be matched."""
    raw = value or b""
    cut = len(raw) > DEAD_VALUE_BYTES
    return DeadLetter(
        reason=reason,
        detail=detail[:DEAD_DETAIL_CHARS],
        source_topic=src.topic,
        partition=src.partition,
        offset=src.offset,
        key=key_text(src.key),
        value=raw[:DEAD_VALUE_BYTES].decode("utf-8", "replace"),
        value_truncated=cut,
        value_size=len(raw),
        value_sha256=hashlib.sha256(raw).hexdigest(),
    )
