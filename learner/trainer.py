"""The continuous learner: TrainingSamples from Kafka -> policy-gradient updates -> candidate versions.

Guarantees (the checkpoint is the source of truth, Kafka offsets only mirror it):

- Every update is followed by an atomic checkpoint (temp file + ``os.replace``) holding the fp32 weights,
  the optimizer, the step, the next offset per partition, the trained sample ids, the last emitted
  version, the baseline and the counters; only THEN are the offsets committed to the consumer group. On
  restart the learner seeks every partition to the checkpoint's offsets, so a crash between the save and
  the commit neither loses a sample nor trains one twice. Samples are taken in offset order per partition,
  so "next offset" is an exact watermark: everything below it was trained on or refused.
- A sample id already trained on (or already waiting in the batch being built) is refused as a
  ``duplicate``: ingest is at-least-once, the learner makes it exactly-once.
- A sample whose ``policy_version`` lags the learner's last emitted version by more than
  ``max_staleness`` is refused as ``stale``. If the served (stable) version itself falls that far
  behind — the gate keeps refusing this lineage, or an operator rolled back — every new sample would be
  stale and the learner would starve, so it rebases: it restarts from the stable weights.
- Bad samples (token/logprob length mismatch, out-of-vocab ids, non-finite values, too long) are refused
  with a counted reason; the loop never crashes on input.

Run as a process: ``liverl learn`` or ``python -m learner.trainer [--config FILE] [--max-steps N]``.
The learner is a singleton per deployment (one consumer in group ``<prefix>.learner``).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import CommitFailedError
from kafka.structs import OffsetAndMetadata

from learner.loss import RunningBaseline, advantages, full_kl, pg_loss
from liverl.core import keys
from liverl.core.bus import make_consumer
from liverl.core.config import LearnerConfig, LiverlConfig
from liverl.core.schemas import TrainingSample, WireError

log = logging.getLogger("liverl.learner")

CHECKPOINT_FORMAT = 1
DEFAULT_KL_ESTIMATOR = "full"  # see learner.loss: k3-as-a-loss stalls the lift on the demo task
STALE_REBASE_CHECK_S = 5.0


class PolicyTrainer:
    """The learner's model half: fp32 master weights, frozen reference, AdamW, baseline. No I/O.

    ``train_step(samples)`` runs ``micro_epochs`` passes of the loss in ``learner.loss`` over one batch.
    Used by ``Learner`` (Kafka) and directly by in-process experiments.
    """

    def __init__(self, model_dir: Path, lcfg: LearnerConfig, state_dict: dict[str, torch.Tensor] | None = None,
                 normalize_adv: bool = False, kl_estimator: str | None = None):
        from learner.model import load_model

        torch.set_num_threads(1)  # 2 cores shared with vLLM, ingest and the gate
        self.lcfg = lcfg
        self.normalize_adv = normalize_adv
        self.kl_estimator = kl_estimator or getattr(lcfg, "kl_estimator", DEFAULT_KL_ESTIMATOR)
        if self.kl_estimator not in ("full", "k3"):
            raise ValueError(f"kl_estimator must be 'full' or 'k3', got {self.kl_estimator!r}")
        self.model = load_model(Path(model_dir), state_dict=state_dict, dtype=torch.float32)
        self.model.train()
        self.ref = load_model(Path(model_dir), dtype=torch.float32)  # the base: KL penalty and KL metric
        self.ref.eval()
        self.ref.requires_grad_(False)
        conf = self.model.config
        self.vocab_size = int(conf.vocab_size)
        self.max_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.pad_id = int(getattr(conf, "pad_token_id", None) or 0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lcfg.lr, weight_decay=0.0)
        self.baseline = RunningBaseline()

    # -- input checks ---------------------------------------------------------------------------
    def refusal(self, s: TrainingSample) -> str | None:
        """Why this sample cannot be trained on (a short countable code), or None when it can."""
        c, lp = s.completion_token_ids, s.behaviour_logprobs
        if not c:
            return "empty_completion"
        if not s.prompt_token_ids:
            return "empty_prompt"
        if len(c) != len(lp):
            return "shape_mismatch"
        if len(c) + len(s.prompt_token_ids) > self.max_len:
            return "too_long"
        if any(not 0 <= t < self.vocab_size for t in s.prompt_token_ids) or any(not 0 <= t < self.vocab_size for t in c):
            return "out_of_vocab"
        if any(not math.isfinite(x) or x > 1e-3 for x in lp):
            return "bad_logprob"
        if not math.isfinite(s.reward):
            return "bad_reward"
        return None

    # -- forward ----------------------------------------------------------------------------------
    def _collate(self, samples: list[TrainingSample]) -> dict[str, torch.Tensor]:
        B = len(samples)
        L = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
        T = max(len(s.completion_token_ids) for s in samples)
        ids_BL = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn_BL = torch.zeros((B, L), dtype=torch.long)
        pos_BT = torch.zeros((B, T), dtype=torch.long)
        tgt_BT = torch.zeros((B, T), dtype=torch.long)
        mask_BT = torch.zeros((B, T))
        beh_BT = torch.zeros((B, T))
        for b, s in enumerate(samples):
            P, C = len(s.prompt_token_ids), len(s.completion_token_ids)
            ids_BL[b, : P + C] = torch.tensor(s.prompt_token_ids + s.completion_token_ids)
            attn_BL[b, : P + C] = 1
            pos_BT[b, :C] = torch.arange(P - 1, P + C - 1)  # logits at position i predict token i+1
            tgt_BT[b, :C] = torch.tensor(s.completion_token_ids)
            mask_BT[b, :C] = 1.0
            beh_BT[b, :C] = torch.tensor(s.behaviour_logprobs)
        reward_B = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        return {"ids_BL": ids_BL, "attn_BL": attn_BL, "pos_BT": pos_BT, "tgt_BT": tgt_BT, "mask_BT": mask_BT,
                "beh_BT": beh_BT, "reward_B": reward_B}

    @staticmethod
    def _token_logp(model, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the completion tokens ``logp_BT`` and the full distributions ``logprobs_BTV``."""
        logits_BLV = model(input_ids=x["ids_BL"], attention_mask=x["attn_BL"]).logits.float()
        V = logits_BLV.shape[-1]
        logits_BTV = torch.gather(logits_BLV, 1, x["pos_BT"][..., None].expand(-1, -1, V))
        logprobs_BTV = torch.log_softmax(logits_BTV, dim=-1)
        logp_BT = torch.gather(logprobs_BTV, 2, x["tgt_BT"][..., None]).squeeze(-1)
        return logp_BT, logprobs_BTV

    def train_step(self, samples: list[TrainingSample]) -> dict[str, float]:
        """One update on ``samples`` (already validated): ``micro_epochs`` AdamW steps, grad-norm clip 1.0."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        x = self._collate(samples)
        adv_B = advantages(x["reward_B"], [s.segment for s in samples], self.baseline, self.normalize_adv)
        ref_BT = ref_BTV = None
        if self.ref is not None:
            with torch.no_grad():
                ref_BT, ref_BTV = self._token_logp(self.ref, x)
        first: dict[str, float] = {}
        out = None
        for epoch in range(max(1, self.lcfg.micro_epochs)):
            logp_BT, logprobs_BTV = self._token_logp(self.model, x)
            with torch.no_grad():
                ent_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
            kl_BT = full_kl(logprobs_BTV, ref_BTV) if ref_BTV is not None and self.kl_estimator == "full" else None
            out = pg_loss(logp_BT, x["beh_BT"], adv_B, x["mask_BT"], tis_cap=self.lcfg.tis_cap,
                          ref_logp_BT=ref_BT, kl_coef=self.lcfg.kl_coef, kl_BT=kl_BT, entropy_BT=ent_BT)
            if not torch.isfinite(out.loss):
                raise FloatingPointError(f"non-finite loss {float(out.loss)} (metrics {out.metrics})")
            self.opt.zero_grad(set_to_none=True)
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if not torch.isfinite(gnorm):
                self.opt.zero_grad(set_to_none=True)
                raise FloatingPointError(f"non-finite gradient norm {float(gnorm)}")
            self.opt.step()
            if epoch == 0:
                first = dict(out.metrics, grad_norm=float(gnorm))
        metrics = dict(first)
        metrics["reward_mean"] = float(x["reward_B"].mean())
        metrics["samples"] = float(len(samples))
        if out is not None and self.lcfg.micro_epochs > 1:
            metrics["loss_last"] = out.metrics["loss"]
        return metrics

    # -- weights & state ---------------------------------------------------------------------------
    def weights(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        """The current weights under the file names (the weights convention); bf16 is the served form."""
        from learner.model import state_dict_from_model

        return state_dict_from_model(self.model, dtype=dtype)

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights(torch.bfloat16)

    def load_weights(self, state_dict: dict[str, torch.Tensor], reset_optimizer: bool) -> None:
        """Overwrite the weights in place (file names, any dtype) so the optimizer keeps its parameters."""
        from learner.model import to_module_state

        module_sd = to_module_state(state_dict, dtype=torch.float32)
        missing, unexpected = self.model.load_state_dict(module_sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
        if reset_optimizer:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lcfg.lr, weight_decay=0.0)

    def set_reference(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Move the KL anchor (file names, any dtype): the learner stays near what is served, not only near the base."""
        from learner.model import to_module_state

        if self.ref is None:
            return
        missing, unexpected = self.ref.load_state_dict(to_module_state(state_dict, dtype=torch.float32), strict=False)
        if missing or unexpected:
            raise ValueError(f"reference state dict does not match the model: missing {missing}, unexpected {unexpected}")

    def state(self) -> dict[str, Any]:
        return {"model": self.weights(torch.float32), "optimizer": self.opt.state_dict(),
                "baseline": self.baseline.state_dict()}

    def load_state(self, st: dict[str, Any]) -> None:
        self.load_weights(st["model"], reset_optimizer=True)
        self.opt.load_state_dict(st["optimizer"])
        self.baseline.load_state_dict(st["baseline"])


