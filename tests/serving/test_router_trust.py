"""What the router trusts: Redis signals health, never where users go.

- a heartbeat of a node ``serving.fleet`` does not name gets no request, and a known node is reached at the config's
  URL, not its heartbeat's;
- the client's ``Authorization``, ``Proxy-Authorization`` and ``Cookie`` stay at the router; everything else of the
  request reaches the node as sent;
- the unsigned ``<p>:rollout`` plan, an unsigned canary announcement and one signed by another key move nobody;
- assignment is a keyed hash salted per rollout: sticky within one rollout, drawn afresh in the next, not predicted by
  the public hash; unit ``request`` draws each request;
- a blackholed or silent node fails over and is marked down; a stream that stalls is cut; a deeply nested body is
  just unkeyed.

The real Router app on an aiohttp server, the real Redis; the nodes are small aiohttp apps (tests/serving/routing.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
import redis.asyncio as aioredis
from multidict import CIMultiDict

from core import fleet, keys
from core.credentials import load_assignment_key
from core.fleet import Node
from deploy.registry.signing import Signer, generate_keypair
from serving.router.router import Router, rank
from tests.conftest import free_port
from tests.serving.routing import announce_rollout, beat, front_door, gateway, start, until

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=60)  # a router that hangs fails the test instead of hanging it


def _refused(router: Router) -> set[str]:
    """The reasons the router refused the canary announcement for, so far."""
    return {s.labels["reason"] for s in router.m_refused.collect()[0].samples if s.name.endswith("_total")}


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


class _Fleet:
    """Stand-in gateways on free ports, their heartbeats, a Router in front (``Router`` kwargs passed through)."""

    def __init__(self, cfg, rds, names: tuple[str, ...] = ("node-a", "node-b", "node-c")):
        self.cfg, self.rds, self.prefix = cfg, rds, cfg.topics.prefix
        self.ports = {n: free_port() for n in names}
        self.rcfg, self.signer = front_door(cfg, {n: _url(p) for n, p in self.ports.items()})
        self.seen: dict[str, list] = {n: [] for n in names}
        self.runners: list = []

    async def __aenter__(self):
        self.ardis = aioredis.from_url(self.cfg.redis.url)
        for n, p in self.ports.items():
            self.runners.append(await start(gateway(n, self.seen[n]), p))
            await beat(self.ardis, self.prefix, n, _url(p))
        return self

    async def route(self, **kw) -> Router:
        self.router = Router(self.rcfg, self.ardis, refresh_s=0.05, **kw)
        rport = free_port()
        self.runners.insert(0, await start(self.router.app, rport))
        self.base = _url(rport)
        self.http = aiohttp.ClientSession(timeout=CLIENT_TIMEOUT)
        return self.router

    async def canary_on_b_with_a_out(self, hold_s: float) -> Router:
        """A rollout on node-b with node-a out of rotation (unhealthy): the stable arm has no node. The router (its
        hold ``hold_s``) once it sees both."""
        await beat(self.ardis, self.prefix, "node-a", _url(self.ports["node-a"]), healthy=False)
        announce_rollout(self.rds, self.rcfg, self.signer, rollout_id=9, share=0.5, nodes=["node-b"])
        router = await self.route()
        router.hold_s = hold_s
        await until(lambda: router.rollout is not None and len(router.nodes) == 1, "rollout and node-b only")
        return router

    async def node_of(self, user: str | None, **kw) -> str:
        body = {"prompt": "x", **({"user": user} if user else {})}
        async with self.http.post(f"{self.base}/v1/completions", json=body, **kw) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["node"]

    async def metrics(self) -> str:
        async with self.http.get(f"{self.base}/metrics") as r:
            return await r.text()

    async def __aexit__(self, *exc) -> None:
        if getattr(self, "http", None) is not None:
            await self.http.close()
        for r in self.runners:
            await r.cleanup()
        await self.ardis.aclose()


def test_a_heartbeat_of_a_node_the_config_does_not_name_gets_no_request(cfg, rds):
    """A forged ``SET <p>:served:zz {"url": "http://evil"}`` wins none of the users (it would win about 1/(N+1))."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a", "node-b")) as f:
            evil_seen: list = []
            evil_port = free_port()
            f.runners.append(await start(gateway("evil", evil_seen), evil_port))
            await beat(f.ardis, f.prefix, "zz", _url(evil_port))  # an unknown node
            await beat(f.ardis, f.prefix, "zz-sick", _url(evil_port), healthy=False)
            # a known node's heartbeat pointing elsewhere: the config's URL is used
            await beat(f.ardis, f.prefix, "node-b", _url(evil_port))
            router = await f.route()
            answered = {await f.node_of(f"user-{i}") for i in range(100)}
            for _ in range(20):
                await f.node_of(None)  # unkeyed: a random node, still only a configured one
            assert answered == {"node-a", "node-b"}
            assert not evil_seen, f"{len(evil_seen)} requests reached a node the config does not name"
            assert len(f.seen["node-b"]) > 0
            assert {n.url for n in router.nodes} == {_url(p) for p in f.ports.values()}
            async with f.http.get(f"{f.base}/fleet") as r:
                assert {n["node"]: n["url"] for n in await r.json()} == f.rcfg.serving.fleet
            for _ in range(3):
                await router.refresh()
            text = await f.metrics()
            assert "liverl_router_unknown_heartbeats_total 2.0" in text  # zz and zz-sick, each counted once
            assert "liverl_router_unknown_nodes 2.0" in text

    asyncio.run(main())


