"""Probes of the processes without an event loop of their own (``core.probes``: the learner, the gate) and of the
on-call page (docs/operations.md, "Probes and termination"): ``/livez`` follows the main loop, not the server's
thread; ``/readyz`` says why not; ``liverl oncall`` is ready while the registry and Redis answer and exits 0 on
SIGTERM at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from core.probes import LoopWatch, start_probe_server
from deploy.registry.registry import open_registry
from liverl.ops.oncall import start_in_thread
from tests.conftest import free_port
from tests.deploy.conftest import tiny_model

REPO = Path(__file__).resolve().parents[2]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_livez_follows_the_main_loop_and_readyz_says_why_not():
    prom = CollectorRegistry()
    Counter("liverl_test_things", "things", registry=prom).inc(3)
    watch = LoopWatch(0.3, "test loop")
    why: dict[str, str | None] = {"ready": "not connected yet"}

    def ready() -> str | None:
        if why["ready"] == "boom":
            raise ConnectionError("boom")
        return why["ready"]

    port = free_port()
    server = start_probe_server("127.0.0.1", port, prom, watch.live, ready)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _get(f"{url}/livez") == (200, b'{"ok": true, "reason": null}')
        status, body = _get(f"{url}/readyz")
        assert status == 503 and json.loads(body) == {"ready": False, "reason": "not connected yet"}
        why["ready"] = None
        assert _get(f"{url}/readyz")[0] == 200
        why["ready"] = "boom"  # a check that raises answers 503 with the error, and the server lives on
        status, body = _get(f"{url}/readyz")
        assert status == 503 and "ConnectionError: boom" in json.loads(body)["reason"]
        time.sleep(0.5)  # the server's thread answers, but the loop has not gone round: wedged
        status, body = _get(f"{url}/livez")
        assert status == 503 and "test loop" in json.loads(body)["reason"]
        watch.tick()
        assert _get(f"{url}/livez")[0] == 200
        status, body = _get(f"{url}/metrics")
        assert status == 200 and b"liverl_test_things_total 3.0" in body
        assert _get(f"{url}/nothing")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_the_oncall_page_is_ready_while_the_registry_and_redis_answer(cfg, rds):
    server = start_in_thread(cfg, port=0)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _get(f"{url}/livez")[0] == 200
        status, body = _get(f"{url}/readyz")  # an empty registry: no page to draw yet
        assert status == 503 and json.loads(body)["ready"] is False, body
        registry = open_registry(cfg)
        registry.init_base(tiny_model(), "/models/base")
        registry.close()
        status, body = _get(f"{url}/readyz")
        assert status == 200 and json.loads(body) == {"ready": True, "reason": None}, body
        assert _get(f"{url}/healthz") == (200, b"ok")
    finally:
        server.shutdown()
        server.server_close()


def test_liverl_oncall_exits_0_on_sigterm(cfg, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        LIVERL__STATE_DIR=str(cfg.state_path),
        LIVERL__REDIS__URL=cfg.redis.url,
        LIVERL__TOPICS__PREFIX=cfg.topics.prefix,
    )
    log = tmp_path / "oncall.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", "oncall", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(f"http://127.0.0.1:{port}/livez")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
