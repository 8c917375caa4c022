"""The release gate: turns learner candidates into releases, or refuses them.

Why a gate: online RL on live feedback can regress or collapse (plain REINFORCE on a small MoE, measured here,
reached 82% accuracy and then collapsed to 0%); Cursor deploys a checkpoint only if it does not regress. Each candidate
must pass

  (a) integrity   its stored delta, applied to its parent's weights, yields exactly its recorded checksum
                  (what the fleet will do, done first here);
  (b) drift       mean per-token KL(candidate || stable) on recent logged generations <= ``cfg.gate.max_kl``
                  (one release moves the policy only so far from what users have seen work);
  (c) collapse    the candidate's mean per-token entropy there >= ``cfg.gate.min_entropy`` (a collapsed,
                  near-deterministic policy has stopped exploring and cannot recover);
  (d) suite       only when the product has an evaluation suite: refused when its mean grade is below the stable
                  version's by more than ``cfg.gate.max_regression`` and the paired sign test on the cases that
                  changed grade (McNemar's for pass/fail) shows the drop at ``cfg.gate.suite_alpha``;
  (e) off-policy  the candidate's reward (the product's, reverts included) estimated on held-out logged feedback
                  (``<prefix>.heldout``, which the learner never trains on; only judgements older than
                  ``cfg.gate.revert_horizon_s``): clipped, self-normalised importance sampling of the logged
                  completions (``deploy.gate.offpolicy``), paired with stable's estimate on the same samples. Refused
                  when the paired test shows it worse than stable's by more than ``cfg.gate.offpolicy_margin``
                  (one-sided ``deploy.gate.offpolicy.ALPHA``); deferred (``needs_canary``) when an effective sample
                  size is under ``cfg.gate.offpolicy_min_ess``: to the canary with two or more nodes; with one, the
                  gate waits for more held-out evidence (``deploy.gate.waiting``).

With ``cfg.gate.integrity_only`` only (a) runs and a pass is promoted at once, with no canary: a comparison mode
that shows what the evidence checks are worth (``liverl demo --integrity-only``), never a production setting.

The gate judges on evidence a real product has: its logged traffic and, if it has one, its own evaluation
suite. It never sees an answer key. The figures come from an ``Evaluator`` handed in by the command that
starts the gate (``learner.evaluate.PolicyEvaluator``), so this module imports neither the learner nor a
product; the probe sequences come from a tail of the generations topic (``deploy.gate.tail.GenerationTail``).
The evidence checks (b)-(e) live in ``deploy.gate.evidence``.

Every check lands in ``gate_results``; a pass promotes the version (audited, actor "gate") and writes
``<prefix>:desired`` in Redis, which the serving agents follow. When several candidates are waiting only the
newest is evaluated; the older ones are rejected as superseded (the learner has moved past them).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable

import prometheus_client as prom
import redis as redis_lib

from core import keys
from core.config import LiverlConfig
from core.probes import STALL_S, LoopWatch, start_probe_server
from core.services import kafka_bootstrap, required_signing_key, setup_redis
from core.shred import open_user_keys
from deploy.gate.canary import CanaryController, Deferred
from deploy.gate.evidence import Evaluator, EvidenceChecks
from deploy.gate.tail import PROBE_UNIT_SHARE, GenerationTail, HeldoutSample, LoggedGeneration, parse_heldout
from deploy.gate.verdict import Verdict
from deploy.gate.waiting import OffpolicyLook, Waiting, WaitSteps
from deploy.registry.attest import Attested, Attestor
from deploy.registry.blobstore import BlobError
from deploy.registry.delta import DeltaError, apply_delta, checksum, warm_up
from deploy.registry.registry import Registry, RegistryConflict, RegistryError, Version, open_registry
from deploy.registry.signing import WRONG_TYPE_WAS, Signer, announce, keep_announced

log = logging.getLogger("liverl.gate")


def before_rollback(registry: Registry, row: Version) -> str | None:
    """Why candidate ``row`` may carry a change an operator rolled back, or None. Its parent was rolled back; or a
    rollback came after the last one its weights account for (``rollback_seen``: audit ids, one sequence for every
    writer, so no host's clock decides); a row registered without it is compared by time."""
    rollback_id, rolled_back_at = registry.last_rollback()
    if row.parent is not None and registry.get(row.parent).status == "rolled_back":
        return f"its parent v{row.parent} was rolled back"
    if row.rollback_seen is not None:
        if row.rollback_seen < rollback_id:
            return f"its weights account for rollbacks up to audit entry {row.rollback_seen}, not {rollback_id}"
    elif row.created_at <= rolled_back_at:
        return "registered before the last rollback's time"
    return None


class Gate(EvidenceChecks, WaitSteps):
    """Evaluates pending candidates with the ``evaluator`` it is given (drift, collapse, optional suite)."""

    def __init__(
        self,
        cfg: LiverlConfig,
        registry: Registry,
        redis: redis_lib.Redis,
        evaluator: Evaluator,
        signer: Signer | None = None,
        heldout: Callable[[], list[HeldoutSample]] | None = None,
    ):
        self.cfg, self.registry, self.redis, self.signer = cfg, registry, redis, signer
        self.heldout = heldout  # the newest held-out samples (``GenerationTail`` on <prefix>.heldout), or None
        self.prefix = cfg.topics.prefix
        self.evaluator = evaluator
        self._stable_suite: dict[tuple[int, str], dict | None] = {}
        self.metrics = prom.CollectorRegistry()
        self._verdicts = prom.Counter(
            "liverl_gate_verdicts", "Gate verdicts on candidates", ["verdict"], registry=self.metrics
        )
        self._checks = prom.Counter("liverl_gate_checks", "Gate checks run", ["check", "result"], registry=self.metrics)
        self._errors = prom.Counter(
            "liverl_gate_errors", "Gate steps that failed with an exception", registry=self.metrics
        )
        self._eval_s = prom.Histogram(
            "liverl_gate_eval_seconds",
            "Time of one candidate's evaluation",
            registry=self.metrics,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        self._stable = prom.Gauge(
            "liverl_gate_stable_version", "Stable version as of the last gate step", registry=self.metrics
        )
        self._score = prom.Gauge(
            "liverl_gate_last_score",
            "Last evaluated candidate's figures (kl, entropy, suite)",
            ["metric"],
            registry=self.metrics,
        )
        self._promoted_at = prom.Gauge(
            "liverl_gate_stable_promoted_timestamp_seconds",
            "When the stable version became stable (Unix time; alert: no promotion for too long)",
            registry=self.metrics,
        )
        self._rolled_back_at = prom.Gauge(
            "liverl_gate_last_rollback_timestamp_seconds",
            "When the registry last rolled back (Unix time, 0: never; alert: rollout rolled back)",
            registry=self.metrics,
        )
        self._refused_in_a_row = prom.Gauge(
            "liverl_gate_refused_in_a_row",
            "Candidates the gate refused since its last promotion (alert: N refused in a row)",
            registry=self.metrics,
        )
        self._in_a_row = 0
        self._waited_on: int | None = None  # the candidate last deferred as too early (logged once each)
        self._rollouts = prom.Counter(
            "liverl_gate_rollouts",
            "Canary rollouts ended, by outcome (promoted, aborted)",
            ["outcome"],
            registry=self.metrics,
        )
        self._canary_share = prom.Gauge(
            "liverl_gate_canary_share", "Share of users on the canary now (0: none)", registry=self.metrics
        )
        self._wrong_type = prom.Counter(  # every reader refused them; the gate wrote over them
            "liverl_gate_wrong_type_keys", "Announcement keys of another Redis type", ["channel"], registry=self.metrics
        )
        self.canary = CanaryController(cfg, registry, redis, signer, self._record)
        self.canary.on_rewritten = functools.partial(_rewritten, self)
        self.attestor = Attestor(registry.db)  # signs only what the audit log vouches for (deploy.registry.attest)
        self._unattested = prom.Counter(
            "liverl_gate_unattested",
            "Gate steps that signed nothing because the registry's stable version or canary is not what the audit "
            "log's verified entries made it (alert: the registry's database was written around the gate)",
            ["channel"],
            registry=self.metrics,
        )
        self._unattested_why: str | None = None
        self.watch = LoopWatch(STALL_S, "gate's loop")  # /livez: the loop goes round (an evaluation included)
        self.step_error: str | None = "no step taken yet"  # /readyz: the last step reached the registry and Redis
        self.wait = Waiting(cfg, self.metrics)  # one node: thin off-policy evidence is waited for (deploy.gate.waiting)
        self.offpolicy_look: OffpolicyLook | None = None
        self.chores: list[Callable[[Gate], None]] = []  # run after each step with the gate (its registry, Redis)

    def metrics_text(self) -> bytes:
        """Gate metrics in Prometheus text format."""
        return prom.generate_latest(self.metrics)

    # ------------------------------------------------------------------------------------------ loop

    def run(self, stop_event: threading.Event) -> None:
        """Poll for candidates every ``cfg.gate.poll_s`` until ``stop_event`` is set; a failing step is logged,
        counted (``liverl_gate_errors_total``) and retried at the next poll."""
        self.warm_up()
        log.info("gate: watching registry %s every %.1f s", self.registry.url, self.cfg.gate.poll_s)
        while not stop_event.is_set():
            self.watch.tick()
            try:
                self.step()
                self.step_error = None
            except Exception as e:
                self._errors.inc()
                self.step_error = f"the last step failed: {type(e).__name__}: {e}"
                log.exception("gate: step failed; retrying in %.1f s", self.cfg.gate.poll_s)
            _run_chores(self)
            stop_event.wait(self.cfg.gate.poll_s)

    def warm_up(self) -> None:
        """Before the first candidate: the evaluator's model built once (``warm_up``, when it has one) and the stable
        version's suite score, so the first candidate is judged as fast as the next ones (in a demo run the first
        drift check took 46 s against 1-3 s after it). Best effort: a failure here is retried by the first step."""
        t0 = time.perf_counter()
        try:
            stable = self.registry.stable()
            if self.cfg.gate.integrity_only:
                return
            warm = getattr(self.evaluator, "warm_up", None)
            if warm is not None:
                warm(self.registry.materialize(stable.version))
            self.stable_suite(stable)
        except Exception as e:  # noqa: BLE001 - the first step does the same work again and reports what fails
            log.warning("gate: warm-up failed (%s: %s); the first candidate pays for it", type(e).__name__, e)
            return
        log.info("gate: evaluator warmed up on stable v%d in %.1f s", stable.version, time.perf_counter() - t0)

    def reconcile(self, stable: Version, seq: int | None = None) -> Attested:
        """The fleet follows ``<prefix>:desired``; make it name the registry's stable version (after a crash between
        a promotion and its announcement, or a lost Redis key), checked as the agents check it (signed, bound to its
        channel and prefix, unexpired), and keep it fresh (``deploy.registry.signing.keep_announced``). The registry is
        the truth, as far as its audit log vouches for it (``deploy.registry.attest``): a stable version that no
        verified audit entry made stable is not signed. ``seq``: the registry's audit sequence read before ``stable``
        was (None: read now), which the announcement carries. Returns what the audit log vouches for."""
        if seq is None:
            seq = self.registry.audit_seq()
        att = self.attestor.refresh()
        if att.problem is not None or att.stable != stable.version:
            self._not_vouched(
                "desired",
                att.problem
                or f"the registry calls v{stable.version} stable, but the audit log's newest verified promotion or "
                f"rollback made v{att.stable} stable: not signed",
            )
            return att
        what = keep_announced(
            self.redis,
            self.prefix,
            "desired",
            stable.version,
            stable.checksum,
            "reconciled with the registry",
            self.signer,
            ttl_s=self.cfg.security.announce_ttl_s,
            seq=seq,
        )
        if what is not None and what != "refreshed":
            _rewritten(self, "desired", what)
            log.warning("gate: desired version %s; announced the registry's stable v%d", what, stable.version)
        return att

    def _not_vouched(self, channel: str, why: str) -> None:
        """Count a refusal to sign what the audit log does not vouch for; log it once per distinct reason."""
        self._unattested.labels(channel).inc()
        if why != self._unattested_why:
            self._unattested_why = why
            log.error("gate: %s announcement not signed: %s (`liverl history --verify` checks the log)", channel, why)

    def step(self) -> list[Verdict]:
        """Process the pending candidates: the newest is evaluated, older ones are superseded."""
        seq = self.registry.audit_seq()  # before the state it orders: a rollback after it outranks what is read here
        stable = self.registry.stable()
        self._stable.set(stable.version)
        self._promoted_at.set(stable.promoted_at or 0.0)
        self._rolled_back_at.set(self.registry.last_rollback()[1] or 0.0)
        att = self.reconcile(stable, seq)
        for v in self.registry.reap_orphan_canaries(actor="gate"):  # a crash between a rollout's steps
            log.warning("gate: version %d was a canary no rollout runs; rejected", v)
        rollout = self.registry.active_rollout()
        if rollout is None:
            self.redis.delete(keys.canary(self.prefix))  # an operator ended it: the canary nodes return to stable
        elif att.canary != rollout.version:  # a rollout row no audited canary_start made: neither watched nor signed
            why = att.problem or (
                f"rollout {rollout.id} of v{rollout.version} is not the canary the audit log vouches for "
                f"({'none' if att.canary is None else f'v{att.canary}'})"
            )
            self._not_vouched("canary", why)
            return [Verdict(rollout.version, "canary", why)]
        else:  # one rollout at a time: new candidates wait until it ends
            outcome, why = self.canary.watch(rollout, stable)
            self._canary_share.set(rollout.share if outcome == "continue" else 0.0)
            if outcome == "promoted":
                self._rollouts.labels("promoted").inc()
                self._promoted(rollout.version)
            elif outcome == "aborted":
                self._rollouts.labels("aborted").inc()
                self._rejected()
            return [Verdict(rollout.version, "canary" if outcome == "continue" else outcome, why)]
        self._canary_share.set(0.0)
        pending = self.registry.candidates()
        waited = None if self.canary.wanted() else self.wait.current(self.registry, pending, stable)
        if waited is not None:  # the newer candidates wait behind it, neither judged nor superseded
            return [self._look_again(waited, stable)]
        if not pending:
            return []
        *older, newest = pending
        verdicts = []
        for row in older:
            reason = f"superseded by {newest.version}"
            if self._refuse(row.version, reason):
                self._verdicts.labels("superseded").inc()
                verdicts.append(Verdict(row.version, "superseded", reason))
        verdicts.append(self._judge(newest, stable))
        return verdicts

    def _promoted(self, version: int) -> None:
        self._verdicts.labels("promoted").inc()
        self._stable.set(version)
        self._promoted_at.set(time.time())
        self._in_a_row = 0
        self._refused_in_a_row.set(0)

    def _rejected(self) -> None:
        self._verdicts.labels("rejected").inc()
        self._in_a_row += 1
        self._refused_in_a_row.set(self._in_a_row)

    def _refuse(self, version: int, reason: str) -> bool:
        """Reject a version that is still a candidate (an operator may have promoted it meanwhile)."""
        try:
            self.registry.set_status(version, "rejected", actor="gate", reason=reason, expect="candidate")
        except RegistryConflict as e:
            log.info("gate: version %d not rejected: %s", version, e)
            return False
        log.warning("gate: version %d rejected: %s", version, reason)
        return True

    # ------------------------------------------------------------------------------------------ checks

    def _record(
        self, version: int, check: str, value: float | None, threshold: float | None, passed: bool, detail: str
    ) -> bool:
        self.registry.record_gate(version, check, value, threshold, passed, detail)
        self._checks.labels(check, "pass" if passed else "fail").inc()
        log.info("gate: version %d %s %s: %s", version, check, "passed" if passed else "FAILED", detail)
        return passed

    def _integrity(self, row: Version) -> dict | None:
        """Rebuild the candidate as the fleet will (parent weights + stored delta); None if that fails."""
        try:
            parent_state = self.registry.materialize(row.parent)
            state, now = apply_delta(parent_state, self.registry.delta_for(row.version))
            got = checksum(state)
        except (DeltaError, BlobError, RegistryError) as e:
            self._record(row.version, "integrity", 0.0, 1.0, False, f"delta from {row.parent} does not apply: {e}")
            return None
        ok = now == row.version and got == row.checksum
        detail = (
            f"delta from {row.parent} rebuilds checksum {got[:12]}…"
            if ok
            else f"delta from {row.parent} rebuilds version {now} checksum {got[:12]}…, expected {row.checksum[:12]}…"
        )
        return state if self._record(row.version, "integrity", float(ok), 1.0, ok, detail) else None

    def _judge(self, row: Version, stable: Version) -> Verdict:
        checks: dict[str, bool] = {}
        early = self._too_early()
        if early is not None:  # left a candidate: superseded by a newer one, or judged when the horizon has passed
            if self._waited_on != row.version:
                self._waited_on = row.version
                self._verdicts.labels("deferred").inc()
                log.info("gate: version %d deferred: %s", row.version, early)
            return Verdict(row.version, "deferred", early, checks)
        why = before_rollback(self.registry, row)
        if why is not None:  # it may carry the change an operator just rolled back
            reason = "emitted before the last rollback"
            checks["after_rollback"] = self._record(
                row.version,
                "after_rollback",
                0.0,
                1.0,
                False,
                f"{reason}: {why} (the learner rebases onto the stable version)",
            )
            self._refuse(row.version, reason)
            self._rejected()
            return Verdict(row.version, "rejected", reason, checks)
        state = self._integrity(row)
        checks["integrity"] = state is not None
        if state is not None and not self.cfg.gate.integrity_only:
            checks.update(self._evidence(row, stable, state))
        failed = [c for c, ok in checks.items() if not ok]
        if failed:
            reason = "failed " + ", ".join(failed)
            self._refuse(row.version, reason)
            self._rejected()
            return Verdict(row.version, "rejected", reason, checks)
        needs_canary = checks.get("needs_canary", False)  # the off-policy check could not judge it: live users must
        reason = f"gate passed ({', '.join(c for c in checks if c != 'needs_canary')})"
        if self.cfg.gate.integrity_only:
            reason += " [gate.integrity_only: no evidence checked]"
        elif self.canary.wanted():  # a configured fleet of 2+ nodes: never promoted without a canary
            try:
                rollout = self.canary.start(row, stable, reason)
            except Deferred as e:  # fewer routable nodes than a canary needs: judged again next step, never skipped
                log.warning("gate: version %d deferred: %s", row.version, e)
                return Verdict(row.version, "deferred", str(e), checks)
            except RegistryConflict as e:  # an operator acted on it meanwhile
                log.info("gate: version %d not put on canary: %s", row.version, e)
                return Verdict(row.version, "deferred", str(e), checks)
            self._canary_share.set(rollout.share)
            return Verdict(row.version, "canary", f"{reason}; canary on {', '.join(rollout.nodes)}", checks)
        elif needs_canary and self.wait.enabled() and self.offpolicy_look is not None:
            return self._wait_or_refuse(row, stable, checks, self.offpolicy_look)
        elif needs_canary:
            reason = (
                "off-policy evidence too thin to judge it (deferred to a canary) and no canary can run "
                f"(gate.canary_share {self.cfg.gate.canary_share:g}, {self.canary.configured_fleet()} node(s) "
                "configured; gate.offpolicy_wait_s 0: no waiting)"
            )
            self._record(row.version, "canary", None, None, False, reason)
            self._refuse(row.version, reason)
            self._rejected()
            return Verdict(row.version, "rejected", reason, checks)
        return self._promote(row, stable, reason, checks)

    def _promote(self, row: Version, stable: Version, reason: str, checks: dict[str, bool]) -> Verdict:
        try:
            self.registry.promote(
                row.version, actor="gate", reason=reason, expected_stable=stable.version, from_candidate=True
            )
        except RegistryConflict as e:  # an operator promoted or rolled back meanwhile: their word stands
            log.info("gate: version %d not promoted: %s; re-evaluating next step", row.version, e)
            return Verdict(row.version, "deferred", str(e), checks)
        announce(
            self.redis,
            self.prefix,
            row.version,
            row.checksum,
            reason,
            self.signer,
            ttl_s=self.cfg.security.announce_ttl_s,
            seq=self.registry.audit_seq(),  # the promotion's own entry included
        )
        log.info("gate: version %d promoted and announced", row.version)
        self._promoted(row.version)
        return Verdict(row.version, "promoted", reason, checks)


def _rewritten(gate: Gate, channel: str, what: str) -> None:
    """Count an announcement key written over because it held another Redis type (``keep_announced``'s answer)."""
    if what == f"was {WRONG_TYPE_WAS}":
        gate._wrong_type.labels(channel).inc()


def _run_chores(gate: Gate) -> None:
    """The gate's chores after a step (``Gate.chores``: e.g. the product's erasures, ``liverl.ops.forget``); a chore
    that fails is logged and counted, and runs again after the next step."""
    for chore in gate.chores:
        try:
            chore(gate)
        except Exception:
            gate._errors.inc()
            log.exception(
                "gate: %s failed; retrying in %.1f s", getattr(chore, "__name__", chore), gate.cfg.gate.poll_s
            )


def run_gate(
    cfg: LiverlConfig,
    make_evaluator: Callable[[Callable[[], list[LoggedGeneration]]], Evaluator],
    once: bool = False,
    chores: list[Callable[[Gate], None]] | None = None,
) -> None:
    """Entry point of ``liverl gate``: the gate loop until SIGINT/SIGTERM (``once``: one step, then return).

    ``make_evaluator(probes)`` builds the evaluator from a callable returning the current probe sequences
    (the command that starts the gate passes ``learner.evaluate.PolicyEvaluator`` with the product's suite).
    ``chores``: callables run with the gate after each step of its loop (``liverl gate`` passes the runner of the
    product's erasures, ``liverl.ops.forget.gate_chore``).
    """
    warm_up()  # the delta codec's kernels (cached on disk after the first compile)
    registry = open_registry(cfg)
    r = setup_redis(cfg, decode_responses=True)
    user_keys = open_user_keys(cfg)  # sealed records open only at use, by a fresh look-up (core.shred)
    tail = GenerationTail(
        kafka_bootstrap(cfg),
        cfg.topics.generations,
        cfg.gate.probe_generations,
        broker=cfg.broker,
        unit_share=PROBE_UNIT_SHARE,  # the heaviest users do not choose the probes
        keys=user_keys,
    ).start()
    heldout = (
        GenerationTail(
            kafka_bootstrap(cfg),
            cfg.topics.heldout,
            cfg.gate.heldout_samples,
            broker=cfg.broker,
            parse=parse_heldout,
            young_s=cfg.gate.revert_horizon_s,
            judged_at=lambda h: h.judged_at,
            keys=user_keys,
        ).start()
        if cfg.gate.heldout_samples
        else None
    )
    server = None
    try:
        key = required_signing_key(cfg)  # none: ValueError, unless security.allow_unsigned (then said loudly)
        gate = Gate(cfg, registry, r, make_evaluator(tail), signer=Signer(key) if key else None, heldout=heldout)
        gate.chores = list(chores or [])
        log.info("gate: announcements %s", f"signed with {key}" if key else "unsigned (no security.signing_key)")
        if cfg.gate.metrics_port and not once:
            server = start_probe_server(
                cfg.serving.host, cfg.gate.metrics_port, gate.metrics, gate.watch.live, lambda: gate.step_error
            )
            log.info("gate: metrics and probes on http://%s:%d/metrics", cfg.serving.host, cfg.gate.metrics_port)
        if once:
            for v in gate.step():
                print(f"version {v.version}: {v.verdict} ({v.reason})")
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        gate.run(stop)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        tail.close()
        if heldout is not None:
            heldout.close()
        r.close()
        registry.close()
        if user_keys is not None:
            user_keys.close()
