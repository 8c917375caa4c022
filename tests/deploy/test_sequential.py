"""The canary's always-valid sequential test (deploy.gate.sequential): its statistic, its decisions and its error rate,
on the unit the canary actually randomises (sticky users) as well as on requests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.config import GateConfig
from deploy.gate.canary_sim import assign, simulate_budget, simulate_sticky
from deploy.gate.sequential import (
    ABORT,
    BETTER,
    CONTINUE,
    FUTILITY_Z,
    PROMOTE,
    UNDECIDED,
    WORSE,
    Canary,
    MetricTest,
    bernoulli_estimate,
    futile,
    log_mixture_lr,
    look_units,
    t_widened,
)
from deploy.gate.sequential_batches import batch_means, look_batches
from deploy.gate.sequential_units import UnitSums, unit_estimate
from deploy.gate.srm import MATCH, MISMATCH, SrmTest


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


def test_events_one_at_a_time_agree_with_a_stack_of_looks():
    """``MetricTest.add`` (the per-event path) and ``MetricTest.look`` on all looks at once (what the calibration
    does) reach the same state and make the same call at the same event."""
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
    nc, xc = np.cumsum(to_canary), np.cumsum(accept & to_canary)
    ns, xs = np.arange(1, n + 1) - nc, np.cumsum(accept & ~to_canary)
    stacked = MetricTest("acceptance", min_events=50)
    pass_, harm = stacked.look(*bernoulli_estimate(nc, xc, ns, xs), np.minimum(nc, ns) >= 50)
    assert int(np.nonzero(pass_ >= math.log(20))[0][0]) + 1 == first[1]
    assert stacked.max_log_lr_pass == pytest.approx(t.max_log_lr_pass)
    assert stacked.max_log_lr_harm == pytest.approx(t.max_log_lr_harm) or t.max_log_lr_harm == -math.inf


def _users(rng, k: int, rates, events: float = 40.0, pre: float = 200.0):
    """k users with acceptance ``rates`` and log-normal activity: (num, den, pre-rollout rate, pre-rollout events)."""
    w = rng.lognormal(0.0, 1.0, k)
    den = rng.poisson(events * w)
    num = rng.binomial(den, rates)
    pre_n = rng.poisson(pre * w)
    pre_x = rng.binomial(pre_n, rates)
    cov = np.where(pre_n > 0, pre_x / np.maximum(pre_n, 1), np.nan)
    return num, den, cov, pre_n


def test_the_delta_method_variance_is_the_jackknifes_when_each_user_has_one_event():
    """Users alike (one event each): the ratio is a plain mean, and its variance (CR3) the jackknife's scaled by
    n / (n - 1): the sample variance over n - 1."""
    rng = np.random.default_rng(3)
    x_c, x_s = rng.random(40), rng.random(60)
    est = unit_estimate(UnitSums(x_c, np.ones(40)), UnitSums(x_s, np.ones(60)))
    assert float(est.d) == pytest.approx(x_c.mean() - x_s.mean())
    assert float(est.var) == pytest.approx(x_c.var(ddof=1) / 39 + x_s.var(ddof=1) / 59)
    jack = np.array([np.delete(x_c, i).mean() for i in range(40)])  # leave one user out
    jackknife = 39 / 40 * np.sum((jack - jack.mean()) ** 2)
    assert float(unit_estimate(UnitSums(x_c, np.ones(40)), UnitSums(x_c, np.ones(40))).var) / 2 == pytest.approx(
        40 / 39 * jackknife
    )
    assert (int(est.users_canary), int(est.users_stable)) == (40, 60)


def test_the_delta_method_variance_matches_a_bootstrap_over_users():
    """Users of very different rates and activity: the delta method's variance of the ratio difference agrees with
    resampling whole users (the bootstrap of the clustered design), and the per-event variance is far below both."""
    rng = np.random.default_rng(4)
    k = 300
    rates = np.where(rng.random(k) < 0.5, 0.7, 0.25)
    num, den, _, _ = _users(rng, k, rates)
    on = rng.random(k) < 0.5
    c, s = UnitSums(num[on], den[on]), UnitSums(num[~on], den[~on])
    est = unit_estimate(c, s)
    boot = []
    for _ in range(2000):
        ic, is_ = rng.integers(0, on.sum(), on.sum()), rng.integers(0, (~on).sum(), (~on).sum())
        boot.append(num[on][ic].sum() / den[on][ic].sum() - num[~on][is_].sum() / den[~on][is_].sum())
    assert float(est.var) == pytest.approx(np.var(boot), rel=0.15)
    _, per_event = bernoulli_estimate(den[on].sum(), num[on].sum(), den[~on].sum(), num[~on].sum())
    assert per_event < float(est.var) / 5  # what the old per-event test believed


def test_cuped_removes_the_variance_the_covariate_predicts_and_never_biases():
    """Over many assignments of one population: CUPED's estimate is centred on 0 in A/A, its spread is far smaller
    than the plain estimate's when the covariate predicts the users, its reported variance matches its spread, and a
    covariate that predicts nothing changes little."""
    rng = np.random.default_rng(5)
    k = 400
    rates = rng.beta(2, 2, k)
    num, den, cov, pre_n = _users(rng, k, rates)
    noise_cov = rng.random(k)  # predicts nothing
    d_raw, d_cuped, v_cuped, removed, d_noise = [], [], [], [], []
    for _ in range(400):
        on = rng.random(k) < 0.5
        c, s = UnitSums(num[on], den[on], cov[on], pre_n[on]), UnitSums(num[~on], den[~on], cov[~on], pre_n[~on])
        plain, adj = unit_estimate(c, s), unit_estimate(c, s, cuped=True)
        d_raw.append(float(plain.d))
        d_cuped.append(float(adj.d))
        v_cuped.append(float(adj.var))
        removed.append(float(adj.cuped_removed))
        n = unit_estimate(
            UnitSums(num[on], den[on], noise_cov[on]), UnitSums(num[~on], den[~on], noise_cov[~on]), cuped=True
        )
        d_noise.append(float(n.d))
    sd = np.std(d_cuped)
    assert abs(np.mean(d_cuped)) < 3 * sd / math.sqrt(len(d_cuped))  # unbiased
    assert np.var(d_cuped) < 0.3 * np.var(d_raw)
    assert np.median(removed) > 0.6
    assert np.mean(v_cuped) == pytest.approx(np.var(d_cuped), rel=0.25)
    assert abs(np.mean(d_noise)) < 3 * np.std(d_noise) / math.sqrt(len(d_noise))
    assert np.var(d_noise) == pytest.approx(np.var(d_raw), rel=0.2)


def test_a_user_without_a_covariate_is_imputed_and_cuped_needs_one():
    rng = np.random.default_rng(6)
    num, den, cov, pre_n = _users(rng, 200, rng.beta(2, 2, 200))
    cov[:30], pre_n[:30] = np.nan, 0  # new users: no history under stable
    c, s = (
        UnitSums(num[:100], den[:100], cov[:100], pre_n[:100]),
        UnitSums(num[100:], den[100:], cov[100:], pre_n[100:]),
    )
    est = unit_estimate(c, s, cuped=True)
    assert math.isfinite(float(est.d)) and 0 < float(est.var) < float(est.var_raw)
    with pytest.raises(ValueError, match="covariate"):
        unit_estimate(UnitSums(num, den), UnitSums(num, den), cuped=True)


def test_a_covariate_every_user_shares_leaves_the_estimate_as_without_cuped():
    """Every user's history the same (a young deployment: two judgements each, one kept): CUPED has nothing to
    regress on and must change nothing. It gave a NaN variance (0/0 in the leverage), and a canary that never
    decided."""
    rng = np.random.default_rng(8)
    num, den, _, _ = _users(rng, 200, rng.beta(2, 2, 200))
    flat = np.full(100, 0.5), np.full(100, 2.0)
    c, s = UnitSums(num[:100], den[:100], *flat), UnitSums(num[100:], den[100:], *flat)
    with_cuped, without = unit_estimate(c, s, cuped=True), unit_estimate(c, s)
    assert float(with_cuped.var) == pytest.approx(float(without.var), rel=1e-9)
    assert float(with_cuped.d) == pytest.approx(float(without.d)) and float(with_cuped.cuped_removed) == 0.0


def test_a_stack_of_looks_is_the_gate_looking_at_each_in_turn():
    """``look_units`` on a whole canary's looks at once (the calibration) and look by look (the gate): same
    running maxima, same verdict, and its arms show the ratios."""
    rng = np.random.default_rng(8)
    k, looks = 120, 30
    rates = np.where(rng.random(k) < 0.5, 0.7, 0.25)
    _, _, cov, pre_n = _users(rng, k, rates)
    steps = rng.poisson(np.outer(np.ones(looks), 3 * rng.lognormal(0, 1, k)))
    den = steps.cumsum(0).astype(float)
    num = rng.binomial(steps, np.clip(rates + 0.1 * (np.arange(k) < 60), 0, 1)).cumsum(0).astype(float)
    arms = (slice(0, 60), slice(60, k))
    for cuped in (False, True):
        whole = MetricTest("acceptance", min_events=50)
        out = look_units(whole, *(UnitSums(num[:, a], den[:, a], cov[a], pre_n[a]) for a in arms), cuped=cuped)
        one = MetricTest("acceptance", min_events=50)
        for t in range(looks):
            last = look_units(one, *(UnitSums(num[t, a], den[t, a], cov[a], pre_n[a]) for a in arms), cuped=cuped)
        assert one.max_log_lr_pass == pytest.approx(whole.max_log_lr_pass)
        assert one.verdict() == whole.verdict() == out["verdict"] == last["verdict"]
        assert out["per_look"]["max_log_lr_pass"][-1] == pytest.approx(whole.max_log_lr_pass)
        assert last["canary_mean"] == pytest.approx(num[-1, :60].sum() / den[-1, :60].sum())
        assert last["canary_users"] == 60 and "per_look" not in last


def test_few_users_widen_the_variance_and_many_leave_it():
    assert float(t_widened(1.0, 4)) > float(t_widened(1.0, 20)) > 1.0
    assert float(t_widened(1.0, 4, t=6.0)) > float(t_widened(1.0, 4, t=3.0))  # the t's tail is heavier further out
    assert float(t_widened(1.0, np.inf)) == 1.0 and float(t_widened(1.0, 1e6)) == pytest.approx(1.0, abs=1e-4)
    # Wallace's normal equivalent against the t's exact tail (a numerical integral of its density)
    for df in (4, 9, 30):
        for t in (2.0, 3.0, 5.0):
            x = np.linspace(t, 2000.0, 2_000_001)
            dens = (
                math.gamma((df + 1) / 2)
                / (math.sqrt(df * math.pi) * math.gamma(df / 2))
                * (1 + x * x / df) ** (-(df + 1) / 2)
            )
            tail = float(np.sum((dens[1:] + dens[:-1]) / 2 * np.diff(x)))
            z = t / math.sqrt(float(t_widened(1.0, df, t)))
            assert 0.5 * math.erfc(z / math.sqrt(2)) == pytest.approx(tail, rel=0.1), (df, t)


def test_sticky_users_break_the_per_event_test_and_not_the_user_unit_test():
    """The CI calibration (the full one is ``liverl bench canary``): A/A canaries on 48 sticky users in the demo's
    two segments, assigned by the router's bucket, looked at every 10 s. The user-unit test, with and without CUPED,
    stays within alpha (a binomial allowance for 300 runs); the per-event variance on the same canaries decides most
    of them, so this test fails if the variance is ever computed per event again."""
    res = simulate_sticky("segments", 48, effects=(0.0,), runs=300, deadline_s=900.0, pre_s=900.0, seed=20)
    aa = res["effects"][0.0]
    false = {s: aa[s]["promoted"] + aa[s]["aborted"] for s in ("user", "user+cuped", "event, sticky users")}
    # 300 runs: a true rate of 5% exceeds 9% with probability < 1%
    assert false["user"] <= 0.09 and false["user+cuped"] <= 0.09, false
    assert false["event, sticky users"] >= 0.5, false
    assert aa["srm"] == 0.0


def test_the_user_unit_test_with_cuped_finds_three_points_on_the_demo_population():
    res = simulate_sticky("segments", 48, effects=(0.03, -0.03), runs=40, deadline_s=1800.0, seed=21)
    assert res["effects"][0.03]["user+cuped"]["promoted"] >= 0.8, res["effects"][0.03]
    assert res["effects"][-0.03]["user+cuped"]["aborted"] >= 0.8, res["effects"][-0.03]
    assert res["effects"][0.03]["user+cuped"]["aborted"] == 0.0
    assert res["effects"][0.03]["cuped_removed"] > 0.9


def test_assignment_is_the_routers_bucket_and_moves_with_the_rollout():
    a, b = assign(b"k", 1, 2000, 0.5), assign(b"k", 2, 2000, 0.5)
    assert 0.45 < a.mean() < 0.55 and 0.4 < (a != b).mean() < 0.6  # each rollout draws its arms afresh
    from core.fleet import bucket

    assert bool(a[17]) == (bucket(b"k", 1, "sim-user-17") < 0.5)


def _srm(share_seen: float, users: int, seed: int, share: float = 0.5) -> SrmTest:
    rng = np.random.default_rng(seed)
    on = rng.random(users) < share_seen
    den = rng.poisson(20 * rng.lognormal(0, 1, users)) + 1
    test = SrmTest(share, alpha=0.001)
    test.look_units(UnitSums(np.zeros(on.sum()), den[on]), UnitSums(np.zeros((~on).sum()), den[~on]))
    return test


def test_srm_flags_a_45_55_split_of_a_50_50_rollout_and_not_a_true_one():
    assert _srm(0.45, 6000, 1).verdict() == MISMATCH
    assert _srm(0.45, 6000, 1).p_users < 1e-4
    assert all(_srm(0.5, 6000, seed).verdict() == MATCH for seed in range(5))
    assert _srm(0.2, 3000, 2, share=0.2).verdict() == MATCH
    assert _srm(0.25, 3000, 2, share=0.2).verdict() == MISMATCH


def test_srm_on_events_is_cluster_aware():
    """Users split as configured, but the canary's users log a fifth fewer events (its logging is broken): the event
    test sees it. Heavy users alone (few users, one of them huge) do not make it fire."""
    rng = np.random.default_rng(9)
    k = 20_000
    on = rng.random(k) < 0.5
    den = rng.poisson(30 * rng.lognormal(0, 1, k)) + 1
    lost = np.where(on, rng.binomial(den, 0.8), den)
    t = SrmTest(0.5)
    out = t.look_units(UnitSums(np.zeros(on.sum()), lost[on]), UnitSums(np.zeros((~on).sum()), lost[~on]))
    assert out["verdict"] == MISMATCH and t.p_events < 1e-4 and t.p_users > 0.01
    lumpy = SrmTest(0.5)
    lumpy.look_units(UnitSums(np.zeros(20), np.r_[5000.0, np.ones(19)]), UnitSums(np.zeros(20), np.ones(20) * 10))
    assert lumpy.verdict() == MATCH  # one heavy user on the canary is chance, not a broken split


def test_srm_is_always_valid_when_looked_at_often():
    """A/A at a loose alpha (0.05, so the simulation can see it): 400 rollouts of 3,000 users, counts looked at every
    30 users; false alarms stay within alpha."""
    rng = np.random.default_rng(10)
    alarms = 0
    for _ in range(400):
        on = rng.random(3000) < 0.3
        n = np.arange(30, 3001, 30)
        x = np.cumsum(on)[n - 1]
        t = SrmTest(0.3, alpha=0.1)  # users at alpha / 2 = 0.05
        t.look_requests(x, n - x)
        alarms += t.p_events <= 0.05
    assert alarms / 400 <= 0.07


def _ar1(rng, shape, phi: float, sd: float) -> np.ndarray:
    """AR(1) series along the last axis: a node's load, correlated from one request to the next."""
    x = np.zeros(shape)
    e = rng.normal(0, sd, shape)
    for i in range(1, shape[-1]):
        x[..., i] = phi * x[..., i - 1] + e[..., i]
    return x