def test_credentials_stay_at_the_router_and_everything_else_reaches_the_node(cfg, rds):
    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a",)) as f:
            await f.route()
            raw = b'{"prompt":  "x" ,\n "user":"u1", "n": 1}'
            headers = CIMultiDict(
                [
                    ("Authorization", "Bearer sk-product-secret"),
                    ("Cookie", "session=abc"),
                    ("Proxy-Authorization", "Basic cHJveHk6cHc="),
                    ("X-Trace", "1"),
                    ("X-Trace", "2"),
                    ("X-Liverl-Product-Key", "pk-123"),
                    ("Content-Type", "application/json"),
                ]
            )
            async with f.http.post(f"{f.base}/v1/completions?a=1&b=%20", data=raw, headers=headers) as r:
                assert r.status == 200, await r.text()
            path_qs, got, body = f.seen["node-a"][-1]
            assert path_qs == "/v1/completions?a=1&b=%20" and body == raw  # the same bytes
            names = [k.lower() for k, _ in got]
            assert not {"authorization", "cookie", "proxy-authorization"} & set(names), got
            assert [v for k, v in got if k.lower() == "x-trace"] == ["1", "2"]  # repeated headers kept, in order
            assert ("X-Liverl-Product-Key", "pk-123") in got and ("Content-Type", "application/json") in got

    asyncio.run(main())


def _public_bucket(key: str) -> float:
    """The bucket main's router used: a public hash of the user key alone, the same for every rollout."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, person=b"liverl-canary").digest(), "big") / 2**64


def test_with_no_stable_node_in_rotation_the_stable_arm_is_not_sent_to_the_canary(cfg, rds):
    """A 2-node fleet with a rollout on node-b, and node-a out of rotation (restarting, or its heartbeat says
    unhealthy): the canary's users still reach node-b, the stable arm's users are held and, when nothing changes
    within the hold, get 503 (counted), not the unproven candidate. With node-a back, they reach it again."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a", "node-b")) as f:
            router = await f.canary_on_b_with_a_out(hold_s=0.1)
            users = [f"user-{i}" for i in range(40)]
            arms = {u: router.arm(u) for u in users}
            assert set(arms.values()) == {True, False}
            statuses = {}
            for u in users:
                async with f.http.post(f"{f.base}/v1/completions", json={"prompt": "x", "user": u}) as r:
                    statuses[u] = (r.status, (await r.json()).get("node"))
            for u, canary in arms.items():
                assert statuses[u] == ((200, "node-b") if canary else (503, None)), (u, canary, statuses[u])
            stable_users = sum(not c for c in arms.values())
            assert router.m_no_stable._value.get() == stable_users
            await beat(f.ardis, f.prefix, "node-a", _url(f.ports["node-a"]))
            await until(lambda: len(router.nodes) == 2, "node-a back")
            assert {await f.node_of(u) for u, c in arms.items() if not c} == {"node-a"}

    asyncio.run(main())


