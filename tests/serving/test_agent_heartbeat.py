"""The agent's heartbeat outlives any one poll: a swap, a plan or a re-verification can take longer than the
heartbeat's TTL (tens of GB to decode and read back), the node serves through it, and so it stays in rotation. Real
Redis; a stand-in node and a stand-in swap (no vLLM)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from core import keys
from deploy.registry.signing import Signer, announce, generate_keypair
from serving.agent.agent import Agent
from serving.node.gateway_host import GatewayLink


class _Node:
    """The node as the link sees it: every state report is taken."""

    async def request(self, method, path, retry=True, json=None):
        return 200, {"version": None}


def test_the_heartbeat_never_expires_during_a_swap_longer_than_its_ttl(cfg, rds):
    private, _ = generate_keypair(cfg.state_path / "keys")
    p = cfg.topics.prefix
    announce(rds, p, 7, "bb" * 32, "promoted v7", Signer(private))
    cfg.serving.swap_poll_s = 0.1
    ttl_s, swap_s = 1, 3.0  # the swap lasts three heartbeat lifetimes

    async def run() -> tuple[list[float | None], list[int]]:
        r = aioredis.Redis.from_url(cfg.redis.url)
        link = GatewayLink(_Node(), "node-a")
        link.set_served(3, "aa" * 32)
        agent = Agent(cfg, link, r)
        agent.heartbeat_ttl_s = ttl_s
        swapping = asyncio.Event()
        swapped: list[int] = []

        async def slow_swap(ann):
            swapping.set()
            await asyncio.sleep(swap_s)
            link.set_served(ann.version, ann.checksum)
            swapped.append(ann.version)
            return {"to": ann.version}

        agent.swap_to = slow_swap
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        seen: list[float | None] = []  # the heartbeat's ts at each read during the swap (None: expired)
        try:
            await asyncio.wait_for(swapping.wait(), 10)
            while not swapped:
                raw = await r.get(keys.served(p, "node-a"))
                seen.append(None if raw is None else keys.ServedHeartbeat.from_json(raw).ts)
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await task
            await r.aclose()
        return seen, swapped

    seen, swapped = asyncio.run(run())
    assert swapped == [7]
    assert len(seen) > 20 and None not in seen, f"the heartbeat was missing in {seen.count(None)} of {len(seen)} reads"
    assert len(set(seen)) > 2  # rewritten while the swap ran, not only before and after it
