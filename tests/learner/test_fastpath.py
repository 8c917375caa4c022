"""The learner's own Qwen3-MoE forward (``learner.fastpath``) computes what transformers' forward computes.

Each layout is a small random Qwen3-MoE saved to disk and loaded twice, once with ``learner.fast_forward`` on and
once off (transformers' forward). On the same packed batch, the completion log-probs, the full distributions the KL
and the entropy read, and the gradient of a loss over both must agree. The layouts cover what the fast path reads
from the model: grouped-query attention (2 query heads a KV head) and plain multi-head, attention biases, a dense
MLP layer among the MoE ones (``mlp_only_layers``), top-3 routing with and without renormalised weights.
"""

from __future__ import annotations

import pytest
import torch

from core.config import LearnerConfig
from core.schemas import TrainingSample
from learner import fastpath
from learner.dist_check import make_samples, on_policy
from learner.policy_trainer import PolicyTrainer
from liverl.testing.models import default_cache, ensure_test_model

LAYOUTS = {
    "gqa": {},
    "mha-bias-dense-layer": {"num_key_value_heads": 2, "attention_bias": True, "mlp_only_layers": [1]},
    "top3-unnormalised": {"num_experts_per_tok": 3, "norm_topk_prob": False, "num_hidden_layers": 3},
}


def _samples(tr: PolicyTrainer, seed: int) -> list[TrainingSample]:
    """13 samples of mixed lengths (some rows hold several), on-policy: the off-policy mask keeps them."""
    return on_policy(tr, make_samples(13, seed, tr.vocab_size, (2, 23), (1, 8)))


def _agree(a: PolicyTrainer, b: PolicyTrainer, samples: list[TrainingSample], tol: float) -> None:
    """The same log-probs, distributions and gradients (within ``tol``), then whole updates with the same metrics."""
    grads, outs = [], []
    for tr in (a, b):
        x = tr._collate(samples)
        assert len(x["ids_RN"]) < len(samples), "some rows must hold several sequences"
        logp, logprobs = tr._token_logp(tr.model, x)
        loss = (logp * x["mask_BT"]).sum() + (logprobs.exp() * logprobs).sum()
        grads.append(torch.autograd.grad(loss, list(tr.model.parameters())))
        outs.append((logp.detach(), logprobs.detach()))
    (lp_a, dist_a), (lp_b, dist_b) = outs
    assert torch.allclose(lp_a, lp_b, rtol=0, atol=tol), (lp_a - lp_b).abs().max()
    assert torch.allclose(dist_a, dist_b, rtol=0, atol=tol), (dist_a - dist_b).abs().max()
    for (name, _), ga, gb in zip(a.model.named_parameters(), *grads, strict=True):
        assert float((ga - gb).abs().max()) <= tol * max(float(gb.abs().max()), 1.0), name
    for batch in (samples, samples[4:]):  # another batch shape
        ma, mb = a.train_step(batch), b.train_step(batch)
        assert ma["grad_norm"] > 0.01  # the policy gradient, not rounding noise around a masked batch
        for k in ("loss", "kl", "grad_norm"):
            assert ma[k] == pytest.approx(mb[k], rel=tol, abs=tol / 10), k


def _model_dir(tmp_path, layout: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = ensure_test_model("qwen3_moe", default_cache())
    config = AutoConfig.from_pretrained(base)
    for k, v in layout.items():
        setattr(config, k, v)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # away from the init's ones and zeros: every weight shows in the output
            p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(tmp_path)  # liverl's weights are bf16 on disk
    return tmp_path


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_fast_forward_is_transformers_forward(tmp_path, layout):
    model_dir = _model_dir(tmp_path, LAYOUTS[layout])
    fast = PolicyTrainer(model_dir, LearnerConfig(fast_forward=True))
    slow = PolicyTrainer(model_dir, LearnerConfig(fast_forward=False))
    assert fastpath.handles(fast.model) and fastpath.handles(fast.ref)
    _agree(fast, slow, _samples(slow, seed=len(layout)), tol=1e-5)


def test_other_families_and_other_precisions_use_transformers_forward():
    mixtral = PolicyTrainer(ensure_test_model("mixtral", default_cache()), LearnerConfig())
    assert not fastpath.handles(mixtral.model)
    qwen = PolicyTrainer(ensure_test_model("qwen3_moe", default_cache()), LearnerConfig())
    assert fastpath.handles(qwen.model)
    assert qwen.forward_path() == "learner/fastpath.py"
    assert mixtral.forward_path().startswith("transformers' forward (mixtral")
    off = PolicyTrainer(ensure_test_model("qwen3_moe", default_cache()), LearnerConfig(fast_forward=False))
    assert off.forward_path() == "transformers' forward (learner.fast_forward = false)"
    assert not fastpath.handles(qwen.model.to(torch.bfloat16))  # transformers upcasts inside its norms


def test_the_fast_forward_follows_weights_changed_in_place():
    """The tables it keeps per batch are not weights: a new reference (``set_reference``) is read at once."""
    tr = PolicyTrainer(ensure_test_model("qwen3_moe", default_cache()), LearnerConfig())
    samples = _samples(tr, seed=1)
    x = tr._collate(samples)
    before, _ = tr._token_logp(tr.ref, x)
    with torch.no_grad():
        tr.ref.model.layers[0].self_attn.o_proj.weight.mul_(3.0)
    after, _ = tr._token_logp(tr.ref, x)
    x2 = tr._collate(samples)
    slow = PolicyTrainer(ensure_test_model("qwen3_moe", default_cache()), LearnerConfig(fast_forward=False))
    with torch.no_grad():
        slow.ref.model.layers[0].self_attn.o_proj.weight.mul_(3.0)
    want, _ = slow._token_logp(slow.ref, x2)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, want, rtol=0, atol=1e-5)


def test_the_compiled_forward_is_the_eager_one():
    """``learner.compile``: the same forward under ``torch.compile``. Inductor reorders reductions, so the
    log-probs and the gradients agree within a tolerance, not bit for bit; whole updates give the same metrics.
    The first calls compile (tens of seconds here; inductor's disk cache makes later processes faster)."""
    from torch._dynamo.utils import counters

    model_dir = ensure_test_model("qwen3_moe", default_cache())
    eager = PolicyTrainer(model_dir, LearnerConfig())
    comp = PolicyTrainer(model_dir, LearnerConfig(compile=True))
    counters.clear()
    _agree(comp, eager, _samples(eager, seed=5), tol=1e-4)
    # compiled whole: a graph break makes torch.compile run the frame eagerly, which would pass the line above
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_a_batch_whose_sample_spans_two_rows_is_refused():
    """The last layer gathers each sample's queries against one row's keys, so a batch in which a sample's entries
    (``row_BT``) lie in two rows is refused with a reason, not computed wrongly. ``PolicyTrainer._collate`` keeps a
    sample in one row, padding entries included."""
    tr = PolicyTrainer(ensure_test_model("qwen3_moe", default_cache()), LearnerConfig())
    x = tr._collate(_samples(tr, seed=3))
    assert bool((x["row_BT"] == x["row_BT"][:, :1]).all())  # what _collate guarantees
    fastpath.token_logp(tr.model, dict(x))  # and what the fast path then accepts
    bad = dict(x, row_BT=x["row_BT"].clone())
    bad["row_BT"][0, -1] = (int(bad["row_BT"][0, 0]) + 1) % len(x["ids_RN"])
    with pytest.raises(ValueError, match="span several packed rows"):
        fastpath.token_logp(tr.model, bad)
