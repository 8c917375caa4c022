"""The agent records what its node serves in the registry's fleet table (a canary's evidence waits for the canary
nodes' ``served`` rows) until the registry takes it, and keeps its memory of failed swaps bounded. Driven with the
real Redis and stand-ins for the node and the registry."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from sqlalchemy.exc import OperationalError

from deploy.registry.signing import generate_keypair
from serving.agent.agent import Agent
from serving.node.gateway_host import GatewayLink


class _Node:
    async def request(self, method, path, retry=True, json=None):
        return 200, {"version": None}


class _Registry:
    """Refuses the first ``fails`` fleet records, as a database that is briefly unreachable does."""

    def __init__(self, fails: int):
        self.fails, self.rows = fails, []

    def update_fleet(self, node, version, checksum, at=None):
        if self.fails:
            self.fails -= 1
            raise OperationalError("UPDATE fleet", {}, ConnectionError("the database is restarting"))
        self.rows.append((node, version, checksum, at))


def test_a_fleet_record_the_registry_refused_is_retried_at_each_poll_with_the_swap_s_time(cfg, rds):
    """The served row a canary waits for lands at a later poll once the registry is back, dated when the node swapped,
    not when the record finally landed; the failures are counted."""
    generate_keypair(cfg.state_path / "keys")
    registry = _Registry(fails=2)

    async def run():
        r = aioredis.Redis.from_url(cfg.redis.url)
        agent = Agent(cfg, GatewayLink(_Node(), "node-a"), r, registry=registry)
        try:
            agent.gw.set_served(5, "cc" * 32)
            swapped_at = time.time()
            agent.fleet_record.swapped(5, "cc" * 32, swapped_at)  # what a swap does, then records it
            await agent.fleet_record.flush()
            assert registry.rows == [] and agent.fleet_record.unrecorded is not None
            for _ in range(2):
                await agent.step()  # nothing announced: no swap, but the record is tried again
            return agent, swapped_at
        finally:
            await r.aclose()

    agent, swapped_at = asyncio.run(run())
    assert registry.rows == [("node-a", 5, "cc" * 32, swapped_at)] and agent.fleet_record.unrecorded is None
    errors = {
        s.labels["kind"]: s.value
        for s in agent.metrics.errors.collect()[0].samples
        if s.name.endswith("_total") and s.labels["kind"].startswith("fleet_record")
    }
    assert errors == {"fleet_record OperationalError": 2.0}


def test_failed_swaps_are_remembered_only_for_their_retry_window(cfg, rds):
    """A failed swap is remembered so that it is not tried at every poll; past the retry window it is forgotten, so
    announcements that fail over a node's life do not pile up."""
    generate_keypair(cfg.state_path / "keys")

    async def run():
        r = aioredis.Redis.from_url(cfg.redis.url)
        agent = Agent(cfg, GatewayLink(_Node(), "node-a"), r, retry_failed_after_s=60.0)
        try:
            agent.gw.set_served(5, "cc" * 32)
            now = time.monotonic()
            agent._failed = {("desired", v, "dd" * 32): now - 61.0 - v for v in range(1000)}
            agent._failed[("canary", 7, "ee" * 32)] = now
            await agent.step()
            return agent._failed
        finally:
            await r.aclose()

    assert list(asyncio.run(run())) == [("canary", 7, "ee" * 32)]
