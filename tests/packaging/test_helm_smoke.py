"""The chart's pods run: the router's, the ingest worker's and the on-call page's Deployments, rendered by the chart,
started with `podman kube play` on the CPU image (packaging/image/build.sh), each process logging in as its own role
(`liverl db roles`, `liverl redis acl`) with the key and password files of its Secret, mounted read-only. The router
answers /healthz and holds its Redis connection as its own ACL user; the ingest worker joins its consumer group on the
tests' broker and passes its own readiness probe, run inside its container; the on-call page answers /healthz and
reads the fresh registry.

What podman's kube play does not do as Kubernetes does, and how the test stands in for it:
- the pods share the host's network (`--network host`) so that they reach Redis and PostgreSQL on this machine's
  loopback, as the values name them; their containers' port declarations are left out (podman would publish them as
  host port mappings, which host networking refuses), and the processes listen on the ports the values name;
- each Secret volume becomes a host folder holding the same files (podman 4.3 writes a Secret's ``data`` to the
  volume still base64-encoded, and writes nothing for ``stringData``); the files are the ones `liverl keys` makes.
Skips, saying why, without podman or its pause container's init (catatonit); the image is the package's ``image``
fixture's build."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from core.roles import Role, mounts
from tests.conftest import free_port

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install '.[test]')")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "packaging" / "helm" / "liverl"
IMAGE = "localhost/liverl:cpu"
REDIS_URL = "redis://127.0.0.1:6379/0"  # this machine's Redis (scripts/services.sh)
IMAGE_UID = 10001  # the image's user (packaging/image/Containerfile), the pods' runAsUser


def _podman_ready() -> str | None:
    """Why the smoke cannot run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install podman runc catatonit)"
    if shutil.which("catatonit") is None and not Path("/usr/libexec/podman/catatonit").exists():
        return "podman kube play needs catatonit for its pause container (apt-get install catatonit)"
    return None  # the image: the package's ``image`` fixture builds it (packaging/image/build.sh)


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_podman_ready()), reason=_podman_ready() or "")]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _wait(url: str, timeout_s: float, logs) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return _get(url)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"nothing answered {url} in {timeout_s:.0f} s; the pods' logs:\n{logs()}")


