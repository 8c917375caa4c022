"""The fleet's front door: ``liverl route`` spreads the product's requests over the serving nodes, sticky per user.

Each serving process (``liverl serve``: gateway + agent + vLLM node) announces itself in its heartbeat
(``<prefix>:served:<node>``, ``liverl.core.keys``), with the URL of its gateway (``serving.advertise_url``) and
whether it is healthy. The router reads the heartbeats every ``refresh_s`` and routes each request:

- **Sticky per user.** The key is the request's ``X-Liverl-User`` header, else the OpenAI ``user`` field of the
  body, else ``X-Session-Id``; the node is chosen by rendezvous (highest-random-weight) hashing of that key over
  the routable nodes, so a user keeps their node while it serves, and a node joining or leaving moves only the
  users it gains or loses. A request with no key goes to a random node (counted: ``liverl_router_unkeyed``).
- **Only nodes that may serve.** A node whose heartbeat expired (it stopped), that reports itself unhealthy (a
  failed weight check takes it out of service) or has no URL is out of rotation. A node that refuses connections
  is skipped for ``down_s`` and the request goes to the user's next node: nothing has reached the client yet, so
  the retry is invisible to it.
- **The canary's share.** During a rollout (``<p>:rollout``, written by the gate; ``deploy.canary``) a user whose
  fixed bucket (``keys.user_bucket``) is below the rollout's share goes to the canary nodes, everyone else to the
  other nodes; the same user always sees the same version. If one side has no node in rotation, the other serves.
- **Unchanged bytes.** The body, the status, the headers (``X-Liverl-Generation-Id``, ``X-Liverl-Version``) and a
  stream's chunks pass through as the node's gateway sent them; the router adds ``X-Liverl-Node``.

Several routers can run side by side (they share nothing but Redis) behind any TCP load balancer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from liverl.core import keys
from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.serving.router")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "content-length", "host"}
MAX_BODY = 8 << 20


@dataclass(frozen=True)
class Node:
    name: str
    url: str
    version: int | None
    healthy: bool


def user_key(headers, body: bytes) -> str | None:
    """The stickiness key of a request: X-Liverl-User, else the body's OpenAI ``user``, else X-Session-Id."""
    if v := headers.get("X-Liverl-User"):
        return v
    if body[:1] == b"{" and b'"user"' in body:
        try:
            u = json.loads(body).get("user")
        except (ValueError, AttributeError):
            u = None
        if isinstance(u, str) and u:
            return u
    return headers.get("X-Session-Id") or None


def rank(key: str, nodes: list[Node]) -> list[Node]:
    """Nodes in the order ``key`` prefers them (rendezvous hashing): the first is its node, the rest the fallbacks."""
    def weight(n: Node) -> bytes:
        return hashlib.blake2b(f"{n.name}\0{key}".encode(), digest_size=8).digest()

    return sorted(nodes, key=weight, reverse=True)


def routable(beats: dict[str, keys.ServedHeartbeat]) -> list[Node]:
    return [Node(name, b.url, b.version, b.healthy) for name, b in sorted(beats.items()) if b.url and b.healthy]


