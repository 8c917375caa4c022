"""liverl on a real Redis Cluster (three masters started here from the machine's redis-server): review finding "the
Lua script uses keys in different slots, so it is incompatible with Redis Cluster (CROSSSLOT)". Keys one step writes
together now share a hash tag (core.keys), ingest calls its script once per version, and every client is
built by core.services.redis_from_url from a redis+cluster:// URL."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import time

import pytest
import redis

from core import keys
from core.services import redis_from_url
from ingest.metrics import _LIVE_LUA, COUNTED_TTL_S, IngestMetrics, Tally


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server / redis-cli not installed (Debian: redis-server), so no Redis Cluster can start here")
    folder = tmp_path_factory.mktemp("redis-cluster")
    ports = _cluster_ports(3)
    for p in ports:
        subprocess.run(
            [
                "redis-server",
                "--port",
                str(p),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{p}.conf",
                "--dir",
                str(folder),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
                "--logfile",
                str(folder / f"{p}.log"),
            ],
            check=True,
        )
    try:
        deadline = time.monotonic() + 10
        while not all(_pings(p) for p in ports):
            assert time.monotonic() < deadline, "cluster nodes did not start"
            time.sleep(0.1)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while (
            b"cluster_state:ok"
            not in subprocess.run(["redis-cli", "-p", str(ports[0]), "cluster", "info"], capture_output=True).stdout
        ):
            assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.2)
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        probe = redis_from_url(url, socket_connect_timeout=2)
        try:  # every node agrees on the slots: a cluster client can write
            while True:
                try:
                    probe.set("probe", 1)
                    break
                except (redis.RedisError, redis.exceptions.RedisClusterException):
                    assert time.monotonic() < deadline + 20, "the cluster took no writes"
                    time.sleep(0.2)
        finally:
            probe.close()
        yield url
    finally:
        for p in ports:
            subprocess.run(["redis-cli", "-p", str(p), "shutdown", "nosave"], capture_output=True)


def _cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster bus port (port + 10000) is free too, so at most 55535."""
    rng, out = random.Random(), []
    while len(out) < n:
        p = rng.randrange(20000, 55535)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pings(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return False


def test_one_script_over_several_versions_is_refused_by_a_cluster(cluster_url):
    """Why the keys changed: a guard and a live hash of two versions land in different slots."""
    r = redis_from_url(cluster_url)
    try:
        assert isinstance(r, redis.RedisCluster)
        ks = ["p:counted:a", "p:live:1", "p:counted:b", "p:live:2"]  # the layout before hash tags
        with pytest.raises((redis.RedisError, redis.exceptions.RedisClusterException), match="same key slot|CROSSSLOT"):
            r.eval(_LIVE_LUA, len(ks), *ks, 60, "accept", "reject")
    finally:
        r.close()


def test_ingest_counts_live_acceptance_exactly_once_on_a_cluster(cluster_url):
    prefix = f"c{time.time_ns()}"
    metrics = IngestMetrics(prefix, cluster_url)

    async def run():
        t = Tally()
        t.inc("joined", 4)
        for i, (v, kind) in enumerate([(1, "accept"), (2, "reject"), (3, "accept"), (1, "edit")]):
            t.live.append((f"fb-{i}", v, kind + keys.judged_fields(4, 0.2)))
        await metrics.apply(t)
        again = Tally()  # a redelivered batch: the guards make it a no-op
        again.live.extend(t.live)
        again.live.append(("fb-r", 1, keys.revert_field(time.time())))
        await metrics.apply(again)
        await metrics.close()

    asyncio.run(run())
    r = redis_from_url(cluster_url, decode_responses=True)
    try:
        live = {v: {k: int(n) for k, n in r.hgetall(keys.live(prefix, v)).items()} for v in (1, 2, 3)}
        assert keys.live_totals(live[1]) == {"accept": 1, "edit": 1, "events": 2, "revert": 1}
        assert keys.live_totals(live[2]) == {"reject": 1, "events": 1}
        assert keys.guardrail_means(live[3]) == {"response_length": 4.0, "latency": 200.0}
        assert 0 < r.ttl(keys.counted(prefix, 1, "fb-0")) <= COUNTED_TTL_S
        assert int(r.hget(keys.ingest_counters(prefix), "joined")) == 4
        # readers on the same cluster: the gate's canary (scan over every node) and the operators' tables
        from core.fleet import routable_nodes
        from liverl.ops.admin import _live

        for node in ("node-a", "node-b", "node-c"):
            r.set(
                keys.served(prefix, node), keys.ServedHeartbeat(version=1, checksum="x", url=f"http://{node}").to_json()
            )
        allowed = {n: f"http://{n}" for n in ("node-a", "node-b", "node-c")}
        assert routable_nodes(r, prefix, allowed) == ["node-a", "node-b", "node-c"]
        assert _live(r, prefix, [1, 2, 3])[2] == {"reject": 1, "events": 1}
    finally:
        r.close()


def test_per_user_sums_are_counted_and_read_on_a_cluster(cluster_url):
    """The canary's per-user sums (keys.units) share their version's slot: counted in the same script call as the live
    counters, and read back for many buckets in one pipeline by a cluster client."""
    prefix = f"c{time.time_ns()}"
    metrics = IngestMetrics(prefix, cluster_url)
    b = keys.unit_bucket(time.time())

    async def run():
        t = Tally()
        t.live += [
            ("fb-0", 1, "accept" + keys.judged_fields(4, 0.2), b, "u1"),
            ("fb-1", 2, "reject", b, "u1"),
            ("fb-2", 1, "edit", b - 1, None),
            ("fb-3", 1, f"revert@{b - 1}", b - 1, "u2"),
        ]
        await metrics.apply(t)
        await metrics.apply(t)  # redelivered: the guards make it a no-op
        await metrics.close()

    asyncio.run(run())
    r = redis_from_url(cluster_url, decode_responses=True)
    try:
        assert keys.read_unit_buckets(r, prefix, 1, [b - 1, b, b + 1]) == {
            b - 1: {"*": {"e": 1, "d": 1, "r": 1}, "u2": {"r": 1}},
            b: {
                "u1": {"e": 1, "a": 1, "t": 4, "m": 200, "n": 1},
                "*": {"e": 1, "a": 1, "t": 4, "t2": 16, "m": 200, "m2": 40000, "n": 1, "h23": 1},
            },
            b + 1: {},
        }
        assert keys.read_unit_buckets(r, prefix, 2, [b]) == {b: {"u1": {"e": 1}, "*": {"e": 1}}}
        assert r.ttl(keys.units(prefix, 1, b)) > 0
    finally:
        r.close()
