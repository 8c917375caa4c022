"""The CPU image (packaging/image): the role is the command, the configuration is the environment, it runs as a
non-root user with the version and commit as labels, reaches PostgreSQL and Redis as a deployment's processes do, and
a long-running role stops on SIGTERM by itself (tini as PID 1 passes it on), not by the runtime's SIGKILL."""

from __future__ import annotations

import json
import subprocess
import tomllib
import uuid

import pytest

from core.services import free_port, port_open
from tests.packaging.conftest import REPO, podman, wait_http

pytestmark = pytest.mark.slow

SIGKILLED = 137


def test_the_role_is_the_command_and_the_config_is_the_environment(image):
    out = podman("run", "--rm", image, "--help").stdout
    for role in ("serve", "route", "ingest", "learn", "gate", "status", "promote", "keys"):
        assert f"    {role} " in out, role
    cfg = podman("run", "--rm", "-e", "LIVERL__BROKER__BOOTSTRAP=kafka-1:9092", image, "config").stdout
    assert "kafka-1:9092" in cfg
    assert podman("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip() != "0"
    labels = json.loads(podman("image", "inspect", image, "--format", "{{json .Labels}}").stdout)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == version
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # the commit the image was built from (plus -dirty for uncommitted changes)
        assert labels["org.opencontainers.image.revision"].split("-")[0] == head.stdout.strip()
    # torch is the CPU build, and vLLM, the SDK and the delta codec import
    probe = "import torch, vllm, liverl_sdk, deploy.registry.delta; print(torch.__version__)"
    assert "+cpu" in podman("run", "--rm", "--entrypoint", "python", image, "-c", probe, timeout=180).stdout


def test_an_admin_verb_reads_postgresql_and_a_server_role_stops_on_sigterm(image, pg_url):
    if not port_open("127.0.0.1", 6379):
        pytest.skip("Redis is not listening on 127.0.0.1:6379 (set up by scripts/services.sh)")
    env = [
        "-e", f"LIVERL__REGISTRY__URL={pg_url}",
        "-e", "LIVERL__REDIS__URL=redis://127.0.0.1:6379/0",
        "-e", f"LIVERL__TOPICS__PREFIX=img{uuid.uuid4().hex[:8]}",
    ]  # fmt: skip
    # the host's services listen on loopback: the container shares the host's network
    out = podman("run", "--rm", "--network=host", *env, image, "versions", timeout=180).stdout
    assert "versions (postgresql+psycopg://" in out  # the registry opened, its schema migrated, and listed (empty)
    port = free_port()
    name = f"liverl-oncall-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "--network=host", *env, image, "oncall", "--port", str(port))
    try:
        # it answers from the registry it reads (an empty one: nothing is registered yet, and it says so)
        body = wait_http(f"http://127.0.0.1:{port}/api/state", 120, ok=lambda status, body: status in (200, 503))
        assert b"registry" in body or isinstance(json.loads(body), dict)
        podman("stop", "-t", "30", name, timeout=60)
        code = int(podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip())
        assert code != SIGKILLED, podman("logs", name, check=False).stdout[-2000:]
    finally:
        podman("rm", "-f", name, check=False)
