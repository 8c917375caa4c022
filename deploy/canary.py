"""The canary: a candidate that passed the gate's offline checks is shown to a share of users before it is promoted.

How a rollout runs (the gate drives it; ``liverl abort | pause | resume | promote --full`` step in):

1. **Start.** At least two serving nodes in rotation and ``gate.canary_share > 0``: the candidate becomes
   ``canary`` in the registry, is announced on ``<p>:canary`` (signed as ``<p>:desired`` is), and a
   ``RolloutPlan`` on ``<p>:rollout`` names the canary nodes (``gate.canary_nodes``, at least one node stays
   stable) and the share. The canary nodes' agents swap to it; the router (``liverl route``) sends each user whose
   fixed bucket is below the share to them, everyone else to the stable nodes. Otherwise the gate promotes at once.
2. **Evidence, peeked at continuously.** Each gate step reads the live counters ingest keeps per version
   (``<p>:live:<v>``: the canary's, and the stable version's since the canary began) and updates always-valid
   sequential tests (mSPRT, ``deploy.sequential``): live acceptance that users kept (accepts less the reverts of
   them that came in) is the success metric; the edit rate, the revert rate (accepted answers the user undid later:
   feedback kind ``revert``), the mean response length and the mean latency (within ``gate.guardrail_tolerance`` and
   ``gate.latency_tolerance`` of stable's) are guardrails; the suite's score is one too, checked before the canary (``deploy.gate``). The tests' state is kept in the plan, so a restarted gate goes on where it was.
3. **Decision.** Promote when acceptance is shown better (``gate.canary_margin`` > 0: not worse by more than it)
   and every guardrail non-inferior; abort as soon as any is shown worse, or at ``gate.canary_deadline_s``. A
   promotion announces the canary as ``desired`` (the stable nodes swap to it); an abort rejects it and removes the
   plan, and the canary nodes swap back to stable with the inverse of the delta they applied. Each decision is a
   gate check (``canary``) in the registry with its evidence.
"""

from __future__ import annotations

import logging
import time

from deploy.registry import Registry, RegistryConflict, Version
from deploy.sequential import ABORT, PROMOTE, Canary, MetricTest
from deploy.signing import Signer, announce
from liverl.core import keys
from liverl.core.config import LiverlConfig
from liverl.core.schemas import VersionAnnouncement

log = logging.getLogger("liverl.gate.canary")

MAX_LOOKS = 500  # looks kept in the plan (the page's plot); the test's state does not need them


def read_plan(redis, prefix: str) -> keys.RolloutPlan | None:
    raw = redis.get(keys.rollout(prefix))
    if raw is None:
        return None
    try:
        return keys.RolloutPlan.from_json(raw)
    except ValueError:
        log.error("unreadable %s; treating it as no rollout", keys.rollout(prefix))
        return None


def routable_nodes(redis, prefix: str) -> list[str]:
    """Serving nodes in rotation (live heartbeat, healthy, with a URL), by name."""
    out = []
    for k in redis.scan_iter(match=keys.served_pattern(prefix), count=500):
        raw = redis.get(k)
        if raw is None:
            continue
        try:
            beat = keys.ServedHeartbeat.from_json(raw)
        except ValueError:
            continue
        if beat.healthy and beat.url:
            out.append(keys.node_of_served(prefix, k))
    return sorted(out)


def _counts(redis, prefix: str, version: int) -> dict[str, int]:
    return {k: int(v) for k, v in redis.hgetall(keys.live(prefix, version)).items()}


