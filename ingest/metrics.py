"""Counters of the ingest worker: Prometheus metrics in-process, and the shared Redis hashes.

Two audiences, two stores:

- Prometheus (``/metrics`` on the ingest worker's web server) for operators: per-process counters with the
  ``liverl_ingest_`` prefix, ``_total`` suffix and no per-user labels (Prometheus naming practice).
- Redis, for the demo and the CLI, which read one place for the whole fleet:
  ``<prefix>:ingest:counters`` (operational counts, at-least-once: a redelivered input is counted again)
  (``mixed_versions``: judgements of generations sampled by more than one version, counted for none)
  and ``<prefix>:live:<policy_version>`` (accept/reject/edit/events) with its per-user sums per 10 s of judgement
  time ``<prefix>:units:{<policy_version>}:<bucket>`` (``keys.units``), which are counted exactly once per
  ``feedback_id`` by a Lua script that sets a guard key ``<prefix>:counted:<feedback_id>`` in the same
  atomic step as the increments. That is what makes the live acceptance rate trustworthy under redelivery.

Increments are gathered per processed batch (``Tally``) and written with one pipelined round trip, so
Redis costs one RTT per batch rather than one per event.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from bisect import bisect_left
from collections import Counter as _Counter
from dataclasses import dataclass, field

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis.commands.core import AsyncScript

from core import keys
from core.config import redact_url
from core.services import is_cluster_url, redis_from_url

log = logging.getLogger("liverl.ingest.metrics")

# How long the per-feedback_id guard key lives. Redelivery happens within minutes (the uncommitted tail
# of a partition); a week is far beyond any realistic replay, and it bounds Redis memory.
COUNTED_TTL_S = 7 * 24 * 3600
UNIT_TTL_S = 2 * 24 * 3600  # how long per-user sums live after their last write (ingest.unit_ttl_s's default)

# KEYS[1] = the version's live hash, KEYS[1 + i] (i = 1..m) = its per-user sums of bucket i (keys.units),
# KEYS[1 + m + j] = guard key of event j; ARGV[1] = guard ttl, ARGV[2] = per-user sums' ttl, ARGV[3] = m, and for event
# j (E of them): ARGV[3 + j] = its kind (a revert's kind carries the bucket of its generation's judgement:
# revert@<bucket>, keys.revert_field, which the live hash counts as a plain revert; a judgement's kind may end with
# the guardrail sums it adds: accept;tokens=5;tokens_sq=25;..., keys.judged_fields), ARGV[3 + E + j] = i, the
# per-user sums it goes to (0: none), ARGV[3 + 2E + j] = its unit ('': none; it counts in the bucket's aggregate
# '*' either way).
# The increments of the events whose guard was new are summed in the script and written once per key and field: a
# batch costs Redis one SET per event, a few HINCRBYs for the live hash and an HMGET and an HSET per 2,000 per-user
# fields, not a dozen writes per event (Redis is the one process every worker shares: its cost per event bounds the
# fleet). Lua numbers are doubles, exact below 2^53: a
# value of more than 15 digits is written alone as it came, and a sum is written out before it reaches 2^52.
# A timed judgement also counts in its bucket's latency histogram (keys.LATENCY_HIST_EDGES_MS: '*|h<i>', at most 58
# fields a bucket), what a canary's latency quantile needs.
_LIVE_LUA = """
local n = 0
local m = tonumber(ARGV[3])
local events = #KEYS - 1 - m
-- a hash key that holds another type would fail the script half-way, after its guards were set (the batch would
-- then count for nothing on the retry): refuse before any write, naming the key, and let the caller replace it
for i = 1, m + 1 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= 'none' and t ~= 'hash' then
    return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' holds a ' .. t .. ', not a hash')
  end
end
local accs = {}  -- per key: its sums and the order their fields came in
for i = 1, m + 1 do
  accs[i] = {KEYS[i], {}, {}}
