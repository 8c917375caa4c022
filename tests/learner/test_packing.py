"""The learner packs a batch's sequences into rows instead of padding each one (``learner.batch.pack``):
the log-probs it trains on must be those of each sequence alone, in every family liverl handles, with the output
head run at the completion positions only."""

from __future__ import annotations

import random

import pytest
import torch

from core.config import LearnerConfig
from core.schemas import TrainingSample
from learner.batch import pack
from learner.families import FAMILIES
from learner.model import load_model
from learner.policy_trainer import PolicyTrainer
from liverl.testing.models import default_cache, ensure_test_model


def test_pack_puts_every_sequence_in_one_row_no_longer_than_the_longest():
    rng = random.Random(3)
    for _ in range(200):
        lens = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 40))]
        rows = pack(lens)
        assert sorted(i for r in rows for i in r) == list(range(len(lens)))
        assert all(sum(lens[i] for i in r) <= max(lens) for r in rows)
        assert len(rows) <= len(lens)
    assert pack([10, 3, 7, 4, 6]) == [[0], [2, 1], [4, 3]]  # longest first, first fit
    assert pack([]) == []


def _samples(vocab: int, n: int, seed: int) -> list[TrainingSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        long = i % 2 == 0  # long and short ones: some rows hold several sequences
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(20, 30) if long else rng.randrange(2, 6))]
        completion = [rng.randrange(1, vocab) for _ in range(rng.randrange(8, 20) if long else rng.randrange(1, 5))]
        out.append(
            TrainingSample(
                sample_id=f"s{i}",
                generation_id=f"s{i}",
                feedback_id=f"f{i}",
                policy_version=0,
                kind="accept",
                reward=0.75,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                behaviour_logprobs=[-1.0] * len(completion),
                ts_generation=1.7e9,
                ts_feedback=1.7e9,
            )
        )
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_logprobs_are_each_sequence_alone(family):
    model_dir = ensure_test_model(family, default_cache())
    tr = PolicyTrainer(model_dir, LearnerConfig())
    tr.model.eval()  # phimoe's router adds jitter noise in training mode: compare like with like
    samples = _samples(tr.vocab_size, 11, seed=len(family))
    assert len(pack([len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples])) < len(samples)
    seen = []  # the output head's input: the completion positions only, [B, T, H], not every packed position
    handle = tr.model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    got = tr.token_logprobs(samples)
    handle.remove()
    T = max(len(s.completion_token_ids) for s in samples)
    assert [s[:2] for s in seen] == [(len(samples), T)], family
    alone_model = load_model(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for s, lp in zip(samples, got, strict=True):
            ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
            logp = torch.log_softmax(alone_model(input_ids=ids).logits.float()[0], -1)
            P = len(s.prompt_token_ids)
            want = [float(logp[P - 1 + t, tok]) for t, tok in enumerate(s.completion_token_ids)]
            assert max(abs(a - b) for a, b in zip(lp, want, strict=True)) < 1e-4, family
