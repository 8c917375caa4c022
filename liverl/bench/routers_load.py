"""The machinery of ``liverl bench routers`` and of ``tests/serving/test_routers_ha.py``: ``liverl route`` processes
with HAProxy in front (``Front``), closed-loop clients that record every request (``drive``), and a kill -9 of one
router under that load (``kill_under_load``)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from core import procs
from core.config import LiverlConfig

LOAD = {"clients": 8, "users": 64, "max_tokens": 16, "fail_pause_s": 0.1}
"""The load's defaults: concurrent clients, distinct user keys, tokens a completion, a client's pause (s) after a
failure."""


# ------------------------------------------------------------------------------------------------ the front


def router_env(cfg: LiverlConfig) -> dict[str, str]:
    """The environment of a ``liverl route`` child: this process's, with ``cfg``'s sections (secrets in clear)."""
    from pydantic import BaseModel, SecretStr

    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LIVERL__")}
    env.pop("LIVERL_CONFIG", None)
    for name, f in LiverlConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            section = getattr(cfg, name)
            data = section.model_dump(mode="json")
            for key, value in section:
                if isinstance(value, SecretStr):
                    data[key] = value.get_secret_value()
            env[f"LIVERL__{name.upper()}"] = json.dumps(data)
    env["LIVERL__STATE_DIR"] = str(cfg.state_path)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except OSError:
        return 0, b""


def _wait(check, what: str, timeout_s: float, children: list[tuple[str, subprocess.Popen]] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for name, p in children:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.1)


@dataclass
class Front:
    """``n`` ``liverl route`` processes on loopback ports, with HAProxy in front when ``balancer``; ``url`` is where
    clients connect (HAProxy, or the only router)."""

    cfg: LiverlConfig
    log_dir: Path
    n: int = 2
    balancer: bool = True
    ports: list[int] = field(default_factory=list)
    routers: list[subprocess.Popen | None] = field(default_factory=list)
    haproxy: subprocess.Popen | None = None
    lb_port: int = 0
    stats_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port if self.balancer else self.ports[0]}"

    def start(self, timeout_s: float = 120.0) -> Front:
        """Start the routers, then HAProxy; returns once every router answers and HAProxy sees each UP (what was
        started is stopped again when that fails)."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> Front:
        from core.services import free_port
        from liverl.ops.haproxy import render

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = [free_port() for _ in range(self.n)]
        self.routers = [None] * self.n
        for i in range(self.n):
            self.start_router(i, wait=False)
        for i in range(self.n):
            self.wait_router(i, timeout_s)
        if self.balancer:
            haproxy = shutil.which("haproxy")
            if haproxy is None:
                raise RuntimeError("haproxy is not installed (Debian/Ubuntu: apt-get install haproxy)")
            self.lb_port, self.stats_port = free_port(), free_port()
            path = self.log_dir / "haproxy.cfg"
            path.write_text(
                render(
                    [f"127.0.0.1:{p}" for p in self.ports],
                    bind=f"127.0.0.1:{self.lb_port}",
                    stats_bind=f"127.0.0.1:{self.stats_port}",
                )
            )
            self.haproxy = procs.spawn([haproxy, "-db", "-f", str(path)], self.log_dir / "haproxy.log")
            _wait(
                lambda: all(s.startswith("UP") for s in self.states().values()) and len(self.states()) == self.n,
                "HAProxy sees every router UP",
                timeout_s,
                [("haproxy", self.haproxy)],
            )
        return self

    def start_router(self, i: int, wait: bool = True, timeout_s: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "liverl.cli", "route", "--host", "127.0.0.1", "--port", str(self.ports[i])]
        self.routers[i] = procs.spawn(cmd, self.log_dir / f"router-{i + 1}.log", router_env(self.cfg))
        if wait:
            self.wait_router(i, timeout_s)

    def router_ready(self, i: int) -> bool:
        return _get(f"http://127.0.0.1:{self.ports[i]}/healthz")[0] == 200

    def wait_router(self, i: int, timeout_s: float = 120.0) -> None:
        _wait(
            lambda: self.router_ready(i), f"router-{i + 1} /healthz", timeout_s, [(f"router-{i + 1}", self.routers[i])]
        )

    def kill(self, i: int) -> float:
        """SIGKILL router ``i``; returns the time (monotonic) just before the signal, so that a request seen to end
        after it may have been cut by the kill and one seen to end before it was not (the caller's event loop can note
        a cut stream's end before this thread runs again)."""
        p = self.routers[i]
        t = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        return t

    def stats(self) -> list[dict[str, str]]:
        """HAProxy's status page as CSV rows (empty when it does not answer)."""
        status, body = _get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout_s=1.0)
        if status != 200:
            return []
        return list(csv.DictReader(io.StringIO(body.decode().lstrip("# "))))

    def states(self) -> dict[str, str]:
        """Each router's state in HAProxy (UP, DOWN, "UP 1/2": going down, ...)."""
        return {
            r["svname"]: r["status"]
            for r in self.stats()
            if r["pxname"] == "routers" and r["svname"].startswith("router-")
        }

    def backend(self) -> dict[str, str]:
        return next((r for r in self.stats() if r["pxname"] == "routers" and r["svname"] == "BACKEND"), {})

    def stop(self) -> None:
        procs.stop([(f"router-{i + 1}", p) for i, p in enumerate(self.routers) if p is not None], timeout=10)
        if self.haproxy is not None:
            procs.stop([("haproxy", self.haproxy)], timeout=10)