def test_the_stable_arm_is_held_until_the_rollout_ends_then_served(cfg, rds):
    """A 2-node fleet with a rollout on node-b and node-a gone: a stable user's request waits (it is never sent to
    node-b while the canary runs), and is served by node-b once the canary announcement is withdrawn (the gate ends
    a rollout whose stable arm has no node, gate.stable_arm_grace_s)."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a", "node-b")) as f:
            router = await f.canary_on_b_with_a_out(hold_s=30.0)
            user = next(f"user-{i}" for i in range(100) if router.arm(f"user-{i}") is False)
            held = asyncio.create_task(f.node_of(user))
            await until(lambda: router.holding == 1, "the stable user's request held")
            await asyncio.sleep(0.5)  # several looks at the rotation: still held, node-b saw nothing of it
            assert not held.done() and not f.seen["node-b"]
            rds.delete(fleet.announcement_key(f.prefix, "canary"))  # the rollout ended
            assert await held == "node-b"
            assert 'liverl_router_held_total{outcome="served"} 1.0' in await f.metrics()
            assert router.m_no_stable._value.get() == 0

    asyncio.run(main())


def test_a_forged_rollout_plan_or_canary_announcement_moves_nobody(cfg, rds, tmp_path):
    """The unsigned ``<p>:rollout`` plan decides neither the share nor the canary nodes."""

    async def main() -> None:
        async with _Fleet(cfg, rds) as f:
            forged = {
                "version": 4,
                "checksum": "c" * 64,
                "stable_version": 3,
                "share": 1.0,
                "nodes": ["node-c"],
                "deadline_at": time.time() + 3600,
            }  # the plan main's router followed
            rds.set(keys.rollout(f.prefix), json.dumps(forged))
            router = await f.route()
            users = [f"user-{i}" for i in range(60)]
            nodes = [Node(n, "", 3) for n in f.ports]
            expected = {u: rank(u, nodes)[0].name for u in users}  # as if there were no rollout

            async def routed() -> dict[str, str]:
                return {u: await f.node_of(u) for u in users}

            assert await routed() == expected
            assert router.rollout is None
            # a canary announcement a Redis writer made: unsigned, then signed by a key that is not the gate's
            announce_rollout(rds, f.rcfg, None, rollout_id=5, share=0.99, nodes=["node-c"])
            await until(lambda: "unsigned" in _refused(router), "unsigned refused")
            assert router.rollout is None and await routed() == expected
            other, _ = generate_keypair(tmp_path / "other")
            announce_rollout(rds, f.rcfg, Signer(other), rollout_id=5, share=0.99, nodes=["node-c"])
            await until(lambda: "bad_signature" in _refused(router), "bad signature refused")
            assert router.rollout is None and await routed() == expected
            text = await f.metrics()
            assert 'liverl_router_arm_total{arm="none"}' in text and 'arm="canary"' not in text

    asyncio.run(main())


def test_assignment_is_keyed_and_salted_per_rollout_sticky_within_one(cfg, rds):
    """The arm of a user is ``fleet.bucket(secret, rollout_id, user) < share``: the same user stays on one arm for the
    rollout, the next rollout draws arms afresh, and a public hash of the user (``_public_bucket``) does not predict
    it. Unit ``request``: each request is drawn."""

    async def main() -> None:
        async with _Fleet(cfg, rds) as f:
            secret = load_assignment_key(f.rcfg)
            announce_rollout(rds, f.rcfg, f.signer, rollout_id=1, share=0.5, nodes=["node-c"])
            router = await f.route()
            await until(lambda: router.rollout is not None and router.rollout.rollout_id == 1)
            users = [f"user-{i}" for i in range(160)]

            async def arms(users: list[str]) -> dict[str, bool]:
                return {u: await f.node_of(u) == "node-c" for u in users}

            first = await arms(users)
            assert first == {u: fleet.bucket(secret, 1, u) < 0.5 for u in users}
            assert await arms(users[:40]) == {u: first[u] for u in users[:40]}  # sticky
            public = {u: _public_bucket(u) < 0.5 for u in users}
            agree = sum(first[u] == public[u] for u in users) / len(users)
            assert 0.3 < agree < 0.7, agree  # the public hash says nothing about the arm

            announce_rollout(rds, f.rcfg, f.signer, rollout_id=2, share=0.5, nodes=["node-c"])
            await until(lambda: router.rollout.rollout_id == 2, "rollout 2 seen")
            second = await arms(users)
            assert second == {u: fleet.bucket(secret, 2, u) < 0.5 for u in users}
            moved = sum(first[u] != second[u] for u in users) / len(users)
            assert 0.3 < moved < 0.7, moved  # independent draws: about half the users change arm

            announce_rollout(rds, f.rcfg, f.signer, rollout_id=3, share=0.5, nodes=["node-c"], unit="request")
            await until(lambda: router.rollout.rollout_id == 3, "rollout 3 seen")
            one_user = [await f.node_of("user-0") == "node-c" for _ in range(40)]
            assert 5 < sum(one_user) < 35  # drawn per request: the same user lands on both arms

    asyncio.run(main())


def _blackhole() -> tuple[socket.socket, list[socket.socket], int]:
    """A port whose listen queue is full: the kernel drops new connection attempts, as a blackholed host does."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    return srv, _cut(port, 4), port


