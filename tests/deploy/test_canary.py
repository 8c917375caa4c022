"""The canary, driven by the real gate on the real registry and Redis: a candidate that passed the offline checks
goes to the canary nodes, the per-user sums ingest keeps (``keys.units``) decide it with the always-valid test, with the
user as the unit, and a promotion or an abort leaves the registry and the announcements consistent. (The serving side
of a rollout, the canary node swapping and the router's split, is in tests/serving; the statistics' calibration in
tests/deploy/test_sequential.py.)

Time: a rollout reads a 10 s bucket of judgements only once its revert horizon has closed. The tests write buckets
of the rollout's first minutes, then move the controller's clock (``gate.canary.clock``) past them."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from core import fleet, keys
from core.config import GateConfig
from core.schemas import VersionAnnouncement
from deploy.gate.canary import SETTLE_S, evidence_start, first_bucket
from deploy.gate.gate import Gate
from deploy.registry.registry import open_registry
from learner.candidates import evidence_against
from tests.deploy.test_gate import ProbeEval, desired, weights

NODES = ("node-a", "node-b")


def beat(rds, cfg, node: str, healthy: bool = True) -> None:
    rds.set(
        keys.served(cfg.topics.prefix, node),
        keys.ServedHeartbeat(version=0, checksum="x", healthy=healthy, url=f"http://127.0.0.1/{node}").to_json(),
        ex=3600,
    )  # long: the first delta encoding in a process may compile kernels for a minute


@pytest.fixture
def fleet2(cfg, rds):
    """Two configured serving nodes in rotation; stable v0."""
    cfg.serving.fleet = {n: f"http://127.0.0.1/{n}" for n in NODES}
    cfg.gate.canary_min_events = 50
    cfg.gate.canary_share = 0.5
    cfg.gate.revert_horizon_s = 30.0
    # the sequential tests at the whole alpha: these canaries are sized for it (the deadline's readout, which takes a
    # share of it by default, has its own tests in test_canary_stats.py)
    cfg.gate.canary_readout_share = 0.0
    for n in NODES:
        beat(rds, cfg, n)
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    gate = Gate(cfg, registry, rds, ProbeEval())
    gate.step()
    yield gate, registry
    registry.close()


def feed(
    rds,
    cfg,
    version: int,
    bucket: int,
    users: dict[str, tuple[int, ...]],
    tokens: int = 4,
    latency_ms: float | None = None,
) -> None:
    """What ingest's script adds for judged events in one bucket: per user (events, accepts, edits, reverts), and the
    bucket's totals under ``*`` (with ``tokens`` per event, and ``latency_ms`` when timed)."""
    key = keys.units(cfg.topics.prefix, version, bucket)
    pipe = rds.pipeline()
    tot = dict.fromkeys(("e", "a", "d", "r"), 0)
    for u, row in users.items():
        for f, n in zip("eadr", row, strict=True):
            if n:
                pipe.hincrby(key, f"{u}|{f}", int(n))
                tot[f] += int(n)
        pipe.hincrby(key, f"{u}|t", tokens * int(row[0]))
    for f, n in tot.items():
        pipe.hincrby(key, f"*|{f}", n)
    pipe.hincrby(key, "*|t", tokens * tot["e"])
    pipe.hincrby(key, "*|t2", tokens * tokens * tot["e"])
    if latency_ms is not None:
        pipe.hincrby(key, "*|m", round(latency_ms * tot["e"]))
        pipe.hincrby(key, "*|m2", round(latency_ms**2 * tot["e"]))
        pipe.hincrby(key, "*|n", tot["e"])
    pipe.execute()


