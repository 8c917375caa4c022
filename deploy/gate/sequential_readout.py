"""What a canary's tests claim together, and what they read out beyond the running maxima: the family's error
split, the fixed-horizon readout at the deadline, the bias-corrected effect and the always-valid interval.

``deploy.gate.sequential.Canary`` applies these; ``deploy.gate.canary_sim_stats`` calibrates them
(``liverl bench canary --stats``).

**The family's error guarantee.** A canary runs ``m = 1 + k`` tests, the success metric and ``k`` guardrails, each
with a pass side (better, or within a margin: ``theta0 = -margin``) and a harm side (worse, or worse by more than
``harm_margin``). Two decisions can be wrong, and each is held at ``alpha`` (``gate.canary_alpha``) whatever the
truth:

- *False promotion*: promoted while the success metric is not better (``theta <= theta0``) or a required guardrail
  is inferior beyond its margin. A promotion needs every one of those pass sides to reject (an intersection-union
  test, Berger 1982): whichever null is true, its own test rejected falsely, so
  ``P(false promotion) <= max_i P(test i passes falsely) <= alpha`` with no split over the tests. Each pass side
  spends ``alpha`` in two parts (``pass_alphas``): ``alpha (1 - s)`` on the always-valid sequential test (Ville's
  inequality: at any look) and ``alpha s`` on one fixed-horizon test at the deadline (``readout_p``), ``s`` being
  ``gate.canary_readout_share``; a false pass needs one of the two, so by the union bound
  ``P <= alpha (1 - s) + alpha s = alpha``.
- *False abort*: aborted as shown worse while no metric is worse (beyond its ``harm_margin``). Any of the ``m``
  harm sides may fire, so each tests at ``alpha / m`` (``harm_alpha``; Bonferroni):
  ``P(false abort) <= m * alpha / m = alpha``. A guardrail that is not required counts among the ``m``: it can abort.

In an A/A canary both families' nulls are true at once, so ``P(any false decision) <= 2 alpha`` at worst; the
calibration measures each family apart (``deploy.gate.canary_sim_stats.simulate_readout``). Outside the family: the
sample-ratio check (``gate.srm_alpha``) aborts a canary whose assignment is broken, not one shown worse; the
futility stop and the deadline's abort never claim a harm and never promote, so they add no error of either kind.

**The readout at the deadline** (Eppo's hybrid of sequential and fixed-sample analysis). A canary still undecided
when its deadline (in time, ``gate.canary_deadline_s``, or evidence, ``gate.canary_max_events``) passes is not simply
aborted: each pass side still open is tested once, as a fixed-sample one-sided test on the last look's estimate, with
the same unit, variance and degrees of freedom as that look (``MetricTest.final``):
``t = (d - theta0) / sqrt(V)`` read as a Student t with ``df`` (``readout_p``: Wallace's normal equivalent, as the
sequential test reads it), passing at ``alpha s``. The mixture's boundary at the deadline is far above a fixed
test's (``sqrt(2 log(1/alpha) + log(1 + tau^2 / V))`` standard errors against ``z_{1-alpha s}``), which is what the
readout buys back. The deadline's time is fixed at the start and the budget counts events, not outcomes, so the
sample the readout sees is fixed in advance in the sense the test needs. It promotes only when the success metric
passes (sequentially or at the readout) and every required guardrail passes its non-inferiority (sequentially or at
the readout).

**The bias-corrected effect** (``shrunk``). A canary that stops early stops because its estimate ran high: the raw
difference of promoted canaries overstates their effect (the winner's curse). The correction is the posterior mean
under the test's own mixture prior ``theta ~ N(c, tau^2)`` given ``d ~ N(theta, V)``:

    theta_hat = c + (d - c) * tau^2 / (tau^2 + V)

A posterior depends on the data only through the likelihood, so the stopping rule leaves it unchanged (the
likelihood principle): averaged over effects drawn from the prior, ``E[theta - theta_hat | promoted] = 0`` for any
stopping rule. ``c`` is 0 (no effect): the success metric's mixture when its margin is 0, and the natural centre of
an effect estimate when a non-inferiority margin moves the mixture's (a margin is a tolerance, not a belief about the
effect). The shrinkage is largest where the bias is, early looks with a large ``V``; at a fixed effect far above
``tau`` it pulls an estimate below the truth.

**The always-valid interval** (``confidence_sequence``): the effects the mixture does not reject at the look,
``{theta : Lambda(d, V; theta) < 1 / alpha}``, two-sided, with ``V`` widened for few units as the test widens it.
Under the mixture's conditions every look's interval covers the effect with probability ``1 - alpha`` at once over
all looks (Howard et al., "Time-uniform, nonparametric, nonasymptotic confidence sequences", 2021), so the interval
at a data-dependent stop, unlike a fixed-sample one, keeps its coverage.
"""