class Learner(ConsumerRebalanceListener):
    """Kafka consumer + PolicyTrainer + checkpoint + registry candidates + live state in Redis."""

    def __init__(self, cfg: LiverlConfig, model_dir: Path, bootstrap: str, registry, redis=None,
                 checkpoint_path: Path | None = None):
        self.cfg, self.lcfg = cfg, cfg.learner
        if self.lcfg.batch_size < 1 or self.lcfg.candidate_every_steps < 1 or self.lcfg.max_staleness < 0:
            raise ValueError("learner.batch_size and candidate_every_steps must be >= 1, max_staleness >= 0")
        self.model_dir, self.bootstrap, self.registry, self.redis = Path(model_dir), bootstrap, registry, redis
        self.topic = cfg.topics.samples
        self.group = f"{cfg.topics.prefix}.learner"
        self.key = keys.learner(cfg.topics.prefix)
        self.ckpt_path = Path(checkpoint_path or cfg.state_path / "learner" / f"{cfg.topics.prefix}.ckpt")
        self.trainer = PolicyTrainer(self.model_dir, self.lcfg)
        self.step = 0
        self.offsets: dict[int, int] = {}  # durable watermark: next offset per partition
        self.trained_ids: set[str] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        self.since_candidate: dict[str, float] = {"reward_sum": 0.0, "samples": 0.0, "steps": 0.0, "loss_sum": 0.0}
        self.last_candidate: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.queue: collections.deque = collections.deque()  # (partition, offset, raw value), as fetched
        self.pending: list[tuple[int, int, TrainingSample]] = []  # accepted, waiting for a full batch
        self.read_pos: dict[int, int] = {}  # next offset to classify per partition
        self._consumer = None
        self._last_rebase_check = 0.0
        self.rollback_seen: int | None = None  # audit id of the last rollback this learner rebased for
        self._last_ref_check = 0.0
        self.ref_version = 0  # the KL reference starts at the base policy (version 0)
        if self.ckpt_path.exists():
            self._load_checkpoint()
        else:
            stable = self.registry.stable()
            self.last_emitted = int(stable.version)
            if stable.version != 0:
                self.trainer.load_weights(self.registry.materialize(stable.version), reset_optimizer=True)
            log.info("learner: no checkpoint at %s; starting from stable version %d", self.ckpt_path, stable.version)

    # -- checkpoint ---------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        st = dict(self.trainer.state(), format=CHECKPOINT_FORMAT, step=self.step, offsets=dict(self.offsets),
                  trained_ids=sorted(self.trained_ids), last_emitted=self.last_emitted,
                  last_candidate=self.last_candidate, counters=dict(self.counters),
                  since_candidate=dict(self.since_candidate), topic=self.topic, rollback_seen=self.rollback_seen)
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
        st = torch.load(self.ckpt_path, map_location="cpu", weights_only=True)
        if st.get("format") != CHECKPOINT_FORMAT or st.get("topic") != self.topic:
            raise ValueError(f"checkpoint {self.ckpt_path} is format {st.get('format')} for topic {st.get('topic')!r}; "
                             f"expected format {CHECKPOINT_FORMAT} for {self.topic!r} (move it away to start fresh)")
        self.trainer.load_state(st)
        self.step = int(st["step"])
        self.offsets = {int(p): int(o) for p, o in st["offsets"].items()}
        self.trained_ids = set(st["trained_ids"])
        self.last_emitted = int(st["last_emitted"])
        self.last_candidate = st["last_candidate"]
        self.counters = collections.Counter(st["counters"])
        self.since_candidate = dict(st["since_candidate"])
        self.rollback_seen = st.get("rollback_seen")
        log.info("learner: resumed from %s at step %d, %d samples trained, offsets %s, last emitted v%d",
                 self.ckpt_path, self.step, len(self.trained_ids), self.offsets, self.last_emitted)

    # -- Kafka ------------------------------------------------------------------------------------
    def on_partitions_revoked(self, revoked) -> None:  # ConsumerRebalanceListener
        log.info("learner: partitions revoked %s", sorted(tp.partition for tp in revoked))

    def on_partitions_assigned(self, assigned) -> None:
        """Seek each partition to where this learner stands; the checkpoint outranks committed offsets."""
        parts = {tp.partition for tp in assigned if tp.topic == self.topic}
        self.queue.clear()  # re-fetched from read_pos below
        self.pending = [e for e in self.pending if e[0] in parts]
        self.read_pos = {p: o for p, o in self.read_pos.items() if p in parts}
        for tp in assigned:
            pos = self.read_pos.get(tp.partition, self.offsets.get(tp.partition))
            if pos is not None:
                self._consumer.seek(tp, pos)
        log.info("learner: assigned partitions %s; positions %s", sorted(parts),
                 {p: self.read_pos.get(p, self.offsets.get(p)) for p in sorted(parts)})

    def _poll(self, timeout_ms: int) -> None:
        c = self._consumer
        full = len(self.queue) >= 8 * self.lcfg.batch_size
        assigned = c.assignment()
        if full and assigned:
            c.pause(*assigned)
        elif c.paused():
            c.resume(*c.paused())
        for tp, records in c.poll(timeout_ms=0 if full else timeout_ms, max_records=4 * self.lcfg.batch_size).items():
            if isinstance(tp, TopicPartition) and tp.topic != self.topic:
                continue
            for r in records:
                self.queue.append((r.partition, r.offset, r.value))

    def _classify(self) -> None:
        """Move fetched records into ``pending`` (accepted) or refuse them, until a batch is full."""
        while self.queue and len(self.pending) < self.lcfg.batch_size:
            part, off, raw = self.queue.popleft()
            self.read_pos[part] = off + 1
            reason = None
            try:
                s = TrainingSample.from_bytes(raw if raw is not None else b"")
            except WireError as e:
                reason, s = f"wire_{e.reason}", None
            if s is not None:
                if s.sample_id in self.trained_ids or any(p[2].sample_id == s.sample_id for p in self.pending):
                    reason = "duplicate"
                elif self.last_emitted - s.policy_version > self.lcfg.max_staleness:
                    reason = "stale"
                else:
                    reason = self.trainer.refusal(s)
            if reason is None:
                self.pending.append((part, off, s))
                continue
            self.counters[f"dropped:{reason}"] += 1
            if reason not in ("duplicate", "stale"):
                log.warning("learner: refused sample at %s[%d]@%d: %s", self.topic, part, off, reason)
            if not any(p[0] == part for p in self.pending):
                self.offsets[part] = off + 1  # nothing waiting below it in this partition

    def _commit(self) -> None:
        """Commit what the checkpoint already holds. A failed commit (this consumer was dropped from its
        group, e.g. a long pause between polls) loses nothing: the next commit carries the same offsets, and
        a reassignment seeks to the checkpoint's positions. It is counted and logged, not fatal."""
        offs = {TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in self.offsets.items()}
        if not offs:
            return
        try:
            self._consumer.commit(offs)
        except CommitFailedError as e:
            self.counters["commit_failed"] += 1
            log.warning("learner: offset commit failed at step %d (%s); the checkpoint holds the offsets, "
                        "the next commit retries", self.step, e)

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
        batch = self.pending[: self.lcfg.batch_size]
        self.pending = self.pending[self.lcfg.batch_size:]
        samples = [e[2] for e in batch]
        t0 = time.monotonic()
        try:
            m = self.trainer.train_step(samples)
        except FloatingPointError as e:  # keep the loop alive; the batch is skipped, loudly
            log.error("learner: step %d skipped: %s", self.step + 1, e)
            self.counters["dropped:nonfinite_update"] += len(samples)
            m = None
        for part, off, s in batch:
            if m is not None:
                self.trained_ids.add(s.sample_id)
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
        log.info("learner: step %d trained %d samples (total %d, v%d) reward %.3f loss %.4f kl %.4f ratio %.3f "
                 "clip %.3f masked %.3f entropy %.3f in %.2fs", self.step, len(samples),
                 self.counters["samples_trained"], self.last_emitted, m["reward_mean"], m["loss"], m["kl"],
                 m["ratio_mean"], m["clipped_frac"], m["masked_frac"], m.get("entropy", float("nan")),
                 self.last_metrics["step_s"])
        return True

    def _maybe_candidate(self) -> None:
        if self.step % self.lcfg.candidate_every_steps != 0 or self.step == 0:
            return
        if self.frozen():
            self.counters["candidates_skipped_frozen"] += 1
            log.info("learner: step %d: frozen, no candidate", self.step)
            return
        sc = self.since_candidate
        metrics = {"samples_trained": int(self.counters["samples_trained"]),
                   "samples_since_last": int(sc["samples"]),
                   "reward_mean": sc["reward_sum"] / max(sc["samples"], 1.0),
                   "loss_mean": sc["loss_sum"] / max(sc["steps"], 1.0),
                   **{k: self.last_metrics[k] for k in ("kl", "entropy", "ratio_mean", "clipped_frac", "masked_frac")
                      if k in self.last_metrics}}
        parent = int(self.registry.stable().version)
        row = self.registry.add_candidate(self.trainer.bf16_state_dict(), parent=parent, metrics=metrics,
                                          sample_offsets={str(p): o for p, o in sorted(self.offsets.items())},
                                          learner_step=self.step)
        self.last_emitted = self.last_candidate = int(row.version)
        self.since_candidate = {k: 0.0 for k in sc}
        log.info("learner: step %d -> candidate v%d (parent v%d, %d samples trained, reward %.3f since last)",
                 self.step, row.version, parent, metrics["samples_trained"], metrics["reward_mean"])

    def _maybe_move_reference(self) -> None:
        """With ``kl_reference = "stable"``, anchor the KL penalty to the version being served once it changes."""
        if self.lcfg.kl_reference != "stable":
            return
        now = time.monotonic()
        if now - self._last_ref_check < STALE_REBASE_CHECK_S:
            return
        self._last_ref_check = now
        stable = int(self.registry.stable().version)
        if stable == self.ref_version:
            return
        self.trainer.set_reference(self.registry.materialize(stable))
        log.info("learner: KL reference moved from v%s to stable v%d", self.ref_version, stable)
        self.ref_version = stable

    def _maybe_rebase(self) -> None:
        """Restart from the stable weights when the fleet stopped following this learner (see module doc)."""
        now = time.monotonic()
        if now - self._last_rebase_check < STALE_REBASE_CHECK_S:
            return
        self._last_rebase_check = now
        stable = int(self.registry.stable().version)
        rollback, _ = self.registry.last_rollback()
        if self.rollback_seen is None or rollback <= self.rollback_seen:
            self.rollback_seen = rollback
            if self.last_emitted - stable <= self.lcfg.max_staleness:
                return
            log.warning("learner: stable v%d lags last emitted v%d by more than %d: rebasing onto v%d",
                        stable, self.last_emitted, self.lcfg.max_staleness, stable)
        else:  # an operator rolled back: whatever this lineage learned since must not come back in a candidate
            self.rollback_seen = rollback
            log.warning("learner: the registry was rolled back to v%d: rebasing onto it", stable)
        self.trainer.load_weights(self.registry.materialize(stable), reset_optimizer=True)
        self.last_emitted = stable
        self.counters["rebases"] += 1
        self._save_checkpoint()

    def publish(self, state: str = "running") -> None:
        if self.redis is None:
            return
        m = self.last_metrics
        fields = {"step": self.step, "samples_trained": self.counters["samples_trained"], "state": state,
                  "last_candidate": -1 if self.last_candidate is None else self.last_candidate,
                  "last_emitted": self.last_emitted, "queue": len(self.queue) + len(self.pending), "ts": time.time(),
                  **{k: round(m[k], 6) for k in ("reward_mean", "kl", "loss", "entropy", "ratio_mean",
                                                 "clipped_frac", "masked_frac", "step_s") if k in m},
                  **{k: v for k, v in self.counters.items() if k != "samples_trained"}}
        try:
            self.redis.hset(self.key, mapping={k: str(v) for k, v in fields.items()})
        except Exception as e:  # noqa: BLE001 - the live view is best effort; training must not stop for it
            self.counters["redis_errors"] += 1
            log.warning("learner: cannot publish live state to Redis: %s", e)

    def run(self, stop_event: threading.Event | None = None, max_steps: int | None = None) -> dict[str, Any]:
        """Consume and train until ``stop_event`` is set or ``max_steps`` updates were made in this call."""
        # a candidate (encode + registry write) can keep the loop from polling for seconds on a busy machine:
        # allow 10 s between polls before the group drops this consumer
        self._consumer = make_consumer(self.bootstrap, self.group, [self.topic],
                                       rebalance_timeout_s=max(self.cfg.broker.rebalance_timeout_s, 10.0))
        self._consumer.subscribe([self.topic], listener=self)  # seek to the checkpoint on every assignment
        start_step, last_pub = self.step, 0.0
        try:
            while not (stop_event is not None and stop_event.is_set()):
                if max_steps is not None and self.step - start_step >= max_steps:
                    break
                self._poll(timeout_ms=200)
                self._classify()
                if self.counters["dropped:stale"] and self._consumer.assignment():
                    self._maybe_rebase()
                self._maybe_move_reference()
                if len(self.pending) >= self.lcfg.batch_size:
                    if self._update():
                        self._maybe_candidate()
                    self._save_checkpoint()
                    self._commit()
                    self.publish()
                    last_pub = time.monotonic()
                elif time.monotonic() - last_pub > 1.0:
                    self.publish("waiting")
                    last_pub = time.monotonic()
        finally:
            self.publish("stopped")
            self._consumer.close(autocommit=False)
            self._consumer = None
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {"step": self.step, "samples_trained": int(self.counters["samples_trained"]),
                "unique_trained": len(self.trained_ids), "last_candidate": self.last_candidate,
                "last_emitted": self.last_emitted, "offsets": dict(self.offsets),
                "counters": dict(self.counters), "last_metrics": dict(self.last_metrics)}


