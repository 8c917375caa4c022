"""The compose deployment (packaging/compose/compose.yaml) on the CPU image, with podman-compose: every role its own
container, the keys made once by `liverl keys` and mounted as files, the stateful parts as services. An OpenAI
request goes through HAProxy to a router to a serving node, the product's judgement of it goes in the same way, and
ingest joins it with its generation into a sample (`liverl audit`, run where the learner runs, says so)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from core.services import free_port
from liverl.ops.audit import JOINED
from tests.packaging.conftest import INFRA, REPO, build, podman, wait_http

pytestmark = pytest.mark.slow

COMPOSE = REPO / "packaging" / "compose" / "compose.yaml"
LIVERL_UID = 10001  # the image's user
UP_TIMEOUT_S = 600  # two vLLM nodes, the learner's two ranks and the gate start together on a 2-core machine
CNI_DIRS = ("/usr/lib/cni", "/usr/libexec/cni", "/opt/cni/bin")


def _compose_bin() -> str | None:
    near = Path(sys.executable).parent / "podman-compose"
    return str(near) if near.exists() else shutil.which("podman-compose")


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _give_to_image_user(path: Path) -> None:
    if os.geteuid() == 0:
        for p in [path, *path.rglob("*")]:
            os.chown(p, LIVERL_UID, LIVERL_UID)
    else:  # rootless podman: the image's user is a subordinate id of this one
        podman("unshare", "chown", "-R", f"{LIVERL_UID}:{LIVERL_UID}", str(path))


@pytest.fixture
def deployment(image, tmp_path):
    """The compose project, up; its logs on failure; down with its volumes afterwards."""
    compose = _compose_bin()
    if compose is None:
        pytest.skip("podman-compose is not installed (the test extra: pip install 'liverl[test]')")
    backend = podman("info", "--format", "{{.Host.NetworkBackend}}").stdout.strip()
    if backend == "cni" and not any(Path(d, "dnsname").exists() for d in CNI_DIRS):
        pytest.skip("podman's CNI networks resolve no container names without the dnsname plugin (scripts/services.sh)")
    p = build("--infra")
    assert p.returncode == 0, f"build.sh --infra failed:\n{p.stderr[-4000:]}"
    # the keys: made once, by the image's own `liverl keys`, as files the image's user owns
    keys = tmp_path / "keys"
    keys.mkdir()
    _give_to_image_user(keys)
    podman("run", "--rm", "-v", f"{keys}:/keys", image, "keys", "/keys", "--nodes", "node-a,node-b")
    # the model: the demo's base policy, built (or found in the tests' model cache) on this machine
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["LIVERL__MODEL__CACHE_DIR"] = os.environ.get("LIVERL_TEST_MODEL_CACHE", str(tmp_path / "models"))
    built = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "build-policy"], env=env, capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stderr[-3000:]
    model = Path(built.stdout.strip().splitlines()[-1])
    assert (model / "config.json").exists(), built.stdout
    port = free_port()
    project = f"liverl{uuid.uuid4().hex[:8]}"
    cenv = dict(
        os.environ,
        LIVERL_IMAGE=image,
        LIVERL_INFRA_IMAGE=INFRA,
        LIVERL_KEYS=str(keys),
        LIVERL_MODEL=str(model),
        LIVERL_PORT=str(port),
        LIVERL_DEVICE="cpu",
    )

    def run(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [compose, "-p", project, "-f", str(COMPOSE), *args],
            env=cenv,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise AssertionError(
                f"podman-compose {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
            )
        return p

    run("up", "-d")
    ok = False
    try:
        yield {"url": f"http://127.0.0.1:{port}", "project": project, "keys": keys, "run": run}
        ok = True
    finally:
        if not ok:
            for c in podman(
                "ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--format", "{{.Names}}"
            ).stdout.split():
                logs = podman("logs", "--tail", "40", c, check=False)
                print(f"--- {c}\n{logs.stdout}{logs.stderr}", file=sys.stderr)
        run("down", "-v", "-t", "10", timeout=300, check=False)


def _joined(report: dict) -> bool:
    """An event of the audit reached a verdict past ingest's join (trained, held out for the gate, queued for the
    learner, ...; ``liverl.ops.audit.JOINED``)."""
    return any(n and (fate in JOINED or fate.split(":")[0] in JOINED) for fate, n in report["fates"].items())


def _container(project: str, service: str) -> str:
    names = podman(
        "ps", "--filter", f"label=io.podman.compose.project={project}",
        "--filter", f"label=io.podman.compose.service={service}", "--format", "{{.Names}}",
    ).stdout.split()  # fmt: skip
    assert names, f"no running container of {service}"
    return names[0]


def test_the_compose_deployment_serves_through_haproxy_and_ingest_joins_the_feedback(deployment):
    url, project = deployment["url"], deployment["project"]

    def alive():
        exited = podman(
            "ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--filter", "status=exited",
            "--format", "{{.Names}} {{.ExitCode}}",
        ).stdout.split("\n")  # fmt: skip
        # a role may exit once while what it needs starts (restart: on-failure); the key services must not be gone
        assert not [e for e in exited if e.strip() and ("haproxy" in e or "postgres" in e or "redis" in e)], exited

    # HAProxy answers as soon as a router is in rotation, which is once a node's heartbeat is live
    wait_http(f"{url}/v1/models", UP_TIMEOUT_S, alive=alive)
    users = [f"user-{i}" for i in range(6)]
    served = []
    for user in users:
        status, body = _post(
            f"{url}/v1/completions",
            {"model": "liverl", "prompt": "[a]12+34=", "max_tokens": 5, "temperature": 1.0, "user": user},
        )
        assert status == 200 and body["choices"], body
        served.append(body["choices"][0]["generation_id"])
    key = (deployment["keys"] / "feedback.key").read_text().splitlines()[0].strip()
    event = {"feedback_id": f"fb-{uuid.uuid4().hex[:8]}", "generation_id": served[0], "kind": "accept"}
    assert _post(f"{url}/v1/feedback", event)[0] == 401  # without the product key
    status, out = _post(f"{url}/v1/feedback", event, {"X-Liverl-Product-Key": key})
    assert status == 202 and out["generation_id"] == served[0], out
    # ingest joins it with its generation into a sample: `liverl audit` where the learner runs
    learner = _container(project, "learner")
    deadline = time.monotonic() + 180
    report: dict = {}
    while time.monotonic() < deadline:
        p = podman("exec", learner, "liverl", "audit", "--json", check=False, timeout=120)
        if p.stdout.strip().startswith("{"):
            report = json.loads(p.stdout)
            if _joined(report):
                break
        time.sleep(3)
    assert report and _joined(report), report or p.stderr[-2000:]
    assert report["lost"] == 0, report
    # both nodes are in the fleet the routers see
    assert {"node-a", "node-b"} <= set(report["nodes"]), report["nodes"]