def population(n: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """``n`` users with heterogeneous acceptance (two segments, as in the demo)."""
    rng = np.random.default_rng(seed)
    return [fleet.unit_id(f"user-{seed}-{i}") for i in range(n)], np.where(rng.random(n) < 0.5, 0.7, 0.25)


def traffic(
    rds,
    cfg,
    rollout,
    buckets: range,
    lift: float,
    n_users: int = 400,
    per_bucket: int = 300,
    seed: int = 0,
    revert_share: float = 0.0,
    latency_ms: tuple[float, float] | None = None,
) -> None:
    """``per_bucket`` events a bucket from a population split by the real assignment (``fleet.bucket``): each user's
    acceptance on the canary is theirs plus ``lift``; ``revert_share`` of the canary's accepts are reverted (written in
    the judgement's bucket, as ingest does)."""
    ids, p = population(n_users, seed)
    secret = b"test-assignment-secret-0123456789"
    on_canary = np.array([fleet.bucket(secret, rollout.id, u) < rollout.share for u in ids])
    rng = np.random.default_rng(seed + 1)
    for b in buckets:
        arms: dict[int, dict[str, list[int]]] = {rollout.version: {}, rollout.stable_version: {}}
        for i in rng.integers(0, n_users, per_bucket):
            canary = bool(on_canary[i])
            acc = rng.random() < min(1.0, max(0.0, p[i] + (lift if canary else 0.0)))
            rev = canary and acc and rng.random() < revert_share
            row = arms[rollout.version if canary else rollout.stable_version].setdefault(ids[i], [0, 0, 0, 0])
            row[0] += 1
            row[1] += acc
            row[3] += rev
        for v, users in arms.items():
            lat = None if latency_ms is None else latency_ms[0 if v == rollout.version else 1]
            feed(rds, cfg, v, b, {u: tuple(r) for u, r in users.items()}, latency_ms=lat)


def start(gate, registry, rds, cfg, seed: int = 1):
    row = registry.add_candidate(weights(0.9, 1.0, seed=seed), parent=registry.stable().version)
    [v] = gate.step()
    assert v.verdict == "canary" and "canary on node-" in v.reason, v.reason
    rollout = registry.active_rollout()
    assert rollout.version == row.version and registry.get(row.version).status == "canary"
    assert registry.stable().version == rollout.stable_version
    ann = VersionAnnouncement.from_bytes(rds.get(keys.canary(cfg.topics.prefix)))
    assert (ann.version, ann.channel, ann.rollout.rollout_id, ann.rollout.nodes) == (
        row.version,
        "canary",
        rollout.id,
        rollout.nodes,
    )
    for n in rollout.nodes:  # what each canary node's agent writes on its verified swap to the candidate
        registry.update_fleet(n, rollout.version, rollout.checksum, at=rollout.started_at)
    return rollout


def after(rollout, cfg, buckets: int) -> float:
    """The time at which the rollout's first ``buckets`` buckets are all final (their revert horizon closed)."""
    b0 = evidence_start(rollout.started_at, cfg.gate.canary_warmup_s)
    return (b0 + buckets) * keys.UNIT_BUCKET_S + cfg.gate.revert_horizon_s + SETTLE_S + 1


def first(rollout, n: int) -> range:
    b0 = evidence_start(rollout.started_at, GateConfig().canary_warmup_s)  # the tests keep the default warm-up
    return range(b0, b0 + n)


def test_a_better_canary_is_promoted_on_per_user_evidence(cfg, rds, fleet2):
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    [v] = gate.step()  # the clock has not passed the horizon: nothing read yet
    assert v.verdict == "canary" and "on 0 events" in v.reason, v.reason
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
    assert registry.stable().version == r.version and desired(rds, cfg).version == r.version
    assert rds.get(keys.canary(cfg.topics.prefix)) is None and registry.active_rollout() is None
    [g] = [g for g in registry.gate_results(r.version) if g.check == "canary"]
    assert g.passed and "acceptance better than stable" in g.detail and "unit user" in g.detail
    assert registry.rollout(r.id).state == "promoted"
    text = gate.metrics_text().decode()
    assert 'liverl_gate_rollouts_total{outcome="promoted"} 1.0' in text and "liverl_gate_canary_share 0.0" in text


def test_a_worse_canary_is_aborted_and_its_nodes_return_to_stable(cfg, rds, fleet2):
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=-0.2)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "acceptance is worse than stable" in v.reason, v.reason
    assert registry.get(r.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0 and rds.get(keys.canary(cfg.topics.prefix)) is None


def test_a_better_canary_whose_served_log_probs_the_learner_does_not_reproduce_is_aborted(cfg, rds, fleet2):
    """Acceptance alone would promote it; the learner's measurement of its served generations
    (``Registry.add_mismatch``) past ``gate.max_logprob_mismatch`` aborts it, with that reason."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    n = cfg.gate.mismatch_min_tokens
    registry.add_mismatch({r.version: {"own_tokens": n, "own_abs": n * 2 * cfg.gate.max_logprob_mismatch}})
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "gate.max_logprob_mismatch" in v.reason, v.reason
    assert registry.get(r.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0


def test_reverts_that_come_after_the_accept_count_before_any_promotion(cfg, rds, fleet2):
    """A reward-hacking candidate: users accept its bait now and revert most of it up to the revert horizon later. A
    bucket is read only once its horizon has closed, so an accept is never counted as kept before its revert could
    come in (counted as they arrived, the newest accepts would look kept and promote the bait)."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    b0 = first(r, 1)[0]
    traffic(rds, cfg, r, range(b0, b0 + 4), lift=0.4, per_bucket=1500)  # the accepts, 40 seconds of them
    gate.canary.clock = lambda: (b0 + 4) * keys.UNIT_BUCKET_S + 1  # no revert has come in yet
    [v] = gate.step()
    assert v.verdict == "canary" and "on 0 events" in v.reason, v.reason  # no bucket's horizon has closed yet
    _reverts(rds, cfg, r, range(b0, b0 + 4))  # they arrive within the horizon
    gate.canary.clock = lambda: after(r, cfg, 4)
    [v] = gate.step()
    assert v.verdict == "aborted" and "revert_rate is worse" in v.reason, v.reason
    assert registry.stable().version == 0


def _reverts(rds, cfg, rollout, buckets: range, share: float = 0.9) -> None:
    """Revert ``share`` of the canary's accepts in ``buckets`` (in the judgements' buckets, as ingest counts them)."""
    rng = np.random.default_rng(11)
    for b in buckets:
        key = keys.units(cfg.topics.prefix, rollout.version, b)
        fields = rds.hgetall(key)
        total = 0
        for k, n in fields.items():
            u, _, f = k.rpartition("|")
            if f == "a" and u != "*":
                rev = int(rng.binomial(int(n), share))
                if rev:
                    rds.hincrby(key, f"{u}|r", rev)
                    total += rev
        rds.hincrby(key, "*|r", total)


def test_a_guardrail_shown_worse_aborts_even_when_acceptance_is_better(cfg, rds, fleet2):
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.1, revert_share=0.3)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail revert_rate is worse" in v.reason, v.reason


