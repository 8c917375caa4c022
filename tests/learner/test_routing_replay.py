"""Routing replay (``learner.replay``, ``learner.routing_replay``): the learner's MoE layers use the experts a sample
carries, on the fast path and through transformers' forward.

(a) every position with routing goes to exactly its given experts (recorded where the experts receive them), the
others to the model's own; (b) the model's own routing given back changes nothing; (c) with router weights perturbed
(what different kernels do to the last bits), log-probs under the sampler's routing are closer to the sampler's
than the learner's own routing gives; (d) routing that does not decode or fit the model is refused by name; (e) a
dense model, and ``routing_replay = "off"``, ignore it. Tiny models, a few seconds each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core import routing
from core.config import LearnerConfig
from core.schemas import TrainingSample
from learner import fastpath, replay, replay_own
from learner.dist_check import make_samples, on_policy
from learner.policy_trainer import PolicyTrainer
from liverl.testing.models import default_cache, ensure_test_model
from tests.learner.test_fastpath import _model_dir


def _trainer(family: str, fast: bool = True, **kw) -> PolicyTrainer:
    kw = {"routing_replay": "rollout", **kw}  # what these tests check (the setting is off by default)
    return PolicyTrainer(ensure_test_model(family, default_cache()), LearnerConfig(fast_forward=fast, **kw))


def _samples(tr: PolicyTrainer, n: int = 9, seed: int = 0) -> list[TrainingSample]:
    return on_policy(tr, make_samples(n, seed, tr.vocab_size, (2, 17), (1, 8)))


def _foreign(samples: list[TrainingSample], shape: replay.MoeShape, seed: int) -> list[TrainingSample]:
    """Every other sample with random routing (distinct experts per position and layer), the rest without."""
    rng = np.random.default_rng(seed)
    out = []
    for i, s in enumerate(samples):
        if i % 2:
            out.append(s)
            continue
        r = np.argsort(rng.random((replay.positions(s), shape.layers, shape.n_experts)), -1)[..., : shape.top_k]
        out.append(s.model_copy(update={"routed_experts": routing.to_text(routing.encode(r, shape.n_experts))}))
    return out


def _with(samples: list[TrainingSample], texts: list[str] | None) -> list[TrainingSample]:
    return [s.model_copy(update={"routed_experts": t}) for s, t in zip(samples, texts, strict=True)]


def _experts_received(model) -> tuple[list, list]:
    """Forward pre-hooks on every MoE layer's experts module recording the expert indices it is handed."""
    got, handles = [], []
    for layer in model.model.layers:
        for name, m in layer.named_modules():
            if name.endswith("experts") and type(m).__name__.endswith("Experts"):
                handles.append(m.register_forward_pre_hook(lambda _m, args: got.append(args[1].detach().clone())))
    return got, handles


def _expected(x: dict, own_RNLK: torch.Tensor) -> torch.Tensor:
    """Per position and MoE layer the experts replay must use: the given ones where ``routed_RN``, else the own."""
    route_RNLK, routed_RN = x["route"]
    return torch.where(routed_RN[..., None, None], route_RNLK, own_RNLK)


def _own(tr: PolicyTrainer, samples: list[TrainingSample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own routing of the batch ``samples`` make, laid out as ``x["route"]``: ``route_RNLK`` and where
    it is defined (every sample's positions but its last token's; not the rows' padding)."""
    texts = replay_own.routing_of(tr.model, samples, tr.pad_id)
    return tr._collate(_with(samples, texts))["route"]


@pytest.mark.parametrize(
    ("family", "layout"), [("qwen3_moe", None), ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]})]
)
def test_the_fast_path_routes_every_position_to_its_given_experts(tmp_path, family, layout):
    model_dir = _model_dir(tmp_path, layout) if layout else ensure_test_model(family, default_cache())
    tr = PolicyTrainer(model_dir, LearnerConfig(routing_replay="rollout"))
    assert fastpath.handles(tr.model) and tr.routing is not None
    samples = _samples(tr)
    mixed = _foreign(samples, tr.routing, seed=1)
    x = tr._collate(mixed)
    own_RNLK, defined_RN = _own(tr, samples)
    want_RNLK = _expected(x, own_RNLK)
    R, N = x["ids_RN"].shape
    seen: list[torch.Tensor] = []
    fastpath.token_logp(tr.model, x, seen=seen)
    assert len(seen) == tr.routing.layers
    pick = (x["row_BT"] * N + x["col_BT"]).reshape(-1)
    for m, got in enumerate(seen):
        want, defined = want_RNLK[:, :, m].reshape(R * N, -1), defined_RN.reshape(R * N)
        if m == len(seen) - 1:  # the last layer runs at the positions the loss reads only
            want, defined = want.index_select(0, pick), defined.index_select(0, pick)
            assert bool(defined.all())  # every position the loss reads has routing
        wrong = int(((got != want).any(-1) & defined).sum())
        assert wrong == 0, f"MoE layer {m}: {wrong} positions went to other experts"
    assert int(x["route"][1].sum()) > 0 and not bool(x["route"][1].all())  # some positions replayed, some own


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_transformers_forward_routes_every_position_to_its_given_experts(family):
    tr = _trainer(family, fast=False)
    samples = _samples(tr)
    x = tr._collate(_foreign(samples, tr.routing, seed=2))
    own_RNLK, defined_RN = _own(tr, samples)
    want_RNLK = _expected(x, own_RNLK)
    R, N = x["ids_RN"].shape
    got, handles = _experts_received(tr.model)
    try:
        tr._token_logp(tr.model, x)
    finally:
        for h in handles:
            h.remove()
    assert len(got) == tr.routing.layers
    for m, idx in enumerate(got):
        want = want_RNLK[:, :, m].reshape(R * N, -1)
        wrong = int(((idx != want).any(-1) & defined_RN.reshape(R * N)).sum())
        assert wrong == 0, f"MoE layer {m}: {wrong} positions went to other experts"


