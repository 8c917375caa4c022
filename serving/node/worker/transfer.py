"""``liverl_delta``: liverl's delta codec as a vLLM weight-transfer backend, driven by vLLM's own RL endpoints.

vLLM 0.32 selects a worker-side weight-transfer engine by name (``--weight-transfer-config '{"backend": ...}'``)
from ``vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory``, whose ``register_engine`` takes
out-of-tree engines; the built-in ones are registered in that same module. ``serving.node.worker.plugin.register``
is liverl's registration. It runs in every vLLM process through two of vLLM's own extension points:

- the ``vllm.general_plugins`` entry point ``liverl_delta`` (``pyproject.toml``): vLLM's plugin loader calls it in
  the API server and in each worker before the model loads (``WorkerWrapperBase.init_worker``), so any vLLM of an
  environment where liverl is installed can serve with ``"backend": "liverl_delta"``, liverl's worker extension or
  not;
- importing liverl's worker extension (``--worker-extension-cls``, as ``liverl serve`` starts its node), which works
  from a source checkout whose package metadata was not rebuilt.

The engine is then driven through vLLM's endpoints (``VLLM_SERVER_DEV_MODE=1``), or the same calls on the engine
client in process (``serving.node.swap`` with ``via: "vllm"``):

1. ``POST /init_weight_transfer_engine {"init_info": {"expect_checksum": "..."}}`` (optional field): loads the
   shadow of the served weights (the model folder, checked against a read-back of the live weights) and refuses
   to start when they are not the weights named.
2. ``POST /pause?mode=keep``, ``POST /start_weight_update``.
3. ``POST /update_weights {"update_info": {"deltas": [[path, checksum_after], ...], "version": N}}``: the delta
   chain (files in ``LIVERL_NODE_DELTA_DIR`` only) is verified against the shadow, every arriving state hashed and
   compared with its ``checksum_after``, and only then are the changed tensors written, read back from the live
   weights and checked tensor by tensor (a mismatch writes the previous values back and fails the call). A chain
   staged beforehand by the extension's ``liverl_stage`` (decoded in a thread while generation went on) is
   committed as it is; any other chain is decoded here, inside the call.
4. ``POST /finish_weight_update {"weight_version": "N"}``: labels every token sampled from then on; ``POST
   /resume``.

What vLLM's endpoints cannot give back is the bit-exact check of the whole served state against the registry's
checksum (``/weight_checker`` hashes vLLM's own parameters: fused, padded and prepacked, under vLLM's names): that
stays the extension's ``liverl_checksum`` (docs/serving.md, "vLLM's weight-update API").

On CPU the engine needs the plain linear weights next to their packed kernels (``layout.install_cpu_patches``,
installed by the plugin for a vLLM whose config names this backend). Tensor parallel size 1, as the read-back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from serving.node.worker.extension import _delta_file, _Stage, commit, served_checksum, state_of, take_stage
from serving.node.worker.layout import LIVERL_BACKEND

log = logging.getLogger("liverl.serving.transfer")

BACKEND = LIVERL_BACKEND


@dataclass
class LiverlDeltaInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``."""

    expect_checksum: str = ""
    """The checksum of the weights the caller believes served (registry checksum); empty: not checked."""


@dataclass
class LiverlDeltaUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: one whole delta chain."""

    deltas: list[list[str]] = field(default_factory=list)
    """``[[path, checksum_after], ...]``: delta files in the node's delta folder, each with the checksum of the
    weights it leads to; the last one is the target's."""
    version: int | None = None
    """The target's version (checked against the last delta's header when given)."""


class LiverlDeltaEngine(WeightTransferEngine[LiverlDeltaInitInfo, LiverlDeltaUpdateInfo]):
    """Applies liverl's XOR+zstd deltas in place; shares the shadow with liverl's worker extension (both keep it on
    the model object)."""

    init_info_cls = LiverlDeltaInitInfo
    update_info_cls = LiverlDeltaUpdateInfo
    supports_draft_weight_update = False  # one shadow: the target model's

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        if vllm_config.parallel_config.world_size != 1:
            raise ValueError(f"the {BACKEND} backend needs tensor and pipeline parallel size 1 (liverl's read-back)")
        self.model_dir = Path(vllm_config.model_config.model)
        self.last: dict[str, Any] = {}

    def _state(self):
        return state_of(self.model, self.model_dir)

    def init_transfer_engine(self, init_info: LiverlDeltaInitInfo) -> None:
        st = self._state()
        if init_info.expect_checksum:
            served = served_checksum(self.model, st)
            if served != init_info.expect_checksum:
                raise ValueError(
                    f"the served weights read back as {served[:12]}, not the expected "
                    f"{init_info.expect_checksum[:12]}: no delta would apply"
                )

    def start_weight_update(self) -> None:
        """Nothing to prepare: the deltas are written in place."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: ``receive_weights`` wrote and checked every changed tensor."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's base synchronizes ``torch.accelerator``, which raises on CPU (no accelerator); the writes here are
        synchronous on CPU, and CUDA is synchronized."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: LiverlDeltaUpdateInfo) -> None:
        if not update_info.deltas or any(len(d) != 2 or not d[1] for d in update_info.deltas):
            raise ValueError('update_info needs "deltas": [[path, checksum_after], ...] (at least one)')
        paths = [_delta_file(p) for p, _ in update_info.deltas]
        expects = [a for _, a in update_info.deltas]
        st = self._state()
        t0 = time.perf_counter()
        stage = take_stage(self.model)
        staged = stage is not None and stage.paths == paths and stage.expects == expects and stage.base == st.checksum
        if not staged:  # decode here, inside the call (and inside the caller's pause)
            stage = _Stage(st.checksum, paths, expects)
            stage.run(st)
        elif stage.thread is not None:
            stage.thread.join()
        if update_info.version is not None and stage.error is None and stage.version != update_info.version:
            raise ValueError(f"the deltas lead to version {stage.version}, not {update_info.version}")
        self.last = commit(self.model, st, stage, expects[-1])
        self.last.update(staged=staged, receive_ms=round((time.perf_counter() - t0) * 1e3, 3))
        log.info("liverl_delta: %s", self.last)

    def shutdown(self) -> None:
        """No connection to release."""