@pytest.mark.parametrize("mode", ["non_inferior", "harm"])
def test_a_slower_canary_is_aborted_on_the_latency_guardrail_tested_on_batch_means(cfg, rds, fleet2, mode):
    gate, registry = fleet2
    cfg.gate.latency_guardrail = mode
    ids, _ = population(50)
    for b in range(first_bucket(time.time()) - 30, first_bucket(time.time()) - 1):  # stable's figures before it
        feed(rds, cfg, 0, b, {u: (2, 1, 0, 0) for u in ids}, latency_ms=200.0)
    r = start(gate, registry, rds, cfg)
    assert r.settings["latency_band"] == pytest.approx(cfg.gate.latency_tolerance * 200.0)
    traffic(rds, cfg, r, first(r, 12), lift=0.0, latency_ms=(400.0, 200.0))
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail latency is worse" in v.reason, v.reason


def _traded_latency(rds, cfg, rollout, buckets: range, mean: float = 300.0, swing: float = 250.0) -> None:
    """Latency as two vLLM nodes on shared cores give it: equal on average, but each 10 s bucket one node is busy
    while the other idles (the arms' batch means anti-correlated, as measured in the demo: corr -0.72 to -0.90)."""
    rng = np.random.default_rng(5)
    for b in buckets:
        x = swing * rng.standard_normal()
        for v, ms in ((rollout.version, mean + x), (rollout.stable_version, mean - x)):
            key = keys.units(cfg.topics.prefix, v, b)
            n = int(rds.hget(key, "*|e") or 0)
            rds.hincrby(key, "*|m", round(ms * n))
            rds.hincrby(key, "*|n", n)


@pytest.mark.parametrize("mode", ["non_inferior", "harm"])
def test_latency_traded_between_shared_nodes_holds_a_promotion_only_when_required(cfg, rds, fleet2, mode):
    """``gate.latency_guardrail``: 'non_inferior' waits until latency is shown no more than the band above stable's,
    which latency two nodes trade on shared cores cannot show in 12 batches; 'harm' promotes on acceptance and the
    other guardrails, and latency only stops a canary it shows slower (the test above, in both modes)."""
    gate, registry = fleet2
    cfg.gate.latency_guardrail = mode
    ids, _ = population(50)
    for b in range(first_bucket(time.time()) - 30, first_bucket(time.time()) - 1):  # stable's figures before it
        feed(rds, cfg, 0, b, {u: (2, 1, 0, 0) for u in ids}, latency_ms=300.0)
    cfg.gate.latency_tolerance = 0.25
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    _traded_latency(rds, cfg, r, first(r, 12))
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    if mode == "non_inferior":
        assert v.verdict == "canary" and "guardrail latency not yet shown non-inferior" in v.reason, v.reason
        assert registry.stable().version == 0
    else:
        assert v.verdict == "promoted", v.reason
        assert "every required guardrail non-inferior (latency: not shown worse)" in v.reason, v.reason
        assert registry.stable().version == r.version


