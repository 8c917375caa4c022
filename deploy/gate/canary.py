"""The canary: a candidate that passed the gate's offline checks is shown to a share of users before it is promoted.

How a rollout runs (the gate drives it; ``liverl abort | pause | resume | promote --full`` step in through the
registry):

1. **Start.** A configured fleet of two or more nodes (``serving.nodes``) and ``gate.canary_share > 0``: the gate
   opens a rollout in the registry (``Registry.begin_rollout``: the candidate becomes ``canary`` in the same
   transaction), picks its canary nodes among the routable ones (``fleet.canary_nodes``: they rotate from one rollout
   to the next, and one node at least stays stable) and announces it on ``<p>:canary``, signed with the rollout's terms
   (id, share, nodes, unit). The canary nodes' agents swap to it; the router sends a user to them when the user's
   keyed bucket for this rollout (``fleet.bucket``) is below the share, so each rollout draws its arms afresh and no
   caller can choose or predict one. With fewer than two routable nodes the decision is deferred, never made without
   a canary.
2. **Evidence, at the gate's look cadence.** Ingest keeps per-user sums per version and 10 s bucket of judgement time
   (``keys.units``; the feedback's own time, not ingest's clock, so a lagging worker moves no judgement of an answer
   stable served before the swap into the canary's buckets: ``ingest.records.judged_bucket``). A bucket is read once
   its revert horizon has closed (``gate.revert_horizon_s`` after its end, plus ingest's settling margin), so a bait
   answer accepted now and reverted later is never counted as kept: every metric is right-censored the same way on
   both arms. What reverts cannot change (the edit rate, the response length,
   latency) is read from a second cursor as soon as ingest has settled a bucket, a revert horizon sooner. A bucket
   is one of judgement time, so the evidence starts only with the first whole bucket ``gate.canary_warmup_s`` after
   every canary node served the candidate (``evidence_start``, from the registry's served times): the buckets
   before hold stable's judgements of answers it served the canary's users before they moved, which the canary
   cannot have (read as evidence, they made the first bucket 9-34% short of canary events, and aborted a canary
   as a sample-ratio mismatch). The sample-ratio check reads the horizon's cursor. The always-valid tests
   (``deploy.gate.sequential``) take the user as the unit (``gate.canary_unit = "user"``: delta method for ratio
   metrics, CUPED with each user's kept acceptance under stable before the rollout) or the judged event (``"request"``).
   Kept acceptance is the success metric; the edit rate, the revert rate and the response length are guardrails with
   nulls fixed at the start (from stable's own figures before the rollout); latency's mean and its quantile
   (``gate.latency_quantile``, from ingest's per-bucket histograms) are tested on the batch means of the buckets (its
   events are autocorrelated through node load). A sample-ratio mismatch of users or events stops the canary (reason
   ``srm``).
3. **Decision.** Promote when kept acceptance is shown better (``gate.canary_margin`` > 0: not worse by more than it)
   and every required guardrail non-inferior; abort as soon as any is shown worse, on an SRM, or at
   ``gate.canary_deadline_s`` (or earlier once the canary arm has ``gate.canary_max_events`` judged events: a budget
   in evidence, so that a canary's power does not follow the day's traffic; the tests are always valid, so where they
   stop moves no error rate, only their power), unless the readout at that deadline passes every test still open
   (``gate.canary_readout_share``). A false promotion and a false abort are each held at ``gate.canary_alpha`` across
   the family (``deploy.gate.sequential_readout``); every verdict names the levels and the success metric's raw and
   bias-corrected effect with its always-valid interval. The levels, the readout's share, the bands, the budget and
   the futility stop are fixed at the rollout's start. With a budget, a canary that could not pass by it even
   ``gate.canary_futility_z`` standard errors better than estimated stops once a quarter is spent (reason ``futile``):
   it never promotes, so no false-promotion rate rises, and ``liverl bench canary --budget`` measures the promotions it
   costs. The test state lives in the registry (compare-and-set by revision), so a restarted gate goes on where it was,
   and a promotion is a compare-and-set on a *running* rollout: an operator's pause between the gate's read and its
   write wins. A promotion announces the canary as ``desired``; an abort rejects it and withdraws the canary
   announcement (the canary nodes return to stable). Each decision is a gate check (``canary``) in the
   registry with its evidence.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from core import fleet, keys
from core.config import LiverlConfig
from core.schemas import RolloutTerms
from deploy.gate import mismatch as logprob_mismatch
from deploy.gate import sequential as seq
from deploy.gate import sequential_quantile as sq
from deploy.gate.canary_tests import ArmSums, Evidence, build_tests, look_record, pending, saved_state
from deploy.gate.srm import MISMATCH, SrmTest
from deploy.registry.registry import Registry, RegistryConflict, Version
from deploy.registry.signing import Signer, announce, keep_announced
from deploy.registry.tables import Rollout

log = logging.getLogger("liverl.gate.canary")

MAX_LOOKS = 500  # looks kept with the rollout (the page's plot); the test's state does not need them
MAX_COVARIATE_VERSIONS = 50
"""The newest versions CUPED's look-back reads users' history from."""
SETTLE_S = 5.0
"""A bucket is read this long after its revert horizon closed: ingest's own lag (a batch, the write buffer). Buckets
are of the judgements' own time, so a worker further behind than this has not joined all of a bucket when the fast
cursor reads it: both arms lose the same share of that bucket (partitions are keyed by generation, not by arm)."""


class Deferred(Exception):
    """No canary can run now (fewer routable nodes than the configured fleet needs): judge again later."""


def first_bucket(started_at: float) -> int:
    """The first whole bucket at or after ``started_at`` (the one it falls inside holds what came before it)."""
    return math.ceil(started_at / keys.UNIT_BUCKET_S)


def evidence_start(live_at: float, warmup_s: float) -> int:
    """A rollout's first bucket of evidence: the first whole one ``gate.canary_warmup_s`` after every canary node
    served the candidate. Before it, the canary's users were still served by the stable version (the router learns
    of a rollout within its refresh, the node swaps within a second or so) and those answers are judged in the next
    seconds: counted for stable, they left the first bucket 9-34% short of canary events in 8 of 13 canaries of
    three demo runs, and caused one sample-ratio abort (315 against 478 events) of a canary that was better."""
    return first_bucket(live_at + warmup_s)


def last_final_bucket(now: float, horizon_s: float) -> int:
    """The newest bucket whose every judgement is in and whose revert horizon has closed."""
    return math.floor((now - horizon_s - SETTLE_S) / keys.UNIT_BUCKET_S) - 1


def look_verdict(tests: seq.Canary, rollout: Rollout, now: float, canary_events: int) -> tuple[str, str]:
    """A look's verdict from its tests (``Canary.verdict``) at time ``now``: with the rollout's evidence budget and
    futility stop (``settings``' ``max_events`` and ``futility_z``, fixed at its start; ``canary_events``: the canary
    arm's judged events on the horizon's cursor), what is undecided aborts once the budget is spent or the deadline
    has passed. ``CanaryController.watch`` then applies the sample-ratio check, an operator's pause and the settling
    time; ``deploy.gate.canary_sim_decisions`` plays whole canaries through this function."""
    budget = (rollout.settings or {}).get("max_events")
    futility = {}  # with a budget: how much of it is spent, for the futility stop (``seq.futile``)
    if budget is not None:
        futility = {"spent": canary_events / budget, "futility_z": (rollout.settings or {}).get("futility_z")}
    if budget is not None and canary_events >= budget and now < rollout.deadline_at:
        return tests.verdict(
            deadline_passed=True,
            deadline_why=f"deadline passed: evidence budget spent ({canary_events} judged events on the canary arm, "
            f"gate.canary_max_events {budget})",
            **futility,
        )
    return tests.verdict(deadline_passed=now >= rollout.deadline_at, **futility)


def evidence_text(rollout: Rollout, stable: Version, tests: seq.Canary, info: dict) -> str:
    """What a look saw, for the rollout's reason and the gate check: the arms' kept acceptance, the test's p-values,
    the effect and the guardrails' means."""
    s = tests.success.summary()
    c_events, s_events = info["events"]
    users = info.get("users")
    text = (
        f"canary v{rollout.version} kept acceptance {s['canary_mean']:.3f} on {c_events} events"
        + (f" of {users[0]} users" if users else "")
        + f" vs stable v{stable.version} {s['stable_mean']:.3f} on {s_events}"
        + (f" of {users[1]} users" if users else "")
        + f" (unit {rollout.unit}; p better {tests.success.p_pass:.3g}, p worse {tests.success.p_harm:.3g}"
    )
    removed = info.get("acceptance", {}).get("cuped_removed")
    if removed is not None and removed >= 0.005:  # below it: too little history before the rollout to help
        text += f"; CUPED removed {100 * removed:.0f}% of the variance"
    text += ")"
    eff = tests.success.effect()
    if eff["effect"] is not None:  # the winner's curse: an early stop overstates; the corrected one shrinks it
        text += (
            f"; effect {eff['effect']:+.4f} (bias-corrected {eff['effect_corrected']:+.4f}, always-valid "
            f"{1 - tests.success.alpha:.0%} interval [{eff['effect_lo']:+.4f}, {eff['effect_hi']:+.4f}])"
        )
    means = {t.name: (t.canary.mean, t.stable.mean) for t in tests.guardrails}
    if "latency_means" in info:
        means["latency"] = info["latency_means"]
    for t in tests.guardrails:  # the arms' mean per-bucket quantile (what the quantile's batch means compare)
        if "quantile_means" in info.get(t.name, {}):
            means[t.name] = info[t.name]["quantile_means"]
    text += "".join(f"; {name} {c:.4g} vs {s:.4g}" for name, (c, s) in means.items())
    return text