def test_the_router_ingest_and_oncall_pods_run_and_answer_their_probes(image, tmp_path, pg_url, stack):
    assert image == IMAGE  # the chart's default image, built by the package's fixture
    pg = urlsplit(pg_url)
    prefix = f"helm{uuid.uuid4().hex[:8]}"
    route_port, oncall_port, ingest_port = free_port(), free_port(), free_port()
    values = {
        "image": {"pullPolicy": "Never"},
        "kafka": {"bootstrap": stack.bootstrap, "partitions": 2},  # the tests' embedded Kafka-compatible broker
        "redis": {"host": "127.0.0.1", "port": 6379},
        "registry": {"host": pg.hostname, "port": pg.port, "database": pg.path.lstrip("/")},
        "topicsPrefix": prefix,  # the roles are <prefix>_router, <prefix>_viewer, ...
        "serve": {"nodes": [{"name": "node-0"}]},
        "route": {"replicas": 1, "port": route_port},  # one: on the host's network, two would want one port
        "oncall": {"port": oncall_port},
        "ingest": {"replicas": 1, "webPort": ingest_port},
    }
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name="smoke", namespace="default")
    docs = [d for p, t in rendered.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
    pods = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] in ("route", "oncall", "ingest")
    ]
    assert len(pods) == 3

    # every file `liverl keys` makes, and the roles and users its passwords belong to, as an operator makes them
    keys = tmp_path / "keys"
    env = dict(os.environ, PYTHONPATH=str(REPO), LIVERL__TOPICS__PREFIX=prefix)
    liverl = [sys.executable, "-m", "liverl.cli"]
    made = []

    def verb(*args: str) -> None:
        done = subprocess.run([*liverl, *args], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr

    verb("keys", str(keys), "--nodes", "node-0")
    try:
        for args in (["db", "roles", "--url", pg_url], ["redis", "acl", "--url", REDIS_URL]):
            made.append(args)
            verb(*args, "--keys", str(keys), "--nodes", "node-0", "--apply")
        _play_and_probe(tmp_path, keys, pods, prefix, route_port, oncall_port)
    finally:
        for args in made:
            verb(*args, "--nodes", "node-0", "--drop")


def _container(deployment: dict) -> str:
    """The podman container kube play made for the deployment's first container (`<name>-pod-0-<container>` in podman
    4, `<name>-pod-<container>` in podman 5)."""
    name, container = deployment["metadata"]["name"], deployment["spec"]["template"]["spec"]["containers"][0]["name"]
    names = subprocess.run(["podman", "ps", "--format", "{{.Names}}"], capture_output=True, text=True).stdout.split()
    found = [n for n in names if n.startswith(f"{name}-pod") and n.endswith(f"-{container}")]
    assert len(found) == 1, (name, names)
    return found[0]


def _play_and_probe(
    tmp_path: Path, keys: Path, pods: list[dict], prefix: str, route_port: int, oncall_port: int
) -> None:
    # each role's Secret as a folder holding the files `liverl keys` lists for its process
    roles = {
        "liverl-keys-router": Role("router"),
        "liverl-keys-viewer": Role("viewer"),
        "liverl-keys-ingest": Role("ingest"),
    }
    for d in pods:
        for v in d["spec"]["template"]["spec"]["volumes"]:
            if "secret" not in v:
                continue
            name = v.pop("secret")["secretName"]
            folder = tmp_path / name
            folder.mkdir()
            for f, _setting in mounts(roles[name]):
                shutil.copy(keys / f, folder / f)
                os.chown(folder / f, 0, IMAGE_UID)  # what fsGroup and defaultMode 0440 give in Kubernetes
                os.chmod(folder / f, 0o440)
            v["hostPath"] = {"path": str(folder), "type": "Directory"}
        for c in d["spec"]["template"]["spec"]["containers"]:
            c.pop("ports", None)  # podman publishes declared ports as host port mappings, which host networking refuses
    play = tmp_path / "play.yaml"
    play.write_text(yaml.safe_dump_all(pods))

    def logs() -> str:
        names = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
        out = []
        for name in names.stdout.split():
            if name.startswith(tuple(d["metadata"]["name"] for d in pods)):
                got = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
                out.append(f"--- {name}\n{got.stdout[-3000:]}{got.stderr[-3000:]}")
        return "\n".join(out)

    started = subprocess.run(
        ["podman", "kube", "play", "--replace", "--network", "host", str(play)], capture_output=True, text=True
    )
    try:
        assert started.returncode == 0, started.stderr
        # the router is up and says why it sends nothing yet: no serving node has sent a heartbeat
        status, body = _wait(f"http://127.0.0.1:{route_port}/healthz", 90, logs)
        assert (status, body) == (503, "no serving node in rotation"), (status, body, logs())
        # the on-call page reads the registry and Redis as the viewer
        status, body = _wait(f"http://127.0.0.1:{oncall_port}/healthz", 90, logs)
        assert status == 200, (status, body, logs())
        # and it did read them: the fresh registry has no version yet, and says so
        status, state = _get(f"http://127.0.0.1:{oncall_port}/api/state")
        assert status == 503 and "no stable version" in state, (status, state, logs())
        # the ingest worker's own readiness probe, run in its container as the kubelet runs it: ready once it has
        # joined the consumer group and restored its join table
        [ingest] = [d for d in pods if d["metadata"]["name"].endswith("-ingest")]
        probe = ingest["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
        deadline, ready = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            ready = subprocess.run(["podman", "exec", _container(ingest), *probe], capture_output=True, text=True)
            if ready.returncode == 0:
                break
            time.sleep(2)
        assert ready is not None and ready.returncode == 0, (ready, logs())
        # the router is connected to Redis as its own ACL user, with the password from its mounted file
        users = {c.get("user") for c in redis.Redis.from_url(REDIS_URL).client_list()}
        assert f"{prefix}_router" in users, (users, logs())
        assert not re.search(r"WRONGPASS|NOAUTH|NOPERM|password authentication failed", logs())
    finally:
        subprocess.run(["podman", "kube", "down", str(play)], capture_output=True)