def test_what_reverts_cannot_change_is_judged_without_waiting_for_the_revert_horizon(cfg, rds, fleet2):
    """Latency, edits and length are final when judged: their guardrails read a bucket once ingest has settled it,
    while kept acceptance and the revert rate still wait for the horizon."""
    gate, registry = fleet2
    ids, _ = population(50)
    for b in range(first_bucket(time.time()) - 30, first_bucket(time.time()) - 1):  # stable's figures before it
        feed(rds, cfg, 0, b, {u: (2, 1, 0, 0) for u in ids}, latency_ms=200.0)
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 8), lift=0.0, latency_ms=(400.0, 200.0))
    cfg.gate.revert_horizon_s = 60.0  # behind it, fewer than the 5 batches the latency test needs
    gate.canary.clock = lambda: after(r, cfg, 8) - cfg.gate.revert_horizon_s  # settled, horizon not closed
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail latency is worse" in v.reason, v.reason
    [look] = registry.rollout(r.id).looks  # kept acceptance read only the buckets whose horizon had closed
    assert look["through_bucket"] < first(r, 8).stop - 1, look


def _fast_sums(rds, cfg, rollout, buckets) -> dict[str, np.ndarray]:
    """Each user's (events, accepts, edits, reverts) over ``buckets`` of both arms, as Redis holds them now."""
    out: dict[str, np.ndarray] = {}
    for v in (rollout.version, rollout.stable_version):
        for data in keys.read_unit_buckets(rds, cfg.topics.prefix, v, buckets).values():
            for u, sums in data.items():
                if u != "*":
                    out[u] = out.get(u, np.zeros(4)) + np.array([sums.get(f, 0) for f in "eadr"], dtype=float)
    return out


def _gate_sums(arms) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for arm in arms:
        for u, row in arm.users.items():
            out[u] = out.get(u, np.zeros(4)) + row[:4]
    return out


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[u], want[u]) for u in want)


