"""The release gate: turns learner candidates into releases, or refuses them.

Why a gate: online RL on live feedback can regress or collapse (plain REINFORCE on a
small MoE, measured here, reached 82% accuracy and then collapsed to 0%); Cursor deploys a checkpoint only if it does not regress. Each candidate must pass

  (a) integrity   its stored delta, applied to its parent's weights, yields exactly its recorded checksum
                  (what the fleet will do, done first here);
  (b) drift       mean per-token KL(candidate || stable) on recent logged generations <= ``cfg.gate.max_kl``
                  (one release moves the policy only so far from what users have seen work);
  (c) collapse    the candidate's mean per-token entropy there >= ``cfg.gate.min_entropy`` (a collapsed,
                  near-deterministic policy has stopped exploring and cannot recover);
  (d) suite       only when the product has an evaluation suite: its mean grade >= the stable version's -
                  ``cfg.gate.max_regression``.

The gate judges on evidence a real product has: its logged traffic and, if it has one, its own evaluation
suite. It never sees an answer key. The figures come from an ``Evaluator`` handed in by the command that
starts the gate (``learner.evaluate.PolicyEvaluator``), so this module imports neither the learner nor a
product; the probe sequences come from a tail of the generations topic (``GenerationTail``).

Every check lands in ``gate_results``; a pass promotes the version (audited, actor "gate") and writes
``<prefix>:desired`` in Redis, which the serving agents follow. When several candidates are waiting only the
newest is evaluated; the older ones are rejected as superseded (the learner has moved past them).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import prometheus_client as prom
import redis as redis_lib

from deploy.blobstore import BlobError
from deploy.delta import DeltaError, apply_delta, checksum
from deploy.signing import Signer, announce
from deploy.registry import Registry, RegistryConflict, RegistryError, Version, open_registry
from liverl.core import keys
from liverl.core.bus import kafka_python_security
from liverl.core.config import BrokerConfig, LiverlConfig
from liverl.core.schemas import GenerationRecord, VersionAnnouncement, WireError

log = logging.getLogger("liverl.gate")



class Evaluator(Protocol):
    """What the gate asks of a policy (see ``learner.evaluate.PolicyEvaluator``)."""

    def drift(self, candidate: Mapping[str, Any], stable: Mapping[str, Any]) -> dict | None:
        """``{"kl", "entropy", "tokens", ...}`` on the current probes, or None when there are none yet."""

    def suite_score(self, weights: Mapping[str, Any]) -> dict | None:
        """``{"name", "score", ...}`` on the product's evaluation suite, or None without one."""


@dataclass
class Verdict:
    version: int
    verdict: str  # promoted | rejected | superseded | deferred
    reason: str
    checks: dict[str, bool] = field(default_factory=dict)



