"""How vLLM stores a model's weights, and how liverl reads them back under the file names.

vLLM loads a checkpoint through each model's own ``load_weights``: the model's ``hf_to_vllm_mapper`` renames
file names and stacks some of them into fused parameters (q/k/v -> ``qkv_proj`` with shard "q"/"k"/"v",
gate/up -> ``gate_up_proj`` with shard 0/1), and a MoE layer's ``RoutedExperts`` gathers expert tensors into
``w13_weight`` [E, 2I, H] (gate rows then up rows) and ``w2_weight`` [E, H, I], from per-expert tensors or
from tensors that already stack all experts. ``ServedLayout`` runs that mapping forwards on every file name
(vLLM's own mapper and expert mapping, nothing guessed from module names) to learn where each file tensor
lives, so it can read each one back exactly: a slice of a parameter, or a slice of a layer's experts.
A file name it cannot place is an error that names the architecture, before anything is served as verified.

On CPU two more layers hide the weights, both handled here:
- linear layers are prepacked into oneDNN handles and their parameter freed. ``install_cpu_patches`` makes
  them keep the plain weight next to the packed copy (the parameter stays the source of truth); after an
  update ``repack_cpu_linears`` rebuilds the handles of the changed layers, and ``check_cpu_kernels`` probes
  every packed kernel against its weight.
- the MoE kernel pads the intermediate dim and prepacks expert weights; the prepack is a pure permutation of
  elements (checked at first use), so ``MoELayout`` inverts it exactly and writes in place.

Tensor parallel size 1 and no expert parallelism: the read-back refuses anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------- CPU linears


def install_cpu_patches() -> None:
    """CPU backend: keep every linear layer's plain weight next to its prepacked kernel copy.

    vLLM's CPU path packs unquantized linear weights into oneDNN handles and frees the parameter; then the weights
    could neither be updated in place nor read back. Patched here (before the model loads: the worker imports
    liverl's extension, and vLLM's plugin loader runs ``serving.node.worker.transfer.register``, before it loads
    the model) to pack with ``remove_weight=False``, for a model whose engine liverl swaps (``liverl_serves``): a
    vLLM of the same environment that neither names liverl's worker extension nor the ``liverl_delta`` backend
    packs as it always does.
    """
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415 vllm: optional; absent, nothing to patch
    except ImportError:  # pragma: no cover - vLLM absent: nothing to patch
        return
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import linear as _linear  # noqa: PLC0415 vllm: CPU only

    lin_cls = _linear.UnquantizedLinearMethod
    if getattr(lin_cls, "_liverl_patched", False):
        return
    orig = lin_cls.process_weights_after_loading

    def keep_weight(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_cpu_skip_gemm_dispatch", False) or not liverl_serves():
            return orig(self, layer)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 vllm: CPU only

        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    lin_cls.process_weights_after_loading = keep_weight
    lin_cls._liverl_patched = True


LIVERL_BACKEND = "liverl_delta"  # the weight-transfer backend serving.node.worker.transfer registers
LIVERL_WORKER_PACKAGE = "serving.node.worker."  # where liverl's worker extension lives


def liverl_serves() -> bool:
    """Whether the model being loaded is one liverl swaps: vLLM's current config names liverl's worker extension or
    the ``liverl_delta`` weight-transfer backend (no current config: assumed, the safe side)."""
    from vllm.config import get_current_vllm_config_or_none  # noqa: PLC0415 vllm: only in the vLLM worker

    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return True
    wt = cfg.weight_transfer_config
    ext = cfg.parallel_config.worker_extension_cls or ""
    return (wt is not None and wt.backend == LIVERL_BACKEND) or ext.startswith(LIVERL_WORKER_PACKAGE)


def repack_cpu_linears(model: torch.nn.Module, module_names: set[str]) -> int:
    """Rebuild the CPU GEMM kernels (oneDNN handles) of the named modules from their updated weights."""
    from vllm.platforms import current_platform  # noqa: PLC0415 vllm: only in the vLLM worker

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: PLC0415 vllm: CPU only

    modules = dict(model.named_modules())
    # a weight shared with a changed module counts as changed: a tied lm_head reads the embedding's parameter
    changed = {
        p.data_ptr() for name in module_names if name in modules for p in modules[name].parameters(recurse=False)
    }
    n = 0
    for name, mod in modules.items():
        if not hasattr(mod, "cpu_linear") or getattr(mod, "_cpu_skip_gemm_dispatch", False):
            continue
        w = getattr(mod, "weight", None)
        if name in module_names or (isinstance(w, torch.Tensor) and w.data_ptr() in changed):
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            n += 1
    return n


def check_cpu_kernels(model: torch.nn.Module) -> list[str]:
    """Names of linear layers whose kernel (packed copy) does not compute ``x @ weight.T`` for a random probe."""
    bad = []
    gen = torch.Generator().manual_seed(0)
    for name, mod in model.named_modules():
        fn, w = getattr(mod, "cpu_linear", None), getattr(mod, "weight", None)
        if fn is None or not isinstance(w, torch.Tensor) or w.ndim != 2 or w.numel() == 0:
            continue
        x = torch.randn(3, w.shape[1], generator=gen).to(w.dtype)
        bias = getattr(mod, "bias", None)
        with torch.no_grad():
            got = fn(x, w, bias).float()
            ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * (ref.abs().max().item() + 1e-6)):
            bad.append(name)
    return bad


# ---------------------------------------------------------------------------------------------- MoE experts


class MoELayout:
    """Maps a RoutedExperts module's live w13/w2 tensors to and from vLLM's checkpoint layout.

    Checkpoint layout: w13 [E, 2*I, H] (gate rows then up rows), w2 [E, H, I]. The live tensors may be padded on
    the intermediate dim (CPU kernels align it) and prepacked (a fixed permutation of elements).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.intermediate = int(module.intermediate_size_per_partition)
        _e, two_ip, _h = module.w13_weight.shape
        self.padded = two_ip // 2
        self.isa = _cpu_moe_isa(module)
        self._perms: dict[tuple[int, ...], torch.Tensor] = {}
        if module.global_num_experts != module.local_num_experts:
            raise ValueError("expert parallelism is not supported by the liverl hot-swap (local != global experts)")

    def _perm(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Flat index map of the prepack: packed.flat[i] == unpacked.flat[perm[i]] (None: no prepack)."""
        if self.isa is None:
            return None
        if shape not in self._perms:
            from vllm._custom_ops import cpu_prepack_moe_weight  # noqa: PLC0415 vllm: CPU-only op

            n = 1
            for d in shape:
                n *= d
            idx = torch.arange(n, dtype=torch.int64)
            perm = torch.zeros(n, dtype=torch.int64)
            for k in range(max(1, (n - 1).bit_length() + 7) // 8):  # base-256 digits are exact in bf16
                digit = ((idx >> (8 * k)) & 255).to(torch.bfloat16).reshape(shape)
                perm += cpu_prepack_moe_weight(digit, self.isa).reshape(-1).to(torch.int64) << (8 * k)
            if not torch.equal(torch.sort(perm).values, idx):
                raise RuntimeError(f"CPU MoE prepack ({self.isa}) is not a permutation for shape {shape}")
            probe = torch.randn(shape).to(torch.bfloat16)
            if not torch.equal(cpu_prepack_moe_weight(probe, self.isa).reshape(-1), probe.reshape(-1)[perm]):
                raise RuntimeError(f"CPU MoE prepack ({self.isa}) is not a fixed permutation for shape {shape}")
            self._perms[shape] = perm
        return self._perms[shape]

    def _unpack(self, live: torch.Tensor) -> torch.Tensor:
        perm = self._perm(tuple(live.shape))
        if perm is None:
            return live.detach().clone()
        flat = torch.empty(live.numel(), dtype=live.dtype)
        flat[perm] = live.detach().reshape(-1).cpu()
        return flat.reshape(live.shape)

    def _pack(self, unpacked: torch.Tensor) -> torch.Tensor:
        perm = self._perm(tuple(unpacked.shape))
        return unpacked if perm is None else unpacked.reshape(-1)[perm].reshape(unpacked.shape)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in checkpoint layout, copied from the live tensors."""
        w13p = self._unpack(self.module.w13_weight)
        w2p = self._unpack(self.module.w2_weight)
        i, ip = self.intermediate, self.padded
        w13 = torch.cat([w13p[:, :i], w13p[:, ip : ip + i]], dim=1)
        return w13.cpu(), w2p[:, :, :i].contiguous().cpu()

    def begin_write(self) -> None:
        """Swap checkpoint-layout copies in as the parameters' data, so ``load_weights`` can write into them."""
        self._live = (self.module.w13_weight.data, self.module.w2_weight.data)
        w13, w2 = self.read()  # on CPU; moved to the parameters' device for the weight loaders
        self.module.w13_weight.data = w13.to(self._live[0].device)
        self.module.w2_weight.data = w2.to(self._live[1].device)

    def end_write(self) -> None:
        """Pad and pack the written copies back into the original live storage (kernels keep their pointers)."""
        live13, live2 = self._live
        w13, w2 = self.module.w13_weight.data, self.module.w2_weight.data
        i, ip = self.intermediate, self.padded
        w13p = torch.zeros(live13.shape, dtype=live13.dtype)
        w13p[:, :i], w13p[:, ip : ip + i] = w13[:, :i].cpu(), w13[:, i:].cpu()
        w2p = torch.zeros(live2.shape, dtype=live2.dtype)
        w2p[:, :, :i] = w2.cpu()
        live13.copy_(self._pack(w13p))
        live2.copy_(self._pack(w2p))
        self.module.w13_weight.data, self.module.w2_weight.data = live13, live2
        del self._live

    def abort_write(self) -> None:
        self.module.w13_weight.data, self.module.w2_weight.data = self._live
        del self._live


def _cpu_moe_isa(module: torch.nn.Module) -> str | None:
    """The ISA string of the CPU MoE kernel that prepacked this layer's weights, or None if not prepacked."""
    from vllm.platforms import current_platform  # noqa: PLC0415 vllm: only in the vLLM worker

    if not current_platform.is_cpu():
        return None
    kernel = getattr(module.quant_method, "moe_kernel", None)
    experts = None
    for holder in (kernel, getattr(kernel, "impl", None)):
        experts = getattr(holder, "fused_experts", None) or experts
    if experts is None:
        raise RuntimeError("cannot find the CPU MoE experts kernel to learn its weight layout")
    if getattr(experts, "_use_zentorch", False):
        return None
    isa = getattr(experts, "isa", None)
    if not isinstance(isa, str):
        raise RuntimeError(f"unsupported CPU MoE experts kernel {type(experts).__name__} (no isa)")
    return isa


# ---------------------------------------------------------------------------------------------- file names


def _mappers(model: torch.nn.Module) -> list[tuple[str, object]]:
    """(name prefix, WeightsMapper) pairs that the model's ``load_weights`` applies: its own, else its children's.

    Some models (Mixtral, Qwen3-MoE) carry the mapper at the top; others (Granite-MoE) only on the inner model,
    whose ``load_weights`` maps names relative to it.
    """
    top = getattr(model, "hf_to_vllm_mapper", None)
    if top is not None:
        return [("", top)]
    return [
        (f"{name}.", m)
        for name, child in model.named_children()
        if (m := getattr(child, "hf_to_vllm_mapper", None)) is not None
    ]


@dataclass(frozen=True)
class _Slot:
    """Where one file tensor lives: rows [start, start+size) of a parameter, or a slice of a MoE layer's experts."""

    param: str = ""  # a parameter's name (non-expert weights)
    start: int = 0
    size: int | None = None  # None: all rows
    moe: str = ""  # a MoE runner's module name (expert weights)
    which: str = ""  # "w13" | "w2"
    expert: int | None = None  # one expert, or None: the stacked tensor of every expert
    half: int | None = None  # w13 only: 0 gate rows, 1 up rows, None both
    transposed: bool = False  # stacked checkpoint tensor stored as [E, in, out]


class ServedLayout:
    """Where each file-named weight lives in a loaded vLLM model; reads them all back, bit-exact.

    ``files`` maps every file name to its tensor (only names and shapes are used). Raises ValueError naming
    the architecture when a file name cannot be placed or a parameter would be left unaccounted for.
    """

    def __init__(self, model: torch.nn.Module, files: Mapping[str, torch.Tensor]):
        from vllm.distributed import get_tensor_model_parallel_world_size  # noqa: PLC0415 vllm: only in the vLLM worker

        if get_tensor_model_parallel_world_size() != 1:
            raise RuntimeError("served-weight read-back supports tensor parallel size 1 only")
        self.model = model
        self.arch = type(model).__name__
        self.mappers = _mappers(model)
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.moe: dict[str, MoELayout] = {}  # runner name (the layer_name its weights are loaded under) -> layout
        self._expert_params: set[str] = set()
        for name, mod in self.modules.items():
            if hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight"):
                self.moe[getattr(mod, "layer_name", name.removesuffix(".routed_experts"))] = MoELayout(mod)
                self._expert_params |= {f"{name}.{p}" for p, _ in mod.named_parameters()}
        self.slots = {name: self._place(name, t) for name, t in files.items()}
        self._check_coverage()

    # -- planning ------------------------------------------------------------------------------------------
    def _fail(self, msg: str) -> ValueError:
        return ValueError(f"liverl cannot read back the weights vLLM serves for {self.arch}: {msg}")

    def _map(self, name: str) -> tuple[str, object]:
        """The parameter name (and shard) vLLM loads the file tensor ``name`` into, by the model's own mapper."""
        for prefix, mapper in self.mappers:
            if name.startswith(prefix):
                mapped = mapper._map_name_with_shard(name[len(prefix) :])
                if mapped is None:
                    raise self._fail(f"vLLM ignores the file tensor {name!r}, so it cannot be served or verified")
                return prefix + mapped[0], mapped[1]
        return name, None

    def _place(self, name: str, t: torch.Tensor) -> _Slot:
        vname, shard = self._map(name)
        for runner, lay in self.moe.items():
            if vname.startswith(runner + "."):
                return self._place_expert(name, vname, t, runner, lay)
        param = self.params.get(vname)
        if param is None:
            raise self._fail(f"file tensor {name!r} maps to {vname!r}, which is no parameter of the model")
        mod = self.modules[vname.rpartition(".")[0]]
        if shard is None:
            rows = getattr(mod, "org_vocab_size", None)  # embeddings / LM head: vocab padding rows are dropped
            size = rows if rows is not None and rows < param.shape[0] else None
            return _Slot(param=vname, size=size)
        if isinstance(shard, str) and hasattr(mod, "_get_shard_offset_mapping"):  # q / k / v of a QKV linear
            return _Slot(
                param=vname,
                start=int(mod._get_shard_offset_mapping(shard)),
                size=int(mod._get_shard_size_mapping(shard)),
            )
        if isinstance(shard, int) and hasattr(mod, "output_sizes"):  # shard i of a merged column linear
            sizes = list(mod.output_sizes)
            return _Slot(param=vname, start=sum(sizes[:shard]), size=sizes[shard])
        raise self._fail(
            f"file tensor {name!r} is loaded as shard {shard!r} of {vname!r} ({type(mod).__name__}), "
            f"a layout the read-back does not know"
        )

    def _place_expert(self, name: str, vname: str, t: torch.Tensor, runner: str, lay: MoELayout) -> _Slot:
        routed = lay.module
        if not routed.moe_config.is_act_and_mul:
            raise self._fail(f"{runner}: non-gated experts are not supported")
        qual = f"{routed.layer_name}.{vname[len(runner) + 1 :]}"
        matches = [m for m in routed.get_expert_mapping(include_fused=True) if m[1] in qual]
        if not matches:
            raise self._fail(f"file tensor {name!r} matches none of {runner}'s expert names")
        _, _, expert_id, shard_id = matches[0]
        which = "w2" if shard_id == "w2" else "w13"
        half = None if shard_id == "w2" else (0 if shard_id == "w1" else 1)
        if t.dim() == 3:  # every expert stacked in one tensor (gate and up together for w13)
            return _Slot(moe=runner, which=which, transposed=bool(routed.is_fused_checkpoint_transposed))
        if which == "w13" and any(f".{fused}." in qual for fused in ("gate_up_proj", "w13")):
            return _Slot(moe=runner, which=which, expert=int(expert_id))  # one expert's gate and up rows
        return _Slot(moe=runner, which=which, expert=int(expert_id), half=half)

    def _check_coverage(self) -> None:
        """Every parameter (and every expert) is read back from some file tensor: nothing served goes unverified."""
        rows: dict[str, int] = {}
        for s in self.slots.values():
            if s.param:
                p = self.params[s.param]
                rows[s.param] = rows.get(s.param, 0) + (p.shape[0] - s.start if s.size is None else s.size)
        missing = []
        for n, p in self.params.items():
            if n in self._expert_params:
                continue
            mod = self.modules[n.rpartition(".")[0]]
            want = getattr(mod, "org_vocab_size", None) or p.shape[0]
            if rows.get(n, 0) < min(want, p.shape[0]):
                missing.append(n)
        for runner, lay in self.moe.items():
            n_exp = lay.module.w13_weight.shape[0]
            for which, halves in (("w13", (0, 1)), ("w2", (None,))):
                seen = {(s.expert, s.half) for s in self.slots.values() if s.moe == runner and s.which == which}
                if (None, None) not in seen and not all(
                    (e, h) in seen or (e, None) in seen for e in range(n_exp) for h in halves
                ):
                    missing.append(f"{runner}.{which}")
        if missing:
            raise self._fail(f"no file tensor is read back into {missing[:5]} ({len(missing)} parameters)")

    # -- reading -------------------------------------------------------------------------------------------
    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Every file tensor (or only ``names``) rebuilt from the live parameters (bf16, file names), on CPU."""
        slots = self.slots if names is None else {n: self.slots[n] for n in names}
        runners = {s.moe for s in slots.values() if not s.param}
        experts = {
            runner: dict(zip(("w13", "w2"), lay.read(), strict=True))
            for runner, lay in self.moe.items()
            if runner in runners
        }
        out: dict[str, torch.Tensor] = {}
        for name, s in slots.items():
            if s.param:
                data = self.params[s.param].detach()
                if data.numel() == 0:
                    raise RuntimeError(f"parameter {s.param} holds no data (packed away by the backend)")
                end = data.shape[0] if s.size is None else s.start + s.size
                # the CPU backend's small-GEMM kernels (sgl, on AMX CPUs) keep a linear's bias in fp32: converted
                # from the bf16 file, so casting back is exact
                out[name] = data[s.start : end].to(torch.bfloat16).contiguous().cpu()
                continue
            t = experts[s.moe][s.which]
            if s.expert is not None:
                t = t[s.expert]
                if s.half is not None:
                    i = t.shape[0] // 2
                    t = t[:i] if s.half == 0 else t[i:]
            elif s.transposed:
                t = t.transpose(1, 2)
            out[name] = t.contiguous()
        return out

    def moe_layouts_for(self, names: Iterable[str]) -> list[MoELayout]:
        """The MoE layers that writing the named file tensors touches."""
        runners = {self.slots[n].moe for n in names if n in self.slots and self.slots[n].moe}
        return [self.moe[r] for r in sorted(runners)]
