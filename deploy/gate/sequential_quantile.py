"""A quantile of latency (p90 by default) as a canary guardrail: each arm's quantile per 10 s bucket, read from the
latency histogram ingest keeps per version and bucket (``core.keys.LATENCY_HIST_EDGES_MS``), and the paired
per-bucket differences tested by batch means, as the mean latency's test is
(``deploy.gate.sequential_batches.batch_means``).

**Why a quantile.** A mean hides a tail: a candidate whose answers are as fast for nine users in ten and three times
slower for the tenth moves mean latency by a fifth and its p90 by three times. The mean's test, with its 25%
tolerance, passes it; the p90's does not.

**The estimate.** Within one bucket each arm's quantile ``Q_b(q)`` is read from its histogram: the bin holding rank
``q N`` of the bucket's ``N`` timed events, interpolated log-linearly inside it (``hist_quantile``; bins are
log-spaced, so this is linear in log-latency). Buckets in which both arms have at least ``min_events`` timed events
pair by time, so a load both arms share cancels, and ``d = mean_b(-(Q_c,b - Q_s,b))`` (lower is better) with
``V = var_b / B`` and ``B - 1`` degrees of freedom: the batch-means estimate of ``batch_means``. A bucket's quantile
is a nonlinear function of its events, so its expectation moves with ``N`` (for a right-skewed latency, a sample
p90 of 20 events sits a little below the p90 of 400): the paired difference is exact on average only with alike
counts on both arms. The tolerance (``gate.latency_quantile_tolerance``, a share of stable's pre-rollout quantile, as
the ``harm_margin`` and the margin) is what keeps that and the node the canary runs on from reading as a harm; the
calibration measures both (``deploy.gate.canary_sim_stats.simulate_latency_quantile``).

**Its place in the family.** By default (``gate.latency_quantile_guardrail = "harm"``) it only aborts: a promotion
does not wait for it, and its harm side counts among the tests that share the false-abort alpha
(``deploy.gate.sequential_readout``). ``"non_inferior"`` makes a promotion wait until it is shown within the
tolerance, like the mean's test.
"""

from __future__ import annotations

import math

import numpy as np

from core import keys
from deploy.gate.sequential import MetricTest
from deploy.gate.sequential_batches import look_batches

MIN_EVENTS = 20
"""Timed events each arm needs in a bucket before that bucket's quantiles count (both arms skip it otherwise: which
buckets count depends on the counts, never on the latencies)."""

_EDGES = np.asarray(keys.LATENCY_HIST_EDGES_MS, dtype=float)
_STEP = 2.0**0.25  # the bins' ratio, for the open-ended first and last bins
_LOWER = np.concatenate([[_EDGES[0] / _STEP], _EDGES])  # bin i spans [_LOWER[i], _UPPER[i])
_UPPER = np.concatenate([_EDGES, [_EDGES[-1] * _STEP]])


def hist_counts(agg: dict) -> np.ndarray:
    """A bucket's histogram (``LATENCY_HIST_BINS`` counts) from its aggregate fields (``*`` of
    ``keys.read_unit_buckets``: ``h<i>`` -> count; absent bins are 0)."""
    out = np.zeros(keys.LATENCY_HIST_BINS)
    for k, n in agg.items():
        if k[:1] == "h" and k[1:].isdigit() and int(k[1:]) < keys.LATENCY_HIST_BINS:
            out[int(k[1:])] = n
    return out


def hist_quantile(counts, q: float) -> np.ndarray:
    """The ``q`` quantile (ms) of each histogram in ``counts`` (last axis over ``LATENCY_HIST_BINS``): the bin holding
    rank ``q N``, interpolated log-linearly inside it; NaN for an empty histogram. The first and last bins read as one
    bin's ratio wide (below 4 ms, at or above 65,536 ms)."""
    if not 0 < q < 1:
        raise ValueError(f"a quantile must be in (0, 1), got {q}")
    c = np.asarray(counts, dtype=float)
    if c.shape[-1] != keys.LATENCY_HIST_BINS:
        raise ValueError(f"a latency histogram has {keys.LATENCY_HIST_BINS} bins, got {c.shape[-1]}")
    cum = np.cumsum(c, axis=-1)
    total = cum[..., -1:]
    rank = q * total
    i = np.minimum((cum < rank).sum(-1), keys.LATENCY_HIST_BINS - 1)  # the first bin whose cumulative count reaches it
    below = np.where(i > 0, np.take_along_axis(cum, np.maximum(i - 1, 0)[..., None], -1)[..., 0], 0.0)
    inside = np.take_along_axis(c, i[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.clip((rank[..., 0] - below) / inside, 0.0, 1.0)
        out = _LOWER[i] * (_UPPER[i] / _LOWER[i]) ** frac
    return np.where(total[..., 0] > 0, out, np.nan)


def paired_quantiles(
    canary: dict[int, dict], stable: dict[int, dict], q: float, min_events: int = MIN_EVENTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each arm's ``q`` quantile in the buckets both served with at least ``min_events`` timed events each
    (``canary`` / ``stable``: bucket -> its aggregate fields, ``ArmSums.buckets``), in bucket order; and in the same
    buckets, the canary's less stable's mean answer length (``length_gap``: NaN where a bucket has no lengths)."""
    both = [b for b in sorted(set(canary) & set(stable))]
    hc = np.array([hist_counts(canary[b]) for b in both]).reshape(-1, keys.LATENCY_HIST_BINS)
    hs = np.array([hist_counts(stable[b]) for b in both]).reshape(-1, keys.LATENCY_HIST_BINS)
    ok = (hc.sum(-1) >= min_events) & (hs.sum(-1) >= min_events)
    gap = np.array([length_gap(canary[b], stable[b]) for b in both], dtype=float)
    return hist_quantile(hc[ok], q), hist_quantile(hs[ok], q), gap[ok]


def length_gap(canary: dict, stable: dict) -> float:
    """One bucket's canary less stable mean answer length (tokens over judged events, each arm's aggregate fields);
    NaN when either arm has none."""
    c_e, s_e = canary.get("e", 0), stable.get("e", 0)
    if not (c_e and s_e) or "t" not in canary or "t" not in stable:
        return math.nan
    return canary["t"] / c_e - stable["t"] / s_e


def look_quantiles(test: MetricTest, canary_q, stable_q, min_batches: int, length_gap=None) -> dict:
    """One look of ``test`` (a latency quantile: ``direction`` -1, margins fixed at the start) on the per-bucket
    quantiles of each arm (``paired_quantiles``), by batch means (at equal answer length when ``length_gap`` is
    given: ``deploy.gate.sequential_batches.batch_means``); no look below ``min_batches`` buckets. Returns
    ``test.summary()`` with the buckets used and the arms' mean per-bucket quantile."""
    out = look_batches(test, canary_q, stable_q, min_batches, length_gap)
    c, s = np.asarray(canary_q, float), np.asarray(stable_q, float)
    means = (float(np.mean(c)), float(np.mean(s))) if c.size else (math.nan, math.nan)
    return out | {"quantile_means": means}