def test_batch_means_are_calibrated_on_autocorrelated_latency():
    """Latency whose requests are autocorrelated (each node's load) under a load both arms share: the paired batch
    means give a statistic of unit spread, where treating requests as independent overstates the evidence; a real
    slowdown is found."""
    rng = np.random.default_rng(11)
    reps, batches, per = 300, 40, 50
    common = np.repeat(np.cumsum(rng.normal(0, 0.05, (reps, batches)), -1), per, -1)  # the fleet's load
    lat_c = 1.0 + common + _ar1(rng, (reps, batches * per), 0.9, 0.05) + rng.normal(0, 0.02, (reps, batches * per))
    lat_s = 1.0 + common + _ar1(rng, (reps, batches * per), 0.9, 0.05) + rng.normal(0, 0.02, (reps, batches * per))
    z_batch, z_naive = [], []
    for c, s in zip(lat_c, lat_s, strict=True):
        d, var, df = batch_means(c.reshape(batches, per).mean(1), s.reshape(batches, per).mean(1))
        z_batch.append(d / math.sqrt(var))
        assert df == batches - 1
        z_naive.append((s.mean() - c.mean()) / math.sqrt(c.var() / c.size + s.var() / s.size))
    assert 0.75 < np.std(z_batch) < 1.15 and abs(np.mean(z_batch)) < 0.2
    assert np.std(z_naive) > 2  # requests taken as independent: a variance several times too small
    slower = MetricTest("latency", tau=0.1, direction=-1, bernoulli=False, harm_margin=0.05, margin=0.05)
    c = 1.2 + rng.normal(0, 0.05, 40)
    s = 1.0 + rng.normal(0, 0.05, 40)
    out = look_batches(slower, c, s)
    assert slower.verdict() == WORSE and out["batches"] == 40 and out["verdict"] == WORSE
    assert batch_means(c[:5], s[:5]) is None
    with pytest.raises(ValueError, match="min_batches"):
        batch_means(c, s, min_batches=1)


