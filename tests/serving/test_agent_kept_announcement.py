"""A serving agent keeps the last desired announcement it verified across restarts: with the gate down longer than
``security.announce_ttl_s`` the announcement in Redis expires, and a node that restarts (from its model directory,
version 0) must return to the stable version, not serve the base weights labelled and routed as usual. Real Redis; a
stand-in node and a stand-in swap (no vLLM)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from deploy.registry.signing import Signer, announce, generate_keypair
from serving.agent.agent import Agent
from serving.node.gateway_host import GatewayLink


class _Node:
    async def request(self, method, path, retry=True, json=None):
        return 200, {"version": None}


def _agent(cfg, r, served: tuple[int, str]) -> tuple[Agent, list[int]]:
    link = GatewayLink(_Node(), "node-a")
    link.set_served(*served)
    agent = Agent(cfg, link, r)
    swapped: list[int] = []

    async def swap(ann):
        link.set_served(ann.version, ann.checksum)
        swapped.append(ann.version)
        return {"to": ann.version}

    agent.swap_to = swap
    return agent, swapped


def test_a_restarted_agent_follows_the_last_verified_announcement_after_it_expired(cfg, rds):
    private, _ = generate_keypair(cfg.state_path / "keys")
    p = cfg.topics.prefix
    ann = announce(rds, p, 5, "bb" * 32, "promoted v5", Signer(private), ttl_s=0.5)

    async def run() -> tuple[list[int], object, list[int]]:
        r = aioredis.Redis.from_url(cfg.redis.url)
        try:
            first, swapped_first = _agent(cfg, r, (0, "aa" * 32))
            await first.step()  # verifies v5 and keeps it
            while time.time() < ann.expires_at + 0.1:  # the gate is down: nothing re-announces it
                await asyncio.sleep(0.05)
            restarted, swapped = _agent(cfg, r, (0, "aa" * 32))  # the node restarted from its model directory
            target = await restarted.desired()
            await restarted.step()
            return swapped_first, target, swapped
        finally:
            await r.aclose()

    swapped_first, target, swapped = asyncio.run(run())
    assert swapped_first == [5]
    assert target is not None and target.version == 5
    assert swapped == [5]


def test_a_kept_announcement_of_another_key_or_deployment_is_refused(cfg, rds, tmp_path):
    """The kept copy is verified again when it is read: one signed by another key, or announced for another
    deployment, moves nothing."""
    private, _ = generate_keypair(cfg.state_path / "keys")
    other, _ = generate_keypair(tmp_path / "other")
    p = cfg.topics.prefix

    async def run() -> list:
        r = aioredis.Redis.from_url(cfg.redis.url)
        try:
            got = []
            for signer, prefix in ((Signer(other), p), (Signer(private), "another-deployment")):
                announce(rds, prefix, 7, "cc" * 32, "forged", signer)
                agent, _ = _agent(cfg, r, (0, "aa" * 32))
                agent.kept.path.parent.mkdir(parents=True, exist_ok=True)
                agent.kept.path.write_bytes(rds.get(f"{prefix}:desired").encode())
                rds.delete(f"{prefix}:desired")
                got.append(await agent.desired())
            return got
        finally:
            await r.aclose()

    assert asyncio.run(run()) == [None, None]
