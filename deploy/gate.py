"""The release gate: turns learner candidates into releases, or refuses them.

Why a gate: online RL on live feedback can regress or collapse (FIELD_NOTES: plain REINFORCE collapsed to 0%
accuracy after peaking); Cursor deploys a checkpoint only if it does not regress. Each candidate must pass

  (a) integrity   its stored delta, applied to its parent's weights, yields exactly its recorded checksum
                  (what the fleet will do, done first here);
  (b) heldout     held-out expected acceptance >= the stable version's - ``cfg.gate.max_regression``;
  (c) collapse    policy entropy on the held-out prompts >= a floor (a collapsed, near-deterministic policy
                  can still score well on a narrow eval, but it has stopped exploring and cannot recover).

Every check lands in ``gate_results``; a pass promotes the version (audited, actor "gate") and writes
``<prefix>:desired`` in Redis, which the serving agents follow. When several candidates are waiting only the
newest is evaluated; the older ones are rejected as superseded (the learner has moved past them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import prometheus_client as prom
import redis as redis_lib

from deploy.blobstore import BlobError
from deploy.delta import DeltaError, apply_delta, checksum
from deploy.registry import Registry, RegistryError, Version, open_registry
from liverl.core.config import LiverlConfig
from liverl.core.schemas import VersionAnnouncement

log = logging.getLogger("liverl.gate")

DEFAULT_ENTROPY_FLOOR = 0.05  # nats per token
EvaluateFn = Callable[[Path, Mapping[str, Any], int], dict]


def desired_key(prefix: str) -> str:
    return f"{prefix}:desired"


def announce(r: redis_lib.Redis, prefix: str, version: int, checksum_: str, reason: str) -> VersionAnnouncement:
    """Tell the fleet which version to serve (``<prefix>:desired``)."""
    ann = VersionAnnouncement(version=version, checksum=checksum_, reason=reason)
    r.set(desired_key(prefix), ann.to_bytes())
    return ann


@dataclass
class Verdict:
    version: int
    verdict: str  # promoted | rejected | superseded | deferred
    reason: str
    checks: dict[str, bool] = field(default_factory=dict)


def _default_evaluate(model_dir: Path, state_dict: Mapping[str, Any], n_prompts: int) -> dict:
    from liverl.demo.score import (
        heldout_score,  # heavy (torch/transformers): imported only when the gate evaluates
    )

    return heldout_score(model_dir, dict(state_dict), n_prompts)


class Gate:
    """Evaluates pending candidates. ``evaluate`` defaults to ``liverl.demo.score.heldout_score``.

    ``model_dir``: the HF model dir the eval loads weights into (None: the base version's ``model_dir``).
    ``entropy_floor``: collapse threshold in nats (None: ``cfg.gate.min_entropy`` if the config has it, else 0.05).
    """

    def __init__(self, cfg: LiverlConfig, registry: Registry, redis: redis_lib.Redis, model_dir: Path | None = None,
                 evaluate: EvaluateFn | None = None, entropy_floor: float | None = None):
        self.cfg, self.registry, self.redis = cfg, registry, redis
        self.prefix = cfg.topics.prefix
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self.evaluate = evaluate or _default_evaluate
        self.entropy_floor = (entropy_floor if entropy_floor is not None
                              else getattr(cfg.gate, "min_entropy", DEFAULT_ENTROPY_FLOOR))
        self._stable_scores: dict[tuple[int, str], dict] = {}
        self.metrics = prom.CollectorRegistry()
        self._verdicts = prom.Counter("liverl_gate_verdicts", "Gate verdicts on candidates", ["verdict"],
                                      registry=self.metrics)
        self._checks = prom.Counter("liverl_gate_checks", "Gate checks run", ["check", "result"], registry=self.metrics)
        self._errors = prom.Counter("liverl_gate_errors", "Gate steps that failed with an exception",
                                    registry=self.metrics)
        self._eval_s = prom.Histogram("liverl_gate_eval_seconds", "Time of one held-out evaluation",
                                      registry=self.metrics, buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self._stable = prom.Gauge("liverl_gate_stable_version", "Stable version as of the last gate step",
                                  registry=self.metrics)
        self._score = prom.Gauge("liverl_gate_last_score", "Last evaluated candidate's held-out numbers", ["metric"],
                                 registry=self.metrics)

    @property
    def model_dir(self) -> Path:
        if self._model_dir is None:
            base_dir = self.registry.get(0).model_dir
            if not base_dir:
                raise ValueError("the gate needs a model_dir: pass one, or register the base with init_base(model_dir=...)")
            self._model_dir = Path(base_dir)
        return self._model_dir

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

    def step(self) -> list[Verdict]:
        """Process the pending candidates: the newest is evaluated, older ones are superseded."""
        stable = self.registry.stable()
        self._stable.set(stable.version)
        if self.redis.get(desired_key(self.prefix)) is None:
            announce(self.redis, self.prefix, stable.version, stable.checksum, "initial stable version")
        pending = self.registry.candidates()
        if not pending:
            return []
        *older, newest = pending
        verdicts = []
        for row in older:
            reason = f"superseded by {newest.version}"
            self.registry.set_status(row.version, "rejected", actor="gate", reason=reason)
            log.info("gate: version %d rejected: %s", row.version, reason)
            self._verdicts.labels("superseded").inc()
            verdicts.append(Verdict(row.version, "superseded", reason))
        verdicts.append(self._judge(newest, stable))
        return verdicts

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

    def _score_of(self, state: Mapping[str, Any]) -> dict:
        t0 = time.perf_counter()
        score = self.evaluate(self.model_dir, state, self.cfg.gate.eval_prompts)
        self._eval_s.observe(time.perf_counter() - t0)
        missing = {"expected_acceptance", "entropy"} - set(score)
        if missing:
            raise ValueError(f"the gate's evaluate function returned no {sorted(missing)} (got {sorted(score)})")
        return score

    def stable_score(self, stable: Version) -> dict:
        """Held-out score of the stable version, computed once per (version, checksum) and recorded for it."""
        key = (stable.version, stable.checksum)
        if key not in self._stable_scores:
            score = self._score_of(self.registry.materialize(stable.version))
            self.registry.record_gate(stable.version, "heldout", score["expected_acceptance"], None, True,
                                      "reference score of the stable version " + json.dumps(score, sort_keys=True, default=str))
            self._stable_scores[key] = score
        return self._stable_scores[key]

    def _judge(self, row: Version, stable: Version) -> Verdict:
        checks: dict[str, bool] = {}
        state = self._integrity(row)
        checks["integrity"] = state is not None
        if state is not None:
            ref = self.stable_score(stable)
            score = self._score_of(state)
            for k in ("expected_acceptance", "greedy_acceptance", "entropy"):
                if k in score:
                    self._score.labels(k).set(score[k])
            ea, floor = score["expected_acceptance"], ref["expected_acceptance"] - self.cfg.gate.max_regression
            checks["heldout"] = self._record(
                row.version, "heldout", ea, floor, ea >= floor,
                f"expected_acceptance {ea:.4f} vs stable v{stable.version} {ref['expected_acceptance']:.4f} "
                f"(max regression {self.cfg.gate.max_regression}) " + json.dumps(score, sort_keys=True, default=str))
            ent = score["entropy"]
            checks["collapse"] = self._record(row.version, "collapse", ent, self.entropy_floor, ent >= self.entropy_floor,
                                              f"entropy {ent:.4f} nats vs floor {self.entropy_floor}")
        failed = [c for c, ok in checks.items() if not ok]
        if failed:
            reason = "failed " + ", ".join(failed)
            self.registry.set_status(row.version, "rejected", actor="gate", reason=reason)
            log.warning("gate: version %d rejected: %s", row.version, reason)
            self._verdicts.labels("rejected").inc()
            return Verdict(row.version, "rejected", reason, checks)
        if self.registry.stable().version != stable.version:  # an operator changed the stable version meanwhile
            log.info("gate: stable changed while version %d was evaluated; re-evaluating next step", row.version)
            return Verdict(row.version, "deferred", "stable version changed during evaluation", checks)
        reason = f"gate passed ({', '.join(checks)})"
        self.registry.promote(row.version, actor="gate", reason=reason)
        announce(self.redis, self.prefix, row.version, row.checksum, reason)
        log.info("gate: version %d promoted and announced", row.version)
        self._verdicts.labels("promoted").inc()
        self._stable.set(row.version)
        return Verdict(row.version, "promoted", reason, checks)


def run_gate(cfg: LiverlConfig, once: bool = False) -> None:
    """Entry point of ``liverl gate``: the gate loop until SIGINT/SIGTERM (``once``: one step, then return)."""
    import signal

    from liverl.core.services import setup_redis
    from deploy.delta import warm_up

    warm_up()  # the delta codec's kernels (cached on disk after the first compile)
    registry = open_registry(cfg)
    r = setup_redis(cfg, decode_responses=True)
    try:
        gate = Gate(cfg, registry, r)
        if once:
            for v in gate.step():
                print(f"version {v.version}: {v.verdict} ({v.reason})")
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        gate.run(stop)
    finally:
        r.close()
        registry.close()