class StableArmWatch:
    """Whether a rollout's stable arm has had no node in rotation for ``gate.stable_arm_grace_s`` (every node the
    canary does not name lost, cut off or unhealthy). The routers hold that arm's users rather than send them to the
    candidate, so the gate ends such a rollout: the canary's nodes go back to stable and serve them."""

    def __init__(self, cfg: LiverlConfig, redis):
        self.cfg, self.redis = cfg, redis
        self.since: tuple[int, float] | None = None  # (rollout id, when its stable arm was first seen empty)

    def gone(self, rollout: Rollout) -> str | None:
        """Why ``rollout`` must end (None: its stable arm has a node, or has had none for less than the grace)."""
        routable = fleet.routable_nodes(self.redis, self.cfg.topics.prefix, self.cfg.serving.fleet)
        if any(n not in rollout.nodes for n in routable):
            self.since = None
            return None
        now = time.monotonic()
        if self.since is None or self.since[0] != rollout.id:
            self.since = (rollout.id, now)
        gone_s = now - self.since[1]
        if gone_s < self.cfg.gate.stable_arm_grace_s:
            return None
        self.since = None
        return (
            f"the stable arm has no node in rotation ({', '.join(routable) or 'none'} routable, all the canary's) "
            f"for {gone_s:.0f} s >= gate.stable_arm_grace_s {self.cfg.gate.stable_arm_grace_s:g} s: its users cannot "
            "be served while the canary holds the other nodes; ended so the canary nodes go back to stable"
        )


