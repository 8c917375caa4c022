"""``tests.netns``: hosts with their own addresses, a link cut and restored, nothing left behind even on failure."""

from __future__ import annotations

import subprocess
import sys
import time

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


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_host_loss_kills_every_process_of_the_host_its_children_too_and_no_other(tmp_path):
    with Hosts(["a", "b"], tmp_path) as hosts:
        # a parent that starts a child of its own in a new session (out of the parent's process group), then sleeps
        forks = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        forks += " start_new_session=True)\ntime.sleep(600)"
        parent = hosts.spawn("a", [sys.executable, "-c", forks], "a.log")
        other = hosts.spawn("b", [sys.executable, "-c", "import time; time.sleep(600)"], "b.log")
        deadline = time.monotonic() + 30
        while len(hosts.pids("a")) < 2:
            assert time.monotonic() < deadline, hosts.pids("a")
            time.sleep(0.1)
        assert hosts.kill_host("a") == 2
        assert hosts.pids("a") == []
        assert parent.returncode == -9
        assert other.poll() is None and hosts.pids("b") == [other.pid]
