"""vLLM worker extension: in-place hot-swap of policy weights from a delta file, and a checksum of what is served.

Loaded inside the vLLM worker through ``--worker-extension-cls serving.worker_ext.LiverlWorkerExtension``; its
methods run there via ``collective_rpc`` (the node's dev endpoint ``POST /collective_rpc``, string arguments only,
so only a file path crosses HTTP, never a weight payload).

Why it is built this way:
- The worker keeps a *shadow* of the served weights under their HF names (bf16, read from the model dir at first
  use). ``deploy.delta.plan_delta`` verifies a delta against the shadow (base checksum, per-tensor checksums,
  corruption) and decodes the changed tensors BEFORE any weight changes; a refused delta leaves the node untouched.
- Changed tensors go into the live model through the model's own ``load_weights`` (which maps HF names onto vLLM's
  fused parameters: q/k/v -> qkv_proj, experts -> w13/w2), writing into the storage the kernels read.
- ``liverl_checksum`` does not trust the shadow: it reads the live parameters back, undoes the fusing (and the CPU
  MoE kernel's weight prepacking) to rebuild HF-named tensors, and hashes them with ``deploy.delta.checksum``. The
  checksum therefore proves that the bytes the kernels use equal the learner's weights, bit for bit.
- On CPU, vLLM normally prepacks linear weights into opaque oneDNN handles and drops the parameter. Packed weights
  can be neither updated in place nor read back, so on import this module makes linear layers keep their plain
  weight next to the packed copy; after an update the handles of the changed layers are rebuilt from the weights,
  and ``liverl_checksum`` also probes every packed kernel against its weight (a random input, bf16 tolerance).
  The CPU MoE prepack is a pure permutation of elements (checked at first use), so it is inverted exactly and
  the live expert tensors themselves are read back and written in place.

Every RPC returns a JSON-able dict with ``ok``; failures carry ``error`` instead of raising, so the caller gets a
clear message over HTTP and the engine keeps running.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("liverl.serving.worker_ext")

BASE_VERSION_ENV = "LIVERL_BASE_VERSION"


def _install_cpu_patches() -> None:
    """CPU backend: keep every linear layer's plain weight next to its prepacked kernel copy.

    vLLM's CPU path packs unquantized linear weights into oneDNN handles and frees the parameter; then the weights
    could neither be updated in place nor read back. Patched here (before the model loads, since the worker
    imports this module first) to pack with ``remove_weight=False``: the parameter stays the source of truth, and
    after an update ``_repack_cpu_linears`` rebuilds the handles of the layers that changed.
    """
    try:
        from vllm.platforms import current_platform
    except Exception:  # pragma: no cover - vLLM absent: nothing to patch
        return
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import linear as _linear

    lin_cls = _linear.UnquantizedLinearMethod
    if getattr(lin_cls, "_liverl_patched", False):
        return
    orig = lin_cls.process_weights_after_loading

    def keep_weight(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return orig(self, layer)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    lin_cls.process_weights_after_loading = keep_weight
    lin_cls._liverl_patched = True


def _repack_cpu_linears(model: torch.nn.Module, module_names: set[str]) -> int:
    """Rebuild the CPU GEMM kernels (oneDNN handles) of the named modules from their updated weights."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    modules = dict(model.named_modules())
    n = 0
    for name in module_names:
        mod = modules.get(name)
        if mod is not None and hasattr(mod, "cpu_linear") and not getattr(mod, "_cpu_skip_gemm_dispatch", False):
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            n += 1
    return n


def _check_cpu_kernels(model: torch.nn.Module) -> list[str]:
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


_install_cpu_patches()


# ---------------------------------------------------------------------------------------------- MoE weight layout


class _MoELayout:
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
            from vllm._custom_ops import cpu_prepack_moe_weight

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
        w13 = torch.cat([w13p[:, :i], w13p[:, ip:ip + i]], dim=1)
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
        w13p[:, :i], w13p[:, ip:ip + i] = w13[:, :i].cpu(), w13[:, i:].cpu()
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
    from vllm.platforms import current_platform

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


# ---------------------------------------------------------------------------------------------- read-back


