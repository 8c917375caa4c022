"""Unit tests of the off-policy policy-gradient loss (pure tensors, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import RunningBaseline, advantages, pg_loss


def _grad_of_logp(logp_BT, beh_BT, adv_B, mask_BT, **kw):
    logp_BT = logp_BT.clone().requires_grad_(True)
    out = pg_loss(logp_BT, beh_BT, adv_B, mask_BT, **kw)
    out.loss.backward()
    return logp_BT.grad, out


def test_positive_advantage_raises_logp_negative_lowers_it():
    logp_BT = torch.log(torch.tensor([[0.5, 0.4], [0.5, 0.4]]))
    mask_BT = torch.ones(2, 2)
    grad_BT, _ = _grad_of_logp(logp_BT, logp_BT.clone(), torch.tensor([1.0, -1.0]), mask_BT, tis_cap=2.0)
    # gradient descent moves logp against the gradient: up for A > 0, down for A < 0
    assert (grad_BT[0] < 0).all() and (grad_BT[1] > 0).all()


def test_gradient_step_on_real_parameters_raises_accepted_token_probability():
    torch.manual_seed(0)
    logits_V = torch.zeros(5, requires_grad=True)
    opt = torch.optim.SGD([logits_V], lr=0.5)
    tok = torch.tensor([[3]])
    for _ in range(5):
        logp_BT = torch.log_softmax(logits_V, -1)[tok]
        out = pg_loss(logp_BT, logp_BT.detach(), torch.tensor([1.0]), torch.ones(1, 1), tis_cap=2.0)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert torch.softmax(logits_V, -1)[3] > 0.5


def test_tis_cap_truncates_the_weight_and_counts_clipped_tokens():
    beh_BT = torch.log(torch.tensor([[0.1, 0.5]]))
    logp_BT = torch.log(torch.tensor([[0.5, 0.5]]))  # ratios 5.0 and 1.0
    grad_BT, out = _grad_of_logp(logp_BT, beh_BT, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0, mask_hi=10.0)
    # d loss / d logp = -w * A / n_tokens with w = min(r, C)
    assert grad_BT[0, 0].item() == pytest.approx(-2.0 / 2)
    assert grad_BT[0, 1].item() == pytest.approx(-1.0 / 2)
    assert out.metrics["clipped_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(3.0)


def test_importance_weight_is_detached_and_below_cap_equals_ratio():
    beh_BT = torch.log(torch.tensor([[0.4]]))
    logp_BT = torch.log(torch.tensor([[0.3]]))  # ratio 0.75
    grad_BT, _ = _grad_of_logp(logp_BT, beh_BT, torch.tensor([2.0]), torch.ones(1, 1), tis_cap=2.0)
    assert grad_BT.item() == pytest.approx(-0.75 * 2.0)


def test_sequences_outside_the_ratio_band_are_masked_and_counted():
    beh_BT = torch.log(torch.full((3, 2), 0.5))
    logp_BT = torch.log(torch.tensor([[0.5, 0.5], [0.05, 0.05], [0.99, 0.99]]))  # ratios 1, 0.1, ~2
    mask_BT = torch.ones(3, 2)
    grad_BT, out = _grad_of_logp(logp_BT, beh_BT, torch.ones(3), mask_BT, tis_cap=5.0, mask_lo=0.5, mask_hi=1.5)
    assert grad_BT[0].abs().sum() > 0
    assert grad_BT[1].abs().sum() == 0 and grad_BT[2].abs().sum() == 0
    assert out.metrics["masked_frac"] == pytest.approx(2 / 3)
    assert out.metrics["masked_seqs"] == 2


def test_padding_contributes_nothing():
    beh_BT = torch.log(torch.tensor([[0.5, 0.5]]))
    logp_BT = torch.log(torch.tensor([[0.5, 1e-30]]))  # the padded slot holds garbage
    mask_BT = torch.tensor([[1.0, 0.0]])
    grad_BT, out = _grad_of_logp(logp_BT, beh_BT, torch.tensor([1.0]), mask_BT, tis_cap=2.0)
    assert grad_BT[0, 1] == 0
    assert out.metrics["tokens"] == 1 and out.metrics["masked_frac"] == 0
    assert math.isfinite(out.metrics["ratio_max"])


def test_kl_is_zero_at_the_reference_and_positive_elsewhere_with_restoring_gradient():
    logp_BT = torch.log(torch.tensor([[0.3, 0.6]]))
    mask_BT = torch.ones(1, 2)
    zero_adv = torch.zeros(1)
    grad_BT, out = _grad_of_logp(
        logp_BT, logp_BT.clone(), zero_adv, mask_BT, tis_cap=2.0, ref_logp_BT=logp_BT.clone(), kl_coef=1.0
    )
    assert out.metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    assert grad_BT.abs().max() < 1e-7
    ref_BT = torch.log(torch.tensor([[0.5, 0.5]]))
    grad_BT, out = _grad_of_logp(
        logp_BT, logp_BT.clone(), zero_adv, mask_BT, tis_cap=2.0, ref_logp_BT=ref_BT, kl_coef=1.0
    )
    assert out.metrics["kl"] > 0
    # descent pulls logp toward the reference: up where logp < ref, down where logp > ref
    assert grad_BT[0, 0] < 0 and grad_BT[0, 1] > 0


def test_kl_coefficient_scales_only_the_penalty():
    logp_BT = torch.log(torch.tensor([[0.3]]))
    ref_BT = torch.log(torch.tensor([[0.6]]))
    a = pg_loss(logp_BT, logp_BT, torch.ones(1), torch.ones(1, 1), tis_cap=2.0, ref_logp_BT=ref_BT, kl_coef=0.0)
    b = pg_loss(logp_BT, logp_BT, torch.ones(1), torch.ones(1, 1), tis_cap=2.0, ref_logp_BT=ref_BT, kl_coef=0.5)
    assert a.metrics["kl"] == pytest.approx(b.metrics["kl"])
    assert (b.loss - a.loss).item() == pytest.approx(0.5 * a.metrics["kl"])


def test_entropy_metric_and_shape_errors():
    logp_BT = torch.zeros(2, 3)
    out = pg_loss(logp_BT, logp_BT, torch.zeros(2), torch.ones(2, 3), tis_cap=2.0, entropy_BT=torch.full((2, 3), 0.7))
    assert out.metrics["entropy"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="shape mismatch"):
        pg_loss(logp_BT, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), tis_cap=2.0)
    with pytest.raises(ValueError, match="adv"):
        pg_loss(logp_BT, logp_BT, torch.zeros(3), torch.ones(2, 3), tis_cap=2.0)
    with pytest.raises(ValueError, match="at least one completion token"):
        pg_loss(logp_BT, logp_BT, torch.zeros(2), torch.tensor([[1.0, 1, 1], [0, 0, 0]]), tis_cap=2.0)


def test_advantages_leave_one_out_per_segment():
    r_B = torch.tensor([0.75, -0.25, -0.25, 0.75, 0.75])
    adv_B = advantages(r_B, ["a", "a", "a", "b", "b"])
    assert adv_B[0].item() == pytest.approx(0.75 - (-0.25))
    assert adv_B[1].item() == pytest.approx(-0.25 - 0.25)
    # a segment whose users accept everything gets no push
    assert adv_B[3].item() == pytest.approx(0.0) and adv_B[4].item() == pytest.approx(0.0)


def test_advantages_running_baseline_for_singletons_and_normalisation():
    running = RunningBaseline(decay=0.5)
    running.update("b", 0.25)
    adv_B = advantages(torch.tensor([0.75, -0.25, 0.75]), ["a", "a", "b"], running)
    assert adv_B[2].item() == pytest.approx(0.75 - 0.25)
    assert running.get("b") == pytest.approx(0.5 * 0.25 + 0.5 * 0.75)
    assert running.get("a") == pytest.approx(0.25)  # first sighting: the batch mean
    restored = RunningBaseline()
    restored.load_state_dict(running.state_dict())
    assert restored.means == running.means
    norm_B = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), [None] * 4, normalize=True)
    raw_B = advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), [None] * 4)
    assert torch.allclose(norm_B, raw_B / (torch.tensor([1.0, 0.0, 1.0, 0.0]).std() + 1e-4))
    with pytest.raises(ValueError, match="finite"):
        advantages(torch.tensor([float("nan")]), ["a"])


def test_the_running_baseline_keeps_at_most_max_segments_means_and_one_overflow_mean():
    """The segment is the product's to choose: a stream of new segments adds no mean past ``max_segments``, the later
    ones share one overflow mean, and the state a checkpoint saves stays that size through a restart."""
    running = RunningBaseline(decay=0.5, max_segments=4)
    for i in range(1000):
        advantages(torch.tensor([1.0 if i % 2 else 0.0]), [f"seg-{i}"], running)
    assert list(running.means) == ["seg-0", "seg-1", "seg-2", "seg-3"] and running.means["seg-1"] == 1.0
    assert running.overflow is not None and 0.0 < running.overflow < 1.0
    assert running.get("seg-999") == running.get("never-seen") == running.overflow
    assert running.get("seg-2") == 0.0
    restored = RunningBaseline(max_segments=4)
    restored.load_state_dict(running.state_dict())
    assert (restored.means, restored.overflow) == (running.means, running.overflow)
    old = RunningBaseline(max_segments=2)  # a checkpoint saved with more segments, or before the cap
    old.load_state_dict({"decay": 0.9, "init": 0.0, "means": {"a": 0.1, "b": 0.2, "c": 0.3}})
    assert old.means == {"a": 0.1, "b": 0.2} and old.overflow is None


def test_full_kl_is_exact_zero_at_reference_and_pulls_toward_it():
    from learner.loss import full_kl

    ref_BTV = torch.log_softmax(torch.tensor([[[1.0, 0.0, -1.0]]]), -1)
    assert full_kl(ref_BTV, ref_BTV).abs().max() < 1e-7
    logits_BTV = torch.tensor([[[3.0, 0.0, -1.0]]], requires_grad=True)
    logprobs_BTV = torch.log_softmax(logits_BTV, -1)
    kl_BT = full_kl(logprobs_BTV, ref_BTV)
    p, q = logprobs_BTV.exp()[0, 0].detach(), ref_BTV.exp()[0, 0]
    assert kl_BT.item() == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)
    out = pg_loss(
        torch.log(p[:1])[None].detach().requires_grad_(),
        torch.log(p[:1])[None],
        torch.zeros(1),
        torch.ones(1, 1),
        tis_cap=2.0,
        kl_BT=kl_BT,
        kl_coef=1.0,
    )
    assert out.metrics["kl"] == pytest.approx(kl_BT.item())
    out.loss.backward()
    assert logits_BTV.grad[0, 0, 0] > 0  # descent lowers the logit the policy over-weights vs the reference


def _entropy_case(floor: float, coef: float):
    """A peaked two-position policy over 4 tokens (entropy ~0.17 nats), its loss with the entropy floor, and the
    gradient on its logits."""
    logits_BTV = torch.tensor([[[4.0, 0.0, 0.0, 0.0], [0.0, 4.5, 0.0, 0.0]]], requires_grad=True)
    logprobs_BTV = torch.log_softmax(logits_BTV, -1)
    logp_BT = logprobs_BTV[0, [0, 1], [0, 1]][None]
    ent_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    out = pg_loss(
        logp_BT,
        logp_BT.detach(),
        torch.tensor([0.5]),
        torch.ones(1, 2),
        tis_cap=2.0,
        entropy_BT=ent_BT,
        entropy_floor=floor,
        entropy_coef=coef,
    )
    out.loss.backward()
    return float((ent_BT.detach()).mean()), out, logits_BTV.grad


def test_the_entropy_floor_acts_only_under_it_and_pushes_the_entropy_up():
    """learner.entropy_floor: above it the loss and its gradient are the plain loss's; under it a gradient step
    raises the entropy, where the plain loss (a positive advantage on the likeliest tokens) lowers it."""
    h, plain, g_plain = _entropy_case(0.0, 0.0)
    assert 0.1 < h < 0.3
    _, above, g_above = _entropy_case(h - 0.05, 1.0)  # the floor under the policy's entropy: nothing changes
    assert above.loss.item() == pytest.approx(plain.loss.item()) and torch.equal(g_above, g_plain)
    assert above.metrics["entropy_floor_gap"] == 0.0 and "entropy_floor_gap" not in plain.metrics
    _, under, g_under = _entropy_case(h + 0.3, 1.0)
    assert under.metrics["entropy_floor_gap"] == pytest.approx(0.3, abs=1e-6)

    def entropy_after(grad):
        logits = torch.tensor([[[4.0, 0.0, 0.0, 0.0], [0.0, 4.5, 0.0, 0.0]]]) - 0.5 * grad
        lp = torch.log_softmax(logits, -1)
        return float(-(lp.exp() * lp).sum(-1).mean())

    assert entropy_after(g_plain) < h < entropy_after(g_under)


def test_the_entropy_floor_is_decided_on_the_whole_batchs_entropy():
    """Over ranks each call holds a share: the hinge acts when the batch's mean (batch_entropy) is under the floor,
    whatever this share's own entropy, and not otherwise."""
    h, plain, g_plain = _entropy_case(0.0, 0.0)
    logits_BTV = torch.tensor([[[4.0, 0.0, 0.0, 0.0], [0.0, 4.5, 0.0, 0.0]]], requires_grad=True)
    lp = torch.log_softmax(logits_BTV, -1)
    ent_BT = -(lp.exp() * lp).sum(-1)
    logp_BT = lp[0, [0, 1], [0, 1]][None]
    kw = dict(tis_cap=2.0, entropy_BT=ent_BT, entropy_floor=h + 0.3, entropy_coef=1.0)
    high = pg_loss(logp_BT, logp_BT.detach(), torch.tensor([0.5]), torch.ones(1, 2), batch_entropy=h + 0.5, **kw)
    assert high.metrics["entropy_floor_gap"] == 0.0 and high.loss.item() == pytest.approx(plain.loss.item())
    low = pg_loss(logp_BT, logp_BT.detach(), torch.tensor([0.5]), torch.ones(1, 2), batch_entropy=h, **kw)
    assert low.loss.item() == pytest.approx(plain.loss.item() - h)