def _silent_listener() -> tuple[socket.socket, int]:
    """node-q: takes connections into its backlog and never answers on them; (its socket, its port)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    return srv, srv.getsockname()[1]


async def _beside_node_q(f: _Fleet, port: int) -> Router:
    """A router over ``f``'s node-b and node-q on ``port`` (a blackhole waits 0.5 s to connect, 600 s to answer)."""
    f.rcfg.serving.fleet = {**f.rcfg.serving.fleet, "node-q": _url(port)}
    await beat(f.ardis, f.prefix, "node-q", _url(port))
    router = await f.route(connect_s=0.5, read_s=600.0, down_s=600)
    await until(lambda: len(router.nodes) == 2)
    return router


def _cut(port: int, n: int = 8) -> list[socket.socket]:
    """Connections that fill ``port``'s listen backlog: from then on the kernel drops new connection attempts, as
    for a host cut off."""
    fillers = []
    for _ in range(n):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(c)
    return fillers


def test_a_blackholed_or_silent_node_fails_over_and_is_marked_down(cfg, rds):
    """A connect timeout fails over (no 500 to the client; the node is marked down), and a read timeout bounds a
    node that accepts and never answers (it would hold the client for ever)."""

    async def main() -> None:
        hole, fillers, hole_port = _blackhole()

        done = asyncio.Event()

        async def silent(reader, writer) -> None:  # reads the request, never answers
            await reader.read(1 << 16)
            await done.wait()
            writer.close()

        quiet = await asyncio.start_server(silent, "127.0.0.1", 0)
        quiet_port = quiet.sockets[0].getsockname()[1]
        try:
            async with _Fleet(cfg, rds, ("node-b",)) as f:
                f.rcfg.serving.fleet = {**f.rcfg.serving.fleet, "node-a": _url(hole_port), "node-q": _url(quiet_port)}
                for n, p in (("node-a", hole_port), ("node-q", quiet_port)):
                    await beat(f.ardis, f.prefix, n, _url(p))
                router = await f.route(connect_s=0.3, read_s=1.0, down_s=600)
                await until(lambda: len(router.nodes) == 3)
                for bad in ("node-a", "node-q"):
                    user = next(
                        u
                        for u in (f"user-{i}" for i in range(1000))  # ranks bad, node-b, the other
                        if [n.name for n in rank(u, router.nodes)][:2] == [bad, "node-b"]
                    )
                    assert await f.node_of(user) == "node-b"  # the client sees an answer, not a 500
                    assert router.choose(user)[0].name == "node-b"  # marked down: no longer tried first
                text = await f.metrics()
                assert 'liverl_router_failovers_total{node="node-a"} 1.0' in text
                assert 'liverl_router_failovers_total{node="node-q"} 1.0' in text
        finally:
            done.set()
            quiet.close()
            await asyncio.sleep(0)
            for s in (hole, *fillers):
                s.close()

    asyncio.run(main())


