"""A gate that waits for off-policy evidence when no canary can run, instead of refusing at once.

With two or more configured nodes, a candidate the off-policy check cannot judge (an effective sample size under
``gate.offpolicy_min_ess``: ``deploy.gate.offpolicy``) goes through a canary. With one node (or
``gate.canary_share`` 0) no canary can run, and the estimate on held-out feedback is the only evidence a candidate can
pass on. For a fixed candidate against a fixed behaviour policy that evidence grows with the held-out samples: the
ESS is about ``e * n``, where the efficiency ``e`` (ESS / n) depends on how far the candidate moved from what the
users were served. So the gate waits for it (``Waiting``, a part of ``deploy.gate.gate.Gate``):

1. **The waited-on candidate.** The first candidate whose evidence is too thin is kept pending with the checks it
   passed (integrity, drift, collapse, suite). Newer candidates wait behind it, not superseded: its evidence only
   grows, where the newest candidate changes with every ``learner.candidate_every_steps`` updates, and the wait's
   projection and bound are about one candidate. The newest is not the better bet either: in a measured one-node run
   the candidate emitted 250 s after the waited-on one was as far from the logged behaviour (unclipped ESS 20% of the
   samples against 18%) and, judged once the waited-on one was promoted, was shown worse than it (-0.12 reward).
2. **Looks.** It is judged again, off-policy only (its other checks stand while the stable version is the same),
   each time the usable held-out samples grew by ``RELOOK_GROWTH`` (at least ``RELOOK_MIN`` samples), or when the
   projection says enough are there. Each look is recorded in the registry (check ``offpolicy_wait``: the ESS
   against the minimum) and in ``liverl_gate_offpolicy_wait{figure}``, with what it waits for: the samples needed
   at the candidate's efficiency now, how many judged events that is at ``ingest.heldout_share``, and when at the
   recent arrival rate.
3. **The end.** Promoted when the check passes; refused when it shows the candidate worse (``failed offpolicy``); or
   refused at the bound (``failed offpolicy_wait``): ``gate.offpolicy_wait_s`` after its first look, or at once when
   the held-out window (``gate.heldout_samples``) is full and the ESS still under the minimum (the window slides:
   more samples of the same behaviour cannot raise it). The learner counts such a refusal against its lineage
   (``learner.candidates.evidence_against``): after ``learner.rebase_after_refusals`` of them it rebases onto stable
   at a backed-off learning rate, and a candidate closer to stable needs fewer samples.

A version reaches users only on evidence: nothing here promotes without a look whose check passed. A restarted gate
resumes the wait of the oldest pending candidate with a waiting record against the same stable version, from its
first look, so a restart does not reset the bound. The wait, the alternative (a switchback canary on the one node)
and their measured costs: docs/release.md, "One node".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import prometheus_client as prom

from core.config import LiverlConfig
from deploy.gate.verdict import Verdict
from deploy.registry.blobstore import BlobError
from deploy.registry.delta import DeltaError
from deploy.registry.registry import Registry, RegistryError, Version

log = logging.getLogger("liverl.gate")

RELOOK_GROWTH = 0.10
"""A waited-on candidate is judged again once its usable held-out samples grew by this share (its ESS by about as
much): about 24 looks on the way from 10 samples to 100, not one a poll."""
RELOOK_MIN = 5
"""... and by at least this many samples."""
RATE_WINDOW_S = 600.0
"""The arrival rate of held-out samples is read over the last this many seconds (or since the oldest one held)."""
RATE_MIN_SPAN_S = 30.0
"""Under this span of held-out judgements the rate is not estimated."""
CHECK = "offpolicy_wait"
"""The gate check of each look, and of the refusal at the bound."""
FIGURES = ("version", "ess", "min_ess", "samples", "samples_needed", "eta_seconds", "waited_seconds", "left_seconds")


@dataclass(frozen=True)
class OffpolicyLook:
    """What one off-policy check found (``EvidenceChecks._offpolicy``)."""

    verdict: str  # pass | refuse | defer
    ess: float  # the smallest of the four effective sample sizes (0: no usable sample)
    n: int  # usable held-out samples the estimate rests on
    full: bool  # the held-out window holds gate.heldout_samples usable records: it only slides from here
    rate: float | None  # held-out samples judged per second, recently (None: not known yet)
    low: str = ""  # which effective sample sizes are under the minimum, e.g. "candidate unclipped 31"


def arrival_rate(samples: Sequence, now: float) -> float | None:
    """Held-out samples judged per second over the last ``RATE_WINDOW_S`` (or since the oldest record held), from
    the held-out records (``HeldoutSample``: ``judged_at``, ``kind``; a revert is a second record of a sample)."""
    times = [s.judged_at for s in samples if s.kind != "revert"]
    if not times:
        return None
    span = min(RATE_WINDOW_S, now - min(times))
    if span < RATE_MIN_SPAN_S:
        return None
    return sum(t >= now - span for t in times) / span


@dataclass(frozen=True)
class Projection:
    needed: int | None  # usable samples the minimum ESS needs at the candidate's efficiency now (None: unknown)
    more: int | None  # how many more than there are
    eta_s: float | None  # at the recent arrival rate (inf: none arrive; None: rate unknown)


def project(look: OffpolicyLook, min_ess: float) -> Projection:
    if look.n == 0 or look.ess <= 0:
        return Projection(None, None, None)
    needed = math.ceil(min_ess * look.n / look.ess)
    more = max(0, needed - look.n)
    if look.rate is None:
        eta = None
    elif more == 0:
        eta = 0.0
    else:
        eta = more / look.rate if look.rate > 0 else math.inf
    return Projection(needed, more, eta)


def duration(s: float) -> str:
    if math.isinf(s):
        return "never at this rate"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


@dataclass
class Wait:
    """The candidate the gate waits on."""

    version: int
    stable: int  # the stable version its checks were run against
    since: float  # its first look
    checks: dict[str, bool]  # the checks it passed at its first look
    look: OffpolicyLook  # the latest
    reason: str = ""


class Waiting:
    """The gate's wait for off-policy evidence (see the module doc); one candidate at a time."""

    def __init__(self, cfg: LiverlConfig, metrics: prom.CollectorRegistry):
        self.cfg = cfg
        self.state: Wait | None = None
        self._resumed = False
        self._gauge = prom.Gauge(
            "liverl_gate_offpolicy_wait",
            "The candidate the gate waits on for off-policy evidence (one node: no canary): its version (0: none), "
            "ESS now and needed, usable held-out samples now and needed, estimated seconds to go, seconds waited and "
            "left to the bound",
            ["figure"],
            registry=metrics,
        )
        self.clear()

    def enabled(self) -> bool:
        return self.cfg.gate.offpolicy_wait_s > 0

    def clear(self) -> None:
        self.state = None
        for f in FIGURES:
            self._gauge.labels(f).set(0.0)

    # ------------------------------------------------------------------------------------------ which candidate

    def current(self, registry: Registry, pending: list[Version], stable: Version) -> Version | None:
        """The pending candidate being waited on, if any. A wait ends without a verdict here when its candidate is no
        longer pending (an operator acted on it) or the stable version changed (its checks were against another)."""
        if not self._resumed:
            self._resumed = True
            self._resume(registry, pending, stable)
        w = self.state
        if w is None:
            return None
        row = next((r for r in pending if r.version == w.version), None)
        if row is None or w.stable != stable.version:
            log.info("gate: no longer waiting on version %d (no longer a candidate, or stable changed)", w.version)
            self.clear()
            return None
        return row

    def _resume(self, registry: Registry, pending: list[Version], stable: Version) -> None:
        """After a restart: the oldest pending candidate with a waiting record against this stable version (one whose
        detail names it) waits again, from its first look."""
        if not self.enabled():
            return
        now = time.time()
        for row in pending:
            looks = [g for g in registry.gate_results(row.version) if g.check == CHECK]
            if looks and looks[-1].passed and f"stable v{stable.version}:" in (looks[-1].detail or ""):
                checks = {g.check: g.passed for g in registry.gate_results(row.version) if g.check != CHECK}
                look = OffpolicyLook("defer", looks[-1].value or 0.0, 0, False, None)
                self.state = Wait(row.version, stable.version, looks[0].at, {**checks, "needs_canary": True}, look)
                log.info("gate: waiting on version %d again (first look %.0f s ago)", row.version, now - looks[0].at)
                return

    # ------------------------------------------------------------------------------------------ when to look

    def due(self, n_now: int, now: float) -> bool:
        """Whether the waited-on candidate is judged again: its usable samples grew enough, the projection says
        they suffice, or the bound has come (a last look when anything new arrived)."""
        w = self.state
        assert w is not None
        if n_now <= w.look.n:
            return False
        step = max(RELOOK_MIN, math.ceil(RELOOK_GROWTH * w.look.n))
        p = project(w.look, self.cfg.gate.offpolicy_min_ess)
        return (
            n_now >= w.look.n + step
            or (p.needed is not None and n_now >= p.needed)
            or now - w.since >= self.cfg.gate.offpolicy_wait_s
        )

    def expired(self, now: float) -> bool:
        w = self.state
        return w is not None and now - w.since >= self.cfg.gate.offpolicy_wait_s

    # ------------------------------------------------------------------------------------------ a look's outcome

    def observe(self, row: Version, stable: Version, checks: dict[str, bool], look: OffpolicyLook, now: float) -> Wait:
        """Start the wait on ``row`` (its first look) or update it with ``look``."""
        w = self.state
        if w is None or w.version != row.version:
            w = self.state = Wait(row.version, stable.version, now, dict(checks), look)
            log.info("gate: version %d: waiting for off-policy evidence (ESS %.0f)", row.version, look.ess)
        w.look = look
        p = project(look, self.cfg.gate.offpolicy_min_ess)
        waited = now - w.since
        for figure, value in (
            ("version", row.version),
            ("ess", look.ess),
            ("min_ess", self.cfg.gate.offpolicy_min_ess),
            ("samples", look.n),
            ("samples_needed", p.needed if p.needed is not None else math.nan),
            ("eta_seconds", p.eta_s if p.eta_s is not None else math.nan),
            ("waited_seconds", waited),
            ("left_seconds", max(0.0, self.cfg.gate.offpolicy_wait_s - waited)),
        ):
            self._gauge.labels(figure).set(value)
        return w

    def refusal(self, now: float) -> str | None:
        """Why the waited-on candidate is refused now (the bound), or None: it waits on."""
        w = self.state
        assert w is not None
        g, look = self.cfg.gate, w.look
        waited = duration(now - w.since)
        ess = f"ESS {look.ess:.0f} of the {g.offpolicy_min_ess:g} needed on {look.n} held-out samples" + (
            f" ({look.low})" if look.low else ""
        )
        if look.full:
            return (
                f"failed {CHECK}: off-policy evidence too thin with the held-out window full: {ess} after {waited}; "
                "more samples of the same behaviour cannot raise it (the window holds the newest gate.heldout_samples "
                f"{g.heldout_samples}) and no canary can run, so it cannot be shown safe: a candidate closer to "
                "stable (the learner rebases after learner.rebase_after_refusals refusals) or a larger "
                "gate.heldout_samples can"
            )
        if now - w.since >= g.offpolicy_wait_s:
            return (
                f"failed {CHECK}: off-policy evidence still too thin after waiting {waited} (gate.offpolicy_wait_s "
                f"{g.offpolicy_wait_s:g}): {ess}; {self._projection(look)}; no canary can run"
            )
        return None

    def waiting(self, stable: Version, now: float, nodes: int) -> str:
        """The verdict's reason while it waits: what it waits for, how long that should take, and the bound."""
        w = self.state
        assert w is not None
        g, look = self.cfg.gate, w.look
        left = duration(max(0.0, g.offpolicy_wait_s - (now - w.since)))
        w.reason = (
            f"waiting for off-policy evidence against stable v{stable.version}: ESS {look.ess:.0f} of the "
            f"{g.offpolicy_min_ess:g} needed (gate.offpolicy_min_ess) on {look.n} held-out samples"
            + (f" ({look.low})" if look.low else "")
            + f"; {self._projection(look)}; no canary can run ({nodes} node(s) configured, gate.canary_share "
            f"{g.canary_share:g}); judged again as samples come, refused if still too thin in {left} "
            f"(gate.offpolicy_wait_s) or once the held-out window of {g.heldout_samples} is full"
        )
        return w.reason

    def _projection(self, look: OffpolicyLook) -> str:
        g, share = self.cfg.gate, self.cfg.ingest.heldout_share
        p = project(look, g.offpolicy_min_ess)
        if p.needed is None:
            return (
                "no usable held-out sample yet (samples drawn at temperature 1 with no truncation or penalties, judged "
                f"at least gate.revert_horizon_s {g.revert_horizon_s:g} s ago)"
            )
        assert p.more is not None
        eff = look.ess / look.n
        text = f"at its efficiency now (ESS {eff:.0%} of the samples) {p.needed} are needed, {p.more} more"
        if share > 0:
            text += f" (about {p.more / share:.0f} judged events at ingest.heldout_share {share:g})"
        if p.eta_s is None:
            text += ", the arrival rate is not known yet"
        else:
            assert look.rate is not None
            text += f", {duration(p.eta_s)} at the recent {60 * look.rate:.1f} held-out samples a minute"
        if p.needed > g.heldout_samples:
            text += (
                f"; that is more than the window of gate.heldout_samples {g.heldout_samples} holds: unless the "
                "estimate rises it is refused once the window is full"
            )
        return text


