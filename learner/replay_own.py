"""A model's own routing of samples, as the blobs a sample carries: what a server that captures its router's choices
would send, computed by the learner's model (tests, and measuring a kernel's mismatch). Apart from
``learner.replay``, which ``learner.batch`` imports, because it packs samples as ``learner.batch`` does."""

from __future__ import annotations

import torch

from core import routing
from core.schemas import TrainingSample
from learner import replay
from learner.batch import collate, pack


@torch.no_grad()
def routing_of(model, samples: list[TrainingSample], pad_id: int = 0) -> list[str] | None:
    """Each sample's routing under ``model`` (transformers' forward, every position of every MoE layer), as the
    base64 blobs a sample carries; None for a model whose routing is not replayed. What a server that captures its
    router's choices would send, computed by the learner's model (tests, and measuring a kernel's mismatch)."""
    shape = replay.moe_shape(model)
    if shape is None:
        return None
    x = collate([s.model_copy(update={"routed_experts": None}) for s in samples], pad_id, torch.device("cpu"))
    R, N = x["ids_RN"].shape
    with replay.recording(model) as seen:
        model(input_ids=x["ids_RN"], position_ids=x["posid_RN"], use_cache=False)
    assert len(seen) == shape.layers, f"{len(seen)} router calls for {shape.layers} MoE layers"
    route_RNLK = torch.stack(seen, dim=1).reshape(R, N, shape.layers, shape.top_k).numpy()
    rows = pack([len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples])
    out: list[str] = [""] * len(samples)
    for b, r, at in replay.places(samples, rows):
        blob = routing.encode(route_RNLK[r, at : at + replay.positions(samples[b])], shape.n_experts)
        out[b] = routing.to_text(blob)
    return out
