"""Per-user sums (``keys.units``): what ingest keeps for the canary's per-user test.

Ingest's join with the real Redis (the broker's part is a recorder, as in test_fuzz.py; test_app.py runs the worker on
the real broker): counted exactly once per feedback id, a revert in the bucket and unit of the judgement it undoes,
events without a user in the aggregate only, a TTL on every key, and hostile unit values refused. The script itself is
checked against a plain Python model of the sums.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from core import keys
from core.config import load_config
from core.schemas import DeadLetter, GenerationRecord, WireError, json_schemas
from ingest.join import JUDGED, Ingest, Source, pack
from ingest.metrics import _LIVE_LUA, _script_call
from tests.ingest.conftest import make_generation
from tests.ingest.test_fuzz import Broker

T0 = 1_750_000_003.0  # a judgement time inside a bucket (bucket 175_000_000 runs from ...000.0 to ...010.0)
UNIT_TTL_S = 3600.0


@pytest.fixture
def world(stack, tmp_path):
    from ingest.metrics import IngestMetrics

    cfg = load_config(
        env={},
        state_dir=str(tmp_path),
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
        ingest__heldout_share=0.0,
        ingest__unit_ttl_s=UNIT_TTL_S,
    )
    metrics = IngestMetrics(cfg.topics.prefix, stack.redis_url)
    loop = asyncio.new_event_loop()
    broker = Broker()
    ing = Ingest(cfg, metrics, {}, broker)
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    yield cfg, ing, broker, loop, r
    loop.run_until_complete(metrics.close())
    loop.close()
    for key in list(r.scan_iter(f"{cfg.topics.prefix}:*", count=1000)):
        r.delete(key)
    r.close()


def _gen(gid: str, version: int, unit: str | None, latency_s: float | None = None) -> bytes:
    return make_generation(gid, version).model_copy(update={"unit": unit, "latency_s": latency_s}).to_bytes()


def _fb(fid: str, gid: str, kind: str) -> bytes:
    doc = {"feedback_id": fid, "generation_id": gid, "kind": kind, "ts": T0}
    if kind == "edit":
        doc["edited_text"] = "43"
    return json.dumps(doc).encode()


def _run(world, now: float, *events: tuple[str, bytes]) -> None:
    """One batch at ``now``: ``events`` are (``"g"`` or ``"f"``, value)."""
    cfg, ing, _, loop, _ = world
    topic = {"g": cfg.topics.generations, "f": cfg.topics.feedback}
    batch = [(Source(topic[which], 0, i, None, now), value) for i, (which, value) in enumerate(events)]
    loop.run_until_complete(ing.process(batch, now=now))


def _units(world, version: int, *at: float) -> dict[int, dict[str, dict[str, int]]]:
    cfg, _, _, _, r = world
    return keys.read_unit_buckets(r, cfg.topics.prefix, version, [keys.unit_bucket(t) for t in at])


def _dead(world) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(v) for _, v in world[2].of(world[0].topics.dead_letters)]


def test_each_judgement_counts_once_per_user_and_in_the_aggregate_whatever_is_redelivered(world):
    v = 41
    _run(
        world,
        T0,
        ("g", _gen("ga", v, "aaaa000000000001", 0.25)),
        ("g", _gen("gb", v, "bbbb000000000002")),
        ("g", _gen("gc", v, None, 0.5)),
    )
    _run(
        world,
        T0,
        ("f", _fb("fa", "ga", "accept")),
        ("f", _fb("fb", "gb", "reject")),
        ("f", _fb("fc", "gc", "edit")),
        ("f", _fb("fa", "ga", "accept")),
    )  # a duplicate in the same batch
    # later: the same feedback again, the generations again (a judged one's counters are re-sent: idempotent)
    _run(
        world,
        T0 + 30,
        ("f", _fb("fa", "ga", "accept")),
        ("f", _fb("fb", "gb", "reject")),
        ("g", _gen("ga", v, "aaaa000000000001", 0.25)),
        ("g", _gen("gc", v, None, 0.5)),
    )
    got = _units(world, v, T0, T0 + 30)
    assert got == {
        keys.unit_bucket(T0): {
            "aaaa000000000001": {"e": 1, "a": 1, "t": 4, "m": 250, "n": 1},
            "bbbb000000000002": {"e": 1, "t": 4},
            "*": {
                "e": 3,
                "a": 1,
                "d": 1,
                "t": 12,
                "t2": 48,
                "m": 750,
                "m2": 250**2 + 500**2,
                "n": 2,
                "h24": 1,
                "h28": 1,
            },
        },
        keys.unit_bucket(T0 + 30): {},  # the re-sent counts went to the judgement's bucket, and were no-ops
    }
    assert keys.live_totals(world[4].hgetall(keys.live(world[0].topics.prefix, v))) == {
        "accept": "1",
        "reject": "1",
        "edit": "1",
        "events": "3",
    }


def test_a_revert_counts_in_the_bucket_and_unit_of_the_judgement_it_undoes(world):
    """Censoring: a revert that comes an hour later adds to the judgement's bucket (the canary counts a bucket once its
    revert horizon has closed), never to the bucket it arrived in."""
    v, later = 42, T0 + 3600
    _run(world, T0, ("g", _gen("ga", v, "aaaa000000000001")), ("g", _gen("gb", v, None)))
    _run(world, T0, ("f", _fb("fa", "ga", "accept")), ("f", _fb("fb", "gb", "accept")))
    _run(world, later, ("f", _fb("ra", "ga", "revert")), ("f", _fb("rb", "gb", "revert")))
    _run(world, later + 5, ("f", _fb("ra", "ga", "revert")))  # redelivered: counted once
    got = _units(world, v, T0, later)
    assert got[keys.unit_bucket(later)] == {}
    assert got[keys.unit_bucket(T0)] == {
        "aaaa000000000001": {"e": 1, "a": 1, "r": 1, "t": 4},
        "*": {"e": 2, "a": 2, "r": 2, "t": 8, "t2": 32},
    }
    live = world[4].hgetall(keys.live(world[0].topics.prefix, v))
    assert live["revert"] == "2" and keys.revert_field(T0) not in live  # by bucket in the per-user sums only


def test_a_judgement_from_before_units_is_reverted_in_the_aggregate_only(world):
    """A judged entry written before entries kept the unit (no ``u``): its revert still counts, in ``*``."""
    cfg, ing, _, _, _ = world
    v = 43
    ing.table["gold"] = pack(JUDGED, T0, {"f": "fold", "v": v, "k": "accept", "n": 3})
    _run(world, T0 + 600, ("f", _fb("rold", "gold", "revert")))
    assert _units(world, v, T0) == {keys.unit_bucket(T0): {"*": {"r": 1}}}


def test_feedback_that_came_before_its_generation_is_counted_for_the_generations_user(world):
    v = 44
    _run(world, T0, ("f", _fb("fa", "ga", "accept")))  # pending: no record yet
    _run(world, T0 + 20, ("g", _gen("ga", v, "aaaa000000000001")))  # joined now, in the bucket of its judgement (T0)
    assert _units(world, v, T0, T0 + 20) == {
        keys.unit_bucket(T0): {
            "aaaa000000000001": {"e": 1, "a": 1, "t": 4},
            "*": {"e": 1, "a": 1, "t": 4, "t2": 16},
        },
        keys.unit_bucket(T0 + 20): {},
    }


def test_a_judgement_ingest_joins_late_counts_in_the_bucket_of_its_own_time_and_so_does_its_revert(world):
    """The canary's buckets are of the users' judgement time, not of ingest's clock: a worker 25 s behind (load,
    pacing) must not move a judgement of an answer served before a canary swap into the canary's first bucket of
    evidence, counted for stable's version (a 60-minute demo under load aborted three good canaries on the sample-ratio
    mismatch that made: 26-34% canary events in their first bucket against a 50% share). A timestamp from the future
    counts no later than ingest's clock."""
    v = 47
    _run(world, T0, ("g", _gen("ga", v, "aaaa000000000001")), ("g", _gen("gf", v, "ffff000000000001")))
    _run(world, T0 + 25, ("f", _fb("fa", "ga", "accept")))  # judged at T0 (its ts), joined 25 s later
    future = json.loads(_fb("ff", "gf", "accept"))
    future["ts"] = T0 + 3600  # a product clock an hour ahead
    _run(world, T0 + 25, ("f", json.dumps(future).encode()))
    _run(world, T0 + 90, ("f", _fb("ra", "ga", "revert")))  # the revert follows its judgement's bucket
    got = _units(world, v, T0, T0 + 25, T0 + 90)
    assert got[keys.unit_bucket(T0)] == {
        "aaaa000000000001": {"e": 1, "a": 1, "r": 1, "t": 4},
        "*": {"e": 1, "a": 1, "r": 1, "t": 4, "t2": 16},
    }
    assert got[keys.unit_bucket(T0 + 25)] == {
        "ffff000000000001": {"e": 1, "a": 1, "t": 4},
        "*": {"e": 1, "a": 1, "t": 4, "t2": 16},
    }
    assert got[keys.unit_bucket(T0 + 90)] == {}


