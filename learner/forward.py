"""Which forward the learner's models run through, and the log-probs of a batch's completion tokens under it.

A Qwen3-MoE model in one process goes through ``learner.fastpath`` (the same maths in fewer operator calls;
``learner.fast_forward``); any other model through transformers' forward (``transformers_token_logp``). The batch is
``learner.batch.collate``'s; its ``route``, when it has one, is the routing both forwards replay (``learner.replay``).
Used by ``learner.policy_trainer.PolicyTrainer`` for the policy and the KL reference.
"""

from __future__ import annotations

import torch

from core.config import LearnerConfig
from learner import fastpath, replay


def fast(model, lcfg: LearnerConfig) -> bool:
    """Whether ``model`` runs through ``learner.fastpath`` (``token_logp``; ``describe`` says it)."""
    return lcfg.fast_forward and fastpath.handles(model)


def describe(model, lcfg: LearnerConfig, sharded: bool) -> str:
    """Which forward ``model`` runs through, and why (the learner logs it at start)."""
    if fast(model, lcfg):
        compiled = " under torch.compile (learner.compile: the first update compiles)" if lcfg.compile else ""
        return f"learner/fastpath.py{compiled}"
    if not lcfg.fast_forward:
        why = "learner.fast_forward = false"
    elif sharded:
        why = "FSDP2-sharded: the fast path runs in one process"
    else:
        why = f"{model.config.model_type} in {next(model.parameters()).dtype}: not a layout learner/fastpath.py handles"
    return f"transformers' forward ({why})"


def token_logp(model, x: dict[str, torch.Tensor], lcfg: LearnerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the completion tokens ``logp_BT`` and the full distributions ``logprobs_BTV``, through the
    forward ``fast`` picks."""
    if fast(model, lcfg):
        return fastpath.token_logp(model, x, compiled=lcfg.compile)
    with replay.replaying(model, x.get("route")):
        return transformers_token_logp(model, x)


def transformers_token_logp(model, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logp`` through transformers' forward, as follows.

    Packed rows and no attention mask: transformers reads the restarts of ``position_ids`` as sequence
    boundaries and masks attention across them (``masking_utils.find_packed_sequence_indices``), so each
    sequence sees exactly what it would alone, and no token is spent on padding between them.

    The output head runs at the completion positions only: a pre-hook on it takes the final hidden states
    ``[R, N, H]`` and hands it the ``[B, T, H]`` rows that predict completion tokens. A prompt position's logits
    are never read, and for a real vocabulary (150K) they are most of the head's matrix product and of the
    activations kept for backward (``[R, N, V]`` in fp32). The hook sits inside the model's own forward, so FSDP2
    units gather and free around it as before."""
    head = model.get_output_embeddings()
    picked: list[bool] = []

    def completion_positions(_module, args):
        if len(args) != 1 or args[0].dim() != 3:  # not the call shape this expects: leave it alone
            return None
        picked.append(True)
        return (args[0][x["row_BT"], x["col_BT"]],)

    handle = head.register_forward_pre_hook(completion_positions) if head is not None else None
    try:
        logits = model(input_ids=x["ids_RN"], position_ids=x["posid_RN"], use_cache=False).logits  # a cache
        # turns transformers' detection of packed sequences off
    finally:
        if handle is not None:
            handle.remove()
    logits_BTV = (logits if picked else logits[x["row_BT"], x["col_BT"]]).float()
    logprobs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    logp_BT = torch.gather(logprobs_BTV, 2, x["tgt_BT"][..., None]).squeeze(-1)
    return logp_BT, logprobs_BTV


def entropy_BT(logprobs_BTV: torch.Tensor) -> torch.Tensor:
    """Each position's entropy (nats) of the distributions ``logprobs_BTV``."""
    return -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