end
local function add(acc, field, value)
  local sums = acc[2]
  local sum = sums[field]
  if sum == nil then
    local order = acc[3]
    order[#order + 1] = field
    sum = 0
  end
  sum = sum + value
  if sum >= 4503599627370496 then
    redis.call('HINCRBY', acc[1], field, string.format('%.0f', sum))
    sum = 0
  end
  sums[field] = sum
end
local live = accs[1]
-- the per-user fields (keys.UNIT_FIELDS) of a guardrail sum and of a kind (nil: none), and the aggregate's
local unit_sum = {tokens = 't', latency_ms = 'm', timed = 'n'}
local all_sum = {tokens = '*|t', tokens_sq = '*|t2', latency_ms = '*|m', latency_ms_sq = '*|m2', timed = '*|n'}
local unit_kind = {accept = 'a', edit = 'd', revert = 'r'}
local all_kind = {accept = '*|a', edit = '*|d', revert = '*|r'}
-- the latency histogram's edges in ms (keys.LATENCY_HIST_EDGES_MS): a timed event counts once in '*|h<i>', i the
-- number of edges at or below its latency (keys.latency_bin)
local hist_edges = {@HIST_EDGES@}
local function hist_field(ms)
  local lo, hi = 1, #hist_edges + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if hist_edges[mid] <= ms then lo = mid + 1 else hi = mid end
  end
  return '*|h' .. (lo - 1)
end
for j = 1, events do
  if redis.call('SET', KEYS[1 + m + j], '1', 'NX', 'EX', ARGV[1]) then
    local kind = ARGV[3 + j]
    local ui = tonumber(ARGV[3 + events + j])
    local acc, up = nil, nil
    if ui > 0 then
      acc = accs[1 + ui]
      local unit = ARGV[3 + 2 * events + j]
      if unit ~= '' then
        up = unit .. '|'
      end
    end
    local semi = string.find(kind, ';', 1, true)
    if semi then
      for field, value in string.gmatch(string.sub(kind, semi + 1), '([%w_]+)=(%d+)') do
        local big = #value > 15
        if big then
          redis.call('HINCRBY', live[1], field, value)
        else
          value = tonumber(value)
          add(live, field, value)
        end
        if acc then
          local f = all_sum[field]
          if f then
            if big then redis.call('HINCRBY', acc[1], f, value) else add(acc, f, value) end
          end
          f = unit_sum[field]
          if f and up then
            if big then redis.call('HINCRBY', acc[1], up .. f, value) else add(acc, up .. f, value) end
          end
          if field == 'latency_ms' then
            add(acc, hist_field(big and math.huge or value), 1)
          end
        end
      end
      kind = string.sub(kind, 1, semi - 1)
    end
    local at = string.find(kind, '@', 1, true)  -- revert@<bucket>: counted in the per-user sums' bucket only
    local base = kind
    if at then
      base = string.sub(kind, 1, at - 1)
    end
    add(live, base, 1)
    local f = unit_kind[base]
    if acc and f then
      add(acc, all_kind[base], 1)
      if up then add(acc, up .. f, 1) end
    end
    if base ~= 'revert' then  -- a follow-up on a judged generation, not another judged event
      add(live, 'events', 1)
      if acc then
        add(acc, '*|e', 1)
        if up then add(acc, up .. 'e', 1) end
      end
    end
    n = n + 1
  end
end
-- the live hash: one HINCRBY per field (a sum of 0 is written too: the field exists as it did with one write per event)
for _, field in ipairs(live[3]) do
  redis.call('HINCRBY', live[1], field, string.format('%.0f', live[2][field]))
end
if #live[3] > 0 then  -- the live hash lives as long as its newest event's guard: a version judged no more leaves
  redis.call('EXPIRE', live[1], ARGV[1])
end
-- the per-user sums: thousands of fields, read and written a chunk at a time (HMGET, HSET: two calls where HINCRBY
-- would take one per field); a value read of more than 15 digits is added to by HINCRBY, the rest stay below 2^53
for i = 2, #accs do
  local key, sums, order = accs[i][1], accs[i][2], accs[i][3]
  for c = 1, #order, 2000 do
    local fields = {}
    for k = c, math.min(c + 1999, #order) do
      fields[#fields + 1] = order[k]
    end
    local had = redis.call('HMGET', key, unpack(fields))
    local set = {}
    for k, field in ipairs(fields) do
      local old = had[k]
      if old and #old > 15 then
        redis.call('HINCRBY', key, field, string.format('%.0f', sums[field]))
      else
        set[#set + 1] = field
        set[#set + 1] = string.format('%.0f', (old and tonumber(old) or 0) + sums[field])
      end
    end
    if #set > 0 then
      redis.call('HSET', key, unpack(set))
    end
  end
  if #order > 0 then
    redis.call('EXPIRE', key, ARGV[2])
  end
end
return n
""".replace("@HIST_EDGES@", ", ".join(str(e) for e in keys.LATENCY_HIST_EDGES_MS))


@dataclass
class Tally:
    """Increments gathered while one batch is processed; applied once the batch's output is durable."""

    counts: _Counter = field(default_factory=_Counter)
    # (feedback_id, policy_version, kind, bucket, unit) of every join and revert, and of every redelivered duplicate of
    # one (re-applying the guarded increment heals a crash between the join and the Redis write); a join's kind carries
    # its guardrail sums (keys.judged_fields); bucket: keys.unit_bucket of the judgement's time, for the per-user sums
    # (keys.units; None: none), unit: the generation's (None: counted in the bucket's aggregate only). (A 3-tuple
    # (feedback_id, policy_version, kind) counts in the live hash only.)
    live: list[tuple] = field(default_factory=list)
    joined_kinds: _Counter = field(default_factory=_Counter)
    feedback_delays_s: list[float] = field(default_factory=list)

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def __bool__(self) -> bool:
        return bool(self.counts or self.live)


def observe_many(hist: Histogram, values: list[float]) -> None:
    """``hist.observe(v)`` for every finite ``v`` (negatives as 0; a NaN would poison the sum for good), with one
    increment per bucket instead of two locked increments per value: a batch observes thousands. Reaches into the
    histogram's buckets (prometheus_client has no bulk observe); tests/ingest/test_fuzz.py checks the exposition
    is the one ``observe`` gives, and a client without these internals falls back to ``observe``."""
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            if math.isfinite(v):
                hist.observe(max(v, 0.0))
        return
    counts = [0] * len(bounds)
    s = 0.0
    for v in values:
        if not math.isfinite(v):
            continue
        if v < 0.0:
            v = 0.0
        counts[bisect_left(bounds, v)] += 1
        s += v
    if s:
        total.inc(s)
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


def _by_version(live: list[tuple]) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for e in live:
        got = out.get(e[1])
        if got is None:
            got = out[e[1]] = []
        got.append(e)
    return out


def _script_call(prefix: str, version: int, entries: list[tuple], unit_ttl_s: float) -> tuple[list[str], list]:
    """The keys and arguments of one call of ``_LIVE_LUA`` for ``version``'s entries (``Tally.live``)."""
    slots: dict[int, int] = {}  # bucket -> its key's index among the per-user sums
    guards: list[str] = []
    kinds: list[str] = []
    where: list[int] = []
    units: list[str] = []
    for e in entries:
        guards.append(keys.counted(prefix, version, e[0]))
        kinds.append(e[2])
        bucket = e[3] if len(e) > 3 else None
        if bucket is None:
            where.append(0)
            units.append("")
            continue
        i = slots.get(bucket)
        if i is None:
            i = slots[bucket] = len(slots) + 1
        where.append(i)
        units.append(e[4] or "")
    lua_keys = [keys.live(prefix, version), *(keys.units(prefix, version, b) for b in slots), *guards]
    return lua_keys, [COUNTED_TTL_S, max(1, math.ceil(unit_ttl_s)), len(slots), *kinds, *where, *units]


class IngestMetrics:
    """Prometheus metrics (private registry, so several apps in one process do not clash) + Redis sink."""

    def __init__(self, prefix: str, redis_url: str):
        self.prefix = prefix
        self.redis_url = redis_url
        self._cluster = is_cluster_url(redis_url)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._declare_records(r)
        self._declare_pacing(r)
        self._declare_refused(r)
        self._declare_progress(r)
        self._redis = None
        self._script: AsyncScript | None = None  # the live counters' script, registered with the client

    # -- declarations (in exposition order) --------------------------------------------------------

    def _declare_records(self, r: CollectorRegistry) -> None:
        """Records consumed, joined and produced."""
        self.feedback = Counter("liverl_ingest_feedback", "Feedback records consumed (valid or not).", registry=r)
        self.generations = Counter(
            "liverl_ingest_generations", "Generation records consumed (valid or not).", registry=r
        )
        self.joined = Counter("liverl_ingest_joined", "Generations joined with their feedback.", ["kind"], registry=r)
        self.samples = Counter("liverl_ingest_samples", "Training samples acknowledged by the broker.", registry=r)
        self.reverted = Counter(
            "liverl_ingest_reverted",
            "Accepted generations the user reverted later (follow-up "
            "feedback kind revert; counted per version in the live counters).",
            registry=r,
        )
        self.revert_samples = Counter(
            "liverl_ingest_revert_samples",
            "Corrections trained for reverted accepts (the accepted sample again with reward ingest.rewards.revert).",
            registry=r,
        )

    def _declare_pacing(self, r: CollectorRegistry) -> None:
        """Records fetched, held back or waiting, and where joined samples went."""
        self.fetched = Counter(
            "liverl_ingest_records_fetched",
            "Records the consumer returned, both inputs: each once, unless a rebalance or a restart reads it again.",
            registry=r,
        )
        self.held = Counter(
            "liverl_ingest_feedback_held_back",
            "Feedback records kept back in memory, their partition "
            "paused, until the generations they judge were read (ingest.pacing FEEDBACK_LEAD_S).",
            registry=r,
        )
        self.pended = Counter(
            "liverl_ingest_feedback_pended",
            "Feedback that arrived before its generation record and waited for it (pending).",
            registry=r,
        )
        self.mixed = Counter(
            "liverl_ingest_mixed_versions",
            "Judged generations whose tokens more than one version "
            "sampled (a hot-swap mid-generation) or whose versions are unknown: counted for no "
            "version (live counters, per-user sums), still trained.",
            registry=r,
        )
        self.heldout = Counter(
            "liverl_ingest_heldout",
            "Joined samples set aside for the gate's held-out stream (ingest.heldout_share).",
            registry=r,
        )

    def _declare_refused(self, r: CollectorRegistry) -> None:
        """Inputs dropped: redelivered, dead-lettered, expired, or making no training sample."""
        self.duplicates = Counter(
            "liverl_ingest_duplicates",
            "Redelivered inputs dropped (same feedback_id or generation_id).",
            ["source"],
            registry=r,
        )
        self.dead_letters = Counter(
            "liverl_ingest_dead_letters", "Inputs refused and sent to the dead-letter topic.", ["reason"], registry=r
        )
        self.expired = Counter(
            "liverl_ingest_generations_expired", "Generation records dropped unjudged after their TTL.", registry=r
        )
        self.dropped = Counter(
            "liverl_ingest_dropped",
            "Joined feedback that makes no training sample, by reason (e.g. not_trainable).",
            ["reason"],
            registry=r,
        )

    def _declare_progress(self, r: CollectorRegistry) -> None:
        """The worker's own health: sweep errors, settle waits, backlog gauges and the feedback-to-sample delay."""
        self.wrong_type = Counter(
            "liverl_ingest_redis_wrong_type",
            "Redis keys ingest writes as hashes (live counters, per-user sums, its counters) found holding another "
            "type: written by something else; each logged by name and replaced.",
            registry=r,
        )
        self.timer_errors = Counter(
            "liverl_ingest_timer_errors",
            "Exceptions in the periodic sweeps (logged; the sweep runs again).",
            ["timer"],
            registry=r,
        )
        self.settle_wait = Counter(
            "liverl_ingest_settle_wait_seconds",
            "Time the worker waited, with a batch in hand, for earlier batches "
            "to settle (the broker, the changelog and Redis behind the decisions: ingest.commit SETTLING_MAX).",
            registry=r,
        )
        self.pending = Gauge(
            "liverl_ingest_pending_feedback", "Feedback waiting for its generation record.", registry=r
        )
        self.paced = Gauge(
            "liverl_ingest_feedback_partitions_paused",
            "Feedback partitions paused because they ran "
            "ahead of their generations partition's backlog (ingest.pacing FEEDBACK_LEAD_S).",
            registry=r,
        )
        self.tracked = Gauge(
            "liverl_ingest_tracked_generations",
            "Keys in the join table's databases (RocksDB's estimate, index "
            "keys included; in memory: entries), set by the expiry timer.",
            registry=r,
        )
        self.feedback_delay = Histogram(
            "liverl_ingest_feedback_to_sample_seconds",
            "Wall time from the user's feedback (event ts) to the joined sample.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )

    # -- Prometheus --------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _observe(self, tally: Tally) -> None:
        c = tally.counts
        self.feedback.inc(c.get("feedback_in", 0))
        self.generations.inc(c.get("generations_in", 0))
        self.samples.inc(c.get("samples_out", 0))
        self.heldout.inc(c.get("heldout_out", 0))
        self.mixed.inc(c.get("mixed_versions", 0))
        self.pended.inc(c.get("pended", 0))
        self.fetched.inc(c.get("fetched", 0))
        self.held.inc(c.get("held", 0))
        self.reverted.inc(c.get("reverted", 0))
        self.revert_samples.inc(c.get("revert_samples_out", 0))
        self.duplicates.labels("feedback").inc(c.get("duplicates", 0))
        self.duplicates.labels("generations").inc(c.get("generation_duplicates", 0))
        self.expired.inc(c.get("generations_expired", 0))
        for name, n in c.items():
            if name.startswith("dlq:"):
                self.dead_letters.labels(name[4:]).inc(n)
            elif name.startswith("drop:"):
                self.dropped.labels(name[5:]).inc(n)
        for kind, n in tally.joined_kinds.items():
            self.joined.labels(kind).inc(n)
        observe_many(self.feedback_delay, tally.feedback_delays_s)

    # -- Redis -------------------------------------------------------------------------------------

    async def _client(self):
        if self._redis is None:
            self._redis = redis_from_url(self.redis_url, asyncio=True, socket_connect_timeout=5, socket_timeout=10)
            self._script = self._redis.register_script(_LIVE_LUA)
        return self._redis

    async def apply(self, tally: Tally, retry_s: float = 20.0, unit_ttl_s: float = UNIT_TTL_S) -> None:
        """Write one batch's increments to Redis (retrying connection errors for ``retry_s``), then to Prometheus; the
        per-user sums' keys live ``unit_ttl_s`` after their last write (``ingest.unit_ttl_s``). A key of ingest's that
        holds another Redis type (``WRONGTYPE``) is replaced (``_replace_wrong_types``) and the batch written again.

        Raises the last Redis error after that: the ingest worker then stops without committing the batch's offsets,
        and the replay is absorbed by the idempotent live counters.
        """
        if not tally:
            return

        client = await self._client()
        script = self._script
        assert script is not None  # _client registers it with the client it makes
        ckey = keys.ingest_counters(self.prefix)
        counts = {name: n for name, n in tally.counts.items() if n}
        # one script call per version: its keys share the version's hash tag (one Cluster slot)
        calls = [
            _script_call(self.prefix, version, entries, unit_ttl_s)
            for version, entries in _by_version(tally.live).items()
        ]
        delay = 0.2
        deadline = time.monotonic() + retry_s
        attempt = replaced = 0
        while True:
            attempt += 1
            pipe = client.pipeline(transaction=False)
            for name, n in counts.items():
                pipe.hincrby(ckey, name, n)
            try:
                if self._cluster:  # a cluster pipeline takes no scripts: each call goes to its slot's node
                    results = list(await pipe.execute(raise_on_error=False)) if counts else []
                    for lua_keys, args in calls:
                        try:
                            results.append(await script(keys=lua_keys, args=args))
                        except redis.ResponseError as e:
                            results.append(e)
                else:
                    for lua_keys, args in calls:
                        await script(keys=lua_keys, args=args, client=pipe)
                    results = await pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "Redis at %s failed (%s); retry %d in %.1f s", redact_url(self.redis_url), e, attempt, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 3.0)
                continue
            errors = [r for r in results if isinstance(r, Exception)]
            if not errors:
                break
            if replaced >= 3 or not all(keys.wrong_type(e) for e in errors):
                raise errors[0]
            # a key ingest owns held another Redis type: it holds nothing ingest wrote, so it is replaced, and the
            # batch is written again (the counters only where they failed; the scripts are idempotent by their guards)
            replaced += 1
            if not any(isinstance(r, Exception) for r in results[: len(counts)]):
                counts = {}
            hashes = [ckey, *(k for lua_keys, args in calls for k in lua_keys[: 1 + int(args[2])])]
            await self._replace_wrong_types(client, hashes)
        self._observe(tally)

    async def _replace_wrong_types(self, client, hashes: list[str]) -> None:
        """Delete those of ``hashes`` (keys ingest writes as hashes) that hold another Redis type, each logged by name
        and counted (``liverl_ingest_redis_wrong_type``): written by something else, they hold no count of ingest's."""
        for key in hashes:
            t = await client.type(key)
            t = t.decode() if isinstance(t, bytes) else str(t)
            if t not in ("hash", "none"):
                log.error("Redis key %s holds a %s, not ingest's hash: replacing it", key, t)
                self.wrong_type.inc()
                await client.delete(key)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
