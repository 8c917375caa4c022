"""The embedded stack's Redis keeps what it was told across a kill -9 (without persistence a
restart loses the fleet's desired version, the live counters and the feedback guards; with fsync every second, a
kill -9 under disk load loses the last acknowledged writes)."""

from __future__ import annotations

import signal

import pytest
import redis

from core import procs
from liverl.stack.stack import start_redis
from tests.conftest import free_port


def test_embedded_redis_keeps_acknowledged_writes_across_kill_9(tmp_path):
    logs = tmp_path / "logs"
    port = free_port()
    proc = start_redis(port, logs)
    try:
        r = redis.Redis(port=port)
        r.set("p:desired", b"announcement")
        r.hincrby("p:live:3", "accept", 7)
        for _ in range(300):  # acknowledged one by one, the last just before the kill
            r.hincrby("p:live:4", "events", 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start_redis(port, logs)
        r = redis.Redis(port=port)
        assert r.get("p:desired") == b"announcement" and r.hget("p:live:3", "accept") == b"7"
        assert r.hget("p:live:4", "events") == b"300"
        assert (
            r.config_get("appendonly")["appendonly"] == "yes" and r.config_get("appendfsync")["appendfsync"] == "always"
        )
        assert (tmp_path / "redis").is_dir()
    finally:
        procs.stop([("redis", proc)], timeout=5)


def test_free_ports_come_from_outside_the_outgoing_connections_range():
    """A port handed to a server that binds it later is not one an outgoing connection can take meanwhile: the
    kernel's own pick (port 0) comes from the ephemeral range, where a gateway binding after vLLM's 30 s start found
    its port taken by a client's socket (a CI run). The helper picks below that range, and the port binds."""
    import socket
    from pathlib import Path

    from core.services import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # random, so two tests starting at once do not get the same one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def _produce(bootstrap: str, topic: str, n: int) -> None:
    from core.bus import make_producer

    p = make_producer(bootstrap)
    for i in range(n):
        p.send(topic, key=f"g{i}", value=f'{{"i": {i}}}'.encode())
    p.flush(30)
    p.close()


def _read(bootstrap: str, topic: str, group: str, want: int | None, timeout_s: float = 60.0) -> list[int]:
    """Read through ``group`` until ``want`` records came (None: until 5 s pass without one), committing them."""
    import json
    import time

    from core.bus import make_consumer

    c = make_consumer(bootstrap, group, [topic])
    got: list[int] = []
    deadline, quiet = time.monotonic() + timeout_s, time.monotonic() + 5
    try:
        while time.monotonic() < deadline and (len(got) < want if want is not None else time.monotonic() < quiet):
            for msgs in c.poll(timeout_ms=500, max_records=want - len(got) if want else 500).values():
                got += [json.loads(m.value)["i"] for m in msgs]
                quiet = time.monotonic() + 5
        c.commit()
    finally:
        c.close()
    return got


@pytest.mark.parametrize("kill", [False, True], ids=["stop", "kill-9"])
def test_embedded_broker_keeps_unconsumed_records_and_committed_offsets_across_a_restart(tmp_path, kill):
    """A restart of `liverl up` keeps every record not yet consumed and the consumer groups' offsets (the embedded
    broker stores them in a folder): 300 records, 120 consumed and committed, the stack stopped (or its broker killed
    -9), the stack started again on the same state dir: the group reads exactly the other 180, and the topic still
    holds all 300."""
    from core.bus import ensure_topics
    from core.config import load_config
    from liverl.stack.stack import start_stack

    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        broker__embedded_port=free_port(),
        redis__url="redis://127.0.0.1:6379/0",
        broker__embedded_merge_batches=700,
    )
    assert cfg.broker.embedded_storage == "folder"  # the default
    topic = "durable.feedback"
    st = start_stack(cfg)
    try:
        storage_args = dict(st.procs)["broker storage"].args
        assert storage_args[storage_args.index("--merge-batches") + 1] == "700"  # broker.embedded_merge_batches
        ensure_topics(st.bootstrap, [topic], 2)
        _produce(st.bootstrap, topic, 300)
        first = _read(st.bootstrap, topic, "g1", 120)
        if kill:
            for name, p in st.procs:
                p.send_signal(signal.SIGKILL) if name == "broker" else None
    finally:
        st.close()
    assert len(first) == 120
    st = start_stack(cfg)
    try:
        rest = _read(st.bootstrap, topic, "g1", None)
        everything = _read(st.bootstrap, topic, "g2", None)
    finally:
        st.close()
    assert sorted(first + rest) == list(range(300)), (len(first), len(rest))
    assert sorted(everything) == list(range(300))
    assert (tmp_path / "state" / "broker" / "liverl").is_dir()


def test_memory_storage_loses_the_records_at_a_restart(tmp_path):
    """The control for the test above: with ``broker.embedded_storage = "memory"`` (the old default) the same
    restart finds nothing, so that test fails without the durable storage."""
    from core.bus import ensure_topics
    from core.config import load_config
    from liverl.stack.stack import start_stack

    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        broker__embedded_port=free_port(),
        broker__embedded_storage="memory",
        redis__url="redis://127.0.0.1:6379/0",
    )
    st = start_stack(cfg)
    try:
        ensure_topics(st.bootstrap, ["mem.feedback"], 2)
        _produce(st.bootstrap, "mem.feedback", 50)
    finally:
        st.close()
    st = start_stack(cfg)
    try:
        ensure_topics(st.bootstrap, ["mem.feedback"], 2)
        assert _read(st.bootstrap, "mem.feedback", "g", None) == []
    finally:
        st.close()