def test_every_bucket_key_expires_and_shares_the_versions_cluster_slot(world):
    cfg, _, _, _, r = world
    v = 45
    _run(world, T0, ("g", _gen("ga", v, "aaaa000000000001")))
    _run(world, T0, ("f", _fb("fa", "ga", "accept")))
    key = keys.units(cfg.topics.prefix, v, keys.unit_bucket(T0))
    assert key == f"{cfg.topics.prefix}:units:{{{v}}}:{keys.unit_bucket(T0)}"
    assert 0 < r.ttl(key) <= UNIT_TTL_S
    assert (
        key_slot(key.encode())
        == key_slot(keys.live(cfg.topics.prefix, v).encode())
        == key_slot(keys.counted(cfg.topics.prefix, v, "fa").encode())
    )
    assert load_config(env={}).ingest.unit_ttl_s == 2 * 24 * 3600


@pytest.mark.parametrize("unit", ["x" * 65, "", "a|b", "*", "a b", "ü", "a\nb", 7, ["a"]])
def test_a_hostile_unit_is_refused_with_its_reason(world, unit):
    doc = json.loads(_gen("gh", 46, None))
    doc["unit"] = unit
    raw = json.dumps(doc).encode()
    with pytest.raises(WireError) as e:
        GenerationRecord.from_bytes(raw)
    assert e.value.reason == "invalid_field" and e.value.detail.startswith("unit:")
    _run(world, T0, ("g", raw))
    [letter] = _dead(world)
    assert (letter.reason, letter.detail.split(":")[0]) == ("invalid_field", "unit")
    assert "gh" not in world[1].table