class Gate:
    """Evaluates pending candidates with the ``evaluator`` it is given (drift, collapse, optional suite)."""

    def __init__(self, cfg: LiverlConfig, registry: Registry, redis: redis_lib.Redis, evaluator: Evaluator,
                 signer: Signer | None = None):
        self.cfg, self.registry, self.redis, self.signer = cfg, registry, redis, signer
        self.prefix = cfg.topics.prefix
        self.evaluator = evaluator
        self._stable_suite: dict[tuple[int, str], dict | None] = {}
        self.metrics = prom.CollectorRegistry()
        self._verdicts = prom.Counter("liverl_gate_verdicts", "Gate verdicts on candidates", ["verdict"],
                                      registry=self.metrics)
        self._checks = prom.Counter("liverl_gate_checks", "Gate checks run", ["check", "result"], registry=self.metrics)
        self._errors = prom.Counter("liverl_gate_errors", "Gate steps that failed with an exception",
                                    registry=self.metrics)
        self._eval_s = prom.Histogram("liverl_gate_eval_seconds", "Time of one candidate's evaluation",
                                      registry=self.metrics, buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self._stable = prom.Gauge("liverl_gate_stable_version", "Stable version as of the last gate step",
                                  registry=self.metrics)
        self._score = prom.Gauge("liverl_gate_last_score", "Last evaluated candidate's figures (kl, entropy, suite)",
                                 ["metric"], registry=self.metrics)

    def metrics_text(self) -> bytes:
        """Gate metrics in Prometheus text format."""
        return prom.generate_latest(self.metrics)

    # ------------------------------------------------------------------------------------------ loop

    def run(self, stop_event: threading.Event) -> None:
        """Poll for candidates every ``cfg.gate.poll_s`` until ``stop_event`` is set; a failing step is logged,
        counted (``liverl_gate_errors_total``) and retried at the next poll."""
        log.info("gate: watching registry %s every %.1f s", self.registry.url, self.cfg.gate.poll_s)
        while not stop_event.is_set():
            try:
                self.step()
            except Exception:
                self._errors.inc()
                log.exception("gate: step failed; retrying in %.1f s", self.cfg.gate.poll_s)
            stop_event.wait(self.cfg.gate.poll_s)

    def reconcile(self, stable: Version) -> None:
        """The fleet follows ``<prefix>:desired``; make it name the registry's stable version (after a crash between
        a promotion and its announcement, or a lost Redis key). The registry is the truth."""
        raw = self.redis.get(keys.desired(self.prefix))
        try:
            ann = VersionAnnouncement.from_bytes(raw) if raw is not None else None
        except WireError:
            ann = None
        unsigned = self.signer is not None and ann is not None and not ann.signature
        if ann is None or unsigned or (ann.version, ann.checksum) != (stable.version, stable.checksum):
            was = "nothing" if ann is None else f"v{ann.version}"
            announce(self.redis, self.prefix, stable.version, stable.checksum,
                     f"reconciled with the registry (was {was}{', unsigned' if unsigned else ''})", self.signer)
            log.warning("gate: desired version was %s; announced the registry's stable v%d", was, stable.version)

    def step(self) -> list[Verdict]:
        """Process the pending candidates: the newest is evaluated, older ones are superseded."""
        stable = self.registry.stable()
        self._stable.set(stable.version)
        self.reconcile(stable)
        pending = self.registry.candidates()
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

    def _record(self, version: int, check: str, value: float | None, threshold: float | None, passed: bool,
                detail: str) -> bool:
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
        detail = (f"delta from {row.parent} rebuilds checksum {got[:12]}…" if ok else
                  f"delta from {row.parent} rebuilds version {now} checksum {got[:12]}…, expected {row.checksum[:12]}…")
        return state if self._record(row.version, "integrity", float(ok), 1.0, ok, detail) else None

    def stable_suite(self, stable: Version) -> dict | None:
        """The stable version's suite score, computed once per (version, checksum) and recorded for it."""
        key = (stable.version, stable.checksum)
        if key not in self._stable_suite:
            score = self.evaluator.suite_score(self.registry.materialize(stable.version))
            if score is not None:
                self.registry.record_gate(stable.version, "suite", score["score"], None, True,
                                          "reference score of the stable version " + json.dumps(score, sort_keys=True))
            self._stable_suite[key] = score
        return self._stable_suite[key]

    def _evidence(self, row: Version, stable: Version, state: Mapping[str, Any]) -> dict[str, bool]:
        """Checks (b)-(d); each lands in gate_results with its value, threshold and reason."""
        checks: dict[str, bool] = {}
        g = self.cfg.gate
        t0 = time.perf_counter()
        drift = self.evaluator.drift(state, self.registry.materialize(stable.version))
        if drift is None:
            checks["drift"] = self._record(row.version, "drift", None, g.max_kl, False,
                                           "no logged generations to measure drift on yet; retried with the next candidate")
        else:
            kl, ent = drift["kl"], drift["entropy"]
            self._score.labels("kl").set(kl)
            self._score.labels("entropy").set(ent)
            checks["drift"] = self._record(
                row.version, "drift", kl, g.max_kl, kl <= g.max_kl,
                f"KL(v{row.version} || stable v{stable.version}) {kl:.4f} nats/token vs max {g.max_kl} "
                f"on {drift['tokens']} tokens of {drift['probes']} logged generations")
            checks["collapse"] = self._record(
                row.version, "collapse", ent, g.min_entropy, ent >= g.min_entropy,
                f"entropy {ent:.4f} nats/token (stable {drift.get('stable_entropy', float('nan')):.4f}) vs floor {g.min_entropy}")
        ref = self.stable_suite(stable)
        if ref is not None:
            score = self.evaluator.suite_score(state)
            self._score.labels("suite").set(score["score"])
            floor = ref["score"] - g.max_regression
            checks["suite"] = self._record(
                row.version, "suite", score["score"], floor, score["score"] >= floor,
                f"suite {score['name']!r} {score['score']:.4f} vs stable v{stable.version} {ref['score']:.4f} "
                f"(max regression {g.max_regression}, {score['completions']} completions)")
        self._eval_s.observe(time.perf_counter() - t0)
        return checks

    def _judge(self, row: Version, stable: Version) -> Verdict:
        checks: dict[str, bool] = {}
        _, rolled_back_at = self.registry.last_rollback()
        if row.created_at <= rolled_back_at:  # it may carry the change an operator just rolled back
            reason = "emitted before the last rollback"
            checks["after_rollback"] = self._record(row.version, "after_rollback", 0.0, 1.0, False,
                                                    f"{reason} (the learner rebases onto the stable version)")
            self._refuse(row.version, reason)
            self._verdicts.labels("rejected").inc()
            return Verdict(row.version, "rejected", reason, checks)
        state = self._integrity(row)
        checks["integrity"] = state is not None
        if state is not None:
            checks.update(self._evidence(row, stable, state))
        failed = [c for c, ok in checks.items() if not ok]
        if failed:
            reason = "failed " + ", ".join(failed)
            self._refuse(row.version, reason)
            self._verdicts.labels("rejected").inc()
            return Verdict(row.version, "rejected", reason, checks)
        reason = f"gate passed ({', '.join(checks)})"
        try:
            self.registry.promote(row.version, actor="gate", reason=reason, expected_stable=stable.version,
                                  from_candidate=True)
        except RegistryConflict as e:  # an operator promoted or rolled back meanwhile: their word stands
            log.info("gate: version %d not promoted: %s; re-evaluating next step", row.version, e)
            return Verdict(row.version, "deferred", str(e), checks)
        announce(self.redis, self.prefix, row.version, row.checksum, reason, self.signer)
        log.info("gate: version %d promoted and announced", row.version)
        self._verdicts.labels("promoted").inc()
        self._stable.set(row.version)
        return Verdict(row.version, "promoted", reason, checks)


class LoggedGeneration(NamedTuple):
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


class GenerationTail:
    """The most recent ``size`` trainable generation records, kept by a thread that tails the generations
    topic without a consumer group (it starts ``size`` records back on each partition and never commits).
    These are the gate's probe sequences: real prompts, and completions the served policy sampled."""

    def __init__(self, bootstrap: str, topic: str, size: int, broker: BrokerConfig | None = None):
        self.bootstrap, self.topic, self.size, self.broker = bootstrap, topic, size, broker
        self._recent: collections.deque[LoggedGeneration] = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-generation-tail", daemon=True)
        self.refused = 0

    def start(self) -> GenerationTail:
        self._thread.start()
        return self

    def __call__(self) -> list[LoggedGeneration]:
        with self._lock:
            return list(self._recent)

    def _run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None,
                                 **kafka_python_security(self.broker))
        try:
            while not self._stop.is_set():
                parts = consumer.partitions_for_topic(self.topic)
                if parts:
                    break
                self._stop.wait(1.0)
            else:
                return
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            ends, begins = consumer.end_offsets(tps), consumer.beginning_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(begins[tp], ends[tp] - self.size))
            while not self._stop.is_set():
                for records in consumer.poll(timeout_ms=500, max_records=1000).values():
                    for rec in records:
                        self._add(rec.value)
        finally:
            consumer.close()

    def _add(self, raw: bytes) -> None:
        try:
            g = GenerationRecord.from_bytes(raw)
        except WireError:
            self.refused += 1
            return
        if g.trainable and g.prompt_token_ids and g.completion_token_ids:
            with self._lock:
                self._recent.append(LoggedGeneration(tuple(g.prompt_token_ids), tuple(g.completion_token_ids)))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def run_gate(cfg: LiverlConfig, make_evaluator: Callable[[Callable[[], list[LoggedGeneration]]], Evaluator],
             once: bool = False) -> None:
    """Entry point of ``liverl gate``: the gate loop until SIGINT/SIGTERM (``once``: one step, then return).

    ``make_evaluator(probes)`` builds the evaluator from a callable returning the current probe sequences
    (the command that starts the gate passes ``learner.evaluate.PolicyEvaluator`` with the product's suite).
    """
    import signal

    from deploy.delta import warm_up
    from liverl.core.services import kafka_bootstrap, setup_redis, signing_key_path

    warm_up()  # the delta codec's kernels (cached on disk after the first compile)
    registry = open_registry(cfg)
    r = setup_redis(cfg, decode_responses=True)
    tail = GenerationTail(kafka_bootstrap(cfg), cfg.topics.generations, cfg.gate.probe_generations,
                          broker=cfg.broker).start()
    server = None
    try:
        key = signing_key_path(cfg)
        gate = Gate(cfg, registry, r, make_evaluator(tail), signer=Signer(key) if key else None)
        log.info("gate: announcements %s", f"signed with {key}" if key else "unsigned (no security.signing_key)")
        if cfg.gate.metrics_port and not once:
            server, _ = prom.start_http_server(cfg.gate.metrics_port, addr=cfg.serving.host, registry=gate.metrics)
            log.info("gate: Prometheus metrics on http://%s:%d/metrics", cfg.serving.host, cfg.gate.metrics_port)
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
        r.close()
        registry.close()
