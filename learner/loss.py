"""The learner's objective: off-policy-corrected policy gradient on live accept/reject rewards.

Estimator (per batch of B sequences, T completion tokens each, padded; ``mask_BT`` marks real tokens):

    log-ratio      d_BT   = logp_new_BT - logp_behaviour_BT       (behaviour = logprobs recorded at serving)
    ratio          r_BT   = exp(d_BT)
    TIS weight     w_BT   = min(r_BT, C).detach()                 (C = cfg.learner.tis_cap)
    masked IS      keep_B = lo <= exp(mean_t d_BT) <= hi          (geometric-mean sequence ratio)
    advantage      A_B    = reward_B - baseline_B  [ / (std(reward) + eps) when normalising ]
    PG loss        L_pg   = - sum_BT(keep_B * mask_BT * w_BT * A_B * logp_new_BT) / sum_BT(mask_BT)
    KL penalty     k3_BT  = exp(logp_ref_BT - logp_new_BT) - (logp_ref_BT - logp_new_BT) - 1     ("k3"), or
                   kl_BT  = sum_v pi_new(v) (log pi_new(v) - log pi_ref(v))  at each position   ("full")
                   L_kl   = kl_coef * sum_BT(mask_BT * k3_BT or kl_BT) / sum_BT(mask_BT)
    entropy floor  H      = sum_BT(mask_BT * H_BT) / sum_BT(mask_BT)                  (H_BT: per-position entropy)
                   L_H    = entropy_coef * max(0, entropy_floor - H)                  (0 while H is above the floor)
    loss           L      = L_pg + L_kl + L_H

Why this shape:

- The behaviour log-probs differ from the learner's even for the same weights (vLLM in bf16 with its
  own kernels vs an fp32 learner; Yao et al.), and samples arrive from versions several steps behind
  the learner (async RL). ``w * grad(logp_new)`` with ``w = pi/mu`` is the importance-sampled REINFORCE
  gradient under samples from ``mu``; truncating ``w`` at ``C`` bounds its variance (a slightly biased,
  always-finite estimator), and dropping sequences whose ratio leaves ``[lo, hi]`` removes samples that
  are too off-policy to be trusted at all (masked IS). The sequence ratio is a geometric mean so that its
  scale does not depend on the completion length. Masked sequences still count in the token
  denominator: they contribute zero, they do not re-weight the rest.
- Baseline: the caller supplies ``baseline_B`` (see ``advantages``): by default the leave-one-out mean
  reward of the other samples of the same segment in the batch (RLOO: unbiased, and a segment whose
  users accept everything gets no push), falling back to a running per-segment mean when a segment has
  a single sample in the batch. Rewards are +0.75 / -0.25 (Cursor Tab), so the raw advantage is already
  O(1); normalising by the batch std is optional because it amplifies noise once the policy is good.
- KL to the frozen base policy keeps the policy from collapsing onto one completion (the field notes
  show plain REINFORCE collapsing to 0% after a peak). Two estimators, both exactly 0 at the reference:
  ``k3`` on the sampled tokens (Schulman's non-negative estimator, as in GRPO) and ``full``, the exact
  per-position KL(pi || ref) summed over the vocabulary at the positions the samples visit. Used as a
  loss, k3 differentiates to the gradient of KL(ref || pi) with a per-token weight pi_ref/pi that
  explodes on the rare sampled token the policy has learned to avoid: on the demo task its per-batch
  value spiked to 10^3-10^4 (the global grad-norm clip then hands that one token the whole update),
  while ``full`` stayed below 0.35 with the same lift. ``full`` is exact, bounded per position and cheap
  for a small vocabulary, and its value is a readable live metric, so the learner uses it by default;
  ``k3`` stays available for large vocabularies.
- The entropy floor: the KL to the base does not hold a policy that has moved far from it. In hour-long demo runs,
  past ~85% kept acceptance the lineage's mean per-token entropy fell under the gate's collapse floor
  (``gate.min_entropy``) within minutes, and the gate refused every candidate for collapse (14 in a row, 403 s, in
  one run). The hinge pushes the entropy up only once it is under ``learner.entropy_floor`` (above the gate's
  floor), so the learner stops proposing what the gate will refuse, and does nothing to a policy above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_MASK_LO: float = 0.5
"""Masked IS lower bound on the geometric-mean sequence ratio pi/mu."""
DEFAULT_MASK_HI: float = 2.0
"""Masked IS upper bound on the geometric-mean sequence ratio pi/mu."""


@dataclass
class LossOutput:
    """The scalar to minimise plus what the learner logs."""

    loss: torch.Tensor
    metrics: dict[str, float]


MAX_SEGMENTS = 1024
"""The most segments ``RunningBaseline`` keeps a mean for: ``segment`` is the product's to choose (any string of up to
64 characters), so the baseline, which every checkpoint saves, must not grow with whatever it sends."""


class RunningBaseline:
    """Exponential moving average of the reward per segment (the fallback baseline).

    At most ``max_segments`` segments get a mean of their own, the first ones seen; every later segment shares one
    overflow mean. Stored in the learner checkpoint (``state_dict``/``load_state_dict``) so a restart keeps it.
    """

    def __init__(self, decay: float = 0.9, init: float = 0.0, max_segments: int = MAX_SEGMENTS):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        self.decay = decay
        self.init = init
        self.max_segments = max_segments
        self.means: dict[str, float] = {}
        self.overflow: float | None = None  # the shared mean of the segments past max_segments

    def _own(self, segment: str | None) -> str | None:
        """The segment's key in ``means``, or None when it shares the overflow mean."""
        key = segment or ""
        return key if key in self.means or len(self.means) < self.max_segments else None

    def get(self, segment: str | None) -> float:
        key = self._own(segment)
        if key is None:
            return self.init if self.overflow is None else self.overflow
        return self.means.get(key, self.init)

    def _ema(self, old: float | None, mean_reward: float) -> float:
        return mean_reward if old is None else self.decay * old + (1.0 - self.decay) * mean_reward

    def update(self, segment: str | None, mean_reward: float) -> None:
        key = self._own(segment)
        if key is None:
            self.overflow = self._ema(self.overflow, mean_reward)
        else:
            self.means[key] = self._ema(self.means.get(key), mean_reward)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "init": self.init, "means": dict(self.means), "overflow": self.overflow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.init = float(state["init"])
        means = [(str(k), float(v)) for k, v in state["means"].items()]
        self.means = dict(means[: self.max_segments])
        overflow = state.get("overflow")  # absent from a checkpoint of a release without the cap
        self.overflow = None if overflow is None else float(overflow)


