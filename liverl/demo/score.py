"""Held-out evaluation: the policy's exact acceptance rate, without sampling noise.

Why exact: the release gate compares a candidate with the stable version on a few hundred prompts;
a sampled estimate would have a standard error of ~3 points there, larger than the regressions it must
catch. Because users accept only specific completions, the probability that a sampled completion is
accepted is exactly ``sum over accepted completions c of p(c | prompt)`` at the product's temperature,
and ``p(c | prompt) = exp(sum of c's token log-probs)`` (EOS included), which one teacher-forced forward
pass gives for every prompt at once. Greedy acceptance follows from the same pass: greedy decoding
returns an accepted completion exactly when every one of its tokens is the argmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from learner.model import load_model
from liverl.demo import task
from liverl.demo.vocab import EOS_ID, VOCAB, encode_text, sft_batch


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def score_model(model, prompts: list[task.TaskPrompt]) -> dict:
    """Exact expected acceptance, greedy acceptance and first-token entropy of ``model`` on ``prompts``.

    ``model`` is a transformers causal LM over the ``liverl.demo.base_policy`` tokenizer (any dtype). Returns
    ``{"expected_acceptance", "greedy_acceptance", "entropy", "n_prompts", "per_segment": {seg: {...}}}``.
    """
    if not prompts:
        raise ValueError("score_model needs at least one prompt")
    rows_p, rows_c, owner = [], [], []
    for i, p in enumerate(prompts):
        for c in task.accepted_completions(p):
            rows_p.append(p)
            rows_c.append(c)
            owner.append(i)
    ids_BT, labels_BT, mask_BT = sft_batch(rows_p, rows_c)
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT).logits.float() / task.TEMPERATURE
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1], dim=-1)  # position t predicts token t+1
    tgt_BT = labels_BT[:, 1:]
    on_BT = tgt_BT != -100
    tok_logp_BT = logp_BTV.gather(-1, tgt_BT.clamp(min=0).unsqueeze(-1)).squeeze(-1) * on_BT
    seq_p_B = tok_logp_BT.sum(-1).exp()
    greedy_ok_B = ((logp_BTV.argmax(-1) == tgt_BT) | ~on_BT).all(-1)

    # entropy of the first completion token: the position just before the first labelled token
    first_B = on_BT.float().argmax(-1)
    first_logp_BV = logp_BTV[torch.arange(len(first_B)), first_B]
    ent_B = -(first_logp_BV.exp() * first_logp_BV).sum(-1)

    owner_B = torch.tensor(owner)
    n = len(prompts)
    exp_acc_N = torch.zeros(n).index_add_(0, owner_B, seq_p_B)
    greedy_N = torch.zeros(n).index_add_(0, owner_B, greedy_ok_B.float()).clamp(max=1.0)
    ent_N = torch.zeros(n).index_add_(0, owner_B, ent_B) / torch.bincount(owner_B, minlength=n).float()

    def summary(idx: list[int]) -> dict:
        sel = torch.tensor(idx)
        return {
            "expected_acceptance": float(exp_acc_N[sel].mean()),
            "greedy_acceptance": float(greedy_N[sel].mean()),
            "entropy": float(ent_N[sel].mean()),
            "n_prompts": len(idx),
        }

    out = summary(list(range(n)))
    out["per_segment"] = {
        seg: summary(idx) for seg in task.SEGMENTS if (idx := [i for i, p in enumerate(prompts) if p.segment == seg])
    }
    return out


def heldout_score(model_dir: Path, state_dict: dict | None, n_prompts: int = 256) -> dict:
    """Score the weights ``state_dict`` (file names, any dtype; None: the dir's own) on the held-out prompts.

    Computed in float32 from the given weights (bf16 weights are scored as they are served). Keys:
    ``expected_acceptance`` (exact P(accept) under sampling at ``task.TEMPERATURE``), ``greedy_acceptance``,
    ``entropy`` (mean entropy in nats of the first completion token), ``n_prompts`` and ``per_segment``.
    """
    if n_prompts <= 0:
        raise ValueError(f"n_prompts must be positive, got {n_prompts}")
    with _one_thread():
        model = load_model(Path(model_dir), state_dict)
        return score_model(model, task.heldout_prompts(n_prompts))


def sample_completions(model, prompts: list[task.TaskPrompt], seed: int = 0) -> list[tuple[list[int], str | None]]:
    """Sample one completion per prompt at ``task.TEMPERATURE`` with at most ``task.MAX_TOKENS`` tokens.

    Returns ``(completion_token_ids, text)`` per prompt: the ids include the final EOS when one was
    sampled; ``text`` is the decoded completion without EOS, or None when the budget ran out first (such
    a completion is never accepted). For tests and offline checks; production sampling is vLLM's.
    """
    gen = torch.Generator().manual_seed(seed)
    ids_BT = torch.tensor([encode_text(p.text) for p in prompts])  # all prompts have the same length
    done_B = torch.zeros(len(prompts), dtype=torch.bool)
    new = []
    with torch.no_grad():
        for _ in range(task.MAX_TOKENS):
            logits_BV = model(input_ids=ids_BT).logits[:, -1].float() / task.TEMPERATURE
            nxt_B = torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=gen)[:, 0]
            nxt_B = torch.where(done_B, torch.full_like(nxt_B, EOS_ID), nxt_B)
            new.append(nxt_B)
            done_B |= nxt_B == EOS_ID
            ids_BT = torch.cat([ids_BT, nxt_B[:, None]], dim=1)
            if bool(done_B.all()):
                break
    out = []
    for i in range(len(prompts)):
        toks = [int(t[i]) for t in new]
        if EOS_ID in toks:
            toks = toks[: toks.index(EOS_ID) + 1]
            out.append((toks, "".join(VOCAB[t] for t in toks[:-1])))
        else:
            out.append((toks, None))
    return out