def _read_served(model: torch.nn.Module, layouts: dict[str, _MoELayout]) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors rebuilt from the live vLLM parameters (inverse of the Qwen3(-MoE) fusing)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        raise RuntimeError("served-weight read-back supports tensor parallel size 1 only")
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        data = param.detach()
        if mod_name in layouts:
            if leaf == "w2_weight":
                continue  # emitted together with w13
            hf_prefix = mod_name.replace(".routed_experts", "")
            w13, w2 = layouts[mod_name].read()
            i = layouts[mod_name].intermediate
            for e in range(w13.shape[0]):
                out[f"{hf_prefix}.{e}.gate_proj.weight"] = w13[e, :i].contiguous()
                out[f"{hf_prefix}.{e}.up_proj.weight"] = w13[e, i:].contiguous()
                out[f"{hf_prefix}.{e}.down_proj.weight"] = w2[e].contiguous()
            continue
        if data.numel() == 0:
            raise RuntimeError(f"parameter {name} holds no data (packed away by the backend); cannot read it back")
        base = mod_name.rsplit(".", 1)[0]
        if mod_name.endswith("qkv_proj"):
            q = mod.num_heads * mod.head_size
            kv = mod.num_kv_heads * mod.head_size
            qd, kd, vd = torch.split(data, [q, kv, kv], dim=0)
            for hf, t in (("q_proj", qd), ("k_proj", kd), ("v_proj", vd)):
                out[f"{base}.{hf}.{leaf}"] = t.contiguous().cpu()
        elif mod_name.endswith("gate_up_proj"):
            g, u = torch.split(data, [data.shape[0] // 2] * 2, dim=0)
            out[f"{base}.gate_proj.{leaf}"] = g.contiguous().cpu()
            out[f"{base}.up_proj.{leaf}"] = u.contiguous().cpu()
        elif hasattr(mod, "org_vocab_size"):  # embeddings / LM head: drop vocab padding rows
            out[name] = data[: mod.org_vocab_size].contiguous().cpu()
        else:
            out[name] = data.contiguous().cpu()
    return out


# ---------------------------------------------------------------------------------------------- the extension


class _State:
    def __init__(self, shadow: dict[str, torch.Tensor], version: int, checksum: str, layouts: dict[str, _MoELayout]):
        self.shadow = shadow
        self.version = version
        self.checksum = checksum
        self.layouts = layouts
        self.swaps = 0


def _rpc(fn):
    """Run an RPC body; turn any failure into {"ok": False, "error": ...} (logged with its traceback)."""

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            result = fn(self, *args, **kwargs)
            result.setdefault("ok", True)
        except Exception as e:  # reported to the caller, never swallowed
            log.error("liverl %s failed: %s\n%s", fn.__name__, e, traceback.format_exc())
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["rpc_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return result

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class LiverlWorkerExtension:
    """Mixed into vLLM's worker class; every public method is callable through ``collective_rpc``."""

    def _liverl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _liverl_state(self) -> _State:
        st = self.__dict__.get("_liverl_st")
        if st is None:
            st = self._liverl_load_shadow()
            self.__dict__["_liverl_st"] = st
        return st

    def _liverl_load_shadow(self) -> _State:
        """Read the model dir's weights, check that they are exactly what the engine serves, keep them as shadow."""
        from safetensors.torch import load_file

        from deploy.delta import DTYPES, checksum, warm_up

        dtype_names = {d.torch: name for name, d in DTYPES.items()}
        model_dir = Path(self.vllm_config.model_config.model)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"no *.safetensors in {model_dir}")
        shadow: dict[str, torch.Tensor] = {}
        for f in files:
            shadow.update({k: v.contiguous() for k, v in load_file(str(f)).items()})
        model = self._liverl_model()
        layouts = {
            n: _MoELayout(m) for n, m in model.named_modules() if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")
        }
        version = int(os.environ.get(BASE_VERSION_ENV, "0"))
        served = _read_served(model, layouts)
        if set(served) != set(shadow):
            raise RuntimeError(
                f"read-back names differ from {model_dir}: missing {sorted(set(shadow) - set(served))[:5]}, "
                f"extra {sorted(set(served) - set(shadow))[:5]}"
            )
        bad = [n for n in shadow if served[n].dtype != shadow[n].dtype or not torch.equal(served[n], shadow[n])]
        if bad:
            raise RuntimeError(f"served weights differ from {model_dir} right after load (read-back broken?): {bad[:5]}")
        warm_up(tuple(sorted({dtype_names[t.dtype] for t in shadow.values() if t.dtype in dtype_names})))  # not mid-swap
        st = _State(shadow, version, checksum(shadow), layouts)
        log.info("liverl shadow loaded: %d tensors, version %d, checksum %s", len(shadow), version, st.checksum[:12])
        return st

    @_rpc
    def liverl_version(self) -> dict[str, Any]:
        """The version and checksum the shadow says is loaded (cheap; see liverl_checksum for the served truth)."""
        st = self._liverl_state()
        return {"version": st.version, "checksum": st.checksum, "swaps": st.swaps}

    @_rpc
    def liverl_checksum(self) -> dict[str, Any]:
        """Checksum of the weights the kernels actually read, rebuilt under HF names (bit-exact with the learner)."""
        from deploy.delta import checksum

        st = self._liverl_state()
        model = self._liverl_model()
        served = _read_served(model, st.layouts)
        bad = _check_cpu_kernels(model)
        if bad:
            raise RuntimeError(f"packed CPU kernels do not match their weights in {bad[:5]}")
        return {"checksum": checksum(served), "version": st.version, "shadow_checksum": st.checksum}

    @_rpc
    def liverl_apply_delta(self, blob_path: str, expect_checksum: str = "") -> dict[str, Any]:
        """Verify the delta at ``blob_path`` against the shadow, then write the changed tensors into the live model.

        Nothing changes unless verification passes. ``expect_checksum`` (optional) names the weights the caller
        wants to arrive at: if they are already loaded the call is a no-op (safe to repeat; an XOR delta applied
        twice would otherwise undo itself), and a delta leading elsewhere is refused. Returns the version and
        checksum now loaded.
        """
        from deploy.delta import DeltaError, plan_delta

        st = self._liverl_state()
        if expect_checksum and expect_checksum == st.checksum:
            return {"version": st.version, "from_version": st.version, "checksum": st.checksum,
                    "changed_tensors": 0, "noop": True}
        t0 = time.perf_counter()
        blob = Path(blob_path).read_bytes()
        plan = plan_delta(st.shadow, blob, known_checksum=st.checksum)  # raises DeltaError before any change
        if expect_checksum and plan.checksum != expect_checksum:
            raise DeltaError(f"delta leads to checksum {plan.checksum[:12]} (version {plan.version}), "
                             f"not the expected {expect_checksum[:12]}")
        t_plan = time.perf_counter()
        from_version = st.version
        changed = [(n, t) for n, t in plan]
        self._liverl_write(changed, st)
        for n, t in changed:
            st.shadow[n] = t
        st.version, st.checksum = plan.version, plan.checksum
        st.swaps += 1
        t1 = time.perf_counter()
        return {
            "version": st.version,
            "from_version": from_version,
            "checksum": st.checksum,
            "changed_tensors": len(changed),
            "plan_ms": round((t_plan - t0) * 1e3, 3),
            "write_ms": round((t1 - t_plan) * 1e3, 3),
        }

    def _liverl_write(self, changed: list[tuple[str, torch.Tensor]], st: _State) -> None:
        """Push HF-named tensors into the live parameters with the model's own ``load_weights``."""
        if not changed:
            return
        model = self._liverl_model()
        layouts = [lay for n, lay in st.layouts.items() if any(c.startswith(n.replace(".routed_experts", "") + ".")
                                                                 for c, _ in changed)]
        for lay in layouts:
            lay.begin_write()
        try:
            with torch.no_grad():
                loaded = model.load_weights(iter(changed))
        except BaseException as e:
            for lay in layouts:  # expert tensors were written into copies: drop them
                lay.abort_write()
            try:  # other tensors may be half written: put the (unchanged) shadow values back
                with torch.no_grad():
                    model.load_weights(iter([(n, st.shadow[n]) for n, _ in changed]))
            except Exception as e2:
                raise RuntimeError(f"weight write failed ({e}) and restoring the previous weights failed too "
                                   f"({e2}): the node serves unknown weights") from e
            raise
        for lay in layouts:
            lay.end_write()
        if not loaded:
            raise RuntimeError("load_weights loaded nothing for the changed tensors")
        _repack_cpu_linears(model, {n.rpartition(".")[0] for n in loaded})
