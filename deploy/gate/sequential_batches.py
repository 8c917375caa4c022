"""Latency's test: per-bucket means of each arm, paired by time (``batch_means``), and one look of a guardrail on
them (``look_batches``).

Per-request latencies are autocorrelated (the node's load), so the test takes the per-bucket means of each arm, pairs
them by time (a load both arms share cancels) and uses the differences' variance across buckets: the batch-means
variance, with ``B - 1`` degrees of freedom read as a Student t by the always-valid test (``deploy.gate.sequential``).

Pairing by time does not cancel which users each arm holds: users stay on their arm, so one heavy user with long
answers makes its arm slower in every bucket, and the buckets' spread does not see it. Given each bucket's difference
of the arms' mean answer length ``x_b``, the test is at equal length: the intercept of the regression
``d_b = delta + beta x_b + e_b`` (``var = s^2 (1/B + mean(x)^2 / Sxx)``, ``B - 2`` degrees of freedom). A delta cannot
change the compute per token, only how many tokens an answer takes, and that is the response length guardrail's;
latency at equal length is what the serving path adds. ``deploy.gate.sequential_quantile`` tests a quantile the same
way.
"""

from __future__ import annotations

import numpy as np

from deploy.gate.sequential import MetricTest


def batch_means(
    canary_means, stable_means, direction: int = -1, min_batches: int = 10, covariate=None
) -> tuple[float, float, int] | None:
    """(d, var, df) of a latency-like metric from per-bucket means of each arm (one value per time bucket, in the
    same buckets; NaN where an arm had no request): the buckets pair by time, so a load both arms share cancels, and
    the mean of the paired differences has the variance of the differences across buckets over their number, with
    ``df`` = buckets - 1. None below ``min_batches`` buckets with both arms.

    ``covariate``: per bucket, the canary's less stable's mean of what the metric grows with (the answer length):
    ``d`` is then the regression's intercept, the difference where the arms' covariate is equal, with its variance
    and ``df`` = buckets - 2 (the module docstring); the plain mean where the covariate does not vary."""
    if min_batches < 3:
        raise ValueError(f"min_batches must be >= 3, got {min_batches}")
    c, s = np.asarray(canary_means, dtype=float), np.asarray(stable_means, dtype=float)
    if c.shape != s.shape or c.ndim != 1:
        raise ValueError(f"per-bucket means of both arms must be 1-d arrays of one length, got {c.shape}, {s.shape}")
    diff = direction * (c - s)
    x = np.zeros_like(diff) if covariate is None else np.asarray(covariate, dtype=float)
    if x.shape != diff.shape:
        raise ValueError(f"the covariate needs one value per bucket ({diff.shape}), got {x.shape}")
    ok = np.isfinite(diff) & np.isfinite(x)
    diff, x = diff[ok], x[ok]
    b = diff.size
    if b < min_batches:
        return None
    xc = x - x.mean()
    sxx = float(xc @ xc)
    if covariate is None or sxx <= 1e-12 * max(float(x @ x), 1e-300):
        return float(diff.mean()), max(float(diff.var(ddof=1)) / b, 1e-12), b - 1
    beta = float(xc @ (diff - diff.mean())) / sxx
    d = float(diff.mean() - beta * x.mean())  # the intercept: the difference at x = 0
    resid = diff - d - beta * x
    s2 = float(resid @ resid) / (b - 2)
    return d, max(s2 * (1.0 / b + x.mean() ** 2 / sxx), 1e-12), b - 2


def look_batches(test: MetricTest, canary_means, stable_means, min_batches: int = 10, covariate=None) -> dict:
    """One look of ``test`` (latency: ``direction`` -1, margins fixed at the canary's start) on per-bucket means
    (``batch_means``, at equal ``covariate`` when given); no look below ``min_batches`` buckets. Returns
    ``test.summary()`` with the buckets used."""
    est = batch_means(canary_means, stable_means, test.direction, min_batches, covariate)
    if est is not None:
        d, var, df = est
        test.look(d, var, True, df)
    diff = np.asarray(canary_means, dtype=float) - np.asarray(stable_means, dtype=float)
    x = np.zeros_like(diff) if covariate is None else np.asarray(covariate, dtype=float)
    used = int(np.count_nonzero(np.isfinite(diff) & np.isfinite(x)))
    return test.summary() | {"unit": "batch", "batches": used, "at_equal_length": covariate is not None}
