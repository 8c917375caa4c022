"""vLLM worker extension: in-place hot-swap of policy weights from a delta file, and a checksum of what is served.

Loaded inside the vLLM worker through ``--worker-extension-cls serving.node.worker.extension.LiverlWorkerExtension``;
its methods run there via ``collective_rpc`` (the node's dev endpoint ``POST /collective_rpc``, string arguments only,
so only a file path crosses HTTP, never a weight payload).

Why it is built this way:
- The worker keeps a *shadow* of the served weights under their file names (bf16, read from the model dir's
  safetensors at first use). ``deploy.registry.delta.plan_delta`` verifies a delta against the shadow (base checksum,
  per-tensor checksums, corruption) and decodes the changed tensors BEFORE any weight changes; a refused delta
  leaves the node untouched.
- Changed tensors go into the live model through the model's own ``load_weights`` (which maps file names onto
  vLLM's fused parameters: q/k/v -> qkv_proj, experts -> w13/w2), writing into the storage the kernels read.
- ``liverl_checksum`` does not trust the shadow: ``serving.node.worker.layout.ServedLayout`` reads the live parameters
  back under the file names (inverting vLLM's name mapping, fusing, padding and the CPU kernels' prepacking), and
  they are hashed with ``deploy.registry.delta.checksum``. The checksum therefore proves that the bytes the kernels use
  equal the learner's weights, bit for bit. A model whose weights cannot be placed that way is refused at the
  first RPC, with its architecture named.
- On CPU, linear layers keep their plain weight next to the packed oneDNN copy (patched on import, see
  ``serving.node.worker.layout``); after an update the changed layers' handles are rebuilt, and ``liverl_checksum``
  also probes every packed kernel against its weight (a random input, bf16 tolerance).

``liverl_routing_start`` / ``liverl_routing``: the router's choices of every request, captured per position for the
learner's routing replay (``serving.node.worker.routing``).

Every RPC returns a JSON-able dict with ``ok``; failures carry ``error`` instead of raising, so the caller gets a
clear message over HTTP and the engine keeps running.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from deploy.registry.container import combine_checksums, tensor_checksum
from deploy.registry.delta import DTYPES, DeltaError, checksum, plan_delta, warm_up
from serving.node.worker.layout import ServedLayout, check_cpu_kernels, install_cpu_patches, repack_cpu_linears

log = logging.getLogger("liverl.serving.worker_ext")

BASE_VERSION_ENV = "LIVERL_BASE_VERSION"


install_cpu_patches()  # before the model loads: the worker imports this module first


# ---------------------------------------------------------------------------------------------- the extension


class _State:
    def __init__(self, shadow: dict[str, torch.Tensor], version: int, checksum: str, layout: ServedLayout):
        self.shadow = shadow
        self.version = version
        self.checksum = checksum
        self.layout = layout
        self.swaps = 0
        self._sums: dict[str, str] | None = None  # per-tensor checksums of the shadow, kept current by each swap

    def tensor_sums(self) -> dict[str, str]:
        if self._sums is None:
            self._sums = {n: tensor_checksum(t) for n, t in self.shadow.items()}
        return self._sums


class _Stage:
    """A chain of deltas verified and decoded off the engine's path: the tensors it changes (their final values),
    the version and checksum it arrives at, and every tensor's checksum there."""

    def __init__(self, base: str, paths: list[Path], expects: list[str]):
        self.base = base
        self.paths = paths
        self.expects = expects
        self.thread: threading.Thread | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.sums: dict[str, str] = {}
        self.version = -1
        self.checksum = ""
        self.error: str | None = None
        self.ms: float | None = None

    def run(self, st: _State) -> None:
        t0 = time.perf_counter()
        try:
            view = dict(st.shadow)  # the weights each delta applies to (shadow tensors are never written in place)
            sums, cur = dict(st.tensor_sums()), self.base
            for path, expect in zip(self.paths, self.expects, strict=True):
                plan = plan_delta(view, path.read_bytes(), known_checksum=cur)
                if plan.checksum != expect:
                    raise DeltaError(
                        f"{path.name} leads to checksum {plan.checksum[:12]} (version {plan.version}), "
                        f"not the expected {expect[:12]}"
                    )
                for n, t in plan:
                    view[n] = self.tensors[n] = t
                    sums[n] = tensor_checksum(t)
                if combine_checksums(sums) != expect:
                    raise DeltaError(
                        f"the decoded weights of {path.name} hash to {combine_checksums(sums)[:12]}, "
                        f"not the expected {expect[:12]}"
                    )
                cur, self.version = expect, plan.version
            self.sums, self.checksum = sums, cur
        except Exception as e:  # noqa: BLE001 the staging thread's boundary: reported by liverl_staged / liverl_commit
            log.error("liverl staging failed: %s\n%s", e, traceback.format_exc())
            self.error = f"{type(e).__name__}: {e}"
        self.ms = round((time.perf_counter() - t0) * 1e3, 3)


