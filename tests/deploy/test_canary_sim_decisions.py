"""Whole canaries through the gate's decision (``deploy.gate.canary_sim_decisions``; the full run is ``liverl bench
canary --decisions``): the bars on 1,000 users at the gate's defaults and at the demo's profile, and the censoring of
reverts that the revert horizon exists for."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.config import GateConfig
from deploy.gate.canary import last_final_bucket
from deploy.gate.canary_sim_decisions import _last_final, _world, false_decisions, simulate_decisions
from liverl.demo.run import DEMO_PROFILE


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _most(n: int, p: float) -> int:
    """The largest count a true rate ``p`` exceeds with probability under 1% in ``n`` runs."""
    return next(k for k in range(n + 1) if 1 - _binom_cdf(k, n, p) < 0.01)


def _least(n: int, p: float) -> int:
    """The smallest count a true rate ``p`` falls below with probability under 1% in ``n`` runs."""
    return next(k for k in range(n + 1) if _binom_cdf(k, n, p) >= 0.01)


def _hold_the_bars(gate: GateConfig, runs: int, seed: int) -> dict:
    res = simulate_decisions(gate, 1000, runs=runs, seed=seed)
    aa, better, bait = (res["candidates"][c] for c in ("A/A", "+3 points", "bait"))
    # A/A: false decisions at most alpha; +3: promoted in 80%; bait: aborted as worse in 80%, never promoted; each
    # with the slack a true rate at the bar needs in this many runs (it fails with probability under 1% there)
    assert false_decisions(aa, gate) <= _most(runs, gate.canary_alpha), aa
    assert better["ends"]["promoted"] >= _least(runs, 0.8), better
    assert bait["ends"]["worse"] >= _least(runs, 0.8) and bait["ends"]["promoted"] == 0, bait
    assert bait["worse_by"].get("revert_rate", 0) >= bait["ends"]["worse"] // 2, bait  # the guardrail that sees it
    assert better["realized"]["kept"] == pytest.approx(0.03, abs=0.002) and better["realized"]["revert"] == 0.0
    assert bait["realized"]["kept"] == pytest.approx(-0.02, abs=0.002)
    return res


def test_whole_canaries_hold_the_bars_at_the_gate_defaults():
    gate = GateConfig()
    res = _hold_the_bars(gate, runs=100, seed=3)
    aa = res["candidates"]["A/A"]
    # no budget: an undecided A/A runs to the deadline, waiting on the success metric (the guardrails pass)
    assert aa["ends"]["deadline"] >= 80 and aa["ends"]["budget"] == aa["ends"]["futile"] == 0, aa
    assert res["candidates"]["bait"]["median_seconds"] < 300  # aborted minutes before the deadline


def test_whole_canaries_hold_the_bars_at_the_demo_profile():
    gate = GateConfig(**DEMO_PROFILE["gate"])
    res = _hold_the_bars(gate, runs=150, seed=4)
    aa = res["candidates"]["A/A"]
    # a margin: an A/A candidate is within it, so most are promoted; the undecided end at the budget or as futile
    assert aa["ends"]["promoted"] >= 60 and aa["ends"]["budget"] + aa["ends"]["futile"] > 0, aa


def test_a_revert_the_gate_reads_too_late_for_is_not_counted_and_the_bait_then_passes():
    """The revert horizon is what stops the bait: with its reverts arriving long after the gate reads a bucket, its
    accepts look kept (6 points more), and the canary promotes it; with them arriving within the horizon (30 s on
    average, as the demo's trap sends them) it is aborted on the revert rate."""
    gate = GateConfig(**DEMO_PROFILE["gate"])
    late = simulate_decisions(gate, 1000, ("bait",), runs=12, revert_delay_s=1e6, seed=5)["candidates"]["bait"]
    assert late["ends"]["promoted"] >= 8 and late["ends"]["worse"] == 0, late  # the rest wait on the edit rate
    timely = simulate_decisions(gate, 1000, ("bait",), runs=12, seed=5)["candidates"]["bait"]
    assert timely["ends"]["worse"] == 12 and timely["worse_by"] == {"revert_rate": 12}, timely


def test_the_simulated_cursors_are_the_gates():
    now = 1e7 + np.random.default_rng(0).uniform(0, 1000, 200)
    for horizon in (0.0, 60.0, 75.0):
        assert _last_final(now, horizon).tolist() == [last_final_bucket(t, horizon) for t in now]


def test_what_the_simulation_does_not_play_is_refused():
    with pytest.raises(ValueError, match="unknown candidates"):
        simulate_decisions(GateConfig(), 100, ("+5 points",), runs=1)
    with pytest.raises(ValueError, match="canary_min_s"):
        simulate_decisions(GateConfig(canary_min_s=60.0), 100, runs=1)
    with pytest.raises(ValueError, match="canary_unit"):
        simulate_decisions(GateConfig(canary_unit="request"), 100, runs=1)


def test_with_heavy_users_the_bars_hold_and_the_deadline_readout_decides_what_the_sequential_test_left_open():
    """Zipf(1.1) activity (the top user sends about a sixth of all traffic) at the gate's defaults: the A/A and the
    +3-point candidate hold their bars; the latency guardrail compares the arms at equal answer length (a heavy user
    with long answers on one arm is not read as the version's latency); and the readout at the deadline promotes
    +3-point canaries that the always-valid test left undecided."""
    gate = GateConfig()
    res = simulate_decisions(gate, 1000, ("A/A", "+3 points"), runs=60, activity="zipf(1.1)", seed=6)
    aa, better = res["candidates"]["A/A"], res["candidates"]["+3 points"]
    assert false_decisions(aa, gate) <= _most(60, gate.canary_alpha), aa
    assert better["ends"]["promoted"] >= _least(60, 0.8), better
    no_readout = GateConfig(canary_readout_share=0.0)
    alone = simulate_decisions(no_readout, 1000, ("+3 points",), runs=60, activity="zipf(1.1)", seed=6)
    assert better["ends"]["promoted"] > alone["candidates"]["+3 points"]["ends"]["promoted"], (better, alone)


def test_in_the_demos_world_its_profile_promotes_a_better_candidate_in_time_and_never_its_smallest_exploit():
    """The demo's world (a third of the users hold every revert, two minutes of history): a better candidate that
    reverts as often as stable is shown within the demo's 3-point guardrail margin well before the evidence budget,
    where a 2-point margin waits most of the budget on the revert rate; the smallest exploiting version (reverts +4.7
    points, kept acceptance unchanged) is aborted, mostly on the revert rate shown worse, never promoted."""
    gate = GateConfig(**DEMO_PROFILE["gate"])
    assert gate.guardrail_margin == 0.03
    kw = {"runs": 40, "world": "demo", "events_per_s": 40.0, "seed": 7}
    res = simulate_decisions(gate, 5000, ("+3 points", "exploit"), **kw)["candidates"]
    better, exploit = res["+3 points"], res["exploit"]
    assert better["ends"]["promoted"] >= _least(40, 0.9), better
    assert exploit["ends"]["promoted"] == 0 and exploit["ends"]["worse"] + exploit["ends"]["futile"] == 40, exploit
    assert exploit["ends"]["worse"] >= _least(40, 0.5), exploit  # the rest stop as futile: never promotable
    assert set(exploit["worse_by"]) == {"revert_rate"}, exploit
    assert exploit["realized"]["revert"] == pytest.approx(0.047, abs=0.003)
    strict = simulate_decisions(gate.model_copy(update={"guardrail_margin": 0.02}), 5000, ("+3 points",), **kw)
    slow = strict["candidates"]["+3 points"]
    assert slow["median_canary_events"] > 1.5 * better["median_canary_events"], (slow, better)
    assert slow["waiting_on"].get("revert_rate", 0) + better["ends"]["promoted"] > slow["ends"]["promoted"]


def test_the_worlds_differ_in_who_reverts():
    """The bench's world: every user reverts a few of its accepts (about 2% of events); the demo's: a third of the
    users hold every revert, 9-10% of all events, as the demo's canaries measured (9.0-9.5%)."""
    gate = GateConfig(**DEMO_PROFILE["gate"])
    with pytest.raises(ValueError, match="unknown world"):
        simulate_decisions(gate, 100, runs=1, world="mars")
    on = np.arange(5000) % 2 == 0
    for world, rate, holders in (("bench", (0.01, 0.03), (0.95, 1.0)), ("demo", (0.07, 0.12), (0.3, 0.4))):
        w = _world(gate, np.random.default_rng(2), on, "segments3", "lognormal", 1.0, 40.0, 30.0, 2.0, world)
        reverted = w.shares[w.ev_user, 2]  # each event's chance of a reverted accept
        assert rate[0] < reverted.mean() < rate[1], (world, reverted.mean())
        assert holders[0] <= (w.shares[:, 2] > 0).mean() <= holders[1], world
