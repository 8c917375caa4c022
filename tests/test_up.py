"""`liverl up` as a user runs it: the whole pipeline comes up, tells where everything is, serves the OpenAI
API, takes feedback, and stops cleanly on Ctrl-C (SIGINT) leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from core.services import port_open
from tests.conftest import free_port


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
def test_up_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    gw, node, broker = free_port(), free_port(), free_port()
    env = dict(os.environ)
    env.update(
        {
            "LIVERL__BROKER__EMBEDDED_PORT": str(broker),
            "LIVERL__REDIS__EMBEDDED_PORT": str(free_port()),
            "LIVERL__SERVING__GATEWAY_PORT": str(gw),
            "LIVERL__SERVING__VLLM_PORT": str(node),
            "LIVERL__SERVING__AGENT_PORT": str(free_port()),
            "LIVERL__INGEST__WEB_PORT": str(free_port()),
            "LIVERL__GATE__METRICS_PORT": str(free_port()),
            "LIVERL__TOPICS__PREFIX": f"up{os.getpid()}",
            "HF_HUB_OFFLINE": "1",
        }
    )
    if os.environ.get("LIVERL_TEST_MODEL_CACHE"):
        env["LIVERL__MODEL__CACHE_DIR"] = os.environ["LIVERL_TEST_MODEL_CACHE"]
    out = tmp_path / "up.log"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", "up", "--state-dir", str(tmp_path / "state")],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 420
        while "Ctrl-C stops everything" not in out.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text()[-3000:]
            time.sleep(1)
        text = out.read_text()
        assert "Ctrl-C stops everything" in text, text[-3000:]
        for what in (
            f"http://127.0.0.1:{gw}/v1",
            "/v1/feedback",
            "X-Liverl-Product-Key",
            "kcat",
            "partitioner=murmur2_random",
            "logs",
            "/metrics",
        ):
            assert what in text, (what, text[-3000:])
        with urllib.request.urlopen(f"http://127.0.0.1:{gw}/readyz", timeout=10) as r:  # what `up` waited for
            assert r.status == 200 and json.loads(r.read())["ready"] is True
        status, body = _post(  # so the first completion after "liverl is up" is served
            f"http://127.0.0.1:{gw}/v1/completions",
            {"model": "liverl", "prompt": "[a]12+34=", "max_tokens": 5, "temperature": 1.0},
        )
        assert status == 200 and body["choices"], body
        gid = body["choices"][0]["generation_id"]
        event = {"feedback_id": "fb-up-1", "generation_id": gid, "kind": "accept"}
        assert _post(f"http://127.0.0.1:{gw}/v1/feedback", event)[0] == 401  # no product key
        key = (tmp_path / "state" / "keys" / "feedback.key").read_text().strip()  # the file `up` made and printed
        status, out = _post(f"http://127.0.0.1:{gw}/v1/feedback", event, {"X-Liverl-Product-Key": key})
        assert status == 202 and out["generation_id"] == gid, out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, out.read_text()[-3000:]
    time.sleep(1)
    listening = [p for p in (gw, node, broker) if port_open("127.0.0.1", p)]
    assert not listening, f"still listening after Ctrl-C (gateway {gw}, vLLM {node}, broker {broker}): {listening}"


def test_up_refuses_a_model_family_it_does_not_handle_before_starting_anything(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}')
    r = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "up", "--model", str(model), "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "'gpt_oss'" in r.stderr and "not handled by liverl yet" in r.stderr and "qwen3_moe" in r.stderr
    assert not (tmp_path / "state" / "logs").exists()  # nothing was started
    r = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "up", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no config.json" in r.stderr


def _marked(mark: str) -> list[str]:
    """The machine's processes whose environment carries ``mark`` (everything a run started inherits it)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid != os.getpid() and f"LIVERL_UP_TEST_MARK={mark}" in "\0".join(
                f"{k}={v}" for k, v in p.environ().items()
            ):
                out.append(f"{p.pid} {p.name()} (parent {p.ppid()})")
        except (psutil.Error, OSError):
            pass
    return out


@pytest.mark.slow
def test_a_failed_up_leaves_no_process_behind(tmp_path):
    """A failed `up` leaves no process behind (no vLLM EngineCore or Worker with parent 1). Here the gateway's port is
    taken, so `serve` fails after its vLLM engine started; `up` gives up, and no process of the run is left."""
    import socket
    import uuid

    mark = uuid.uuid4().hex
    gw = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        {
            "LIVERL__BROKER__EMBEDDED_PORT": str(free_port()),
            "LIVERL__REDIS__EMBEDDED_PORT": str(free_port()),
            "LIVERL__SERVING__GATEWAY_PORT": str(gw),
            "LIVERL__SERVING__VLLM_PORT": str(free_port()),
            "LIVERL__SERVING__AGENT_PORT": str(free_port()),
            "LIVERL__INGEST__WEB_PORT": str(free_port()),
            "LIVERL__GATE__METRICS_PORT": str(free_port()),
            "LIVERL__TOPICS__PREFIX": f"upfail{mark[:8]}",
            "LIVERL__SUPERVISOR__RESTARTS": "0",
            "HF_HUB_OFFLINE": "1",
            "LIVERL_UP_TEST_MARK": mark,
        }
    )
    if os.environ.get("LIVERL_TEST_MODEL_CACHE"):
        env["LIVERL__MODEL__CACHE_DIR"] = os.environ["LIVERL_TEST_MODEL_CACHE"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", gw))
        held.listen()
        r = subprocess.run(
            [sys.executable, "-m", "liverl.cli", "up", "--state-dir", str(tmp_path / "state")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert r.returncode != 0, r.stdout[-2000:]
    left = _marked(mark)
    if left:
        import psutil

        for entry in left:
            try:
                psutil.Process(int(entry.split()[0])).kill()
            except psutil.Error:
                pass
    assert not left, f"processes of the failed run still running: {left}\n{r.stderr[-2000:]}"
    serve_log = (tmp_path / "state" / "logs" / "serve.log").read_text(errors="replace")
    assert "vLLM" in serve_log or "vllm" in serve_log  # the engine had started: there was something to stop
