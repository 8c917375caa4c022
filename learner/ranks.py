"""The learner over N ranks: rank 0 leads, the others follow its trainer calls.

How samples reach the ranks: ONE reader scatters. Rank 0 is the deployment's learner as in one process (the Kafka
consumer, the lease, the ledger, the registry, Redis); every call it makes on its trainer that touches the weights
is broadcast first (``Leader``), and ranks 1..N-1 (``follow``) make the same call with the same arguments, so the
FSDP2 collectives line up. Why not each rank its own partitions:

- the sharded update is one synchronous step over all ranks (FSDP all-gathers each layer, reduce-scatters its
  gradient), so every rank must train the same step at the same time with its share of ONE batch; ranks that read
  their own partitions would still have to agree on each batch's composition, and a rank whose partitions run dry
  would stall the group;
- the exactly-once account stays where it is exact today: one ledger, one set of offsets, one staleness and dedupe
  decision per sample, all checkpointed together with the weights (``learner.dist.CheckpointDir``);
- a batch is small next to the step it feeds: 64 samples of 1k tokens are ~0.5 MB pickled, while the step is a
  forward and backward of the whole model over 64k tokens (``python -m learner.dist_check`` prints both ends).

A follower that dies takes the group down (torchrun ends the others); the restart loads the last complete DCP
checkpoint on every rank and rank 0 seeks Kafka to its offsets.
"""

from __future__ import annotations

import logging
from typing import Any

from learner.dist import CheckpointDir, Ranks, broadcast
from learner.policy_trainer import BatchFailed, PolicyTrainer

log = logging.getLogger("liverl.learner")

# the trainer calls every rank must make together; anything else (refusal, vocab_size...) is rank 0's alone
COLLECTIVE = (
    "train_step",
    "weights",
    "bf16_state_dict",
    "candidate_weights",
    "measure_candidate_entropy",
    "load_weights",
    "set_reference",
    "token_logprobs",
    "set_lr_scale",
)


class Leader:
    """Rank 0's trainer: a ``PolicyTrainer`` whose collective calls are announced to the followers first.

    ``save_checkpoint`` / ``load_checkpoint`` write and read the DCP checkpoints on every rank.
    """

    def __init__(self, trainer: PolicyTrainer, ranks: Ranks, ckpts: CheckpointDir):
        self._trainer, self.ranks, self.ckpts = trainer, ranks, ckpts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._trainer, name)
        if name not in COLLECTIVE:
            return attr

        def call(*args, **kwargs):
            broadcast((name, args, kwargs), self.ranks)
            return attr(*args, **kwargs)

        return call

    def save_checkpoint(self, step: int, extra: dict[str, Any]):
        broadcast(("save", (step,), {}), self.ranks)
        return self.ckpts.save(step, self._trainer.model, self._trainer.opt, extra, ema=self._trainer.ema_state())

    def load_checkpoint(self) -> dict[str, Any] | None:
        broadcast(("load", (), {}), self.ranks)
        return load_checkpoint(self._trainer, self.ckpts)

    def stop(self) -> None:
        broadcast(("stop", (), {}), self.ranks)


def load_checkpoint(trainer: PolicyTrainer, ckpts: CheckpointDir) -> dict[str, Any] | None:
    """The latest complete checkpoint into ``trainer`` on this rank (every rank calls it): the weights, the optimizer
    and the candidates' weight average; one saved without an average starts it at the loaded weights."""
    ema = trainer.ema_state()
    meta = ckpts.load(trainer.model, trainer.opt, ema=ema)
    if meta is not None and not meta["ema_loaded"]:
        trainer.reset_ema()
    return meta


def follow(trainer: PolicyTrainer, ranks: Ranks, ckpts: CheckpointDir) -> int:
    """A follower's life: make rank 0's calls until it says stop; returns how many calls were made."""
    n = 0
    while True:
        name, args, kwargs = broadcast(None, ranks)
        n += 1
        if name == "stop":
            return n
        if name == "save":
            ckpts.save(args[0], trainer.model, trainer.opt, {}, ema=trainer.ema_state())  # rank 0 writes learner.json
        elif name == "load":
            load_checkpoint(trainer, ckpts)
        elif name in COLLECTIVE:
            try:
                getattr(trainer, name)(*args, **kwargs)
            except BatchFailed as e:  # rank 0 fails the same batch (the loss and the norm are the group's)
                log.warning("learner rank %d: batch refused as on rank 0: %s", ranks.rank, e)
        else:
            raise RuntimeError(f"learner rank {ranks.rank}: unknown call {name!r} from rank 0")