def _since(now: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    return {k: max(0, v - base.get(k, 0)) for k, v in now.items()}


def build_tests(cfg: LiverlConfig, plan: keys.RolloutPlan, canary: dict[str, int], stable: dict[str, int],
                settling: bool = False) -> Canary:
    """The rollout's tests on the counts so far, their always-valid state restored from the plan. While ``settling``
    (the first ``gate.canary_min_s``) latency and length are not judged worse: a node that has just swapped runs hot
    for a few seconds (the delta's apply shares its CPU, its caches are cold)."""
    g = cfg.gate
    success = MetricTest("acceptance", alpha=g.canary_alpha, tau=g.canary_tau, direction=1, margin=g.canary_margin,
                         min_events=g.canary_min_events)
    edit = MetricTest("edit_rate", alpha=g.canary_alpha, tau=g.canary_tau, direction=-1, margin=g.guardrail_margin,
                      min_events=g.canary_min_events)
    revert = MetricTest("revert_rate", alpha=g.canary_alpha, tau=g.canary_tau, direction=-1,
                        margin=g.guardrail_margin, min_events=g.canary_min_events)
    guardrails = [edit, revert]
    tolerance = {"response_length": g.guardrail_tolerance, "latency": g.latency_tolerance}
    for name in keys.GUARDRAIL_SUMS:  # response length, latency: means, tolerated up to a share of stable's
        arms = {arm: keys.moments(c, name) for arm, c in (("canary", canary), ("stable", stable))}
        if not any(n for n, _, _ in arms.values()):
            continue  # no arm has it (records from a gateway that did not time them): nothing to judge
        n_s, total_s, _ = arms["stable"]
        scale = max(total_s / n_s if n_s else 0.0, 1e-9)
        band = tolerance[name] * scale
        test = MetricTest(name, alpha=g.canary_alpha, tau=band or scale, direction=-1, margin=band, harm_margin=band,
                          bernoulli=False, min_events=max(g.canary_min_events, 2))
        for arm, (n, total, total_sq) in arms.items():
            a = test.canary if arm == "canary" else test.stable
            a.n, a.total, a.total_sq = n, total, total_sq
        guardrails.append(test)
    for test, kind in ((success, "kept"), (edit, "edit"), (revert, "revert")):
        for arm, c in (("canary", canary), ("stable", stable)):
            n = c.get("events", 0)
            # success is acceptance users kept: an accept they reverted later counts as no success
            hits = max(0, c.get("accept", 0) - c.get("revert", 0)) if kind == "kept" else c.get(kind, 0)
            a = test.canary if arm == "canary" else test.stable
            a.add(1.0, hits)
            a.add(0.0, max(0, n - hits))
    for test in (success, *guardrails):
        test.max_log_lr_pass = plan.max_log_lr.get(f"{test.name}:pass", float("-inf"))
        test.max_log_lr_harm = plan.max_log_lr.get(f"{test.name}:harm", float("-inf"))
        test._look()  # one look at the totals; the running maxima carry every earlier look
        if settling and test.name in keys.GUARDRAIL_SUMS:
            test.max_log_lr_harm = float("-inf")
    return Canary(success, guardrails)


class CanaryController:
    """Starts, watches and ends rollouts for the gate (one at a time)."""

    def __init__(self, cfg: LiverlConfig, registry: Registry, redis, signer: Signer | None, record):
        self.cfg, self.registry, self.redis, self.signer = cfg, registry, redis, signer
        self.prefix = cfg.topics.prefix
        self.record = record  # Gate._record(version, check, value, threshold, passed, detail)

    def plan(self) -> keys.RolloutPlan | None:
        return read_plan(self.redis, self.prefix)

    def start(self, row: Version, stable: Version, reason: str) -> keys.RolloutPlan | None:
        """Begin a rollout of ``row``; None when there is no canary to run (share 0 or fewer than 2 nodes)."""
        g = self.cfg.gate
        nodes = routable_nodes(self.redis, self.prefix)
        if g.canary_share <= 0 or len(nodes) < 2:
            return None
        canary_nodes = nodes[-min(g.canary_nodes, len(nodes) - 1):]
        self.registry.set_status(row.version, "canary", actor="gate", expect="candidate",
                                 reason=f"{reason}; canary on {', '.join(canary_nodes)} at {g.canary_share:.0%}")
        ann = VersionAnnouncement(version=row.version, checksum=row.checksum, reason=f"canary of v{row.version}")
        if self.signer is not None:
            ann = self.signer.sign(ann)
        self.redis.set(keys.canary(self.prefix), ann.to_bytes())
        now = time.time()
        plan = keys.RolloutPlan(version=row.version, checksum=row.checksum, stable_version=stable.version,
                                share=g.canary_share, nodes=canary_nodes, started_at=now,
                                deadline_at=now + g.canary_deadline_s,
                                stable_baseline=_counts(self.redis, self.prefix, stable.version))
        self.redis.set(keys.rollout(self.prefix), plan.to_json())
        log.info("gate: canary v%d started on %s with %.0f%% of users (stable v%d)", row.version,
                 ", ".join(canary_nodes), 100 * g.canary_share, stable.version)
        return plan

    def clear(self) -> None:
        self.redis.delete(keys.rollout(self.prefix))  # the router first: no new users to the canary
        self.redis.delete(keys.canary(self.prefix))  # then the canary nodes return to desired

    def watch(self, plan: keys.RolloutPlan, stable: Version) -> tuple[str, str]:
        """One look: update the evidence, decide. Returns (promoted | aborted | continue | ended, why)."""
        row = self.registry.get(plan.version)
        if row.status != "canary":  # an operator promoted or rejected it meanwhile: their word stands
            self.clear()
            return "ended", f"v{plan.version} is {row.status} now"
        if stable.version != plan.stable_version:
            return self.abort(plan, f"the stable version changed to v{stable.version} during the canary")
        c = _counts(self.redis, self.prefix, plan.version)
        s_all = _counts(self.redis, self.prefix, stable.version)
        s = _since(s_all, plan.stable_baseline)
        # reverts come late: on both arms, count those of answers judged during the canary (the stable arm's reverts
        # that arrived meanwhile include reverts of answers judged before it), from the same first whole bucket (the
        # stable arm cannot tell the part of the canary's first bucket before it began; counting the canary's there
        # would make its revert rate look worse than stable's early on)
        s["revert"] = keys.reverts_judged_since(s_all, plan.started_at)
        c["revert"] = keys.reverts_judged_since(c, plan.started_at)
        now = time.time()
        settling = now - plan.started_at < self.cfg.gate.canary_min_s
        tests = build_tests(self.cfg, plan, c, s, settling)
        verdict, why = tests.verdict(deadline_passed=now >= plan.deadline_at)
        if plan.state == "paused" and verdict != ABORT:
            verdict, why = "continue", "paused by an operator"
        elif settling and verdict != ABORT:  # late feedback (reverts) of the canary's answers is still on its way
            verdict, why = "continue", (f"settling: no promotion in the first gate.canary_min_s "
                                        f"{self.cfg.gate.canary_min_s:.0f} s ({now - plan.started_at:.0f} s so far)")
        summary = tests.success.summary()
        look = keys.CanaryLook(at=now, canary_events=c.get("events", 0), stable_events=s.get("events", 0),
                               canary_acceptance=summary["canary_mean"], stable_acceptance=summary["stable_mean"],
                               p_better=tests.success.p_pass, p_worse=tests.success.p_harm)
        state = {f"{t.name}:{side}": v for t in (tests.success, *tests.guardrails)
                 for side, v in (("pass", t.max_log_lr_pass), ("harm", t.max_log_lr_harm))
                 if v > float("-inf") and not (settling and side == "pass")}  # passing evidence counts after settling
        plan = plan.model_copy(update={"max_log_lr": state, "looks": [*plan.looks, look][-MAX_LOOKS:],
                                       "verdict": verdict, "reason": why})
        evidence = (f"canary v{plan.version} acceptance {summary['canary_mean']:.3f} on {look.canary_events} vs stable "
                    f"v{stable.version} {summary['stable_mean']:.3f} on {look.stable_events} (p better "
                    f"{tests.success.p_pass:.3g}, p worse {tests.success.p_harm:.3g}); edit rate "
                    f"{tests.guardrails[0].canary.mean:.3f} vs {tests.guardrails[0].stable.mean:.3f}; revert rate "
                    f"{tests.guardrails[1].canary.mean:.3f} vs {tests.guardrails[1].stable.mean:.3f}"
                    + "".join(f"; {t.name} {t.canary.mean:.4g} vs {t.stable.mean:.4g}" for t in tests.guardrails[2:]))
        if verdict == PROMOTE:
            return self.promote(plan, stable, f"{why}: {evidence}")
        if verdict == ABORT:
            return self.abort(plan, f"{why}: {evidence}")
        self.redis.set(keys.rollout(self.prefix), plan.to_json())
        return "continue", f"{why}: {evidence}"

    def promote(self, plan: keys.RolloutPlan, stable: Version, why: str, actor: str = "gate") -> tuple[str, str]:
        self.record(plan.version, "canary", plan.looks[-1].canary_acceptance if plan.looks else None,
                    plan.looks[-1].stable_acceptance if plan.looks else None, True, why)
        try:
            self.registry.promote(plan.version, actor=actor, reason=f"canary passed: {why}",
                                  expected_stable=stable.version, from_candidate=True)
        except RegistryConflict as e:
            self.clear()
            return "ended", str(e)
        announce(self.redis, self.prefix, plan.version, plan.checksum, f"canary passed: {why}"[:1024], self.signer)
        self.clear()
        log.info("gate: canary v%d promoted: %s", plan.version, why)
        return "promoted", why

    def abort(self, plan: keys.RolloutPlan, why: str, actor: str = "gate") -> tuple[str, str]:
        self.clear()
        self.record(plan.version, "canary", plan.looks[-1].canary_acceptance if plan.looks else None,
                    plan.looks[-1].stable_acceptance if plan.looks else None, False, why)
        try:
            self.registry.set_status(plan.version, "rejected", actor=actor, reason=f"canary aborted: {why}",
                                     expect="canary")
        except RegistryConflict as e:
            log.info("gate: canary v%d not rejected: %s", plan.version, e)
        log.warning("gate: canary v%d aborted: %s", plan.version, why)
        return "aborted", why