def test_a_fixed_margin_is_the_null_at_every_look():
    """A guardrail's margin is absolute and set once: looks never move it (the gate computes it from stable's
    pre-rollout mean at the canary's start)."""
    rng = np.random.default_rng(12)
    length = MetricTest(
        "response_length",
        tau=5.0,
        direction=-1,
        bernoulli=False,
        margin=10.0,
        harm_margin=10.0,
        min_events=1,
        min_units=2,
    )
    k = 200
    for look in range(1, 6):
        den = np.full(k, look * 5.0)
        num = den * rng.normal(100 + 5 * look, 3, k)  # stable's mean drifts up; the canary's with it
        look_units(length, UnitSums(num[:100], den[:100]), UnitSums(num[100:], den[100:]))
        assert (length.margin, length.harm_margin) == (10.0, 10.0)
    assert length.verdict() == BETTER  # not worse by 10 tokens


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
    watched = Canary(MetricTest("acceptance"), [MetricTest("latency", margin=0.05, required=False)])
    _feed(watched.success, rng, 0.65, 0.50, 6000)  # the watched guardrail has no evidence: a promotion does not wait
    verdict, why = watched.verdict()
    assert verdict == PROMOTE and "latency: not shown worse" in why
    _feed(watched.guardrails[0], rng, 0.50, 0.80, 6000)  # but shown worse, it still aborts
    assert watched.verdict()[0] == ABORT
    early = Canary(MetricTest("acceptance"), [MetricTest("kept", margin=0.02)])
    assert early.verdict() == (CONTINUE, "collecting evidence")
    verdict, why = early.verdict(deadline_passed=True)
    assert verdict == ABORT and "deadline" in why
    # the reason names each undecided test with the p-value it ended at, against its alpha (what on-call reads)
    assert "acceptance undecided (p 1 against 0.05)" in why, why
    assert "guardrail kept not shown non-inferior (p 1 against 0.05)" in why, why


