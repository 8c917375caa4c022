"""The serving side's probes say what they state (docs/operations.md, "Probes"):

- the gateway's ``/readyz`` is 503 until a completion sent now would be served (its producer started, a version its
  agent verified), then 200, and once it is 200 a completion succeeds; a draining gateway answers 503 at once, refuses
  new generations with ``X-Liverl-Draining`` and counts the ones it still holds; ``/livez`` answers throughout;
- the router's ``/readyz`` is 503 with no node in rotation, 200 with a node in rotation (with only the canary's, it
  says the stable arm's requests are held), 503 once it drains; a node's draining 503 sends the request to the next
  node;
- the serving process's own server answers ``/livez`` and ``/readyz`` from the probes it is given.

The gateway runs for real on the session's broker in front of a stand-in for the vLLM node (a few canned lines of its
OpenAI API, one of them slow); the router on the real Redis in front of stand-in gateways (``tests.serving.routing``).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from core import keys
from core.config import load_config
from core.probes import DRAINING_HEADER
from serving.agent.metrics import AgentMetrics, start_agent_server
from serving.node.client import NodeClient
from serving.node.gateway import Gateway
from serving.node.gateway_host import GatewayLink, apply_ops, state_of
from serving.router.router import Router
from tests.conftest import free_port
from tests.serving.routing import announce_rollout, beat, front_door, gateway, start, until
from tests.serving.test_gateway_units import COMPLETION


async def _node(port: int, release: asyncio.Event) -> web.AppRunner:
    """A stand-in vLLM node: ``/v1/models``, and ``/v1/completions`` that holds a prompt "slow" until ``release``."""

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "liverl", "max_model_len": 64}]})

    async def completions(request: web.Request):
        if "slow" in json.dumps(json.loads(await request.read()).get("prompt")):
            await release.wait()
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return await start(app, port)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as r:
        return r.status, await r.json(content_type=None)


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str = "[a]40+2=") -> aiohttp.ClientResponse:
    async with http.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as r:
        await r.read()
        return r


def test_gateway_readyz_is_200_exactly_when_a_completion_would_be_served_and_drops_at_once_on_drain(stack, tmp_path):
    cfg = load_config(
        env={},
        state_dir=str(tmp_path),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
    )

    async def run() -> None:
        node_port, gw_port = free_port(), free_port()
        release = asyncio.Event()
        node = await _node(node_port, release)
        client = NodeClient(f"http://127.0.0.1:{node_port}")
        await client.start()
        gw = Gateway(cfg, client, "node-t", stack.bootstrap)
        runner = await start(gw.app, gw_port)  # listening before its start, as it would be if it answered early
        url = f"http://127.0.0.1:{gw_port}"
        try:
            async with aiohttp.ClientSession() as http:
                assert (await _get(http, f"{url}/livez"))[0] == 200
                status, body = await _get(http, f"{url}/readyz")
                assert status == 503 and "producer" in body["reason"], body
                await gw.start()
                # the producer runs and vLLM answers /v1/models, but no version is verified yet: not ready, and a
                # completion sent now is indeed refused
                status, body = await _get(http, f"{url}/readyz")
                assert status == 503 and body["reason"] == "not initialised", body
                async with http.get(f"{url}/v1/models") as r:
                    assert r.status == 200
                assert (await _complete(http, url)).status == 503
                apply_ops(gw, GatewayLink(client, "node-t").ops())  # the agent's report before it verified: same
                assert (await _get(http, f"{url}/readyz"))[0] == 503
                gw.set_served(3, "c" * 64)  # what the agent reports once it has read the weights back
                status, body = await _get(http, f"{url}/readyz")
                assert status == 200 and body == {"ready": True, "reason": None, "version": 3, "node": "node-t"}
                r = await _complete(http, url)
                assert r.status == 200 and r.headers["X-Liverl-Version"] == "3"

                # a generation in flight when the drain begins: counted, and it finishes
                slow = asyncio.create_task(_complete(http, url, "slow"))
                await until(lambda: gw.active == 1, "the slow generation in the gateway's handler")
                link = GatewayLink(client, "node-t")
                link.set_served(3, "c" * 64)
                link.drain()
                apply_ops(gw, link.ops())
                status, body = await _get(http, f"{url}/readyz")
                assert status == 503 and body["reason"].startswith("draining"), body
                assert (await _get(http, f"{url}/livez"))[0] == 200
                refused = await _complete(http, url)
                assert refused.status == 503 and refused.headers.get(DRAINING_HEADER) == "1"
                state = state_of(gw)
                assert state["draining"] is True and state["active"] == 1, state
                release.set()
                assert (await slow).status == 200  # admitted before the drain: served
                assert state_of(gw)["active"] == 0
        finally:
            await runner.cleanup()
            await gw.close()
            await client.close()
            await node.cleanup()

    asyncio.run(run())


def test_router_readyz_needs_a_node_in_rotation_and_a_draining_node_is_skipped(cfg, rds):
    prefix = cfg.topics.prefix

    async def run() -> None:
        ardis = aioredis.from_url(cfg.redis.url)
        ports = {"node-a": free_port(), "node-b": free_port()}
        rcfg, signer = front_door(cfg, {n: f"http://127.0.0.1:{p}" for n, p in ports.items()})
        seen_b: list = []
        draining = web.Application()  # node-a: a gateway that is stopping

        async def refuse(_request: web.Request) -> web.Response:
            return web.json_response({"error": "draining"}, status=503, headers={DRAINING_HEADER: "1"})

        draining.router.add_post("/v1/completions", refuse)
        upstream = [await start(draining, ports["node-a"]), await start(gateway("node-b", seen_b), ports["node-b"])]
        router = Router(rcfg, ardis, refresh_s=0.05, down_s=30)
        rport = free_port()
        rrunner = await start(router.app, rport)
        base = f"http://127.0.0.1:{rport}"
        try:
            async with aiohttp.ClientSession() as http:
                assert (await _get(http, f"{base}/livez"))[0] == 200
                status, body = await _get(http, f"{base}/readyz")
                assert status == 503 and body["reason"] == "no serving node in rotation", body
                # a rollout whose canary is node-a, and only node-a in rotation: the stable arm has no node
                announce_rollout(rds, rcfg, signer, rollout_id=5, share=0.5, nodes=["node-a"])
                await beat(ardis, prefix, "node-a", None)
                await until(lambda: router.nodes and router.rollout is not None, "node-a and the rollout seen")
                status, body = await _get(http, f"{base}/readyz")
                assert status == 200 and body["stable_nodes"] == 0 and "held" in body["note"], body
                router.hold_s = 0.2
                stable_user = next(f"u{i}" for i in range(100) if router.arm(f"u{i}") is False)
                async with http.post(f"{base}/v1/completions", json={"prompt": "x", "user": stable_user}) as r:
                    assert r.status == 503  # held, and nothing changed within the hold: never sent to the canary
                await beat(ardis, prefix, "node-b", None)
                await until(lambda: len(router.nodes) == 2, "node-b in rotation")
                status, body = await _get(http, f"{base}/readyz")
                assert status == 200 and body["stable_nodes"] == 1, body
                # with no rollout every request may go to node-a, which is draining: each is answered by node-b
                rds.delete(keys.canary(prefix))
                await until(lambda: router.rollout is None, "the rollout's end seen")
                for i in range(20):
                    async with http.post(f"{base}/v1/completions", json={"prompt": "x", "user": f"u{i}"}) as r:
                        assert r.status == 200 and r.headers["X-Liverl-Node"] == "node-b", await r.text()
                assert len(seen_b) == 20
                router.draining = True
                status, body = await _get(http, f"{base}/readyz")
                assert status == 503 and body["reason"].startswith("draining"), body
        finally:
            await rrunner.cleanup()
            for u in upstream:
                await u.cleanup()
            await ardis.aclose()

    asyncio.run(run())


def test_the_serving_process_answers_livez_and_readyz_from_its_probes():
    async def run() -> None:
        port = free_port()
        state = {"live": True, "ready": False}
        runner = await start_agent_server(
            AgentMetrics(),
            lambda: (True, {"ok": True}),
            "127.0.0.1",
            port,
            live=lambda: (state["live"], {"ok": state["live"]}),
            ready=lambda: (state["ready"], {"ready": state["ready"]}),
        )
        try:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}"
                assert [(await _get(http, f"{url}/{p}"))[0] for p in ("livez", "readyz", "healthz")] == [200, 503, 200]
                state.update(live=False, ready=True)
                assert [(await _get(http, f"{url}/{p}"))[0] for p in ("livez", "readyz")] == [503, 200]
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_router_stays_ready_through_a_gap_in_the_heartbeats_and_holds_what_it_is_sent(cfg, rds):
    """After a Redis outage every node's heartbeat has expired until the nodes write again: a router that had nodes
    stays ready for serving.router_hold_s and holds the requests it is sent (a balancer taking every router out for
    those seconds would refuse them all); a router whose nodes stay gone longer than that says so."""
    prefix = cfg.topics.prefix

    async def run() -> None:
        ardis = aioredis.from_url(cfg.redis.url)
        port = free_port()
        rcfg, _ = front_door(cfg, {"node-a": f"http://127.0.0.1:{port}"})
        upstream = await start(gateway("node-a"), port)
        router = Router(rcfg, ardis, refresh_s=0.05)
        rport = free_port()
        rrunner = await start(router.app, rport)
        base = f"http://127.0.0.1:{rport}"
        try:
            async with aiohttp.ClientSession() as http:
                status, body = await _get(http, f"{base}/readyz")
                assert status == 503 and body["reason"] == "no serving node in rotation", body  # never had one
                await beat(ardis, prefix, "node-a", None)
                await until(lambda: router.nodes, "node-a in rotation")
                router.hold_s = 30.0
                await ardis.delete(keys.served(prefix, "node-a"))  # the heartbeat gone (Redis came back empty)
                await until(lambda: not router.nodes, "node-a out of rotation")
                status, body = await _get(http, f"{base}/readyz")
                assert status == 200 and body["nodes"] == 0 and "held" in body["note"], body
                held = asyncio.create_task(_complete(http, base))
                await until(lambda: router.holding == 1, "the request held")
                await beat(ardis, prefix, "node-a", None)  # the node writes its heartbeat again
                r = await held
                assert r.status == 200 and r.headers["X-Liverl-Node"] == "node-a"
                await ardis.delete(keys.served(prefix, "node-a"))
                await until(lambda: not router.nodes, "node-a out of rotation again")
                router.hold_s = 0.2  # gone longer than the hold: not ready
                await asyncio.sleep(0.5)
                status, body = await _get(http, f"{base}/readyz")
                assert status == 503 and body["reason"] == "no serving node in rotation", body
        finally:
            await rrunner.cleanup()
            await upstream.cleanup()
            await ardis.aclose()

    asyncio.run(run())
