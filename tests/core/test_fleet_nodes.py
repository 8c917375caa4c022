"""``core.fleet``'s nodes: which serving nodes may take traffic (the router, the gate's canary and ``liverl
status`` share the rule), on the real Redis; and the fleet ``liverl up`` names for the nodes it starts."""

from __future__ import annotations

import pytest

from core import fleet, keys
from core.config import load_config


def _beat(rds, prefix: str, node: str, url: str | None, healthy: bool = True) -> None:
    hb = keys.ServedHeartbeat(version=2, checksum="c" * 64, healthy=healthy, url=url)
    rds.set(keys.served(prefix, node), hb.to_json(), ex=60)


def test_routable_nodes_are_the_configured_healthy_ones_at_the_configured_url(cfg, rds):
    p = cfg.topics.prefix
    allowed = {"node-0": "http://10.0.0.1:8000/", "node-1": "http://10.0.0.2:8000", "node-2": "http://10.0.0.3:8000"}
    _beat(rds, p, "node-0", "http://10.0.0.1:8000")
    _beat(rds, p, "node-1", "http://evil.example:80")  # a known name: the config's URL is used
    _beat(rds, p, "node-2", "http://10.0.0.3:8000", healthy=False)  # out of service
    _beat(rds, p, "zz", "http://evil.example:80")  # unknown: never routable
    rds.set(keys.served(p, "garbage"), "{not json", ex=60)  # unreadable: skipped (logged)
    beats = fleet.read_heartbeats(rds, p)
    assert set(beats) == {"node-0", "node-1", "node-2", "zz"}
    nodes = fleet.routable(beats, allowed)
    assert [(n.name, n.url, n.version) for n in nodes] == [
        ("node-0", "http://10.0.0.1:8000", 2),
        ("node-1", "http://10.0.0.2:8000", 2),
    ]
    assert fleet.unknown(beats, allowed) == ["zz"]
    assert fleet.routable_nodes(rds, p, allowed) == ["node-0", "node-1"]
    assert fleet.routable_nodes(rds, p, {}) == []  # a config that names no node routes to none


def test_the_async_reader_reads_the_same(cfg, rds):
    import asyncio

    import redis.asyncio as aioredis

    p = cfg.topics.prefix
    _beat(rds, p, "node-0", "http://10.0.0.1:8000")
    _beat(rds, p, "zz", None)

    async def main():
        r = aioredis.from_url(cfg.redis.url)
        try:
            return await fleet.read_heartbeats_async(r, p)
        finally:
            await r.aclose()

    assert asyncio.run(main()) == fleet.read_heartbeats(rds, p)


def test_fleet_urls_are_checked():
    load_config(env={}, serving__fleet={"node-0": "https://gw.internal:8443"})
    for bad in (
        {"node-0": "gw.internal:8000"},
        {"node-0": "ftp://x"},
        {"": "http://x:1"},
        {"node-0": "http://x:1/?a=b"},
    ):
        with pytest.raises(ValueError, match="serving.fleet"):
            load_config(env={}, serving__fleet=bad)


def test_up_names_the_nodes_it_starts():
    from liverl.stack.up import Pipeline, with_local_fleet

    two = load_config(env={}, serving__nodes=2, serving__gateway_port=9000, serving__host="0.0.0.0")
    assert with_local_fleet(two).serving.fleet == {"node-0": "http://127.0.0.1:9000", "node-1": "http://127.0.0.1:9001"}
    assert Pipeline(two, "/m").cfg.serving.fleet == with_local_fleet(two).serving.fleet
    assert two.serving.fleet == {}  # the caller's config is not changed
    one = load_config(env={}, serving__node_name="gpu-a", serving__advertise_url="http://10.0.0.9:8000")
    assert with_local_fleet(one).serving.fleet == {"gpu-a": "http://10.0.0.9:8000"}
    other = load_config(env={}, serving__nodes=2, serving__fleet={"node-0": "http://10.0.0.1:8000"})
    with pytest.raises(ValueError, match="leave serving.fleet unset"):
        with_local_fleet(other)