def test_judgements_ingest_counts_late_reach_both_cursors_until_the_late_window_closes(cfg, rds, fleet2):
    """Judgements count in the bucket of the user's judgement time, so an ingest worker that runs behind writes into
    buckets a cursor has already read: each cursor reads a bucket again at every bucket that comes due after it, until
    gate.canary_late_s past its revert horizon; what is counted into it after that is never read."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    cfg.gate.revert_horizon_s, cfg.gate.canary_late_s = 60.0, 20.0
    cfg.gate.canary_min_s = 1e9  # undecided throughout: the evidence is what is looked at
    span, b0, step = first(r, 6), first(r, 6).start, keys.UNIT_BUCKET_S
    t1 = after(r, cfg, 6) - cfg.gate.revert_horizon_s  # the 6 buckets settled, no revert horizon closed

    def look(at: float):
        gate.canary.clock = lambda: at
        gate.step()
        ev = gate.canary._evidence
        return _gate_sums((ev.fast_canary, ev.fast_stable)), _gate_sums((ev.canary, ev.stable)), ev

    traffic(rds, cfg, r, span, lift=0.0, per_bucket=60, seed=3)  # what ingest had counted when they settled
    fast, slow, _ = look(t1)
    assert sum(x[0] for x in fast.values()) == 6 * 60 and not slow
    traffic(rds, cfg, r, span, lift=0.0, per_bucket=240, seed=4)  # the rest, counted late into the same buckets
    fast, slow, _ = look(t1 + step)  # one more bucket settled; the first one's horizon closed
    assert _same(fast, _fast_sums(rds, cfg, r, span)) and _same(slow, _fast_sums(rds, cfg, r, range(b0, b0 + 1)))
    traffic(rds, cfg, r, range(b0, b0 + 1), lift=0.0, per_bucket=50, seed=5)  # later still, inside the late window
    fast, slow, ev = look(t1 + 3 * step)  # the first bucket's late window has closed: it is final now
    assert ev.next_bucket == ev.next_fast == b0 + 1
    assert _same(fast, _fast_sums(rds, cfg, r, span)) and _same(slow, _fast_sums(rds, cfg, r, range(b0, b0 + 3)))
    assert sum(x[0] for x in fast.values()) == 6 * 300 + 50
    traffic(rds, cfg, r, range(b0, b0 + 1), lift=0.0, per_bucket=70, seed=6)  # past its late window: never read
    fast2, slow2, ev = look(t1 + 4 * step)
    assert _same(fast2, fast) and sum(x[0] for x in slow2.values()) == sum(x[0] for x in slow.values()) + 300
    assert ev.fast_canary.total("e") + ev.fast_stable.total("e") == 6 * 300 + 50


def test_stables_late_judgements_of_answers_served_before_the_rollout_are_no_sample_ratio_mismatch(cfg, rds, fleet2):
    """A bucket is one of judgement time: the first buckets of a rollout hold stable's judgements of answers served
    before it started, which the canary cannot have. Read alone, seconds after the start, they are no evidence that the
    assignment is broken (a demo run aborted three canaries on them when the sample-ratio check read them early)."""
    gate, registry = fleet2
    cfg.gate.revert_horizon_s = 60.0
    r = start(gate, registry, rds, cfg)
    ids, _ = population(400)
    for b in first(r, 2):  # only stable's users' late judgements so far
        feed(rds, cfg, r.stable_version, b, {u: (1, 1, 0, 0) for u in ids[:300]})
    gate.canary.clock = lambda: after(r, cfg, 2) - cfg.gate.revert_horizon_s  # settled, horizon not closed
    [v] = gate.step()
    assert v.verdict == "canary" and "srm" not in v.reason, v.reason


def test_an_undecided_canary_is_aborted_at_its_deadline(cfg, rds, fleet2):
    gate, registry = fleet2
    cfg.gate.canary_deadline_s = 60.0
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 3), lift=0.0)
    gate.canary.clock = lambda: r.deadline_at + 1
    [v] = gate.step()
    assert v.verdict == "aborted" and "deadline passed" in v.reason, v.reason


def test_an_undecided_canary_is_aborted_once_its_evidence_budget_is_spent(cfg, rds, fleet2):
    """``gate.canary_max_events``: the deadline in judged events of the canary arm, long before the one in seconds;
    fixed at the rollout's start (a config changed later does not move it). Without it the same look continues."""
    gate, registry = fleet2
    cfg.gate.canary_max_events = 400
    cfg.gate.canary_futility_z = None  # the budget alone (the futility stop has its own test below)
    r = start(gate, registry, rds, cfg)
    assert registry.rollout(r.id).settings["max_events"] == 400
    cfg.gate.canary_max_events = None  # the rollout keeps the budget it started with
    traffic(rds, cfg, r, first(r, 1), lift=0.0)
    gate.canary.clock = lambda: after(r, cfg, 1)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason  # under the budget yet (one bucket: about 150 events on the canary arm)
    traffic(rds, cfg, r, range(first(r, 1).stop, first(r, 4).stop), lift=0.0, seed=5)
    gate.canary.clock = lambda: after(r, cfg, 4)
    assert gate.canary.clock() < r.deadline_at
    [v] = gate.step()
    assert v.verdict == "aborted", v.reason
    assert "deadline passed: evidence budget spent (" in v.reason and "gate.canary_max_events 400" in v.reason
    assert "acceptance undecided (p " in v.reason


def test_a_canary_that_cannot_pass_within_its_budget_is_aborted_as_futile_before_spending_it(cfg, rds, fleet2):
    """``gate.canary_futility_z``: a candidate clearly worse than what it must be shown, with a
    quarter of the budget spent, stops now, and says why; the learner counts it as evidence against the candidate.
    The setting is fixed at the rollout's start."""
    gate, registry = fleet2
    cfg.gate.canary_max_events = 1200
    r = start(gate, registry, rds, cfg)
    assert registry.rollout(r.id).settings["futility_z"] == GateConfig().canary_futility_z  # the default
    cfg.gate.canary_futility_z = None  # the rollout keeps the setting it started with
    traffic(rds, cfg, r, first(r, 4), lift=-0.04, seed=3)
    gate.canary.clock = lambda: after(r, cfg, 4)
    [v] = gate.step()
    assert v.verdict == "aborted", v.reason
    assert "futile with " in v.reason and "of the evidence budget spent: acceptance cannot be shown " in v.reason
    assert "deadline passed" not in v.reason and evidence_against(registry.get(r.version).status_reason)


