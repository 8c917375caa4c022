"""``tests.netns``: hosts with their own addresses, a link cut and restored, nothing left behind even on failure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns import Hosts, unavailable


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_hosts_reach_each_other_by_address_a_cut_isolates_one_and_close_removes_everything(tmp_path):
    with pytest.raises(RuntimeError, match="a failure inside the block"), Hosts(["a", "b"], tmp_path) as hosts:
        a, b = hosts.addr("a"), hosts.addr("b")
        assert a != b and not a.startswith("127.")
        listen = f"import socket; s = socket.create_server(({b!r}, 8000))\nwhile True: s.accept()[0].close()"
        server = hosts.spawn("b", [sys.executable, "-c", listen], "b.log")
        hosts.wait_port(b, 8000, 30, server)  # (the machine reaches b)
        assert hosts.reachable("a", b, 8000)
        with hosts.cut_for("b"):
            assert not hosts.reachable("a", b, 8000)
        assert hosts.reachable("a", b, 8000)
        names = {hosts.ns("a"), hosts.ns("b")}
        links = {hosts.bridge, hosts.link("a"), hosts.link("b")}
        assert links <= _links()
        assert names <= _namespaces()
        raise RuntimeError("a failure inside the block")
    assert not names & _namespaces()
    assert not links & _links()
    assert server.poll() is not None  # the host's process was stopped
