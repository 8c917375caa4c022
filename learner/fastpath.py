"""The learner's own forward pass for Qwen3-MoE in one process: the same maths as transformers, less work.

Why: on a small model the update is bound by the cost of each operator call, not by arithmetic. transformers'
forward rebuilds the packed-sequence attention mask and the rotary tables on every call (about 40 operators a
forward, twice an update: the policy and the KL reference), and runs each of ~35 submodules through
``nn.Module.__call__`` and its output-capturing decorators. Here:

- the mask and the rotary tables are built once per batch (``prepare``, kept in the batch dict and shared by both
  models), and each decoder layer is straight-line torch over the model's tensors (``_spec_and_weights``);
- the last decoder layer computes keys and values at every position and everything else (its queries, their
  attention, its output projection, experts and residual) only at the positions the loss reads, as the output
  head does (``_body``, ``_attention``'s ``pick``): each position's query and what follows it are its own, so the
  other positions' were computed and never read. On the demo model (2 layers) that is most of the second layer's
  attention and experts, in the reference's forward, the policy's and its backward. The picked queries attend per
  sample: a sample's T queries against its own row's keys (``PolicyTrainer._collate`` keeps a sample in one row);
- the rotary embedding is one ``roll`` against a sine table with its sign folded in (``prepare``), not
  ``rotate_half``'s slice, negation and concatenation; grouped-query attention is SDPA's own (``enable_gqa``),
  not k and v repeated; rows are gathered with ``index_select``, whose backward is one ``index_add``;
- ``learner.compile``: the same code under ``torch.compile``, which fuses the elementwise chains and above all the
  backward's (``token_logp``).

Same maths: the RMS norms, the rotary embedding, SDPA with the same boolean block-causal mask, the router's
softmax / top-k / renormalisation and the experts' grouped products are those of ``transformers.models.qwen3_moe``
and ``transformers.integrations.moe.grouped_mm_experts_forward``. ``tests/learner/test_fastpath.py`` holds the
log-probs, the distributions and every gradient to transformers' within 1e-5 for several layouts (1e-4 compiled).
``liverl bench learn`` (``--transformers-forward``, ``--compile``) measures what it saves (``BENCHMARKS.md``).

Routing replay (``learner.replay``): the batch's ``route``, when it has one, gives the experts of the positions it
marks; ``_moe`` takes them instead of its top-k and their weights from its softmax at them.

Where it applies (``handles``): ``model_type == "qwen3_moe"`` (the demo's family and ``moe24m``), default RoPE, no
sliding window, no attention dropout, SiLU experts with a gate, fp32 weights. Anything else, and every
FSDP2-sharded model (its all-gathers run in module hooks this path would skip), goes through transformers' own
forward, as does everything with ``learner.fast_forward = false``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def handles(model) -> bool:
    """Whether ``token_logp`` computes what transformers' forward of ``model`` computes (the same operators; the
    test holds them within 1e-5)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) != "qwen3_moe":
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(cfg, "use_sliding_window", False):
        return False
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) != 0.0 or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 torch.distributed: only checked here

    if isinstance(model, FSDPModule):  # sharded (learner.dist.shard wraps the root): weights are gathered in hooks
        return False
    if next(model.parameters()).dtype != torch.float32:  # transformers upcasts inside its norms: not reproduced
        return False
    for layer in model.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if ex is not None and (
            getattr(ex, "has_bias", False)
            or getattr(ex, "is_transposed", False)
            or not getattr(ex, "has_gate", True)
            or getattr(ex, "_is_expert_parallel", False)
        ):
            return False
    return True


