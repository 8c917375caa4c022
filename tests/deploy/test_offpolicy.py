"""Off-policy estimates of a candidate's acceptance from logged feedback (deploy.gate.offpolicy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy.gate.offpolicy import ALPHA, compare, merge_heldout, snis


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
    assert c.verdict == "defer" and "effective sample size" in c.reason and "deferred to the canary" in c.reason
    assert snis(far, lb, r, clip=1.5).clipped == pytest.approx(pick_a.mean())


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same length"):
        snis([0.0, 1.0], [0.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        snis([float("nan")], [0.0], [1.0])
    with pytest.raises(ValueError, match="no logged"):
        snis([], [], [])


# --- the paired decision rule ---------------------------------------------------------------------------------------
# A/A: the candidate is exactly as good as stable, so every refusal is a false one. Over DRAWS draws the refusal rate
# must stay within ALPHA plus a binomial allowance of 3 standard errors (39 of 1,000 at alpha 0.025). The rule before
# this one (the candidate's upper bound against stable's estimate, taken as exact) refused 6% in the near-independent
# case below.

DRAWS = 1000
ALLOWED = ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / DRAWS)


def _product_rewards(rng, n: int) -> np.ndarray:
    """The default product's rewards: accept 0.75, reject -0.25, edit 0, reverted accept -1."""
    return rng.choice([0.75, -0.25, 0.0, -1.0], size=n, p=[0.5, 0.3, 0.1, 0.1])


def _refusals(make, n: int, seed: int, margin: float = 0.0) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    verdicts = [compare(*make(rng, n), margin=margin).verdict for _ in range(DRAWS)]
    return verdicts.count("refuse"), verdicts.count("defer")


def _aa_independent(rng, n):
    """Candidate and stable both moved off the logged behaviour, in opposite directions that do not touch the reward:
    equally good, and their weights nearly independent (the hardest A/A case for the rule's false refusals)."""
    lb, r, x = rng.normal(-20, 5, n), _product_rewards(rng, n), rng.normal(0, 1.0, n)
    return lb + x, lb - x, lb, r


def _aa_tiny(rng, n):
    """Candidate = stable plus a tiny independent perturbation of each log-prob (stable itself off the behaviour)."""
    lb, r = rng.normal(-20, 5, n), _product_rewards(rng, n)
    ls = lb + rng.normal(0, 0.5, n)
    return ls + rng.normal(0, 0.05, n), ls, lb, r


def _aa_small(rng, n):
    lb, r, x = rng.normal(-20, 5, n), _product_rewards(rng, n), rng.normal(0, 0.3, n)
    return lb + x, lb - x, lb, r


def test_an_identical_candidate_is_never_refused():
    rng = np.random.default_rng(20)
    for _ in range(200):
        lb, r = rng.normal(-20, 5, 300), _product_rewards(rng, 300)
        ls = lb + rng.normal(0, 0.5, 300)
        c = compare(ls, ls, lb, r, margin=0.0)
        assert c.verdict == "pass" and c.difference == 0.0 and c.std_error == 0.0


@pytest.mark.parametrize(
    "make,n",
    [(_aa_independent, 512), (_aa_tiny, 512), (_aa_small, 100)],
    ids=["near-independent", "tiny-perturbation", "small-slice"],
)
def test_an_equally_good_candidate_is_refused_at_most_alpha_of_the_time(make, n):
    refused, deferred = _refusals(make, n, seed=7)
    assert deferred <= DRAWS // 100  # the slices are large enough to be judged
    assert refused / DRAWS <= ALLOWED, f"{refused} false refusals in {DRAWS} A/A draws (alpha {ALPHA})"
    # and the margin only lowers it
    assert _refusals(make, n, seed=7, margin=0.02)[0] <= refused


K = 4  # completions per prompt in the contextual bandit below


def _bandit_world(rng, n: int, beta: float):
    """Prompts with K completions, each accepted with its own probability q (reward 0.75 if accepted, else -0.25).
    Stable leans towards the better completions; the candidate is stable moved away from them by ``beta`` (0: an
    equally good candidate, ~-0.05 of reward at 1.0), each with independent noise. Logged by the behaviour policy."""
    q = rng.random((n, K))
    logsm = lambda g: g - np.logaddexp.reduce(g, axis=1, keepdims=True)  # noqa: E731
    gb = rng.normal(0, 1, (n, K))
    gs = gb + rng.normal(0, 0.3, (n, K)) + (q - 0.5)
    gc = gs + rng.normal(0, 0.3, (n, K)) - beta * (q - 0.5)
    lb, ls, lc = logsm(gb), logsm(gs), logsm(gc)
    k = np.argmax(lb + rng.gumbel(size=(n, K)), axis=1)  # sampled from the behaviour policy
    i = np.arange(n)
    r = np.where(rng.random(n) < q[i, k], 0.75, -0.25)
    return (lc[i, k], ls[i, k], lb[i, k], r), float((np.exp(lc) * q).sum(1).mean() - (np.exp(ls) * q).sum(1).mean())