@pytest.mark.parametrize(("family", "fast"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", False)])
def test_replaying_the_models_own_routing_changes_nothing(family, fast):
    """The gate weights are the router's softmax at the given experts: at its own experts, its own top-k values,
    so the log-probs and every gradient (the router's included) are those of the plain forward."""
    tr = _trainer(family, fast=fast)
    samples = _samples(tr, seed=3)
    own = _with(samples, replay_own.routing_of(tr.model, samples, tr.pad_id))
    outs = []
    for batch in (samples, own):
        x = tr._collate(batch)
        assert ("route" in x) == (batch is own)
        logp, logprobs = tr._token_logp(tr.model, x)
        loss = (logp * x["mask_BT"]).sum() + (logprobs.exp() * logprobs).sum()
        outs.append((logp.detach(), torch.autograd.grad(loss, list(tr.model.parameters()))))
    (lp_plain, g_plain), (lp_replay, g_replay) = outs
    assert torch.equal(lp_plain, lp_replay), (lp_plain - lp_replay).abs().max()
    for (name, _), a, b in zip(tr.model.named_parameters(), g_plain, g_replay, strict=True):
        assert torch.equal(a, b), name
    router = replay.routers(tr.model)[0].weight
    i = [p is router for p in tr.model.parameters()].index(True)
    assert float(g_replay[i].abs().max()) > 0  # the router learns through the chosen experts' weights


@pytest.mark.parametrize(("family", "fast"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", False)])
def test_under_perturbed_routers_the_samplers_routing_gives_the_samplers_log_probs(family, fast):
    """The sampler is the model as saved; the learner's routers are perturbed (what another kernel's rounding does,
    larger). Some tokens then go to other experts; replaying the sampler's routing brings the learner's log-probs
    closer to the sampler's than its own routing does."""
    sampler = _trainer(family, fast=False)
    samples = _samples(sampler, n=16, seed=4)  # behaviour log-probs: the sampler's
    sampled = _with(samples, replay_own.routing_of(sampler.model, samples, sampler.pad_id))
    learner = _trainer(family, fast=fast)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for r in replay.routers(learner.model):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * 0.02 * float(r.weight.std()))
    flipped = sum(
        a != b
        for a, b in zip(
            replay_own.routing_of(learner.model, samples, learner.pad_id),
            (s.routed_experts for s in sampled),
            strict=True,
        )
    )
    assert flipped > 0, "the perturbation moved no token to another expert: the test would show nothing"
    errors = {}
    for name, batch in (("own", samples), ("replayed", sampled)):
        lps = learner.token_logprobs(batch)
        pairs = [
            (a, b) for s, lp in zip(samples, lps, strict=True) for a, b in zip(lp, s.behaviour_logprobs, strict=True)
        ]
        errors[name] = float(np.mean([abs(a - b) for a, b in pairs]))
    assert errors["replayed"] < errors["own"], errors


def test_routing_that_does_not_decode_or_fit_is_refused():
    tr = _trainer("qwen3_moe")
    s = _samples(tr, n=1)[0]
    good = routing.encode(np.tile([0, 1], (replay.positions(s), tr.routing.layers, 1)), tr.routing.n_experts)
    assert tr.refusal(s.model_copy(update={"routed_experts": routing.to_text(good)})) is None
    for bad, reason in (
        (routing.to_text(good[:-1]), "bad_routing"),  # truncated
        (routing.to_text(good[:-1] + bytes([good[-1] ^ 1])), "bad_routing"),  # a bit flipped
        ("not base64!", "bad_routing"),
        (
            routing.to_text(routing.encode(np.zeros((replay.positions(s) + 1, 2, 2), dtype=int) + [0, 1], 4)),
            "routing_mismatch",
        ),
        (
            routing.to_text(routing.encode(np.zeros((replay.positions(s), 3, 2), dtype=int) + [0, 1], 4)),
            "routing_mismatch",
        ),
        (
            routing.to_text(routing.encode(np.zeros((replay.positions(s), 2, 2), dtype=int) + [0, 1], 8)),
            "routing_mismatch",
        ),
    ):
        assert tr.refusal(s.model_copy(update={"routed_experts": bad})) == reason


def test_samples_without_routing_train_as_before_and_are_counted():
    tr = _trainer("qwen3_moe")
    samples = _samples(tr, seed=6)
    own = _with(samples, replay_own.routing_of(tr.model, samples, tr.pad_id))
    m = tr.train_step(own[:4] + samples[4:])
    assert (m["routing_replayed"], m["routing_missing"]) == (4.0, float(len(samples) - 4))


def test_a_dense_model_and_replay_off_ignore_routing():
    moe = _trainer("qwen3_moe")
    samples = _samples(moe, n=4, seed=7)
    texts = replay_own.routing_of(moe.model, samples, moe.pad_id)
    off = _trainer("qwen3_moe", routing_replay="off")
    dense = _trainer("qwen3")
    assert replay_own.routing_of(dense.model, samples) is None
    for tr in (off, dense):
        assert tr.routing is None
        with_routing = _with(samples, texts)
        assert all(tr.refusal(s) is None for s in with_routing)
        x = tr._collate(with_routing)
        assert "route" not in x
        assert tr.token_logprobs(with_routing) == tr.token_logprobs(samples)
        assert "routing_replayed" not in tr.train_step(with_routing)
