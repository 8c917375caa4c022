"""The gate's probes and its stop (docs/operations.md, "Probes and termination"): on its metrics port ``/livez`` is 200
while its loop goes round (503 once a step has held it longer than the stall bound), ``/readyz`` 200 while its last
step reached the registry and Redis (503 before the first step and after a failed one); told to stop, the loop ends
after the step in hand, and ``liverl gate`` exits 0 on SIGTERM within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from core.probes import start_probe_server
from deploy.gate.gate import Gate
from deploy.registry.registry import open_registry
from tests.conftest import free_port
from tests.deploy.conftest import tiny_model
from tests.deploy.test_gate import ProbeEval, weights

REPO = Path(__file__).resolve().parents[2]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_gate_probes_say_whether_its_loop_goes_round_and_its_steps_reach_what_they_need(cfg, rds):
    cfg.gate.poll_s = 0.05
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    gate = Gate(cfg, registry, rds, ProbeEval())
    port = free_port()
    server = start_probe_server("127.0.0.1", port, gate.metrics, gate.watch.live, lambda: gate.step_error)
    url = f"http://127.0.0.1:{port}"
    stop, fail, hold = threading.Event(), threading.Event(), threading.Event()
    step = gate.step

    def flaky_step():
        if fail.is_set():
            raise ConnectionError("the registry does not answer")
        while hold.is_set() and not stop.is_set():  # a step that hangs
            time.sleep(0.01)
        return step()

    gate.step = flaky_step
    loop = threading.Thread(target=gate.run, args=(stop,), name="gate-loop")
    try:
        status, body = _get(f"{url}/readyz")
        assert status == 503 and body["reason"] == "no step taken yet", body
        loop.start()
        _until(lambda: _get(f"{url}/readyz")[0] == 200, "the gate ready after a step")
        assert _get(f"{url}/livez") == (200, {"ok": True, "reason": None})
        fail.set()
        _until(lambda: _get(f"{url}/readyz")[0] == 503, "a failed step makes the gate unready")
        assert "the registry does not answer" in _get(f"{url}/readyz")[1]["reason"]
        assert _get(f"{url}/livez")[0] == 200  # failing steps still go round: alive, restarting would not help
        fail.clear()
        _until(lambda: _get(f"{url}/readyz")[0] == 200, "ready again once a step succeeds")
        gate.watch.stall_s = 0.3
        hold.set()
        _until(lambda: _get(f"{url}/livez")[0] == 503, "a step that hangs makes the gate not live")
        assert "wedged" in _get(f"{url}/livez")[1]["reason"]
        hold.clear()
        _until(lambda: _get(f"{url}/livez")[0] == 200, "live again once the loop goes round")
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as r:
            assert r.status == 200 and b"liverl_gate_" in r.read()
        stop.set()
        loop.join(5)
        assert not loop.is_alive(), "the gate's loop did not end after its stop"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        registry.close()


def test_liverl_gate_exits_0_on_sigterm_within_seconds(cfg, stack, tmp_path):
    from deploy.registry.auditchain import ensure_audit_key
    from deploy.registry.signing import generate_keypair
    from tests.learner.test_trainer import model_cache

    registry = open_registry(cfg)
    registry.init_base(tiny_model(), "/nonexistent/model")
    registry.close()
    generate_keypair(cfg.state_path / "keys")
    ensure_audit_key(cfg)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        LIVERL__STATE_DIR=str(cfg.state_path),
        LIVERL__BROKER__BOOTSTRAP=cfg.broker.bootstrap,
        LIVERL__REDIS__URL=cfg.redis.url,
        LIVERL__TOPICS__PREFIX=cfg.topics.prefix,
        LIVERL__SERVING__HOST="127.0.0.1",
        LIVERL__MODEL__CACHE_DIR=str(model_cache()),
        LIVERL__GATE__METRICS_PORT=str(port),
        LIVERL__GATE__INTEGRITY_ONLY="true",
        LIVERL__GATE__POLL_S="0.5",
    )
    log = tmp_path / "gate.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", "gate"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 600  # its start compiles the delta codec's kernels when not cached
        while True:
            try:
                if _get(f"http://127.0.0.1:{port}/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.3)
        assert _get(f"http://127.0.0.1:{port}/livez")[0] == 200
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=15) == 0, log.read_text()[-4000:]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"liverl gate ignored SIGTERM for 15 s:\n{log.read_text()[-4000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
