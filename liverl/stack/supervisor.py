"""Run the pipeline's processes on one machine: what ``liverl up`` and ``liverl demo`` share.

A supervisor, not a shortcut: it starts the processes an operator would run (``liverl serve``,
``liverl ingest``, ``liverl learn``, ``liverl gate``), each with the whole resolved config in its environment,
writes their logs to ``<state_dir>/logs/<role>.log``, restarts one that exits (each resumes from its durable
state: learner checkpoint, committed offsets, registry), and stops them all on the way out.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, SecretStr

from core import keys, procs
from core.config import LiverlConfig
from core.services import LiverlError, signing_key_path, verify_key_path
from core.shred import ensure_kek
from deploy.registry.auditchain import ensure_audit_key
from deploy.registry.signing import Signer, announce, generate_keypair
from learner.model import load_state_dict
from liverl.stack.stack import Stack

log = logging.getLogger("liverl.supervisor")

ROLES = ("serve", "ingest", "learn", "gate")
SECTIONS = tuple(
    name
    for name, f in LiverlConfig.model_fields.items()
    if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
)
"""Every section of the config (``security`` included): a child sees all of them, so none is silently dropped."""


class SupervisorError(LiverlError):
    """A supervised process failed to start or kept crashing."""


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, n: int = 30) -> str:
        return "\n".join(procs.tail(self.log_path, 200 * n).splitlines()[-n:])


def section_json(section) -> str:
    """A config section as JSON with its secrets in clear (pydantic masks them): the environment of a child only."""
    data = section.model_dump(mode="json")
    for name, value in section:
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
    return json.dumps(data)


def child_env(cfg: LiverlConfig, stack: Stack, model_dir: Path) -> dict[str, str]:
    """The environment of a supervised process: the whole resolved config, one JSON value per section (so the
    child sees exactly what this process resolved from file, environment and flags), plus the live addresses."""
    resolved = cfg.model_copy(deep=True)
    resolved.broker.bootstrap = stack.bootstrap
    resolved.redis.url = stack.redis_url
    resolved.registry.url = stack.registry_url
    resolved.registry.blob_dir = str(stack.blob_dir)
    resolved.model.path = str(model_dir)
    resolved.model.cache_dir = str(cfg.model_cache_path)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LIVERL__")}
    env.pop("LIVERL_CONFIG", None)
    for section in SECTIONS:
        env[f"LIVERL__{section.upper()}"] = section_json(getattr(resolved, section))
    env["LIVERL__STATE_DIR"] = str(cfg.state_path)
    env["LIVERL__PRODUCT"] = resolved.product or "null"
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    return env


def roles_for(cfg: LiverlConfig) -> tuple[str, ...]:
    """The processes to run: one ``serve`` per node (``serve@<i>`` with several) and, then, the router in front."""
    n = cfg.serving.nodes
    if n <= 1:
        return ROLES
    return (*(f"serve@{i}" for i in range(n)), "route", "ingest", "learn", "gate")


def node_serving(serving: dict, i: int) -> dict:
    """Node ``i``'s serving section: its own name and ports, counted up from the configured ones."""
    return {
        **serving,
        "node_name": f"node-{i}",
        "gateway_port": serving["gateway_port"] + i,
        "vllm_port": serving["vllm_port"] + i,
        "agent_port": serving["agent_port"] + i if serving["agent_port"] else 0,  # 0: off on every node
        "advertise_url": None,
    }


def start_child(role: str, env: dict[str, str], log_dir: Path) -> Child:
    log_path = log_dir / f"{role.replace('@', '-')}.log"
    command, _, node = role.partition("@")
    if node:
        env = {**env, "LIVERL__SERVING": json.dumps(node_serving(json.loads(env["LIVERL__SERVING"]), int(node)))}
    return Child(role, procs.spawn([sys.executable, "-m", "liverl.cli", command], log_path, env), log_path)


def stop_children(children: list[Child], timeout: float = 20.0) -> None:
    procs.stop([(c.role, c.proc) for c in children], timeout)


