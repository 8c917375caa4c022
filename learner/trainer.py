"""The continuous learner: TrainingSamples from Kafka -> policy-gradient updates -> candidate versions.

Guarantees (the checkpoint is the source of truth, Kafka offsets only mirror it):

- Every ``checkpoint_every_steps`` updates or ``checkpoint_every_s`` seconds (and after a candidate, a rebase,
  when idle, on a clean stop) an atomic checkpoint holds the fp32 weights, the optimizer, the step, the next
  offset per partition, the recent trained sample ids, the last emitted version, the baseline and the counters:
  one file (temp file + ``os.replace``) in one process, a DCP folder committed by a rename under torchrun
  (``learner.dist``, ``learner.ranks``). Only THEN are the offsets committed to the group ``<prefix>.learner``. On restart
  the learner seeks every partition to the checkpoint's offsets: updates after it are trained again from the
  same weights, and the ledger lines past its seq are cut, so none is lost or trained twice in the lineage
  that goes on. Samples are taken in offset order per partition, so "next offset" is an exact watermark:
  everything below it was trained on or refused.
- A sample id already trained on (or already waiting in the batch being built) is refused as a
  ``duplicate``, however late it comes back (``learner.seen``: every trained id, durable, cut back with the
  ledger): ingest is at-least-once, the learner makes it exactly-once.
- A sample whose ``policy_version`` is more than ``max_staleness`` candidates' worth of updates
  (``max_staleness * candidate_every_steps`` learner steps) behind the learner's weights is refused as
  ``stale``. Lag is counted in the learner's own updates since its weights were that version (a version
  number says nothing of it: the registry numbers every candidate, rejected ones included). While a canary
  runs, the stable version's samples may all be stale; the canary's keep the learner fed. If only stale
  samples come for ``STARVE_S`` (the gate refuses this lineage, or an operator rolled back), the learner
  would starve, so it rebases: it restarts from the stable weights. It also rebases when the gate refused its
  newest ``rebase_after_refusals`` candidates in a row on their evidence (a 60-minute demo run: the lineage's
  entropy fell under the gate's collapse floor and every candidate was refused for 5 minutes and more; training it
  further does not bring it back).
- Bad samples (token/logprob length mismatch, out-of-vocab ids, non-finite values, too long) are refused
  with a counted reason; the loop never crashes on input.

Run as a process: ``liverl learn [--config FILE] [--max-steps N]``.
The learner is a singleton per deployment, fenced by a lease in Redis (``learner.lease``): a second learner waits for
the first to go, and a learner that lost its lease stops before it writes another checkpoint, candidate or offset
commit. So it reads every partition of the samples topic itself (``Learner._assign``), without joining a consumer
group: it commits its offsets to the group ``<prefix>.learner`` for lag tools, and starts at once.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from kafka import TopicPartition
from kafka.errors import CommitFailedError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry, start_http_server
from sqlalchemy.exc import SQLAlchemyError

from core import keys
from core.bus import ensure_topics, make_consumer, topic_configs
from core.config import LiverlConfig
from core.schemas import TrainingSample, WireError
from core.services import kafka_bootstrap, setup_redis
from deploy.registry.delta import warm_up
from deploy.registry.registry import RegistryError, open_registry
from learner import dist as ldist
from learner.dist import CheckpointDir, Ranks, dcp_root
from learner.lease import LearnerLease
from learner.ledger import Ledger, checkpoint_path_for, ledger_path
from learner.metrics import PrometheusCollector
from learner.model import load_state_dict
from learner.policy_trainer import BatchFailed, PolicyTrainer
from learner.ranks import Leader, follow
from learner.seen import SeenIds, seen_path

log = logging.getLogger("liverl.learner")

CHECKPOINT_FORMAT = 1
ROLLBACK_CHECK_S = 1.0  # while idle; before an update the rollback check always runs
REFERENCE_CHECK_S = 5.0  # how often the KL reference looks for a new stable version
STARVE_S = 30.0  # only stale samples for this long (the fleet stopped following this learner): rebase onto stable
VERSION_STEPS_KEPT = 512  # versions whose learner step the checkpoint remembers
# what a registry call may raise when the database or the blob store is unreachable or refuses
REGISTRY_ERRORS = (RegistryError, SQLAlchemyError, OSError)
PARTITIONS_CHECK_S = 30.0  # how often the learner looks for partitions added to the samples topic


class LeaseLost(RuntimeError):
    """This learner's lease is gone (another learner may be running): it must not write anything more."""