def test_a_unit_of_64_id_characters_is_taken_and_the_exported_schema_says_so():
    assert GenerationRecord.model_validate_json(_gen("g", 1, "A-z_0.9:" * 8)).unit == "A-z_0.9:" * 8
    assert GenerationRecord.model_validate_json(_gen("g", 1, None)).unit is None  # old producers send none
    schema = json_schemas()["generation"]  # what `liverl schema generation` prints for other producers
    [text, _] = schema["properties"]["unit"]["anyOf"]
    assert (text["maxLength"], text["pattern"]) == (64, r"^[A-Za-z0-9_.:\-]+$") and "unit" not in schema["required"]


def test_reading_buckets_tolerates_absent_keys_and_either_client(stack):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    for decode in (True, False):
        r = redis.Redis.from_url(stack.redis_url, decode_responses=decode)
        try:
            r.hset(keys.units(prefix, 3, 7), mapping={"u1|e": 2, "u1|a": 1, "*|e": 3, "*|t2": 9})
            r.hset(keys.units(prefix, 3, 9), mapping={"u1|e": 1, "*|e": 1})
            got = keys.read_unit_buckets(r, prefix, 3, [7, 8, 9])
            assert got == {
                7: {"u1": {"e": 2, "a": 1}, "*": {"e": 3, "t2": 9}},
                8: {},
                9: {"u1": {"e": 1}, "*": {"e": 1}},
            }
            assert keys.unit_totals(got) == {"u1": {"e": 3, "a": 1}, "*": {"e": 4, "t2": 9}}
            assert keys.read_unit_buckets(r, prefix, 3, []) == {}
        finally:
            r.delete(keys.units(prefix, 3, 7), keys.units(prefix, 3, 9))
            r.close()


def test_closed_buckets_are_those_judged_since_the_start_whose_revert_horizon_has_passed():
    # bucket b holds judgements of [10 b, 10 b + 10): closed once 10 b + 10 + horizon <= now
    assert keys.closed_unit_buckets(1000.0, 1100.0, 30.0) == range(100, 107)
    assert keys.closed_unit_buckets(1005.0, 1100.0, 30.0) == range(101, 107)  # bucket 100 began before the start
    assert keys.closed_unit_buckets(1000.0, 1100.0, 29.0) == range(100, 107)
    assert keys.closed_unit_buckets(1000.0, 1101.0, 30.0) == range(100, 107)
    assert keys.closed_unit_buckets(1000.0, 1110.0, 30.0) == range(100, 108)
    assert list(keys.closed_unit_buckets(1000.0, 1020.0, 30.0)) == []  # nothing closed yet


# -- the script against a model ---------------------------------------------------------------------------------------

_GUARDRAILS = ("tokens", "tokens_sq", "timed", "latency_ms", "latency_ms_sq")
_PER_UNIT = {"tokens": "t", "latency_ms": "m", "timed": "n"}
_ALL = {"tokens": "t", "tokens_sq": "t2", "latency_ms": "m", "latency_ms_sq": "m2", "timed": "n"}
_KIND = {"accept": "a", "edit": "d", "revert": "r"}