def wait_http(url: str, timeout: float, children: list[Child], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if c.proc.poll() is not None:
                raise SupervisorError(
                    f"{c.role} exited with code {c.proc.returncode} while waiting for {what}:\n{c.tail()}"
                )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SupervisorError(f"{what} not ready at {url} after {timeout:.0f} s")


def ensure_keys(cfg: LiverlConfig) -> None:
    """Announcements are signed on one machine too: make ``<state_dir>/keys`` once, unless keys are configured. A
    configured key that is not there is an error here, before any process starts (not a silent "unsigned")."""
    for setting in ("signing_key", "verify_key"):
        path = getattr(cfg.security, setting)
        if path and not Path(path).is_file():
            raise ValueError(
                f"security.{setting} is {path}, which is not a file: point it at the key, or unset it "
                f"and `liverl up` makes a pair in {cfg.state_path / 'keys'}"
            )
    if signing_key_path(cfg) is None and verify_key_path(cfg) is None:
        generate_keypair(cfg.state_path / "keys")

    ensure_audit_key(cfg)  # the audit log's HMAC key, <state_dir>/keys/audit.key (0600) unless configured
    ensure_kek(cfg)  # the users' key-encryption key, <state_dir>/keys/shred.key (0600) unless configured


def init_registry(cfg: LiverlConfig, model_dir: Path, redis) -> int:
    """Register the model dir's weights as version 0 when the registry is empty, and announce the stable version
    when nothing is announced yet. Returns the stable version."""
    from deploy.registry.registry import RegistryError, open_registry  # noqa: PLC0415 torch: via deploy.registry.registry; the supervisor is light

    registry = open_registry(cfg)
    try:
        try:
            stable = registry.stable()
        except RegistryError:
            stable = registry.init_base(load_state_dict(model_dir), str(model_dir))
        if redis.get(keys.desired(cfg.topics.prefix)) is None:
            key = signing_key_path(cfg)
            announce(
                redis,
                cfg.topics.prefix,
                stable.version,
                stable.checksum,
                "initial stable version",
                Signer(key) if key else None,
                ttl_s=cfg.security.announce_ttl_s,
                seq=registry.audit_seq(),
            )
        return stable.version
    finally:
        registry.close()


@dataclass
class Supervisor:
    """The pipeline's processes, each restarted when it exits: at most ``max_restarts`` times within any
    ``window_s`` (a budget per window, not a lifetime cap), after a back-off when it keeps exiting soon after its
    start (``SupervisorConfig`` documents the policy)."""

    env: dict[str, str]
    log_dir: Path
    roles: tuple[str, ...] = ROLES
    max_restarts: int = 5
    window_s: float = 600.0
    healthy_after_s: float = 30.0
    backoff_max_s: float = 30.0
    children: list[Child] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts per role over the supervisor's whole life (for reports; the budget counts ``exits`` instead)."""
    exits: dict[str, list[float]] = field(default_factory=dict)
    """Times (``clock``) of each role's exits within the window."""
    clock: Callable[[], float] = time.monotonic
    spawn: Callable[[str, dict[str, str], Path], Child] = start_child
    _started: dict[str, float] = field(default_factory=dict)
    _streak: dict[str, int] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: LiverlConfig, env: dict[str, str], log_dir: Path, roles: tuple[str, ...]) -> Supervisor:
        s = cfg.supervisor
        return cls(
            env,
            log_dir,
            roles,
            max_restarts=s.restarts,
            window_s=s.restart_window_s,
            healthy_after_s=s.healthy_after_s,
            backoff_max_s=s.backoff_max_s,
        )

    def start(self) -> Supervisor:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children = [self._spawn(role) for role in self.roles]
        return self

    def _spawn(self, role: str) -> Child:
        self._started[role] = self.clock()
        return self.spawn(role, self.env, self.log_dir)

    def check(self) -> str | None:
        """Restart what exited (now, or once its back-off is over); returns a failure message once a role exited
        more than ``max_restarts`` times within ``window_s``."""
        now = self.clock()
        for i, c in enumerate(self.children):
            if c.proc.poll() is None:
                continue
            if c.role not in self._due:  # a new exit
                ran = now - self._started.get(c.role, now)
                seen = [t for t in self.exits.get(c.role, []) if t > now - self.window_s] + [now]
                self.exits[c.role] = seen
                if len(seen) > self.max_restarts:
                    return (
                        f"{c.role} exited with code {c.proc.returncode} {len(seen)} times within "
                        f"{self.window_s:g} s (supervisor.restarts = {self.max_restarts} per "
                        f"supervisor.restart_window_s); last log lines:\n{c.tail()}"
                    )
                self._streak[c.role] = self._streak.get(c.role, 0) + 1 if ran < self.healthy_after_s else 0
                streak = self._streak[c.role]
                delay = 0.0 if streak == 0 else min(self.backoff_max_s, 2.0 ** (streak - 1))
                self._due[c.role] = now + delay
                log.error(
                    "%s exited with code %s after %.0f s (%d of %d restarts in %g s used); restarting in %.0f s;"
                    " last log lines:\n%s",
                    c.role,
                    c.proc.returncode,
                    ran,
                    len(seen),
                    self.max_restarts,
                    self.window_s,
                    delay,
                    c.tail(),
                )
            if now >= self._due[c.role]:
                del self._due[c.role]
                self.restarts[c.role] = self.restarts.get(c.role, 0) + 1
                self.children[i] = self._spawn(c.role)
        return None

    def stop(self) -> None:
        stop_children(self.children)
