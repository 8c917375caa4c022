"""The candidate policy: when the learner's weights become a candidate version, and when it drops its lineage.

What the learner does with the registry (``deploy.registry.registry``), apart from the loop's fetch and update:

- **Emit.** Every ``candidate_every_steps`` updates the weights (with ``candidate_ema``: their average over the
  updates, ``PolicyTrainer.candidate_weights``) are registered as a candidate, a child of the stable version, with
  the metrics of the updates since the last one, the watermark of the samples it was trained on and its step. A
  registry error leaves the candidate due: it is tried again after the next update. While the hold flag is set
  (``liverl hold``; an unreadable flag counts as set) the learner trains but emits nothing. With averaged candidates
  the learner measures the average's entropy against its updates' and, with ``floor_for_candidate``, raises its
  entropy floor by their ratio (``PolicyTrainer.measure_candidate_entropy``).
- **Rebase** (``maybe_rebase``): restart from the stable weights, with a fresh optimizer, when

  1. an operator rolled back (whatever this lineage learned since must not come back in a candidate);
  2. the gate refused this lineage's newest ``rebase_after_refusals`` judged candidates in a row on their own
     evidence (``evidence_against``): a lineage under the gate's collapse floor is refused for as long as it is
     trained further. Each such rebase multiplies the learning rate by ``lr_backoff`` (not under ``min_lr_scale``);
     each promotion since it last changed divides it back, up to ``lr``;
  3. only stale samples came for ``STARVE_S`` and the stable version's samples are stale too
     (``learner.admission``): the fleet stopped following this learner, which would otherwise starve.

  The rollback check runs before every update and at most every ``ROLLBACK_CHECK_S`` while idle.
- **KL reference.** With ``kl_reference = "stable"`` the KL penalty's reference follows the stable version.

Invariants, and a kill -9 at each point. The loop writes a checkpoint right after a candidate or a rebase, and only
then commits offsets (``learner.checkpoint``). Killed after the registry has a candidate and before that checkpoint,
the restart resumes from the checkpoint before it and trains those samples again; the registered candidate stays a
candidate for the gate to judge. Killed after a rebase and before its checkpoint, the restart sees the same registry
and rebases again (the last rollback seen, the back-off and the steps of each version are in the checkpoint).
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.exc import SQLAlchemyError

from core import keys
from core.config import LiverlConfig
from deploy.registry.registry import RegistryError
from learner.admission import Admission
from learner.checkpoint import LearnerState
from learner.ledger import Ledger

log = logging.getLogger("liverl.learner")

ROLLBACK_CHECK_S = 1.0  # while idle; before an update the rollback check always runs
REFERENCE_CHECK_S = 5.0  # how often the KL reference looks for a new stable version
STARVE_S = 30.0  # only stale samples for this long (the fleet stopped following this learner): rebase onto stable
# what a registry call may raise when the database or the blob store is unreachable or refuses
REGISTRY_ERRORS = (RegistryError, SQLAlchemyError, OSError)


def evidence_against(reason: str) -> bool:
    """Whether a rejection says the candidate itself is bad: a failed gate check (``failed drift, collapse``...) or a
    canary aborted on its live evidence. That includes a one-node gate's refusal at the end of its wait for
    off-policy evidence (``failed offpolicy_wait``, ``deploy.gate.waiting``): the lineage moved further from what
    users were served than the held-out evidence can follow, and a rebase at a backed-off learning rate brings
    candidates that need fewer samples. Not: superseded by a newer candidate, refused at once for too little evidence
    with no canary to run and no wait (``gate.offpolicy_wait_s`` 0), a sample-ratio mismatch or a deadline (the
    rollout's trouble, not the candidate's), an operator's rejection without a check."""
    if reason.startswith("failed "):
        return True
    return reason.startswith("canary aborted:") and not any(w in reason for w in ("srm:", "deadline passed"))