def test_a_truly_worse_candidate_is_refused_with_good_power():
    """Five points worse than stable (margin 2): refused in nearly every draw of 512 held-out samples, because pairing
    removes what the two estimates share. The unpaired rule refused it in under 1% of the draws."""
    rng = np.random.default_rng(21)
    verdicts, gaps = [], []
    for _ in range(300):
        sample, gap = _bandit_world(rng, 512, beta=1.0)
        verdicts.append(compare(*sample, margin=0.02).verdict)
        gaps.append(gap)
    assert -0.06 < np.mean(gaps) < -0.04
    assert verdicts.count("refuse") / len(verdicts) >= 0.9, verdicts.count("refuse")
    # the same world with an equally good candidate: within alpha
    rng = np.random.default_rng(22)
    same = [compare(*_bandit_world(rng, 512, beta=0.0)[0], margin=0.02).verdict for _ in range(300)]
    assert same.count("refuse") / len(same) <= ALLOWED


def test_an_effective_sample_size_below_the_minimum_defers_to_the_canary_whatever_the_estimate():
    """A candidate too far from the logged behaviour is not judged off-policy: neither refused nor passed."""
    rng = np.random.default_rng(23)
    lb, r = rng.normal(-20, 5, 400), _product_rewards(rng, 400)
    far = lb + rng.normal(0, 3.0, 400)
    for logp in (far, far + 2.0 * r):  # moved far, towards reward or not: the estimate would say "pass"
        c = compare(logp, lb, lb, r, min_ess=50)
        assert c.candidate.ess_unclipped < 50 and c.verdict == "defer" and "deferred to the canary" in c.reason
    ok = compare(lb + rng.normal(0, 0.2, 400), lb, lb, r, min_ess=50)
    assert ok.verdict == "pass" and ok.ess >= 50


def test_the_unclipped_effective_sample_size_is_reported_and_defers_when_clipping_flatters():
    """Clipping flattens the largest weights, so the clipped ESS can look healthy for a target that moved far: the
    unclipped one is reported beside it and below the minimum it defers."""
    rng = np.random.default_rng(24)
    lb, r = rng.normal(-20, 5, 1000), _product_rewards(rng, 1000)
    logp = lb + rng.normal(0, 2.5, 1000)
    e = snis(logp, lb, r, clip=3.0)
    assert e.ess_unclipped < 50 < e.ess  # clipped at 3: flattered
    c = compare(logp, lb, lb, r, clip=3.0, min_ess=50)
    assert c.verdict == "defer" and "candidate unclipped" in c.reason and c.ess == pytest.approx(e.ess_unclipped)
    assert c.as_dict()["candidate"]["ess_unclipped"] == pytest.approx(e.ess_unclipped)


def test_stables_own_effective_sample_size_counts_too():
    """Stable's estimate is half of the difference: a stable version far from the logged behaviour defers too."""
    rng = np.random.default_rng(25)
    lb, r = rng.normal(-20, 5, 400), _product_rewards(rng, 400)
    c = compare(lb, lb + rng.normal(0, 3.0, 400), lb, r, min_ess=50)
    assert c.verdict == "defer" and "stable" in c.reason


def test_the_weights_stay_finite_however_far_the_log_probs_are():
    lb = np.array([-900.0, -5.0, -3.0, -4.0] * 30)
    r = np.array([1.0, 0.0, 1.0, 0.0] * 30)
    c = compare(lb - 800.0, lb - 800.0, lb, r, min_ess=1)  # every weight exp(-800): 0 in floating point
    assert math.isfinite(c.candidate.value) and c.candidate.ess == pytest.approx(120) and c.verdict == "pass"


def test_compare_refuses_bad_settings():
    with pytest.raises(ValueError, match="alpha"):
        compare([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0], alpha=0.7)
    with pytest.raises(ValueError, match="margin"):
        compare([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0], margin=-0.1)


# --- the held-out slice: reverts merged, young judgements censored --------------------------------------------------


def _held(gid: str, reward: float, judged_at: float, kind: str = "accept"):
    from deploy.gate.tail import HeldoutSample

    return HeldoutSample((1, 2), (3,), -1.0, reward, gid, judged_at, kind)


def test_a_revert_adds_its_correction_to_its_accepts_reward_and_keeps_the_judgement_time():
    """The product's revert reward is the correction trained on top of the accept (0.75 - 1.0 = -0.25, a reject's):
    their sum is what the product scores an answer the user took back."""
    recs = [
        _held("a", 0.75, 100.0),
        _held("b", -0.25, 101.0, "reject"),
        _held("c", 0.75, 102.0),
        _held("a", -1.0, 150.0, "revert"),
        _held("b", -0.25, 101.0, "reject"),  # a revert of a; b redelivered
        _held("a", -1.0, 150.0, "revert"),
    ]  # the revert redelivered: added once
    kept, young = merge_heldout(recs, judged_before=1000.0)
    assert young == 0 and [(s.generation_id, s.reward, s.kind, s.judged_at) for s in kept] == [
        ("a", -0.25, "revert", 100.0),
        ("b", -0.25, "reject", 101.0),
        ("c", 0.75, "accept", 102.0),
    ]
    only_revert, _ = merge_heldout([_held("z", -1.0, 150.0, "revert")], judged_before=1000.0)
    assert only_revert == []  # its accept already out of the tail: what the product scored it is unknown


def test_judgements_younger_than_the_revert_horizon_are_censored_whatever_their_kind():
    recs = [
        _held("old-acc", 0.75, 10.0),
        _held("old-rej", -0.25, 20.0),
        _held("young-acc", 0.75, 95.0),
        _held("young-rej", -0.25, 96.0),
        _held("old-acc", -1.0, 97.0, "revert"),
    ]
    kept, young = merge_heldout(recs, judged_before=90.0)
    assert young == 2 and [(s.generation_id, s.reward) for s in kept] == [("old-acc", -0.25), ("old-rej", -0.25)]
