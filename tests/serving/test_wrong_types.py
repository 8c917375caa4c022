"""A Redis key of the wrong type (a hash where an announcement or a heartbeat belongs) makes Redis answer WRONGTYPE.
The agent and the router read it as a refused or unreadable value, counted and logged, and go on: the node stays in
rotation (its heartbeat is still written), and the router keeps refreshing its nodes and its rollout terms. Real
Redis; a stand-in node (no vLLM) and stand-in gateways."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from core import fleet, keys
from serving.agent.agent import Agent
from serving.node.gateway_host import GatewayLink
from serving.router.router import Router
from tests.conftest import free_port
from tests.serving.routing import announce_rollout, beat, front_door, gateway, start


class _Node:
    """The node as the link sees it: every state report is taken."""

    async def request(self, method, path, retry=True, json=None):
        return 200, {"version": None}


def test_a_desired_key_of_another_type_leaves_the_node_in_rotation(cfg, rds):
    p = cfg.topics.prefix
    front_door(cfg, {"node-a": "http://127.0.0.1:1"})  # the announcement key pair the agent verifies with
    rds.hset(keys.desired(p), "x", "1")
    rds.hset(keys.canary(p), "x", "1")

    async def run() -> Agent:
        r = aioredis.Redis.from_url(cfg.redis.url)
        try:
            link = GatewayLink(_Node(), "node-a")
            link.set_served(3, "aa" * 32)
            agent = Agent(cfg, link, r)
            assert await agent.step() is None
            return agent
        finally:
            await r.aclose()

    agent = asyncio.run(run())
    beat_now = keys.ServedHeartbeat.from_json(rds.get(keys.served(p, "node-a")))
    assert (beat_now.version, beat_now.healthy) == (3, True)
    assert dict(agent.refused_by_reason) == {"wrong_type": 2}


def test_the_router_refreshes_past_keys_of_another_type(cfg, rds):
    """A heartbeat key and the canary key made hashes: the router routes on the readable heartbeats, counts the other,
    and picks up the rollout once the gate writes its announcement over the hash."""
    ports = {n: free_port() for n in ("node-a", "node-b")}
    rcfg, signer = front_door(cfg, {n: f"http://127.0.0.1:{port}" for n, port in ports.items()})
    p = cfg.topics.prefix

    async def main() -> None:
        ardis = aioredis.from_url(cfg.redis.url)
        runners = [await start(gateway(n), port) for n, port in ports.items()]
        try:
            await beat(ardis, p, "node-a", None)
            await ardis.hset(keys.served(p, "node-b"), "x", "1")
            await ardis.hset(keys.canary(p), "x", "1")
            router = Router(rcfg, ardis, refresh_s=3600)
            await router.refresh()
            assert [n.name for n in router.nodes] == ["node-a"] and router.rollout is None
            refused = {s.labels["reason"] for s in router.m_refused.collect()[0].samples if s.name.endswith("_total")}
            assert refused == {"wrong_type"}
            assert router.m_unreadable._value.get() == 1
            await ardis.delete(keys.served(p, "node-b"))
            await beat(ardis, p, "node-b", None)
            announce_rollout(rds, rcfg, signer, rollout_id=3, share=0.5, nodes=["node-b"])  # SET: over the hash
            await router.refresh()
            assert [n.name for n in router.nodes] == ["node-a", "node-b"]
            assert router.rollout is not None and router.rollout.nodes == ["node-b"]
        finally:
            for r in runners:
                await r.cleanup()
            await ardis.aclose()

    asyncio.run(main())
    assert fleet.read_desired(rds, p) is None
