"""Sample-ratio mismatch of a canary's arms (``SrmTest``): do the arms' user and event counts match the share the
assignment drew?

The arms' user counts against the configured share, as a Bernoulli sequence with a conjugate Beta mixture (the
two-arm case of Lindon and Malek, "Anytime-valid inference for multinomial count data", 2020), and their event
counts with a cluster-aware variance (events of one user share its arm: ``Var = s (1 - s) sum(e_u^2) / E^2``) in
the normal mixture of ``deploy.gate.sequential``, two-sided. A mismatch means the assignment or the logging is
broken: no metric of that canary can be trusted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from deploy.gate.sequential import log_mixture_lr
from deploy.gate.sequential_units import UnitSums

MISMATCH, MATCH = "mismatch", "ok"


def _lbeta(a, b):
    lg = np.vectorize(math.lgamma, otypes=[float])
    return lg(a) + lg(b) - lg(np.asarray(a) + np.asarray(b))


def srm_log_bf_counts(x, n, share: float, tau: float = 0.05):
    """log Bayes factor of "a unit lands on the canary with some probability p" (p ~ Beta with mean ``share`` and
    standard deviation ``tau``) against p = ``share``, after ``x`` of ``n`` units on the canary: a nonnegative
    martingale under the null however the units arrive, so 1 / its running maximum is an always-valid p-value."""
    k = max(share * (1 - share) / (tau * tau) - 1.0, 1.0)  # the prior's concentration
    a, b = k * share, k * (1 - share)
    x, n = np.asarray(x, dtype=float), np.asarray(n, dtype=float)
    return _lbeta(a + x, b + n - x) - _lbeta(a, b) - x * math.log(share) - (n - x) * math.log(1 - share)


@dataclass
class SrmTest:
    """Sample-ratio mismatch: do the arms' user and event counts match the configured ``share``? Always valid at
    ``alpha`` (``gate.srm_alpha``) however often it looks; split in two (users, events). Keeps running maxima like
    ``MetricTest`` (store them with the rollout). ``tau``: the size of mismatch it is tuned for (share points)."""

    share: float
    alpha: float = 0.001
    tau: float = 0.05
    max_log_bf_users: float = float("-inf")
    max_log_bf_events: float = float("-inf")

    def __post_init__(self):
        if not (0 < self.share < 1 and 0 < self.alpha < 1 and 0 < self.tau < 0.5):
            raise ValueError(
                f"share and alpha must be in (0, 1), tau in (0, 0.5), got {self.share}, {self.alpha}, {self.tau}"
            )

    def look_units(self, canary: UnitSums, stable: UnitSums) -> dict:
        """One look (or a stack of them) with the user as the unit: users seen per arm (a Beta-binomial mixture)
        and judged events per arm (normal mixture, cluster-aware variance). Uses each arm's ``den`` (the events)."""
        mc, ms = canary.moments, stable.moments
        n = mc["n"] + ms["n"]
        users = srm_log_bf_counts(mc["n"], n, self.share, self.tau)
        e_c, e_s = mc["den"], ms["den"]
        total = e_c + e_s
        s = self.share
        with np.errstate(invalid="ignore", divide="ignore"):
            d = e_c / total - s
            var = s * (1 - s) * ((canary.den**2).sum(-1) + (stable.den**2).sum(-1)) / (total * total)
            events = np.where(total > 0, log_mixture_lr(d, var, 0.0, self.tau), -np.inf)
        return self._update(
            users,
            events,
            {"canary_users": mc["n"], "stable_users": ms["n"], "canary_events": e_c, "stable_events": e_s},
        )

    def look_requests(self, events_canary, events_stable) -> dict:
        """One look (or a stack) with the request as the unit: each event is drawn into an arm on its own."""
        x, n = np.asarray(events_canary, float), np.asarray(events_canary, float) + np.asarray(events_stable, float)
        events = srm_log_bf_counts(x, n, self.share, self.tau)
        return self._update(np.full_like(events, -np.inf), events, {"canary_events": x, "stable_events": n - x})

    def _update(self, users, events, counts: dict) -> dict:
        users = np.maximum(np.maximum.accumulate(np.atleast_1d(users)), self.max_log_bf_users)
        events = np.maximum(np.maximum.accumulate(np.atleast_1d(events)), self.max_log_bf_events)
        self.max_log_bf_users, self.max_log_bf_events = float(users[-1]), float(events[-1])
        # counts of users and events
        out: dict[str, Any] = {k: int(round(float(np.ravel(v)[-1]))) for k, v in counts.items()}
        out |= {"share": self.share, "p_users": self.p_users, "p_events": self.p_events, "verdict": self.verdict()}
        if np.ndim(next(iter(counts.values()))) > 0:
            out["per_look"] = {"mismatch": np.minimum(np.exp(-users), np.exp(-events)) <= self.alpha / 2}
        return out

    @property
    def p_users(self) -> float:
        return min(1.0, math.exp(-self.max_log_bf_users)) if self.max_log_bf_users > float("-inf") else 1.0

    @property
    def p_events(self) -> float:
        return min(1.0, math.exp(-self.max_log_bf_events)) if self.max_log_bf_events > float("-inf") else 1.0

    def verdict(self) -> str:
        """``mismatch`` when either count is shown off the share at ``alpha / 2`` (Bonferroni over the two)."""
        return MISMATCH if min(self.p_users, self.p_events) <= self.alpha / 2 else MATCH
