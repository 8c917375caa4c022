"""Routing replay: the learner's MoE layers send each token to the experts the server's router chose.

An MoE router is a hard top-k. The server's kernels and the learner's round differently in the last bits, and where
two experts' router scores are close that flips a token to another expert: its log-prob then differs between the
sampler (the behaviour log-probs) and the trainer, and the importance ratio of that token measures kernels, not
the policy. With ``learner.routing_replay = "rollout"`` a sample that carries its routing (``routed_experts``,
``core.routing``) is computed with the server's experts, in the policy's forward and the KL reference's.

The choice, as the R3 paper (Rollout Routing Replay) makes it: the expert *indices* come from the sample; the gate
*weights* are the family's own normalisation of the learner's router logits at those indices (softmax over all
experts, gathered, renormalised over the top-k where the family does: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral; softmax
over the chosen logits: GraniteMoE). So the router still receives gradient, through the chosen experts' weights; only
the discrete choice is the server's. With the learner's own routing given back, the weights are the values its top-k
took, to the bit: replay then computes exactly what the plain forward computes. PhiMoE's sparsemixer picks its
second expert against a threshold set by the first, not a top-k of one score; its routing is not replayed
(``moe_shape`` returns None) and its samples train on the learner's routing.

A sample without routing trains as before, on the learner's own routing, position by position within the same
batch (``layout``'s mask); the trainer counts it (``routing_missing``). Where the routing does not fit the model
(other layer count, experts, top-k, positions) the sample is refused (``refusal``: ``routing_mismatch``), and a blob
that does not decode is ``bad_routing`` (ingest dead-letters those before they become samples).

Two ways in: ``learner.fastpath`` takes the batch's ``route`` (``layout``) in its ``_moe``; transformers' forward is
replayed by forward hooks on each MoE layer's router module that replace its output (``replaying``), and
``recording`` captures what a router chose (tests, and the learner's own routing of a batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from core import routing
from core.schemas import TrainingSample

_SOFTMAX_ALL = {"qwen3_moe", "qwen2_moe", "olmoe", "mixtral"}  # softmax over every expert, gather, renormalise
_SOFTMAX_TOPK = {"granitemoe"}  # softmax over the chosen experts' logits


@dataclass(frozen=True)
class MoeShape:
    """What a routing blob must hold for a model: its MoE layers (dense ones left out), top-k and experts."""

    layers: int
    top_k: int
    n_experts: int
    family: str


def routers(model) -> list[torch.nn.Module]:
    """Each MoE layer's router module, in the order of the model's layers (transformers' ``*TopKRouter``)."""
    out = []
    for layer in model.model.layers:
        found = [m for m in layer.modules() if type(m).__name__.endswith("TopKRouter")]
        assert len(found) <= 1, f"{len(found)} routers in one decoder layer"
        out += found
    return out


def moe_shape(model) -> MoeShape | None:
    """The routing a sample must carry for ``model``; None when the model is dense or its family is not replayed."""
    family = getattr(model.config, "model_type", None)
    if family not in _SOFTMAX_ALL | _SOFTMAX_TOPK:
        return None
    rs = routers(model)
    if not rs:
        return None
    shapes = {(int(r.top_k), int(r.num_experts)) for r in rs}
    assert len(shapes) == 1, f"MoE layers with different top-k or expert counts: {shapes}"
    (k, e) = shapes.pop()
    return MoeShape(layers=len(rs), top_k=k, n_experts=e, family=family)


def refusal(s: TrainingSample, shape: MoeShape | None) -> str | None:
    """``bad_routing`` for routing that does not decode, ``routing_mismatch`` for routing of another shape than the
    model's (layers, top-k, experts) or the sample's (positions); None otherwise, and always when not replaying."""
    if shape is None or s.routed_experts is None:
        return None
    try:
        blob = routing.from_text(s.routed_experts)
        P, L, K, E = routing.header(blob)
        routing.decode(blob)
    except routing.RoutingError:
        return "bad_routing"
    if (L, K, E) != (shape.layers, shape.top_k, shape.n_experts) or P != positions(s):
        return "routing_mismatch"
    return None


def positions(s: TrainingSample) -> int:
    """The positions a sample's routing covers: its prompt and completion but the last token."""
    return len(s.prompt_token_ids) + len(s.completion_token_ids) - 1


def places(samples: list[TrainingSample], rows: list[list[int]]) -> Iterator[tuple[int, int, int]]:
    """(sample, row, first position) of each sample in ``learner.batch.pack``'s rows, as ``collate`` lays them."""
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            yield b, r, at
            at += len(samples[b].prompt_token_ids) + len(samples[b].completion_token_ids)


def layout(
    samples: list[TrainingSample], rows: list[list[int]], N: int, shape: MoeShape
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's routing in its packed rows (``learner.batch.collate``'s layout): ``route_RNLK`` (int64) and
    ``routed_RN`` (bool: the position's experts are the sample's; elsewhere the model routes itself). None when no
    sample carries routing. Each sample's routing is decoded (``refusal`` refused those that do not)."""
    if not any(s.routed_experts is not None for s in samples):
        return None
    route = np.zeros((len(rows), N, shape.layers, shape.top_k), dtype=np.int64)
    routed = np.zeros((len(rows), N), dtype=bool)
    for b, r, at in places(samples, rows):
        s = samples[b]
        if s.routed_experts is not None:
            n = positions(s)
            route[r, at : at + n] = routing.decode(
                routing.from_text(s.routed_experts),
                positions=n,
                layers=shape.layers,
                top_k=shape.top_k,
                n_experts=shape.n_experts,
            )
            routed[r, at : at + n] = True
    return torch.from_numpy(route), torch.from_numpy(routed)


def gate_weights(logits: torch.Tensor, index: torch.Tensor, family: str, norm_topk: bool) -> torch.Tensor:
    """The gate weights of the experts ``index`` [n, K] under the router logits [n, E], as ``family`` normalises
    them (float32, before any cast back to the logits' dtype)."""
    if family in _SOFTMAX_TOPK:
        return torch.softmax(logits.float().gather(1, index), dim=-1)
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
    if norm_topk or family == "mixtral":
        w = w / w.sum(dim=-1, keepdim=True)
    return w


# ---------------------------------------------------------------------------------------------- transformers


def _outputs(family: str, out: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, weights, index) of a router's output tuple."""
    if family in _SOFTMAX_TOPK:  # GraniteMoE: (index, weights, logits)
        return out[2], out[1], out[0]
    return out[0], out[1], out[2]


@contextlib.contextmanager
def replaying(model, route: tuple[torch.Tensor, torch.Tensor] | None) -> Iterator[None]:
    """Within it, transformers' forward of ``model`` on the batch ``route`` was laid out for (``layout``) routes
    every position ``routed_RN`` marks to its given experts, with the family's gate weights of the router's logits
    at them. A no-op when ``route`` is None."""
    if route is None:
        yield
        return
    shape = moe_shape(model)
    assert shape is not None, "replaying a model whose routing is not replayed"
    route_RNLK, routed_RN = route
    R, N = routed_RN.shape
    idx_all = route_RNLK.reshape(R * N, shape.layers, shape.top_k)
    has = routed_RN.reshape(R * N, 1)
    handles = []

    def hook_for(layer: int, router):
        def hook(_module, args, out):
            logits, weights, index = _outputs(shape.family, out)
            if logits.shape[0] != R * N:
                raise ValueError(
                    f"routing replay: the router of MoE layer {layer} saw {logits.shape[0]} positions, the batch "
                    f"has {R * N} ({R} rows of {N})"
                )
            idx = torch.where(has, idx_all[:, layer].to(index.device), index)
            w = gate_weights(logits, idx, shape.family, bool(getattr(router, "norm_topk_prob", False)))
            w = w.type_as(args[0]) if shape.family in _SOFTMAX_TOPK else w.to(weights.dtype)
            if shape.family in _SOFTMAX_TOPK:
                return idx, w, logits
            return logits, w, idx

        return hook

    try:
        for i, r in enumerate(routers(model)):
            handles.append(r.register_forward_hook(hook_for(i, r)))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def recording(model) -> Iterator[list[torch.Tensor]]:
    """Within it, each call of an MoE layer's router appends the expert indices it returned ([positions, top_k]) to
    the list it yields, in call order (one forward: one entry per MoE layer, in layer order)."""
    shape = moe_shape(model)
    family = shape.family if shape is not None else getattr(model.config, "model_type", "")
    seen: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda _m, _a, out: seen.append(_outputs(family, out)[2].detach().clone()))
        for r in routers(model)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
