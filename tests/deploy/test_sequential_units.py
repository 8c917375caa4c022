"""The user-unit estimator under heavy users: Zipf-like activity whose top user sends a fifth of the traffic, three
segments of users accepting 0.75 / 0.40 / 0.10 with per-user spread. Rates are checked against binomial bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy.gate.canary_sim import simulate_sticky
from deploy.gate.sequential import MetricTest, look_units, t_widened
from deploy.gate.sequential_units import UnitSums, _covariate, cap_users, unit_estimate

VARIANCE_FACTOR = 4.0
"""The most the corrected CUPED variance may exceed the plain delta-method variance (no CUPED, no leverage
correction) by, in these worlds."""


def zipf_world(rng: np.random.Generator, share: float, n: int = 300, events: int = 20_000, pre: int = 20_000):
    """One A/A canary: ``n`` users of Zipf(1.1) activity (the top user about a fifth of all traffic), three segments,
    ``events`` judged events in the rollout and ``pre`` before it (each user's covariate)."""
    w = 1.0 / np.arange(1, n + 1) ** 1.1
    w = rng.permutation(w / w.sum())
    segment = rng.choice(np.array([0.75, 0.40, 0.10]), n)
    p = rng.beta(20 * segment, 20 * (1 - segment))
    on = rng.random(n) < share
    den = rng.multinomial(events, w)
    num = rng.binomial(den, p)
    pre_n = rng.multinomial(pre, w)
    cov = np.where(pre_n > 0, rng.binomial(pre_n, p) / np.maximum(pre_n, 1), np.nan)
    arms = [on & (den > 0), ~on & (den > 0)]
    return [UnitSums(num[a], den[a], cov[a], pre_n[a]) for a in arms]


def summed_leverage(canary: UnitSums, stable: UnitSums) -> float:
    """The largest ``h_u + Z_u^2 / sum(Z^2)``: the ratio's leverage plus the slope's, added."""
    mc, ms = canary.moments, stable.moments
    zc, zs = _covariate(canary, mc), _covariate(stable, ms)
    zz = zc["zz"] + zs["zz"]
    return max(float((m["lev"] + z["z"] ** 2 / zz).max()) for m, z in ((mc, zc), (ms, zs)))


def plain_delta_variance(canary: UnitSums, stable: UnitSums) -> float:
    return sum(float((m["lin"] ** 2).sum() / m["n"] ** 2) for m in (canary.moments, stable.moments))


def binomial_max(n: int, p: float, z: float = 3.09) -> int:
    """The count a Binomial(n, p) stays under with probability about 0.999 (normal approximation)."""
    return math.ceil(n * p + z * math.sqrt(n * p * (1 - p)))


def test_a_heavy_users_leverage_past_one_leaves_the_variance_finite_and_bounded():
    """When one user sends a fifth of the traffic, its share of its arm's events plus its share of CUPED's covariate
    spread passes 1 in about a tenth of canaries. Each such canary's variance stays finite and within
    ``VARIANCE_FACTOR`` of the plain delta method's."""
    rng = np.random.default_rng(46)
    past_one = 0
    for _ in range(400):
        canary, stable = zipf_world(rng, share=0.2)
        if summed_leverage(canary, stable) < 1.0:
            continue
        past_one += 1
        est = unit_estimate(canary, stable, cuped=True)
        assert math.isfinite(float(est.var)) and est.var > 0
        assert est.var <= VARIANCE_FACTOR * plain_delta_variance(canary, stable)
        assert 0.0 < est.cuped_removed < 1.0 and math.isfinite(float(est.df))
    assert past_one >= 10  # the worlds do exercise a leverage past 1


def test_cuped_under_heavy_users_is_calibrated_at_a_fixed_horizon():
    """An A/A under Zipf activity: the CUPED estimate's variance is not below its spread across canaries, and a
    two-sided 5% test on it (Student t, the gate's widening) rejects at most at 5% (binomial bound)."""
    rng = np.random.default_rng(7)
    runs = 1500
    d, var, reject = np.empty(runs), np.empty(runs), 0
    for i in range(runs):
        est = unit_estimate(*zipf_world(rng, share=0.5), cuped=True)
        d[i], var[i] = float(est.d), float(est.var)
        t = est.d / math.sqrt(est.var)
        reject += abs(est.d) / math.sqrt(float(t_widened(est.var, est.df, t))) > 1.96
    assert np.mean(var) >= 0.9 * np.var(d)
    assert reject <= binomial_max(runs, 0.05), reject / runs


def test_the_user_unit_test_with_cuped_is_calibrated_and_sees_three_points_under_zipf_activity():
    """The gate's own per-look code (``look_units``) in the heavy-tailed world: A/A false decisions at most alpha,
    and a +3-point candidate promoted in at least 80% of canaries (binomial bounds)."""
    runs = 150
    res = simulate_sticky("segments3", 1000, effects=(0.0, 0.03), runs=runs, activity="zipf(1.1)", seed=3)
    aa, ab = res["effects"][0.0]["user+cuped"], res["effects"][0.03]["user+cuped"]
    assert (aa["promoted"] + aa["aborted"]) * runs <= binomial_max(runs, 0.05)
    assert ab["promoted"] * runs >= runs * 0.8 - 3.09 * math.sqrt(runs * 0.8 * 0.2)
    assert res["effects"][0.0]["srm"] * runs <= binomial_max(runs, 0.001)


def test_capping_heavy_users_keeps_their_rates_and_counts_their_events_in_full():
    """``cap_users``: a user above the pooled quantile of events counts as that many, with its rate unchanged, on
    both arms alike; the covariate's weights are capped at their own quantile; ``look_units`` still counts every
    event for ``min_events`` and the arms' totals."""
    rng = np.random.default_rng(31)
    den_c = np.concatenate([[5000.0], rng.integers(1, 20, 99).astype(float)])
    den_s = np.concatenate([[3000.0], rng.integers(1, 20, 199).astype(float)])
    num_c, num_s = np.round(0.4 * den_c), np.round(0.4 * den_s)
    cov_c, cov_s = rng.uniform(0.2, 0.6, 100), rng.uniform(0.2, 0.6, 200)
    canary = UnitSums(num_c, den_c, cov_c, den_c * 2)
    stable = UnitSums(num_s, den_s, cov_s, den_s * 2)
    cc, cs = cap_users(canary, stable, 0.99)
    cap = np.quantile(np.concatenate([den_c, den_s]), 0.99)
    assert cc.den.max() == pytest.approx(cap) and cs.den.max() == pytest.approx(cap)
    assert np.allclose(cc.num / cc.den, num_c / den_c) and np.allclose(cs.num / cs.den, num_s / den_s)
    assert np.array_equal(cc.den[1:][den_c[1:] <= cap], den_c[1:][den_c[1:] <= cap])  # the rest untouched
    assert cc.cov_den.max() == pytest.approx(np.quantile(np.concatenate([den_c, den_s]) * 2, 0.99))
    # the heavy user no longer carries most of its arm's weight
    assert unit_estimate(cc, cs, cuped=True).df > unit_estimate(canary, stable, cuped=True).df
    # a stack of looks caps each look at its own quantile; a look with no user seen has no cap
    stack_c = UnitSums(np.stack([num_c * 0, num_c]), np.stack([den_c * 0, den_c]))
    stack_s = UnitSums(np.stack([num_s * 0, num_s]), np.stack([den_s * 0, den_s]))
    sc, ss = cap_users(stack_c, stack_s, 0.99)
    assert np.all(sc.den[0] == 0) and sc.den[1].max() == pytest.approx(cap)
    test = MetricTest("acceptance", tau=0.03, min_events=100, min_units=10)
    out = look_units(test, canary, stable, cuped=True, user_cap=0.99)
    assert test.canary.n == int(den_c.sum()) and test.stable.n == int(den_s.sum()) and out["ready"]
