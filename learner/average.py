"""The candidates' weights: an exponential moving average of the policy's parameters over its recent updates.

``learner.candidate_ema`` is the decay (0: off, the candidates are the weights as they are). The average is kept
beside the parameters, shard for shard under FSDP2, and moved only after an update took (``update``). ``swapped_in``
puts it in the parameters' place for a measurement and the weights back after. Used by
``learner.policy_trainer.PolicyTrainer``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from core.config import LearnerConfig
from learner.dist import reshard


class WeightAverage:
    """The average of ``model``'s parameters (``tensors``, in the parameters' order; None when it is off)."""

    def __init__(self, model: torch.nn.Module, lcfg: LearnerConfig):
        self.model, self.lcfg = model, lcfg
        self.tensors: list[torch.Tensor] | None = None
        self.reset()

    @property
    def decay(self) -> float:
        return float(self.lcfg.candidate_ema)

    def reset(self) -> None:
        """The average restarts at the weights as they are (at the start, a rebase, a load)."""
        self.tensors = [p.detach().clone() for p in self.model.parameters()] if self.decay > 0 else None

    @torch.no_grad()
    def update(self) -> None:
        """One step towards the weights as they are (after an update took)."""
        if self.tensors is not None:
            torch._foreach_lerp_(self.tensors, [p.detach() for p in self.model.parameters()], 1.0 - self.decay)

    def state(self) -> dict[str, torch.Tensor]:
        """The average under the model's in-memory parameter names (this rank's shards); {} when it is off."""
        if self.tensors is None:
            return {}
        return {n: e for (n, _), e in zip(self.model.named_parameters(), self.tensors, strict=True)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back an average saved by ``state`` (a checkpoint); one saved with it off leaves it at the weights."""
        self.reset()
        if self.tensors is None or not state:
            return
        names = [n for n, _ in self.model.named_parameters()]
        if set(state) != set(names):
            raise ValueError(f"the checkpoint's weight average has {len(state)} tensors; the model has {len(names)}")
        with torch.no_grad():
            for n, e in zip(names, self.tensors, strict=True):
                e.copy_(state[n])

    def module_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the average in the parameters' place, whole on every rank (a shard is gathered:
        a collective); call only when the average is on."""
        assert self.tensors is not None
        by_param = {id(p): e for p, e in zip(self.model.parameters(), self.tensors, strict=True)}
        module_state = dict(self.model.named_buffers())  # FSDP2 leaves buffers whole on every rank
        for n, p in self.model.named_parameters(remove_duplicate=False):
            e = by_param[id(p)]
            module_state[n] = e.full_tensor() if hasattr(e, "full_tensor") else e  # a shard: gathered (a collective)
        return module_state

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the parameters for the block's duration, the weights put back after; call only when on."""
        assert self.tensors is not None
        reshard(self.model)  # the weights as parameters hold them (FSDP2: the shards), not as the forward gathered them
        params = [p.detach() for p in self.model.parameters()]
        saved = [p.clone() for p in params]
        try:
            with torch.no_grad():
                for p, e in zip(params, self.tensors, strict=True):
                    p.copy_(e)
            yield
        finally:
            reshard(self.model)  # the average's gathered weights go: the next forward gathers the restored shards
            with torch.no_grad():
                for p, w in zip(params, saved, strict=True):
                    p.copy_(w)