def evidence_against(reason: str) -> bool:
    """Whether a rejection says the candidate itself is bad: a failed gate check (``failed drift, collapse``...) or a
    canary aborted on its live evidence. Not: superseded by a newer candidate, deferred for too little evidence with
    no canary to run, a sample-ratio mismatch or a deadline (the rollout's trouble, not the candidate's), an operator's
    rejection without a check."""
    if reason.startswith("failed "):
        return True
    return reason.startswith("canary aborted:") and not any(w in reason for w in ("srm:", "deadline passed"))


class Learner:
    """Kafka consumer + PolicyTrainer + checkpoint + registry candidates + live state in Redis."""

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
        self.ledger = Ledger(ledger_path(self.ckpt_path), max_bytes=self.lcfg.ledger_max_mb << 20)
        self.seen = SeenIds(seen_path(self.ckpt_path), horizon_s=self.lcfg.dedupe_horizon_h * 3600.0)
        self.ranks = ranks  # under torchrun: this is rank 0, the leader (learner.ranks); checkpoints are DCP folders
        self.trainer = PolicyTrainer(self.model_dir, self.lcfg, ranks=ranks)
        log.info("learner: forward: %s", self.trainer.forward_path())
        self.ckpts: CheckpointDir | None = None
        if ranks is not None:
            self.ckpts = CheckpointDir(dcp_root(self.ckpt_path), ranks)
            self.trainer = Leader(self.trainer, ranks, self.ckpts)
        self._ckpt_step, self._ckpt_at = 0, time.monotonic()  # the last checkpoint's step and time
        self.step = 0
        self.seq = 0  # checkpoints written; the ledger's lines carry the seq of the checkpoint that made them durable
        self.offsets: dict[int, int] = {}  # durable watermark: next offset per partition
        self.trained_ids: dict[str, None] = {}  # the last ``dedupe_window`` trained sample ids, oldest first
        self._candidate_due = False
        self._pending_since = 0.0  # when the oldest pending sample was accepted
        self.counters: collections.Counter[str] = collections.Counter()
        self.since_candidate: dict[str, float] = {"reward_sum": 0.0, "samples": 0.0, "steps": 0.0, "loss_sum": 0.0}
        self.last_candidate: int | None = None
        self.last_metrics: dict[str, float] = {}
        self._shed_said_at = float("-inf")  # when the log last said the learner sheds load
        self._rebased_wall = 0.0  # when this learner last rebased (wall clock, as the registry's times)
        self._emitted_since_rebase = 0  # candidates this process emitted since then
        self._lr_scale_since = (
            0.0  # when the learning rate last backed off or recovered (wall clock; ``_set_lr_scale``)
        )
        self.last_backlog: tuple[int, float] = (-1, -1.0)  # (samples, seconds) as of the last publish (``backlog``)
        self.queue: collections.deque = collections.deque()  # (partition, offset, raw value, hop times), as fetched
        self.arrival: dict[tuple[int, int], tuple[float, float]] = {}  # (partition, offset) of a pending sample ->
        # (its record's timestamp: when ingest produced it, when this learner fetched it), wall clock: ``hops``
        self.last_hops: dict[str, float] = {}  # the last batch's hop times (``hops``)
        self.pending: list[tuple[int, int, TrainingSample]] = []  # accepted, waiting for a full batch
        self.read_pos: dict[int, int] = {}  # next offset to classify per partition
        self._consumer = None
        self._parts_checked_at = 0.0  # when _assign last looked at the samples topic's partitions
        self._last_rebase_check = 0.0
        self.rollback_seen: int | None = None  # audit id of the last rollback this learner rebased for
        self._last_ref_check = 0.0
        self.ref_version = 0  # the KL reference starts at the base policy (version 0)
        self.version_steps: dict[int, int] = {}  # version -> learner step at which these weights were that version
        self._fresh_at = time.monotonic()  # when a sample last passed the staleness check
        if (self.ckpts.latest() is not None) if self.ckpts is not None else self.ckpt_path.exists():
            self._load_checkpoint()
        else:
            self.ledger.truncate_after(0)  # lines of a run whose first checkpoint never landed
            self.seen.truncate_after(0)
            stable = self.registry.stable()
            self.last_emitted = int(stable.version)
            self.version_steps = {int(stable.version): self.step}
            self.rollback_seen = self.registry.last_rollback()[0]  # stable already reflects any earlier rollback
            self.ledger.rebased(self.step, int(stable.version))
            if stable.version != 0:
                self.trainer.load_weights(self.registry.materialize(stable.version), reset_optimizer=True)
            log.info("learner: no checkpoint at %s; starting from stable version %d", self.ckpt_path, stable.version)

    # -- checkpoint ---------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        """Ledger lines first (tagged with the new seq), then the checkpoint: a crash in between leaves lines
        whose seq the checkpoint never reached, and the restart cuts them off (``Ledger.truncate_after``)."""
        self._fenced("checkpoint")
        self.seq += 1
        self.seen.flush(self.seq)
        self.ledger.flush(self.seq)
        self._ckpt_step, self._ckpt_at = self.step, time.monotonic()
        st = dict(
            format=CHECKPOINT_FORMAT,
            step=self.step,
            offsets=dict(self.offsets),
            seq=self.seq,
            # one JSON string, not a list: torch.save pickles a list item by item through a Python callback
            # (scripts/ckpt_bench.py, 100K ids, the demo model: save 49 -> 15 ms, load 204 -> 10 ms, a quiet machine)
            trained_ids=json.dumps(list(self.trained_ids)),
            last_emitted=self.last_emitted,
            last_candidate=self.last_candidate,
            counters=dict(self.counters),
            since_candidate=dict(self.since_candidate),
            topic=self.topic,
            rollback_seen=self.rollback_seen,
            version_steps=dict(sorted(self.version_steps.items())[-VERSION_STEPS_KEPT:]),
            lr_scale=self.trainer.lr_scale,
            lr_scale_since=self._lr_scale_since,
            floor_lift=self.trainer.floor_lift,
        )
        if self.ckpts is not None:  # every rank writes its shards; rank 0 adds this state as learner.json
            self.trainer.save_checkpoint(self.step, dict(st, baseline=self.trainer.baseline.state_dict()))
            return
        st.update(self.trainer.state())
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_path.with_name(self.ckpt_path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(st, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.ckpt_path)
        dfd = os.open(self.ckpt_path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _load_checkpoint(self) -> None:
        if self.ckpts is not None:
            st = self.trainer.load_checkpoint()
            self.trainer.baseline.load_state_dict(st["baseline"])
        else:
            st = torch.load(self.ckpt_path, map_location="cpu", weights_only=True)
        if st.get("format") != CHECKPOINT_FORMAT or st.get("topic") != self.topic:
            raise ValueError(
                f"checkpoint {self.ckpt_path} is format {st.get('format')} for topic {st.get('topic')!r}; "
                f"expected format {CHECKPOINT_FORMAT} for {self.topic!r} (move it away to start fresh)"
            )
        if self.ckpts is None:
            self.trainer.load_state(st)
        self.step = self._ckpt_step = int(st["step"])
        self.offsets = {int(p): int(o) for p, o in st["offsets"].items()}
        self.seq = int(st.get("seq", 0))
        self.ledger.truncate_after(self.seq)
        self.seen.truncate_after(self.seq)
        ids = st["trained_ids"]
        ids = json.loads(ids) if isinstance(ids, str) else ids  # a list: a checkpoint written before 2026-11-29
        self.trained_ids = dict.fromkeys(ids[-self.lcfg.dedupe_window :])
        self.last_emitted = int(st["last_emitted"])
        self.last_candidate = st["last_candidate"]
        self.counters = collections.Counter(st["counters"])
        self.since_candidate = dict(st["since_candidate"])
        self.rollback_seen = st.get("rollback_seen")
        self.version_steps = {int(v): int(n) for v, n in (st.get("version_steps") or {}).items()}
        self.trainer.set_lr_scale(float(st.get("lr_scale", 1.0)))
        self._lr_scale_since = float(st.get("lr_scale_since", 0.0))
        if self.lcfg.floor_for_candidate:  # turned off since: the configured floor again
            self.trainer.floor_lift = float(st.get("floor_lift", 1.0))
        log.info(
            "learner: resumed from %s at step %d, %d samples trained, offsets %s, last emitted v%d",
            self.ckpt_path,
            self.step,
            len(self.trained_ids),
            self.offsets,
            self.last_emitted,
        )

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
        self.queue.clear()  # re-fetched from read_pos below
        self.pending = [e for e in self.pending if e[0] in parts]
        self.arrival = {k: v for k, v in self.arrival.items() if k[0] in parts}
        self.read_pos = {p: o for p, o in self.read_pos.items() if p in parts}
        for tp in assigned:
            pos = self.read_pos.get(tp.partition, self.offsets.get(tp.partition))
            if pos is not None:
                self._consumer.seek(tp, pos)
        log.info(
            "learner: assigned partitions %s; positions %s",
            sorted(parts),
            {p: self.read_pos.get(p, self.offsets.get(p)) for p in sorted(parts)},
        )

    def _poll(self, timeout_ms: int) -> None:
        c = self._consumer
        full = len(self.queue) >= 8 * self.lcfg.batch_size
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
                self.queue.append((r.partition, r.offset, r.value, (ts, now)))

    def backlog(self) -> tuple[int, float]:
        """What ingest judged that this learner has not trained yet: (samples, seconds). Samples: the samples topic's
        high watermarks (as of the last fetch) less this learner's trained watermarks, over its partitions. Seconds:
        the age of the oldest of them by its feedback time (``ts_feedback``), 0 when none waits. This is the lag
        the on-call page, ``liverl status`` and the ``LiverlLearnerBehind`` alert show."""
        c = self._consumer
        events = 0
        for tp in c.assignment() if c is not None else ():
            high = c.highwater(tp)
            at = self.offsets.get(tp.partition)
            if at is None:  # nothing trained from it yet: from the first record still held, else the read position
                held = [e[1] for e in self.pending if e[0] == tp.partition] + [
                    e[1] for e in self.queue if e[0] == tp.partition
                ]
                at = min(held) if held else self.read_pos.get(tp.partition)
            if high is not None and at is not None:
                events += max(0, high - at)
        oldest = None
        if self.pending:
            oldest = self.pending[0][2].ts_feedback
        if self.queue:
            try:
                head = TrainingSample.from_bytes(self.queue[0][2] or b"").ts_feedback
                oldest = head if oldest is None else min(oldest, head)
            except Exception:  # noqa: BLE001 - a record the classifier will refuse: its age is not known
                pass
        seconds = 0.0 if oldest is None or (events == 0 and not self.pending) else max(0.0, time.time() - oldest)
        return events, seconds

    def _classify(self) -> None:
        """Move fetched records into ``pending`` (accepted) or refuse them, until a batch is full."""
        while self.queue and not self._batch_ready():
            part, off, raw, arrived = self.queue.popleft()
            self.read_pos[part] = off + 1
            s = None
            try:
                s = TrainingSample.from_bytes(raw if raw is not None else b"")
                reason = self._refusal(s)
            except WireError as e:
                reason = f"wire_{e.reason}"
            except Exception as e:  # noqa: BLE001 - one record must never stop the learner (it would crash-loop on it)
                reason = "internal_error"
                log.exception(
                    "learner: refusing the record at %s[%d]@%d: %s: %s", self.topic, part, off, type(e).__name__, e
                )
            if reason is None:
                self._fresh_at = time.monotonic()
                if not self.pending:
                    self._pending_since = self._fresh_at
                self.pending.append((part, off, s))
                self.arrival[(part, off)] = arrived
                continue
            self.counters[f"dropped:{reason}"] += 1
            self.ledger.refused(part, off, s.sample_id if s is not None else None, reason)
            if reason == "shed":
                self._shed_note()
            elif reason not in ("duplicate", "stale"):
                log.warning("learner: refused sample at %s[%d]@%d: %s", self.topic, part, off, reason)
            if not any(p[0] == part for p in self.pending):
                self.offsets[part] = off + 1  # nothing waiting below it in this partition

    def _shed_note(self) -> None:
        """Say that the learner sheds load, at most every 30 s, with how much so far."""
        now = time.monotonic()
        if now - self._shed_said_at >= 30.0:
            self._shed_said_at = now
            log.warning(
                "learner: cannot keep up: skipping samples whose feedback is more than learner.max_backlog_s "
                "%.0f s old, training the newest (%d shed so far, counted as dropped:shed)",
                self.lcfg.max_backlog_s,
                self.counters["dropped:shed"],
            )

    def _refusal(self, s: TrainingSample) -> str | None:
        if (
            s.sample_id in self.trained_ids
            or any(p[2].sample_id == s.sample_id for p in self.pending)
            or s.sample_id in self.seen
        ):  # the recent window first, then every id ever trained (durable)
            return "duplicate"
        if self.lcfg.max_backlog_s and time.time() - s.ts_feedback > self.lcfg.max_backlog_s:
            return "shed"  # the learner is behind: the newest feedback first (``learner.max_backlog_s``)
        if self.lag(s.policy_version) > self.max_lag:
            return "stale"
        return self.trainer.refusal(s)

    @property
    def max_lag(self) -> int:
        """The most learner updates a sample's policy may be behind the weights it trains (``max_staleness``
        candidates' worth)."""
        return self.lcfg.max_staleness * self.lcfg.candidate_every_steps

    def lag(self, version: int) -> int:
        """Learner updates since these weights were ``version``; for a version this learner never held (an
        operator's, or one from before its checkpoints kept the steps), an estimate from the version numbers."""
        at = self.version_steps.get(version)
        if at is not None:
            return self.step - at
        return max(0, self.last_emitted - version) * self.lcfg.candidate_every_steps

    def _batch_size(self) -> int:
        """How many of the pending samples make the next batch: ``batch_size``, or fewer when their padded size
        would pass ``max_batch_tokens`` (at least one: a single sample longer than the cap is refused as too_long
        by the trainer only past the model's context, so it trains alone)."""
        n, longest = 0, 0
        for _, _, s in self.pending[: self.lcfg.batch_size]:
            longest = max(longest, len(s.prompt_token_ids) + len(s.completion_token_ids))
            if n and (n + 1) * longest > self.lcfg.max_batch_tokens:
                break
            n += 1
        return n

    def _batch_ready(self) -> bool:
        if not self.pending:
            return False
        if len(self.pending) >= self.lcfg.batch_size or self._batch_size() < len(self.pending):
            return True
        return not self.queue and time.monotonic() - self._pending_since > self.lcfg.max_batch_wait_s

    def hops(self, batch: list[tuple[int, int, TrainingSample]]) -> dict[str, float]:
        """Where a batch's oldest sample spent its time before this update, in seconds (wall clocks): ``ingest_s`` from
        its feedback to ingest's sample record (the record's timestamp: ingest waiting for the generation, or behind
        its input), ``fetch_s`` from that record to this learner's fetch (the broker, or this learner's reads behind),
        ``queue_s`` from the fetch to now (waiting here for a batch, or for earlier updates). They add up to the
        backlog's seconds for that sample, so ``liverl status`` and the log say which hop a lag is in."""
        now, worst = time.time(), None
        for part, off, s in batch:
            emitted, fetched = self.arrival.pop((part, off), (now, now))
            if worst is None or s.ts_feedback < worst[0]:
                worst = (s.ts_feedback, emitted, fetched)
        if worst is None:
            return {}
        fb, emitted, fetched = worst
        return {
            "ingest_s": max(0.0, emitted - fb),
            "fetch_s": max(0.0, fetched - emitted),
            "queue_s": max(0.0, now - fetched),
        }

    def _checkpoint_due(self) -> bool:
        """``checkpoint_every_steps`` updates or ``checkpoint_every_s`` seconds since the last checkpoint."""
        return (
            self.step - self._ckpt_step >= self.lcfg.checkpoint_every_steps
            or time.monotonic() - self._ckpt_at >= self.lcfg.checkpoint_every_s
        )

    def _commit(self) -> None:
        """Commit what the checkpoint already holds. A failed commit (this consumer was dropped from its
        group, e.g. a long pause between polls, or the group is rebalancing) loses nothing: the next commit
        carries the same offsets, and a reassignment seeks to the checkpoint's positions. It is counted and
        logged, not fatal."""
        offs = {TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in self.offsets.items()}
        if not offs:
            return
        self._fenced("offset commit")
        try:
            self._consumer.commit(offs)
        except (CommitFailedError, RebalanceInProgressError) as e:  # the group is moving: nothing is lost
            self.counters["commit_failed"] += 1
            log.warning(
                "learner: offset commit failed at step %d (%s); the checkpoint holds the offsets, "
                "the next commit retries",
                self.step,
                e,
            )

    # -- the loop -----------------------------------------------------------------------------------
    def frozen(self) -> bool:
        """The hold flag (``keys.learner_hold``, set by ``liverl hold`` or a demo measuring its last version): the
        learner trains but emits no candidates. An unreadable flag counts as set (no candidate we cannot account for)."""
        if self.redis is None:
            return False
        try:
            return self.redis.get(keys.learner_hold(self.cfg.topics.prefix)) in (b"1", "1")
        except Exception as e:  # noqa: BLE001 - redis-py raises several families; training goes on either way
            log.warning("learner: cannot read the freeze flag (%s); holding back candidates", e)
            return True

    def _update(self) -> bool:
        """Train on the oldest full batch; True when the weights changed."""
        n = self._batch_size()
        batch, self.pending = self.pending[:n], self.pending[n:]
        self._pending_since = time.monotonic()  # the rest waits anew (an approximation of its oldest sample's age)
        samples = [e[2] for e in batch]
        self.last_hops = self.hops(batch)
        t0 = time.monotonic()
        try:
            m = self.trainer.train_step(samples)
        except BatchFailed as e:  # the trainer is as before; the batch is refused, counted and logged
            log.error("learner: step %d skipped, %d samples refused: %s", self.step + 1, len(samples), e)
            self.counters[f"dropped:{e.reason}"] += len(samples)
            for part, off, s in batch:
                self.ledger.refused(part, off, s.sample_id, e.reason)
            m = None
        if m is not None:
            self.ledger.trained(
                self.step + 1,
                [(part, off, s.sample_id) for part, off, s in batch],
                feedback=[(s.feedback_id, s.ts_feedback) for _, _, s in batch],
            )
            self.seen.add([(s.sample_id, time.time()) for _, _, s in batch])
            for _, _, s in batch:
                self.trained_ids[s.sample_id] = None
            while len(self.trained_ids) > self.lcfg.dedupe_window:
                del self.trained_ids[next(iter(self.trained_ids))]
        waiting = {}
        for part, off, _ in self.pending:
            waiting.setdefault(part, off)
        for part, off, _ in batch:
            self.offsets[part] = waiting.get(part, self.read_pos.get(part, off + 1))
        if m is None:
            return False
        self.step += 1
        self.counters["samples_trained"] += len(samples)
        self.last_metrics = dict(m, step_s=time.monotonic() - t0)
        sc = self.since_candidate
        sc["reward_sum"] += m["reward_mean"] * len(samples)
        sc["samples"] += len(samples)
        sc["steps"] += 1
        sc["loss_sum"] += m["loss"]
        log.info(
            "learner: step %d trained %d samples (total %d, v%d) reward %.3f loss %.4f kl %.4f ratio %.3f "
            "clip %.3f masked %.3f entropy %.3f in %.2fs; oldest sample: ingest %.1fs fetch %.1fs queue %.1fs",
            self.step,
            len(samples),
            self.counters["samples_trained"],
            self.last_emitted,
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

    def _maybe_candidate(self) -> None:
        if self.step % self.lcfg.candidate_every_steps == 0 and self.step:
            self._candidate_due = True
        if not self._candidate_due:
            return
        self._fenced("candidate")
        if self.frozen():
            self._candidate_due = False
            self.counters["candidates_skipped_frozen"] += 1
            log.info("learner: step %d: frozen, no candidate", self.step)
            return
        sc = self.since_candidate
        metrics = {
            "samples_trained": int(self.counters["samples_trained"]),
            "samples_since_last": int(sc["samples"]),
            "reward_mean": sc["reward_sum"] / max(sc["samples"], 1.0),
            "loss_mean": sc["loss_sum"] / max(sc["steps"], 1.0),
            **{
                k: self.last_metrics[k]
                for k in ("kl", "entropy", "entropy_floor_gap", "ratio_mean", "clipped_frac", "masked_frac")
                if k in self.last_metrics
            },
        }
        held = self.trainer.measure_candidate_entropy()  # with averaged candidates: what the gate will measure
        if held is not None:
            metrics["candidate_entropy"] = held["candidate_entropy"]
        try:
            parent = int(self.registry.stable().version)
            row = self.registry.add_candidate(
                self.trainer.candidate_weights(),
                parent=parent,
                metrics=metrics,
                sample_offsets={str(p): o for p, o in sorted(self.offsets.items())},
                learner_step=self.step,
            )
        except REGISTRY_ERRORS as e:  # the weights are in the checkpoint; the candidate is tried again next step
            self.counters["registry_errors"] += 1
            log.error(
                "learner: step %d: cannot register a candidate (%s: %s); retrying after the next step",
                self.step,
                type(e).__name__,
                e,
            )
            return
        self._candidate_due = False
        self.last_emitted = self.last_candidate = int(row.version)
        self._emitted_since_rebase += 1
        self.version_steps[int(row.version)] = self.step
        self.since_candidate = {k: 0.0 for k in sc}
        log.info(
            "learner: step %d -> candidate v%d (parent v%d, %d samples trained, reward %.3f since last%s%s)",
            self.step,
            row.version,
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

    def _maybe_move_reference(self) -> None:
        """With ``kl_reference = "stable"``, anchor the KL penalty to the version being served once it changes."""
        if self.lcfg.kl_reference != "stable":
            return
        now = time.monotonic()
        if now - self._last_ref_check < REFERENCE_CHECK_S:
            return
        self._last_ref_check = now
        stable = int(self.registry.stable().version)
        if stable == self.ref_version:
            return
        self.trainer.set_reference(self.registry.materialize(stable))
        log.info("learner: KL reference moved from v%s to stable v%d", self.ref_version, stable)
        self.ref_version = stable

    def _maybe_rebase(self, before_update: bool = False) -> None:
        """Restart from the stable weights when an operator rolled back, or when the fleet stopped following this
        learner (see module doc).

        Called on every loop iteration, whatever the counters say: a deployment that never dropped a stale
        sample must see a rollback too. The rollback check is one indexed registry read; it runs before every
        update (``before_update``: no step trains a lineage the registry has rolled back) and at most every
        ``ROLLBACK_CHECK_S`` while idle. Then a lineage the gate keeps refusing (``_refused_in_a_row``); the
        starvation rule applies once samples were refused as stale.
        """
        now = time.monotonic()
        if not before_update and now - self._last_rebase_check < ROLLBACK_CHECK_S:
            return
        self._last_rebase_check = now
        rollback, _ = self.registry.last_rollback()
        if self.rollback_seen is None or rollback <= self.rollback_seen:
            self.rollback_seen = rollback
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
                return
            if not self.counters["dropped:stale"]:
                return  # nothing was ever refused as stale: the fleet follows this learner
            stable = int(self.registry.stable().version)
            starved_s = now - self._fresh_at
            if starved_s < STARVE_S or self.lag(stable) <= self.max_lag:
                return  # still fed (a canary's samples), or the stable version's samples are fresh: no reason
            log.warning(
                "learner: only stale samples for %.0f s; stable v%d is %d updates behind (max %d): rebasing onto v%d",
                starved_s,
                stable,
                self.lag(stable),
                self.max_lag,
                stable,
            )
        else:  # an operator rolled back: whatever this lineage learned since must not come back in a candidate
            self.rollback_seen = rollback
            stable = int(self.registry.stable().version)
            log.warning("learner: the registry was rolled back to v%d: rebasing onto it", stable)
        self._rebase(stable)

    def _set_lr_scale(self, scale: float, since: float | None = None) -> None:
        """Train at ``scale`` x lr; promotions after ``since`` (default: now) count towards the next recovery."""
        if scale != self.trainer.lr_scale:
            self.trainer.set_lr_scale(scale)
            self.counters["lr_changes"] += 1
        self._lr_scale_since = time.time() if since is None else since

    def _recover_lr(self) -> None:
        """A learning rate backed off after refusals (``learner.lr_backoff``) comes back one step per promotion since
        it last changed: the gate accepts this lineage's steps again. One registry read, only while backed off."""
        if self.trainer.lr_scale >= 1.0:
            return
        promoted_at = self.registry.stable().promoted_at or 0.0
        if promoted_at <= self._lr_scale_since:
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
        a canary defers the decision to its verdict. (Stopping at any unjudged candidate, as this once did, meant the
        rule almost never fired: in an hour's demo two canaries in a row were aborted with a newer candidate already
        waiting, and the learner went on training the refused lineage.)"""
        k = self.lcfg.rebase_after_refusals
        if not k or self._emitted_since_rebase < k:
            return []  # too few candidates of this lineage for k refusals: no registry read before the update
        stable = self.registry.stable()
        # the stable version's successors: candidates emitted during its canary are judged after its promotion,
        # against it (counting from the promotion left out the first canary after each one: a second run of the
        # hour's demo had two futile canaries in a row and no rebase)
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
        self.trainer.load_weights(self.registry.materialize(stable), reset_optimizer=True)
        self._rebased_wall = time.time()
        self._emitted_since_rebase = 0
        self.last_emitted = stable
        self.version_steps[stable] = self.step
        self.ledger.rebased(self.step, stable)
        self._fresh_at = time.monotonic()
        self.counters["rebases"] += 1
        self._save_checkpoint()

    def publish(self, state: str = "running") -> None:
        self.last_backlog = self._backlog_shown()  # in the loop's thread: the consumer is not thread-safe
        if self.redis is None:
            return
        m = self.last_metrics
        fields = {
            "step": self.step,
            "samples_trained": self.counters["samples_trained"],
            "state": state,
            "last_candidate": -1 if self.last_candidate is None else self.last_candidate,
            "last_emitted": self.last_emitted,
            "queue": len(self.queue) + len(self.pending),
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
            **{k: v for k, v in self.counters.items() if k != "samples_trained"},
        }
        try:
            self.redis.hset(self.key, mapping={k: str(v) for k, v in fields.items()})
        except Exception as e:  # noqa: BLE001 - the live view is best effort; training must not stop for it
            self.counters["redis_errors"] += 1
            log.warning("learner: cannot publish live state to Redis: %s", e)

    def run(self, stop_event: threading.Event | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """Consume and train until ``stop_event`` is set or ``max_steps`` updates were made in this call."""
        self._consumer = make_consumer(self.bootstrap, self.group, [], broker=self.cfg.broker)  # assigned: _assign
        start_step, last_pub = self.step, 0.0
        try:
            while not (stop_event is not None and stop_event.is_set()):
                if max_steps is not None and self.step - start_step >= max_steps:
                    break
                if not self._consumer.assignment() or time.monotonic() - self._parts_checked_at > PARTITIONS_CHECK_S:
                    if not self._assign():  # no samples topic yet (ingest creates it)
                        time.sleep(0.2)
                        continue
                self._poll(timeout_ms=200)
                self._classify()
                ready = self._batch_ready()
                try:
                    self._maybe_rebase(before_update=ready)  # a rollback is seen whatever the counters say
                    self._maybe_move_reference()
                except REGISTRY_ERRORS as e:  # both are retried every few seconds; training goes on meanwhile
                    self.counters["registry_errors"] += 1
                    log.error("learner: cannot read the registry (%s: %s); retrying", type(e).__name__, e)
                if ready:
                    emitted = self.last_candidate
                    if self._update():
                        self._maybe_candidate()
                    if self.last_candidate != emitted or self._checkpoint_due():  # a candidate: its lineage durable
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
            if self.step > self._ckpt_step or self.ledger.buffered:  # a clean stop keeps what was trained since
                self._save_checkpoint()
                self._commit()
        finally:
            self.publish("stopped")
            self._consumer.close(autocommit=False)
            self._consumer = None
        return self.stats()

    def _backlog_shown(self) -> tuple[int, float]:
        try:
            events, seconds = self.backlog()
        except Exception as e:  # noqa: BLE001 - the live view is best effort: a client call mid-rebalance may raise
            log.debug("learner: backlog unknown: %s", e)
            return -1, -1.0
        return events, round(seconds, 1)

    def _fenced(self, what: str) -> None:
        if self.lease is not None and self.lease.lost.is_set():
            raise LeaseLost(f"the learner lease is lost; no {what} (another learner may be running)")

    def stats(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples_trained": int(self.counters["samples_trained"]),
            "unique_trained": len(self.trained_ids),
            "last_candidate": self.last_candidate,
            "last_emitted": self.last_emitted,
            "offsets": dict(self.offsets),
            "counters": dict(self.counters),
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

    ``metrics_port``: serve Prometheus metrics on 127.0.0.1:port (``serving.host``) while it runs.
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
        server, _ = start_http_server(metrics_port, addr=cfg.serving.host, registry=prom)
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
