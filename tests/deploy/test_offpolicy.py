"""Off-policy estimates of a candidate's acceptance from logged feedback (deploy.offpolicy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy.offpolicy import compare, snis


def _bandit(rng, n: int, p_behaviour: float, p_target: float):
    """Two completions per prompt: A is accepted, B is not. Logged by a behaviour policy that picks A with
    ``p_behaviour``; the target picks A with ``p_target`` (true acceptance ``p_target``)."""
    pick_a = rng.random(n) < p_behaviour
    lb = np.where(pick_a, math.log(p_behaviour), math.log(1 - p_behaviour))
    lt = np.where(pick_a, math.log(p_target), math.log(1 - p_target))
    return lt, lb, pick_a.astype(float)


def test_on_policy_the_estimate_is_the_plain_mean_with_every_sample_effective():
    rng = np.random.default_rng(0)
    lp = rng.normal(-5, 2, 1000)
    r = (rng.random(1000) < 0.4).astype(float)
    e = snis(lp, lp, r)
    assert e.value == pytest.approx(r.mean()) and e.ess == pytest.approx(1000) and e.clipped == 0
    assert e.lower < e.value < e.upper and e.std_error == pytest.approx(math.sqrt(r.var() / 1000), rel=1e-6)


def test_the_estimate_finds_the_targets_acceptance_and_its_interval_covers_it():
    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(200):
        e = snis(*_bandit(rng, 2000, 0.5, 0.7))
        covered += e.lower <= 0.7 <= e.upper
    assert covered >= 180  # 95% intervals: at least 90% coverage over 200 repeats
    e = snis(*_bandit(rng, 20000, 0.5, 0.7))
    assert e.value == pytest.approx(0.7, abs=0.02) and 0.5 * 20000 < e.ess < 20000


def test_a_worse_candidate_is_refused_a_better_one_passes_and_a_far_one_is_not_judged():
    rng = np.random.default_rng(2)
    lb_pick = _bandit(rng, 3000, 0.5, 0.5)
    lt_stable, lb, r = lb_pick
    pick_a = r > 0
    worse = np.where(pick_a, math.log(0.3), math.log(0.7))
    better = np.where(pick_a, math.log(0.7), math.log(0.3))
    c = compare(worse, lt_stable, lb, r)
    assert c.verdict == "refuse" and "below stable" in c.reason and c.stable.value == pytest.approx(r.mean())
    assert compare(better, lt_stable, lb, r).verdict == "pass"
    far = np.where(pick_a, 0.0, -40.0)  # near-deterministic: almost every weight clipped or ~0
    c = compare(far, lt_stable, lb, r, min_ess=2000)
    assert c.verdict == "insufficient" and "effective sample size" in c.reason
    assert snis(far, lb, r, clip=1.5).clipped == pytest.approx(pick_a.mean())


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same length"):
        snis([0.0, 1.0], [0.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        snis([float("nan")], [0.0], [1.0])
    with pytest.raises(ValueError, match="no logged"):
        snis([], [], [])
