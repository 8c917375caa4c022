"""The learner's poll/commit loop (``Learner.run``): the steps of one batch and their invariants are on the
package's page (``learner/__init__.py``); the decisions are in ``learner.admission`` (which record may train) and
``learner.candidates`` (when the weights become a candidate, when the lineage is dropped), the checkpoint's format
and order of writes in ``learner.checkpoint``. This module holds what ties them to Kafka, Redis and the lease:

- the samples topic's partitions, all read by this learner (``Learner._assign``), without joining a consumer group;
- the update of a batch, its ledger line and its place in the watermark (``Learner._update``);
- when to checkpoint: after a candidate or a rebase, every ``checkpoint_every_steps`` updates or
  ``checkpoint_every_s`` seconds, when idle with refusals buffered, on a clean stop; then the offset commit to the
  group ``<prefix>.learner`` (for lag tools: the checkpoint, not the group, holds the positions);
- the live state in Redis (``keys.learner``), read by ``liverl status`` and the on-call page.

Run as a process: ``liverl learn [--config FILE] [--max-steps N]`` (``run_learner``).
The learner is a singleton per deployment, fenced by a lease in Redis (``learner.lease``): a second learner waits for
the first to go, and a learner that lost its lease stops before it writes another checkpoint, candidate or offset
commit (``LeaseLost``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from kafka.errors import CommitFailedError, KafkaTimeoutError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry

from core import keys
from core.bus import ensure_topics, make_consumer, topic_configs
from core.config import LiverlConfig
from core.probes import STALL_S, LoopWatch, start_probe_server
from core.services import kafka_bootstrap, setup_redis
from core.shred import open_user_keys
from deploy.registry.delta import warm_up
from deploy.registry.registry import RegistryError, open_registry
from learner import dist as ldist
from learner.admission import Admission
from learner.candidates import REGISTRY_ERRORS, Candidates
from learner.checkpoint import Checkpoints, LearnerState
from learner.dist import CheckpointDir, Ranks, dcp_root
from learner.lease import LearnerLease
from learner.ledger import Ledger, checkpoint_path_for, ledger_path
from learner.metrics import PrometheusCollector
from learner.model import load_state_dict
from learner.policy_trainer import BatchFailed, PolicyTrainer
from learner.ranks import Leader, follow
from learner.seen import SeenIds, seen_path

log = logging.getLogger("liverl.learner")

PARTITIONS_CHECK_S = 30.0  # how often the learner looks for partitions added to the samples topic


class LeaseLost(RuntimeError):
    """This learner's lease is gone (another learner may be running): it must not write anything more."""