def _rpc(fn):
    """Run an RPC body; turn any failure into {"ok": False, "error": ...} (logged with its traceback)."""

    def wrapper(self, *args, **kwargs):
        t_wall = time.time()  # when the engine core ran it (a swap's profile places the pause with it)
        t0 = time.perf_counter()
        try:
            result = fn(self, *args, **kwargs)
            result.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 the RPC boundary: reported to the caller, never swallowed
            log.error("liverl %s failed: %s\n%s", fn.__name__, e, traceback.format_exc())
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["rpc_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        result["t_wall"] = t_wall
        return result

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# ---------------------------------------------------------------------------------------------- shared state
# The state lives on the model object, so that the worker extension's RPCs and the ``liverl_delta`` weight-transfer
# engine (``serving.node.worker.transfer``), which vLLM hands the model but not the worker, share one shadow.

STATE_ATTR = "_liverl_st"
STAGE_ATTR = "_liverl_stage"


def state_of(model: torch.nn.Module, model_dir: Path) -> _State:
    """The swap state of ``model`` (its shadow loaded from ``model_dir`` and checked at first use)."""
    st = model.__dict__.get(STATE_ATTR)
    if st is None:
        st = model.__dict__[STATE_ATTR] = load_state(model, model_dir)
    return st


def load_state(model: torch.nn.Module, model_dir: Path) -> _State:
    """Read the model dir's weights, check that they are exactly what the engine serves, keep them as shadow."""
    dtype_names = {d.torch: name for name, d in DTYPES.items()}
    shadow: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        shadow.update({k: v.contiguous() for k, v in load_file(str(f)).items()})
    layout = ServedLayout(model, shadow)
    version = int(os.environ.get(BASE_VERSION_ENV, "0"))
    served = layout.read()
    bad = [n for n in shadow if served[n].dtype != shadow[n].dtype or not torch.equal(served[n], shadow[n])]
    if bad:
        raise RuntimeError(
            f"served weights differ from {model_dir} right after load (read-back broken, or the "
            f"files are not bf16?): {bad[:5]}"
        )
    warm_up(tuple(sorted({dtype_names[t.dtype] for t in shadow.values() if t.dtype in dtype_names})))  # not mid-swap

    sums = {n: tensor_checksum(t) for n, t in shadow.items()}
    st = _State(shadow, version, combine_checksums(sums), layout)
    st._sums = sums
    log.info("liverl shadow loaded: %d tensors, version %d, checksum %s", len(shadow), version, st.checksum[:12])
    return st


def start_stage(model: torch.nn.Module, st: _State, paths: list[Path], expects: list[str]) -> _Stage:
    """Verify and decode a chain of deltas in a background thread (replacing any earlier stage of ``model``)."""
    stage = _Stage(st.checksum, paths, list(expects))
    stage.thread = threading.Thread(target=stage.run, args=(st,), name="liverl-stage", daemon=True)
    model.__dict__[STAGE_ATTR] = stage
    stage.thread.start()
    return stage


def take_stage(model: torch.nn.Module) -> _Stage | None:
    """The stage of ``model``, removed from it (a stage is committed at most once)."""
    return model.__dict__.pop(STAGE_ATTR, None)


def commit(model: torch.nn.Module, st: _State, stage: _Stage, expect_checksum: str) -> dict[str, Any]:
    """Inside the pause: write the staged tensors, read them back from the live weights and check each one's
    checksum, probe the CPU kernels, and make the staged state the shadow. Refused (nothing written) when the stage
    failed, leads elsewhere, or was planned on weights that are no longer served; a read-back mismatch writes the
    previous values back and raises."""
    if stage.thread is not None:
        stage.thread.join()
    if stage.error:
        raise RuntimeError(f"staging failed: {stage.error}")
    if stage.checksum != expect_checksum:
        raise RuntimeError(f"the staged deltas lead to {stage.checksum[:12]}, not {expect_checksum[:12]}")
    if st.checksum != stage.base:
        raise RuntimeError(f"staged on weights {stage.base[:12]}, but {st.checksum[:12]} are served")
    if st.checksum == expect_checksum:
        return {"version": st.version, "checksum": st.checksum, "changed_tensors": 0, "noop": True}
    t0 = time.perf_counter()
    changed = list(stage.tensors.items())
    write_weights(model, changed, st)
    t1 = time.perf_counter()
    back = st.layout.read(stage.tensors)
    bad = [n for n in stage.tensors if tensor_checksum(back[n]) != stage.sums[n]]
    bad_kernels = check_cpu_kernels(model)
    t2 = time.perf_counter()
    if bad or bad_kernels:  # put the previous values back (the shadow still holds them)
        write_weights(model, [(n, st.shadow[n]) for n, _ in changed], st)
        raise RuntimeError(
            f"written tensors read back wrong: {bad[:5]}; kernels off their weights: "
            f"{bad_kernels[:5]} (previous values written back)"
        )
    from_version = st.version
    for n, t in changed:
        st.shadow[n] = t
    st._sums = stage.sums
    st.version, st.checksum = stage.version, stage.checksum
    st.swaps += 1
    return {
        "version": st.version,
        "from_version": from_version,
        "checksum": st.checksum,
        "changed_tensors": len(changed),
        "stage_ms": stage.ms,
        "write_ms": round((t1 - t0) * 1e3, 3),
        "readback_ms": round((t2 - t1) * 1e3, 3),
    }


def served_checksum(model: torch.nn.Module, st: _State) -> str:
    """The checksum of the weights the kernels read, rebuilt under the files' names; raises if a CPU kernel is off
    its weight."""
    served = st.layout.read()
    bad = check_cpu_kernels(model)
    if bad:
        raise RuntimeError(f"packed CPU kernels do not match their weights in {bad[:5]}")
    return checksum(served)


def write_weights(model: torch.nn.Module, changed: list[tuple[str, torch.Tensor]], st: _State) -> None:
    """Push HF-named tensors into the live parameters with the model's own ``load_weights``."""
    if not changed:
        return
    layouts = st.layout.moe_layouts_for(n for n, _ in changed)
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
        except Exception as e2:  # noqa: BLE001 any failed restore leaves unknown weights: raised with both errors
            raise RuntimeError(
                f"weight write failed ({e}) and restoring the previous weights failed too "
                f"({e2}): the node serves unknown weights"
            ) from e
        raise
    for lay in layouts:
        lay.end_write()
    if not loaded:
        raise RuntimeError("load_weights loaded nothing for the changed tensors")
    repack_cpu_linears(model, {n.rpartition(".")[0] for n in loaded})


class LiverlWorkerExtension:
    """Mixed into vLLM's worker class; every public method is callable through ``collective_rpc``."""

    def _liverl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _liverl_state(self) -> _State:
        return state_of(self._liverl_model(), Path(self.vllm_config.model_config.model))

    @_rpc
    def liverl_version(self) -> dict[str, Any]:
        """The version and checksum the shadow says is loaded (cheap; see liverl_checksum for the served truth)."""
        st = self._liverl_state()
        return {"version": st.version, "checksum": st.checksum, "swaps": st.swaps}

    @_rpc
    def liverl_checksum(self) -> dict[str, Any]:
        """Checksum of the weights the kernels actually read, rebuilt under HF names (bit-exact with the learner)."""
        st = self._liverl_state()
        return {
            "checksum": served_checksum(self._liverl_model(), st),
            "version": st.version,
            "shadow_checksum": st.checksum,
        }

    @_rpc
    def liverl_apply_delta(self, blob_path: str, expect_checksum: str = "") -> dict[str, Any]:
        """Verify the delta at ``blob_path`` against the shadow, then write the changed tensors into the live model.

        Nothing changes unless verification passes. ``blob_path`` must lie in the agent's delta folder (the node's
        ``LIVERL_NODE_DELTA_DIR``): no other file is opened, and a refusal does not say whether the file exists.
        ``expect_checksum`` (required) names the weights the caller wants to arrive at: if they are already loaded
        the call is a no-op (safe to repeat; an XOR delta applied twice would otherwise undo itself), and a delta
        leading elsewhere is refused. Returns the version and checksum now loaded.
        """
        if not expect_checksum:
            raise ValueError("expect_checksum is required: name the weights this delta must lead to")
        path = _delta_file(blob_path)
        st = self._liverl_state()
        if expect_checksum == st.checksum:
            return {
                "version": st.version,
                "from_version": st.version,
                "checksum": st.checksum,
                "changed_tensors": 0,
                "noop": True,
            }
        t0 = time.perf_counter()
        blob = path.read_bytes()
        plan = plan_delta(st.shadow, blob, known_checksum=st.checksum)  # raises DeltaError before any change
        if plan.checksum != expect_checksum:
            raise DeltaError(
                f"delta leads to checksum {plan.checksum[:12]} (version {plan.version}), "
                f"not the expected {expect_checksum[:12]}"
            )
        # The header's claim is not enough (anyone can write a self-consistent header): hash what the weights will
        # be, the decoded copies with the unchanged shadow, and compare with the caller's checksum before writing.
        sums = dict(st.tensor_sums())
        sums.update({n: tensor_checksum(t) for n, t in plan})
        arriving = combine_checksums(sums)
        if arriving != expect_checksum:
            raise DeltaError(
                f"the decoded weights hash to {arriving[:12]}, not the expected {expect_checksum[:12]}: "
                "refused before any write"
            )
        t_plan = time.perf_counter()
        from_version = st.version
        changed = [(n, t) for n, t in plan]
        write_weights(self._liverl_model(), changed, st)
        for n, t in changed:
            st.shadow[n] = t
        st._sums = sums
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

    # -- staged swaps: verify and decode before the pause, only write inside it ------------------------------

    @_rpc
    def liverl_stage(self, blob_paths: list[str], expect_checksums: list[str]) -> dict[str, Any]:
        """Start verifying and decoding a chain of deltas in a background thread and return at once.

        The swap calls this BEFORE pausing the engine (``serving.node.swap``): decoding and hashing (most of a swap's
        work) then run beside generation, and the pause only writes (``liverl_commit``). Each delta is checked
        against the weights the previous one leads to, and each arriving state is hashed from its per-tensor sums
        and compared with ``expect_checksums[i]``, as ``liverl_apply_delta`` does. ``liverl_staged`` says when it is
        ready. A new stage replaces any earlier one."""
        if not blob_paths or len(blob_paths) != len(expect_checksums) or not all(expect_checksums):
            raise ValueError("liverl_stage needs one expected checksum per delta file")
        paths = [_delta_file(p) for p in blob_paths]
        st = self._liverl_state()
        start_stage(self._liverl_model(), st, paths, list(expect_checksums))
        return {"base_checksum": st.checksum}

    @_rpc
    def liverl_staged(self) -> dict[str, Any]:
        """Whether the staged chain is decoded (``ready``), and its error if it failed."""
        stage = self._liverl_model().__dict__.get(STAGE_ATTR)
        if stage is None:
            raise RuntimeError("nothing staged")
        ready = not stage.thread.is_alive()
        return {"ready": ready, "error": stage.error if ready else None, "stage_ms": stage.ms}

    @_rpc
    def liverl_commit(self, expect_checksum: str) -> dict[str, Any]:
        """Inside the pause: write the staged tensors, read them back from the live weights and check each one's
        checksum, probe the CPU kernels, and make the staged state the shadow. Refused (nothing written) when the
        stage failed, leads elsewhere, or was planned on weights that are no longer served.

        The read-back covers the tensors this swap wrote; the others were proved by the last full read-back
        (``liverl_checksum``, which the agent runs again right after the swap, outside the pause)."""
        stage = take_stage(self._liverl_model())
        if stage is None:
            raise RuntimeError("nothing staged")
        return commit(self._liverl_model(), self._liverl_state(), stage, expect_checksum)

    @_rpc
    def liverl_routing_start(self) -> dict[str, Any]:
        """Capture the router's choices of every request from now on (``serving.node.worker.routing``); idempotent."""
        cap = self.__dict__.get("_liverl_routing")
        if cap is None:
            from serving.node.worker.routing import RoutingCapture  # noqa: PLC0415 only where routing is recorded

            cap = self.__dict__["_liverl_routing"] = RoutingCapture(self.model_runner)
        return {"layers": cap.layer_ids, "experts": cap.n_experts, "top_k": cap.top_k}

    @_rpc
    def liverl_routing(self, keys: list[str], positions: list[int] | None = None) -> dict[str, Any]:
        """The routing of finished requests by their engine id less its random suffix (``RoutingCapture.take``),
        forgotten once read."""
        cap = self.__dict__.get("_liverl_routing")
        if cap is None:
            raise RuntimeError("routing capture is off: liverl_routing_start first")
        return {"routing": cap.take(list(keys), None if positions is None else [int(n) for n in positions])}


ENV_DELTA_DIR = "LIVERL_NODE_DELTA_DIR"


def _delta_file(blob_path: str) -> Path:
    """``blob_path`` resolved, if it is a file inside the delta folder; else a refusal that reveals nothing about it."""
    root = os.environ.get(ENV_DELTA_DIR, "")
    if not root:
        raise PermissionError(f"{ENV_DELTA_DIR} is not set: this node applies no delta files")
    base = Path(root).resolve()
    path = Path(blob_path).resolve()
    if not path.is_relative_to(base) or path == base:
        raise PermissionError(f"delta files are read only from {base}")
    return path


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files vLLM loaded from ``model_dir``: those its index lists, else the single file(s)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if any(Path(n).name != n for n in names):
            raise RuntimeError(f"{index} names shard files outside the model dir")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"no *.safetensors in {model_dir}")
    return files


def _register_backend() -> None:
    """The ``liverl_delta`` weight-transfer backend (``serving.node.worker.plugin``), for a node started from a
    checkout whose package metadata (its ``vllm.general_plugins`` entry point) was not rebuilt; idempotent."""
    try:
        import vllm.distributed.weight_transfer  # noqa: F401, PLC0415 vllm: optional where this module is imported
    except ImportError:  # pragma: no cover - vLLM absent (a tool reading ENV_DELTA_DIR): no engine to register
        return
    from serving.node.worker.plugin import register  # noqa: PLC0415 vllm: imported by register, in the worker

    register()


_register_backend()
