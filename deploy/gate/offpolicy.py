"""Evidence before exposure: a candidate's reward, estimated off-policy from logged feedback, against stable's.

Every logged generation carries the behaviour policy's log-probs of its completion (what vLLM sampled it with) and,
once judged, the product's shaped reward for it (``TrainingSample.reward``: ``Product.reward`` of the judgement,
replaced by the revert reward when the user later undid an accept). A candidate that was never served can still be
scored on those samples: weight each one by how much more (or less) likely the candidate is to produce that
completion,

    w_i = min(exp(log pi_candidate(y_i | x_i) - log mu(y_i | x_i)), clip)

and the self-normalised importance-sampling estimate (SNIS) of its mean reward is ``V = sum(w_i r_i) / sum(w_i)``.
Clipping bounds the variance at the price of a bias towards the behaviour policy; self-normalising removes the scale
of the weights (the log-probs of long completions are far from 0 on both sides).

The log-prob mismatch: ``mu`` comes from vLLM (its kernels, its precision), ``pi`` from transformers. Their small
per-token differences sum over a long completion into a per-sample factor ``exp(delta_i)`` on the weight even when
the candidate *is* the behaviour policy. The same factor multiplies stable's weight of that sample (both target
log-probs come from transformers), so it reweights the slice both estimates are computed on alike rather than
favouring either; the clip bounds what one sample's weight can become (``clip`` at most), so the mismatch can neither
make one sample decide the estimate nor overflow it.

How many samples it rests on: the effective sample size ``ESS = (sum w)^2 / sum(w^2)`` (near n when the target is
close to the behaviour policy, a handful when it moved far). It is reported on the clipped weights (what the estimate
uses) and on the unclipped ones (how far the target really moved: clipping flattens the largest weights, so the
clipped ESS flatters a target that moved far).

The comparison (``compare``) is a **paired** test on the same held-out samples. Each ratio estimator is linearised
per sample (the delta method; Deng et al., "Applying the Delta Method in Metric Analytics", 2018):

    V - V_true ~ (1/n) sum_i psi_i,   psi_i = w_i (r_i - V) / mean(w)

so the difference ``D = V_candidate - V_stable`` is, to first order, the mean of the per-sample differences
``d_i = psi_candidate_i - psi_stable_i``, and its variance is theirs: stable's own uncertainty and the covariance of
the two estimates (the same samples, the same rewards) are in it. Treating stable's estimate as exact, as the rule
before this one did, refused about 6-8% of equally good candidates whose weights were nearly independent of
stable's. Two small-sample corrections keep the error rate at ``alpha`` down to ``min_ess``-sized slices (measured:
tests/deploy/test_offpolicy.py): each term gets its leverage correction, ``psi_i / (1 - w_i / sum(w))`` (which makes
the variance the jackknife's, exactly), and the quantile is Student's t with the degrees of freedom a sample of the
terms' kurtosis ``k`` supports, ``2 (n - 1) / (k - 1)`` (``n - 1`` for normal terms; heavy weights give fewer). The
verdict:

- ``defer``: the ESS of the candidate or of stable, clipped or unclipped, is below ``min_ess``. The normal
  approximation is not trusted there; the candidate is neither refused nor passed on this evidence: it must go
  through the canary.
- ``refuse``: the candidate is shown worse than stable by more than ``margin``: the one-sided ``1 - alpha`` upper
  bound ``D + z_(1-alpha) se`` is below ``-margin`` (``alpha`` is ``ALPHA`` = 0.025 by default: a candidate exactly as
  good as stable is refused at most 2.5% of the time at margin 0, and less at a positive margin).
- ``pass``: otherwise.

``margin`` is in the product's reward units (with the default rewards an accept is worth 1 more than a reject, so
0.02 is 2 points of acceptance when nothing is edited or reverted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol, Self, TypeVar

import numpy as np


class HeldoutRecord(Protocol):
    """What ``merge_heldout`` reads of a held-out sample (``deploy.gate.gate.HeldoutSample`` is one)."""

    @property
    def generation_id(self) -> str: ...
    @property
    def judged_at(self) -> float: ...
    @property
    def reward(self) -> float: ...
    @property
    def kind(self) -> str: ...
    def _replace(self, *, reward: float, kind: str, judged_at: float) -> Self: ...


S = TypeVar("S", bound=HeldoutRecord)  # a held-out sample (merge_heldout)

ALPHA = 0.025  # one-sided error rate of the off-policy refusal (an equally good candidate refused at most this often)


@dataclass(frozen=True)
class Estimate:
    value: float  # the SNIS estimate of the mean reward
    std_error: float
    lower: float
    upper: float
    ess: float  # effective sample size of the clipped weights (those the estimate uses)
    ess_unclipped: float  # the same of the weights before clipping (how far the target moved)
    n: int
    clipped: float  # share of samples whose weight hit the clip

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "std_error": self.std_error,
            "lower": self.lower,
            "upper": self.upper,
            "ess": self.ess,
            "ess_unclipped": self.ess_unclipped,
            "n": self.n,
            "clipped": self.clipped,
        }


def _inputs(logp_target, logp_behaviour, reward) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lt = np.asarray(logp_target, dtype=np.float64)
    lb = np.asarray(logp_behaviour, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if not (lt.shape == lb.shape == r.shape and lt.ndim == 1):
        raise ValueError(
            f"logp_target, logp_behaviour and reward must be 1-D and the same length, got "
            f"{lt.shape}, {lb.shape}, {r.shape}"
        )
    if lt.size == 0:
        raise ValueError("no logged samples to estimate from")
    if not (np.isfinite(lt).all() and np.isfinite(lb).all() and np.isfinite(r).all()):
        raise ValueError("log-probs and rewards must be finite")
    return lt, lb, r


def _weights(log_w: np.ndarray, clip: float) -> tuple[np.ndarray, float, float]:
    """The clipped weights up to a common factor (every figure here is scale-free, and scaling by the largest keeps
    them finite however far the log-probs are from 0), their ESS, and the ESS of the unclipped weights."""
    capped = np.minimum(log_w, math.log(clip))
    w = np.exp(capped - capped.max())
    u = np.exp(log_w - log_w.max())
    return w, float(w.sum()) ** 2 / float((w * w).sum()), float(u.sum()) ** 2 / float((u * u).sum())


def snis(logp_target, logp_behaviour, reward, *, clip: float = 10.0, confidence: float = 0.95) -> Estimate:
    """The clipped, self-normalised importance-sampling estimate of the mean reward under the target policy.

    ``logp_target`` and ``logp_behaviour``: log-probability of each logged completion (summed over its tokens) under
    the target and the behaviour policy; ``reward``: each completion's reward (the product's, any finite number).
    The interval is two-sided at ``confidence`` (normal approximation; trust it only at a reasonable ESS).
    """
    lt, lb, r = _inputs(logp_target, logp_behaviour, reward)
    if clip <= 0 or not 0 < confidence < 1:
        raise ValueError("clip must be > 0 and confidence in (0, 1)")
    return _estimate(lt - lb, r, clip, NormalDist().inv_cdf(0.5 + confidence / 2))[0]


def _estimate(log_w: np.ndarray, r: np.ndarray, clip: float, z: float) -> tuple[Estimate, np.ndarray]:
    """The estimate and its clipped weights (up to a common factor)."""
    w, ess, ess_u = _weights(log_w, clip)
    value = float((w * r).sum() / w.sum())
    psi = w * (r - value) / float(w.mean())  # each sample's delta-method term: V - V_true ~ mean(psi)
    se = math.sqrt(float((psi * psi).sum())) / r.size
    return Estimate(
        value=value,
        std_error=se,
        lower=value - z * se,
        upper=value + z * se,
        ess=ess,
        ess_unclipped=ess_u,
        n=int(r.size),
        clipped=float(np.mean(log_w >= math.log(clip))),
    ), w


def _paired_se(
    estimates: tuple[tuple[Estimate, np.ndarray], tuple[Estimate, np.ndarray]], r: np.ndarray
) -> tuple[float, float]:
    """The standard error of ``V_candidate - V_stable`` from the per-sample terms of both estimates (each
    ``(estimate, its weights)``), and the degrees of freedom of its t quantile. A sample's term is its delta-method
    term with the leverage correction, i.e. the change in the difference when the sample is left out
    (``V - V_(-i) = w_i (r_i - V) / (sum(w) - w_i)``), so the variance is the jackknife's. inf when one sample carries
    all the weight (leaving it out is undefined)."""
    n = r.size
    terms = np.zeros(n)
    for (est, w), sign in zip(estimates, (1.0, -1.0), strict=True):
        rest = float(w.sum()) - w
        if n < 2 or not (rest > 0).all():
            return math.inf, 1.0
        terms += sign * w * (r - est.value) / rest
    c = terms - terms.mean()
    m2 = float((c * c).mean())
    se = math.sqrt((n - 1) * m2)  # the jackknife variance: (n - 1) / n * sum(c^2)
    kurtosis = float((c**4).mean()) / (m2 * m2) if m2 > 0 else 3.0
    return se, (n - 1) * min(1.0, 2.0 / max(kurtosis - 1.0, 1e-9))


def _t_quantile(p: float, dof: float) -> float:
    """Student's t quantile: the Cornish-Fisher expansion (Hill, 1970) from 5 degrees of freedom up (error under
    1e-3 there at the levels used), the exact quantile of 2 degrees of freedom (larger, so conservative) below."""
    if dof < 5:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * dof)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * dof**3)
    )


@dataclass(frozen=True)
class Comparison:
    candidate: Estimate
    stable: Estimate
    difference: float  # candidate's estimate minus stable's, on the same samples
    std_error: float  # of the difference: the paired one, from each sample's terms in both estimates
    dof: float  # degrees of freedom of the t quantile of the bound
    upper: float  # one-sided 1 - alpha upper bound of the difference
    margin: float
    min_ess: float
    alpha: float
    verdict: str  # "pass", "refuse" or "defer"
    reason: str

    @property
    def ess(self) -> float:
        """The smallest of the four effective sample sizes (candidate and stable, clipped and unclipped): the one the
        deferral looks at."""
        return min(self.candidate.ess, self.candidate.ess_unclipped, self.stable.ess, self.stable.ess_unclipped)

    def as_dict(self) -> dict:
        return {
            "candidate": self.candidate.as_dict(),
            "stable": self.stable.as_dict(),
            "difference": self.difference,
            "std_error": self.std_error,
            "dof": self.dof,
            "upper": self.upper,
            "margin": self.margin,
            "min_ess": self.min_ess,
            "alpha": self.alpha,
            "verdict": self.verdict,
            "reason": self.reason,
        }


def compare(
    logp_candidate,
    logp_stable,
    logp_behaviour,
    reward,
    *,
    margin: float = 0.02,
    min_ess: float = 50.0,
    clip: float = 10.0,
    alpha: float = ALPHA,
) -> Comparison:
    """The candidate against stable on the same logged samples: ``refuse`` when the paired test shows it worse by
    more than ``margin`` at one-sided level ``alpha``, ``defer`` (to the canary) when an effective sample size is
    under ``min_ess``, ``pass`` otherwise (see the module's docstring)."""
    lc, lb, r = _inputs(logp_candidate, logp_behaviour, reward)
    ls = _inputs(logp_stable, logp_behaviour, reward)[0]
    if clip <= 1 or not 0 < alpha < 0.5 or margin < 0 or min_ess < 0:
        raise ValueError(
            f"need clip > 1, 0 < alpha < 0.5, margin >= 0 and min_ess >= 0, got clip {clip}, "
            f"alpha {alpha}, margin {margin}, min_ess {min_ess}"
        )
    z2 = NormalDist().inv_cdf(1 - alpha / 2)  # the single estimates' intervals: two-sided, at the same level
    pair = _estimate(lc - lb, r, clip, z2), _estimate(ls - lb, r, clip, z2)
    (cand, _), (stab, _) = pair
    diff = cand.value - stab.value
    se, dof = _paired_se(pair, r)
    z = _t_quantile(1 - alpha, dof)
    upper = diff + z * se

    def verdict(v: str, reason: str) -> Comparison:
        return Comparison(cand, stab, diff, se, dof, upper, margin, min_ess, alpha, v, reason)

    shown = (
        f"difference {diff:+.3f} (paired se {se:.3f}, one-sided {1 - alpha:.1%} upper bound {upper:+.3f}, "
        f"t with {dof:.0f} df) vs -margin {-margin:g}"
    )
    sizes = (
        ("candidate", cand.ess),
        ("candidate unclipped", cand.ess_unclipped),
        ("stable", stab.ess),
        ("stable unclipped", stab.ess_unclipped),
    )
    low = [f"{name} {ess:.0f}" for name, ess in sizes if ess < min_ess]
    if low:
        return verdict(
            "defer",
            f"effective sample size below {min_ess:g} ({', '.join(low)}): too far from the logged "
            f"behaviour to be judged off-policy; deferred to the canary ({shown})",
        )
    if upper < -margin:
        return verdict(
            "refuse",
            f"estimated reward {cand.value:.3f} is shown below stable's {stab.value:.3f} by more "
            f"than {margin:g}: {shown}, at one-sided alpha {alpha:g}",
        )
    return verdict(
        "pass",
        f"estimated reward {cand.value:.3f} [{cand.lower:.3f}, {cand.upper:.3f}] vs stable "
        f"{stab.value:.3f}: not shown worse by more than {margin:g}: {shown}",
    )


def merge_heldout(samples: Sequence[S], judged_before: float) -> tuple[list[S], int]:
    """The held-out samples the check may use, from the records of the held-out stream in arrival order (each a
    ``deploy.gate.tail.HeldoutSample``: a NamedTuple with ``generation_id``, ``judged_at``, ``reward`` and ``kind``).

    - One sample per generation. A revert record (ingest's, after the user undid an accepted answer) adds its reward
      to the accept's: the product's revert reward is the correction the learner trains on top of the accept, so
      their sum is what the product scores an answer it gave and the user took back (the demo's 0.75 - 1.0 = -0.25,
      a reject's). Any other later record of the same generation (a redelivery) replaces the earlier one. The
      sample keeps the earliest judgement time (a revert record carries the revert's time; the judgement was before
      it) and its first record's place in the order. A revert whose accept is no longer in the records is left
      out (what the product scored that answer is not known from the revert alone).
    - Censoring: only samples judged at or before ``judged_before`` (the gate passes now minus
      ``gate.revert_horizon_s``) are kept. A younger accept may still be reverted, so counting it would score bait
      as a success; every kind is censored alike, or the young window would tilt the slice towards rejects.

    Returns the samples kept, oldest first, and how many were left out as too young."""
    merged: dict[str, S] = {}
    for s in samples:
        prev = merged.get(s.generation_id)
        if prev is None:
            if s.kind != "revert":  # a revert whose accept has left the tail: its generation's reward is unknown
                merged[s.generation_id] = s
        elif s.kind == "revert" and prev.kind == "accept":
            merged[s.generation_id] = prev._replace(
                reward=prev.reward + s.reward, kind="revert", judged_at=min(prev.judged_at, s.judged_at)
            )
        elif s.kind == "revert" and prev.kind == "revert":
            continue  # the revert again (a redelivery): already added
        else:
            merged[s.generation_id] = prev._replace(
                reward=s.reward, kind=s.kind, judged_at=min(prev.judged_at, s.judged_at)
            )
    kept = [s for s in merged.values() if s.judged_at <= judged_before]
    return kept, len(merged) - len(kept)
