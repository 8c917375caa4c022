"""The user as the unit of a canary's test: each arm's per-user sums of a ratio metric (``UnitSums``) and the
estimate of the arms' difference with its variance (``unit_estimate``): the delta method for ratio metrics, CUPED on
a pre-rollout covariate, and the small-sample corrections (CR3 residuals, Welch's degrees of freedom).

The leverage correction is bounded. CR3 scales each user's residual by ``1 / (1 - h_u)``, which is exact for a
leverage ``h_u`` of a true projection (then ``h_u < 1``) and the jackknife's leave-one-out residual. Two corrections
apply here, and they compose rather than add:

- CUPED's slope ``b`` is fitted on the users (regression of ``L`` on ``Z`` through the origin, pooled over the
  arms). Each user's residual is taken on the slope fitted without it, ``L_u - b_(-u) Z_u``: the exact leave-one-out
  residual, computed directly, so no ``1 - h`` is divided by. A heavy user whose covariate carries nearly all of
  ``sum Z^2`` gets its own raw ``L_u`` back (nothing else informs the slope for it) instead of a residual the slope
  was fitted to make zero. Summing the slope's leverage ``Z_u^2 / sum Z^2`` with the ratio's ``h_u`` is what can pass
  1 for a user who is a fifth of all traffic, and dividing by ``max(1 - h, tiny)`` then inflates the variance by
  up to 1e11, which silently stops the test.
- The ratio's own leverage, the user's share of the arm's events ``h_u = den_u / sum den``, is below 1 whenever the
  arm has two users; it is capped at ``LEVERAGE_MAX`` (0.9: the factor at most 10), as HC4m/HC5
  (Cribari-Neto et al., 2007, 2011) bound the leverage discount. The cap only binds when one user carries over 90%
  of an arm's events, where Kish's effective number of users (the degrees of freedom) is about 1 and the Student-t
  widening keeps the test from deciding anyway: the cap keeps the variance finite, and the degrees of freedom keep
  the test conservative.

So the variance is at most ``LEVERAGE_MAX``'s factor squared (100) times the uncorrected cluster-robust variance of
the same residuals, and it is the jackknife's where the cap does not bind (biased upward, if anything: Efron and
Stein, 1981). ``tests/deploy/test_sequential_units.py`` holds it within 4 times the plain delta-method variance in a
Zipf(1.1) world whose top user's summed leverage passes 1, with an A/A calibrated.

``deploy.gate.sequential`` states the estimator and its references; ``deploy.gate.sequential.look_units`` feeds the
estimate to the always-valid test.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np

LEVERAGE_MAX = 0.9
"""The largest share of an arm's events whose leverage correction CR3 applies in full: the factor ``1 / (1 - h)``
is at most 10 (module docstring)."""
LOO_TINY = 1e-9
"""Below this share of ``sum Z^2`` left without a user, no other user informs the slope for it."""


@dataclass(frozen=True, eq=False)
class UnitSums:
    """One arm's per-user sums of one ratio metric, the last axis over users (a leading axis, if any, over looks in
    time order; the covariate has no look axis).

    ``num``, ``den``: each user's sums in the rollout so far (kept accepts and judged events; or the sum of response
    lengths and their count). Users with ``den == 0`` have not been seen yet and do not count.
    ``cov``: each user's pre-rollout covariate (e.g. kept rate under stable before the rollout), NaN when the user
    has none; ``cov_den``: the events behind it (its weight; leave it out to weigh every user alike).
    """

    num: np.ndarray
    den: np.ndarray
    cov: np.ndarray | None = None
    cov_den: np.ndarray | None = None

    def __post_init__(self):
        num, den = np.asarray(self.num, dtype=float), np.asarray(self.den, dtype=float)
        if num.shape != den.shape or num.ndim not in (1, 2):
            raise ValueError(
                f"num and den must be per-user arrays of one shape (users, or looks x users), got "
                f"{num.shape} and {den.shape}"
            )
        if not np.isfinite(num.sum() + den.sum()) or (den.size and den.min() < 0):
            raise ValueError("per-user sums must be finite and den >= 0")
        object.__setattr__(self, "num", num)
        object.__setattr__(self, "den", den)
        users = num.shape[-1]
        if self.cov is not None:
            cov = np.asarray(self.cov, dtype=float)
            w = np.ones(users) if self.cov_den is None else np.asarray(self.cov_den, dtype=float)
            if cov.shape != (users,) or w.shape != (users,):
                raise ValueError(f"cov and cov_den must have one value per user ({users}), got {cov.shape}, {w.shape}")
            if np.any(~np.isfinite(w)) or np.any(w < 0) or np.any(np.isinf(cov)):
                raise ValueError("cov_den must be finite and >= 0; cov finite or NaN (no covariate)")
            has = np.isfinite(cov) & (w > 0)
            object.__setattr__(self, "cov", np.where(has, cov, 0.0))
            object.__setattr__(self, "cov_den", np.where(has, w, 0.0))

    @cached_property
    def moments(self) -> dict:
        """The arm's sums the estimator needs (per look): users seen, totals, ratio, each user's linearised
        ``L_u = (num_u - R den_u) / mean(den)`` and leverage ``h_u = den_u / sum(den)`` (0 for users not seen), and the
        delta-method variance with its degrees of freedom."""
        seen = self.den > 0
        if np.any((self.num != 0) & ~seen):
            raise ValueError("a user with no events (den 0) cannot have a numerator")
        n = np.count_nonzero(seen, axis=-1)
        total_num, total_den = self.num.sum(-1), self.den.sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(total_den > 0, total_num / total_den, 0.0)
            mean_den = total_den / n
            lin = (self.num - _last(ratio) * self.den) / _last(mean_den)
            lev = self.den / _last(total_den)
            var, df = _cr3(lin, lev, n)
        return {
            "seen": seen,
            "n": n,
            "num": total_num,
            "den": total_den,
            "ratio": ratio,
            "lin": lin,
            "lev": lev,
            "var": var,
            "df": df,
        }


def _last(a):
    """``a`` with a trailing axis, to broadcast a per-look value over users."""
    return np.asarray(a)[..., None]


@dataclass(frozen=True)
class UnitEstimate:
    """``unit_estimate``'s result (arrays when given a stack of looks): ``d`` and ``var`` (CUPED's when asked),
    the plain delta-method ``var_raw``, Welch's ``df``, users and events per arm, each arm's ratio, and the share of
    variance CUPED removed (0 without it)."""

    d: np.ndarray
    var: np.ndarray
    var_raw: np.ndarray
    df: np.ndarray
    users_canary: np.ndarray
    users_stable: np.ndarray
    events_canary: np.ndarray
    events_stable: np.ndarray
    ratio_canary: np.ndarray
    ratio_stable: np.ndarray
    cuped_removed: np.ndarray


def unit_estimate(canary: UnitSums, stable: UnitSums, direction: int = 1, cuped: bool = False) -> UnitEstimate:
    """theta = direction * (R_canary - R_stable) with the user as the unit: the delta method for ratio metrics, and
    with ``cuped`` the regression on the users' pre-rollout covariate (module docstring). Needs ``cov`` on both arms
    when ``cuped``; a stack of looks gives one value per look."""
    mc, ms = canary.moments, stable.moments
    d = direction * (mc["ratio"] - ms["ratio"])
    var_raw = mc["var"] + ms["var"]
    var = var_raw
    removed = np.zeros_like(var_raw)
    if cuped:
        if canary.cov is None or stable.cov is None:
            raise ValueError("CUPED needs each arm's pre-rollout covariate (UnitSums.cov)")
        zc, zs = _covariate(canary, mc), _covariate(stable, ms)
        with np.errstate(invalid="ignore", divide="ignore"):
            zz, lz = zc["zz"] + zs["zz"], zc["lz"] + zs["lz"]
            b = np.where(zz > 0, lz / zz, 0.0)  # pooled
            d = direction * ((mc["ratio"] - b * zc["ratio"]) - (ms["ratio"] - b * zs["ratio"]))
            # each arm's leave-one-user-out residuals of the regression on Z, then the ratio's own leverage
            # (module docstring: the two corrections compose, they are not added)
            parts = [_cr3(_loo_residuals(m["lin"], z["z"], lz, zz), m["lev"], m["n"]) for m, z in ((mc, zc), (ms, zs))]
            (var_c, df_c), (var_s, df_s) = parts
            var = np.where((mc["n"] >= 3) & (ms["n"] >= 3), var_c + var_s, np.inf)
            removed = np.where(np.isfinite(var) & np.isfinite(var_raw) & (var_raw > 0), 1.0 - var / var_raw, 0.0)
        df = _welch_df(var_c, var_s, df_c, df_s)
    else:
        df = _welch_df(mc["var"], ms["var"], mc["df"], ms["df"])
    return UnitEstimate(
        d=d,
        var=var,
        var_raw=var_raw,
        df=df,
        users_canary=mc["n"],
        users_stable=ms["n"],
        events_canary=mc["den"],
        events_stable=ms["den"],
        ratio_canary=mc["ratio"],
        ratio_stable=ms["ratio"],
        cuped_removed=removed,
    )


def cap_users(canary: UnitSums, stable: UnitSums, quantile: float) -> tuple[UnitSums, UnitSums]:
    """Both arms with each heavy user's weight capped: a user with more events (``den``) than the ``quantile`` of
    the users' events, both arms' seen users pooled (per look, for a stack of looks), has its ``num`` and ``den``
    scaled down to that many events, its rate unchanged; and likewise its covariate's weight (``cov_den``) at the
    same quantile of the users' events before the rollout.

    The estimate is then of the users' rates weighed by their capped activity, the way experimentation platforms cap
    or winsorize heavy users (GrowthBook's and Eppo's capping, Statsig's winsorization). The cap is the same for both
    arms and found without looking at the outcome, so an A/A stays an A/A; where a few users send a fifth of the
    traffic, the tests rest on many users instead of on those few. Events still count in full wherever events are
    counted (the evidence budget, ``min_events``, the sample-ratio check)."""
    cap = _pooled_quantile(canary.den, stable.den, quantile)
    cov_cap = None
    if canary.cov_den is not None and stable.cov_den is not None:
        cov_cap = _pooled_quantile(canary.cov_den, stable.cov_den, quantile)

    def capped(arm: UnitSums) -> UnitSums:
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = np.where(arm.den > _last(cap), _last(cap) / arm.den, 1.0)  # NaN cap (no user seen): 1
        cov_den = arm.cov_den
        if cov_den is not None and cov_cap is not None and np.isfinite(cov_cap):
            cov_den = np.minimum(cov_den, cov_cap)
        return UnitSums(arm.num * scale, arm.den * scale, arm.cov, cov_den)

    return capped(canary), capped(stable)


def _pooled_quantile(a: np.ndarray, b: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile of the positive values of ``a`` and ``b`` together along the last axis (users); NaN where
    there is none."""
    both = np.concatenate([np.asarray(a, dtype=float), np.asarray(b, dtype=float)], axis=-1)
    both = np.where(both > 0, both, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a look with no user seen yet: NaN, no cap
        return np.nanquantile(both, q, axis=-1)


def _covariate(arm: UnitSums, m: dict) -> dict:
    """The arm's covariate as a ratio over the users seen so far, ``C = sum(cov_den cov) / sum(cov_den)``, each
    user's linearised part of it, ``Z_u = cov_den_u (cov_u - C) / mean(cov_den)`` (0 for a user without one, or not
    seen yet: the arm's mean imputed; ``Z`` has mean 0 in the arm, as ``L`` has), and ``sum L_u Z_u``, ``sum Z_u^2``."""
    assert arm.cov is not None and arm.cov_den is not None  # set together by UnitSums when cov is given
    w = np.where(m["seen"], arm.cov_den, 0.0)
    w_total = w.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(w_total > 0, np.einsum("...u,u->...", w, arm.cov) / w_total, 0.0)
        w_mean = np.where(w_total > 0, w_total / m["n"], 1.0)
        z = w * (arm.cov - _last(ratio)) / _last(w_mean)
        lz = np.einsum("...u,...u->...", m["lin"], z)
    return {"ratio": ratio, "z": z, "lz": lz, "zz": _sum_sq(z)}


def _loo_residuals(lin, z, lz, zz):
    """Each user's residual ``L_u - b_(-u) Z_u`` on the pooled slope fitted without that user,
    ``b_(-u) = (sum L Z - L_u Z_u) / (sum Z^2 - Z_u^2)`` (the exact leave-one-out residual of the regression through
    the origin, ``(L_u - b Z_u) / (1 - Z_u^2 / sum Z^2)``, computed without the division by ``1 - h``); a user whose
    covariate alone carries all of ``sum Z^2`` keeps ``L_u``: no other user informs the slope for it."""
    zz_o = _last(zz) - z * z
    with np.errstate(invalid="ignore", divide="ignore"):
        b_o = np.where(zz_o > LOO_TINY * _last(zz), (_last(lz) - lin * z) / zz_o, 0.0)
    return lin - b_o * z


def _cr3(r, lev, n):
    """Variance of an arm's mean of ``n`` users' linearised contributions ``r`` (with mean 0), and its degrees of
    freedom: ``sum((r_u / (1 - h_u))^2) / n^2``, the cluster-robust variance with each user's residual scaled up by
    its share of the arm's events ``h_u`` (CR3, the ratio's jackknife up to ``n / (n - 1)``: a heavy user pulls the
    ratio towards itself, so its own residual understates its noise; see MacKinnon, Nielsen and Webb,
    "Cluster-robust inference: a guide to empirical practice", 2023), ``h_u`` capped at ``LEVERAGE_MAX``. Infinite
    below 2 users."""
    adj = r / (1.0 - np.minimum(lev, LEVERAGE_MAX))
    ss = _sum_sq(adj)
    return np.where(n >= 2, ss / (n * n), np.inf), _units_df(adj, ss, n)


def _sum_sq(a):
    return np.einsum("...u,...u->...", a, a)


def _units_df(r, ss, n):
    """The effective number of users behind ``ss = sum(r_u^2)``, less one: ``3 ss^2 / sum r^4 - 1`` (Kish's
    effective size ``(sum s_u^2)^2 / sum s_u^4`` for normal ``r_u`` of variances ``s_u^2``, whose ``E r^4 = 3 s^4``),
    at most ``n - 1``. Heavy users lower it: a few of them carry the variance."""
    r2 = r * r
    with np.errstate(invalid="ignore", divide="ignore"):
        df = 3.0 * ss * ss / _sum_sq(r2) - 1.0
    return np.minimum(np.where(np.isfinite(df), df, 1.0), n - 1.0)


def _welch_df(var_c, var_s, df_c, df_s):
    """Welch-Satterthwaite degrees of freedom of ``var_c + var_s``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        df = (var_c + var_s) ** 2 / (var_c**2 / np.maximum(df_c, 1.0) + var_s**2 / np.maximum(df_s, 1.0))
    return np.where(np.isfinite(df), df, 1.0)
