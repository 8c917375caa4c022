"""The user-unit estimator under heavy users: Zipf-like activity whose top user sends a fifth of the traffic, three
segments of users accepting 0.75 / 0.40 / 0.10 with per-user spread. Rates are checked against binomial bounds."""

from __future__ import annotations

import math

import numpy as np

from deploy.gate.canary_sim import simulate_sticky
from deploy.gate.sequential import t_widened
from deploy.gate.sequential_units import UnitSums, _covariate, unit_estimate

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
