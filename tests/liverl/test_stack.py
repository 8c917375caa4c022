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