def test_the_futility_stop_leaves_a_better_canary_to_be_promoted(cfg, rds, fleet2):
    gate, registry = fleet2
    cfg.gate.canary_max_events = 1200
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 4), lift=0.15, seed=4)
    gate.canary.clock = lambda: after(r, cfg, 4)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason


def test_without_an_evidence_budget_the_same_canary_runs_on(cfg, rds, fleet2):
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    assert registry.rollout(r.id).settings["max_events"] is None
    traffic(rds, cfg, r, first(r, 3), lift=0.0)
    gate.canary.clock = lambda: after(r, cfg, 3)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason


def test_the_test_state_lives_in_the_registry_and_survives_a_gate_restart(cfg, rds, fleet2):
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 4), lift=0.15)
    gate.canary.clock = lambda: after(r, cfg, 4)
    [v] = gate.step()
    state = registry.rollout(r.id).test_state
    assert v.verdict in ("canary", "promoted") and state, v.reason
    rds.set(keys.rollout(cfg.topics.prefix), "{}")  # Redis holds nothing the gate reads back
    if v.verdict == "canary":
        again = Gate(cfg, registry, rds, ProbeEval())  # a restarted gate reads the buckets again, from the registry's
        again.canary.clock = gate.canary.clock  # rollout, and carries on with the registry's test state
        traffic(rds, cfg, r, range(first(r, 4).stop, first(r, 12).stop), lift=0.15, seed=3)
        again.canary.clock = lambda: after(r, cfg, 12)
        [v] = again.step()
        assert v.verdict == "promoted", v.reason


def test_a_forged_plan_or_test_state_in_redis_decides_nothing(cfg, rds, fleet2):
    """The registry, not Redis, holds the rollout plan and the test's state; whatever is
    written to ``<p>:rollout`` is never read."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    forged = {
        "version": r.version,
        "checksum": r.checksum,
        "stable_version": 0,
        "share": 1.0,
        "nodes": list(NODES),
        "deadline_at": time.time() + 600,
        "state": "running",  # what main's gate restored its test state from
        "max_log_lr": {"acceptance:pass": 50, "edit_rate:pass": 50, "revert_rate:pass": 50},
    }
    rds.set(keys.rollout(cfg.topics.prefix), json.dumps(forged))
    traffic(rds, cfg, r, first(r, 3), lift=0.0)
    gate.canary.clock = lambda: after(r, cfg, 3)
    [v] = gate.step()
    assert v.verdict == "canary" and registry.stable().version == 0, v.reason
    ann = VersionAnnouncement.from_bytes(rds.get(keys.canary(cfg.topics.prefix)))
    assert ann.rollout.share == 0.5 and len(ann.rollout.nodes) == 1  # the gate's terms, not the forged ones


def test_an_operator_pause_between_the_gates_read_and_its_promotion_holds(cfg, rds, fleet2, monkeypatch):
    """The gate decides to promote on a read of a running rollout; an operator pauses it meanwhile. The
    promotion is a compare-and-set on a running rollout: the pause wins."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    gate.canary.clock = lambda: after(r, cfg, 12)
    real = gate.canary.build_tests

    def pausing(*a, **kw):
        out = real(*a, **kw)
        registry.set_rollout_state(r.id, "paused", actor="alice", reason="looking at the reverts")
        return out

    monkeypatch.setattr(gate.canary, "build_tests", pausing)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason
    assert registry.rollout(r.id).state == "paused" and registry.get(r.version).status == "canary"
    monkeypatch.setattr(gate.canary, "build_tests", real)
    [v] = gate.step()
    assert v.verdict == "canary" and "paused by an operator" in v.reason
    registry.set_rollout_state(r.id, "running", actor="alice", reason="reverts are fine")
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason


def test_a_sample_ratio_mismatch_stops_the_canary(cfg, rds, fleet2):
    """Half the users should be on the canary; a broken assignment (or logging) shows as far fewer: stopped, reason
    srm, whatever the metrics say."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    ids, p = population(600)
    rng = np.random.default_rng(5)
    for b in first(r, 12):
        canary, stable = {}, {}
        for i in rng.integers(0, 600, 300):
            side = canary if i < 60 else stable  # 10% of the users reach the canary, not 50%
            row = side.setdefault(ids[i], [0, 0, 0, 0])
            row[0] += 1
            row[1] += rng.random() < p[i]
        feed(rds, cfg, r.version, b, {u: tuple(x) for u, x in canary.items()})
        feed(rds, cfg, 0, b, {u: tuple(x) for u, x in stable.items()})
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and v.reason.startswith("srm"), v.reason


def test_the_request_unit_tests_each_judged_event(cfg, rds, fleet2):
    gate, registry = fleet2
    cfg.gate.canary_unit = "request"
    r = start(gate, registry, rds, cfg)
    assert r.unit == "request"
    ann = VersionAnnouncement.from_bytes(rds.get(keys.canary(cfg.topics.prefix)))
    assert ann.rollout.unit == "request"
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "promoted" and "unit request" in v.reason, v.reason


def test_with_a_configured_fleet_of_two_and_one_node_down_the_decision_is_deferred_not_made_without_a_canary(
    cfg, rds, fleet2
):
    """A 2-node fleet with one node restarting does not promote fleet-wide without live evidence."""
    gate, registry = fleet2
    beat(rds, cfg, "node-b", healthy=False)
    row = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    [v] = gate.step()
    assert v.verdict == "deferred" and "a canary needs 2 routable nodes" in v.reason, v.reason
    assert registry.get(row.version).status == "candidate" and registry.stable().version == 0
    beat(rds, cfg, "node-b")
    [v] = gate.step()
    assert v.verdict == "canary", v.reason


def test_a_canary_whose_stable_arm_lost_its_last_node_is_ended_after_the_grace(cfg, rds, fleet2):
    """The stable arm's only node leaves the rotation during a canary: the routers hold its users rather than hand
    them the candidate, so the gate aborts the rollout once the arm has been empty for gate.stable_arm_grace_s, and
    the canary node goes back to stable. A node that is back within the grace ends nothing."""
    gate, registry = fleet2
    cfg.gate.stable_arm_grace_s = 0.3
    r = start(gate, registry, rds, cfg)
    [stable_node] = [n for n in NODES if n not in r.nodes]
    beat(rds, cfg, stable_node, healthy=False)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason  # within the grace
    beat(rds, cfg, stable_node)  # back: the clock starts again next time
    [v] = gate.step()
    time.sleep(0.4)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason
    rds.delete(keys.served(cfg.topics.prefix, stable_node))  # gone (its heartbeat expired)
    [v] = gate.step()
    assert v.verdict == "canary", v.reason
    time.sleep(0.4)
    [v] = gate.step()
    assert v.verdict == "aborted" and "the stable arm has no node in rotation" in v.reason, v.reason
    assert registry.get(r.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0 and rds.get(keys.canary(cfg.topics.prefix)) is None


def test_a_heartbeat_of_a_node_the_config_does_not_name_is_never_a_canary_node(cfg, rds, fleet2):
    gate, registry = fleet2
    beat(rds, cfg, "node-b", healthy=False)
    beat(rds, cfg, "evil")  # a forged heartbeat: not in serving.fleet
    registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    [v] = gate.step()
    assert v.verdict == "deferred", v.reason


def test_canary_nodes_rotate_from_one_rollout_to_the_next(cfg, rds, fleet2):
    gate, registry = fleet2
    seen = []
    for seed in (1, 2, 3, 4):  # two candidates each time, the older superseded: every canary is an even version
        registry.add_candidate(weights(0.9, 1.0, seed=10 + seed), parent=0)  # (a demo run put v16, v38 and v52 on
        registry.add_candidate(weights(0.9, 1.0, seed=seed), parent=0)  # one node)
        assert [v.verdict for v in gate.step()] == ["superseded", "canary"]
        r = registry.active_rollout()
        assert r.version % 2 == 0
        seen.append(r.nodes)
        registry.finish_rollout_abort(r.id, actor="alice", reason="next one")
        gate.step()
    assert all(a != b for a, b in itertools.pairwise(seen)), seen  # with two nodes, each rollout on the other one


def test_a_rollback_during_the_canary_aborts_it(cfg, rds, fleet2):
    """An operator rolls back the stable version while a canary runs: the canary was judged against a version no
    longer served, so it is aborted, never promoted over the rollback."""
    gate, registry = fleet2
    row = registry.add_candidate(weights(0.9, 1.0, seed=5), parent=0)
    registry.promote(row.version, actor="alice", reason="hotfix", expected_stable=0, from_candidate=True)
    gate.step()
    r = start(gate, registry, rds, cfg, seed=6)
    assert r.stable_version == row.version
    registry.rollback(actor="alice", reason="the hotfix was bad")
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "stable version changed" in v.reason, v.reason
    assert registry.get(r.version).status == "rejected" and registry.stable().version == 0


def test_a_candidate_the_offpolicy_check_defers_is_never_promoted_without_a_canary(cfg, rds, fleet2, monkeypatch):
    gate, registry = fleet2
    cfg.gate.canary_share = 0.0  # no canary can run
    monkeypatch.setattr(
        gate, "_evidence", lambda row, stable, state: {"drift": True, "offpolicy": True, "needs_canary": True}
    )
    row = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    [v] = gate.step()
    assert v.verdict == "rejected" and "deferred to a canary" in v.reason, v.reason
    assert registry.get(row.version).status == "rejected" and registry.stable().version == 0


def test_cuped_uses_each_users_history_before_the_rollout_whatever_served_it(cfg, rds, fleet2):
    """The covariate is each user's kept rate over the look-back before the rollout, from every version that served
    them (here an earlier stable version): users differ, their history says how, and CUPED takes that out."""
    gate, registry = fleet2
    ids, p = population(400)
    rng = np.random.default_rng(9)
    now_b = first_bucket(time.time())
    for b in range(now_b - 60, now_b - 1):  # ten minutes of history under v0
        feed(
            rds, cfg, 0, b, {u: (3, int(rng.binomial(3, p[i])), 0, 0) for i, u in enumerate(ids) if rng.random() < 0.2}
        )
    row = registry.add_candidate(weights(0.8, 1.0, seed=7), parent=0)
    registry.promote(row.version, actor="alice", reason="an earlier release", expected_stable=0, from_candidate=True)
    gate.step()
    r = start(gate, registry, rds, cfg, seed=8)
    assert r.stable_version == row.version
    traffic(rds, cfg, r, first(r, 12), lift=0.05)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    look = registry.rollout(r.id).looks[-1] if v.verdict == "canary" else None
    removed = look["cuped_removed"] if look else float(v.reason.split("CUPED removed ")[1].split("%")[0]) / 100
    assert removed > 0.5, v.reason


def test_evidence_starts_once_the_canary_nodes_serve_the_candidate(cfg, rds, fleet2):
    """Until a canary node has swapped (and the router has learnt of the rollout), the canary's users are served by
    the stable version, and those answers are judged in the rollout's first seconds. Counted for stable, they made the
    first bucket 9-34% short of canary events in 8 of 13 canaries of three demo runs and aborted one better canary as a
    sample-ratio mismatch (315 against 478 events). The evidence starts with the first whole bucket
    gate.canary_warmup_s after every canary node served the candidate (the registry's served times)."""
    gate, registry = fleet2
    row = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    [v] = gate.step()
    r = registry.active_rollout()
    assert v.verdict == "canary" and r.version == row.version
    gate.canary.clock = lambda: r.started_at + 200.0  # long after, but no canary node has reported the swap
    [v] = gate.step()
    assert v.verdict == "canary" and f"waiting for {r.nodes[0]} to serve v{r.version}" in v.reason, v.reason
    live = r.started_at + 14.0  # the node swapped 14 s in
    b_live = evidence_start(live, cfg.gate.canary_warmup_s)
    ids, _ = population(400)
    for b in range(first_bucket(r.started_at), b_live):  # everyone served by stable, the canary's users included
        feed(rds, cfg, 0, b, {u: (1, 1, 0, 0) for u in ids[:300]})
    traffic(rds, cfg, r, range(b_live, b_live + 12), lift=0.15)
    registry.update_fleet(r.nodes[0], r.version, r.checksum, at=live)
    gate.canary.clock = lambda: (b_live + 12) * keys.UNIT_BUCKET_S + cfg.gate.revert_horizon_s + SETTLE_S + 1
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason  # read from the start of the rollout instead: aborted as an SRM
    counted = sum(int(rds.hget(keys.units(cfg.topics.prefix, 0, b), "*|e") or 0) for b in range(b_live, b_live + 12))
    assert "vs stable v0 " in v.reason and f"on {counted} of" in v.reason, v.reason
