"""SIGTERM stops the serving side gracefully (docs/operations.md, "Probes and termination"):

- a serving node (``liverl serve``, a real vLLM node on CPU) told to stop while requests stream through the router:
  its ``/readyz`` goes 503 at once, it leaves the rotation, the requests it holds finish, new ones go to the other
  node, no request fails, its heartbeat is gone and it exits 0 well within its grace period;
- a node told to stop while its engine is still starting exits 0 without waiting for the model to load;
- a router (``liverl route``) told to stop: its ``/readyz`` goes 503 at once, it keeps routing a few seconds (a
  balancer drops it meanwhile), the stream it relays finishes, and it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from core import keys
from liverl.bench.routers_load import router_env
from serving.router.router import Router
from tests.conftest import free_port
from tests.serving.routing import beat, front_door, start, until

REPO = Path(__file__).resolve().parents[2]


def _status(url: str) -> int:
    """The HTTP status of a GET (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _probe_until_exit(url: str, proc: subprocess.Popen, t0: float, seen: list[tuple[float, int]]) -> None:
    """GET ``url`` every 0.05 s until ``proc`` exits (at most 90 s), appending (seconds since ``t0``, status): 0 when
    the connection was refused, -1 when no answer came within 2 s (a loaded machine)."""
    while proc.poll() is None and time.monotonic() - t0 < 90:
        t = time.monotonic() - t0
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except urllib.error.URLError as e:  # refused: nothing listens (0); else no answer in time (-1)
            status = 0 if isinstance(e.reason, ConnectionRefusedError) else -1
        except OSError:  # (a timeout while reading the answer)
            status = -1
        seen.append((t, status))
        time.sleep(0.05)


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    env = {**env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", *command], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _status(url) != 200:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{url} not 200 after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _exit_code(proc: subprocess.Popen, timeout_s: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"did not exit within {timeout_s:.0f} s of SIGTERM:\n{log.read_text()[-4000:]}") from None


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _second_node(srv, tmp_path: Path, name: str = "node-x"):
    """A config for a second `liverl serve` beside the package's node (same state dir, registry, keys, prefix), and
    the router's config naming both."""
    fleet = {srv.cfg.serving.node_name: srv.url}
    cfg = srv.cfg.model_copy(deep=True)
    cfg.serving.node_name = name
    cfg.serving.gateway_port, cfg.serving.vllm_port, cfg.serving.agent_port = free_port(), free_port(), free_port()
    cfg.serving.advertise_url = None
    cfg.model.path = str(srv.model_dir)
    fleet[name] = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    cfg.serving.fleet = fleet
    rcfg, _ = front_door(srv.cfg, fleet)
    return cfg, rcfg


@pytest.mark.slow
def test_a_node_told_to_stop_under_load_finishes_what_it_holds_and_no_request_fails(srv, tmp_path):
    cfg, rcfg = _second_node(srv, tmp_path)
    log = tmp_path / "serve-node-x.log"
    proc = _spawn(["serve"], router_env(cfg), log)
    gw_url = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    agent_url = f"http://{cfg.serving.host}:{cfg.serving.agent_port}"
    try:
        _wait_ready(f"{gw_url}/readyz", proc, log, 600)
        assert _status(f"{agent_url}/readyz") == 200 and _status(f"{agent_url}/livez") == 200
        asyncio.run(_load_and_stop(srv, cfg, rcfg, proc, gw_url, agent_url, log))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _load_and_stop(srv, cfg, rcfg, proc, gw_url: str, agent_url: str, log: Path) -> None:
    ardis = aioredis.from_url(srv.cfg.redis.url)
    router = Router(rcfg, ardis, refresh_s=0.2)
    rport = free_port()
    runner = await start(router.app, rport)
    base = f"http://127.0.0.1:{rport}"
    outcomes: list[tuple[float, float, int, str | None, bool]] = []  # start, end, status, node, stream complete
    stop_load = asyncio.Event()

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        n = 0
        while not stop_load.is_set():
            n += 1
            body = {"prompt": "[a]12+30=", "max_tokens": 16, "stream": True, "user": f"user-{i}-{n % 16}"}
            body["ignore_eos"] = True  # every generation that long: streams are in flight when the stop comes
            t0 = time.monotonic()
            try:
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    raw = await r.read()
                    done = r.status == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
                    outcomes.append((t0, time.monotonic(), r.status, r.headers.get("X-Liverl-Node"), done))
            except aiohttp.ClientError as e:
                outcomes.append((t0, time.monotonic(), 0, None, False))
                print(f"client {i}: {type(e).__name__}: {e}")

    try:
        await until(lambda: len(router.nodes) == 2, "both nodes in the router's rotation", 30)
        async with aiohttp.ClientSession() as http:
            clients = [asyncio.create_task(client(i, http)) for i in range(6)]
            await until(
                lambda: sum(1 for o in outcomes if o[3] == "node-x") >= 5, "node-x serving some of the load", 120
            )
            proc.send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            # at once, side by side: the gateway's /readyz until the process is gone, and the serving process's own
            seen: list[tuple[float, int]] = []
            prober = asyncio.create_task(asyncio.to_thread(_probe_until_exit, f"{gw_url}/readyz", proc, t_term, seen))
            ready_after = await asyncio.to_thread(_status, f"{agent_url}/readyz")
            assert ready_after in (503, 0), ready_after
            await prober
            code = await asyncio.to_thread(_exit_code, proc, 30, log)
            t_exit = time.monotonic()
            await asyncio.sleep(2.0)  # the load goes on, on the other node
            stop_load.set()
            await asyncio.gather(*clients)
        assert code == 0, log.read_text()[-4000:]
        assert t_exit - t_term < cfg.serving.drain_timeout_s + 20, "the node waited out its drain timeout"
        late_ready = [(t, s) for t, s in seen if s == 200 and t > 1.0]
        assert not late_ready, f"the stopping node's gateway still said ready: {late_ready}"
        drained = re.search(r"drained in ([0-9.]+) s", log.read_text())
        assert drained, log.read_text()[-4000:]
        # from a second after the stop until the drain ended, the gateway listened, and what it answered said it was
        # draining (a drain shorter than that leaves nothing to see here: the serving process's own /readyz said it at
        # once, above)
        during = [s for t, s in seen if 1.0 < t < float(drained.group(1)) - 0.2]
        assert all(s in (503, -1) for s in during), f"the gateway did not say it was draining: {seen}"
        failed = [o for o in outcomes if o[2] != 200 or not o[4]]
        assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:5]}"
        after = [o for o in outcomes if o[0] > t_term + 1.0]
        assert after and {o[3] for o in after} == {srv.cfg.serving.node_name}, {o[3] for o in after}
        assert await ardis.get(keys.served(srv.cfg.topics.prefix, "node-x")) is None, "node-x still in the fleet"
        print(
            f"\nnode-x stopped {t_exit - t_term:.1f} s after SIGTERM; {len(outcomes)} streamed requests, "
            f"{sum(1 for o in outcomes if o[3] == 'node-x' and o[0] < t_term < o[1])} in flight on node-x at the stop"
        )
    finally:
        await runner.cleanup()
        await ardis.aclose()


