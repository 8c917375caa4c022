"""Always-valid sequential tests for canaries: peek at every look, keep the error rate at alpha, on the right unit.

A canary compares a metric of the candidate's traffic with the stable version's (kept acceptance, edit rate,
response length, latency). The gate looks at the comparison continuously and must be free to stop the moment the
evidence is clear, which a fixed-sample test does not allow: peeking at a t-test after every event promotes a
candidate that is no better about a third of the time. The mixture sequential probability ratio test (mSPRT;
Robbins 1970, Johari, Pekelis and Walsh, "Always valid inference", 2017) does.

**The test.** Given an estimate ``d`` of ``theta = direction * (metric_canary - metric_stable)`` with variance ``V``,
the mixture likelihood ratio of ``theta = theta0`` against ``theta ~ N(theta0, tau^2)`` is

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 * (d - theta0)^2 / (2 V (V + tau^2)))

and ``1 / max Lambda`` over the looks so far is an always-valid p-value: under ``theta = theta0`` the chance that
``Lambda`` ever reaches ``1 / alpha`` is at most ``alpha`` (Ville's inequality; exact when ``d`` is a Gaussian mean
whose information ``1 / V`` grows look by look, asymptotic otherwise). ``tau`` is the effect the test is tuned for
(``tau = 0.03``: 3 points of acceptance); the guarantee holds for any ``tau``. ``MetricTest`` keeps the running
maxima; each look hands it one ``(d, V)`` (``MetricTest.look``). Where ``(d, V)`` come from is the unit's business:

- ``gate.canary_unit = "request"`` (each request drawn into an arm afresh): the events are the units, ``d`` is the
  difference of the arms' means and ``V = var_c / n_c + var_s / n_s`` with plug-in variances (a Bernoulli arm's
  ``p(1-p)``, shrunk towards 1/2 by one pseudo-event per outcome so an arm of all accepts has a variance).
- ``gate.canary_unit = "user"`` (a user stays on one arm for the whole rollout): the user is the unit
  (``look_units``). A per-event variance is wrong here: users differ (one accepts 70%, another 25%), the two arms
  differ in their mix of users, the difference converges to that mix difference, not to zero, while a per-event
  variance shrinks as 1 / events, so an A/A canary ends up deciding, either way. Each arm's metric is a ratio of
  per-user sums, ``R = sum(num_u) / sum(den_u)`` (kept accepts over judged events), and its variance is the delta
  method's (Deng, Knoblich and Lu, "Applying the Delta Method in Metric Analytics", KDD 2018): the user's
  linearised contribution ``L_u = (num_u - R den_u) / mean(den)`` and ``Var(R) = sum(L_u^2) / n^2`` over the arm's
  ``n`` users (a cluster-robust variance: each user's events stay together), with the small-sample care below.
- **CUPED** (Deng, Xu, Kohavi and Walker, WSDM 2013) on the user unit: a covariate each user had before the rollout
  (``UnitSums.cov``, e.g. the user's kept rate under stable in the ``gate.cuped_lookback_s`` before the start, with
  ``cov_den`` its number of events). Like the metric, each arm's covariate is a ratio over its users,
  ``C = sum(cov_den cov) / sum(cov_den)``, linearised as ``Z_u = cov_den_u (cov_u - C) / mean(cov_den)`` (a user
  without one gets ``Z_u = 0``: the mean imputed). ``d`` becomes ``(R_c - b C_c) - (R_s - b C_s)`` with
  ``b = sum(L Z) / sum(Z^2)`` pooled over both arms, and ``V`` the residuals' ``sum((L - b Z)^2) / n^2`` per arm.
  The covariate is fixed before the rollout, so ``C_c - C_s`` is 0 on average and the estimate unbiased whatever
  ``b``; the variance drops by the share of the users' metric the covariate predicts (``cuped_removed``). Weighing
  ``Z`` by ``cov_den`` matters: users differ in activity as much as in taste, and ``L_u`` grows with the user's
  events, so a covariate that is the rate alone predicts little of it.
- **Latency** (``deploy.gate.sequential_batches``): per-request latencies are autocorrelated (the node's load), so
  the test takes the per-bucket means of each arm, pairs them by time (a load both arms share cancels) and uses the
  differences' variance across buckets, at equal answer length (a heavy user with long answers on one arm is not the
  version's latency).

Departures from the papers, and small-sample care:
- The test is used one-sided (a rejection counts only when ``d`` is on the tested side, which can only lower the
  error) and ``V`` is re-estimated at every look (the paper's plug-in version for unknown variance).
- With the user as the unit the information does not grow without bound: a fixed set of users, each measured ever
  more precisely, leaves the between-user variance. ``d`` then still has the nested-means structure the mixture needs
  (its variance at a later look is its covariance with an earlier one), so the guarantee holds; the test simply
  cannot decide effects smaller than the users' spread allows.
- Few users, of very different activity, make the plain cluster-robust variance too small and ``d / sqrt(V)``
  heavier-tailed than a normal (a heavy user pulls its arm's ratio towards itself, so its residual understates its
  noise). Three corrections, checked by the calibration: each user's residual is divided by ``1 - h_u``, its
  leverage ``h_u = den_u / sum(den)`` capped at 0.9, and with CUPED taken on the slope fitted without the user
  (``deploy.gate.sequential_units``: the two leverages compose, and a sum of them past 1 never divides anything):
  the CR3 / jackknife variance
  (``sum(L^2) / (n - 1)^2`` when users are alike, a little above the textbook ``sum(L^2) / (n (n - 1))``); each
  side's statistic is read as a Student t (``t_widened``, Wallace's 1959 normal equivalent) with
  Welch-Satterthwaite degrees of freedom, each arm's the effective number of users behind its variance
  (``3 (sum r^2)^2 / sum r^4``, which heavy users lower); and no decision is taken before ``min_units`` users per
  arm. The batch-means latency test reads its statistic as a t
  with buckets - 1 degrees of freedom.

**Sample-ratio mismatch**: ``deploy.gate.srm``.

Decisions per metric (``MetricTest.verdict``):
- ``better``: the candidate is better than stable (``theta0 = 0``), or with a ``margin``, not worse by more than it
  (non-inferiority: ``theta0 = -margin``);
- ``worse``: the candidate is worse than stable (``theta0 = 0``, the other side), or worse by more than
  ``harm_margin``;
- ``undecided`` otherwise.
Margins are absolute and fixed when the test is made: a guardrail's tolerance is turned into one from stable's
pre-rollout mean once, at the canary's start, so every look tests the same null.
``Canary.verdict`` combines them as Spotify's rule does: promote when the success metric is ``better`` and every
required guardrail is non-inferior; abort as soon as any metric is ``worse``; at the deadline, decide the pass sides
still open by one fixed-horizon readout, and abort if one still fails; with an evidence budget, abort as ``futile`` a
canary whose success metric or a required guardrail could not pass by the end of the budget even if its effect were
``futility_z`` standard errors better than estimated (``futile``: a non-binding futility stop, which can only lower
the false-promotion rate). The levels each side tests at, so that a false promotion and a false abort each stay at
``alpha`` across the family, the readout, the bias-corrected effect and the always-valid interval every verdict
reports are stated in ``deploy.gate.sequential_readout``.

The calibration (``deploy.gate.canary_sim.simulate_sticky``, run by ``liverl bench canary``) replays this code, look by
look at the gate's cadence, on populations of sticky users assigned by ``core.fleet.bucket``.

The user-unit estimate (``UnitSums``, ``unit_estimate``: delta method, CUPED, CR3, Welch) is in
``deploy.gate.sequential_units``; this module holds the tests that read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from deploy.gate import sequential_readout as ro
from deploy.gate.sequential_units import UnitSums, cap_users, unit_estimate

BETTER, WORSE, UNDECIDED = "better", "worse", "undecided"
PROMOTE, ABORT, CONTINUE = "promote", "abort", "continue"


def log_mixture_lr(d, var, theta0: float, tau: float):
    """log Lambda of the normal-mixture SPRT; ``d`` and ``var`` may be arrays (one value per look)."""
    t2 = tau * tau
    var = np.maximum(var, 1e-12)
    return 0.5 * np.log(var / (var + t2)) + t2 * (d - theta0) ** 2 / (2.0 * var * (var + t2))


def t_widened(var, df, t=3.0):
    """``var`` widened so that ``t = (d - theta0) / sqrt(var)``, a Student t with ``df`` degrees of freedom, reads as
    the normal ``z`` of the same tail: ``var * t^2 / z^2`` with Wallace's (1959) normal equivalent
    ``z = (8 df + 1) / (8 df + 3) * sqrt(df * log(1 + t^2 / df))`` (within a few percent of the exact tail from 3
    degrees of freedom). ``t`` may be an array (one per look); ``df`` below 3 counts as 3; ``inf`` leaves ``var``."""
    df = np.maximum(np.asarray(df, dtype=float), 3.0)
    t2 = np.maximum(np.asarray(t, dtype=float) ** 2, 1e-9)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        c2 = ((8 * df + 1) / (8 * df + 3)) ** 2
        factor = np.where(np.isfinite(df), t2 / (c2 * df * np.log1p(t2 / df)), 1.0)
    return var * np.where(np.isfinite(factor), factor, 1.0)


FUTILITY_Z: float = 1.5
"""How optimistic the futility projection is (``futile``): the estimate it projects is ``z`` standard errors above
the current one (a one-sided 93% upper bound at 1.5). ``gate.canary_futility_z``'s default."""
FUTILITY_MIN_SPENT: float = 0.25
"""No futility stop before this share of the evidence budget is spent: the first looks' variances rest on few users."""


