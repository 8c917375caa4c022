"""Launch one vLLM serving node: the stock OpenAI server, as a subprocess, with liverl's worker extension.

Why a subprocess running the stock server (``python -m vllm.entrypoints.openai.api_server``): the node is exactly
what an operator would run on a GPU box, so the gateway talks to it over HTTP only, and a crash of the engine is
contained and reported (with the tail of its log) instead of taking the gateway down.

Options that matter (all exact vLLM 0.32 names):
- ``VLLM_SERVER_DEV_MODE=1`` registers the dev and RL routes used for hot-swaps: ``POST /pause?mode=wait``,
  ``POST /resume``, ``POST /collective_rpc``, ``POST /reset_prefix_cache`` (also ``/is_paused``).
- ``--worker-extension-cls serving.worker_ext.LiverlWorkerExtension``: the hot-swap RPCs inside the worker.
- ``--logprobs-mode processed_logprobs``: logged log-probs are those of the distribution actually sampled from
  (after temperature / top-p), i.e. the behaviour policy the learner's importance ratios need.
- ``--generation-config vllm``: ignore sampling defaults in the model dir, so what the gateway logs is what ran.
- ``--kv-cache-memory-bytes``: a small, explicit KV cache (on CPU this also skips the warm-up profiling pass;
  ``VLLM_CPU_KVCACHE_SPACE`` is removed from the node's environment because it would override it).
- CPU only: ``--enforce-eager`` (start in seconds instead of a ~50 s inductor compile; the tiny model is
  overhead-bound anyway), ``OMP_NUM_THREADS`` = ``threads`` (default 1) and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  so the engine neither pins nor spins both cores of a small machine.

This module imports neither torch nor vLLM at import time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.serving.node")

SERVED_MODEL_NAME = "liverl"
WORKER_EXTENSION = "serving.worker_ext.LiverlWorkerExtension"
NODE_KEEPALIVE_S = 75  # the gateway's client pool keeps idle connections for less (serving.gateway)


class NodeError(RuntimeError):
    """The vLLM node could not start, or died."""


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when the installed vLLM is a CUDA build and a GPU is visible, else ``cpu``."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"serving.device must be auto, cpu or cuda, not {requested!r}")
    from importlib import metadata

    def installed(dist: str) -> bool:
        try:
            metadata.version(dist)
            return True
        except metadata.PackageNotFoundError:
            return False

    cpu_build = installed("vllm-cpu")
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if cpu_build or not installed("vllm"):
            raise ValueError("serving.device is cuda but the installed vLLM is not a CUDA build "
                             "(pip install 'liverl[gpu]', i.e. vllm==0.32.0, on a machine with a GPU)")
        return "cuda"
    if cpu_build:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def node_command(model_dir: Path, host: str, port: int, device: str, max_num_seqs: int, max_model_len: int,
                 kv_cache_bytes: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host, "--port", str(port),
        "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level", "warning",
    ]
    if device == "cpu":
        cmd.append("--enforce-eager")
    return cmd


def node_env(device: str, threads: int, base_version: int) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["LIVERL_BASE_VERSION"] = str(base_version)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["PYTHONUNBUFFERED"] = "1"
    # keep idle HTTP connections longer than the gateway's pool does, so the gateway never reuses a socket the
    # server is closing (that race shows up as "Server disconnected" under load with vLLM's 5 s default)
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(NODE_KEEPALIVE_S)
    if device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(threads)
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # idle OpenMP threads sleep instead of spinning
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # legacy knob; it would override --kv-cache-memory-bytes
    return env


@dataclass
class NodeHandle:
    """A running vLLM node. ``url`` is its OpenAI base URL (without ``/v1``)."""

    url: str
    model_dir: Path
    log_path: Path
    device: str
    proc: subprocess.Popen
    start_s: float
    _log_file: object = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_bytes: int = 6000) -> str:
        return _tail(self.log_path, n_bytes)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the node's process group (server + engine core), then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("vLLM node %s did not stop on SIGTERM; killing it", self.url)
        try:  # the engine core may outlive the server process: clear the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _tail(path: Path, n_bytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_bytes))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_node(cfg: LiverlConfig, model_dir: str | os.PathLike, log_path: str | os.PathLike, *,
               port: int | None = None, threads: int = 1, base_version: int = 0, max_model_len: int | None = None,
               kv_cache_bytes: int | None = None, ready_timeout_s: float = 300.0) -> NodeHandle:
    """Start ``vllm`` on ``model_dir`` and wait until it serves; raise ``NodeError`` with the log tail if it dies.

    ``base_version``: the registry version whose weights ``model_dir`` holds (0 for the base policy dir).
    """
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model dir (no config.json)")
    device = resolve_device(cfg.serving.device)
    if max_model_len is None:  # the model's own context length (the demo policy has 32), capped
        model_cfg = json.loads((model_dir / "config.json").read_text())
        max_model_len = min(int(model_cfg.get("max_position_embeddings", 512)), 4096)
    host, port = cfg.serving.host, port or cfg.serving.vllm_port
    kv = kv_cache_bytes or (256 << 20 if device == "cpu" else 1 << 30)
    cmd = node_command(model_dir, host, port, device, cfg.serving.max_num_seqs, max_model_len, kv)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")
    log_file.write(f"\n=== liverl: starting vLLM node: {' '.join(cmd)}\n".encode())
    log_file.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=node_env(device, threads, base_version), start_new_session=True,
                            cwd=str(Path(__file__).resolve().parent.parent))
    handle = NodeHandle(url=f"http://{host}:{port}", model_dir=model_dir, log_path=log_path, device=device,
                        proc=proc, start_s=0.0, _log_file=log_file)
    try:
        _wait_ready(handle, ready_timeout_s)
    except BaseException:
        handle.stop(timeout_s=5)
        raise
    handle.start_s = time.monotonic() - t0
    log.info("vLLM node ready at %s on %s in %.1f s (log %s)", handle.url, device, handle.start_s, log_path)
    return handle


def _wait_ready(handle: NodeHandle, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if handle.proc.poll() is not None:
            raise NodeError(f"vLLM node exited with code {handle.proc.returncode} before it was ready; "
                            f"log {handle.log_path}, last lines:\n{handle.log_tail()}")
        try:
            status, body = _get(handle.url + "/v1/models")
            if status == 200 and SERVED_MODEL_NAME in json.loads(body).get("data", [{}])[0].get("id", ""):
                return
        except (OSError, ValueError, IndexError):
            pass
        if time.monotonic() > deadline:
            raise NodeError(f"vLLM node not ready after {timeout_s:.0f} s; log {handle.log_path}, last lines:\n"
                            f"{handle.log_tail()}")
        time.sleep(0.25)
