"""The user as the unit of a canary's test: each arm's per-user sums of a ratio metric (``UnitSums``) and the
estimate of the arms' difference with its variance (``unit_estimate``): the delta method for ratio metrics, CUPED on
a pre-rollout covariate, and the small-sample corrections (CR3 residuals, Welch's degrees of freedom).

``deploy.gate.sequential`` states the estimator and its references; ``deploy.gate.sequential.look_units`` feeds the
estimate to the always-valid test.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


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
            b = np.where(zc["zz"] + zs["zz"] > 0, (zc["lz"] + zs["lz"]) / (zc["zz"] + zs["zz"]), 0.0)  # pooled
            d = direction * ((mc["ratio"] - b * zc["ratio"]) - (ms["ratio"] - b * zs["ratio"]))
            # each arm's residuals L - b Z, with the leverage of b (pooled) added to the user's own (none when no
            # user's covariate differs from its arm's: Z is 0 throughout and CUPED changes nothing)
            zz = zc["zz"] + zs["zz"]
            parts = [
                _cr3(
                    m["lin"] - _last(b) * z["z"],
                    m["lev"] + z["z"] ** 2 / np.where(_last(zz) > 0, _last(zz), 1.0),
                    m["n"],
                )
                for m, z in ((mc, zc), (ms, zs))
            ]
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


def _cr3(r, lev, n):
    """Variance of an arm's mean of ``n`` users' linearised contributions ``r`` (with mean 0), and its degrees of
    freedom: ``sum((r_u / (1 - h_u))^2) / n^2``, the cluster-robust variance with each user's residual scaled up by
    its leverage ``h_u`` (CR3, the jackknife's up to ``n / (n - 1)``: a heavy user pulls the mean towards itself, so its
    own residual understates its noise; see MacKinnon, Nielsen and Webb, "Cluster-robust inference: a guide to empirical
    practice", 2023). Infinite below 2 users."""
    adj = r / np.maximum(1.0 - lev, 1e-9)
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