class PrometheusCollector:
    """Exposes a learner's live state at scrape time (``liverl_learner_*``; counters end in ``_total``)."""

    def __init__(self, learner: Learner):
        self.learner = learner

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lr = self.learner
        yield CounterMetricFamily("liverl_learner_steps", "Policy updates made.", value=lr.step)
        yield CounterMetricFamily("liverl_learner_samples_trained", "Samples trained on.",
                                  value=lr.counters["samples_trained"])
        dropped = CounterMetricFamily("liverl_learner_samples_dropped", "Samples refused, by reason.", labels=["reason"])
        for k, v in sorted(lr.counters.items()):
            if k.startswith("dropped:"):
                dropped.add_metric([k.split(":", 1)[1]], v)
        yield dropped
        yield CounterMetricFamily("liverl_learner_rebases", "Restarts from the stable weights.", value=lr.counters["rebases"])
        yield GaugeMetricFamily("liverl_learner_last_candidate_version", "Last candidate version emitted (-1: none).",
                                value=-1 if lr.last_candidate is None else lr.last_candidate)
        for k in ("reward_mean", "kl", "entropy", "ratio_mean", "clipped_frac", "masked_frac", "loss"):
            if k in lr.last_metrics:
                yield GaugeMetricFamily(f"liverl_learner_{k}", f"Last update's {k}.", value=lr.last_metrics[k])


