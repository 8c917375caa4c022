"""What a canary's verdict claims beyond one metric's test (deploy.gate.sequential_readout, the latency quantile of
deploy.gate.sequential_quantile): the family's levels, the readout at the deadline and only there, the bias-corrected
effect and the always-valid interval, the quantile read from the histogram; each calibrated on a few simulated
canaries (the full calibration is ``liverl bench canary --stats``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core import keys
from deploy.gate import sequential_readout as ro
from deploy.gate.canary_sim_stats import simulate_latency_quantile, simulate_readout
from deploy.gate.sequential import ABORT, CONTINUE, PROMOTE, Canary, MetricTest, log_mixture_lr, t_widened
from deploy.gate.sequential_quantile import hist_counts, hist_quantile, look_quantiles, paired_quantiles


def _slack(p: float, n: int) -> float:
    """Two binomial standard errors above ``p`` for ``n`` runs: a small run count's honest room."""
    return p + 2 * math.sqrt(p * (1 - p) / n)


def _test(name: str, d: float, se: float, **kw) -> MetricTest:
    t = MetricTest(name, min_events=1, min_units=2, **kw)
    t.look(d, se * se)
    return t


def test_harm_sides_split_alpha_over_every_test_and_the_verdict_names_the_levels():
    """Three tests that may abort: each harm side at alpha / 3 (Bonferroni), so a p-value between alpha / 3 and
    alpha no longer aborts, and one below does; the verdict says which level it was held to."""
    se = 0.01
    z_between = 3.2  # harm p (mixture, tau 0.03) between 0.0167 and 0.05
    c = Canary(_test("acceptance", 0.0, se), [_test("edit_rate", -z_between * se, se, direction=-1), _test("x", 0, se)])
    assert 0.05 / 3 < c.guardrails[0].p_harm < 0.05
    assert c.verdict()[0] == CONTINUE
    assert c.harm_alpha(c.success) == pytest.approx(0.05 / 3)
    c.guardrails[0].look(-4.0 * se, se * se)
    verdict, why = c.verdict()
    assert verdict == ABORT and "guardrail edit_rate is worse" in why
    assert "over the 3 tests that may abort" in why and "false abort <= 0.05" in why, why
    assert c.guarantee() == {
        "alpha": 0.05,
        "tests": 3,
        "pass_alpha": 0.05,
        "readout_alpha": 0.0,
        "harm_alpha": pytest.approx(0.05 / 3),
    }


def test_the_readout_decides_only_at_the_deadline_and_only_what_the_sequential_test_left_open():
    """An effect of 2.4 standard errors: the mixture has not passed it, the fixed-horizon test at alpha s would.
    Before the deadline the canary goes on; at it, the readout promotes, naming its p-value and level; without a
    readout share it aborts as before. A required guardrail the readout cannot pass holds the promotion back."""
    se = 0.01

    def canary(share: float, guard_d: float = 0.0) -> Canary:
        success = _test("acceptance", 2.4 * se, se)
        guard = _test("edit_rate", guard_d, se / 2, direction=-1, margin=0.02)
        return Canary(success, [guard], readout_share=share)

    c = canary(0.2)
    assert c.success.p_pass > 0.04 and c.success.readout_p() < 0.01 and c.guardrails[0].p_pass < 0.04
    assert c.verdict() == (CONTINUE, "collecting evidence")
    verdict, why = c.verdict(deadline_passed=True)
    assert verdict == PROMOTE and why.startswith("deadline passed: the readout at the fixed horizon passes: ")
    assert "acceptance better than stable (p " in why and "<= 0.01)" in why and "sequential 0.04 + readout 0.01" in why
    verdict, why = canary(0.0).verdict(deadline_passed=True)
    assert verdict == ABORT and "acceptance undecided (p " in why and "readout" not in why
    held = canary(0.2, guard_d=-0.016)  # 0.8 se inside the 2-point margin: neither test shows non-inferiority
    verdict, why = held.verdict(deadline_passed=True)
    assert verdict == ABORT and "guardrail edit_rate not shown non-inferior" in why and "; readout p " in why, why