@pytest.mark.slow
def test_a_node_told_to_stop_while_its_engine_starts_exits_at_once(srv, tmp_path):
    cfg, _ = _second_node(srv, tmp_path, "node-y")
    log = tmp_path / "serve-node-y.log"
    proc = _spawn(["serve"], router_env(cfg), log)
    try:
        agent_url = f"http://{cfg.serving.host}:{cfg.serving.agent_port}"
        node_log = cfg.state_path / "logs" / "vllm-node-y.log"
        deadline = time.monotonic() + 300
        # the serving process is up and its vLLM node spawned, loading the model (minutes on a loaded machine)
        while _status(f"{agent_url}/livez") != 200 or "starting vLLM node" not in _text(node_log):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        time.sleep(1.0)
        assert _status(f"{agent_url}/readyz") == 503  # not ready while the engine loads
        proc.send_signal(signal.SIGTERM)
        assert _exit_code(proc, 30, log) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _long_stream_gateway(chunks: int = 30, gap_s: float = 0.1) -> web.Application:
    """A stand-in gateway whose completions stream ``chunks`` chunks ``gap_s`` apart (a generation in flight)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_a_router_told_to_stop_goes_unready_at_once_finishes_its_streams_and_exits_0(cfg, rds, tmp_path):
    port, rport = free_port(), free_port()
    rcfg, _ = front_door(cfg, {"node-a": f"http://127.0.0.1:{port}"})
    rcfg.serving.drain_timeout_s = 30
    log = tmp_path / "route.log"
    base = f"http://127.0.0.1:{rport}"

    async def run() -> None:
        upstream = await start(_long_stream_gateway(), port)
        ardis = aioredis.from_url(cfg.redis.url)
        await beat(ardis, cfg.topics.prefix, "node-a", None)
        proc = _spawn(["route", "--host", "127.0.0.1", "--port", str(rport)], router_env(rcfg), log)
        try:
            await asyncio.to_thread(_wait_ready, f"{base}/readyz", proc, log, 120)
            assert await asyncio.to_thread(_status, f"{base}/livez") == 200
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/completions", json={"prompt": "x", "stream": True}) as r:
                    assert r.status == 200
                    first = await r.content.readline()
                    assert first.startswith(b"data: ")
                    proc.send_signal(signal.SIGTERM)
                    t_term = time.monotonic()
                    await asyncio.sleep(0.5)
                    assert await asyncio.to_thread(_status, f"{base}/readyz") == 503  # a balancer drops it now
                    # still routing meanwhile: a request the balancer sent before it noticed is served
                    async with http.post(f"{base}/v1/completions", json={"prompt": "y", "stream": True}) as r2:
                        assert r2.status == 200 and (await r2.read()).rstrip().endswith(b"data: [DONE]")
                    rest = await r.read()
                assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]  # the stream in flight finished
            code = await asyncio.to_thread(_exit_code, proc, 30, log)
            assert code == 0, log.read_text()[-4000:]
            assert time.monotonic() - t_term < 20
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            await upstream.cleanup()
            await ardis.aclose()

    asyncio.run(run())
