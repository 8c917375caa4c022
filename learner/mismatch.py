"""The sampler/trainer mismatch of each version, measured on the samples the learner trains on.

Every sampled token carries the log-prob the server's sampler gave it (``behaviour_logprobs``, the behaviour
policy); the learner recomputes it in its forward. Per token, with ``d = logp_learner - logp_behaviour``:

- ``|d|``, the absolute log-prob difference;
- ``exp(d) - 1 - d``, the k3 estimate of KL(behaviour || learner) (Schulman's: unbiased for tokens sampled from the
  behaviour policy, never negative).

Both are summed per ``policy_version`` of the samples, under two routings of an MoE model: the learner's own
(``own``) and the server's replayed (``replay``: only samples that carry routing, ``learner.replay``). The forward
the loss runs gives one of the two for free (its first epoch, before any step); ``learner.mismatch_measure =
"both"`` adds one no-grad forward for the other, on the samples that carry routing. Dense models have one routing:
``own`` only. The learner reports the sums to the registry (``Registry.add_mismatch``), which the gate bounds
(``gate.max_logprob_mismatch``).

What it measures besides the kernels: the learner's weights when it trains are the version's plus the updates made
since (at most ``learner.max_staleness`` candidates' worth), so both columns include the policy's own movement; the
difference between them is the routing's.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from core.schemas import TrainingSample


def token_terms(
    logp_BT: torch.Tensor, beh_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[list[float], list[float], list[int]]:
    """Per sample of the batch: the sum of ``|d|``, the sum of the k3 terms, and its tokens (``mask_BT``)."""
    d_BT = (logp_BT.detach().float() - beh_BT.float()) * mask_BT
    k3_BT = (torch.expm1(d_BT) - d_BT) * mask_BT
    return d_BT.abs().sum(1).tolist(), k3_BT.sum(1).tolist(), mask_BT.sum(1).long().tolist()


class MismatchSums:
    """Version -> the ``Registry.add_mismatch`` sums (``own_tokens``, ``own_abs``, ``own_kl``, ``replay_*``)."""

    def __init__(self):
        self.sums: defaultdict[int, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(
        self,
        samples: list[TrainingSample],
        which: list[str | None],
        logp_BT: torch.Tensor,
        beh_BT: torch.Tensor,
        mask_BT: torch.Tensor,
    ) -> None:
        """Add each sample ``b``'s terms under ``which[b]`` (``"own"``, ``"replay"``, or None: not this forward's)."""
        abs_B, kl_B, n_B = token_terms(logp_BT, beh_BT, mask_BT)
        for b, s in enumerate(samples):
            mode = which[b]
            if mode is None or n_B[b] == 0:
                continue
            row = self.sums[int(s.policy_version)]
            row[f"{mode}_tokens"] += n_B[b]
            row[f"{mode}_abs"] += abs_B[b]
            row[f"{mode}_kl"] += kl_B[b]

    def merge(self, other: dict[int, dict[str, float]]) -> None:
        for v, row in other.items():
            for k, x in row.items():
                self.sums[v][k] += x

    def take(self) -> dict[int, dict[str, float]]:
        """The sums so far, forgotten here."""
        out = {v: dict(row) for v, row in self.sums.items()}
        self.sums.clear()
        return out

    def __bool__(self) -> bool:
        return bool(self.sums)