def prepare(model, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's rotary tables ``cos`` and ``sin_signed`` [R, 1, N, D] and its attention mask [R, 1, N, N] (True:
    may attend): causal within each packed sequence. A sequence starts where its position id restarts at 0, the
    rule transformers applies to packed rows (``masking_utils.find_packed_sequence_indices``). Refuses a batch in
    which one sample's entries (``row_BT``) span several rows.

    ``sin_signed`` is transformers' ``sin`` with its first half negated: ``rotate_half(q) * sin``, that is
    ``cat(-q2, q1) * sin``, is ``roll(q, D/2) * sin_signed`` to the bit (``_rope``), in one operator instead of four."""
    rope = model.model.rotary_emb
    pos = x["posid_RN"]
    freqs = pos[..., None].float() * rope.inv_freq.to(device=pos.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * rope.attention_scaling)[:, None]
    sin = (emb.sin() * rope.attention_scaling)[:, None]
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    p = pos.cpu().numpy()
    seq = np.cumsum(p == 0, axis=1)
    causal = np.tril(np.ones((p.shape[1], p.shape[1]), dtype=bool))
    mask = torch.from_numpy((seq[:, :, None] == seq[:, None, :]) & causal)[:, None].to(pos.device)
    row = x["row_BT"]
    if not bool((row == row[:, :1]).all()):  # the last layer's queries are gathered per sample (``_attention``)
        raise ValueError(
            "row_BT: a sample's positions span several packed rows; PolicyTrainer._collate keeps each in one"
        )
    return cos, sin, mask


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (``prepare``: ``sin_signed``)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


@dataclass(frozen=True)
class _Layer:
    """What a decoder layer's maths needs besides its tensors (constants to ``torch.compile``)."""

    eps: tuple[float, float, float, float]  # input norm, q norm, k norm, post-attention norm
    head_dim: int
    gqa: bool  # fewer KV heads than query heads (a bool, not a count: torch.compile keeps it a constant)
    scaling: float
    moe: bool
    top_k: int
    norm_topk: bool
    n_experts: int


@dataclass(frozen=True)
class _Spec:
    layers: tuple[_Layer, ...]
    final_eps: float
    padding_idx: int | None


def _spec_and_weights(model) -> tuple[_Spec, list]:
    """The model as constants and a flat list of its tensors (the compiled code guards on tensors, not modules)."""
    m = model.model
    layers, weights = [], [m.embed_tokens.weight]
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        moe = hasattr(mlp, "experts")
        gate = mlp.gate if moe else None
        layers.append(
            _Layer(
                eps=(
                    layer.input_layernorm.variance_epsilon,
                    a.q_norm.variance_epsilon,
                    a.k_norm.variance_epsilon,
                    layer.post_attention_layernorm.variance_epsilon,
                ),
                head_dim=a.head_dim,
                gqa=a.num_key_value_groups > 1,
                scaling=float(a.scaling),
                moe=moe,
                top_k=gate.top_k if moe else 0,
                norm_topk=bool(gate.norm_topk_prob) if moe else False,
                n_experts=mlp.experts.num_experts if moe else 0,
            )
        )
        weights += [
            layer.input_layernorm.weight,
            a.q_norm.weight,
            a.k_norm.weight,
            layer.post_attention_layernorm.weight,
        ]
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            weights += [proj.weight, proj.bias]
        if moe:
            weights += [gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj]
        else:
            weights += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    weights.append(m.norm.weight)
    return _Spec(tuple(layers), m.norm.variance_epsilon, m.embed_tokens.padding_idx), weights


def _attention(L: _Layer, w: list, h: torch.Tensor, cos, sin, mask, pick=None) -> torch.Tensor:
    """Qwen3-MoE attention; ``w``: q norm, k norm, then (weight, bias) of q, k, v, o. ``pick`` (each sample's row
    [B], the picked positions' places in the flattened [R*N] positions [B*T], and (B, T)): the queries at those
    positions only ([B, T, H] out instead of [R, N, H]). Each sample's T queries attend to its own row's keys and
    values, gathered to it, under their own rows of the mask."""
    R, N, _ = h.shape
    D = L.head_dim
    q_norm, k_norm, wq, bq, wk, bk, wv, bv, wo, bo = w
    k = _rope(_rms(F.linear(h, wk, bk).view(R, N, -1, D), k_norm, L.eps[2]).transpose(1, 2), cos, sin)
    v = F.linear(h, wv, bv).view(R, N, -1, D).transpose(1, 2)
    if pick is not None:  # per sample its T queries [B, heads, T, D] against its row's keys [B, heads, N, D]
        rows, at, (B, T) = pick
        h = h.reshape(R * N, -1).index_select(0, at)
        cos, sin = cos.reshape(R * N, D).index_select(0, at), sin.reshape(R * N, D).index_select(0, at)
        mask = mask.reshape(R * N, N).index_select(0, at).view(B, 1, T, N)
        k, v, R, N = k.index_select(0, rows), v.index_select(0, rows), B, T
        cos, sin = cos.view(B, 1, T, D), sin.view(B, 1, T, D)
    q = _rope(_rms(F.linear(h, wq, bq).view(R, N, -1, D), q_norm, L.eps[1]).transpose(1, 2), cos, sin)
    # GQA: SDPA's own (transformers repeats k and v with a mask; the same products, without the copies)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=L.scaling, enable_gqa=L.gqa)
    return F.linear(o.transpose(1, 2).reshape(R, N, -1), wo, bo)


