"""HAProxy's configuration for several routers: the shipped file is the renderer's, and HAProxy accepts it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from liverl.ops.haproxy import env_routers, main, render

SHIPPED = Path(__file__).resolve().parents[2] / "packaging" / "haproxy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (Debian package haproxy)")


def test_the_shipped_file_is_the_rendering_for_two_routers_from_the_environment():
    assert SHIPPED.read_text() == render(env_routers(2)), (
        "packaging/haproxy/haproxy.cfg differs from its template: "
        "python -m liverl.ops.haproxy --env 2 > packaging/haproxy/haproxy.cfg"
    )


def test_every_router_is_health_checked_and_failures_are_replayed_elsewhere():
    text = render(["10.0.0.7:8080", "10.0.0.8:8080", "router-3.internal:8080"])
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [s[1:3] for s in servers] == [
        ["router-1", '"10.0.0.7:8080"'],
        ["router-2", '"10.0.0.8:8080"'],
        ["router-3", '"router-3.internal:8080"'],
    ]
    assert all(s[3:] == ["check"] for s in servers)
    lines = {line.strip() for line in text.splitlines()}
    assert "http-check send meth GET uri /readyz" in lines
    assert "retry-on conn-failure empty-response" in lines
    assert "option redispatch 1" in lines


@pytest.mark.parametrize("bad", ["", "10.0.0.7", "a b:80", 'x:80" check', "host:port"])
def test_an_address_haproxy_would_misread_is_refused(bad):
    with pytest.raises(ValueError, match="address"):
        render([bad] if bad else [])


def test_the_command_line_renders_n_routers_from_the_environment(capsys):
    assert main(["--env", "3"]) == 0
    assert capsys.readouterr().out == render(env_routers(3))


@needs_haproxy
@pytest.mark.parametrize("routers", [env_routers(2), ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]])
def test_haproxy_accepts_the_configuration(tmp_path, routers):
    path = tmp_path / "haproxy.cfg"
    path.write_text(render(routers, bind="127.0.0.1:18080", stats_bind="127.0.0.1:18404"))
    out = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    # -c only parses (binds nothing). Nothing is overridden or ignored (an unresolvable router name is only a
    # warning: it is resolved again while HAProxy runs)
    warnings = [w for w in (out.stdout + out.stderr).splitlines() if "WARNING" in w and "could not resolve" not in w]
    assert not warnings, warnings