def run_learner(cfg: LiverlConfig, model_dir: Path, stop_event: threading.Event | None = None, max_steps: int | None = None,
                metrics_port: int | None = None) -> dict:
    """The learner process: connect to the configured stack, build/load the base policy, train until stopped.

    ``metrics_port``: serve Prometheus metrics on 127.0.0.1:port (``serving.host``) while it runs.
    """
    from deploy.delta import warm_up
    from deploy.registry import RegistryError, open_registry
    from learner.model import load_state_dict
    from liverl.core.bus import ensure_topics

    from liverl.core.services import kafka_bootstrap, setup_redis

    bootstrap = kafka_bootstrap(cfg)
    ensure_topics(bootstrap, [cfg.topics.samples], cfg.broker.partitions)
    warm_up()  # the delta codec's kernels, before the first candidate is due
    registry = open_registry(cfg)
    try:
        registry.stable()
    except RegistryError:  # an empty registry: this process is the first to need version 0
        log.info("learner: registry has no stable version; registering the base policy as v0")
        registry.init_base(load_state_dict(model_dir), str(model_dir))
    r = setup_redis(cfg)
    learner = Learner(cfg, model_dir, bootstrap, registry, redis=r)
    server = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        prom = CollectorRegistry()
        prom.register(PrometheusCollector(learner))
        server, _ = start_http_server(metrics_port, addr=cfg.serving.host, registry=prom)
    try:
        return learner.run(stop_event=stop_event, max_steps=max_steps)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        r.close()
        registry.close()

