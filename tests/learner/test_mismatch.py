"""The sampler/trainer mismatch the learner measures per version (``learner.mismatch``, ``learner.mismatch_measure``):
from the loss's own forward and, for samples that carry routing, one no-grad forward under the other routing; a
known offset between the behaviour log-probs and the learner's comes out as that offset and its k3 KL. Tiny models,
a few seconds each."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core import routing
from core.config import LearnerConfig
from learner import replay, replay_own
from learner.dist_check import make_samples, on_policy
from learner.policy_trainer import PolicyTrainer
from liverl.testing.models import default_cache, ensure_test_model


def _trainer(family: str, **kw) -> PolicyTrainer:
    return PolicyTrainer(ensure_test_model(family, default_cache()), LearnerConfig(**kw))


def _versioned(samples, versions=(3, 3, 4, 4)):
    return [s.model_copy(update={"policy_version": versions[i % len(versions)]}) for i, s in enumerate(samples)]


def _tokens(samples, version, which=lambda s: True) -> int:
    return sum(len(s.completion_token_ids) for s in samples if s.policy_version == version and which(s))


def _random_routing(s, shape: replay.MoeShape, rng) -> str:
    r = np.argsort(rng.random((replay.positions(s), shape.layers, shape.n_experts)), -1)[..., : shape.top_k]
    return routing.to_text(routing.encode(r, shape.n_experts))


def test_a_known_offset_is_measured_per_version_with_its_k3_kl():
    tr = _trainer("qwen3_moe", mismatch_measure="trained")
    samples = _versioned(on_policy(tr, make_samples(8, 0, tr.vocab_size, (2, 12), (2, 8))))
    shifted = [s.model_copy(update={"behaviour_logprobs": [x - 0.1 for x in s.behaviour_logprobs]}) for s in samples]
    tr.train_step(shifted)
    got = tr.mismatch.take()
    assert sorted(got) == [3, 4] and not tr.mismatch  # taken: forgotten
    for v in (3, 4):
        n = _tokens(samples, v)
        assert got[v]["own_tokens"] == n and "replay_tokens" not in got[v]  # no routing carried, nothing replayed
        assert got[v]["own_abs"] / n == pytest.approx(0.1, abs=1e-4)
        assert got[v]["own_kl"] / n == pytest.approx(math.exp(0.1) - 1 - 0.1, rel=1e-3)


def test_both_routings_are_measured_whichever_the_learner_trains_with():
    for mode in ("off", "rollout"):
        tr = _trainer("qwen3_moe", routing_replay=mode, mismatch_measure="both")
        shape = replay.moe_shape(tr.model)
        samples = _versioned(on_policy(tr, make_samples(8, 1, tr.vocab_size, (2, 12), (2, 8))))
        rng = np.random.default_rng(0)
        # every other sample carries routing that is not the learner's: it moves its log-probs under replay only
        foreign = [s.model_copy(update={"routed_experts": _random_routing(s, shape, rng)}) if i % 2 == 0 else s
                   for i, s in enumerate(samples)]  # fmt: skip
        tr.train_step(foreign)
        got = tr.mismatch.take()
        for v in (3, 4):
            carried = _tokens(foreign, v, lambda s: s.routed_experts is not None)
            assert got[v]["own_tokens"] == _tokens(foreign, v)  # the loss's forward or the extra one: every sample
            assert got[v]["replay_tokens"] == carried
            assert got[v]["own_abs"] / got[v]["own_tokens"] < 1e-4  # on-policy under its own routing
            assert got[v]["replay_abs"] / carried > 1e-3  # the random experts' log-probs are not the behaviour's


def test_the_servers_own_routing_replayed_reproduces_the_behaviour_and_a_dense_model_has_one_routing():
    tr = _trainer("qwen3_moe", routing_replay="rollout", mismatch_measure="both")
    samples = _versioned(on_policy(tr, make_samples(6, 2, tr.vocab_size, (2, 12), (2, 8))))
    own = [s.model_copy(update={"routed_experts": t}) for s, t in zip(samples, replay_own.routing_of(tr.model,
           samples, tr.pad_id), strict=True)]  # fmt: skip
    tr.train_step(own)
    got = tr.mismatch.take()
    for v in (3, 4):
        assert got[v]["replay_tokens"] == got[v]["own_tokens"] == _tokens(samples, v)
        assert got[v]["replay_abs"] / got[v]["replay_tokens"] < 1e-4 and got[v]["own_abs"] / _tokens(samples, v) < 1e-4
    dense = _trainer("qwen3", mismatch_measure="both")
    samples = _versioned(on_policy(dense, make_samples(4, 3, dense.vocab_size, (2, 12), (2, 8))))
    dense.train_step(samples)
    assert all(set(row) == {"own_tokens", "own_abs", "own_kl"} for row in dense.mismatch.take().values())
    off = _trainer("qwen3", mismatch_measure="off")
    off.train_step(samples)
    assert not off.mismatch