def futile(d, var, spent, theta0: float, tau: float, alpha: float, z: float = FUTILITY_Z, readout_alpha: float = 0.0):
    """Whether a test that has not passed yet could not pass by the end of its evidence budget, even if the effect
    were ``z`` standard errors better than estimated now. ``spent``: the share of the budget behind ``(d, var)``.

    The projection is optimistic on both counts: the effect is the current estimate's upper bound ``d + z sqrt(var)``,
    and the variance at the budget is ``var * spent``, as if information grew in proportion to the events (with the
    user as the unit it grows more slowly: users come back). Futile when that effect is not above ``theta0`` or
    when, read at the budget, its mixture likelihood ratio (``log_mixture_lr``) stays under ``1 / alpha`` and, with
    a readout at the deadline (``readout_alpha`` > 0, ``deploy.gate.sequential_readout``), its fixed-horizon ``z``
    there stays under the readout's one-sided quantile.

    Stopping for futility never promotes, so it cannot raise the false-promotion rate; what it costs is the
    candidates it stops that would have passed by the budget (``deploy.gate.canary_sim.simulate_budget`` measures both).
    Arrays allowed (one value per look)."""
    d, var, spent = (np.asarray(x, dtype=float) for x in (d, var, spent))
    with np.errstate(invalid="ignore"):
        best = d + z * np.sqrt(np.maximum(var, 0.0))
        at_end = np.maximum(var, 1e-12) * np.clip(spent, 1e-6, 1.0)
        lr = log_mixture_lr(best, at_end, theta0, tau)
        readout = (
            (best - theta0) / np.sqrt(at_end) >= NormalDist().inv_cdf(1.0 - readout_alpha)
            if readout_alpha > 0
            else False
        )
    return (
        (spent >= FUTILITY_MIN_SPENT)
        & np.isfinite(d)
        & np.isfinite(var)
        & ((best <= theta0) | ((lr < math.log(1.0 / alpha)) & ~np.asarray(readout)))
    )


