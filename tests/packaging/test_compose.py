"""The compose deployment (packaging/compose/compose.yaml) on the CPU image, with podman-compose: every role its own
container, the keys made once by `liverl keys` and mounted as files, the stateful parts as services, every process
logged in to PostgreSQL and Redis as its own role. An OpenAI request goes through HAProxy to a router to a serving
node, the product's judgement of it goes in the same way, and ingest joins it with its generation into a sample
(`liverl audit`, run by the viewer over the learner's ledger, says so); meanwhile a serving node's own credentials
cannot change a version's status or write the gate's announcement, and neither store takes a login without a
password."""

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
ONE_SHOTS = ("db-roles", "redis-acl")  # they exit once the roles are made

# run by `python -` in a serving node's container, with the node's own configuration (its role, its password files)
NODE_LOGINS = """
import json
import urllib.parse

import redis
import sqlalchemy as sa
from core import keys
from core.config import load_config
from core.services import redis_from_url, redis_url

cfg, out = load_config(), {}
engine = sa.create_engine(cfg.registry_url)
with engine.connect() as c:
    out["user"] = c.exec_driver_sql("SELECT current_user").scalar()
    out["versions"] = c.exec_driver_sql("SELECT count(*) FROM versions").scalar()
try:  # a node that would mark a version stable itself
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE versions SET status = 'stable', status_reason = 'forged'")
    out["update"] = "allowed"
except sa.exc.DBAPIError as e:
    out["update"] = getattr(e.orig, "sqlstate", None) or repr(e.orig)
engine.dispose()
owner = sa.create_engine(sa.engine.make_url(cfg.registry_url).set(username="liverl", password=None))
try:  # the owner over the network, without a password
    owner.connect().close()
    out["owner"] = "allowed"
except sa.exc.OperationalError:
    out["owner"] = "refused"
owner.dispose()
r = redis_from_url(redis_url(cfg))
r.get(keys.desired(cfg.topics.prefix))  # the node reads announcements
try:
    r.set(keys.desired(cfg.topics.prefix), "forged")
    out["desired"] = "allowed"
except redis.exceptions.NoPermissionError:
    out["desired"] = "NOPERM"
r.close()
where = urllib.parse.urlsplit(redis_url(cfg))
anonymous = redis.Redis(host=where.hostname, port=where.port or 6379)
try:  # Redis's default user
    anonymous.ping()
    out["default"] = "allowed"
except redis.exceptions.AuthenticationError:
    out["default"] = "refused"
anonymous.close()
print(json.dumps(out))
"""
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
            stdin=subprocess.DEVNULL,
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


def _logs(project: str, service: str) -> str:
    """The last lines of each container of a service, running or not."""
    names = podman(
        "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
        "--filter", f"label=io.podman.compose.service={service}", "--format", "{{.Names}} {{.Status}}",
    ).stdout.splitlines()  # fmt: skip
    out = []
    for line in names:
        q = podman("logs", "--tail", "30", line.split()[0], check=False)
        out.append(f"--- {line}\n{q.stdout[-3000:]}{q.stderr[-3000:]}")
    return "\n".join(out) or "no container"


def test_the_compose_deployment_serves_through_haproxy_and_ingest_joins_the_feedback(deployment):
    url, project, run = deployment["url"], deployment["project"], deployment["run"]

    def alive():
        exited = podman(
            "ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--filter", "status=exited",
            "--format", "{{.Names}} {{.ExitCode}}",
        ).stdout.split("\n")  # fmt: skip
        # a role may exit once while what it needs starts (restart: on-failure); the key services must not be gone
        # (containers are <project>_<service>_<n>; the one-shots exit by design)
        gone = [e for e in exited if any(f"_{s}_" in e for s in ("haproxy", "postgres", "redis"))]
        assert not gone, exited

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
    # a serving node's own credentials: it reads versions, and may neither change a status nor announce one
    p = podman("exec", "-i", _container(project, "node-a"), "python", "-", input=NODE_LOGINS, timeout=120)
    logins = json.loads(p.stdout.strip().splitlines()[-1])
    assert logins["user"] == "liverl_node_node-a" and isinstance(logins["versions"], int), logins
    assert logins["update"] == "42501", logins  # insufficient privilege
    assert logins["desired"] == "NOPERM", logins
    assert logins["owner"] == "refused" and logins["default"] == "refused", logins  # no login without a password
    for one_shot in ONE_SHOTS:
        code = podman(
            "ps", "-a", "--filter", f"label=io.podman.compose.project={project}",
            "--filter", f"label=io.podman.compose.service={one_shot}", "--format", "{{.ExitCode}}",
        ).stdout.split()  # fmt: skip
        assert code == ["0"], (one_shot, code)
    # ingest joins it with its generation into a sample: `liverl audit`, as the viewer, over the learner's ledger; and
    # both nodes join the fleet the routers see (HAProxy answered once one was live: the second vLLM may still be
    # loading on a loaded machine, so this waits for it as for the first)
    fleet = {"node-a", "node-b"}
    deadline = time.monotonic() + UP_TIMEOUT_S
    report: dict = {}
    while time.monotonic() < deadline:
        p = run("--profile", "tools", "run", "--rm", "-T", "viewer", "audit", "--json", timeout=120, check=False)
        start = p.stdout.find("{\n")
        if start >= 0:
            report = json.loads(p.stdout[start:])
            if _joined(report) and fleet <= set(report["nodes"]):
                break
        time.sleep(3)
    assert report and _joined(report), report or p.stderr[-2000:]
    assert report["lost"] == 0, report
    missing = fleet - set(report["nodes"])
    assert not missing, (report["nodes"], {n: _logs(project, n) for n in missing})