def test_requests_waiting_on_a_node_found_blackholed_fail_over_at_once(cfg, rds):
    """A host cut off mid-connection: a request sent on a connection opened before the cut waits for an answer that
    cannot come. Once another request finds the node blackholed (its connection not accepted within connect_s), the
    waiting one fails over too, instead of holding its client for the whole read timeout (600 s here)."""

    async def main() -> None:
        srv, port = _silent_listener()
        fillers: list[socket.socket] = []
        try:
            async with _Fleet(cfg, rds, ("node-b",)) as f:
                router = await _beside_node_q(f, port)
                users = [u for u in (f"user-{i}" for i in range(1000)) if rank(u, router.nodes)[0].name == "node-q"]
                first = asyncio.create_task(f.node_of(users[0]))
                await asyncio.sleep(0.5)  # connected (the kernel's backlog took it), request sent, no answer
                assert not first.done()
                fillers += _cut(port)  # the backlog full from now on: new connections are not accepted
                assert await f.node_of(users[1]) == "node-b"  # its connect times out: node-q found blackholed
                assert await asyncio.wait_for(first, 60) == "node-b"  # the waiting one failed over with it
                assert 'liverl_router_failovers_total{node="node-q"} 2.0' in await f.metrics()
        finally:
            for c in (srv, *fillers):
                c.close()

    asyncio.run(main())


def test_a_request_alone_on_a_node_cut_off_is_released_by_the_probe_its_wait_starts(cfg, rds):
    """Every request reuses a keep-alive connection opened before the cut, so none meets the cut on a connection of
    its own: the probe a long wait starts (a fresh connection, not accepted) finds the node blackholed, and the request
    fails over well before the read timeout (600 s here)."""

    async def main() -> None:
        srv, port = _silent_listener()
        fillers: list[socket.socket] = []
        try:
            async with _Fleet(cfg, rds, ("node-b",)) as f:
                router = await _beside_node_q(f, port)
                router.blackholes.probe_after_s = 0.5
                user = next(u for u in (f"user-{i}" for i in range(1000)) if rank(u, router.nodes)[0].name == "node-q")
                first = asyncio.create_task(f.node_of(user))
                await asyncio.sleep(0.2)  # connected (the kernel's backlog took it), request sent, no answer
                assert not first.done()
                fillers += _cut(port)  # the backlog full from now on: new connections are not accepted
                assert await asyncio.wait_for(first, 60) == "node-b"
                assert router.blackholes.probes >= 1
                assert 'liverl_router_failovers_total{node="node-q"} 1.0' in await f.metrics()
        finally:
            for c in (srv, *fillers):
                c.close()

    asyncio.run(main())


