"""The candidates' weight average (``learner.candidate_ema``): what the learner emits is the exponential moving average
of its weights over its updates, restarted at a rebase, left alone by a failed batch, and carried by its checkpoints
(one file here; DCP in ``tests/learner/test_dist.py``). Without it, a candidate is the weights as they are."""

from __future__ import annotations

import pytest
import torch

from .test_trainer import base_samples, model_dir  # noqa: F401 -- fixtures


def trainer(model_dir, ema: float):  # noqa: F811
    from learner.policy_trainer import PolicyTrainer
    from liverl.core.config import LearnerConfig

    return PolicyTrainer(model_dir, LearnerConfig(lr=1e-3, candidate_ema=ema))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_candidate_is_the_average_of_the_weights_after_each_update(model_dir, base_samples):  # noqa: F811
    tr = trainer(model_dir, 0.5)
    avg = tr.weights(torch.float32)
    assert same(tr.candidate_weights(), {k: v.to(torch.bfloat16) for k, v in avg.items()})  # starts at the weights
    for i in range(3):
        tr.train_step(base_samples[16 * i : 16 * (i + 1)])
        now = tr.weights(torch.float32)
        avg = {k: torch.lerp(avg[k], now[k], 0.5) for k in avg}
    cand = tr.candidate_weights()
    assert same(cand, {k: v.to(torch.bfloat16) for k, v in avg.items()})
    assert not same(cand, tr.bf16_state_dict())  # not the last update's weights

    plain = trainer(model_dir, 0.0)
    plain.train_step(base_samples[:16])
    assert same(plain.candidate_weights(), plain.bf16_state_dict())  # off: the weights as they are


def test_a_failed_batch_leaves_the_average_and_a_rebase_restarts_it(model_dir, base_samples):  # noqa: F811
    from learner.policy_trainer import BatchFailed

    tr = trainer(model_dir, 0.9)
    tr.train_step(base_samples[:16])
    before = tr.candidate_weights()
    real = tr._token_logp
    tr._token_logp = lambda model, x: (lambda lp: (lp[0] * float("nan"), lp[1]))(real(model, x))
    with pytest.raises(BatchFailed, match="nonfinite_update"):
        tr.train_step(base_samples[16:32])
    tr._token_logp = real
    assert same(tr.candidate_weights(), before)

    stable = trainer(model_dir, 0.0).bf16_state_dict()  # the base: what a rebase onto version 0 loads
    tr.load_weights(stable, reset_optimizer=True)
    assert same(tr.candidate_weights(), stable)


def test_the_checkpoint_carries_the_average(model_dir, base_samples):  # noqa: F811
    tr = trainer(model_dir, 0.9)
    for i in range(2):
        tr.train_step(base_samples[16 * i : 16 * (i + 1)])
    st = tr.state()
    resumed = trainer(model_dir, 0.9)
    resumed.load_state(st)
    assert same(resumed.candidate_weights(), tr.candidate_weights())
    assert same(resumed.bf16_state_dict(), tr.bf16_state_dict())

    old = {k: v for k, v in st.items() if k != "ema"}  # a checkpoint from before the average: it starts at its weights
    older = trainer(model_dir, 0.9)
    older.load_state(old)
    assert same(older.candidate_weights(), tr.bf16_state_dict())

    wrong = dict(st, ema=dict(list(st["ema"].items())[:-1]))
    with pytest.raises(ValueError, match="weight average"):
        trainer(model_dir, 0.9).load_state(wrong)
