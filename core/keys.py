"""The Redis key space: every key liverl keeps in Redis, with a model for every record kept there.

Redis is the pipeline's second contract after the Kafka topics (``core.schemas``): the gate tells the
fleet what to serve, agents report what they serve, ingest keeps live counters, the learner publishes its
state. Every process builds its keys here and parses what it reads with these models, so a key or a field
is renamed in one place. Every key starts with the topic prefix (``cfg.topics.prefix``).

Redis Cluster: keys one step writes together share a hash tag, so they live in one slot: ingest's script counts a
judgement in ``live:{<v>}`` and ``units:{<v>}:<bucket>`` and sets its guard ``counted:{<v>}:<feedback>`` atomically,
one call per version (``redis.url = "redis+cluster://host:port"``, ``core.services.redis_from_url``).

| key                              | type   | written by      | record                                    |
|----------------------------------|--------|-----------------|-------------------------------------------|
| ``<p>:desired``                  | string | gate, admin     | ``VersionAnnouncement`` (schemas), signed, |
|                                  |        |                 | bound to channel, prefix and expiry       |
| ``<p>:canary``                   | string | gate            | the canary's, with its rollout's terms    |
|                                  |        |                 | (id, share, nodes, unit; ``core.fleet``) |
| ``<p>:served:<node>``            | string | serving agent   | ``ServedHeartbeat`` (TTL: stale = gone)   |
| ``<p>:swaps``                    | list   | serving agent   | ``SwapRecord`` (capped, newest last)      |
| ``<p>:swap_errors``              | list   | serving agent   | ``SwapError`` (capped)                    |
| ``<p>:live:{<version>}``         | hash   | ingest          | kind -> count, ``events`` (live acceptance),|
|                                  |        |                 | guardrail sums (``judged_fields``)        |
| ``<p>:units:{<v>}:<bucket>``     | hash   | ingest          | per-user sums of 10 s of judgements       |
|                                  |        |                 | (``units``, ``UNIT_FIELDS``; TTL), and    |
|                                  |        |                 | the bucket's latency histogram            |
|                                  |        |                 | (``*|h<i>``, ``LATENCY_HIST_EDGES_MS``)   |
| ``<p>:ingest:counters``          | hash   | ingest          | counter -> count (``dlq:<reason>`` etc.)  |
| ``<p>:counted:{<v>}:<feedback>`` | string | ingest          | guard: counted once (TTL)                 |
| ``<p>:learner``                  | hash   | learner         | field -> value (step, samples_trained...) |
| ``<p>:learner:hold``             | string | operator, demo  | "1": the learner trains but emits no candidates |
| ``<p>:learner:lease``            | string | learner         | who is the learner (a token with a TTL)   |
| ``<p>:audit:head``               | hash   | registry writers| ``seq``, ``mac``, ``tag``: the audit chain's  |
|                                  |        |                 | head (``deploy.registry.auditchain``; only forward)|
| ``<p>:deployment``               | string | ``up``, gate    | the deployment that claims the prefix     |
|                                  |        |                 | (``liverl.stack.deployment``)             |
| ``<p>:releases``                 | list   | operator        | each release of the prefix from a gone    |
|                                  |        |                 | deployment (``liverl.ops.release``;       |
|                                  |        |                 | capped, newest last; kept by ``--fresh``) |

Which process may read or write which of these keys, as a Redis ACL user of its own: ``core.roles``.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_right

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("liverl.keys")

LIST_CAP = 1000
"""Lists (swaps, swap errors) keep at most this many entries, newest last."""


def wrong_type(e: BaseException) -> bool:
    """True when ``e`` is Redis's ``WRONGTYPE`` answer: a command met a key that holds another type than the table
    above says (written by hand, by another program, or by someone with Redis access). Readers treat such a key as a
    garbage value (counted and logged, naming the key), never as a reason to stop; its owner replaces it."""
    return type(e).__name__ == "ResponseError" and "WRONGTYPE" in str(e)  # in a pipeline or script: inside the text


def desired(prefix: str) -> str:
    return f"{prefix}:desired"


def served(prefix: str, node: str) -> str:
    return f"{prefix}:served:{node}"


def served_pattern(prefix: str) -> str:
    return f"{prefix}:served:*"


def node_of_served(prefix: str, key: str | bytes) -> str:
    key = key.decode() if isinstance(key, bytes) else key
    return key.removeprefix(f"{prefix}:served:")


def swaps(prefix: str) -> str:
    return f"{prefix}:swaps"


def swap_errors(prefix: str) -> str:
    return f"{prefix}:swap_errors"


def live(prefix: str, version: int) -> str:
    """A version's live counters (a hash): ``accept``, ``reject``, ``edit``, ``events`` (judged generations),
    ``revert`` and the guardrail sums (``judged_fields``): a fixed set of fields. It expires with the guard of its
    newest event (7 days after the version was last judged). A revert by when the answer it undoes was judged is in
    the per-user sums (``units``). The version is the key's hash tag: its guards (``counted``) share its Redis
    Cluster slot."""
    return f"{prefix}:live:{{{int(version)}}}"


def judged_fields(tokens: int | None, latency_s: float | None) -> str:
    """The guardrail sums a judged generation adds to its version's live counters, as the suffix of its tally kind
    (``accept;tokens=5;tokens_sq=25;timed=1;latency_ms=180;latency_ms_sq=32400``; ingest's Lua script applies it in
    the same guarded step as the count): response length in completion tokens, and, when the gateway timed it, the
    serving latency in milliseconds, each with its square, so a canary has each arm's mean and variance
    (``moments``)."""
    out = ""
    if tokens is not None:
        out += f";tokens={int(tokens)};tokens_sq={int(tokens) ** 2}"
    if latency_s is not None and math.isfinite(latency_s) and latency_s >= 0:
        ms = round(latency_s * 1000.0)
        out += f";timed=1;latency_ms={ms};latency_ms_sq={ms * ms}"
    return out


GUARDRAIL_SUMS: dict[str, tuple[str, str]] = {
    "response_length": ("tokens", "events"),
    "latency": ("latency_ms", "timed"),
}
"""Continuous guardrails kept in the live counters: name -> (sum field, count field); ``<sum field>_sq`` holds the
squares."""


def moments(counts: dict[str, int], guardrail: str) -> tuple[int, float, float]:
    """(n, sum, sum of squares) of a continuous guardrail (``GUARDRAIL_SUMS``) in a live hash; n is 0 when the hash
    has none of it (records from a gateway that did not time them)."""
    field, n_field = GUARDRAIL_SUMS[guardrail]
    if field not in counts:
        return 0, 0.0, 0.0
    return counts.get(n_field, 0), float(counts[field]), float(counts.get(f"{field}_sq", 0))


REVERT_BUCKET_S = 10
"""Reverts are also counted by when the generation they undo was judged, in buckets of this many seconds."""


def revert_field(judged_at: float) -> str:
    """The tally kind of a revert of a generation judged at ``judged_at`` (``revert@<bucket>``): a revert arrives late,
    and the canary counts it in the bucket of the judgement it undoes (``units``); the live hash counts it as a plain
    ``revert``."""
    return f"revert@{int(judged_at // REVERT_BUCKET_S)}"


UNIT_BUCKET_S = 10
"""Per-user sums are kept per this many seconds of judgement time (``units``)."""

ALL_UNITS = "*"
"""The unit of a bucket's aggregate fields: every judged event of the bucket, with a unit or without."""