def test_futility_needs_a_quarter_of_the_budget_and_a_hopeless_estimate():
    """``futile``: a canary as good as stable is not stopped; one whose estimate sits at the margin's
    null with half the budget spent is; no stop before a quarter of the budget, whatever the estimate."""
    tau, alpha, theta0 = 0.03, 0.05, -0.03
    se = 0.01
    assert not futile(0.0, se**2, 0.5, theta0, tau, alpha)  # as good as stable: it may still pass by the budget
    assert futile(-0.03, se**2, 0.5, theta0, tau, alpha)  # at the null: even 1 se better cannot pass
    assert futile(-0.05, se**2, 0.5, theta0, tau, alpha, z=1.0)
    assert not futile(-0.05, se**2, 0.2, theta0, tau, alpha)  # too early to say
    assert not futile(float("nan"), se**2, 0.5, theta0, tau, alpha)
    more = futile(np.full(3, -0.02), np.full(3, se**2), np.array([0.3, 0.6, 0.9]), theta0, tau, alpha, z=1.0)
    assert more.dtype == bool and more.shape == (3,) and list(more) == sorted(more)  # later looks: more often futile
    t = MetricTest("acceptance", margin=0.03, min_events=10, min_units=2)
    assert not t.futile(0.9)  # nothing measured yet
    t.look(-0.04, se**2)
    assert t.futile(0.9) and not t.futile(0.1)