def test_a_long_generation_on_a_node_that_answers_the_probe_is_not_released(cfg, rds):
    """A node that takes long to send its response head (a non-streamed generation) but accepts the probe's
    connection is there: its request waits for it, probed again and again, and is not failed over."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a", "node-b")) as f:
            router = await f.route(connect_s=0.5, read_s=600.0)
            router.blackholes.probe_after_s = 0.1
            await until(lambda: len(router.nodes) == 2)
            user = next(u for u in (f"user-{i}" for i in range(1000)) if rank(u, router.nodes)[0].name == "node-a")
            body = {"prompt": "x", "user": user, "think_s": 1.5}
            async with f.http.post(f"{f.base}/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.json())["node"] == "node-a"
            assert router.blackholes.probes >= 2
            assert "liverl_router_failovers_total{" not in await f.metrics()

    asyncio.run(main())


def test_a_node_without_a_route_counts_as_blackholed_and_a_refusing_one_does_not():
    """A host cut off answers a new connection with no route (EHOSTUNREACH, once its neighbour entry fails) or not at
    all: either releases the requests waiting on it. A refused connection (the process stopped, or is stopping and
    finishing what it holds) does not."""
    import errno

    from serving.router.router import unreachable

    key = aiohttp.client_reqrep.ConnectionKey("10.0.0.5", 8000, False, True, None, None, None)

    def failed(code: int) -> aiohttp.ClientConnectorError:
        return aiohttp.ClientConnectorError(key, OSError(code, "x"))

    assert unreachable(aiohttp.ConnectionTimeoutError())
    assert unreachable(failed(errno.EHOSTUNREACH)) and unreachable(failed(errno.ENETUNREACH))
    assert not unreachable(failed(errno.ECONNREFUSED))
    assert not unreachable(aiohttp.ServerDisconnectedError())


def test_a_stream_that_stalls_is_cut_not_ended_as_if_complete(cfg, rds):
    """The read timeout bounds the wait between a stream's chunks too. The head has reached the client, so there is no
    failover: the client sees a broken stream (never a clean end it would take for the whole answer)."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a",)) as f:
            await f.route(read_s=0.5)
            body = {"prompt": "x", "user": "u1", "stream": True, "stall_s": 3}
            async with f.http.post(f"{f.base}/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["X-Liverl-Node"] == "node-a"
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
            assert 'liverl_router_upstream_errors_total{node="node-a"} 1.0' in await f.metrics()

    asyncio.run(main())


def test_a_deeply_nested_body_is_routed_unkeyed(cfg, rds):
    """``json.loads`` of a deeply nested body raises RecursionError; the router routes the request
    unkeyed, not a 500."""

    async def main() -> None:
        async with _Fleet(cfg, rds, ("node-a",)) as f:
            await f.route()
            raw = b'{"user": "u", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            async with f.http.post(f"{f.base}/v1/completions", data=raw) as r:
                assert r.status == 200 and r.headers["X-Liverl-Node"] == "node-a"
            assert "liverl_router_unkeyed_total 1.0" in await f.metrics()

    asyncio.run(main())


def test_the_router_refuses_to_start_without_a_fleet_an_assignment_key_or_a_verify_key(cfg, tmp_path):
    with pytest.raises(ValueError, match="serving.fleet"):
        Router(cfg, None)
    known = cfg.model_copy(deep=True)
    known.serving.fleet = {"node-0": "http://127.0.0.1:1"}
    with pytest.raises(ValueError, match="security.assignment_key"):
        Router(known, None)
    (tmp_path / "a.key").write_text("s" * 32)
    known.security.assignment_key = str(tmp_path / "a.key")
    with pytest.raises(ValueError, match="security.verify_key"):
        Router(known, None)
    known.security.allow_unsigned = True  # UNSAFE, and said so: then it starts
    assert Router(known, None).verifier is None
    (tmp_path / "a.key").write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        Router(known, None)