class Learner:
    """The poll/commit loop: a Kafka consumer, a ``PolicyTrainer``, the admission and candidate policies, the
    checkpoint, and the live state in Redis."""

    def __init__(
        self,
        cfg: LiverlConfig,
        model_dir: Path,
        bootstrap: str,
        registry,
        redis=None,
        checkpoint_path: Path | None = None,
        ranks: Ranks | None = None,
    ):
        self.cfg, self.lcfg = cfg, cfg.learner
        self.model_dir, self.bootstrap, self.registry, self.redis = Path(model_dir), bootstrap, registry, redis
        self.topic = cfg.topics.samples
        self.group = f"{cfg.topics.prefix}.learner"
        self.key = keys.learner(cfg.topics.prefix)
        self.ckpt_path = Path(checkpoint_path or checkpoint_path_for(cfg))
        self.lease = None  # a learner.lease.LearnerLease when run as the deployment's learner (run_learner)
        self.watch = LoopWatch(STALL_S, "learner's loop")  # /livez: the loop goes round (a training step included)
        self.assigned = False  # /readyz: the samples topic's partitions are assigned
        self.ledger = Ledger(ledger_path(self.ckpt_path), max_bytes=self.lcfg.ledger_max_mb << 20)
        self.seen = SeenIds(seen_path(self.ckpt_path), horizon_s=self.lcfg.dedupe_horizon_h * 3600.0)
        self.ranks = ranks  # under torchrun: this is rank 0, the leader (learner.ranks); checkpoints are DCP folders
        self.trainer = PolicyTrainer(self.model_dir, self.lcfg, ranks=ranks)
        log.info("learner: forward: %s", self.trainer.forward_path())
        self.ckpts: CheckpointDir | None = None
        if ranks is not None:
            self.ckpts = CheckpointDir(dcp_root(self.ckpt_path), ranks)
            self.trainer = Leader(self.trainer, ranks, self.ckpts)
        self.state = LearnerState()
        self.checkpoints = Checkpoints(
            self.ckpt_path, self.topic, self.lcfg, self.trainer, self.ledger, self.seen, self.ckpts
        )
        self.admission = Admission(self.lcfg, self.topic, self.state, self.trainer, self.ledger, self.seen)
        self.admission.user_keys = open_user_keys(cfg)  # opens sealed samples (core.shred); None: none to open
        self.candidates = Candidates(cfg, self.state, self.trainer, registry, redis, self.ledger, self.admission)
        self.last_metrics: dict[str, float] = {}  # the last update's
        self.last_hops: dict[str, float] = {}  # the last batch's hop times (``Admission.hops``)
        self.last_backlog: tuple[int, float] = (-1, -1.0)  # (samples, seconds) at the last publish
        self._consumer = None
        self._parts_checked_at = 0.0  # when _assign last looked at the samples topic's partitions
        self._mismatch_reported = time.monotonic()  # when the mismatch was last added to the registry
        if not self.checkpoints.restore(self.state):
            stable = self.candidates.start_from_stable()
            log.info("learner: no checkpoint at %s; starting from stable version %d", self.ckpt_path, stable)

    # -- checkpoint ---------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        """A checkpoint (``Checkpoints.save``), unless the lease is lost."""
        self._fenced("checkpoint")
        self.checkpoints.save(self.state)

    def _maybe_rebase(self, before_update: bool = False) -> None:
        """The candidate policy's rebase rules (``Candidates.maybe_rebase``); a rebase is checkpointed at once."""
        if self.candidates.maybe_rebase(before_update):
            self._save_checkpoint()

    # -- Kafka ------------------------------------------------------------------------------------
    def _assign(self) -> bool:
        """Read every partition of the samples topic, each from where this learner stands. The learner takes them all
        itself (``assign``), in no consumer-group membership: its lease (``learner.lease``) is what makes it the only
        reader, and the checkpoint, not the group, holds its positions (committed offsets follow the checkpoint, for
        lag tools). A group join would add nothing but its wait (Tansu completes one only after the rebalance
        timeout, 10 s at every start) and a member that a long candidate encode could get dropped. Partitions added
        to the topic later are taken at the next check (``PARTITIONS_CHECK_S``). False: the topic has none yet."""
        self._parts_checked_at = time.monotonic()
        parts = self._consumer.partitions_for_topic(self.topic)
        tps = [TopicPartition(self.topic, p) for p in sorted(parts or ())]
        if not tps:
            return False
        if set(tps) != set(self._consumer.assignment()):
            self._consumer.assign(tps)
            self.on_partitions_assigned(tps)
        return True

    def on_partitions_assigned(self, assigned) -> None:
        """Seek each partition to where this learner stands; the checkpoint outranks committed offsets (a partition
        this learner never read starts at the group's committed offset, else the earliest)."""
        parts = {tp.partition for tp in assigned if tp.topic == self.topic}
        self.admission.keep_partitions(parts)
        for tp in assigned:
            pos = self.admission.position(tp.partition)
            if pos is not None:
                self._consumer.seek(tp, pos)
        log.info(
            "learner: assigned partitions %s; positions %s",
            sorted(parts),
            {p: self.admission.position(p) for p in sorted(parts)},
        )

    def _poll(self, timeout_ms: int) -> None:
        c = self._consumer
        full = len(self.admission.queue) >= 8 * self.lcfg.batch_size
        assigned = c.assignment()
        if full and assigned:
            c.pause(*assigned)
        elif c.paused():
            c.resume(*c.paused())
        polled = c.poll(timeout_ms=0 if full else timeout_ms, max_records=4 * self.lcfg.batch_size)
        now = time.time()
        for tp, records in polled.items():
            if isinstance(tp, TopicPartition) and tp.topic != self.topic:
                continue
            for r in records:
                ts = r.timestamp / 1000.0 if r.timestamp and r.timestamp > 0 else now  # -1: no timestamp
                self.admission.queue.append((r.partition, r.offset, r.value, (ts, now)))

    def _commit(self) -> None:
        """Commit what the checkpoint already holds. A failed commit (this consumer was dropped from its
        group, e.g. a long pause between polls, the group is rebalancing, or the broker did not answer in time: a
        cut link) loses nothing: the next commit carries the same offsets, and a reassignment seeks to the
        checkpoint's positions. It is counted and logged, not fatal."""
        offs = {TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in self.state.offsets.items()}
        if not offs:
            return
        self._fenced("offset commit")
        try:
            self._consumer.commit(offs)
        except (CommitFailedError, RebalanceInProgressError, KafkaTimeoutError) as e:  # nothing is lost
            self.state.counters["commit_failed"] += 1
            log.warning(
                "learner: offset commit failed at step %d (%s); the checkpoint holds the offsets, "
                "the next commit retries",
                self.state.step,
                e,
            )

    # -- the loop -----------------------------------------------------------------------------------
    def _update(self) -> bool:
        """Train on the oldest full batch; True when the weights changed."""
        st = self.state
        batch, forgotten = self.admission.still_known(self.admission.take_batch())  # a fresh look at users' keys
        if not batch:
            self.admission.advance(forgotten)
            return False
        samples = [e[2] for e in batch]
        self.last_hops = self.admission.hops(batch)
        t0 = time.monotonic()
        try:
            m = self.trainer.train_step(samples)
        except BatchFailed as e:  # the trainer is as before; the batch is refused, counted and logged
            log.error("learner: step %d skipped, %d samples refused: %s", st.step + 1, len(samples), e)
            st.counters[f"dropped:{e.reason}"] += len(samples)
            for part, off, s in batch:
                self.ledger.refused(part, off, s.sample_id, e.reason)
            m = None
        if m is not None:
            self.ledger.trained(
                st.step + 1,
                [(part, off, s.sample_id) for part, off, s in batch],
                feedback=[(s.feedback_id, s.ts_feedback) for _, _, s in batch],
                units=[s.unit for _, _, s in batch],  # whose samples (liverl forget: the versions that hold them)
            )
            self.admission.trained(batch)
        self.admission.advance(batch + forgotten)
        if m is None:
            return False
        st.step += 1
        st.counters["samples_trained"] += len(samples)
        for k in ("routing_replayed", "routing_missing"):  # learner.routing_replay: whose routing was the server's
            if k in m:
                st.counters[k] += int(m[k])
        self.last_metrics = dict(m, step_s=time.monotonic() - t0)
        self.candidates.updated(m, len(samples))
        self._report_mismatch()
        log.info(
            "learner: step %d trained %d samples (total %d, v%d) reward %.3f loss %.4f kl %.4f ratio %.3f "
            "clip %.3f masked %.3f entropy %.3f in %.2fs; oldest sample: ingest %.1fs fetch %.1fs queue %.1fs",
            st.step,
            len(samples),
            st.counters["samples_trained"],
            st.last_emitted,
            m["reward_mean"],
            m["loss"],
            m["kl"],
            m["ratio_mean"],
            m["clipped_frac"],
            m["masked_frac"],
            m.get("entropy", float("nan")),
            self.last_metrics["step_s"],
            self.last_hops.get("ingest_s", 0.0),
            self.last_hops.get("fetch_s", 0.0),
            self.last_hops.get("queue_s", 0.0),
        )
        return True

    def _report_mismatch(self, force: bool = False) -> None:
        """Add the sampler/trainer mismatch measured since the last report to the registry (``learner.mismatch``),
        every ``learner.mismatch_report_s`` or when ``force``d (a candidate was emitted). A registry that does not
        answer keeps them for the next report (counted: ``mismatch_report_failed``)."""
        sums = getattr(self.trainer, "mismatch", None)  # the leader of several ranks reports its own share
        if sums is None or not sums:
            return
        now = time.monotonic()
        if not force and now - self._mismatch_reported < self.lcfg.mismatch_report_s:
            return
        self._mismatch_reported = now
        taken = sums.take()
        try:
            self.registry.add_mismatch(taken)
        except REGISTRY_ERRORS as e:
            sums.merge(taken)
            self.state.counters["mismatch_report_failed"] += 1
            log.warning("learner: mismatch not reported to the registry (kept for the next report): %s", e)

    def publish(self, state: str = "running") -> None:
        """The live state to Redis (best effort: an error is counted and logged); the backlog to ``last_backlog``."""
        self.last_backlog = self._backlog_shown()  # in the loop's thread: the consumer is not thread-safe
        if self.redis is None:
            return
        st, m = self.state, self.last_metrics
        fields = {
            "step": st.step,
            "samples_trained": st.counters["samples_trained"],
            "state": state,
            "last_candidate": -1 if st.last_candidate is None else st.last_candidate,
            "last_emitted": st.last_emitted,
            "queue": self.admission.waiting(),
            "ts": time.time(),
            "backlog_samples": self.last_backlog[0],
            "backlog_s": self.last_backlog[1],
            **{f"hop_{k}": round(v, 1) for k, v in self.last_hops.items()},
            **{
                k: round(m[k], 6)
                for k in (
                    "reward_mean",
                    "kl",
                    "loss",
                    "entropy",
                    "entropy_floor_gap",
                    "ratio_mean",
                    "clipped_frac",
                    "masked_frac",
                    "step_s",
                    "lr",
                )
                if k in m
            },
            **{k: v for k, v in st.counters.items() if k != "samples_trained"},
        }
        try:
            self.redis.hset(self.key, mapping={k: str(v) for k, v in fields.items()})
        except Exception as e:  # noqa: BLE001 - the live view is best effort; training must not stop for it
            self.state.counters["redis_errors"] += 1
            log.warning("learner: cannot publish live state to Redis: %s", e)

    def run(self, stop_event: threading.Event | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """Consume and train until ``stop_event`` is set or ``max_steps`` updates were made in this call."""
        self._consumer = make_consumer(self.bootstrap, self.group, [], broker=self.cfg.broker)  # assigned: _assign
        st = self.state
        start_step, last_pub = st.step, 0.0
        try:
            while not (stop_event is not None and stop_event.is_set()):
                self.watch.tick()
                if max_steps is not None and st.step - start_step >= max_steps:
                    break
                if not self._consumer.assignment() or time.monotonic() - self._parts_checked_at > PARTITIONS_CHECK_S:
                    self.assigned = self._assign()
                    if not self.assigned:  # no samples topic yet (ingest creates it)
                        time.sleep(0.2)
                        continue
                self._poll(timeout_ms=200)
                self.admission.classify()
                ready = self.admission.batch_ready()
                try:
                    self._maybe_rebase(before_update=ready)  # a rollback is seen whatever the counters say
                    self.candidates.maybe_move_reference()
                except REGISTRY_ERRORS as e:  # both are retried every few seconds; training goes on meanwhile
                    st.counters["registry_errors"] += 1
                    log.error("learner: cannot read the registry (%s: %s); retrying", type(e).__name__, e)
                if ready:
                    emitted = st.last_candidate
                    if self._update() and self.candidates.due():
                        self._fenced("candidate")
                        self.candidates.emit(self.last_metrics)
                        self._report_mismatch(force=True)  # what the gate will read of the versions trained on
                    if st.last_candidate != emitted or self.checkpoints.due(
                        st.step
                    ):  # a candidate: its lineage durable
                        self._save_checkpoint()
                        self._commit()
                    self.publish()
                    last_pub = time.monotonic()
                elif time.monotonic() - last_pub > 1.0:
                    if self.ledger.buffered:  # refusals while idle: make them (and their offsets) durable
                        self._save_checkpoint()
                        self._commit()
                    self.publish("waiting")
                    last_pub = time.monotonic()
            if st.step > self.checkpoints.saved_step or self.ledger.buffered:  # a clean stop keeps what was trained
                self._save_checkpoint()
                self._commit()
            self._report_mismatch(force=True)  # and reports what it measured
        finally:
            self.publish("stopped")
            self._consumer.close(autocommit=False)
            self._consumer = None
            if self.admission.user_keys is not None:
                self.admission.user_keys.close()
        return self.stats()

    def _backlog_shown(self) -> tuple[int, float]:
        try:
            events, seconds = self.admission.backlog(self._consumer)
        except Exception as e:  # noqa: BLE001 - the live view is best effort: a client call mid-rebalance may raise
            log.debug("learner: backlog unknown: %s", e)
            return -1, -1.0
        return events, round(seconds, 1)

    def not_ready(self) -> str | None:
        """Why the learner cannot train now (``/readyz``), or None: it holds the lease and reads the samples."""
        if self.lease is not None and self.lease.lost.is_set():
            return "the learner lease is lost (another learner may be running)"
        if not self.assigned:
            return "no partition of the samples topic assigned yet"
        return None

    def _fenced(self, what: str) -> None:
        if self.lease is not None and self.lease.lost.is_set():
            raise LeaseLost(f"the learner lease is lost; no {what} (another learner may be running)")

    def stats(self) -> dict[str, Any]:
        st = self.state
        return {
            "step": st.step,
            "samples_trained": int(st.counters["samples_trained"]),
            "unique_trained": len(st.trained_ids),
            "last_candidate": st.last_candidate,
            "last_emitted": st.last_emitted,
            "offsets": dict(st.offsets),
            "counters": dict(st.counters),
            "last_metrics": dict(self.last_metrics),
        }


def run_learner(
    cfg: LiverlConfig,
    model_dir: Path,
    stop_event: threading.Event | None = None,
    max_steps: int | None = None,
    metrics_port: int | None = None,
) -> dict:
    """The learner process: connect to the configured stack, build/load the base policy, train until stopped.

    ``metrics_port``: serve Prometheus metrics and the probes (``core.probes``: ``/livez`` while the training loop
    goes round, ``/readyz`` while it holds the lease and reads the samples topic) on ``serving.host:port``.
    Under torchrun (WORLD_SIZE set) the policy is sharded with FSDP2 over the ranks: rank 0 is this learner, the
    others follow its trainer calls (``learner.ranks``), and checkpoints are DCP folders (``learner.dist``).
    """
    ranks = None
    if "WORLD_SIZE" in os.environ:
        ranks = ldist.setup()
        if not ranks.main:
            return _follow(cfg, model_dir, ranks)

    bootstrap = kafka_bootstrap(cfg)
    ensure_topics(bootstrap, [cfg.topics.samples], cfg.broker.partitions, broker=cfg.broker, configs=topic_configs(cfg))
    warm_up()  # the delta codec's kernels, before the first candidate is due
    registry = open_registry(cfg)
    try:
        registry.stable()
    except RegistryError:  # an empty registry: this process is the first to need version 0
        log.info("learner: registry has no stable version; registering the base policy as v0")
        registry.init_base(load_state_dict(model_dir), str(model_dir))
    r = setup_redis(cfg)
    lease = LearnerLease(
        r, cfg.topics.prefix, checkpoint_path_for(cfg).with_suffix(".lease"), ttl_s=cfg.learner.lease_ttl_s
    )
    lease.acquire(wait_s=cfg.learner.lease_wait_s)  # before the checkpoint is read: the previous learner is gone
    try:
        learner = Learner(cfg, model_dir, bootstrap, registry, redis=r, ranks=ranks)
    except BaseException:
        lease.release()
        raise
    learner.lease = lease
    server = None
    if metrics_port is not None:
        prom = CollectorRegistry()
        prom.register(PrometheusCollector(learner))
        server = start_probe_server(cfg.serving.host, metrics_port, prom, learner.watch.live, learner.not_ready)
    clean = False
    try:
        out = learner.run(stop_event=stop_event, max_steps=max_steps)
        clean = True
        return out
    finally:
        if ranks is not None:
            learner.trainer.stop()  # the followers return; a crash of this rank ends them through torchrun instead
            ldist.teardown(barrier=clean)
        lease.release()
        if server is not None:
            server.shutdown()
            server.server_close()
        r.close()
        registry.close()


def _follow(cfg: LiverlConfig, model_dir: Path, ranks: Ranks) -> dict:
    """A rank > 0 of ``liverl learn`` under torchrun: its shards of the policy, rank 0's calls, until told to stop."""
    clean = False
    try:
        trainer = PolicyTrainer(Path(model_dir), cfg.learner, ranks=ranks)
        calls = follow(trainer, ranks, CheckpointDir(dcp_root(checkpoint_path_for(cfg)), ranks))
        clean = True
        return {"rank": ranks.rank, "calls": calls}
    finally:
        ldist.teardown(barrier=clean)
