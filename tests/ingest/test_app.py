"""The ingest worker end to end: real embedded broker, real Redis, the worker in its own process.

One worker serves the whole module; every test uses fresh generation ids (and its own policy version for
the live counters) and asserts on counter *deltas*, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from core import keys
from core.bus import feedback_client as from_config
from core.schemas import DeadLetter, FeedbackEvent, TrainingSample
from tests.ingest.conftest import make_generation, new_gid, wait_until


def _version() -> int:
    return random.randrange(1_000, 900_000)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if after.get(k, 0) != before.get(k, 0)
    }


def test_join_shapes_rewards_and_carries_behaviour_logprobs(harness):
    cfg, v = harness.cfg, _version()
    gens = {kind: make_generation(new_gid(), v, n_tokens=3 + i) for i, kind in enumerate(["accept", "reject", "edit"])}
    gens["accept"] = gens["accept"].model_copy(update={"latency_s": 0.25})  # timed by its gateway; the others not
    for rec in gens.values():
        harness.send_generation(rec, flush=False)
    harness.producer.flush()
    fids = {}
    with from_config(cfg) as sdk:
        fids["accept"] = sdk.accept(gens["accept"].generation_id, segment="pro")
        fids["reject"] = sdk.reject(gens["reject"].generation_id)
        fids["edit"] = sdk.edit(gens["edit"].generation_id, "12+30=42", segment="free")

    with harness.tail("samples") as tail:
        recs = tail.wait_for(tail.keys({g.generation_id for g in gens.values()}), n=3)
    samples = {r.key.decode(): TrainingSample.from_bytes(r.value) for r in recs}
    assert len(recs) == 3 and len(samples) == 3
    rewards = cfg.ingest.rewards
    for kind, rec in gens.items():
        s = samples[rec.generation_id]
        assert s.sample_id == s.generation_id == rec.generation_id
        assert s.feedback_id == fids[kind] and s.kind == kind
        assert s.reward == getattr(rewards, kind)
        assert s.policy_version == v
        assert s.behaviour_logprobs == rec.completion_logprobs
        assert s.completion_token_ids == rec.completion_token_ids
        assert s.prompt_token_ids == rec.prompt_token_ids
        assert s.ts_generation == rec.ts and s.ts_feedback <= time.time()
    assert (
        samples[gens["accept"].generation_id].reward,
        samples[gens["reject"].generation_id].reward,
        samples[gens["edit"].generation_id].reward,
    ) == (0.75, -0.25, 0.0)
    assert samples[gens["accept"].generation_id].segment == "pro"
    assert samples[gens["edit"].generation_id].edited_text == "12+30=42"
    assert samples[gens["reject"].generation_id].edited_text is None

    live = wait_until(lambda: harness.live(v).get("events") == 3 and harness.live(v), 10, what="live counters")
    # the canary's guardrails: response length of every judged generation (3 + 4 + 5 tokens), latency of the timed one
    assert live == {
        "accept": 1,
        "reject": 1,
        "edit": 1,
        "events": 3,
        "tokens": 12,
        "tokens_sq": 50,
        "timed": 1,
        "latency_ms": 250,
        "latency_ms_sq": 62500,
    }


def test_feedback_before_its_generation_still_joins(harness):
    v, gid = _version(), new_gid()
    with from_config(harness.cfg) as sdk:
        fid = sdk.reject(gid)
    # Wait until the worker holds the feedback as pending, so the order is really feedback-first.
    wait_until(
        lambda: (harness.worker.metric("liverl_ingest_pending_feedback ") or 0) >= 1,
        10,
        what="the feedback to be pending",
    )
    rec = make_generation(gid, v)
    harness.send_generation(rec)
    with harness.tail("samples") as tail:
        (r,) = tail.wait_for(tail.keys({gid}))
    s = TrainingSample.from_bytes(r.value)
    assert (s.feedback_id, s.kind, s.reward, s.behaviour_logprobs) == (fid, "reject", -0.25, rec.completion_logprobs)
    assert wait_until(
        lambda: harness.live(v) == {"reject": 1, "events": 1, "tokens": 4, "tokens_sq": 16}, 10, what="live counters"
    )


def test_bad_inputs_are_dead_lettered_with_reasons_and_counted(harness):
    cfg = harness.cfg
    before = harness.counters()
    unknown = new_gid()
    cases = {  # key -> (raw value, expected reason, topic)
        "bad-json": (b'{"feedback_id": "x", ', "malformed_json", cfg.topics.feedback),
        "bad-utf8": (b"\xff\xfe{}", "malformed_json", cfg.topics.feedback),
        "bad-array": (b"[1, 2]", "not_an_object", cfg.topics.feedback),
        "bad-kind": (
            json.dumps({"feedback_id": "f1", "generation_id": "g1", "kind": "maybe"}).encode(),
            "invalid_field",
            cfg.topics.feedback,
        ),
        "bad-edit": (
            json.dumps({"feedback_id": "f2", "generation_id": "g2", "kind": "edit"}).encode(),
            "invalid_field",
            cfg.topics.feedback,
        ),
        "bad-version": (
            json.dumps({"schema_version": 2, "feedback_id": "f3", "generation_id": "g3", "kind": "accept"}).encode(),
            "unsupported_schema_version",
            cfg.topics.feedback,
        ),
        "bad-gen": (b"not json at all", "malformed_json", cfg.topics.generations),
        "bad-gen-logprobs": (
            make_generation("g4", 1)
            .model_dump_json()
            .replace('"completion_logprobs":[', '"completion_logprobs":[0.0,')
            .encode(),
            "invalid_field",
            cfg.topics.generations,
        ),
    }
    with from_config(cfg) as sdk:
        for key, (value, _, topic) in cases.items():
            if topic == cfg.topics.feedback:
                sdk.send_raw(value, key=key)
            else:
                harness.send_generation_raw(value, key=key)
        unknown_fid = sdk.accept(unknown)  # valid, but its generation never comes
        with pytest.raises(TypeError):
            sdk.send_raw("not bytes")  # type: ignore[arg-type]
    t0 = time.monotonic()

    with harness.tail("dead_letters") as tail:
        recs = tail.wait_for(tail.keys(set(cases) | {unknown}), n=len(cases) + 1, timeout=cfg.ingest.pending_ttl_s + 40)
    elapsed = time.monotonic() - t0
    letters = {r.key.decode(): DeadLetter.from_bytes(r.value) for r in recs}
    assert len(recs) == len(cases) + 1, [(r.key, r.value[:80]) for r in recs]
    for key, (value, reason, topic) in cases.items():
        d = letters[key]
        assert (d.reason, d.source_topic) == (reason, topic), (key, d)
        assert d.value == value.decode("utf-8", "replace")
        assert d.partition is not None and d.offset is not None and d.detail
    d = letters[unknown]
    assert d.reason == "unknown_generation" and d.source_topic == cfg.topics.feedback
    assert FeedbackEvent.from_bytes(d.value).feedback_id == unknown_fid
    assert elapsed >= cfg.ingest.pending_ttl_s * 0.5  # it waited for the generation before giving up

    want = {
        "dlq:malformed_json": 3,
        "dlq:not_an_object": 1,
        "dlq:invalid_field": 3,
        "dlq:unsupported_schema_version": 1,
        "dlq:unknown_generation": 1,
        "feedback_in": 7,
        "generations_in": 2,
        "pended": 1,
        "fetched": 9,
    }  # (fetched: each input returned by the consumer once)
    got = wait_until(
        lambda: (d := _delta(harness.counters(), before)) == want and d,
        10,
        what=f"counters {want}, have {_delta(harness.counters(), before)}",
    )
    assert got == want
    assert harness.worker.metric('liverl_ingest_dead_letters_total{reason="unknown_generation"}') >= 1


def test_duplicates_are_dropped_and_a_second_judgement_dead_lettered(harness):
    cfg, v = harness.cfg, _version()
    before = harness.counters()
    judged, early = new_gid(), new_gid()
    harness.send_generation(make_generation(judged, v))
    with from_config(cfg) as sdk:
        fid = sdk.accept(judged)
        sdk.flush()
        for _ in range(2):  # at-least-once redelivery of the same feedback_id
            sdk.send(FeedbackEvent(feedback_id=fid, generation_id=judged, kind="accept"))
        other = sdk.reject(judged)  # a different judgement of an already-judged generation
        # feedback-first, duplicated while it waits for its generation
        early_fid = sdk.edit(early, "fixed")
        sdk.edit(early, "fixed", feedback_id=early_fid)
        sdk.flush()
    wait_until(lambda: _delta(harness.counters(), before).get("feedback_in") == 6, 15, what="6 feedback consumed")
    harness.send_generation(make_generation(early, v))

    with harness.tail("dead_letters") as tail:
        (r,) = tail.wait_for(tail.keys({judged}))
    d = DeadLetter.from_bytes(r.value)
    assert d.reason == "already_judged" and FeedbackEvent.from_bytes(d.value).feedback_id == other
    with harness.tail("samples") as tail:
        wait_until(
            lambda: (tail.poll(), len({r.key for r in tail.matching(tail.keys({judged, early}))}) == 2)[1],
            30,
            what="both samples",
        )
        time.sleep(0.5)
        tail.poll()
        recs = tail.matching(tail.keys({judged, early}))
    # A replay after a crash may send a sample again (the learner keeps one per sample_id): count ids, not records.
    by_id: dict[str, set[bytes]] = {}
    for r in recs:
        by_id.setdefault(r.key.decode(), set()).add(r.value)
    assert all(len(v) == 1 for v in by_id.values()), "re-sent samples differ"
    samples = [TrainingSample.from_bytes(next(iter(v))) for v in by_id.values()]
    assert sorted((s.generation_id, s.feedback_id) for s in samples) == sorted([(judged, fid), (early, early_fid)])

    want = {
        "feedback_in": 6,
        "generations_in": 2,
        "joined": 2,
        "samples_out": 2,
        "duplicates": 3,
        "pended": 1,
        "dlq:already_judged": 1,
        "fetched": 8,
    }

    def counted():
        return _delta(harness.counters(), before)

    assert wait_until(lambda: counted() == want, 10, what=f"counters {want}, have {counted()}")
    counts = harness.live(v)
    assert {k: counts[k] for k in ("accept", "edit", "events")} == {"accept": 1, "edit": 1, "events": 2}
    assert counts.keys() <= {"accept", "edit", "events", "tokens", "tokens_sq"}  # counted once: no reject, no revert


def test_a_revert_of_an_accepted_generation_is_counted_once_and_trains_its_correction(harness):
    """The follow-up a product sees later (the user undid an accepted answer): counted per version as ``revert``
    (the gate's kept rate), never a judged event; it trains one correction, the accepted sample again with the
    revert's reward under its own sample id; a revert of something not accepted is refused."""
    cfg, v = harness.cfg, _version()
    before = harness.counters()
    accepted, rejected, unknown = new_gid(), new_gid(), new_gid()
    for gid in (accepted, rejected):
        harness.send_generation(make_generation(gid, v), flush=False)
    harness.producer.flush()
    with from_config(cfg) as sdk:
        sdk.accept(accepted)
        sdk.reject(rejected)
        sdk.flush()
        wait_until(lambda: harness.live(v).get("events") == 2, 15, what="both judged")
        rid = sdk.revert(accepted)
        sdk.revert(accepted, feedback_id=rid)  # redelivered: counted once
        second = sdk.revert(accepted)  # a second revert of the same generation
        bad = sdk.revert(rejected)
        orphan = sdk.revert(unknown)
        sdk.flush()
    with harness.tail("dead_letters") as tail:
        recs = tail.wait_for(tail.keys({accepted, rejected, unknown}), n=3)
    reasons = {
        FeedbackEvent.from_bytes(DeadLetter.from_bytes(r.value).value).feedback_id: DeadLetter.from_bytes(
            r.value
        ).reason
        for r in recs
    }
    assert reasons == {second: "already_reverted", bad: "revert_unaccepted", orphan: "revert_unjudged"}
    assert wait_until(
        lambda: keys.live_totals(harness.live(v)) == {"accept": 1, "reject": 1, "revert": 1, "events": 2},
        10,
        what=f"live counters with one revert, have {harness.live(v)}",
    )
    assert not [k for k in harness.live(v) if "@" in k]  # a fixed set of fields: by bucket only in keys.units
    assert 0 < harness.redis.ttl(keys.live(cfg.topics.prefix, v)) <= 7 * 24 * 3600  # kept a week after the last
    delta = _delta(harness.counters(), before)
    assert delta.get("reverted") == 1 and delta.get("samples_out") == 3 and delta.get("duplicates") == 1
    assert delta.get("revert_samples_out") == 1
    assert harness.worker.metric("liverl_ingest_reverted_total ") >= 1
    with harness.tail("samples") as tail:
        recs = tail.wait_for(tail.keys({accepted}), n=2)
    by_id = {s.sample_id: s for s in (TrainingSample.from_bytes(r.value) for r in recs)}
    assert set(by_id) == {accepted, f"{accepted}:revert"}
    orig, fix = by_id[accepted], by_id[f"{accepted}:revert"]
    assert (orig.kind, orig.reward, fix.kind, fix.reward, fix.feedback_id) == (
        "accept",
        cfg.ingest.rewards.accept,
        "revert",
        cfg.ingest.rewards.revert,
        rid,
    )
    assert fix.completion_token_ids == orig.completion_token_ids and fix.behaviour_logprobs == orig.behaviour_logprobs


def test_per_user_sums_count_each_feedback_once_and_a_revert_in_its_judgements_bucket(harness):
    """The canary's per-user evidence (keys.units) through the worker and the broker: a judgement counts once for
    its generation's user however often its feedback comes, and a later revert lands in the same user and bucket."""
    v, gid, unit = _version(), new_gid(), "cafe0000000000a1"
    harness.send_generation(make_generation(gid, v).model_copy(update={"unit": unit, "latency_s": 0.2}))
    with from_config(harness.cfg) as sdk:
        fid = sdk.accept(gid)
        sdk.accept(gid, feedback_id=fid)  # redelivered
        sdk.flush()
        wait_until(lambda: harness.live(v).get("events") == 1, 15, what="the judgement")
        rid = sdk.revert(gid)
        sdk.revert(gid, feedback_id=rid)
        sdk.flush()
    wait_until(lambda: harness.live(v).get("revert") == 1, 15, what="the revert")
    now = keys.unit_bucket(time.time())
    got = keys.read_unit_buckets(harness.redis, harness.cfg.topics.prefix, v, range(now - 30, now + 2))
    [bucket] = [b for b, per in got.items() if per]  # judgement and revert: one bucket
    assert got[bucket] == {
        unit: {"e": 1, "a": 1, "r": 1, "t": 4, "m": 200, "n": 1},
        "*": {"e": 1, "a": 1, "r": 1, "t": 4, "t2": 16, "m": 200, "m2": 40000, "n": 1, "h23": 1},
    }
    assert 0 < harness.redis.ttl(keys.units(harness.cfg.topics.prefix, v, bucket)) <= harness.cfg.ingest.unit_ttl_s


def test_generations_of_mixed_versions_train_but_count_for_no_version(harness):
    """A generation whose tokens two versions sampled across a hot-swap (``version_spans``), or whose spans are unknown
    (``[]``), trains like any other (behaviour log-probs are per token) but counts for no version: not in the live
    counters, not in the per-user sums the canary reads, neither its judgement, its redelivery nor its revert. Counted
    in ``mixed_versions`` instead. One version's spans, or none, count as before."""
    v, unit = _version(), "cafe0000000000b2"
    gids = {name: new_gid() for name in ("mixed", "unknown", "one_span", "plain")}
    spans = {"mixed": [(v, 0, 2), (v + 1, 2, 4)], "unknown": [], "one_span": [(v, 0, 4)], "plain": None}
    before = harness.counters()
    for name, gid in gids.items():
        rec = make_generation(gid, v).model_copy(update={"unit": unit, "version_spans": spans[name]})
        harness.send_generation(rec, flush=False)
    harness.producer.flush()
    with from_config(harness.cfg) as sdk:
        fids = {name: sdk.accept(gid) for name, gid in gids.items()}
        sdk.accept(gids["mixed"], feedback_id=fids["mixed"])  # redelivered: still counted for no version
        sdk.flush()
        with harness.tail("samples") as tail:
            tail.wait_for(tail.keys(set(gids.values())), n=4, timeout=30)
        sdk.revert(gids["mixed"])  # the correction trains; the revert counts for no version either
        sdk.revert(gids["plain"])
    with harness.tail("samples") as tail:
        got = tail.wait_for(lambda r: r.key is not None and r.key.decode() in set(gids.values()), n=6, timeout=30)
    samples = [TrainingSample.from_bytes(r.value) for r in got]
    assert {s.sample_id for s in samples} == set(gids.values()) | {gids["mixed"] + ":revert", gids["plain"] + ":revert"}
    mixed_sample = next(s for s in samples if s.sample_id == gids["mixed"])
    assert mixed_sample.policy_version == v and len(mixed_sample.behaviour_logprobs) == 4
    want = {"mixed_versions": 2, "mixed_versions_reverted": 1}
    delta = wait_until(
        lambda: (d := _delta(harness.counters(), before)).get("reverted") == 2 and d, 15, what="both reverts counted"
    )
    assert {k: delta.get(k, 0) for k in want} == want, delta
    live = harness.live(v)
    assert keys.live_totals(live) == {"accept": 2, "revert": 1, "events": 2}, live  # one_span and plain only
    assert harness.live(v + 1) == {}
    now = keys.unit_bucket(time.time())
    buckets = keys.read_unit_buckets(harness.redis, harness.cfg.topics.prefix, v, range(now - 60, now + 2))
    per_user = [per[unit] for per in buckets.values() if unit in per]
    assert sum(p.get("e", 0) for p in per_user) == 2 and sum(p.get("r", 0) for p in per_user) == 1, buckets
    assert not any(
        keys.read_unit_buckets(harness.redis, harness.cfg.topics.prefix, v + 1, range(now - 60, now + 2)).values()
    )
    assert harness.worker.metric("liverl_ingest_mixed_versions_total ") >= 2


def test_live_counters_count_each_feedback_id_once(harness):
    """The Lua guard: replaying a batch's increments (a crash before the offset commit) changes nothing."""
    import asyncio

    from ingest.metrics import IngestMetrics, Tally

    v = _version()

    async def apply_twice():
        m = IngestMetrics(harness.cfg.topics.prefix, harness.cfg.redis.url)
        try:
            for _ in range(2):
                t = Tally()
                t.live += [("fid-a", v, "accept"), ("fid-b", v, "reject"), ("fid-a", v, "accept")]
                t.inc("joined", 2)
                await m.apply(t)
        finally:
            await m.close()

    before = harness.counters()
    asyncio.run(apply_twice())
    assert harness.live(v) == {"accept": 1, "reject": 1, "events": 2}
    assert _delta(harness.counters(), before) == {"joined": 4}  # operational counters are at-least-once


def test_metrics_endpoint_speaks_prometheus(harness):
    status, ctype, body = harness.worker.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    for name in (
        "liverl_ingest_feedback_total",
        "liverl_ingest_generations_total",
        "liverl_ingest_samples_total",
        'liverl_ingest_joined_total{kind="accept"}',
        "liverl_ingest_pending_feedback",
        "liverl_ingest_feedback_to_sample_seconds_bucket",
    ):
        assert name in body, name
    status, _, health = harness.worker.get("/healthz")
    assert status == 200 and json.loads(health)["ok"] is True
    # faust's table and router views would show prompts and feedback to anyone who reaches the port: off.
    import urllib.error

    for path in ("/table/join/", "/router/"):
        with pytest.raises(urllib.error.HTTPError) as e:
            harness.worker.get(path)
        assert e.value.code == 404, path


def test_throughput(harness, record_property):
    """Publish N generations + N feedback as fast as the clients can and time until every sample is out."""
    n, v = 2000, _version()
    gids = [new_gid() for _ in range(n)]
    recs = [make_generation(g, v, n_tokens=16) for g in gids]
    t0 = time.monotonic()
    with from_config(harness.cfg) as sdk:
        for i, rec in enumerate(recs):
            harness.send_generation(rec, flush=False)
            (sdk.accept if i % 3 else sdk.reject)(rec.generation_id)
        harness.producer.flush()
        sdk.flush()
    t_pub = time.monotonic() - t0
    with harness.tail("samples") as tail:
        recs_out = tail.wait_for(tail.keys(set(gids)), n=n, timeout=120)
    elapsed = time.monotonic() - t0
    assert len({r.key for r in recs_out}) == n
    rate = n / elapsed
    record_property("joined_per_s", round(rate, 1))
    print(
        f"\ningest throughput: {n} generations + {n} feedback -> {n} samples in {elapsed:.2f} s "
        f"(publishing took {t_pub:.2f} s): {rate:.0f} joins/s, {2 * rate:.0f} input events/s"
    )
    assert wait_until(lambda: harness.live(v).get("events") == n, 10, what="live counters")


def test_hostile_inputs_through_the_worker(harness):
    """The review's crash triggers, sent to the real worker: each is dead-lettered with its reason (value cut, with
    size and sha256), the worker stays up, and feedback in the same batches still joins."""
    import hashlib

    cfg, v = harness.cfg, _version()
    gid = new_gid()
    good = FeedbackEvent(feedback_id=f"f-{gid}", generation_id=gid, kind="accept").model_dump()
    cases = {  # key -> (raw value, expected reason)
        "h-deep": (b"[" * 200_000 + b"]" * 200_000, "malformed_json"),
        "h-deep-small": (b'{"feedback_id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "malformed_json"),
        "h-bigint": (
            b'{"feedback_id": "f", "generation_id": "g", "kind": "accept", "ts": ' + b"9" * 5000 + b"}",
            "malformed_json",
        ),
        "h-bom": (b"\xef\xbb\xbf" + json.dumps(good).encode(), "malformed_json"),
        "h-utf16": (json.dumps(good).encode("utf-16"), "malformed_json"),
        "h-nan": (json.dumps(dict(good, ts=float("nan"))).encode(), "invalid_field"),
        "h-inf": (json.dumps(dict(good, ts=float("inf"))).encode(), "invalid_field"),
        "h-version-true": (json.dumps(dict(good, schema_version=True)).encode(), "unsupported_schema_version"),
        "h-padded": (
            json.dumps(dict(good, generation_id=new_gid())).encode()[:-1] + b"\n" * 600_000 + b"}",
            "too_large",
        ),
        "h-broker-limit": (b"\x01" * 1_000_000, "too_large"),
    }
    before = harness.counters()
    harness.send_generation(make_generation(gid, v))
    with from_config(cfg) as sdk:
        for key, (value, _) in cases.items():
            sdk.send_raw(value, key=key)
        sdk.send(FeedbackEvent(**good))
    with harness.tail("dead_letters") as tail:
        recs = tail.wait_for(tail.keys(set(cases)), n=len(cases), timeout=60)
    assert all(len(r.value) < 120_000 for r in recs)
    letters = {r.key.decode(): DeadLetter.from_bytes(r.value) for r in recs}
    for key, (value, reason) in cases.items():
        d = letters[key]
        assert d.reason == reason, (key, d.reason, d.detail)
        assert d.value_size == len(value) and d.value_sha256 == hashlib.sha256(value).hexdigest()
        assert d.value_truncated == (len(value) > 16 * 1024)
    with harness.tail("samples") as tail:
        tail.wait_for(tail.keys({gid}))
    harness.worker.assert_alive()
    got = _delta(harness.counters(), before)
    assert got.get("dlq:internal_error", 0) == 0 and got["feedback_in"] == len(cases) + 1


def test_rewards_come_from_the_product(cfg):
    """The product names the reward of each kind, per segment if it wishes; ingest asks it, not a constant."""
    from core.product import Product, load_product

    class Strict(Product):
        def reward(self, kind, segment):
            return {"accept": 1.0, "reject": -1.0, "edit": -0.5}[kind] * (2.0 if segment == "vip" else 1.0)

    import sys
    import types

    mod = types.ModuleType("liverl_test_product")
    mod.PRODUCT = Strict
    sys.modules["liverl_test_product"] = mod
    cfg.product = "liverl_test_product:PRODUCT"
    p = load_product(cfg)
    assert p.reward("reject", "vip") == -2.0 and p.reward("accept", None) == 1.0
    from ingest.join import Ingest

    ing = Ingest(cfg, metrics=None, table={}, output=None)
    assert ing.product.reward("edit", "vip") == -1.0
    cfg.product = "liverl_test_product:NOPE"
    import pytest

    with pytest.raises(ValueError, match="has no attribute 'NOPE'"):
        load_product(cfg)


def test_waiting_for_settled_batches_yields_and_ends(cfg):
    """The worker waits for settling batches before deciding a third, and for all of them before a timer, a
    rebalance or a stop. A batch that has just settled must count as settled at once: awaiting a finished task does
    not yield to the event loop, so a wait that relied on the task's done callback to drop it would spin forever (the
    worker would hang, SIGTERM included). Run in a thread so a regression fails here instead of hanging."""
    import asyncio
    import threading

    from ingest.app import IngestWorker
    from ingest.commit import Committer

    finished: list[bool] = []

    def run():
        async def main():
            w = IngestWorker(cfg, cfg.broker.bootstrap, cfg.redis.url, web_port=0)
            committer = Committer(w.ingest, w.table, w.table_outbox, consumer=None)  # (the worker's, less its consumer)
            loop = asyncio.get_running_loop()
            settled = [loop.create_future(), loop.create_future()]
            for f in settled:
                f.set_result(None)  # finished; their done callbacks (none here) would run only at the next yield
            committer._settling = list(settled)
            await committer.drain()
            finished.append(committer.unsettled() == [])

        asyncio.run(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert finished == [True], "waiting for settled batches did not end"