def test_the_canary_aborts_as_futile_only_with_a_budget_left_and_never_once_shown_better():
    def canary(d):
        c = Canary(MetricTest("acceptance", margin=0.03, min_events=10, min_units=2))
        c.success.look(d, 0.01**2)
        return c

    verdict, why = canary(-0.025).verdict(spent=0.5, futility_z=1.0)
    assert verdict == ABORT and why.startswith("futile with 50% of the evidence budget spent: acceptance cannot be ")
    assert canary(-0.025).verdict(spent=0.5)[0] == CONTINUE  # no futility_z: no futility stop
    assert canary(-0.025).verdict()[0] == CONTINUE  # no budget
    verdict, why = canary(-0.025).verdict(deadline_passed=True, spent=1.0, futility_z=1.0)
    assert verdict == ABORT and why.startswith("deadline passed")  # a spent budget says so, not "futile"
    assert canary(0.05).verdict(spent=0.9, futility_z=5.0)[0] == PROMOTE


def test_the_futility_stop_saves_evidence_and_costs_little_power_in_the_demos_world():
    """``simulate_budget`` (``liverl bench canary --budget``): a non-inferiority canary with the demo's budget,
    sticky users at the plateau's acceptance, with and without the stop. It never promotes what the budget alone
    would not; it spends less on a candidate at the margin's null; it loses few promotions of one as good as stable."""
    z = GateConfig().canary_futility_z
    assert z == FUTILITY_Z  # the gate's default is the function's
    r = simulate_budget(n_users=2000, runs=60, effects=(0.0, -0.03), futility_z=(None, z), events_per_s=60.0)
    rows = {(row["effect"], row["futility_z"]): row for row in r["rows"]}
    assert rows[(-0.03, z)]["promoted"] <= rows[(-0.03, None)]["promoted"] <= 0.1
    assert rows[(-0.03, z)]["mean_events"] < 0.85 * rows[(-0.03, None)]["mean_events"]
    assert rows[(-0.03, z)]["futile"] > 0.3
    assert rows[(0.0, z)]["promoted"] >= rows[(0.0, None)]["promoted"] - 0.05
    assert rows[(0.0, None)]["futile"] == rows[(-0.03, None)]["futile"] == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        MetricTest("a", alpha=1.5)
    with pytest.raises(ValueError, match="finite"):
        MetricTest("a").add("canary", float("nan"))
    with pytest.raises(ValueError, match="arm"):
        MetricTest("a").add("both", 1.0)
    with pytest.raises(ValueError, match="one shape"):
        UnitSums(np.zeros(3), np.ones(4))
    with pytest.raises(ValueError, match="den >= 0"):
        UnitSums(np.zeros(3), -np.ones(3))
    with pytest.raises(ValueError, match="numerator"):
        _ = UnitSums(np.ones(3), np.zeros(3)).moments
    with pytest.raises(ValueError, match="one value per user"):
        UnitSums(np.zeros(3), np.ones(3), cov=np.zeros(2))
    with pytest.raises(ValueError, match="share"):
        SrmTest(1.5)
    with pytest.raises(ValueError, match="share"):
        simulate_sticky(share=1.5, runs=1)
    with pytest.raises(ValueError, match="population"):
        simulate_sticky("uniform", runs=1)