def test_the_readout_reads_the_looks_t_as_the_sequential_test_does():
    """One-sided normal tail at infinite df; a Student-t reading with few units (Wallace's normal equivalent, the one
    ``t_widened`` gives the mixture); 1 without a finite estimate; not ready: no readout."""
    assert ro.readout_p(0.02, 0.01**2, math.inf, 0.0) == pytest.approx(0.5 * math.erfc(2 / math.sqrt(2)))
    assert ro.readout_p(0.02, 0.01**2, 5, 0.0) > ro.readout_p(0.02, 0.01**2, math.inf, 0.0)
    for t, df in ((2.5, 4.0), (-1.2, 9.0), (3.0, 40.0)):
        z = ro.normal_equivalent(t, df)
        assert z * z == pytest.approx(t * t * 1.0 / float(t_widened(1.0, df, t)))
    assert ro.readout_p(float("nan"), 1e-4, 10, 0.0) == 1.0
    t = MetricTest("a", min_events=1, min_units=2)
    t.look(0.05, 1e-4, ready=False)
    assert t.final() is None and t.readout_p() == 1.0
    with pytest.raises(ValueError, match="readout"):
        Canary(MetricTest("a"), readout_share=1.0)


def test_the_corrected_effect_shrinks_towards_no_effect_by_the_mixtures_weight():
    tau = 0.03
    for d, var in ((0.05, 0.01**2), (-0.02, 0.02**2), (0.01, 1e-8)):
        s = ro.shrunk(d, var, tau)
        assert s == pytest.approx(d * tau**2 / (tau**2 + var)) and abs(s) <= abs(d) and s * d >= 0
    assert ro.shrunk(0.05, 1e-10, tau) == pytest.approx(0.05, rel=1e-6)  # precise estimates are left as they are
    assert ro.shrunk(0.05, 0.03**2, tau) == pytest.approx(0.025)  # V = tau^2: half way
    t = _test("acceptance", 0.04, 0.01, tau=tau)
    eff = t.effect()
    assert eff["effect"] == 0.04 and 0 < eff["effect_corrected"] < 0.04 and eff["effect_lo"] < eff["effect_corrected"]


def test_the_always_valid_interval_is_where_the_mixture_does_not_reject():
    """Its ends are where the t-widened mixture ratio reaches 1 / alpha; it excludes 0 exactly when the two-sided
    mixture would reject no effect; fewer degrees of freedom widen it."""
    d, var, tau, alpha = 0.03, 0.01**2, 0.03, 0.05
    lo, hi = ro.confidence_sequence(d, var, math.inf, tau, alpha)
    assert lo < d < hi and (hi - d) == pytest.approx(d - lo)
    for end in (lo, hi):
        assert float(log_mixture_lr(d, var, end, tau)) == pytest.approx(math.log(1 / alpha), abs=1e-6)
    assert (lo > 0) == (float(log_mixture_lr(d, var, 0.0, tau)) >= math.log(1 / alpha))
    lo5, hi5 = ro.confidence_sequence(d, var, 5, tau, alpha)
    assert lo5 < lo and hi5 > hi
    assert math.isnan(ro.confidence_sequence(d, float("inf"), 5, tau, alpha)[0])


def test_the_family_and_the_readout_are_calibrated_and_the_readout_adds_power():
    """A few canaries of ``simulate_readout`` (success metric and two guardrails, sticky users, CUPED): A/A false
    promotions (sequential or readout) and false aborts each at most alpha, within two binomial standard errors; the
    readout at share 0.2 promotes more canaries 1.5 points better by the deadline than no readout."""
    runs = 120
    r = simulate_readout(
        "segments", 600, effects=(0.0, 0.015), runs=runs, readout_shares=(0.0, 0.2), prior=False, seed=3
    )
    rows = {(x["readout_share"], x["effect"]): x for x in r["rows"]}
    for s in (0.0, 0.2):
        aa = rows[(s, 0.0)]
        assert aa["promoted"] + aa["readout"] <= _slack(0.05, runs), aa
        assert aa["worse"] <= _slack(0.05, runs), aa
        assert aa["runs"] == runs
    assert rows[(0.0, 0.015)]["readout"] == 0.0
    with_readout, without = rows[(0.2, 0.015)], rows[(0.0, 0.015)]
    assert with_readout["readout"] > 0 and with_readout["promoted"] + with_readout["readout"] > without["promoted"]