class CanaryController:
    """Starts, watches and ends rollouts for the gate (one at a time)."""

    def __init__(self, cfg: LiverlConfig, registry: Registry, redis, signer: Signer | None, record):
        self.cfg, self.registry, self.redis, self.signer = cfg, registry, redis, signer
        self.prefix = cfg.topics.prefix
        self.record = record  # Gate._record(version, check, value, threshold, passed, detail)
        self._evidence: Evidence | None = None
        self.stable_arm = StableArmWatch(cfg, redis)
        self.clock = time.time  # what "now" is for a rollout's buckets and deadline (tests move it)
        self.on_rewritten = lambda channel, what: None  # told what keep_announced wrote over (the gate counts it)

    # ------------------------------------------------------------------------------------------ start

    def configured_fleet(self) -> int:
        """How many serving nodes this deployment is configured to run (``serving.fleet``, else ``serving.nodes``)."""
        return fleet.configured_nodes(self.cfg.serving)

    def wanted(self) -> bool:
        """Whether a candidate must go through a canary before it is promoted."""
        return self.cfg.gate.canary_share > 0 and self.configured_fleet() >= 2

    def start(self, row: Version, stable: Version, reason: str) -> Rollout:
        """Open a rollout of ``row``. Raises ``Deferred`` when fewer than two nodes can take traffic now."""
        g = self.cfg.gate
        nodes = fleet.routable_nodes(self.redis, self.prefix, self.cfg.serving.fleet)
        if len(nodes) < 2:
            raise Deferred(
                f"a canary needs 2 routable nodes of the {self.configured_fleet()} configured, "
                f"{len(nodes)} in rotation ({', '.join(nodes) or 'none'}); judged again when they are"
            )
        last = self.registry.rollouts(limit=1)  # rotate by rollout, not by version: superseded candidates make the
        # versions that reach a canary skip numbers (a demo run put v16, v38 and v52 all on node-0)
        canary_nodes = fleet.canary_nodes(nodes, (last[0].id if last else 0) + 1, g.canary_nodes)
        now = self.clock()
        settings = self._fixed_nulls(stable, now)
        rollout = self.registry.begin_rollout(
            row.version,
            stable_version=stable.version,
            share=g.canary_share,
            nodes=canary_nodes,
            unit=g.canary_unit,
            deadline_at=now + g.canary_deadline_s,
            settings=settings,
            actor="gate",
            reason=f"{reason}; canary on {', '.join(canary_nodes)} at {g.canary_share:.0%} of users, unit "
            f"{g.canary_unit}",
        )
        self._announce(rollout)
        self._evidence = None
        log.info(
            "gate: canary v%d started (rollout %d) on %s with %.0f%% of %ss (stable v%d)",
            row.version,
            rollout.id,
            ", ".join(canary_nodes),
            100 * g.canary_share,
            g.canary_unit,
            stable.version,
        )
        return rollout

    @staticmethod
    def terms(rollout: Rollout) -> RolloutTerms:
        # the column is a plain string; RolloutTerms validates it against its Literal
        unit: Any = rollout.unit
        return RolloutTerms(rollout_id=rollout.id, share=rollout.share, nodes=list(rollout.nodes), unit=unit)

    def _announce(self, rollout: Rollout) -> None:
        announce(
            self.redis,
            self.prefix,
            rollout.version,
            rollout.checksum,
            f"canary of v{rollout.version}",
            self.signer,
            channel="canary",
            rollout=self.terms(rollout),
            ttl_s=self.cfg.security.announce_ttl_s,
            seq=self.registry.audit_seq(),  # the rollout's start included
        )

    def refresh(self, rollout: Rollout) -> None:
        """Keep the canary's announcement present, signed, naming the rollout's terms and fresh (it expires, so a
        replayed copy cannot outlive it): after a lost Redis key, a gate restart, or half its lifetime."""
        what = keep_announced(
            self.redis,
            self.prefix,
            "canary",
            rollout.version,
            rollout.checksum,
            f"canary of v{rollout.version}",
            self.signer,
            rollout=self.terms(rollout),
            ttl_s=self.cfg.security.announce_ttl_s,
            seq=self.registry.audit_seq(),
        )
        if what is not None:
            self.on_rewritten("canary", what)

    def _fixed_nulls(self, stable: Version, now: float) -> dict:
        """The continuous guardrails' bands, fixed for the whole rollout from stable's own figures before it: mean
        response length and latency, and latency's quantile (``gate.latency_quantile``, from ingest's histograms),
        over the CUPED look-back (or stable's whole life), times the tolerance."""
        g = self.cfg.gate
        lo = first_bucket(now - max(g.cuped_lookback_s, keys.UNIT_BUCKET_S))
        hi = math.floor(now / keys.UNIT_BUCKET_S) - 1
        tokens = events = ms = timed = 0
        hist = np.zeros(keys.LATENCY_HIST_BINS)
        for data in keys.read_unit_buckets(self.redis, self.prefix, stable.version, range(lo, hi + 1)).values():
            agg = data.get("*", {})
            tokens += agg.get("t", 0)
            events += agg.get("e", 0)
            ms += agg.get("m", 0)
            timed += agg.get("n", 0)
            hist += sq.hist_counts(agg)
        length = tokens / events if events else None
        latency = ms / timed if timed else None
        q = g.latency_quantile
        quantile = float(sq.hist_quantile(hist, q)) if q is not None and hist.sum() > 0 else None
        return {
            "length_band": None if length is None else g.guardrail_tolerance * max(length, 1e-9),
            "latency_band": None if latency is None else g.latency_tolerance * max(latency, 1e-9),
            "latency_q_band": None if quantile is None else g.latency_quantile_tolerance * max(quantile, 1e-9),
            "latency_quantile": q,
            "stable_length": length,
            "stable_latency_ms": latency,
            "stable_latency_q_ms": quantile,
            "fixed_at": now,
            "max_events": g.canary_max_events,  # the evidence budget, fixed with the nulls
            "futility_z": g.canary_futility_z,  # and the futility stop that reads it
            "readout_share": g.canary_readout_share,  # the deadline readout's share of alpha
            "latency_at_equal_length": g.latency_at_equal_length,  # how the latency guardrails compare the arms
            "user_cap": g.canary_user_cap,  # heavy users' weight in the user-unit tests
        }

    def clear(self) -> None:
        self.redis.delete(keys.canary(self.prefix))  # the canary nodes return to desired
        self._evidence = None

    # ------------------------------------------------------------------------------------------ evidence

    def _read(self, rollout: Rollout, now: float) -> Evidence:
        ev = self._evidence
        if ev is None or ev.rollout_id != rollout.id:
            ev = self._evidence = Evidence(rollout.id)
        if ev.start is None:
            live = self.live_at(rollout)
            if live is None:  # a canary node has not swapped to the candidate yet: nothing of it to read
                return ev
            ev.start = ev.next_bucket = ev.next_fast = evidence_start(live, self.cfg.gate.canary_warmup_s)
            if self.cfg.gate.cuped and rollout.unit == "user":
                ev.covariate = self._covariate(rollout)
        end = math.floor(rollout.deadline_at / keys.UNIT_BUCKET_S)
        g = self.cfg.gate
        # Two cursors over the same buckets: one waits for the revert horizon (kept acceptance and the revert rate),
        # the other only for ingest's settling (edits, length and latency are final when judged; reverts never
        # change them), so those guardrails gather evidence a revert horizon sooner, censored no less fairly.
        # Each reads a bucket once it is due and again at each bucket that comes due after it, for
        # gate.canary_late_s more: judgements count in the bucket of the user's judgement time, and an ingest worker
        # that runs behind writes them there late. A bucket read only once would miss every judgement counted after
        # that read: in a 2-core demo where ingest ran tens of seconds behind, the edit rate's test saw about a tenth
        # of the events and held canaries shown better at p < 1e-50 to their deadline.
        final = min(last_final_bucket(now, g.revert_horizon_s + g.canary_late_s), end)
        for due, (first_, through), arms in (
            (min(last_final_bucket(now, g.revert_horizon_s), end), ("next_bucket", "through"), (ev.canary, ev.stable)),
            (min(last_final_bucket(now, 0.0), end), ("next_fast", "fast_through"), (ev.fast_canary, ev.fast_stable)),
        ):
            first = getattr(ev, first_)
            if due <= getattr(ev, through) and final < first:
                continue  # no bucket came due since the last read
            wanted = range(first, due + 1)
            for arm, version in zip(arms, (rollout.version, rollout.stable_version), strict=True):
                read = keys.read_unit_buckets(self.redis, self.prefix, version, wanted)
                for b in wanted:
                    if b in read or b in arm.provisional:
                        arm.add(b, read.get(b, {}), final=b <= final)
            setattr(ev, first_, max(first, min(final, due) + 1))
            setattr(ev, through, max(getattr(ev, through), due))
        return ev

    def live_at(self, rollout: Rollout) -> float | None:
        """When the last of the rollout's canary nodes first served its version (the registry's ``served`` rows, each
        written by a node's agent on its verified swap), not before the rollout started; None while one has not."""
        first = {s.node: s.first_at for s in self.registry.served(rollout.version)}
        if any(n not in first for n in rollout.nodes):
            return None
        return max(rollout.started_at, *(first[n] for n in rollout.nodes))

    def _covariate(self, rollout: Rollout) -> dict[str, np.ndarray]:
        """Each user's sums before the rollout (CUPED's covariates: kept acceptance, and the guardrails' own rates),
        over the ``gate.cuped_lookback_s`` before it and whatever served them then (the stable version, earlier
        stable versions, earlier canaries): anything before the rollout is untouched by it, and a user's own history
        predicts the user. Users with events only (``deploy.gate.canary_tests.pre_rollout_rate`` reads them)."""
        t0 = rollout.started_at - self.cfg.gate.cuped_lookback_s
        wanted = range(first_bucket(t0), first_bucket(rollout.started_at))
        versions = {rollout.stable_version} | {
            v.version
            for v in self.registry.list(limit=MAX_COVARIATE_VERSIONS)
            if v.version != rollout.version and (v.created_at >= t0 or (v.promoted_at or 0.0) >= t0)
        }
        pre = ArmSums()
        for version in sorted(versions):
            for b, data in keys.read_unit_buckets(self.redis, self.prefix, version, wanted).items():
                pre.add(b, data)
        return {u: s for u, s in pre.users.items() if s[0] > 0}

    def build_tests(self, rollout: Rollout, ev: Evidence, settling: bool) -> tuple[seq.Canary, SrmTest, dict]:
        """The rollout's tests at this look (``deploy.gate.canary_tests.build_tests``)."""
        return build_tests(self.cfg.gate, rollout, ev, settling)

    # ------------------------------------------------------------------------------------------ looks

    def watch(self, rollout: Rollout, stable: Version) -> tuple[str, str]:
        """One look: update the evidence, decide. Returns (promoted | aborted | continue | ended, why)."""
        row = self.registry.get(rollout.version)
        if row.status != "canary":  # an operator promoted or rejected it meanwhile: their word stands
            self.registry.end_rollout(rollout.id, actor="gate", reason=f"v{rollout.version} is {row.status} now")
            self.clear()
            return "ended", f"v{rollout.version} is {row.status} now"
        if stable.version != rollout.stable_version:
            return self.abort(rollout, f"the stable version changed to v{stable.version} during the canary")
        ok, _, why = logprob_mismatch.check(
            self.cfg, rollout.version, self.registry.mismatch(rollout.version).get(rollout.version)
        )
        if not ok:  # its users were served log-probs the learner does not reproduce: not promoted on any evidence
            return self.abort(rollout, why)
        gone = self.stable_arm.gone(rollout)
        if gone is not None:  # the stable arm's users are held by the routers: end it so they can be served
            return self.abort(rollout, gone)
        self.refresh(rollout)
        now = self.clock()
        ev = self._read(rollout, now)
        fresh = (ev.through, ev.fast_through) != ev.looked_at  # a bucket came due since the last look: new evidence
        ev.looked_at = (ev.through, ev.fast_through)
        settling = now - rollout.started_at < self.cfg.gate.canary_min_s
        tests, srm, info = self.build_tests(rollout, ev, settling)
        verdict, why = look_verdict(tests, rollout, now, info["events"][0])
        if verdict == seq.CONTINUE:
            why = (
                pending(tests, info)
                if ev.start is not None
                else f"waiting for {', '.join(rollout.nodes)} to serve v{rollout.version} (evidence counts from "
                f"gate.canary_warmup_s {self.cfg.gate.canary_warmup_s:g} s after)"
            )
        if srm.verdict() == MISMATCH:  # the arms are not what the assignment drew: nothing of them can be trusted
            verdict, why = (
                seq.ABORT,
                (
                    f"srm: the arms' users or events do not match the share {rollout.share:g} "
                    f"(p users {srm.p_users:.3g}, p events {srm.p_events:.3g} <= "
                    f"gate.srm_alpha/2): the assignment, routing or logging is broken"
                ),
            )
        elif rollout.state == "paused" and verdict != seq.ABORT:
            verdict, why = "continue", "paused by an operator"
        elif settling and verdict != seq.ABORT:
            verdict, why = (
                "continue",
                (
                    f"settling: no promotion in the first gate.canary_min_s "
                    f"{self.cfg.gate.canary_min_s:.0f} s ({now - rollout.started_at:.0f} s so far)"
                ),
            )
        look = look_record(now, tests, srm, info, ev)
        state = saved_state(tests, srm, settling)
        evidence = evidence_text(rollout, stable, tests, info)
        if verdict == seq.CONTINUE and not fresh and why == rollout.reason:
            return "continue", f"{why}: {evidence}"  # nothing new since the last look: nothing to record
        try:
            rollout = self.registry.save_rollout_evidence(
                rollout.id,
                expect_revision=rollout.revision,
                test_state=state,
                looks=[*(rollout.looks or []), look][-MAX_LOOKS:],
                verdict=verdict,
                reason=why,
            )
        except RegistryConflict as e:  # an operator changed the rollout since it was read: look again next step
            return "continue", f"rollout changed while judged ({e}); looking again"
        if verdict == seq.PROMOTE:
            return self.promote(rollout, stable, f"{why}: {evidence}")
        if verdict == seq.ABORT:
            return self.abort(rollout, f"{why}: {evidence}")
        return "continue", f"{why}: {evidence}"

    def promote(self, rollout: Rollout, stable: Version, why: str, actor: str = "gate") -> tuple[str, str]:
        last = (rollout.looks or [{}])[-1]
        try:
            self.registry.finish_rollout_promote(
                rollout.id,
                expected_stable=stable.version,
                actor=actor,
                reason=f"canary passed: {why}",
                expect_revision=rollout.revision,  # the evidence just saved: any operator write since moves it
            )
        except RegistryConflict as e:  # paused (and resumed), aborted or promoted since it was read: look again
            return "continue", f"not promoted: {e}"
        self.record(rollout.version, "canary", last.get("canary_acceptance"), last.get("stable_acceptance"), True, why)
        announce(
            self.redis,
            self.prefix,
            rollout.version,
            rollout.checksum,
            f"canary passed: {why}"[:1024],
            self.signer,
            ttl_s=self.cfg.security.announce_ttl_s,
            seq=self.registry.audit_seq(),  # the promotion's own entry included
        )
        self.clear()
        log.info("gate: canary v%d promoted: %s", rollout.version, why)
        return "promoted", why

    def abort(self, rollout: Rollout, why: str, actor: str = "gate") -> tuple[str, str]:
        last = (rollout.looks or [{}])[-1]
        try:
            self.registry.finish_rollout_abort(rollout.id, actor=actor, reason=f"canary aborted: {why}")
        except RegistryConflict as e:
            log.info("gate: canary v%d not aborted: %s", rollout.version, e)
            return "continue", f"not aborted: {e}"
        self.clear()
        self.record(rollout.version, "canary", last.get("canary_acceptance"), last.get("stable_acceptance"), False, why)
        log.warning("gate: canary v%d aborted: %s", rollout.version, why)
        return "aborted", why
