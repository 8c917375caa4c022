"""The embedded stack's Redis keeps what it was told across a kill -9 (review finding 26: without persistence a
restart lost the fleet's desired version, the live counters and the feedback guards; with fsync every second, a
kill -9 under disk load lost the last acknowledged writes)."""

from __future__ import annotations

import signal

import redis

from liverl.core import procs
from liverl.stack import start_redis
from tests.conftest import free_port


def test_embedded_redis_keeps_acknowledged_writes_across_kill_9(tmp_path):
    logs = tmp_path / "logs"
    port = free_port()
    proc = start_redis(port, logs)
    try:
        r = redis.Redis(port=port)
        r.set("p:desired", b"announcement")
        r.hincrby("p:live:3", "accept", 7)
        for i in range(300):  # acknowledged one by one, the last just before the kill
            r.hincrby("p:live:4", "events", 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start_redis(port, logs)
        r = redis.Redis(port=port)
        assert r.get("p:desired") == b"announcement" and r.hget("p:live:3", "accept") == b"7"
        assert r.hget("p:live:4", "events") == b"300"
        assert r.config_get("appendonly")["appendonly"] == "yes" and r.config_get("appendfsync")["appendfsync"] == "always"
        assert (tmp_path / "redis").is_dir()
    finally:
        procs.stop([("redis", proc)], timeout=5)


def test_free_ports_come_from_outside_the_outgoing_connections_range():
    """A port handed to a server that binds it later is not one an outgoing connection can take meanwhile: the
    kernel's own pick (port 0) comes from the ephemeral range, where a gateway binding after vLLM's 30 s start found
    its port taken by a client's socket (a CI run). The helper picks below that range, and the port binds."""
    import socket
    from pathlib import Path

    from liverl.core.services import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # random, so two tests starting at once do not get the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