def advantages(
    reward_B: torch.Tensor,
    segments: Sequence[str | None],
    running: RunningBaseline | None = None,
    normalize: bool = False,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Sequence advantages ``A_B = reward_B - baseline_B`` (see the module docstring).

    Baseline per sample: the mean reward of the OTHER samples of its segment in this batch when there
    is at least one, else ``running.get(segment)`` (or the leave-one-out batch mean without ``running``).
    ``running`` is updated with this batch's per-segment means afterwards.
    """
    if reward_B.ndim != 1 or reward_B.shape[0] != len(segments):
        raise ValueError(
            f"reward_B must be 1-D with one reward per segment entry, got "
            f"{tuple(reward_B.shape)} for {len(segments)} segments"
        )
    # O(batch) host-side arithmetic in numpy (float64): as torch operators, a few per segment, it was ~3% of a small
    # model's update
    r_B = reward_B.detach().cpu().double().numpy()
    if not np.isfinite(r_B).all():
        raise ValueError("rewards must be finite")
    B = r_B.shape[0]
    baseline_B = np.zeros(B, dtype=np.float64)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(segments):
        groups.setdefault(s or "", []).append(i)
    total = r_B.sum()
    for seg, idx in groups.items():
        r_G = r_B[idx]
        n = len(idx)
        if n >= 2:
            baseline_B[idx] = (r_G.sum() - r_G) / (n - 1)
        elif running is not None:
            baseline_B[idx] = running.get(seg)
        elif B >= 2:
            baseline_B[idx] = (total - r_G) / (B - 1)
    if running is not None:
        for seg, idx in groups.items():
            running.update(seg, float(r_B[idx].mean()))
    adv_B = r_B - baseline_B
    if normalize and B >= 2:
        adv_B = adv_B / (r_B.std(ddof=1) + eps)
    return torch.from_numpy(adv_B).float()


def pg_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    tis_cap: float,
    ref_logp_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    mask_lo: float = DEFAULT_MASK_LO,
    mask_hi: float = DEFAULT_MASK_HI,
    kl_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    n_tokens: float | None = None,
    entropy_floor: float = 0.0,
    entropy_coef: float = 0.0,
    batch_entropy: float | None = None,
) -> LossOutput:
    """The loss of the module docstring and its metrics.

    ``logp_BT`` (learner, with grad), ``behaviour_logp_BT`` (serving) and ``ref_logp_BT`` (frozen base)
    are the log-probs of the sampled completion tokens; ``mask_BT`` is 1 on real tokens, 0 on padding.
    ``kl_BT`` (with grad, see ``full_kl``) replaces the k3 estimate from ``ref_logp_BT`` when given.
    ``entropy_BT``: the per-position entropy; reported, and with ``entropy_coef`` > 0 (then it needs its grad) the
    hinge ``entropy_coef * max(0, entropy_floor - H)`` on the batch's mean ``H``. ``batch_entropy``: the whole batch's
    mean when this call holds one rank's share (it decides whether the hinge acts); default: this call's own.
    ``n_tokens``: the denominator of the token means, when this call holds one rank's share of a batch spread over
    ranks (``learner.dist``): the whole batch's completion tokens. Default: this call's own tokens. The loss, ``kl``
    and ``entropy`` are then this share's part of the batch's value (their sum over ranks is the value).
    """
    if logp_BT.shape != behaviour_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp_BT.shape)}, behaviour "
            f"{tuple(behaviour_logp_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    if logp_BT.ndim != 2 or adv_B.shape != (logp_BT.shape[0],):
        raise ValueError(f"expected logp [B, T] and adv [B], got {tuple(logp_BT.shape)} and {tuple(adv_B.shape)}")
    if ref_logp_BT is not None and ref_logp_BT.shape != logp_BT.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp_BT.shape)} != logp shape {tuple(logp_BT.shape)}")
    if not tis_cap > 0 or not 0 < mask_lo <= 1 <= mask_hi:
        raise ValueError(f"need tis_cap > 0 and 0 < mask_lo <= 1 <= mask_hi, got {tis_cap}, {mask_lo}, {mask_hi}")
    mask_BT = mask_BT.to(logp_BT.dtype)
    len_B = mask_BT.sum(1)
    if (len_B <= 0).any():
        raise ValueError("every sequence needs at least one completion token")
    n_tokens = (
        mask_BT.sum() if n_tokens is None else torch.tensor(float(n_tokens), dtype=logp_BT.dtype, device=logp_BT.device)
    )

    with torch.no_grad():
        # Clamped only to keep exp() finite; w is capped at C and such sequences are masked anyway.
        logratio_BT = ((logp_BT - behaviour_logp_BT) * mask_BT).clamp(-20.0, 20.0)
        ratio_BT = torch.exp(logratio_BT)
        w_BT = torch.clamp(ratio_BT, max=tis_cap)
        seq_ratio_B = torch.exp(logratio_BT.sum(1) / len_B)
        keep_B = ((seq_ratio_B >= mask_lo) & (seq_ratio_B <= mask_hi)).to(logp_BT.dtype)
        keep_BT = keep_B[:, None] * mask_BT

    pg_BT = -(w_BT * adv_B[:, None].to(logp_BT.dtype) * logp_BT)
    loss_pg = (pg_BT * keep_BT).sum() / n_tokens
    loss = loss_pg
    kl = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
    if kl_BT is not None:
        if kl_BT.shape != logp_BT.shape:
            raise ValueError(f"kl_BT shape {tuple(kl_BT.shape)} != logp shape {tuple(logp_BT.shape)}")
        kl = (kl_BT * mask_BT).sum() / n_tokens
    elif ref_logp_BT is not None:
        d_BT = (ref_logp_BT.detach() - logp_BT) * mask_BT
        k3_BT = torch.exp(d_BT) - d_BT - 1.0
        kl = (k3_BT * mask_BT).sum() / n_tokens
    if kl_coef:
        loss = loss + kl_coef * kl
    floor_gap = 0.0
    if entropy_coef and entropy_BT is not None:
        h_part = (entropy_BT * mask_BT).sum() / n_tokens  # this call's part of the batch's mean
        h = float(h_part.detach()) if batch_entropy is None else batch_entropy
        floor_gap = max(0.0, entropy_floor - h)
        if floor_gap > 0:  # d/dh of coef * (floor - h_total) is -coef on every rank's part
            loss = loss - entropy_coef * h_part

    with torch.no_grad():  # the metrics as one tensor, read back once (one host sync, not a dozen)
        m = mask_BT.bool()
        ratio_m = ratio_BT[m]
        adv_B = adv_B.to(logp_BT.dtype)
        names = ["loss", "loss_pg", "kl", "ratio_mean", "ratio_max", "clipped_frac", "masked_frac", "masked_seqs"]
        names += ["adv_mean", "adv_std", "adv_abs_mean", "tokens"]
        values = [loss.detach(), loss_pg.detach(), kl.detach(), ratio_m.mean(), ratio_m.max()]
        values += [(ratio_m > tis_cap).to(logp_BT.dtype).mean(), 1.0 - keep_B.mean(), (1.0 - keep_B).sum()]
        values += [adv_B.mean(), adv_B.std() if adv_B.numel() > 1 else adv_B.new_zeros(()), adv_B.abs().mean()]
        values += [n_tokens]
        if entropy_BT is not None:
            names.append("entropy")
            values.append((entropy_BT.detach() * mask_BT).sum() / n_tokens)
        metrics = dict(zip(names, torch.stack([v.to(logp_BT.dtype) for v in values]).tolist(), strict=True))
        if entropy_coef:
            metrics["entropy_floor_gap"] = floor_gap
    return LossOutput(loss=loss, metrics=metrics)


def full_kl(logprobs_BTV: torch.Tensor, ref_logprobs_BTV: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || ref) over the vocabulary at each position: ``kl_BT`` (differentiable in ``logprobs``)."""
    if logprobs_BTV.shape != ref_logprobs_BTV.shape:
        raise ValueError(f"logprobs {tuple(logprobs_BTV.shape)} and ref {tuple(ref_logprobs_BTV.shape)} differ")
    return (logprobs_BTV.exp() * (logprobs_BTV - ref_logprobs_BTV.detach())).sum(-1)
