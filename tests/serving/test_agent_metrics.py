"""The serving process serves the agent's own metrics on ``serving.agent_port`` (``serving.agent.metrics``): the swap,
pause, re-verification and poll-error metrics the dashboards and alerts use, counted where the agent runs. Driven
with the real Redis and a stand-in node (no vLLM: the swap is refused before any call to the node)."""

from __future__ import annotations

import asyncio

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from deploy.registry.signing import Signer, announce, generate_keypair
from serving.agent.agent import Agent
from serving.agent.metrics import start_agent_server
from serving.node.gateway_host import GatewayLink
from tests.conftest import free_port

AGENT_METRICS = (
    "liverl_gateway_swaps",
    "liverl_gateway_swap_pause_seconds",
    "liverl_gateway_reverify",
    "liverl_gateway_agent_errors",
)


class _Node:
    """The node as the link sees it: every state report is taken."""

    def __init__(self):
        self.ops: list = []

    async def request(self, method, path, retry=True, json=None):
        self.ops.append(json["ops"])
        return 200, {"version": None}


def test_the_agent_s_endpoint_serves_its_metrics_after_it_counts_a_refused_swap(cfg, rds):
    private, _ = generate_keypair(cfg.state_path / "keys")
    announce(rds, cfg.topics.prefix, 7, "bb" * 32, "promoted v7", Signer(private))
    port = free_port()

    async def run() -> tuple[dict, tuple[int, dict], tuple[int, dict]]:
        r = aioredis.Redis.from_url(cfg.redis.url)
        link = GatewayLink(_Node(), "node-a")
        agent = Agent(cfg, link, r)  # no registry: the swap to v7 cannot be planned, so it is refused
        web = await start_agent_server(agent.metrics, agent.health, cfg.serving.host, port)
        try:
            async with aiohttp.ClientSession() as http:

                async def get(path: str):
                    async with http.get(f"http://{cfg.serving.host}:{port}{path}") as resp:
                        return resp.status, await (resp.json() if path == "/healthz" else resp.text())

                starting = await get("/healthz")
                link.set_served(3, "aa" * 32)  # what Agent.init learns from the node
                assert await agent.step() is None
                _, text = await get("/metrics")
                return text, starting, await get("/healthz")
        finally:
            await web.cleanup()
            await r.aclose()

    text, starting, healthy = asyncio.run(run())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in AGENT_METRICS:
        assert name in families, sorted(families)
    swaps = {
        s.labels["outcome"]: s.value for s in families["liverl_gateway_swaps"].samples if s.name.endswith("_total")
    }
    assert swaps == {"refused": 1}
    assert next(s.value for s in families["liverl_agent_target_version"].samples) == 7
    assert starting == (503, {"ok": False, "reason": "not initialised", "version": None, "node": "node-a"})
    assert healthy == (200, {"ok": True, "reason": None, "version": 3, "node": "node-a"})
    errors = rds.lrange(f"{cfg.topics.prefix}:swap_errors", 0, -1)
    assert len(errors) == 1 and "no registry configured" in errors[0]


def test_agent_port_zero_serves_nothing_and_several_nodes_count_it_up():
    from core.config import load_config
    from liverl.stack.supervisor import node_serving
    from serving.agent.metrics import AgentMetrics

    assert asyncio.run(start_agent_server(AgentMetrics(), lambda: (True, {}), "127.0.0.1", 0)) is None
    cfg = load_config(env={}, serving__nodes=2, serving__agent_port=9300)
    assert node_serving(cfg.serving.model_dump(mode="json"), 1)["agent_port"] == 9301
    off = load_config(env={}, serving__nodes=2, serving__agent_port=0)
    assert node_serving(off.serving.model_dump(mode="json"), 1)["agent_port"] == 0
