"""Always-valid sequential tests for canaries: peek after every event, keep the error rate at alpha.

A canary compares a metric of the candidate's traffic with the stable version's (live acceptance, edit rate,
response length, latency, the evaluation suite's score). The gate looks at the comparison continuously and must
be free to stop the moment the evidence is clear, which a fixed-sample test does not allow: peeking at a t-test
after every event promotes a candidate that is no better about a third of the time. The mixture sequential
probability ratio test (mSPRT; Robbins 1970, Johari, Pekelis and Walsh, "Always valid inference", 2017) does.

The estimator. With ``theta = direction * (mean_canary - mean_stable)`` and its estimate ``d`` of variance ``V``
(``V = var_c / n_c + var_s / n_s``, the plug-in variances of the two arms: a Bernoulli arm's ``p(1-p)``, shrunk
towards 1/2 by one pseudo-event per outcome so an arm of all accepts does not have zero variance), the mixture
likelihood ratio of ``theta = theta0`` against a normal mixture ``theta ~ N(theta0, tau^2)`` is

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 * (d - theta0)^2 / (2 V (V + tau^2)))

and ``1 / max Lambda`` so far is an always-valid p-value: under ``theta = theta0`` the chance that ``Lambda`` ever
reaches ``1 / alpha`` is at most ``alpha`` (Ville's inequality; exact for Gaussian increments, asymptotic for
means of bounded metrics, hence ``min_events`` per arm before any decision). Departures from the paper: the test
is used one-sided (a rejection counts only when ``d`` is on the tested side, which can only lower the error), and
``V`` is re-estimated at every look (the paper's plug-in version for unknown variance).

``tau`` is the size of effect the test is tuned for: near the effect one wants to detect (3 points of acceptance:
``tau = 0.03``) it decides fastest there; the error guarantee holds for any ``tau``.

Decisions per metric (``MetricTest.verdict``):
- ``better``: the candidate is better than stable (``theta0 = 0``), or with a ``margin``, not worse by more than it
  (non-inferiority: ``theta0 = -margin``);
- ``worse``: the candidate is worse than stable (``theta0 = 0``, the other side);
- ``undecided`` otherwise.
``Canary.verdict`` combines them as Spotify's rule does: promote when the success metric is ``better`` and every
guardrail is non-inferior; abort as soon as any metric is ``worse``; abort at the deadline if undecided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

BETTER, WORSE, UNDECIDED = "better", "worse", "undecided"
PROMOTE, ABORT, CONTINUE = "promote", "abort", "continue"


def log_mixture_lr(d, var, theta0: float, tau: float):
    """log Lambda of the normal-mixture SPRT; ``d`` and ``var`` may be arrays (one value per look)."""
    t2 = tau * tau
    var = np.maximum(var, 1e-12)
    return 0.5 * np.log(var / (var + t2)) + t2 * (d - theta0) ** 2 / (2.0 * var * (var + t2))


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


@dataclass
class MetricTest:
    """One metric's always-valid comparison, canary against stable.

    ``direction``: +1 when higher is better (acceptance), -1 when lower is better (latency, edit rate).
    ``margin``: 0 tests "better"; > 0 tests "not worse by more than margin" (a guardrail's non-inferiority).
    ``harm_margin``: 0 calls the canary worse as soon as it is shown worse at all (Spotify's deterioration test);
    > 0 only when shown worse by more than this (a tolerance, for metrics such as latency where a small, precisely
    measured difference is not a harm).
    """

    name: str
    alpha: float = 0.05
    tau: float = 0.03
    direction: int = 1
    margin: float = 0.0
    harm_margin: float = 0.0
    bernoulli: bool = True
    min_events: int = 100
    canary: Arm = field(default_factory=Arm)
    stable: Arm = field(default_factory=Arm)
    max_log_lr_pass: float = float("-inf")  # running maxima: the always-valid p-values are 1 / exp(these)
    max_log_lr_harm: float = float("-inf")

    def __post_init__(self):
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.tau <= 0 or self.margin < 0 or self.harm_margin < 0 or self.direction not in (1, -1) \
                or self.min_events < 1:
            raise ValueError("tau must be > 0, margins >= 0, direction +1 or -1, min_events >= 1")

    def add(self, arm: str, value: float, count: int = 1) -> None:
        (self.canary if arm == "canary" else self.stable if arm == "stable" else _bad_arm(arm)).add(value, count)
        self._look()

    def estimate(self) -> tuple[float, float]:
        """(theta, its variance): the signed difference, positive when the canary is better."""
        d = self.direction * (self.canary.mean - self.stable.mean)
        var = self.canary.variance(self.bernoulli) / max(self.canary.n, 1) + \
            self.stable.variance(self.bernoulli) / max(self.stable.n, 1)
        return d, var

    def _look(self) -> None:
        if min(self.canary.n, self.stable.n) < self.min_events:
            return
        d, var = self.estimate()
        if not math.isfinite(var):
            return
        if d > -self.margin:
            self.max_log_lr_pass = max(self.max_log_lr_pass, float(log_mixture_lr(d, var, -self.margin, self.tau)))
        if d < -self.harm_margin:
            self.max_log_lr_harm = max(self.max_log_lr_harm,
                                       float(log_mixture_lr(d, var, -self.harm_margin, self.tau)))

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

    def summary(self) -> dict:
        d, var = self.estimate()
        return {"metric": self.name, "canary_n": self.canary.n, "stable_n": self.stable.n,
                "canary_mean": self.canary.mean, "stable_mean": self.stable.mean, "difference": d,
                "std_error": math.sqrt(var) if math.isfinite(var) else None, "p_pass": self.p_pass,
                "p_harm": self.p_harm, "margin": self.margin, "harm_margin": self.harm_margin,
                "verdict": self.verdict()}


def _bad_arm(arm: str):
    raise ValueError(f"arm must be 'canary' or 'stable', not {arm!r}")


@dataclass
class Canary:
    """The success metric and the guardrails of one rollout.

    An abort on any guardrail shown worse splits alpha across the guardrails (Bonferroni: k chances of a false
    alarm); a promotion needs every guardrail shown non-inferior, each at alpha (an intersection-union test: all must
    pass, so no split is needed for the promotion's error to stay at alpha)."""

    success: MetricTest
    guardrails: list[MetricTest] = field(default_factory=list)

    def verdict(self, deadline_passed: bool = False) -> tuple[str, str]:
        """(promote | abort | continue, why)."""
        k = max(len(self.guardrails), 1)
        for g in self.guardrails:
            if g.verdict(g.alpha / k) == WORSE:
                return ABORT, f"guardrail {g.name} is worse than stable (p {g.p_harm:.3g})"
        s = self.success.verdict()
        if s == WORSE:
            return ABORT, f"{self.success.name} is worse than stable (p {self.success.p_harm:.3g})"
        pending = [g.name for g in self.guardrails if g.p_pass > g.alpha]
        if s == BETTER and not pending:
            shown = "better than stable" if self.success.margin == 0 else \
                f"not worse than stable by more than {self.success.margin:g}"
            return PROMOTE, f"{self.success.name} {shown} (p {self.success.p_pass:.3g}), every guardrail non-inferior"
        if deadline_passed:
            return ABORT, "deadline passed: " + ("; ".join(
                ([f"{self.success.name} undecided"] if s != BETTER else []) +
                [f"guardrail {name} not shown non-inferior" for name in pending]))
        return CONTINUE, "collecting evidence"


# ------------------------------------------------------------------------------------------------ simulation


def simulate(p_stable: float, p_canary: float, share: float, max_events: int, runs: int, *, alpha: float = 0.05,
             tau: float = 0.03, min_events: int = 100, seed: int = 0) -> dict:
    """Canaries on Bernoulli traffic with a look after every event: how often each ends promoted, aborted or
    undecided at ``max_events`` (all traffic, both arms), and after how many events the decision came.

    Vectorised over looks: the cumulative sums of one run give every look's estimate at once, and the running
    maximum of log Lambda is the always-valid test's state after each event (exactly what ``MetricTest`` computes
    one event at a time).
    """
    if not (0 < share < 1 and 0 <= p_stable <= 1 and 0 <= p_canary <= 1 and runs >= 1 and max_events >= 2):
        raise ValueError("share in (0, 1), probabilities in [0, 1], runs >= 1, max_events >= 2")
    rng = np.random.default_rng(seed)
    threshold = math.log(1.0 / alpha)
    outcomes = {PROMOTE: 0, ABORT: 0, "undecided": 0}
    events_to_decision: list[int] = []
    for _ in range(runs):
        to_canary = rng.random(max_events) < share
        accept = np.where(to_canary, rng.random(max_events) < p_canary, rng.random(max_events) < p_stable)
        nc = np.cumsum(to_canary)
        ns = np.arange(1, max_events + 1) - nc
        xc = np.cumsum(accept & to_canary)
        xs = np.cumsum(accept & ~to_canary)
        ok = (nc >= min_events) & (ns >= min_events)
        nc_, ns_ = np.maximum(nc, 1), np.maximum(ns, 1)
        pc, ps = (xc + 1.0) / (nc + 2.0), (xs + 1.0) / (ns + 2.0)
        d = xc / nc_ - xs / ns_
        var = pc * (1 - pc) / nc_ + ps * (1 - ps) / ns_
        llr = np.where(ok, log_mixture_lr(d, var, 0.0, tau), -np.inf)
        up = np.nonzero((llr >= threshold) & (d > 0))[0]
        down = np.nonzero((llr >= threshold) & (d < 0))[0]
        first_up = up[0] if up.size else max_events
        first_down = down[0] if down.size else max_events
        if first_up < first_down:
            outcomes[PROMOTE] += 1
            events_to_decision.append(int(first_up) + 1)
        elif first_down < first_up:
            outcomes[ABORT] += 1
            events_to_decision.append(int(first_down) + 1)
        else:
            outcomes["undecided"] += 1
    ev = sorted(events_to_decision)
    k80 = math.ceil(0.8 * runs) - 1  # the 80th percentile over all runs, undecided ones counting as never
    return {"p_stable": p_stable, "p_canary": p_canary, "share": share, "max_events": max_events, "runs": runs,
            "alpha": alpha, "tau": tau, "min_events": min_events,
            "promoted": outcomes[PROMOTE] / runs, "aborted": outcomes[ABORT] / runs,
            "undecided": outcomes["undecided"] / runs,
            "median_events": ev[len(ev) // 2] if ev else None,
            "p80_events": ev[k80] if k80 < len(ev) else None}