# ------------------------------------------------------------------------------------------------ the load


@dataclass
class Outcome:
    """One request: when it was sent and finished (monotonic), whether it succeeded, and the router that answered
    (HAProxy's ``X-Liverl-Router``; None without a response head or without HAProxy)."""

    start: float
    end: float
    ok: bool
    stream: bool
    router: str | None
    error: str = ""


def chat_requests(max_tokens: int, n_prompts: int = 64) -> list[dict]:
    """The demo product's chat requests, ``max_tokens`` tokens each (``ignore_eos``: every one that long)."""
    from liverl.demo import task

    return [
        {
            "model": "liverl",
            "messages": [{"role": "user", "content": p.text}],
            "max_tokens": max_tokens,
            "temperature": task.TEMPERATURE,
            "ignore_eos": True,
        }
        for p in task.heldout_prompts(n_prompts, seed=1)
    ]


async def drive(
    url: str,
    stop: asyncio.Event,
    out: list[Outcome],
    clients: int = LOAD["clients"],
    users: int = LOAD["users"],
    max_tokens: int = LOAD["max_tokens"],
    fail_pause_s: float = LOAD["fail_pause_s"],
    seed: int = 0,
) -> None:
    """``clients`` closed-loop clients until ``stop`` is set, streamed and plain chat completions in turn, each for
    a user key out of ``users``; every request's ``Outcome`` is appended to ``out``."""
    import aiohttp

    bodies = chat_requests(max_tokens)
    rng = random.Random(seed)

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        k = i
        while not stop.is_set():
            stream = k % 2 == 0
            body = {**bodies[k % len(bodies)], "user": f"user-{rng.randrange(users)}", "stream": stream}
            k += 1
            t0, ok, router, error = time.monotonic(), False, None, ""
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    router = r.headers.get("X-Liverl-Router")
                    if stream:
                        last = b""
                        async for line in r.content:
                            if line.startswith(b"data: [DONE]"):
                                ok = r.status == 200
                                break
                            last = line.strip() or last
                        else:
                            error = f"HTTP {r.status}, stream ended without [DONE] after {last[:300]!r}"
                    else:
                        data = await r.json(content_type=None)
                        ok = r.status == 200 and bool(data.get("choices"))
                    if not ok and not error:
                        error = f"HTTP {r.status}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"[:200]
            out.append(Outcome(t0, time.monotonic(), ok, stream, router, error))
            if not ok:
                await asyncio.sleep(fail_pause_s)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))


async def warm_up(url: str, n: int, timeout_s: float = 300.0, **load) -> None:
    """The load until ``n`` requests succeeded (at most ``timeout_s``); nothing is recorded."""
    out: list[Outcome] = []
    stop = asyncio.Event()
    task = asyncio.create_task(drive(url, stop, out, **load))
    deadline = time.monotonic() + timeout_s
    while sum(o.ok for o in out) < n and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, timeout=150)