_EVENT = st.tuples(
    st.integers(0, 15),  # feedback id: repeats are redeliveries
    st.sampled_from(["accept", "reject", "edit", "revert"]),
    st.lists(
        st.tuples(st.sampled_from(_GUARDRAILS), st.one_of(st.integers(0, 1000), st.integers(0, 10**17))), max_size=4
    ),
    st.one_of(st.none(), st.integers(0, 2)),  # bucket (None: the live hash only, as a 3-tuple)
    st.sampled_from([None, "u0", "u1", "aaaa000000000001"]),
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batches=st.lists(st.lists(_EVENT, min_size=1, max_size=12), min_size=1, max_size=4))
def test_the_script_keeps_the_sums_a_plain_model_gives(stack, batches):
    """Whatever the batches, redeliveries, buckets, units and values (up to 18 digits, sums past 2^53): each bucket's
    hash holds, per unit and for ``*``, the sums of the events counted for the first time, and the live hash what it
    always held."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    live: dict[str, int] = {}
    units: dict[int, dict[str, int]] = {}
    seen: set[int] = set()
    touched: set[str] = set()

    def add(d: dict, k: str, n: int) -> None:
        d[k] = d.get(k, 0) + n

    try:
        for batch in batches:
            entries = []
            for fid, base, fields, bucket, unit in batch:
                kind = (f"revert@{bucket or 0}" if base == "revert" else base) + "".join(f";{f}={n}" for f, n in fields)
                entries.append((f"f{fid}", 5, kind) if bucket is None else (f"f{fid}", 5, kind, bucket, unit))
                if fid in seen:
                    continue
                seen.add(fid)
                for f, n in fields:
                    add(live, f, n)
                add(live, base, 1)
                if base != "revert":
                    add(live, "events", 1)
                if bucket is None:
                    continue
                u = units.setdefault(bucket, {})
                for f, n in fields:
                    add(u, f"*|{_ALL[f]}", n)
                    if unit and f in _PER_UNIT:
                        add(u, f"{unit}|{_PER_UNIT[f]}", n)
                    if f == "latency_ms":  # the bucket's latency histogram: one count in the value's bin
                        add(u, f"*|h{keys.latency_bin(n)}", 1)
                for who in ("*", unit) if unit else ("*",):
                    if base in _KIND:
                        add(u, f"{who}|{_KIND[base]}", 1)
                    if base != "revert":
                        add(u, f"{who}|e", 1)
            ks, args = _script_call(prefix, 5, entries, UNIT_TTL_S)
            touched.update(ks)
            r.eval(_LIVE_LUA, len(ks), *ks, *args)
        assert {f: int(n) for f, n in r.hgetall(keys.live(prefix, 5)).items()} == live
        for b in range(3):
            got = {f: int(n) for f, n in r.hgetall(keys.units(prefix, 5, b)).items() if int(n)}
            assert got == {f: n for f, n in units.get(b, {}).items() if n}, b
            assert (r.ttl(keys.units(prefix, 5, b)) > 0) == (b in units)
    finally:
        if touched:  # the keys the script wrote (a SCAN of a shared Redis's whole keyspace costs minutes in CI)
            r.delete(*touched)
        r.close()


def test_the_latency_histogram_has_a_fixed_number_of_log_spaced_bins():
    """What a bucket's hash may hold for latency is bounded (58 fields, whatever the traffic), and each bin is a fixed
    share of its latency wide: a quantile read from it is within a bin of the bucket's own."""
    e = keys.LATENCY_HIST_EDGES_MS
    assert keys.LATENCY_HIST_BINS == len(e) + 1 == 58 and list(e) == sorted(set(e))
    assert (e[0], e[-1]) == (4, 65536)
    ratios = [b / a for a, b in zip(e, e[1:], strict=False) if a >= 32]
    assert all(1.15 < r < 1.23 for r in ratios), ratios  # four bins an octave
    assert [keys.latency_bin(ms) for ms in (0, 3, 4, 5, 250, 500, 65535, 65536, 10**17)] == [
        0,
        0,
        1,
        2,
        24,
        28,
        56,
        57,
        57,
    ]
    for i in range(1, len(e)):  # each bin holds [edge i-1, edge i)
        assert keys.latency_bin(e[i - 1]) == i and keys.latency_bin(e[i] - 1) == i


def test_a_judgements_time_decides_its_bucket():
    assert keys.unit_bucket(T0) == keys.unit_bucket(T0 + 6.9) != keys.unit_bucket(T0 + 7.0)
    assert keys.UNIT_BUCKET_S == 10 and keys.unit_bucket(T0) * 10 == T0 - 3