def test_latency_at_equal_answer_length_does_not_read_the_arms_user_mix_as_the_versions():
    """Users stay on their arm: one with long answers on the canary arm makes it slower in every bucket, and the
    paired batch means read that as the version's latency. Regressed on the buckets' difference in mean answer
    length, the test is at equal length: an A/A of such arms is calibrated, and a slower serving path (more ms per
    token) is still found."""
    rng = np.random.default_rng(21)
    reps, batches, per_token = 400, 40, 2.0

    def arms(slowdown: float):
        gap = 40.0 + rng.normal(0, 15, (reps, batches))  # the canary's heavy user: 40 more tokens an answer
        load = rng.normal(0, 5, (reps, batches))  # shared by both arms in a bucket
        c = 100 + (per_token + slowdown) * (200 + gap) + load + rng.normal(0, 10, (reps, batches))
        s = 100 + per_token * 200 + load + rng.normal(0, 10, (reps, batches))
        return c, s, gap

    c, s, gap = arms(0.0)
    z_plain, z_equal = [], []
    for ci, si, gi in zip(c, s, gap, strict=True):
        d, var, df = batch_means(ci, si)
        z_plain.append(d / math.sqrt(var))
        d, var, df = batch_means(ci, si, covariate=gi)
        z_equal.append(d / math.sqrt(var))
        assert df == batches - 2
    # lower is better (direction -1): the plain test sees a slower canary in every A/A
    assert np.mean(np.array(z_plain) < -1.645) > 0.99
    assert 0.8 < np.std(z_equal) < 1.25 and abs(np.mean(z_equal)) < 0.2
    assert np.mean(np.array(z_equal) < -1.645) < 0.09
    c, s, gap = arms(0.5)  # 25% more ms per token
    slower = MetricTest("latency", tau=50, direction=-1, bernoulli=False, harm_margin=60, margin=60)
    out = look_batches(slower, c[0], s[0], covariate=gap[0])
    assert out["at_equal_length"] and out["batches"] == batches and slower.verdict() == WORSE
    # no spread in the covariate: the plain batch means
    assert batch_means(c[0], s[0], covariate=np.full(batches, 3.0))[2] == batches - 1
    with pytest.raises(ValueError, match="covariate"):
        batch_means(c[0], s[0], covariate=gap[0][:5])
