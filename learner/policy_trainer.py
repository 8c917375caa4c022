"""The learner's model half: fp32 master weights, a KL reference, AdamW and the reward baseline. No I/O.

``PolicyTrainer.train_step(samples)`` runs ``micro_epochs`` passes of ``learner.loss`` over one batch and leaves the
weights untouched when the batch fails (non-finite loss or gradient, out of memory). ``refusal(sample)`` is the
input check the learner applies to every record before it may reach a batch (``learner.admission``). The batch's
layout (the input check, packing, collation) is ``learner.batch``'s; which forward the policy and the reference run
through, and the log-probs it gives, ``learner.forward``'s. Used by ``learner.trainer.Learner`` (Kafka, checkpoints)
and directly by ``liverl bench logprobs`` and in-process experiments.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from core.config import LearnerConfig
from core.schemas import TrainingSample
from learner import forward, replay
from learner.average import WeightAverage
from learner.batch import collate, padded_tokens, refusal
from learner.dist import Ranks, all_sum, full_state_dict, grad_scale, shard, share
from learner.loss import RunningBaseline, advantages, full_kl, pg_loss
from learner.mismatch import MismatchSums
from learner.model import assign_weights, load_model, state_dict_from_model

FLOOR_LIFT_MAX = 4.0
"""The most ``learner.floor_for_candidate`` may raise the entropy floor by (a factor)."""


class BatchFailed(RuntimeError):
    """A batch could not be trained on; the trainer's state is as before it. ``reason`` is a countable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class PolicyTrainer:
    """The learner's model half: fp32 master weights, frozen reference, AdamW, baseline. No I/O.

    ``train_step(samples)`` runs ``micro_epochs`` passes of the loss in ``learner.loss`` over one batch.
    Used by ``Learner`` (Kafka) and directly by in-process experiments.

    ``ranks`` (``learner.dist.setup()``): the policy and the reference are sharded with FSDP2 over the group, and
    every call that touches weights (``train_step``, ``weights``, ``load_weights``, ``set_reference``,
    ``token_logprobs``) is a collective: every rank calls it, with the same samples. Each rank trains its share of
    the batch; the advantages, the loss's token denominator and the gradient are the whole batch's, so the maths is
    the same code for 1 and N ranks (``learner.dist``). Without ``ranks``: one process, CPU, no process group.
    """

    def __init__(
        self,
        model_dir: Path,
        lcfg: LearnerConfig,
        state_dict: dict[str, torch.Tensor] | None = None,
        normalize_adv: bool = False,
        kl_estimator: str | None = None,
        ranks: Ranks | None = None,
    ):
        if ranks is None or ranks.device.type == "cpu":
            torch.set_num_threads(1)  # 2 cores shared with vLLM, ingest and the gate (and the other ranks)
        self.lcfg = lcfg
        self.normalize_adv = normalize_adv
        self.kl_estimator = kl_estimator or lcfg.kl_estimator
        if self.kl_estimator not in ("full", "k3"):
            raise ValueError(f"kl_estimator must be 'full' or 'k3', got {self.kl_estimator!r}")
        self.model = load_model(Path(model_dir), state_dict=state_dict, dtype=torch.float32)
        self.model.train()
        self.ref = load_model(Path(model_dir), dtype=torch.float32)  # the base: KL penalty and KL metric
        self.ref.eval()
        self.ref.requires_grad_(False)
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else torch.device("cpu")
        if ranks is not None:
            shard(self.model, ranks)
            shard(self.ref, ranks)
        conf = self.model.config
        self.vocab_size = int(conf.vocab_size)
        self.max_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.pad_id = int(getattr(conf, "pad_token_id", None) or 0)
        # the routing samples must carry to be replayed (learner.routing_replay); None: dense, off, or not replayed
        self.routing = replay.moe_shape(self.model) if lcfg.routing_replay == "rollout" else None
        self.moe = replay.moe_shape(self.model)  # the routing a sample may carry, replayed or not (the mismatch's)
        self.mismatch = MismatchSums()  # per version, the sampler/trainer mismatch of the samples trained on
        self.lr_scale = 1.0  # the learner's back-off after refused candidates (``set_lr_scale``)
        self.floor_lift = 1.0  # the entropy floor's factor for the averaged candidates (learner.floor_for_candidate)
        self._last_x: tuple[dict[str, torch.Tensor], int, float] | None = None  # the last batch, where it is measured
        self.opt = self._adamw(lcfg.lr)
        self.baseline = RunningBaseline()
        self.average = WeightAverage(self.model, lcfg)  # the candidates' weights (``candidate_weights``)

    # -- input checks ---------------------------------------------------------------------------
    def refusal(self, s: TrainingSample) -> str | None:
        """Why this sample cannot be trained on (a short countable code), or None when it can (``learner.batch``)."""
        return refusal(s, self.max_len, self.vocab_size) or replay.refusal(s, self.routing)

    # -- forward ----------------------------------------------------------------------------------
    def _collate(self, samples: list[TrainingSample]) -> dict[str, torch.Tensor]:
        """The batch as the forward pass takes it (``learner.batch.collate``), on this trainer's device."""
        return collate(samples, self.pad_id, self.device, self.routing)

    def _token_logp(self, model, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the completion tokens ``logp_BT`` and the full distributions ``logprobs_BTV``, through the
        forward ``learner.forward`` picks for ``model``."""
        return forward.token_logp(model, x, self.lcfg)

    @torch.no_grad()
    def token_logprobs(self, samples: list[TrainingSample], model=None) -> list[list[float]]:
        """The current policy's log-prob of each completion token, as the loss computes it (fp32).

        ``model``: another transformers model to score with the same code (e.g. a bf16 copy, for reference).
        """
        x = self._collate(samples)
        logp_BT, _ = self._token_logp(self.model if model is None else model, x)
        return [logp_BT[b, : len(s.completion_token_ids)].tolist() for b, s in enumerate(samples)]

    def forward_path(self) -> str:
        """Which forward the policy and the reference run through, and why (the learner logs it at start)."""
        return forward.describe(self.model, self.lcfg, sharded=self.ranks is not None)

    def train_step(self, samples: list[TrainingSample]) -> dict[str, float]:
        """One update on ``samples`` (already validated): ``micro_epochs`` AdamW steps, grad-norm clip 1.0.

        All or nothing: if any epoch fails (a non-finite loss or gradient, out of memory, any other error), the
        weights, the optimizer and the baseline are put back as they were and ``BatchFailed`` names the reason.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        undo = self._undo_point()
        try:
            return self._train_step(samples)
        except Exception as e:
            self.opt.zero_grad(set_to_none=True)
            undo()
            if isinstance(e, FloatingPointError):
                raise BatchFailed("nonfinite_update", str(e)) from e
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
                raise BatchFailed(
                    "out_of_memory", f"{len(samples)} samples, {padded_tokens(samples)} padded tokens"
                ) from e
            raise BatchFailed("train_error", f"{type(e).__name__}: {e}") from e

    def _undo_point(self):
        """A callable that restores the state ``train_step`` may change. The weights and the optimizer are only
        copied when more than one epoch runs: a single epoch fails before ``opt.step()`` or not at all."""
        baseline = copy.deepcopy(self.baseline.state_dict())
        saved = None
        if self.lcfg.micro_epochs > 1:
            saved = (
                {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                copy.deepcopy(self.opt.state_dict()),
            )

        def undo() -> None:
            self.baseline.load_state_dict(baseline)
            if saved is not None:
                self.model.load_state_dict(saved[0])
                self.opt.load_state_dict(saved[1])

        return undo

    def _train_step(self, samples: list[TrainingSample]) -> dict[str, float]:
        reward_N = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv_N = advantages(reward_N, [s.segment for s in samples], self.baseline, self.normalize_adv)  # whole batch
        n_tokens = sum(len(s.completion_token_ids) for s in samples)  # the whole batch's: every rank's denominator
        idx = list(range(len(samples))) if self.ranks is None else share(len(samples), self.ranks)
        weight = 1.0 if self.ranks is None else grad_scale(self.ranks)
        if not idx:  # fewer samples than ranks: a zero-weighted pass keeps this rank in FSDP's collectives
            idx, weight = [0], 0.0
        x = self._collate([samples[i] for i in idx])
        adv_B = adv_N[idx].to(self.device)
        with torch.no_grad():
            ref_BT, ref_BTV = self._token_logp(self.ref, x)
        first: dict[str, float] = {}
        out = None
        floor = self.lcfg.entropy_floor * self.floor_lift
        measured = MismatchSums()  # this batch's, kept only if it trains
        for epoch in range(self.lcfg.micro_epochs):
            logp_BT, logprobs_BTV = self._token_logp(self.model, x)
            if epoch == 0 and self.lcfg.mismatch_measure != "off" and weight > 0:
                self._measure_mismatch([samples[i] for i in idx], x, logp_BT, measured)
            with torch.no_grad():
                ent_BT = forward.entropy_BT(logprobs_BTV)
            batch_entropy = None
            if self.lcfg.entropy_coef > 0 and self.lcfg.entropy_floor > 0:  # the floor's hinge (learner.loss)
                part = float((ent_BT * x["mask_BT"]).sum()) / n_tokens * (weight > 0)
                batch_entropy = part if self.ranks is None else all_sum([part], self.ranks)[0]  # the whole batch's
                if batch_entropy < floor:  # it acts: the entropy again, with its gradient
                    ent_BT = forward.entropy_BT(logprobs_BTV)
            kl_BT = full_kl(logprobs_BTV, ref_BTV) if self.kl_estimator == "full" else None
            out = pg_loss(
                logp_BT,
                x["beh_BT"],
                adv_B,
                x["mask_BT"],
                tis_cap=self.lcfg.tis_cap,
                ref_logp_BT=ref_BT,
                kl_coef=self.lcfg.kl_coef,
                kl_BT=kl_BT,
                entropy_BT=ent_BT,
                n_tokens=n_tokens,
                entropy_floor=floor,
                entropy_coef=self.lcfg.entropy_coef,
                batch_entropy=batch_entropy,
            )
            if self.ranks is not None:  # this share's parts -> the batch's values, the same on every rank
                parts = ("loss", "loss_pg", "kl", "entropy")
                summed = all_sum([out.metrics.get(k, 0.0) * (weight > 0) for k in parts], self.ranks)
                out.metrics.update({k: v for k, v in zip(parts, summed, strict=True) if k in out.metrics})
            if not math.isfinite(out.metrics["loss"]):  # every rank sees the batch's loss: all raise or none
                raise FloatingPointError(f"non-finite loss {out.metrics['loss']} (metrics {out.metrics})")
            self.opt.zero_grad(set_to_none=True)
            (out.loss if weight == 1.0 else out.loss * weight).backward()
            gnorm = self._clip_grad_norm(1.0)
            if not math.isfinite(gnorm):
                raise FloatingPointError(f"non-finite gradient norm {gnorm}")
            self.opt.step()
            if epoch == 0:
                first = dict(out.metrics, grad_norm=gnorm)
        self.average.update()  # after every epoch took: a failed batch leaves the average as it was
        self.mismatch.merge(measured.take())
        metrics = dict(first)
        metrics["reward_mean"] = float(reward_N.mean())
        metrics["samples"] = float(len(samples))
        metrics["lr"] = self.lr
        if self.routing is not None:  # samples whose routing was replayed, and those trained on the learner's own
            replayed = sum(s.routed_experts is not None for s in samples)
            metrics["routing_replayed"], metrics["routing_missing"] = float(replayed), float(len(samples) - replayed)
        if self.floor_lift != 1.0:
            metrics["entropy_floor"] = floor
        self._last_x = (x, n_tokens, weight)
        if out is not None and self.lcfg.micro_epochs > 1:
            metrics["loss_last"] = out.metrics["loss"]
        return metrics

    @torch.no_grad()
    def _measure_mismatch(
        self, samples: list[TrainingSample], x: dict[str, torch.Tensor], logp_BT: torch.Tensor, sums: MismatchSums
    ) -> None:
        """Add this batch's sampler/trainer mismatch to ``sums`` (``learner.mismatch``): from the loss's own
        forward, under the routing it trains with, and with ``mismatch_measure = "both"`` one no-grad forward under
        the other routing for the samples that carry routing."""
        carried = [
            self.moe is not None and replay.refusal(s, self.moe) is None and s.routed_experts is not None
            for s in samples
        ]
        trained = ["replay" if self.routing is not None and c else "own" for c in carried]
        sums.add(samples, trained, logp_BT, x["beh_BT"], x["mask_BT"])
        if self.lcfg.mismatch_measure != "both" or not any(carried):
            return
        if self.routing is not None:  # trained replayed: the learner's own routing for those samples
            other, shape = samples, None
        else:  # trained on its own: the server's routing, where it decodes for this model
            other = [
                s if c else s.model_copy(update={"routed_experts": None}) for s, c in zip(samples, carried, strict=True)
            ]
            shape = self.moe
        y = collate(other, self.pad_id, self.device, shape)
        logp2_BT, _ = self._token_logp(self.model, y)
        which = [("own" if self.routing is not None else "replay") if c else None for c in carried]
        sums.add(samples, which, logp2_BT, y["beh_BT"], y["mask_BT"])

    @torch.no_grad()
    def _entropy_part(self, x: dict[str, torch.Tensor], n_tokens: int, weight: float, model=None) -> float:
        """This rank's part of the batch's mean per-token entropy under the weights as they are (no gradient);
        ``model``: another transformers model to measure with the same code (``scripts/plateau_sim.py``'s gate)."""
        _, logprobs_BTV = self._token_logp(self.model if model is None else model, x)
        ent_BT = forward.entropy_BT(logprobs_BTV)
        return float((ent_BT * x["mask_BT"]).sum()) / n_tokens * (weight > 0)

    @torch.no_grad()
    def measure_candidate_entropy(self) -> dict[str, float] | None:
        """With averaged candidates (``learner.candidate_ema``): the average's and the weights' mean per-token entropy
        on the last batch (two forward passes, at each candidate), what the gate's collapse check will measure of
        the candidate before it does. An average of the weights is a sharper policy than the weights it averages: in
        the demo's seventh hour the learner's batches sat at its floor (0.09-0.10 nats a token) while its averaged
        candidates measured 0.058-0.073 on the same generations, against the gate's 0.05.

        With ``learner.floor_for_candidate`` and the floor on, it also raises the floor of the next updates by the
        ratio of the two (between 1 and ``FLOOR_LIFT_MAX``), so that the average, not the weights, sits at the floor.
        Returns ``{"entropy", "candidate_entropy", "floor_lift"}``, or None without an average or a batch yet. A
        collective under ranks: the average goes through the same sharded forward as the weights."""
        if self.average.tensors is None or self._last_x is None:
            return None
        x, n_tokens, weight = self._last_x
        h = self._entropy_part(x, n_tokens, weight)
        with self.average.swapped_in():
            h_avg = self._entropy_part(x, n_tokens, weight)
        if self.ranks is not None:
            h, h_avg = all_sum([h, h_avg], self.ranks)
        if self.lcfg.floor_for_candidate and self.lcfg.entropy_floor > 0 and self.lcfg.entropy_coef > 0:
            self.floor_lift = min(FLOOR_LIFT_MAX, max(1.0, h / h_avg)) if h_avg > 0 else FLOOR_LIFT_MAX
        return {"entropy": h, "candidate_entropy": h_avg, "floor_lift": self.floor_lift}

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradient to ``max_norm`` by its global norm (across the shards of every rank); the norm before."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.ranks is None:  # one device, one dtype: torch's own operators without its grouping (half the time)
            grads = [p.grad for p in params]
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # as clip_grads_with_norm_
            return float(total)
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if hasattr(total, "full_tensor"):  # a DTensor: the shards' norms reduced over the group
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # -- weights & state ---------------------------------------------------------------------------
    def weights(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        """The current weights under the file names (the weights convention); bf16 is the served form."""
        if self.ranks is None:
            return state_dict_from_model(self.model, dtype=dtype)

        return state_dict_from_model(self.model, dtype=dtype, module_state=full_state_dict(self.model))

    def bf16_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights(torch.bfloat16)

    # -- the candidates' weights: an exponential moving average of the updates (``learner.average``) ----------
    def reset_ema(self) -> None:
        """The candidates' average restarts at the weights as they are (at the start, a rebase, a load)."""
        self.average.reset()

    def ema_state(self) -> dict[str, torch.Tensor]:
        """The average under the model's in-memory parameter names (this rank's shards); {} when it is off."""
        return self.average.state()

    def load_ema_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back an average saved by ``ema_state`` (a checkpoint); one saved with it off leaves it at the weights."""
        self.average.load_state(state)

    def candidate_weights(self) -> dict[str, torch.Tensor]:
        """What the learner emits as a candidate (file names, bf16, whole on every rank): the exponential moving
        average of its weights over its recent updates (``learner.candidate_ema``), or the weights as they are when
        that is 0. The learner trains on; only what it serves is averaged."""
        if self.average.tensors is None:
            return self.weights(torch.bfloat16)
        return state_dict_from_model(self.model, dtype=torch.bfloat16, module_state=self.average.module_state())

    def load_weights(self, state_dict: dict[str, torch.Tensor], reset_optimizer: bool) -> None:
        """Overwrite the weights in place (file names, any dtype) so the optimizer keeps its parameters; the
        candidates' average restarts at them."""
        assign_weights(self.model, state_dict)
        self.reset_ema()
        if reset_optimizer:
            self.opt = self._adamw(self.lr)

    def _adamw(self, lr: float) -> torch.optim.AdamW:
        """AdamW; in one process (no FSDP2 shards), torch's fused kernel: the same update in one pass over each
        tensor instead of a dozen elementwise ops (``liverl bench learn``: 0.39 against 1.08 ms a step on the demo
        model's 25 tensors, CPU, one thread). Sharded weights keep the default (foreach) implementation."""
        return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0, fused=self.ranks is None or None)

    @property
    def lr(self) -> float:
        """The learning rate the next update uses: ``lcfg.lr`` times the back-off scale."""
        return self.lcfg.lr * self.lr_scale

    def set_lr_scale(self, scale: float) -> None:
        """Train at ``scale`` x ``lcfg.lr`` from the next update on (the optimizer's moments are kept)."""
        self.lr_scale = float(scale)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

    def set_reference(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Move the KL anchor (file names, any dtype): the learner stays near what is served, not only near the base."""
        assign_weights(self.ref, state_dict)

    def state(self) -> dict[str, Any]:
        return {
            "model": self.weights(torch.float32),
            "optimizer": self.opt.state_dict(),
            "baseline": self.baseline.state_dict(),
            "ema": {n: e.detach().clone() for n, e in self.ema_state().items()},
        }

    def load_state(self, st: dict[str, Any]) -> None:
        self.load_weights(st["model"], reset_optimizer=True)
        self.load_ema_state(st.get("ema") or {})
        self.opt.load_state_dict(st["optimizer"])
        self.set_lr_scale(self.lr_scale)  # the configured rate times the scale, not the rate the checkpoint ran at
        self.baseline.load_state_dict(st["baseline"])
