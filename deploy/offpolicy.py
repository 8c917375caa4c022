"""Evidence before exposure: a candidate's live acceptance, estimated off-policy from logged feedback.

Every logged generation carries the behaviour policy's log-probs of its completion (what vLLM sampled it with) and,
once judged, whether the user accepted it. A candidate that was never served can still be scored on those samples:
weight each one by how much more (or less) likely the candidate is to produce that completion,

    w_i = min(exp(log pi_candidate(y_i | x_i) - log mu(y_i | x_i)), clip)

and the self-normalised importance-sampling estimate (SNIS) of its acceptance is ``sum(w_i r_i) / sum(w_i)`` with
``r_i`` 1 for an accepted completion and 0 otherwise. Clipping bounds the variance at the price of a bias towards the
behaviour policy; self-normalising removes the scale of the weights (the log-probs of long completions are far
from 0 on both sides).

How sure: the effective sample size ``ESS = (sum w)^2 / sum(w^2)`` says how many of the logged samples the estimate
really rests on (near n when the candidate is close to the behaviour policy, a handful when it moved far). The
standard error is the delta-method one of a ratio estimator, ``sqrt(sum(w_i^2 (r_i - V)^2)) / sum(w_i)``, and the
bounds are ``V +- z * se`` with ``z`` for a two-sided ``confidence`` (normal approximation; it needs a reasonable
ESS, so the verdict is "not enough evidence" below ``min_ess``).

The gate compares the candidate's estimate with the stable version's on the **same** held-out slice (stable's
weights are the same ratio with stable's log-probs, 1 where stable produced the logs itself). A candidate whose
upper bound is below stable's estimate by more than ``margin`` is refused before any user sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class Estimate:
    value: float  # the SNIS estimate of acceptance
    std_error: float
    lower: float
    upper: float
    ess: float  # effective sample size
    n: int
    clipped: float  # share of samples whose weight hit the clip

    def as_dict(self) -> dict:
        return {"value": self.value, "std_error": self.std_error, "lower": self.lower, "upper": self.upper,
                "ess": self.ess, "n": self.n, "clipped": self.clipped}


def snis(logp_target, logp_behaviour, reward, *, clip: float = 10.0, confidence: float = 0.95) -> Estimate:
    """The clipped, self-normalised importance-sampling estimate of the mean reward under the target policy.

    ``logp_target`` and ``logp_behaviour``: log-probability of each logged completion (summed over its tokens) under
    the target and the behaviour policy; ``reward``: each completion's reward (1/0 for accepted or not).
    """
    lt = np.asarray(logp_target, dtype=np.float64)
    lb = np.asarray(logp_behaviour, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if not (lt.shape == lb.shape == r.shape and lt.ndim == 1):
        raise ValueError(f"logp_target, logp_behaviour and reward must be 1-D and the same length, got "
                         f"{lt.shape}, {lb.shape}, {r.shape}")
    if lt.size == 0:
        raise ValueError("no logged samples to estimate from")
    if not (np.isfinite(lt).all() and np.isfinite(lb).all() and np.isfinite(r).all()):
        raise ValueError("log-probs and rewards must be finite")
    if clip <= 0 or not 0 < confidence < 1:
        raise ValueError("clip must be > 0 and confidence in (0, 1)")
    log_w = lt - lb
    w = np.exp(np.minimum(log_w, math.log(clip)))
    clipped = float(np.mean(log_w >= math.log(clip)))
    sw = float(w.sum())
    value = float((w * r).sum() / sw)
    se = float(math.sqrt(float((w * w * (r - value) ** 2).sum())) / sw)
    ess = sw * sw / float((w * w).sum())
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return Estimate(value=value, std_error=se, lower=value - z * se, upper=value + z * se, ess=ess, n=int(r.size),
                    clipped=clipped)


@dataclass(frozen=True)
class Comparison:
    candidate: Estimate
    stable: Estimate
    margin: float
    min_ess: float
    verdict: str  # "pass", "refuse" or "insufficient"
    reason: str

    def as_dict(self) -> dict:
        return {"candidate": self.candidate.as_dict(), "stable": self.stable.as_dict(), "margin": self.margin,
                "min_ess": self.min_ess, "verdict": self.verdict, "reason": self.reason}


def compare(logp_candidate, logp_stable, logp_behaviour, reward, *, margin: float = 0.02, min_ess: float = 50.0,
            clip: float = 10.0, confidence: float = 0.95) -> Comparison:
    """Refuse a candidate whose upper bound is below stable's estimate (same slice) by more than ``margin``."""
    cand = snis(logp_candidate, logp_behaviour, reward, clip=clip, confidence=confidence)
    stab = snis(logp_stable, logp_behaviour, reward, clip=clip, confidence=confidence)
    if cand.ess < min_ess:
        return Comparison(cand, stab, margin, min_ess, "insufficient",
                          f"effective sample size {cand.ess:.0f} < {min_ess:g}: the candidate moved too far from the "
                          "logged behaviour to be judged off-policy")
    if cand.upper < stab.value - margin:
        return Comparison(cand, stab, margin, min_ess, "refuse",
                          f"estimated acceptance {cand.value:.3f} (upper bound {cand.upper:.3f}) is below stable's "
                          f"{stab.value:.3f} by more than {margin:g}")
    return Comparison(cand, stab, margin, min_ess, "pass",
                      f"estimated acceptance {cand.value:.3f} [{cand.lower:.3f}, {cand.upper:.3f}] vs stable "
                      f"{stab.value:.3f} (ESS {cand.ess:.0f} of {cand.n})")