# ------------------------------------------------------------------------------------------- one metric's test


@dataclass
class Arm:
    """Running sums of one arm's metric (Bernoulli outcomes or any bounded number)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, value: float, count: int = 1) -> None:
        if not math.isfinite(value):
            raise ValueError(f"a metric value must be finite, got {value}")
        self.n += count
        self.total += value * count
        self.total_sq += value * value * count

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def variance(self, bernoulli: bool) -> float:
        if bernoulli:
            p = (self.total + 1.0) / (self.n + 2.0)  # one pseudo accept and one pseudo reject
            return p * (1.0 - p)
        if self.n < 2:
            return float("inf")
        return max((self.total_sq - self.total * self.total / self.n) / (self.n - 1), 1e-12)


def bernoulli_estimate(n_c, x_c, n_s, x_s, direction: int = 1):
    """(d, var) of the per-event test on Bernoulli counts (events ``n``, successes ``x`` per arm); arrays allowed
    (one value per look). The arithmetic of ``MetricTest.estimate`` for a Bernoulli metric."""
    n_c, n_s = np.maximum(n_c, 1), np.maximum(n_s, 1)
    p_c, p_s = (x_c + 1.0) / (n_c + 2.0), (x_s + 1.0) / (n_s + 2.0)
    d = direction * (x_c / n_c - x_s / n_s)
    return d, p_c * (1 - p_c) / n_c + p_s * (1 - p_s) / n_s


@dataclass
class MetricTest:
    """One metric's always-valid comparison, canary against stable.

    ``direction``: +1 when higher is better (acceptance), -1 when lower is better (latency, edit rate).
    ``margin``: 0 tests "better"; > 0 tests "not worse by more than margin" (a guardrail's non-inferiority).
    ``harm_margin``: 0 calls the canary worse as soon as it is shown worse at all (Spotify's deterioration test);
    > 0 only when shown worse by more than this (a tolerance, for metrics such as latency where a small, precisely
    measured difference is not a harm). Both are absolute and fixed for the test's life (see the module docstring).
    ``min_events``: events each arm needs before any decision; ``min_units``: users each arm needs (``look_units``).
    ``required``: as a guardrail of a ``Canary``, whether a promotion waits for it to be shown non-inferior (True) or
    it only stops a canary it shows worse (False: ``gate.latency_guardrail = "harm"``).

    Two ways to feed it: events (``add``, the per-event test of ``canary_unit = "request"``), or one estimate per
    look from elsewhere (``look``: ``look_units`` for the user unit, ``sequential_batches.batch_means`` for latency).
    """

    name: str
    alpha: float = 0.05
    tau: float = 0.03
    direction: int = 1
    margin: float = 0.0
    harm_margin: float = 0.0
    bernoulli: bool = True
    min_events: int = 100
    min_units: int = 10
    required: bool = True
    canary: Arm = field(default_factory=Arm)
    stable: Arm = field(default_factory=Arm)
    max_log_lr_pass: float = float("-inf")  # running maxima: the always-valid p-values are 1 / exp(these)
    max_log_lr_harm: float = float("-inf")
    last: tuple[float, float] | None = None  # the latest external (d, var), when fed by ``look``
    last_df: float = math.inf  # and its degrees of freedom, and whether that look could count (``final``)
    last_ready: bool = False

    def __post_init__(self):
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if (
            self.tau <= 0
            or self.margin < 0
            or self.harm_margin < 0
            or self.direction not in (1, -1)
            or self.min_events < 1
            or self.min_units < 2
        ):
            raise ValueError("tau must be > 0, margins >= 0, direction +1 or -1, min_events >= 1, min_units >= 2")

    def add(self, arm: str, value: float, count: int = 1) -> None:
        (self.canary if arm == "canary" else self.stable if arm == "stable" else _bad_arm(arm)).add(value, count)
        self._look()

    def estimate(self) -> tuple[float, float]:
        """(theta, its variance): the signed difference, positive when the canary is better. The latest external
        estimate when the test is fed by ``look``, else the per-event one from the arms' sums."""
        if self.last is not None:
            return self.last
        if self.bernoulli:
            d, var = bernoulli_estimate(
                self.canary.n, self.canary.total, self.stable.n, self.stable.total, self.direction
            )
            return float(d), float(var)
        d = self.direction * (self.canary.mean - self.stable.mean)
        var = self.canary.variance(False) / max(self.canary.n, 1) + self.stable.variance(False) / max(self.stable.n, 1)
        return d, var

    def _look(self) -> None:
        """A look at the arms' event sums (the per-event path; scalar, as it runs once per event in ``add``)."""
        if min(self.canary.n, self.stable.n) < self.min_events:
            return
        d, var = self.estimate()
        if not math.isfinite(var):
            return
        if d > -self.margin:
            self.max_log_lr_pass = max(self.max_log_lr_pass, float(log_mixture_lr(d, var, -self.margin, self.tau)))
        if d < -self.harm_margin:
            self.max_log_lr_harm = max(self.max_log_lr_harm, float(log_mixture_lr(d, var, -self.harm_margin, self.tau)))

    def look(self, d, var, ready=True, df=np.inf) -> tuple[np.ndarray, np.ndarray]:
        """One look from an external estimate ``d`` of ``theta`` with variance ``var``: the running maxima take it.

        ``df``: the degrees of freedom of ``var`` when it is estimated from few units (users, batches): each side's
        statistic is then read as a Student t (``t_widened``). ``d``, ``var``, ``ready`` (whether the look may count:
        enough users and events) and ``df`` may be arrays of looks in time order (the simulation hands a whole
        canary's looks at once); the state afterwards is the same as after looking at each in turn. Returns the
        running maxima (pass, harm) after each look."""
        self.last = (float(np.ravel(d)[-1]), float(np.ravel(var)[-1]))
        self.last_df = float(np.ravel(np.broadcast_to(df, np.shape(d)))[-1])
        self.last_ready = bool(np.ravel(np.broadcast_to(ready, np.shape(d)))[-1])
        return self._update(d, var, ready, df)

    def _update(self, d, var, ready, df=np.inf) -> tuple[np.ndarray, np.ndarray]:
        d, var, ready, df = np.broadcast_arrays(
            np.asarray(d, float), np.asarray(var, float), np.asarray(ready, bool), np.asarray(df, float)
        )
        ok = ready & np.isfinite(var) & np.isfinite(d)
        sides = []
        for theta0, on_side in ((-self.margin, d > -self.margin), (-self.harm_margin, d < -self.harm_margin)):
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                v = t_widened(var, df, (d - theta0) / np.sqrt(var))
                sides.append(np.where(ok & on_side, log_mixture_lr(d, v, theta0, self.tau), -np.inf))
        pass_ = np.maximum(np.maximum.accumulate(np.atleast_1d(sides[0])), self.max_log_lr_pass)
        harm = np.maximum(np.maximum.accumulate(np.atleast_1d(sides[1])), self.max_log_lr_harm)
        self.max_log_lr_pass, self.max_log_lr_harm = float(pass_[-1]), float(harm[-1])
        return pass_, harm

    @property
    def p_pass(self) -> float:
        """Always-valid p-value of "not better" (or "worse by more than the margin")."""
        return min(1.0, math.exp(-self.max_log_lr_pass)) if self.max_log_lr_pass > float("-inf") else 1.0

    @property
    def p_harm(self) -> float:
        """Always-valid p-value of "not worse" (by more than ``harm_margin``)."""
        return min(1.0, math.exp(-self.max_log_lr_harm)) if self.max_log_lr_harm > float("-inf") else 1.0

    def verdict(self, alpha: float | None = None) -> str:
        a = self.alpha if alpha is None else alpha
        if self.p_harm <= a:
            return WORSE
        if self.p_pass <= a:
            return BETTER
        return UNDECIDED

    def futile(
        self, spent: float, z: float = FUTILITY_Z, alpha: float | None = None, readout_alpha: float = 0.0
    ) -> bool:
        """Whether this test, not passed yet, could not pass within its budget (``futile``; ``spent``: the share of
        the evidence budget behind the latest estimate; ``alpha``: its sequential pass level, ``readout_alpha``: the
        deadline readout's, ``Canary.pass_alphas``)."""
        a = self.alpha if alpha is None else alpha
        if self.p_pass <= a or (self.last is None and min(self.canary.n, self.stable.n) < self.min_events):
            return False  # passed, or nothing measured yet
        d, var = self.estimate()
        return bool(futile(d, var, spent, -self.margin, self.tau, a, z, readout_alpha))

    def final(self) -> tuple[float, float, float] | None:
        """(d, var, df) of the latest look that could count (enough units and events, a finite variance): what the
        readout at the deadline tests (``deploy.gate.sequential_readout``); None before one."""
        if self.last is not None:
            d, var = self.last
            ok = self.last_ready
            df = self.last_df
        else:
            (d, var), df = self.estimate(), math.inf
            ok = min(self.canary.n, self.stable.n) >= self.min_events
        return (d, var, df) if ok and math.isfinite(d) and math.isfinite(var) and var > 0 else None

    def readout_p(self) -> float:
        """The fixed-horizon one-sided p-value of the pass side's null at the latest look (``readout_p``); 1 without
        one that could count."""
        f = self.final()
        return 1.0 if f is None else ro.readout_p(f[0], f[1], f[2], -self.margin)

    def effect(self, alpha: float | None = None) -> dict:
        """The effect at the latest look (positive when the canary is better): raw, bias-corrected (``ro.shrunk``)
        and its always-valid ``1 - alpha`` interval (``ro.confidence_sequence``); None where there is none yet."""
        f = self.final()
        if f is None:
            return {"effect": None, "effect_corrected": None, "effect_lo": None, "effect_hi": None}
        d, var, df = f
        lo, hi = ro.confidence_sequence(d, var, df, self.tau, self.alpha if alpha is None else alpha)
        return {"effect": d, "effect_corrected": ro.shrunk(d, var, self.tau), "effect_lo": lo, "effect_hi": hi}

    def summary(self) -> dict:
        d, var = self.estimate()
        return {
            "metric": self.name,
            "canary_n": self.canary.n,
            "stable_n": self.stable.n,
            "canary_mean": self.canary.mean,
            "stable_mean": self.stable.mean,
            "difference": d,
            "std_error": math.sqrt(var) if math.isfinite(var) else None,
            "p_pass": self.p_pass,
            "p_harm": self.p_harm,
            "margin": self.margin,
            "harm_margin": self.harm_margin,
            "verdict": self.verdict(),
        }


def _bad_arm(arm: str):
    raise ValueError(f"arm must be 'canary' or 'stable', not {arm!r}")


# ----------------------------------------------------------------------------------------- the user as the unit


def look_units(
    test: MetricTest, canary: UnitSums, stable: UnitSums, cuped: bool = False, user_cap: float | None = None
) -> dict:
    """One look of ``test`` with the user as the unit: what the gate calls at each look, and what the calibration
    (``deploy.gate.canary_sim.simulate_sticky``) calls, on a stack of looks at once.

    Estimates theta by ``unit_estimate`` (CUPED when ``cuped``; heavy users' weight capped at the ``user_cap``
    quantile of the users' events, ``cap_users``), widens the variance for few users (``t_widened``),
    and feeds the test when each arm has ``test.min_units`` users and ``test.min_events`` events. The arms' event
    sums are kept in ``test.canary`` / ``test.stable`` (so ``test.summary()`` shows the arms' ratios). Returns a
    summary: the test's (``MetricTest.summary``) and the estimate's parts; with a stack of looks, the per-look arrays
    too (``per_look``: ``d``, ``var``, ``max_log_lr_pass``, ``max_log_lr_harm``, ``cuped_removed``, ``ready``)."""
    events = canary.den.sum(-1), stable.den.sum(-1)  # in full, whatever the cap
    if user_cap is not None and user_cap < 1.0:
        canary, stable = cap_users(canary, stable, user_cap)
    est = unit_estimate(canary, stable, test.direction, cuped)
    ready = (np.minimum(est.users_canary, est.users_stable) >= test.min_units) & (
        np.minimum(*events) >= test.min_events
    )
    pass_, harm = test.look(est.d, est.var, ready, est.df)
    for arm, n_events, ratios in (
        (test.canary, events[0], est.ratio_canary),
        (test.stable, events[1], est.ratio_stable),
    ):
        n, ratio = float(np.ravel(n_events)[-1]), float(np.ravel(ratios)[-1])
        arm.n, arm.total = int(n), (ratio * n if math.isfinite(ratio) else 0.0)
    last = lambda a: float(np.ravel(a)[-1])  # noqa: E731
    out = test.summary() | {
        "unit": "user",
        "cuped": cuped,
        "canary_users": int(last(est.users_canary)),
        "stable_users": int(last(est.users_stable)),
        "variance": last(est.var),
        "variance_raw": last(est.var_raw),
        "df": last(est.df),
        "cuped_removed": last(est.cuped_removed),
        "ready": bool(np.ravel(ready)[-1]),
    }
    if np.ndim(est.d) > 0:
        out["per_look"] = {
            "d": est.d,
            "var": est.var,
            "df": est.df,
            "max_log_lr_pass": pass_,
            "max_log_lr_harm": harm,
            "cuped_removed": est.cuped_removed,
            "ready": ready,
        }
    return out


# ------------------------------------------------------------------------------------------------- the canary


@dataclass
class Canary:
    """The success metric and the guardrails of one rollout, and the error each of its decisions is held at
    (``deploy.gate.sequential_readout`` states the arithmetic; ``m = 1 + len(guardrails)``): P(false promotion) <=
    alpha, each pass side at alpha (an intersection-union test), spent as ``alpha (1 - readout_share)`` on the
    sequential test and ``alpha readout_share`` on one readout at the deadline (union bound); P(false abort) <= alpha,
    each of the ``m`` harm sides at ``alpha / m`` (Bonferroni). ``readout_share`` 0: no readout, an undecided canary
    aborts at the deadline. A guardrail not ``required`` only aborts: a promotion does not wait for it, so nothing
    bounds the chance of promoting a canary worse on it by less than what the test can show."""

    success: MetricTest
    guardrails: list[MetricTest] = field(default_factory=list)
    readout_share: float = 0.0

    def __post_init__(self):
        ro.pass_alphas(self.success.alpha, self.readout_share)  # validates the share

    @property
    def tests(self) -> list[MetricTest]:
        return [self.success, *self.guardrails]

    def pass_alphas(self, t: MetricTest) -> tuple[float, float]:
        """(sequential, readout) levels of ``t``'s pass side."""
        return ro.pass_alphas(t.alpha, self.readout_share)

    def harm_alpha(self, t: MetricTest) -> float:
        """The level of ``t``'s harm side: its alpha over the ``m`` tests that may abort."""
        return ro.harm_alpha(t.alpha, len(self.tests))

    def guarantee(self) -> dict:
        """The family's levels, for the look record and the verdict's text."""
        seq_a, ro_a = self.pass_alphas(self.success)
        a, m = self.success.alpha, len(self.tests)
        return {
            "alpha": a,
            "tests": m,
            "pass_alpha": seq_a,
            "readout_alpha": ro_a,
            "harm_alpha": self.harm_alpha(self.success),
        }

    def guarantee_text(self) -> str:
        g = self.guarantee()
        split = (
            f"sequential {g['pass_alpha']:g} + readout {g['readout_alpha']:g}" if g["readout_alpha"] else "sequential"
        )
        return (
            f"false promotion <= {g['alpha']:g} ({split}); false abort <= {g['alpha']:g} "
            f"({g['harm_alpha']:.3g} on each of {g['tests']} tests' harm side)"
        )

    def verdict(
        self,
        deadline_passed: bool = False,
        deadline_why: str = "deadline passed",
        spent: float | None = None,
        futility_z: float | None = None,
    ) -> tuple[str, str]:
        """(promote | abort | continue, why). Past the deadline (in time or evidence: ``deadline_why`` says which),
        the pass sides still open are read out once at the fixed horizon (with ``readout_share`` > 0): the canary
        promotes if they all pass there, and aborts otherwise. With an evidence budget (``spent``: the share of it
        used so far) and ``futility_z``, a canary whose success metric or a required guardrail could not pass within
        the budget even ``futility_z`` standard errors better than estimated (``futile``, readout included) aborts
        now, as "futile"."""
        for t in (*self.guardrails, self.success):
            if t.p_harm <= self.harm_alpha(t):
                what = "guardrail " if t is not self.success else ""
                return ABORT, (
                    f"{what}{t.name} is worse than stable (p {t.p_harm:.3g} <= {self.harm_alpha(t):.3g}, alpha "
                    f"{t.alpha:g} over the {len(self.tests)} tests that may abort; {self.guarantee_text()})"
                )
        s = self.success
        s_passed = s.p_pass <= self.pass_alphas(s)[0]
        pending = [g for g in self.guardrails if g.required and g.p_pass > self.pass_alphas(g)[0]]
        watched = [g.name for g in self.guardrails if not g.required]
        every = "every " + ("required " if watched else "") + "guardrail non-inferior"
        every += f" ({', '.join(watched)}: not shown worse)" if watched else ""
        if s_passed and not pending:
            return PROMOTE, f"{s.name} {_goal(s)} (p {s.p_pass:.3g}), {every}; {self.guarantee_text()}"
        if spent is not None and futility_z is not None and spent < 1.0 and not deadline_passed:
            hopeless = [
                t for t in ([] if s_passed else [s]) + pending if t.futile(spent, futility_z, *self.pass_alphas(t))
            ]
            if hopeless:
                return ABORT, f"futile with {spent:.0%} of the evidence budget spent: " + "; ".join(
                    _futile_why(t, futility_z, self.pass_alphas(t)[0]) for t in hopeless
                )
        if deadline_passed:
            open_ = ([] if s_passed else [s]) + pending
            read = {t.name: t.readout_p() for t in open_} if self.readout_share > 0 else {}
            if read and all(read[t.name] <= self.pass_alphas(t)[1] for t in open_):
                return PROMOTE, (
                    deadline_why
                    + ": the readout at the fixed horizon passes: "
                    + "; ".join(
                        f"{t.name} {_goal(t)} (p {read[t.name]:.3g} <= {self.pass_alphas(t)[1]:g})" for t in open_
                    )
                    + f"; {every}; {self.guarantee_text()}"
                )
            # with the p-values it ended at, so that on-call sees how far each test was from deciding
            return ABORT, deadline_why + ": " + "; ".join(
                (f"{t.name} undecided" if t is s else f"guardrail {t.name} not shown non-inferior")
                + f" (p {t.p_pass:.3g} against {self.pass_alphas(t)[0]:g}"
                + (f"; readout p {read[t.name]:.3g} against {self.pass_alphas(t)[1]:g}" if read else "")
                + ")"
                for t in open_
            )
        return CONTINUE, "collecting evidence"


def _goal(t: MetricTest) -> str:
    return "better than stable" if t.margin == 0 else f"not worse than stable by more than {t.margin:g}"


def _futile_why(t: MetricTest, z: float, alpha: float) -> str:
    d, var = t.estimate()
    return (
        f"{t.name} cannot be shown {_goal(t)} by the budget even {z:g} standard errors above its estimate "
        f"(effect {d:+.4g} ± {math.sqrt(max(var, 0.0)):.2g}, positive when better; p {t.p_pass:.3g} against "
        f"{alpha:g})"
    )