class Router:
    def __init__(self, cfg: LiverlConfig, redis, refresh_s: float = 1.0, down_s: float = 5.0):
        self.cfg, self.redis, self.prefix = cfg, redis, cfg.topics.prefix
        self.refresh_s, self.down_s = refresh_s, down_s
        self.nodes: list[Node] = []
        self.plan: keys.RolloutPlan | None = None
        self._down: dict[str, float] = {}  # node -> until when it is skipped (refused a connection)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        r = self.metrics = CollectorRegistry()
        self.m_requests = Counter("liverl_router_requests", "Requests routed, by node and HTTP status",
                                  ["node", "status"], registry=r)
        self.m_arm = Counter("liverl_router_arm", "Requests by rollout arm (canary, stable; none: no rollout)",
                             ["arm"], registry=r)
        self.m_failover = Counter("liverl_router_failovers", "Requests re-routed because their node refused the "
                                  "connection", ["node"], registry=r)
        self.m_unkeyed = Counter("liverl_router_unkeyed", "Requests with no user or session key (routed at random)",
                                 registry=r)
        self.m_nodes = Gauge("liverl_router_nodes", "Nodes in rotation", registry=r)
        self.m_refresh_errors = Counter("liverl_router_refresh_errors", "Failed reads of the nodes' heartbeats",
                                        registry=r)
        self.app = web.Application(client_max_size=MAX_BODY)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/metrics", self.metrics_route)
        self.app.router.add_get("/fleet", self.fleet)
        self.app.router.add_route("*", "/v1/{tail:.*}", self.proxy)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # ------------------------------------------------------------------------------------------ membership

    async def refresh(self) -> None:
        beats = {}
        async for k in self.redis.scan_iter(match=keys.served_pattern(self.prefix), count=500):
            raw = await self.redis.get(k)
            if raw is None:
                continue
            try:
                beats[keys.node_of_served(self.prefix, k)] = keys.ServedHeartbeat.from_json(raw)
            except ValueError as e:
                log.warning("router: unreadable heartbeat %s: %s", k, e)
        nodes = routable(beats)
        raw = await self.redis.get(keys.rollout(self.prefix))
        try:
            self.plan = keys.RolloutPlan.from_json(raw) if raw is not None else None
        except ValueError as e:
            log.warning("router: unreadable rollout plan (%s); routing as if there were none", e)
            self.plan = None
        if [n.name for n in nodes] != [n.name for n in self.nodes]:
            log.info("router: nodes in rotation: %s", ", ".join(f"{n.name} (v{n.version})" for n in nodes) or "none")
        self.nodes = nodes
        self.m_nodes.set(len(nodes))

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep routing on the last known nodes
                self.m_refresh_errors.inc()
                log.warning("router: cannot read the heartbeats (%s); routing on the last known nodes", e)
            await asyncio.sleep(self.refresh_s)

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                              auto_decompress=False)
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def _stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def choose(self, key: str | None) -> list[Node]:
        """The nodes to try for ``key``, in order: its rendezvous ranking, nodes that just refused us last."""
        now = time.monotonic()
        pool, plan = self.nodes, self.plan
        if plan is not None:
            canary = (keys.user_bucket(key) if key is not None else random.random()) < plan.share
            side = [n for n in self.nodes if (n.name in plan.nodes) == canary]
            pool = side or self.nodes
            self.m_arm.labels("canary" if canary and side else "stable").inc()
        else:
            self.m_arm.labels("none").inc()
        nodes = rank(key, pool) if key is not None else random.sample(pool, len(pool))
        return [n for n in nodes if self._down.get(n.name, 0) <= now] + \
               [n for n in nodes if self._down.get(n.name, 0) > now]

    # ------------------------------------------------------------------------------------------ routes

    async def healthz(self, _request: web.Request) -> web.Response:
        if not self.nodes:
            return web.Response(status=503, text="no serving node in rotation")
        return web.Response(text=f"ok: {len(self.nodes)} nodes")

    async def metrics_route(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics), content_type="text/plain")

    async def fleet(self, _request: web.Request) -> web.Response:
        return web.json_response([{"node": n.name, "url": n.url, "version": n.version} for n in self.nodes])

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = user_key(request.headers, body)
        if key is None:
            self.m_unkeyed.inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        for node in self.choose(key):
            try:
                upstream = await self._session.request(request.method, node.url + request.path_qs, data=body,
                                                       headers=headers, allow_redirects=False)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:
                # refused, reset or closed before any byte came back (a pooled keep-alive connection to a node
                # that just stopped fails this way too): nothing has reached the client, so the next node answers
                self._down[node.name] = time.monotonic() + self.down_s
                self.m_failover.labels(node.name).inc()
                log.warning("router: %s refused the connection (%s); trying the next node", node.name, e)
                continue
            try:
                return await self._relay(request, upstream, node)
            finally:
                upstream.release()
        self.m_requests.labels("none", "503").inc()
        return web.json_response({"error": {"message": "no serving node is available", "type": "unavailable"}},
                                 status=503)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, node: Node) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in HOP_BY_HOP:
                resp.headers.add(k, v)
        resp.headers["X-Liverl-Node"] = node.name
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        self.m_requests.labels(node.name, str(upstream.status)).inc()
        return resp


def run_router(cfg: LiverlConfig, redis_url: str, host: str, port: int) -> None:
    """Blocking entry point (``liverl route``)."""
    from liverl.core.services import redis_from_url

    async def main() -> None:
        rds = redis_from_url(redis_url, asyncio=True)
        router = Router(cfg, rds)
        runner = web.AppRunner(router.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        log.info("router on http://%s:%d: %d nodes in rotation", host, port, len(router.nodes))
        print(f"router on http://{host}:{port} ({len(router.nodes)} nodes in rotation; GET /fleet lists them)",
              flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            await rds.aclose()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