@torch.library.custom_op("liverl::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as an operator ``torch.compile`` treats as opaque: its own shape function (torch's
    requires bf16 inputs while tracing, though the CPU kernel runs fp32) and its backward in grouped products."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # [M, K] x [E, K, N] -> [M, N]
        return a.new_empty((a.shape[0], b.shape[-1]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[-1]))  # [K, M] x [M, N] -> [E, K, N]: a weight's grad


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _moe(
    L: _Layer,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    h: torch.Tensor,
    traced: bool,
    replay: tuple[torch.Tensor, torch.Tensor] | None = None,
    seen: list | None = None,
):
    """Router (softmax, top-k, renormalised) and the experts as two grouped products over tokens sorted by expert.
    ``traced``: under ``torch.compile`` (the opaque ``grouped_mm``, and token counts of a fixed shape).

    ``replay`` (``learner.replay``): the given experts [n, K] and where they hold [n]; there the top-k indices are
    the given ones and their weights the softmax at them (renormalised as the model does): the router's own top-k
    values when it chose them itself. ``seen``: a list the experts each token went to are appended to."""
    logits = F.linear(h, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, L.top_k, dim=-1)
    if replay is not None:
        given, has = replay
        index = torch.where(has[:, None], given, index)
        weights = probs.gather(1, index)
    if seen is not None:
        seen.append(index.detach())
    if L.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    flat = index.reshape(-1)
    _, perm = torch.sort(flat)
    token = perm // L.top_k
    if traced:
        counts = torch.zeros(L.n_experts, dtype=torch.int64, device=h.device).index_add_(0, flat, torch.ones_like(flat))
        mm = grouped_mm
    else:
        counts, mm = torch.bincount(flat, minlength=L.n_experts), torch._grouped_mm
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = mm(h.index_select(0, token), gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    y = mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
    y = y * weights.reshape(-1).index_select(0, perm)[:, None]
    return torch.zeros_like(h).index_add_(0, token, y)


def _tables(model, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's rotary tables and mask, kept in ``x["fastpath"]`` for the next model of the same rotary
    configuration (the policy and the reference share them)."""
    rope = model.model.rotary_emb
    key = (tuple(rope.inv_freq.tolist()), float(rope.attention_scaling))
    if x.get("fastpath", (None,))[0] != key:
        x["fastpath"] = (key, *prepare(model, x))
    return x["fastpath"][1:]


def _body(
    spec: _Spec,
    weights: list,
    ids,
    cos,
    sin,
    mask,
    row,
    col,
    route=None,
    traced: bool = False,
    seen: list | None = None,
) -> torch.Tensor:
    """The final hidden states at the positions ``row``, ``col`` ([B, T, H]). ``route``: the batch's routing to
    replay (``learner.replay.layout``: ``route_RNLK``, ``routed_RN``), or None; ``seen``: see ``_moe``."""
    h = F.embedding(ids, weights[0], spec.padding_idx)
    R, N, H = h.shape
    # the positions the loss reads: each sample's row [B] (all its entries lie in one row: ``prepare`` checks it)
    # and their places in the flattened [R*N] positions [B*T]
    pick = (row[:, 0], (row * N + col).reshape(-1), row.shape)
    if route is not None:  # per position: the given experts of every MoE layer, and whether they hold there
        route_PLK, routed_P = route[0].reshape(R * N, *route[0].shape[2:]), route[1].reshape(R * N)
    moe_at = 0  # the MoE layers' ordinal: a routing blob leaves dense layers out
    at = 1
    for i, L in enumerate(spec.layers):
        w_in, q_norm, k_norm, w_post = weights[at : at + 4]
        attn = [q_norm, k_norm, *weights[at + 4 : at + 12]]
        a, b, c = weights[at + 12 : at + 15]
        at += 15
        if i < len(spec.layers) - 1:
            h = h + _attention(L, attn, _rms(h, w_in, L.eps[0]), cos, sin, mask)
        else:  # the last layer past its keys and values: only the positions the loss reads (each token's MLP and
            # residual are its own), as the output head does; [R, N, H] -> [B, T, H]
            attn_BTH = _attention(L, attn, _rms(h, w_in, L.eps[0]), cos, sin, mask, pick=pick)
            h = h.reshape(R * N, H).index_select(0, pick[1]).view(attn_BTH.shape) + attn_BTH
        n = _rms(h, w_post, L.eps[3])
        shape, n = n.shape, n.reshape(-1, H)
        if L.moe:
            replay = None
            if route is not None:  # the last layer runs at the picked positions only: its routing is picked too
                given, has = route_PLK[:, moe_at], routed_P
                if i == len(spec.layers) - 1:
                    given, has = given.index_select(0, pick[1]), has.index_select(0, pick[1])
                replay = (given, has)
            y = _moe(L, a, b, c, n, traced, replay, seen)
            moe_at += 1
        else:
            y = F.linear(F.silu(F.linear(n, a)) * F.linear(n, b), c)
        h = h + y.view(shape)
    return _rms(h, weights[at], spec.final_eps)


_compiled = None  # _body under torch.compile, made at the first call that asks for it


def token_logp(model, x: dict, compiled: bool = False, seen: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``PolicyTrainer._token_logp`` for a model ``handles`` accepts: ``logp_BT`` and ``logprobs_BTV``. The output
    head runs (as a module, so its hooks see it) on the completion positions only. The batch's ``route``, when it
    has one, is replayed (``learner.replay``). ``seen`` (eager only): a list each MoE layer appends the experts its
    positions went to ([R*N, K]; the last layer's: the picked positions' [B*T, K]).

    ``compiled`` (``learner.compile``): the same code under ``torch.compile(dynamic=True)``, which fuses the
    elementwise chains (norms, rotary, gating) and their backward into a few generated kernels. The first call for
    grad mode compiles (measured: 1-2 minutes on a 2-core machine; inductor keeps the result on disk, and a later
    process loads it in 10-20 s); the log-probs agree with the eager path within 1e-4 (reductions reordered). The policy
    and the reference share the compiled code (it takes their weights as inputs), and the reference is compiled too: an
    eager reference against a compiled policy differs by ~1e-5 in log-probs, so their KL would not be 0 at equal
    weights."""
    cos, sin, mask = _tables(model, x)
    spec, weights = _spec_and_weights(model)
    args = (spec, weights, x["ids_RN"], cos, sin, mask, x["row_BT"], x["col_BT"], x.get("route"))
    if not compiled:
        h_BTH = _body(*args, seen=seen)
    else:
        global _compiled
        if _compiled is None:
            import torch._inductor.config as inductor  # noqa: PLC0415 only with learner.compile

            inductor.compile_threads = 1  # in this thread: no pool of compile workers left behind on a shared box
            _compiled = torch.compile(_body, dynamic=True)
        h_BTH = _compiled(*args, traced=True)
    logprobs_BTV = torch.log_softmax(model.get_output_embeddings()(h_BTH).float(), dim=-1)
    return torch.gather(logprobs_BTV, 2, x["tgt_BT"][..., None]).squeeze(-1), logprobs_BTV