UNIT_FIELDS = ("e", "a", "d", "r", "t", "m", "n")
"""Fields kept per unit ``u`` in a bucket, as ``<u>|<field>``: ``e`` judged events (accept, reject, edit), ``a``
accepts, ``d`` edits, ``r`` reverts of the generations judged in the bucket (counted in the bucket of the judgement,
whenever the revert came), ``t`` completion tokens, ``m`` latency in ms (sum), ``n`` timed events (the count ``m``
sums over). Rejects are ``e - a - d``; a field that is 0 may be absent."""

LATENCY_HIST_EDGES_MS: tuple[int, ...] = tuple(round(4 * 2 ** (i / 4)) for i in range(57))
"""Edges of the latency histogram kept per version and bucket, in whole ms: 4 ms to 65,536 ms, four bins an octave
(each bin 19% wide, rounded to whole ms below 32 ms). Bin ``i`` (field ``*|h<i>``, ``latency_bin``) counts the timed
events of the bucket with ``LATENCY_HIST_EDGES_MS[i - 1] <= ms < LATENCY_HIST_EDGES_MS[i]``; bin 0 those below 4 ms,
bin 57 those at 65,536 ms or more. So a bucket's hash holds at most ``LATENCY_HIST_BINS`` (58) histogram fields
whatever its traffic: what a quantile of the bucket's latency needs (``deploy.gate.sequential_quantile``), where the
sums ``m`` and ``m2`` give only its mean and variance. A quantile read from it is within one bin (19%) of the
bucket's own at worst, and the same bins on both arms make that error common to them."""

