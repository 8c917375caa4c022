"""The canary's always-valid sequential test (deploy.sequential): its statistic, its decisions and its error rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy.sequential import (ABORT, BETTER, CONTINUE, PROMOTE, UNDECIDED, WORSE, Canary, MetricTest, log_mixture_lr,
                               simulate)


def test_the_mixture_ratio_matches_its_formula_and_is_one_at_no_evidence():
    d, var, tau = 0.05, 0.0004, 0.03
    want = math.sqrt(var / (var + tau**2)) * math.exp(tau**2 * d**2 / (2 * var * (var + tau**2)))
    assert math.exp(log_mixture_lr(d, var, 0.0, tau)) == pytest.approx(want)
    assert log_mixture_lr(0.0, 1e9, 0.0, tau) == pytest.approx(0.0, abs=1e-9)  # no information: ratio 1
    assert log_mixture_lr(0.0, var, 0.0, tau) < 0  # a precise zero difference is evidence for the null


def _feed(test: MetricTest, rng: np.random.Generator, p_canary: float, p_stable: float, n: int, share: float = 0.5):
    for _ in range(n):
        arm = "canary" if rng.random() < share else "stable"
        test.add(arm, float(rng.random() < (p_canary if arm == "canary" else p_stable)))


def test_one_event_at_a_time_agrees_with_the_vectorised_simulation():
    """``MetricTest`` (what the gate runs) and ``simulate`` (the calibration) make the same call on the same events."""
    rng = np.random.default_rng(7)
    n, share = 4000, 0.3
    to_canary = rng.random(n) < share
    accept = np.where(to_canary, rng.random(n) < 0.62, rng.random(n) < 0.5)
    t = MetricTest("acceptance", min_events=50)
    first = None
    for i in range(n):
        t.add("canary" if to_canary[i] else "stable", float(accept[i]))
        if first is None and t.verdict() != UNDECIDED:
            first = (t.verdict(), i + 1)
    assert first is not None and first[0] == BETTER
    # the same arithmetic, all looks at once
    nc, xc = np.cumsum(to_canary), np.cumsum(accept & to_canary)
    ns, xs = np.arange(1, n + 1) - nc, np.cumsum(accept & ~to_canary)
    pc, ps = (xc + 1) / (nc + 2), (xs + 1) / (ns + 2)
    d = xc / np.maximum(nc, 1) - xs / np.maximum(ns, 1)
    var = pc * (1 - pc) / np.maximum(nc, 1) + ps * (1 - ps) / np.maximum(ns, 1)
    llr = np.where((nc >= 50) & (ns >= 50), log_mixture_lr(d, var, 0.0, 0.03), -np.inf)
    assert int(np.nonzero((llr >= math.log(20)) & (d > 0))[0][0]) + 1 == first[1]


def test_clear_effects_are_found_both_ways_and_no_effect_stays_undecided():
    rng = np.random.default_rng(1)
    up, down, same = MetricTest("a"), MetricTest("a"), MetricTest("a")
    _feed(up, rng, 0.70, 0.50, 3000)
    _feed(down, rng, 0.30, 0.50, 3000)
    _feed(same, rng, 0.50, 0.50, 3000)
    assert (up.verdict(), down.verdict(), same.verdict()) == (BETTER, WORSE, UNDECIDED)
    assert up.p_pass < 0.05 and down.p_harm < 0.05 and same.p_pass > 0.05 and same.p_harm > 0.05
    s = up.summary()
    assert s["verdict"] == BETTER and s["canary_n"] + s["stable_n"] == 3000 and s["difference"] > 0.1


def test_lower_is_better_metrics_and_non_inferiority_margins():
    rng = np.random.default_rng(2)
    latency = MetricTest("latency_s", direction=-1, bernoulli=False, tau=0.05, margin=0.05, min_events=30)
    for _ in range(2000):
        latency.add("canary", float(rng.normal(1.00, 0.1)))
        latency.add("stable", float(rng.normal(1.01, 0.1)))
    assert latency.verdict() == BETTER  # not slower by more than 50 ms (it is not slower at all)
    slower = MetricTest("latency_s", direction=-1, bernoulli=False, tau=0.05, min_events=30)
    for _ in range(2000):
        slower.add("canary", float(rng.normal(1.2, 0.1)))
        slower.add("stable", float(rng.normal(1.0, 0.1)))
    assert slower.verdict() == WORSE


def test_the_canary_promotes_only_with_every_guardrail_and_aborts_on_any_harm_or_the_deadline():
    rng = np.random.default_rng(3)

    def canary(p_kept_canary: float) -> Canary:
        c = Canary(MetricTest("acceptance"), [MetricTest("kept", margin=0.05)])
        _feed(c.success, rng, 0.65, 0.50, 6000)
        _feed(c.guardrails[0], rng, p_kept_canary, 0.80, 6000)
        return c

    assert canary(0.80).verdict()[0] == PROMOTE
    verdict, why = canary(0.60).verdict()  # accepted more, kept less: the reward-hacking shape
    assert verdict == ABORT and "kept" in why
    early = Canary(MetricTest("acceptance"), [MetricTest("kept", margin=0.02)])
    assert early.verdict() == (CONTINUE, "collecting evidence")
    verdict, why = early.verdict(deadline_passed=True)
    assert verdict == ABORT and "deadline" in why


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        MetricTest("a", alpha=1.5)
    with pytest.raises(ValueError, match="finite"):
        MetricTest("a").add("canary", float("nan"))
    with pytest.raises(ValueError, match="arm"):
        MetricTest("a").add("both", 1.0)
    with pytest.raises(ValueError, match="share"):
        simulate(0.5, 0.5, 1.5, 100, 1)


def test_a_a_canaries_peeked_after_every_event_promote_at_most_alpha():
    """A bounded calibration for CI (the full one is ``liverl bench canary``: 1,000 canaries per scenario)."""
    res = simulate(0.5, 0.5, share=0.2, max_events=20_000, runs=400, alpha=0.05, seed=11)
    # 400 runs: a true rate of 5% would exceed 8% with probability < 1%
    assert res["promoted"] <= 0.08 and res["promoted"] + res["aborted"] <= 0.10, res
    power = simulate(0.5, 0.6, share=0.2, max_events=20_000, runs=100, seed=12)
    assert power["promoted"] >= 0.9 and power["aborted"] == 0.0, power
