"""The router in front of the fleet, on the real Redis: sticky per user, only live and healthy nodes in rotation,
nodes joining and leaving move only their own users, a node that refuses connections is skipped invisibly, and
bodies, headers and streamed chunks pass through unchanged.

The two nodes behind it are small aiohttp apps that answer as a node's gateway does (a body naming the node,
liverl's headers, an SSE stream), not vLLM: two vLLM engines on a 2-core CI machine take minutes to start and
would test vLLM, not routing. A real node behind the router is in the serving suite (test_serving.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import redis.asyncio as aioredis

from core import fleet, keys
from core.credentials import load_assignment_key
from core.fleet import Node, user_key
from serving.router.router import Router, rank
from tests.conftest import free_port
from tests.serving.routing import announce_rollout, beat, front_door, gateway, start, until


def test_rendezvous_ranking_is_sticky_and_moves_only_a_leaving_node_s_users():
    a, b, c = (Node(n, f"http://{n}", 1) for n in ("node-a", "node-b", "node-c"))
    users = [f"user-{i}" for i in range(3000)]
    before = {u: rank(u, [a, b, c])[0].name for u in users}
    assert before == {u: rank(u, [c, a, b])[0].name for u in users}  # order of discovery does not matter
    share = {n: sum(v == n for v in before.values()) / len(users) for n in ("node-a", "node-b", "node-c")}
    assert all(0.29 < s < 0.38 for s in share.values()), share
    after = {u: rank(u, [a, c])[0].name for u in users}  # node-b leaves
    assert all(after[u] == before[u] for u in users if before[u] != "node-b")
    back = {u: rank(u, [a, b, c])[0].name for u in users}  # and comes back: its users return
    assert back == before


def test_user_key_header_then_openai_user_then_session():
    assert user_key({"X-Liverl-User": "u1"}, b'{"user": "u2"}') == "u1"
    assert user_key({}, b'{"prompt": "x", "user": "u2"}') == "u2"
    assert user_key({"X-Session-Id": "s"}, b'{"prompt": "x"}') == "s"
    deep = b'{"user": "u", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"  # RecursionError in json.loads
    for hostile in (b'{"user": 5}', b'{"user": ["a"]}', b'{"user": ""', b"[1]", b"\xff\xfe", b"", deep):
        assert user_key({}, hostile) is None


def test_router_routes_sticky_over_live_healthy_nodes_and_fails_over(cfg, rds):
    prefix = cfg.topics.prefix

    async def main() -> None:
        ardis = aioredis.from_url(cfg.redis.url)
        ports = {"node-a": free_port(), "node-b": free_port(), "node-c": free_port()}
        rcfg, _ = front_door(cfg, {n: f"http://127.0.0.1:{p}" for n, p in ports.items()})
        upstream = {n: await start(gateway(n), ports[n]) for n in ("node-a", "node-b")}
        for n in ("node-a", "node-b"):
            await beat(ardis, prefix, n, f"http://127.0.0.1:{ports[n]}")
        router = Router(rcfg, ardis, refresh_s=0.1, down_s=30)
        rport = free_port()
        rrunner = await start(router.app, rport)
        base = f"http://127.0.0.1:{rport}"
        try:
            async with aiohttp.ClientSession() as http:

                async def ask(user: str | None, **extra) -> tuple[int, dict, dict]:
                    body = {"prompt": "1+1=", **({"user": user} if user else {}), **extra}
                    async with http.post(f"{base}/v1/completions", json=body) as r:
                        return r.status, dict(r.headers), await r.json()

                async with http.get(f"{base}/fleet") as r:
                    assert {n["node"] for n in await r.json()} == {"node-a", "node-b"}  # node-c: no heartbeat yet
                users = [f"u{i}" for i in range(60)]
                first = {}
                for u in users:
                    status, headers, body = await ask(u)
                    assert status == 200 and body["echo"]["user"] == u  # the body reaches the node unchanged
                    assert headers["X-Liverl-Node"] == body["node"] and headers["X-Liverl-Version"] == "3"
                    assert headers["X-Liverl-Generation-Id"] == f"g-{body['node']}"
                    first[u] = body["node"]
                assert set(first.values()) == {"node-a", "node-b"}
                for u in users[:20]:  # sticky
                    assert (await ask(u))[2]["node"] == first[u]
                status, _, body = await ask("u0", prompt="bad")  # the node's 4xx passes through as it is
                assert status == 400 and body["error"]["param"] == "prompt"

                async with http.post(
                    f"{base}/v1/completions", json={"prompt": "x", "stream": True}, headers={"X-Liverl-User": "u1"}
                ) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    assert r.headers["X-Liverl-Node"] == first["u1"]
                    text = (await r.read()).decode()
                events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
                assert [e["i"] for e in events] == list(range(5)) and text.endswith("data: [DONE]\n\n")

                # node-b reports itself unhealthy (a failed weight check): out of rotation, node-a's users stay put
                await beat(ardis, prefix, "node-b", f"http://127.0.0.1:{ports['node-b']}", healthy=False)
                await until(lambda: {n.name for n in router.nodes} == {"node-a"})
                for u in users:
                    assert (await ask(u))[2]["node"] == "node-a"
                await beat(ardis, prefix, "node-b", f"http://127.0.0.1:{ports['node-b']}")
                await until(lambda: {n.name for n in router.nodes} == {"node-a", "node-b"})
                assert {u: (await ask(u))[2]["node"] for u in users} == first  # back: its users return

                # node-a dies without a word (heartbeat still fresh): its users fail over, nobody sees an error
                await upstream["node-a"].cleanup()
                for u in users:
                    status, headers, body = await ask(u)
                    assert status == 200 and body["node"] == "node-b"
                # a node that joins takes its share of users (rendezvous: only users it now ranks first move)
                upstream["node-c"] = await start(gateway("node-c"), ports["node-c"])
                await ardis.delete(keys.served(prefix, "node-a"))  # node-a's heartbeat expires
                await beat(ardis, prefix, "node-c", f"http://127.0.0.1:{ports['node-c']}")
                await until(lambda: {n.name for n in router.nodes} == {"node-b", "node-c"})
                now = {u: (await ask(u))[2]["node"] for u in users}
                assert set(now.values()) == {"node-b", "node-c"}
                nodes = [Node(n, "", 3) for n in ("node-b", "node-c")]
                assert now == {u: rank(u, nodes)[0].name for u in users}

                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                assert 'liverl_router_failovers_total{node="node-a"}' in text
                assert 'liverl_router_requests_total{node="node-b",status="200"}' in text
                assert "liverl_router_nodes 2.0" in text

                for n in ("node-b", "node-c"):  # the whole fleet gone
                    await ardis.delete(keys.served(prefix, n))
                await until(lambda: not router.nodes)
                # held while the fleet comes back: node-c's heartbeat returns while the request waits, and it answers
                router.hold_s = 30.0
                held = asyncio.create_task(ask("u1"))
                await until(lambda: router.holding == 1)
                await beat(ardis, prefix, "node-c", f"http://127.0.0.1:{ports['node-c']}")
                status, headers, body = await held
                assert status == 200 and body["node"] == "node-c" and headers["X-Liverl-Node"] == "node-c"
                assert router.holding == 0
                await ardis.delete(keys.served(prefix, "node-c"))
                await until(lambda: not router.nodes)
                router.hold_s = 0.3  # nothing comes back within the hold: 503
                status, _, body = await ask("u1")
                assert status == 503 and "no serving node" in body["error"]["message"]
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                assert 'liverl_router_held_total{outcome="served"} 1.0' in text
                assert 'liverl_router_held_total{outcome="503"} 1.0' in text
                async with http.get(f"{base}/healthz") as r:
                    assert r.status == 503
        finally:
            await rrunner.cleanup()
            for r in upstream.values():
                await r.cleanup()
            await ardis.aclose()

    asyncio.run(main())


def test_during_a_rollout_the_canary_share_of_users_goes_to_the_canary_nodes(cfg, rds):
    prefix = cfg.topics.prefix

    async def main() -> None:
        ardis = aioredis.from_url(cfg.redis.url)
        ports = {n: free_port() for n in ("node-a", "node-b", "node-c")}
        rcfg, signer = front_door(cfg, {n: f"http://127.0.0.1:{p}" for n, p in ports.items()})
        secret = load_assignment_key(rcfg)
        upstream = {n: await start(gateway(n), p) for n, p in ports.items()}
        for n, p in ports.items():
            await beat(ardis, prefix, n, f"http://127.0.0.1:{p}")
        announce_rollout(rds, rcfg, signer, rollout_id=11, share=0.3, nodes=["node-c"])
        router = Router(rcfg, ardis, refresh_s=0.1)
        rport = free_port()
        rrunner = await start(router.app, rport)
        try:
            async with aiohttp.ClientSession() as http:

                async def node_of(user: str) -> str:
                    async with http.post(
                        f"http://127.0.0.1:{rport}/v1/completions", json={"prompt": "x", "user": user}
                    ) as r:
                        return (await r.json())["node"]

                users = [f"user-{i}" for i in range(400)]
                seen = {u: await node_of(u) for u in users}
                for u in users:  # the canary's users are exactly those whose keyed bucket is below the share
                    assert (seen[u] == "node-c") == (fleet.bucket(secret, 11, u) < 0.3), u
                assert 0.22 < sum(v == "node-c" for v in seen.values()) / len(users) < 0.38
                assert {v for v in seen.values() if v != "node-c"} == {"node-a", "node-b"}
                for u in users[:50]:  # sticky
                    assert await node_of(u) == seen[u]

                rds.delete(keys.canary(prefix))  # the rollout ends: node-c takes ordinary users again
                await until(lambda: router.rollout is None)
                after = {u: await node_of(u) for u in users}
                assert set(after.values()) == {"node-a", "node-b", "node-c"}
                assert sum(v == "node-c" for v in after.values()) / len(users) < 0.45
        finally:
            await rrunner.cleanup()
            for r in upstream.values():
                await r.cleanup()
            await ardis.aclose()

    asyncio.run(main())


@pytest.mark.slow
def test_a_real_node_behind_the_router_with_the_openai_client(srv):
    """The real serving process (vLLM on CPU, gateway, agent) announces its URL in its heartbeat; the OpenAI client
    talks to the router, plain and streamed, and every generation keeps its id and is logged."""
    import threading

    import openai

    from tests.serving.conftest import records

    ready, stop = threading.Event(), None
    port = free_port()
    holder: dict = {}

    def run() -> None:
        async def main() -> None:
            nonlocal stop
            stop = asyncio.Event()
            ardis = aioredis.from_url(srv.cfg.redis.url)
            rcfg, _ = front_door(srv.cfg, {srv.cfg.serving.node_name: srv.url})
            router = Router(rcfg, ardis, refresh_s=0.2)
            runner = await start(router.app, port)
            holder["router"] = router
            ready.set()
            await stop.wait()
            await runner.cleanup()
            await ardis.aclose()

        holder["loop"] = asyncio.new_event_loop()
        holder["loop"].run_until_complete(main())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        beat = keys.ServedHeartbeat.from_json(
            srv.redis.get(keys.served(srv.cfg.topics.prefix, srv.cfg.serving.node_name))
        )
        assert beat.url == srv.url and beat.healthy
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            raw = c.completions.with_raw_response.create(model="liverl", prompt="[a]23+45=", max_tokens=4, user="alice")
            out = raw.parse()
            assert raw.headers["X-Liverl-Node"] == srv.cfg.serving.node_name
            gid = out.choices[0].model_extra["generation_id"]
            assert raw.headers["X-Liverl-Generation-Id"] == gid
            chunks = list(
                c.chat.completions.create(
                    model="liverl",
                    messages=[{"role": "user", "content": "[b]1+2="}],
                    max_tokens=4,
                    stream=True,
                    user="bob",
                )
            )
            sid = chunks[0].choices[0].model_extra["generation_id"]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        recs = records(srv, {gid, sid})
        assert recs[gid].completion == out.choices[0].text and recs[sid].completion == text
    finally:
        holder["loop"].call_soon_threadsafe(stop.set)
        t.join(30)
