"""The ``liverl_delta`` weight-transfer backend (``serving.node.worker.transfer``) in a stock CPU vLLM server, found
through liverl's ``vllm.general_plugins`` entry point and driven only through vLLM's own RL endpoints: no liverl
middleware, no liverl worker extension. The served weights are then checked against the registry's checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def _perturb(state: dict, seed: int, share: float = 0.1) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        x = v.float()
        mask = torch.rand(x.shape, generator=g) < share
        out[k] = torch.where(mask, x + 0.05 * x.std() * torch.randn(x.shape, generator=g), x).to(v.dtype)
    return out


def _plugin_dir(tmp_path: Path) -> Path:
    """What installing liverl puts in site-packages for vLLM's plugin loader: its entry points, read from
    pyproject.toml (the shared test environment's metadata may predate them)."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    info = tmp_path / "plugins" / "liverl_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: liverl-entry-points\nVersion: 0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in eps.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return info.parent


def _call(url: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


@pytest.mark.slow
def test_a_delta_pushed_through_vllms_update_endpoints_serves_the_registrys_checksum(tmp_path):
    pytest.importorskip("vllm")
    _swap_through_vllms_endpoints(tmp_path)


@pytest.mark.gpu
def test_the_backend_swaps_a_cuda_vllm_through_its_update_endpoints(tmp_path):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and vLLM's CUDA build (scripts/gpu_check.sh runs it)")
    _swap_through_vllms_endpoints(tmp_path)


def _swap_through_vllms_endpoints(tmp_path: Path) -> None:
    """Start vLLM with the backend (on whatever device its build serves), swap base -> child through its endpoints,
    and check the served weights, read back under the files' names, against the registry's checksums."""
    from deploy.registry.blobstore import LocalBlobStore
    from deploy.registry.registry import Registry
    from liverl.demo.base_policy import load_state_dict
    from liverl.testing.models import default_cache, ensure_test_model

    model_dir = ensure_test_model("qwen3_moe", default_cache())
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", LocalBlobStore(str(tmp_path / "blobs")))
    base_state = load_state_dict(model_dir)
    base = registry.init_base(base_state, str(model_dir))
    child = registry.add_candidate(
        _perturb(base_state, seed=1), parent=base.version, metrics={}, sample_offsets={}, learner_step=1
    )
    deltas = tmp_path / "deltas"
    deltas.mkdir()
    [blob] = registry.deltas_between(base.version, child.version)
    (deltas / "1.delta").write_bytes(blob)
    (deltas / "bad.delta").write_bytes(blob)
    registry.close()

    port = free_port()
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",  # vLLM's RL routes
        VLLM_PLUGINS="liverl_delta",  # only liverl's plugin, found through its entry point
        LIVERL_NODE_DELTA_DIR=str(deltas),
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(_plugin_dir(tmp_path)), os.environ.get("PYTHONPATH")])),
    )
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enforce-eager",
        "--generation-config",
        "vllm",
        "--weight-transfer-config",
        json.dumps({"backend": "liverl_delta"}),
    ]
    log_path = tmp_path / "vllm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 500
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                if _call(url + "/health", method="GET")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)

        def ok(path: str, body: dict | None = None, method: str = "POST") -> dict:
            status, out = _call(url + path, body, method)
            assert status == 200, (path, status, out, log_path.read_text()[-3000:])
            return out

        # the backend reads the served weights back under the files' names: they are the registry's base
        ok("/init_weight_transfer_engine", {"init_info": {"expect_checksum": base.checksum}})
        before = ok("/weight_checker", {"action": "checksum"})["checksums"]

        # a delta that does not lead where the caller says is refused before any write
        ok("/start_weight_update")
        status, _ = _call(url + "/update_weights", {"update_info": {"deltas": [[str(deltas / "bad.delta"), "0" * 64]]}})
        assert status != 200
        assert ok("/weight_checker", {"action": "compare", "baseline": before})["match"] is True

        # the swap, as vLLM's RL API runs one: pause (keep), start, update, finish with the version, resume
        ok("/pause?mode=keep")
        ok("/start_weight_update")
        ok("/update_weights", {"update_info": {"deltas": [[str(deltas / "1.delta"), child.checksum]], "version": 1}})
        ok("/finish_weight_update", {"weight_version": str(child.version)})
        ok("/resume")

        assert ok("/weight_info", method="GET") == {"weight_version": str(child.version)}
        compared = ok("/weight_checker", {"action": "compare", "baseline": before})
        assert compared["match"] is False and compared["mismatches"]  # vLLM's own digests saw the weights change
        # the whole served state, read back bit for bit, is the registry's child (and no longer its base)
        ok("/init_weight_transfer_engine", {"init_info": {"expect_checksum": child.checksum}})
        status, out = _call(url + "/init_weight_transfer_engine", {"init_info": {"expect_checksum": base.checksum}})
        assert status != 200, out
        completion = ok("/v1/completions", {"model": str(model_dir), "prompt": "a b", "max_tokens": 4})
        assert completion["choices"][0]["text"] is not None
        assert "Creating weight transfer engine: LiverlDeltaEngine" in log_path.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
