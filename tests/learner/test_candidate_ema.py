"""The candidates' weight average (``learner.candidate_ema``): what the learner emits is the exponential moving average
of its weights over its updates, restarted at a rebase, left alone by a failed batch, and carried by its checkpoints
(one file here; DCP in ``tests/learner/test_dist.py``). Without it, a candidate is the weights as they are."""

from __future__ import annotations

import pytest
import torch

from .test_trainer import base_samples, model_dir  # noqa: F401 -- fixtures


def trainer(model_dir, ema: float):  # noqa: F811
    from core.config import LearnerConfig
    from learner.policy_trainer import PolicyTrainer

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


def test_the_candidates_entropy_is_measured_and_the_floor_can_be_held_for_it(cfg, model_dir, base_samples):  # noqa: F811
    """An average of the weights is a sharper policy than the weights it averages (the demo's seventh hour: batches at
    the learner's floor, 0.09-0.10 nats a token, averaged candidates at 0.058-0.073 on the same generations). At each
    candidate the learner measures both on the last batch, without changing the weights or the average; with
    ``learner.floor_for_candidate`` it raises the floor of its next updates by their ratio (1 to 4), and a restart
    keeps the raised floor."""
    from core.config import LearnerConfig
    from learner.policy_trainer import FLOOR_LIFT_MAX, PolicyTrainer
    from learner.trainer import Learner

    from .test_trainer import learner_cfg, make_registry, produce_samples

    tr = PolicyTrainer(model_dir, LearnerConfig(lr=1e-3, candidate_ema=0.9, floor_for_candidate=True))
    assert tr.measure_candidate_entropy() is None  # no update yet: nothing to measure on
    for i in range(4):
        tr.train_step(base_samples[16 * i : 16 * (i + 1)])
    weights, cand = tr.weights(torch.float32), tr.candidate_weights()
    held = tr.measure_candidate_entropy()
    assert same(tr.weights(torch.float32), weights) and same(tr.candidate_weights(), cand)  # measured, not changed

    x, n_tokens, _ = tr._last_x
    other = trainer(model_dir, 0.0)  # the average, measured apart: loaded into a model of its own
    other.model.load_state_dict(tr.ema_state(), strict=False)
    assert held["candidate_entropy"] == pytest.approx(other._entropy_part(x, n_tokens, 1.0), rel=1e-5)
    other.model.load_state_dict({n: p.detach() for n, p in tr.model.named_parameters()}, strict=False)
    assert held["entropy"] == pytest.approx(other._entropy_part(x, n_tokens, 1.0), rel=1e-5)
    ratio = held["entropy"] / held["candidate_entropy"]
    assert held["floor_lift"] == tr.floor_lift == pytest.approx(min(FLOOR_LIFT_MAX, max(1.0, ratio)))

    tr.floor_lift = 2.0  # the next update is held to twice the configured floor
    m = tr.train_step(base_samples[64:80])
    assert m["entropy_floor"] == pytest.approx(2.0 * tr.lcfg.entropy_floor)
    assert m["entropy_floor_gap"] == pytest.approx(max(0.0, 2.0 * tr.lcfg.entropy_floor - m["entropy"]), abs=1e-6)
    tr.floor_lift = 1.0
    assert "entropy_floor" not in tr.train_step(base_samples[80:96])

    off = trainer(model_dir, 0.9)  # the default: measured alike, the floor left as configured
    for i in range(4):
        off.train_step(base_samples[16 * i : 16 * (i + 1)])
    measured = off.measure_candidate_entropy()
    assert measured["candidate_entropy"] == pytest.approx(held["candidate_entropy"], rel=1e-6)
    assert off.floor_lift == 1.0 and measured["floor_lift"] == 1.0
    plain = trainer(model_dir, 0.0)  # not averaged: nothing to measure
    plain.train_step(base_samples[:16])
    assert plain.measure_candidate_entropy() is None
    no_floor = PolicyTrainer(
        model_dir, LearnerConfig(lr=1e-3, candidate_ema=0.9, entropy_floor=0.0, floor_for_candidate=True)
    )
    no_floor.train_step(base_samples[:16])
    assert no_floor.measure_candidate_entropy() is not None and no_floor.floor_lift == 1.0  # no floor to hold

    cfg = learner_cfg(cfg, batch_size=8, candidate_every_steps=2, candidate_ema=0.9, floor_for_candidate=True)
    produce_samples(cfg, base_samples[:32])
    reg = make_registry(cfg, model_dir)
    try:
        learner = Learner(cfg, model_dir, cfg.broker.bootstrap, reg)
        learner.trainer.floor_lift = 3.0  # as if measured: the candidates below measure it again
        learner.run(max_steps=4)
        assert learner.trainer.floor_lift != 3.0
        assert all("candidate_entropy" in c.metrics for c in reg.candidates())
        restarted = Learner(cfg, model_dir, cfg.broker.bootstrap, reg)
        assert restarted.trainer.floor_lift == learner.trainer.floor_lift
        restarted.trainer.floor_lift = 2.5
        restarted._save_checkpoint()
        assert Learner(cfg, model_dir, cfg.broker.bootstrap, reg).trainer.floor_lift == 2.5
        cfg.learner.floor_for_candidate = False  # turned off since the checkpoint: the configured floor again
        assert Learner(cfg, model_dir, cfg.broker.bootstrap, reg).trainer.floor_lift == 1.0
    finally:
        reg.close()