async def kill_under_load(
    front: Front,
    before_s: float,
    after_s: float,
    restart: bool,
    victim: int = 0,
    when_streaming: float = 0.0,
    warm: int = 32,
    **load,
) -> dict:
    """Run the load on ``front``, after ``warm`` unmeasured successful requests (a cold node's first batches are
    slow); after ``before_s`` kill router ``victim`` (with ``when_streaming`` > 0: at the first moment within that
    many seconds more when a stream it answers is mid-body, so the kill is known to cut one); watch for it to be
    marked down (HAProxy) or restart it and wait for it (``restart``); run ``after_s`` more. Returns the outcomes
    and the moments, all ``time.monotonic()``."""
    loop = asyncio.get_running_loop()
    if warm > 0:
        await warm_up(front.url, warm, **load)
    out: list[Outcome] = []
    stop = asyncio.Event()
    task = asyncio.create_task(drive(front.url, stop, out, **load))
    await asyncio.sleep(before_s)
    probe = await _until_stream_on(front, out, victim, when_streaming) if when_streaming > 0 else None
    t_kill = await loop.run_in_executor(None, front.kill, victim)
    t_down = None
    if front.balancer:
        victim_name = f"router-{victim + 1}"
        while time.monotonic() < t_kill + after_s:
            states = await loop.run_in_executor(None, front.states)
            if states.get(victim_name, "").startswith("DOWN"):
                t_down = time.monotonic()
                break
            await asyncio.sleep(0.05)
    elif restart:
        await loop.run_in_executor(None, lambda: front.start_router(victim, wait=False))
        while time.monotonic() < t_kill + after_s + 60:
            if await loop.run_in_executor(None, front.router_ready, victim):
                t_down = time.monotonic()  # for the baseline: when it answered again
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, t_kill + after_s - time.monotonic()))
    stop.set()
    await asyncio.wait_for(task, timeout=150)
    if probe is not None:
        await asyncio.wait_for(probe, timeout=60)
    backend = await loop.run_in_executor(None, front.backend) if front.balancer else {}
    return {"outcomes": out, "t_kill": t_kill, "t_down": t_down, "backend": backend}


async def _until_stream_on(front: Front, out: list[Outcome], victim: int, within_s: float) -> asyncio.Task | None:
    """Wait (at most ``within_s``) until a streamed request is in flight whose head came from router ``victim``.
    ``drive`` records a request when it ends; a probe stream of our own shows the moment instead. Returns the task
    that reads the probe to its end and records it (None: no probe reached the victim in time)."""
    import aiohttp

    name = f"router-{victim + 1}"
    deadline = time.monotonic() + within_s
    body = {**chat_requests(64)[0], "stream": True, "max_tokens": 64}
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    try:
        while time.monotonic() < deadline:
            body["user"] = f"probe-{random.randrange(1 << 30)}"
            t0 = time.monotonic()
            resp = await session.post(front.url + "/v1/chat/completions", json=body)
            if resp.headers.get("X-Liverl-Router", name) == name:
                await resp.content.readline()  # the first chunk: the stream is mid-body on the victim
                probe = asyncio.create_task(_finish(session, resp, out, t0, name))
                session = None  # the probe's task closes it
                return probe
            await resp.read()
            resp.release()
        return None
    finally:
        if session is not None:
            await session.close()


async def _finish(session, resp, out: list[Outcome], t0: float, name: str) -> None:
    """The probe stream, read to its end and recorded like the load's requests."""
    import aiohttp

    ok, error = False, ""
    try:
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                ok = True
                break
        else:
            error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"[:200]
    finally:
        resp.release()
        await session.close()
    out.append(Outcome(t0, time.monotonic(), ok, True, name, error))


def summarize(res: dict, victim: str = "router-1") -> dict:
    """The table's numbers for one front's run (see the module's docstring)."""
    out: list[Outcome] = res["outcomes"]
    t_kill, t_down = res["t_kill"], res["t_down"]
    failed = [o for o in out if not o.ok]
    t0, t1 = min(o.start for o in out), max(o.end for o in out)
    in_flight = [o for o in out if o.start < t_kill <= o.end]
    after = [o for o in failed if o.start >= t_kill]
    later = t_down if t_down is not None else float("inf")
    backend = res.get("backend") or {}
    return {
        "requests": len(out),
        "failed": len(failed),
        "ok_per_s_before": sum(1 for o in out if o.ok and o.end < t_kill) / (t_kill - t0),
        "ok_per_s_after": sum(1 for o in out if o.ok and o.start >= t_kill) / (t1 - t_kill),
        "in_flight": len(in_flight),
        "failed_in_flight": sum(1 for o in failed if o.start < t_kill),
        "failed_in_flight_streams": sum(1 for o in failed if o.start < t_kill and o.stream),
        "failed_before_kill": sum(1 for o in failed if o.end < t_kill),
        "failed_after_kill": len(after),
        "failed_after_down": sum(1 for o in after if o.start >= later),
        "failed_other_router": sum(1 for o in failed if o.router not in (None, victim)),
        "down_after_s": None if t_down is None else t_down - t_kill,
        "ok_after_down": sum(1 for o in out if o.ok and o.start >= later),
        "retries": int(backend.get("wretr") or 0),
        "redispatches": int(backend.get("wredis") or 0),
        "errors": sorted({o.error for o in failed})[:5],
    }
