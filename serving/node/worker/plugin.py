"""liverl's vLLM plugin: registers the ``liverl_delta`` weight-transfer backend (``serving.node.worker.transfer``).

``register`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``): vLLM's plugin loader
(``vllm.plugins.load_general_plugins``) calls it in every vLLM process, in a worker before the model loads
(``WorkerWrapperBase.init_worker``). It stays light (vLLM's factory registers the engine by module path, imported
only when a worker creates it) and installs liverl's CPU linear patch, which acts only on a model whose vLLM config
names this backend or liverl's worker extension (``layout.liverl_serves``). liverl's worker extension calls it too,
so a node started from a checkout whose package metadata was not rebuilt has the backend as well.
"""

from __future__ import annotations

from serving.node.worker.layout import LIVERL_BACKEND, install_cpu_patches

ENGINE_MODULE = "serving.node.worker.transfer"
ENGINE_CLASS = "LiverlDeltaEngine"


def register() -> None:
    """Register ``liverl_delta`` with vLLM's ``WeightTransferEngineFactory`` and install the CPU patch; idempotent."""
    from vllm.distributed.weight_transfer.factory import (  # noqa: PLC0415 vllm: a plugin runs only inside vLLM
        WeightTransferEngineFactory,
    )

    # register_engine refuses a name twice, and the factory has no lookup but its registry
    if LIVERL_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(LIVERL_BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    install_cpu_patches()