def test_the_corrected_estimate_of_promoted_canaries_is_closer_to_the_truth_than_the_raw_one():
    """The winner's curse: canaries promoted early overstate their effect. Among the promoted, the corrected mean
    lies between the truth and the raw mean (a fixed effect below the mixture's tau, where the raw estimate's bias is
    larger than the correction; ``liverl bench canary --stats`` measures it with effects drawn from the prior too)."""
    r = simulate_readout("segments", 600, effects=(0.01, 0.02), runs=80, readout_shares=(0.2,), prior=False, seed=4)
    for row in r["rows"]:
        assert row["promoted_n"] >= 15, row
        truth = row["truth"]
        assert truth < row["corrected"] < row["raw"], row
        assert row["covered"] >= 0.9, row


def test_a_quantile_is_read_from_the_histogram_ingest_keeps():
    rng = np.random.default_rng(0)
    x = np.round(rng.lognormal(math.log(300), 0.6, 5000)).astype(int)
    h = np.bincount([keys.latency_bin(v) for v in x], minlength=keys.LATENCY_HIST_BINS)
    for q in (0.5, 0.9, 0.99):
        assert hist_quantile(h, q) == pytest.approx(np.quantile(x, q), rel=0.19)  # within a bin
    assert np.isnan(hist_quantile(np.zeros(keys.LATENCY_HIST_BINS), 0.9))
    agg = {"e": 7, "m": 100, "h3": 2, "h57": 1}
    assert list(np.nonzero(hist_counts(agg))[0]) == [3, 57]
    with pytest.raises(ValueError, match="quantile"):
        hist_quantile(h, 1.0)
    with pytest.raises(ValueError, match="bins"):
        hist_quantile(np.ones(5), 0.9)
    # buckets both arms served with enough timed events pair by time; the others are skipped by both arms
    c = {1: {f"h{keys.latency_bin(200)}": 30}, 2: {f"h{keys.latency_bin(200)}": 5}, 3: {"h30": 30}}
    s = {1: {f"h{keys.latency_bin(100)}": 30}, 2: {f"h{keys.latency_bin(100)}": 30}}
    qc, qs, _gap = paired_quantiles(c, s, 0.9)
    assert qc.shape == qs.shape == (1,) and 180 < qc[0] < 216 and 90 < qs[0] < 110


def test_a_slow_tail_is_shown_worse_on_the_quantile_and_not_on_the_mean():
    """Latency per bucket with 15% of the canary's requests 2.5 times slower: p90 far past a 25% band, the mean
    within it. The quantile's batch means show it worse; the mean's do not."""
    rng = np.random.default_rng(1)
    qs, qc, ms, mc = [], [], [], []
    for _ in range(20):
        s = rng.lognormal(math.log(200), 0.2, 200)
        c = rng.lognormal(math.log(200), 0.2, 200) * np.where(rng.random(200) < 0.15, 2.5, 1.0)
        for arr, out_q, out_m in ((s, qs, ms), (c, qc, mc)):
            out_q.append(hist_quantile(np.bincount([keys.latency_bin(round(v)) for v in arr], minlength=58), 0.9))
            out_m.append(arr.mean())
    band_q, band_m = 0.25 * np.mean(qs), 0.25 * np.mean(ms)
    q = MetricTest("latency_p90", tau=band_q, direction=-1, margin=band_q, harm_margin=band_q, bernoulli=False)
    m = MetricTest("latency", tau=band_m, direction=-1, margin=band_m, harm_margin=band_m, bernoulli=False)
    look_quantiles(q, qc, qs, min_batches=5)
    look_quantiles(m, mc, ms, min_batches=5)
    assert q.p_harm < 0.01 and m.p_harm > 0.05, (q.p_harm, m.p_harm)


def test_the_latency_quantile_is_calibrated_under_autocorrelated_node_load():
    """A/A canaries whose nodes' load is autocorrelated (``simulate_latency_quantile``): the p90 test shows none
    worse beyond its band more often than alpha, within two binomial standard errors, and it finds a slow tail the
    mean's test misses."""
    runs = 60
    r = simulate_latency_quantile(("none", "tail: 12% of requests 3x slower"), runs=runs, seed=2)
    rows = {(x["effect"], x["test"]): x for x in r["rows"]}
    assert rows[("none", "quantile")]["worse"] <= _slack(0.05, runs)
    assert rows[("none", "quantile")]["within"] > 0.9  # and an equal candidate is shown within the band
    tail_q, tail_m = (
        rows[("tail: 12% of requests 3x slower", "quantile")],
        rows[("tail: 12% of requests 3x slower", "mean")],
    )
    assert tail_q["true_change"] > 0.25 > tail_m["true_change"]
    assert tail_q["worse"] > 0.5 and tail_q["worse"] > tail_m["worse"] + 0.3
