"""The CPU image, built once for the package by packaging/image/build.sh (which reuses the base image and the build's
cached layers when this machine has them), and helpers to run podman.

The package is one unit for pytest-xdist (a package-scoped fixture: tests/conftest.py), so one worker builds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "image" / "build.sh"
IMAGE = os.environ.get("LIVERL_TEST_IMAGE", "localhost/liverl:cpu")
INFRA = os.environ.get("LIVERL_TEST_INFRA_IMAGE", "localhost/liverl-infra:bookworm")
BUILD_TIMEOUT_S = 1800


def podman(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _usable() -> str | None:
    """Why podman cannot run the images here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/services.sh installs it as root)"
    p = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        return f"podman does not work here: {p.stderr.strip()[-300:]}"
    base = os.environ.get("LIVERL_IMAGE_BASE", "localhost/liverl-base:bookworm")
    has_base = subprocess.run(["podman", "image", "exists", base]).returncode == 0
    if not has_base and (shutil.which("debootstrap") is None or os.geteuid() != 0):
        return f"no base image {base}, and making it needs debootstrap and root"
    return None


def build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BUILD), *args], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=REPO
    )


@pytest.fixture(scope="package")
def image() -> str:
    """The CPU image (tag LIVERL_TEST_IMAGE, default localhost/liverl:cpu), built by the build script; the build's log
    on failure."""
    why = _usable()
    if why:
        pytest.skip(why)
    p = build("--tag", IMAGE)  # LIVERL_TEST_IMAGE: a tag of its own, which another checkout's build leaves alone
    assert p.returncode == 0, f"build.sh failed:\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return IMAGE


def wait_http(url: str, timeout: float, ok=lambda status, body: status == 200, headers=None, alive=None) -> bytes:
    """GET ``url`` until ``ok(status, body)``; ``alive()`` (optional) raises when what should answer has died."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            req = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(req, timeout=10) as r:
                body = r.read()
                if ok(r.status, body):
                    return body
                last = f"{r.status} {body[:200]!r}"
        except urllib.error.HTTPError as e:
            body = e.read()
            if ok(e.code, body):
                return body
            last = f"{e.code} {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        time.sleep(2)
    raise AssertionError(f"{url} did not answer as expected within {timeout:.0f} s; last: {last}")