from __future__ import annotations

import math


def pass_alphas(alpha: float, share: float) -> tuple[float, float]:
    """(sequential, readout) levels of one pass side: ``alpha (1 - share)`` and ``alpha share``; they sum to alpha."""
    if not (0 < alpha < 1 and 0 <= share < 1):
        raise ValueError(f"alpha must be in (0, 1) and the readout's share in [0, 1), got {alpha}, {share}")
    return alpha * (1.0 - share), alpha * share


def harm_alpha(alpha: float, tests: int) -> float:
    """Each harm side's level when ``tests`` tests (the success metric and every guardrail) may abort: Bonferroni."""
    if tests < 1:
        raise ValueError(f"a canary has at least one test, got {tests}")
    return alpha / tests


def normal_equivalent(t: float, df: float) -> float:
    """The standard normal quantile with the tail of Student's ``t`` with ``df`` degrees of freedom (Wallace 1959:
    ``z = (8 df + 1) / (8 df + 3) sqrt(df log(1 + t^2 / df))``, signed; the reading ``sequential.t_widened`` gives
    the sequential test). ``df`` below 3 counts as 3, as there; ``inf`` returns ``t``."""
    if not math.isfinite(t):
        return t
    if not math.isfinite(df):
        return t
    df = max(df, 3.0)
    z = (8 * df + 1) / (8 * df + 3) * math.sqrt(df * math.log1p(t * t / df))
    return math.copysign(z, t)


def readout_p(d: float, var: float, df: float, theta0: float) -> float:
    """One-sided fixed-horizon p-value of ``theta <= theta0`` (the pass side's null) from the estimate ``d`` of
    ``theta`` with variance ``var`` and ``df`` degrees of freedom; 1 when the estimate is not finite."""
    if not (math.isfinite(d) and math.isfinite(var) and var > 0):
        return 1.0
    z = normal_equivalent((d - theta0) / math.sqrt(var), df)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def shrunk(d: float, var: float, tau: float, center: float = 0.0) -> float:
    """The posterior mean of ``theta`` under the mixture's prior ``N(center, tau^2)`` (module docstring)."""
    if not (math.isfinite(d) and math.isfinite(var)):
        return float("nan")
    return center + (d - center) * tau * tau / (tau * tau + max(var, 0.0))


def _log_lr_at(t: float, var: float, df: float, tau: float) -> float:
    """log Lambda at ``d - theta = t sqrt(var)``, with the variance widened for ``df`` as the test widens it."""
    z = normal_equivalent(t, df)
    v = var * (t * t / (z * z)) if z != 0 else var
    t2 = tau * tau
    return 0.5 * math.log(v / (v + t2)) + t2 * t * t * var / (2.0 * v * (v + t2))


def confidence_sequence(d: float, var: float, df: float, tau: float, alpha: float) -> tuple[float, float]:
    """The always-valid ``1 - alpha`` interval of ``theta`` at this look (module docstring): ``d`` plus or minus the
    distance at which the mixture's likelihood ratio reaches ``1 / alpha`` (bisection on the standardised distance,
    along which it grows). (nan, nan) without a finite estimate."""
    if not (math.isfinite(d) and math.isfinite(var) and var > 0 and 0 < alpha < 1 and tau > 0):
        return float("nan"), float("nan")
    target = math.log(1.0 / alpha)
    lo, hi = 0.0, 1.0
    while _log_lr_at(hi, var, df, tau) < target and hi < 1e6:
        hi *= 2.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _log_lr_at(mid, var, df, tau) < target else (lo, mid)
    r = hi * math.sqrt(var)
    return d - r, d + r