LATENCY_HIST_BINS = len(LATENCY_HIST_EDGES_MS) + 1


def latency_bin(ms: int) -> int:
    """The histogram bin (``LATENCY_HIST_EDGES_MS``) of a latency of ``ms`` whole milliseconds: how many edges are at
    or below it. Ingest's script computes the same by a binary search over the same edges."""
    return bisect_right(LATENCY_HIST_EDGES_MS, ms)


ALL_FIELDS = UNIT_FIELDS + ("t2", "m2")
"""Fields of the aggregate unit ``ALL_UNITS``: ``UNIT_FIELDS`` and the squares ``t2`` (tokens) and ``m2`` (latency
ms), for per-request tests and batch means. Beside them it holds ``h0`` .. ``h57``, the bucket's latency histogram
(``LATENCY_HIST_EDGES_MS``; a bin that is 0 is absent)."""


def unit_bucket(judged_at: float) -> int:
    """The bucket (``UNIT_BUCKET_S`` seconds of judgement time) a generation judged at ``judged_at`` is counted in."""
    return int(judged_at // UNIT_BUCKET_S)


def units(prefix: str, version: int, bucket: int) -> str:
    """Per-user sums of ``version``'s generations judged in ``bucket`` (a hash ``<unit>|<field>`` -> int,
    ``UNIT_FIELDS``, and ``*|<field>`` for every event of the bucket, ``ALL_FIELDS`` and the latency histogram's
    ``*|h<i>``, ``LATENCY_HIST_EDGES_MS``: its fields are bounded by the users judged in it, whatever the traffic).
    Written by ingest's live counters' script, once per feedback id, with a TTL (``ingest.unit_ttl_s``). The version
    is the hash tag: the same Redis Cluster slot as ``live`` and the guards."""
    return f"{prefix}:units:{{{int(version)}}}:{int(bucket)}"


def closed_unit_buckets(since: float, now: float, horizon_s: float) -> range:
    """The buckets of generations judged at or after ``since`` whose revert horizon has closed by ``now``: every
    generation in them was judged at least ``horizon_s`` before ``now``, so their reverts (``r``) are final. The
    bucket ``since`` falls inside is left out (part of it was judged before)."""
    first = math.ceil(since / UNIT_BUCKET_S)
    end = math.floor((now - horizon_s) / UNIT_BUCKET_S)  # bucket b ends at (b + 1) * S <= now - horizon
    return range(first, max(first, end))


def read_unit_buckets(redis, prefix: str, version: int, buckets) -> dict[int, dict[str, dict[str, int]]]:
    """Per-user sums of ``version`` in ``buckets``: ``{bucket: {unit: {field: n}}}`` (unit ``ALL_UNITS`` holds the
    bucket's aggregate). One pipelined round trip for all buckets (the keys share a Cluster slot); a bucket with no key
    (nothing judged, or expired) maps to ``{}``, and so does a key that holds another type than a hash (logged).
    ``redis`` is a sync client, with or without ``decode_responses``."""
    buckets = [int(b) for b in buckets]
    if not buckets:
        return {}
    pipe = redis.pipeline(transaction=False)
    for b in buckets:
        pipe.hgetall(units(prefix, version, b))
    out: dict[int, dict[str, dict[str, int]]] = {}
    for b, raw in zip(buckets, pipe.execute(raise_on_error=False), strict=True):
        per: dict[str, dict[str, int]] = {}
        if isinstance(raw, Exception):
            if not wrong_type(raw):
                raise raw
            log.error("ignoring %s: %s (ingest replaces it at its next write)", units(prefix, version, b), raw)
            raw = {}
        for k, n in raw.items():
            k = k.decode() if isinstance(k, bytes) else k
            unit, _, name = k.rpartition("|")
            per.setdefault(unit, {})[name] = int(n)
        out[b] = per
    return out


def unit_totals(buckets: dict[int, dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """``read_unit_buckets``' answer summed over its buckets: ``{unit: {field: n}}``."""
    out: dict[str, dict[str, int]] = {}
    for per in buckets.values():
        for unit, fields in per.items():
            acc = out.setdefault(unit, {})
            for name, n in fields.items():
                acc[name] = acc.get(name, 0) + n
    return out


_SUM_FIELDS = frozenset(f for field, n_field in GUARDRAIL_SUMS.values() for f in (field, f"{field}_sq", n_field)) - {
    "events"
}


def live_totals(counts: dict[str, int]) -> dict[str, int]:
    """A live hash's counts (kinds and ``events``), without its per-bucket revert fields and guardrail sums: what
    tables and reports show (``guardrail_means`` gives the rest)."""
    return {k: n for k, n in counts.items() if "@" not in k and k not in _SUM_FIELDS}


def guardrail_means(counts: dict[str, int]) -> dict[str, float]:
    """Mean of each continuous guardrail a live hash has (``response_length`` in tokens, ``latency`` in ms)."""
    out = {}
    for name in GUARDRAIL_SUMS:
        n, total, _ = moments(counts, name)
        if n:
            out[name] = total / n
    return out


def canary(prefix: str) -> str:
    """The canary version, announced (and signed) as ``desired`` is; served only by the rollout's nodes."""
    return f"{prefix}:canary"


def rollout(prefix: str) -> str:
    """Where a build before the registry's rollouts kept its unsigned rollout plan. Nothing writes or reads it now (the
    rollout lives in the registry, its terms in the signed ``canary`` announcement); tests forge it to show that."""
    return f"{prefix}:rollout"


def live_pattern(prefix: str) -> str:
    return f"{prefix}:live:*"


def version_of_live(key: str | bytes) -> int | None:
    key = key.decode() if isinstance(key, bytes) else key
    tail = key.rsplit(":", 1)[-1].removeprefix("{").removesuffix("}")
    return int(tail) if tail.isdigit() else None


def ingest_counters(prefix: str) -> str:
    return f"{prefix}:ingest:counters"


def counted(prefix: str, version: int, feedback_id: str) -> str:
    """The guard that a feedback event was counted in ``version``'s live counters (same hash tag: same slot)."""
    return f"{prefix}:counted:{{{int(version)}}}:{feedback_id}"


def learner(prefix: str) -> str:
    return f"{prefix}:learner"


def learner_hold(prefix: str) -> str:
    return f"{prefix}:learner:hold"


def learner_lease(prefix: str) -> str:
    """Who is this deployment's learner (a token with a TTL, renewed while it runs; see ``learner.lease``)."""
    return f"{prefix}:learner:lease"


def audit_head(prefix: str) -> str:
    """The audit chain's anchored head (a hash ``seq``, ``mac``, ``tag``; ``deploy.registry.auditchain``)."""
    return f"{prefix}:audit:head"


def deployment(prefix: str) -> str:
    """The claim of the deployment that owns ``<prefix>:*`` (``liverl.stack.deployment``)."""
    return f"{prefix}:deployment"


def releases(prefix: str) -> str:
    """Every release of the prefix from a deployment that is gone (``liverl release-prefix``): the prefix's own
    history, not a deployment's, so a release and ``up --fresh`` leave it (``liverl.ops.release``)."""
    return f"{prefix}:releases"


def units_pattern(prefix: str) -> str:
    return f"{prefix}:units:*"


def counted_pattern(prefix: str) -> str:
    return f"{prefix}:counted:*"


def everything(prefix: str) -> str:
    """The pattern of every key of this prefix (a demo's reset)."""
    return f"{prefix}:*"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: str | bytes):
        return cls.model_validate_json(raw)


class ServedHeartbeat(_Record):
    """What a serving node serves, refreshed every agent poll; the key expires when the node stops."""

    version: int | None
    checksum: str | None
    ts: float = Field(default_factory=time.time)
    last_swap_pause_ms: float | None = None
    healthy: bool = True
    url: str | None = None  # the node's gateway, for the router (serving.advertise_url); None: not routable


class SwapRecord(_Record):
    """One hot-swap attempt on one node, with where its pause went."""

    node: str
    from_: int | None = Field(alias="from")
    to: int
    how: str
    deltas: int
    verify_ok: bool = False
    drain_ms: float | None = None
    vllm_pause_ms: float | None = None
    apply_ms: float | None = None
    pause_ms: float | None = None
    ts: float = Field(default_factory=time.time)

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)


class SwapErrorRecord(_Record):
    node: str
    from_: int | None = Field(alias="from")
    to: int
    error: str
    restored: bool
    ts: float = Field(default_factory=time.time)

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)