class WaitSteps:
    """The gate's steps of the wait: a part of ``deploy.gate.gate.Gate``, whose state and checks it uses."""

    # the gate's state and steps these read, set by ``Gate.__init__`` (``EvidenceChecks``: the checks)
    cfg: LiverlConfig
    registry: Registry
    wait: Waiting
    canary: Any
    heldout: Callable[[], list] | None
    offpolicy_look: OffpolicyLook | None
    _verdicts: prom.Counter
    _eval_s: prom.Histogram
    _record: Callable[[int, str, float | None, float | None, bool, str], bool]
    _refuse: Callable[[int, str], bool]
    _rejected: Callable[[], None]
    _promote: Callable[[Version, Version, str, dict[str, bool]], Verdict]
    _offpolicy: Callable[..., OffpolicyLook]
    usable_heldout: Callable[[], int]

    def _wait_or_refuse(self, row: Version, stable: Version, checks: dict[str, bool], look: OffpolicyLook) -> Verdict:
        """No canary can run and the off-policy evidence is too thin: wait for more (recorded, with what it waits
        for), or refuse at the bound (``deploy.gate.waiting``)."""
        now = time.time()
        first = self.wait.state is None or self.wait.state.version != row.version
        w = self.wait.observe(row, stable, checks, look, now)
        if first:
            self._verdicts.labels("deferred").inc()
        refusal = self.wait.refusal(now)
        if refusal is not None:
            return self._refuse_waited(row, refusal)
        reason = self.wait.waiting(stable, now, self.canary.configured_fleet())
        self._record(row.version, CHECK, look.ess, self.cfg.gate.offpolicy_min_ess, True, reason)
        return Verdict(row.version, "deferred", reason, w.checks)

    def _refuse_waited(self, row: Version, reason: str) -> Verdict:
        w = self.wait.state
        assert w is not None
        checks = {**w.checks, CHECK: False}
        self._record(row.version, CHECK, w.look.ess, self.cfg.gate.offpolicy_min_ess, False, reason)
        self.wait.clear()
        self._refuse(row.version, reason)
        self._rejected()
        return Verdict(row.version, "rejected", reason, checks)

    def _look_again(self, row: Version, stable: Version) -> Verdict:
        """The waited-on candidate once more: off-policy only (its other checks passed against the same stable),
        when its usable samples grew enough (``Waiting.due``); at the bound, refused on what it has."""
        w = self.wait.state
        assert w is not None
        now = time.time()
        if not self.wait.due(self.usable_heldout(), now):
            if self.wait.expired(now):  # nothing new arrived by the bound
                refusal = self.wait.refusal(now)
                assert refusal is not None
                return self._refuse_waited(row, refusal)
            return Verdict(row.version, "deferred", w.reason or "waiting for off-policy evidence", w.checks)
        t0 = time.perf_counter()
        try:
            state = self.registry.materialize(row.version)  # checksum-verified, as the integrity check was
        except (DeltaError, BlobError, RegistryError) as e:
            reason = f"failed integrity: it no longer rebuilds: {e}"
            self._record(row.version, "integrity", 0.0, 1.0, False, reason)
            self.wait.clear()
            self._refuse(row.version, reason)
            self._rejected()
            return Verdict(row.version, "rejected", reason, {**w.checks, "integrity": False})
        look = self.offpolicy_look = self._offpolicy(row, stable, state, self.heldout() if self.heldout else [])
        self._eval_s.observe(time.perf_counter() - t0)
        checks = {c: ok for c, ok in w.checks.items() if c != "needs_canary"}
        if look.verdict == "defer":
            return self._wait_or_refuse(row, stable, w.checks, look)
        waited = now - w.since
        self.wait.clear()
        if look.verdict == "refuse":
            checks["offpolicy"] = False
            self._refuse(row.version, "failed offpolicy")
            self._rejected()
            return Verdict(row.version, "rejected", "failed offpolicy", checks)
        reason = f"gate passed ({', '.join(checks)}; off-policy evidence after waiting {waited:.0f} s for it)"
        return self._promote(row, stable, reason, checks)