class Candidates:
    """Emits candidates, follows the stable version, rebases (see the module doc)."""

    def __init__(
        self, cfg: LiverlConfig, state: LearnerState, trainer, registry, redis, ledger: Ledger, admission: Admission
    ):
        self.cfg, self.lcfg, self.state = cfg, cfg.learner, state
        self.trainer, self.registry, self.redis, self.ledger, self.admission = (
            trainer,
            registry,
            redis,
            ledger,
            admission,
        )
        self._due = False  # a candidate is due (its step came, or its registration failed)
        self._rebased_wall = 0.0  # when this learner last rebased (wall clock, as the registry's times)
        self._emitted_since_rebase = 0  # candidates this process emitted since then
        self.rebase_checked_at = 0.0  # when ``maybe_rebase`` last read the registry (monotonic)
        self._ref_checked_at = 0.0
        self.ref_version = 0  # the KL reference starts at the base policy (version 0)

    def start_from_stable(self) -> int:
        """No checkpoint: start from the stable version's weights, as of the registry's last rollback."""
        st, stable = self.state, self.registry.stable()
        st.last_emitted = int(stable.version)
        st.version_steps = {int(stable.version): st.step}
        st.rollback_seen = self.registry.last_rollback()[0]  # stable already reflects any earlier rollback
        self.ledger.rebased(st.step, int(stable.version))
        if stable.version != 0:
            self.trainer.load_weights(self.registry.materialize(stable.version), reset_optimizer=True)
        return int(stable.version)

    # -- emit -----------------------------------------------------------------------------------------
    def updated(self, m: dict[str, float], n_samples: int) -> None:
        """An update with metrics ``m`` trained ``n_samples``: it counts towards the next candidate's metrics."""
        sc = self.state.since_candidate
        sc["reward_sum"] += m["reward_mean"] * n_samples
        sc["samples"] += n_samples
        sc["steps"] += 1
        sc["loss_sum"] += m["loss"]

    def due(self) -> bool:
        """Whether a candidate is due: its step came, or an earlier registration failed."""
        if self.state.step % self.lcfg.candidate_every_steps == 0 and self.state.step:
            self._due = True
        return self._due

    def frozen(self) -> bool:
        """The hold: the learner trains but emits no candidates while the flag ``keys.learner_hold`` is set (by
        ``liverl hold``, or a demo measuring its last version) or the audit log's newest hold or release is a hold
        (``Registry.held``: ``liverl hold``'s own entry, so deleting the flag in Redis does not lift an operator's
        hold; ``liverl hold --release`` does). An unreadable flag or log counts as held (no candidate we cannot
        account for)."""
        if self.redis is not None:
            try:
                if self.redis.get(keys.learner_hold(self.cfg.topics.prefix)) in (b"1", "1"):
                    return True
            except Exception as e:  # noqa: BLE001 - redis-py raises several families; training goes on either way
                log.warning("learner: cannot read the freeze flag (%s); holding back candidates", e)
                return True
        try:
            return self.registry.held() is not None
        except REGISTRY_ERRORS as e:
            log.warning("learner: cannot read the audit log's hold (%s); holding back candidates", e)
            return True

    def emit(self, metrics_now: dict[str, float]) -> None:
        """Register the due candidate (``metrics_now``: the last update's), unless frozen; on a registry error it
        stays due."""
        st = self.state
        if self.frozen():
            self._due = False
            st.counters["candidates_skipped_frozen"] += 1
            log.info("learner: step %d: frozen, no candidate", st.step)
            return
        metrics = self._metrics(metrics_now)
        held = self.trainer.measure_candidate_entropy()  # with averaged candidates: what the gate will measure
        if held is not None:
            metrics["candidate_entropy"] = held["candidate_entropy"]
        try:
            parent = int(self.registry.stable().version)
            row = self.registry.add_candidate(
                self.trainer.candidate_weights(),
                parent=parent,
                metrics=metrics,
                sample_offsets={str(p): o for p, o in sorted(st.offsets.items())},
                learner_step=st.step,
                rollback_seen=st.rollback_seen,  # the last rollback these weights were rebased for
            )
        except REGISTRY_ERRORS as e:  # the weights are in the checkpoint; the candidate is tried again next step
            st.counters["registry_errors"] += 1
            log.error(
                "learner: step %d: cannot register a candidate (%s: %s); retrying after the next step",
                st.step,
                type(e).__name__,
                e,
            )
            return
        self._due = False
        st.last_emitted = st.last_candidate = int(row.version)
        self._emitted_since_rebase += 1
        st.version_steps[int(row.version)] = st.step
        st.since_candidate = {k: 0.0 for k in st.since_candidate}
        self._log_emitted(int(row.version), parent, metrics, held)

    def _metrics(self, metrics_now: dict[str, float]) -> dict[str, float]:
        sc = self.state.since_candidate
        return {
            "samples_trained": int(self.state.counters["samples_trained"]),
            "samples_since_last": int(sc["samples"]),
            "reward_mean": sc["reward_sum"] / max(sc["samples"], 1.0),
            "loss_mean": sc["loss_sum"] / max(sc["steps"], 1.0),
            **{
                k: metrics_now[k]
                for k in ("kl", "entropy", "entropy_floor_gap", "ratio_mean", "clipped_frac", "masked_frac")
                if k in metrics_now
            },
        }

    def _log_emitted(self, version: int, parent: int, metrics: dict[str, float], held: dict | None) -> None:
        log.info(
            "learner: step %d -> candidate v%d (parent v%d, %d samples trained, reward %.3f since last%s%s)",
            self.state.step,
            version,
            parent,
            metrics["samples_trained"],
            metrics["reward_mean"],
            f"; its weights averaged over its updates, decay {self.lcfg.candidate_ema}"
            if self.lcfg.candidate_ema
            else "",
            f"; entropy {held['candidate_entropy']:.3f} nats a token against its updates' {held['entropy']:.3f}"
            + (
                f", the floor {self.lcfg.entropy_floor * held['floor_lift']:.3f} from now on"
                if self.lcfg.floor_for_candidate
                else ""
            )
            if held is not None
            else "",
        )

    # -- follow the stable version ----------------------------------------------------------------------
    def maybe_move_reference(self) -> None:
        """With ``kl_reference = "stable"``, anchor the KL penalty to the version being served once it changes."""
        if self.lcfg.kl_reference != "stable":
            return
        now = time.monotonic()
        if now - self._ref_checked_at < REFERENCE_CHECK_S:
            return
        self._ref_checked_at = now
        stable = int(self.registry.stable().version)
        if stable == self.ref_version:
            return
        self.trainer.set_reference(self.registry.materialize(stable))
        log.info("learner: KL reference moved from v%s to stable v%d", self.ref_version, stable)
        self.ref_version = stable

    def maybe_rebase(self, before_update: bool = False) -> bool:
        """Restart from the stable weights when an operator rolled back, the gate keeps refusing this lineage, or the
        fleet stopped following it (see the module doc); True when it did (the loop then writes a checkpoint).

        Called on every loop iteration, whatever the counters say: a deployment that never dropped a stale
        sample must see a rollback too. The rollback check is one indexed registry read; it runs before every
        update (``before_update``: no step trains a lineage the registry has rolled back) and at most every
        ``ROLLBACK_CHECK_S`` while idle. Then a lineage the gate keeps refusing (``_refused_in_a_row``); the
        starvation rule applies once samples were refused as stale.
        """
        now = time.monotonic()
        if not before_update and now - self.rebase_checked_at < ROLLBACK_CHECK_S:
            return False
        self.rebase_checked_at = now
        st = self.state
        rollback, _ = self.registry.last_rollback()
        if st.rollback_seen is not None and rollback > st.rollback_seen:
            st.rollback_seen = rollback
            stable = int(self.registry.stable().version)
            log.warning("learner: the registry was rolled back to v%d: rebasing onto it", stable)
            self._rebase(stable)
            return True
        st.rollback_seen = rollback
        self._recover_lr()
        refused = self._refused_in_a_row()
        if refused:
            stable = int(self.registry.stable().version)
            scale = max(self.lcfg.min_lr_scale, self.trainer.lr_scale * self.lcfg.lr_backoff)
            log.warning(
                "learner: the gate refused this lineage's last %d candidates (%s); rebasing onto stable v%d "
                "at learning rate %.3g (%.3g x lr)",
                len(refused),
                "; ".join(refused[:3]),
                stable,
                self.lcfg.lr * scale,
                scale,
            )
            self._set_lr_scale(scale)
            self._rebase(stable)
            return True
        if not st.counters["dropped:stale"]:
            return False  # nothing was ever refused as stale: the fleet follows this learner
        stable = int(self.registry.stable().version)
        starved_s = now - self.admission.fresh_at
        lag, max_lag = self.admission.lag(stable), self.admission.max_lag
        if starved_s < STARVE_S or lag <= max_lag:
            return False  # still fed (a canary's samples), or the stable version's samples are fresh: no reason
        log.warning(
            "learner: only stale samples for %.0f s; stable v%d is %d updates behind (max %d): rebasing onto v%d",
            starved_s,
            stable,
            lag,
            max_lag,
            stable,
        )
        self._rebase(stable)
        return True

    def _set_lr_scale(self, scale: float, since: float | None = None) -> None:
        """Train at ``scale`` x lr; promotions after ``since`` (default: now) count towards the next recovery."""
        if scale != self.trainer.lr_scale:
            self.trainer.set_lr_scale(scale)
            self.state.counters["lr_changes"] += 1
        self.state.lr_scale_since = time.time() if since is None else since

    def _recover_lr(self) -> None:
        """A learning rate backed off after refusals (``learner.lr_backoff``) comes back one step per promotion since
        it last changed: the gate accepts this lineage's steps again. One registry read, only while backed off."""
        if self.trainer.lr_scale >= 1.0:
            return
        promoted_at = self.registry.stable().promoted_at or 0.0
        if promoted_at <= self.state.lr_scale_since:
            return
        scale = min(1.0, self.trainer.lr_scale / self.lcfg.lr_backoff)
        log.info(
            "learner: a candidate was promoted since the learning rate backed off: learning rate %.3g (%.3g x lr)",
            self.lcfg.lr * scale,
            scale,
        )
        self._set_lr_scale(scale, since=promoted_at)

    def _refused_in_a_row(self) -> list[str]:
        """The gate's reasons when it refused this learner's newest ``rebase_after_refusals`` judged candidates in a row
        on their evidence since the stable version was emitted and this learner's last rebase; else []. Candidates not
        judged yet are passed over (there nearly always is one: the learner emits while the gate judges), and one on
        a canary defers the decision to its verdict."""
        k = self.lcfg.rebase_after_refusals
        if not k or self._emitted_since_rebase < k:
            return []  # too few candidates of this lineage for k refusals: no registry read before the update
        stable = self.registry.stable()
        # from the stable version's creation, not its promotion: the candidates emitted during its canary are
        # judged after its promotion, against it, and their refusals count
        since = max(stable.created_at, self._rebased_wall)
        reasons = []
        for v in self.registry.list(limit=8 * k):  # newest first
            if v.created_at <= since:
                break
            if v.status == "candidate":
                continue  # not judged yet (the gate judges the newest; the older ones it supersedes): no verdict
            if v.status == "canary":
                return []  # on live users now: its verdict may end the run, so wait for it
            if v.status != "rejected":
                break
            if not evidence_against(v.status_reason or ""):
                continue  # superseded, too little evidence to judge, an operator's or the rollout's own trouble
            reasons.append(f"v{v.version}: {v.status_reason}")
            if len(reasons) >= k:
                return reasons
        return []

    def _rebase(self, stable: int) -> None:
        st = self.state
        self.trainer.load_weights(self.registry.materialize(stable), reset_optimizer=True)
        self._rebased_wall = time.time()
        self._emitted_since_rebase = 0
        st.last_emitted = stable
        st.version_steps[stable] = st.step
        self.ledger.rebased(st.step, stable)
        self.admission.fresh_at = time.monotonic()
        st.counters["rebases"] += 1
