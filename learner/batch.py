"""What the learner's forward pass takes: a sample's input check, and a batch's sequences packed into rows.

``refusal`` is why a record cannot be trained on (the learner applies it before a record may reach a batch);
``pack`` and ``collate`` lay a batch out for the forward pass (``learner.forward``) as numpy arrays handed to torch
once. Used by ``learner.policy_trainer.PolicyTrainer``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from core.schemas import TrainingSample
from learner.replay import MoeShape, layout


def refusal(s: TrainingSample, max_len: int, vocab_size: int) -> str | None:
    """Why this sample cannot be trained on by a model of ``max_len`` positions and ``vocab_size`` tokens (a short
    countable code), or None when it can."""
    c, lp = s.completion_token_ids, s.behaviour_logprobs
    if not c:
        return "empty_completion"
    if not s.prompt_token_ids:
        return "empty_prompt"
    if len(c) != len(lp):
        return "shape_mismatch"
    if len(c) + len(s.prompt_token_ids) > max_len:
        return "too_long"
    if any(not 0 <= t < vocab_size for t in s.prompt_token_ids) or any(not 0 <= t < vocab_size for t in c):
        return "out_of_vocab"
    if any(not math.isfinite(x) or x > 1e-3 for x in lp):
        return "bad_logprob"
    if not math.isfinite(s.reward):
        return "bad_reward"
    return None


def pack(lengths: list[int]) -> list[list[int]]:
    """Sequences packed into rows as long as the longest one: first fit, longest first. Returns each row's sample
    indices in order. A batch of mixed lengths then runs on fewer, fuller rows than one padded row per sample (the
    matrix products scale with the rows times their length; measured on ``liverl bench learn``'s batches, 32-37% of a
    padded batch was padding), and no row is longer than the padded batch's, so attention costs no more either."""
    cap = max(lengths, default=0)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(cap - lengths[i])
    return rows


def collate(
    samples: list[TrainingSample], pad_id: int, device: torch.device, routing: MoeShape | None = None
) -> dict[str, torch.Tensor]:
    """The batch as the forward pass takes it: the sequences (prompt + completion) packed into rows (``pack``),
    and per sample its completion's targets, mask, behaviour log-probs and where each completion token's logits
    sit in the packed rows (``row_BT``, ``col_BT``: the position before the token). A sample's padding entries
    (past its completion, masked out) point at its own last completion position: all of a sample's entries lie
    in its own row, which ``learner.fastpath`` relies on.

    ``routing`` (the model's ``learner.replay.MoeShape`` when it replays): the samples' routing laid out the same
    way, as ``route`` (``learner.replay.layout``), when any sample carries some."""
    B = len(samples)
    lens = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    rows = pack(lens)
    N = max(lens)
    T = max(len(s.completion_token_ids) for s in samples)
    # built in numpy and handed to torch once: a torch op per sample and field was most of a small model's update
    ids_RN = np.full((len(rows), N), pad_id, dtype=np.int64)
    posid_RN = np.zeros((len(rows), N), dtype=np.int64)
    row_BT = np.zeros((B, T), dtype=np.int64)
    col_BT = np.zeros((B, T), dtype=np.int64)
    tgt_BT = np.zeros((B, T), dtype=np.int64)
    mask_BT = np.zeros((B, T), dtype=np.float32)
    beh_BT = np.zeros((B, T), dtype=np.float32)
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            s = samples[b]
            P, C = len(s.prompt_token_ids), len(s.completion_token_ids)
            ids_RN[r, at : at + P] = s.prompt_token_ids
            ids_RN[r, at + P : at + P + C] = s.completion_token_ids
            posid_RN[r, at : at + P + C] = np.arange(P + C)  # restarts: each sequence attends only to itself
            row_BT[b] = r
            col_BT[b, :C] = np.arange(at + P - 1, at + P + C - 1)  # logits at position i predict token i+1
            col_BT[b, C:] = at + P + C - 2  # padding (masked): the sample's last completion position again
            tgt_BT[b, :C] = s.completion_token_ids
            mask_BT[b, :C] = 1.0
            beh_BT[b, :C] = s.behaviour_logprobs
            at += P + C
        posid_RN[r, at:] = np.arange(N - at)  # the row's padding: a sequence of its own, never read
    ids_RN, posid_RN, row_BT, col_BT, tgt_BT, mask_BT, beh_BT = map(
        torch.from_numpy, (ids_RN, posid_RN, row_BT, col_BT, tgt_BT, mask_BT, beh_BT)
    )
    reward_B = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    x = {
        "ids_RN": ids_RN,
        "posid_RN": posid_RN,
        "row_BT": row_BT,
        "col_BT": col_BT,
        "tgt_BT": tgt_BT,
        "mask_BT": mask_BT,
        "beh_BT": beh_BT,
        "reward_B": reward_B,
    }
    route = None if routing is None else layout(samples, rows, N, routing)
    if route is not None:
        x["route"] = route if device.type == "cpu" else tuple(t.to(device, non_blocking=True) for t in route)
    if device.type == "cpu":
        return x
    return {k: v if k == "route" else v.to(device, non_blocking=True) for k, v in x.items()}


def padded_tokens(samples: list[TrainingSample]) -> int:
    """The tokens a batch of ``samples`` takes in the forward pass once packed (what its activations scale with)."""
    lens = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    return len(pack(lens)) * max(lens, default=0)
