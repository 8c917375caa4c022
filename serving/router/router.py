"""The fleet's front door: ``liverl route`` spreads the product's requests over the serving nodes, sticky per user.

The router sends requests only to the nodes the config names (``serving.fleet``: node name -> gateway URL; ``liverl
up`` and ``liverl demo`` fill it). Each serving process (``liverl serve``: gateway + agent + vLLM node) writes a
heartbeat (``<prefix>:served:<node>``, ``core.keys``) saying whether it is healthy and what it serves; the
router reads them every ``refresh_s`` (``core.fleet``: the same rule the gate's canary and ``liverl status``
use) and routes each request:

- **Only nodes the config knows.** A heartbeat of a node ``serving.fleet`` does not name moves nothing (it is logged
  once and counted, ``liverl_router_unknown_heartbeats``), and a node's URL is the config's, never its heartbeat's.
  Redis is a signal here (is the node up, healthy), not an authority on where users go.
- **Sticky per user.** The key is the request's ``X-Liverl-User`` header, else the OpenAI ``user`` field of the
  body, else ``X-Session-Id`` (``fleet.user_key``); the node is chosen by rendezvous (highest-random-weight) hashing
  of that key over the routable nodes, so a user keeps their node while it serves, and a node joining or leaving
  moves only the users it gains or loses. A request with no key goes to a random node (``liverl_router_unkeyed``).
- **Only nodes that may serve.** A node whose heartbeat expired (it stopped) or that reports itself unhealthy (a
  failed weight check takes it out of service) is out of rotation. A node that refuses the connection, resets it,
  does not accept it within ``connect_s`` (blackholed) or sends no response head within
  ``serving.router_read_timeout_s`` is skipped for ``down_s`` and the request goes to the user's next node: nothing
  has reached the client yet, so the retry is invisible to it. A node found blackholed also releases the requests
  waiting for its answer on connections opened before (a host cut off mid-request): they fail over at once, not
  after the read timeout. A request that waits for its response head longer than ``PROBE_AFTER_S`` has its node
  probed on a fresh connection (``serving.router.blackholes``), so a cut is found even when every request reuses a
  keep-alive connection. The same read timeout bounds the wait for each next chunk of a stream; a stream that
  stalls that long is cut (counted, ``liverl_router_upstream_errors``).
- **The canary's share.** During a rollout the router reads the canary announcement (``<p>:canary``), signed by the
  gate and verified here (``security.verify_key``), for the rollout's terms: its id, share, canary nodes and unit.
  With unit ``user``, a user goes to the canary nodes when their bucket, a keyed hash of the rollout id and the user
  key (``fleet.bucket``, with the secret ``security.assignment_key`` that only routers hold), is below the share: the
  same user stays on one arm for the whole rollout, each rollout draws its arms afresh, and no caller can predict or
  pick an arm. With unit ``request`` each request is drawn afresh. The unsigned ``<p>:rollout`` plan is never read.
  With no canary node in rotation, the canary's users are served by stable nodes; with no stable node in rotation,
  the stable arm's users are held (below), never sent to the unproven candidate: a stable node restarting in a
  2-node fleet must not hand every user to the canary. The gate ends such a rollout (``gate.stable_arm_grace_s``), so
  the canary's nodes go back to stable and the held requests are served.
- **Held, not refused.** A request that no node may serve right now (none in rotation for its arm, or every one of
  them failed it before answering) waits up to ``serving.router_hold_s`` and is tried again as the rotation changes
  (``liverl_router_held``); only then is it answered 503 (``liverl_router_stable_arm_unavailable`` counts those of a
  stable arm with no node). At most ``serving.router_hold_max`` wait at once. A fault the fleet heals in seconds (a
  node restarting, the heartbeats rewritten after a Redis outage, a canary ended) costs its users a wait, not an
  error.
- **Credentials stay here.** ``Authorization``, ``Proxy-Authorization`` and ``Cookie`` are not forwarded to nodes (a
  product's API key for the front door is not the nodes' business). Feedback's product key travels in its own header
  (``X-Liverl-Product-Key``), which is forwarded: the node's gateway checks it.
- **Unchanged bytes.** Everything else of the request (method, path, query, body, headers) reaches the node as the
  client sent it; the body, the status, the headers (``X-Liverl-Generation-Id``, ``X-Liverl-Version``) and a
  stream's chunks pass back as the node's gateway sent them; the router adds ``X-Liverl-Node``.

- **Probes and a graceful stop.** ``GET /livez``: 200 whenever the router's event loop answers. ``GET /readyz``: 200
  while a node is in rotation, or was within ``serving.router_hold_s`` (its requests are held: after a Redis outage
  every heartbeat has expired until the nodes write again, and a balancer taking every router out for those seconds
  would refuse what the routers can hold), and the router is not stopping. A rollout's stable arm with no node keeps
  it ready (``stable_nodes`` 0 in the body): every router sees the same fleet, so a balancer taking them all out
  would refuse every request at once, the canary's users too, where a router holds the stable arm's until the gate
  ends the rollout. A node that answers 503 with
  ``X-Liverl-Draining`` (it is stopping and did nothing with the request) is skipped like one that refused the
  connection. On SIGTERM the router's ``/readyz`` goes 503 at once, it keeps routing for ``unready_s`` (so a balancer's
  health checks take it out first), then stops listening, lets the requests in flight finish (at most
  ``serving.drain_timeout_s``) and exits 0.

Several routers can run side by side (they share Redis, the config and the assignment key) behind any TCP load
balancer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import signal
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from core import fleet
from core.config import LiverlConfig
from core.credentials import load_assignment_key
from core.fleet import Node
from core.probes import DRAINING_HEADER
from core.schemas import RolloutTerms
from core.services import redis_from_url, verify_key_path
from deploy.registry.signing import Verifier
from serving.router.blackholes import Blackholes, unreachable

log = logging.getLogger("liverl.serving.router")

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "cookie"}  # request headers a node never sees
MAX_BODY = 8 << 20
HOLD_POLL_S = 0.25  # how often a held request looks at the rotation again
NO_NODE = {"error": {"message": "no serving node is available", "type": "unavailable"}}
MAX_REMEMBERED = 10_000  # unknown heartbeat names remembered (each logged once)


# Failures before any byte of the node's response: refused, reset, closed, not accepted within connect_s
# (ConnectionTimeoutError) or no response head within the read timeout (SocketTimeoutError). Nothing has reached the
# client, so the next node can answer.
FAILOVER = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ServerTimeoutError)


def rank(key: str, nodes: list[Node]) -> list[Node]:
    """Nodes in the order ``key`` prefers them (rendezvous hashing): the first is its node, the rest the fallbacks."""

    def weight(n: Node) -> bytes:
        return hashlib.blake2b(f"{n.name}\0{key}".encode(), digest_size=8).digest()

    return sorted(nodes, key=weight, reverse=True)


class Router:
    """The aiohttp app of ``liverl route``. ``assignment_key`` and ``verifier`` default to the config's
    (``security.assignment_key``, ``security.verify_key``); ``connect_s`` and ``read_s`` bound the wait for a node's
    connection and for its next bytes (``read_s`` default: ``serving.router_read_timeout_s``)."""

    def __init__(
        self,
        cfg: LiverlConfig,
        redis,
        refresh_s: float = 1.0,
        down_s: float = 5.0,
        connect_s: float = 5.0,
        read_s: float | None = None,
        assignment_key: bytes | None = None,
        verifier=None,
    ):
        if not cfg.serving.fleet:
            raise ValueError(
                "the router routes only to the nodes the config names: set serving.fleet to each node's "
                'name and gateway URL (for example serving.fleet = {"node-0" = '
                '"http://10.0.0.5:8000"}; `liverl up` fills it for the nodes it starts)'
            )
        self.cfg, self.redis, self.prefix = cfg, redis, cfg.topics.prefix
        self.allowed: dict[str, str] = dict(cfg.serving.fleet)
        self.secret = assignment_key if assignment_key is not None else load_assignment_key(cfg)
        self.verifier = verifier if verifier is not None else _verifier(cfg)
        self.refresh_s, self.down_s = refresh_s, down_s
        self.hold_s, self.hold_max = cfg.serving.router_hold_s, cfg.serving.router_hold_max
        self.holding = 0  # requests held now (waiting for a node that may serve them)
        self.connect_s, self.read_s = connect_s, cfg.serving.router_read_timeout_s if read_s is None else read_s
        self.nodes: list[Node] = []
        self.rollout: RolloutTerms | None = None  # the verified canary announcement's terms (None: no rollout)
        self.announcements = fleet.AnnouncementReader(self.prefix, self.verifier)  # refuses replays too
        self._last_refused: str | None = None
        self._down: dict[str, float] = {}  # node -> until when it is skipped (refused a connection)
        self.blackholes = Blackholes(connect_s)
        self._served_at: float | None = None  # when a node was last in rotation (monotonic)
        self._said: set[tuple[str, str]] = set()  # (what, name) logged once: unknown heartbeats, URL mismatches
        self._draw = random.SystemRandom()  # per-request draws no caller can predict from the arms it sees
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.draining = False  # stopping: /readyz answers 503, requests in flight finish
        r = self.metrics = CollectorRegistry()
        self.m_requests = Counter(
            "liverl_router_requests", "Requests routed, by node and HTTP status", ["node", "status"], registry=r
        )
        self.m_arm = Counter(
            "liverl_router_arm", "Requests by rollout arm (canary, stable; none: no rollout)", ["arm"], registry=r
        )
        self.m_no_stable = Counter(
            "liverl_router_stable_arm_unavailable",
            "Requests of a rollout's stable arm answered 503 because no stable node came into rotation within "
            "serving.router_hold_s (never sent to the canary nodes)",
            registry=r,
        )
        self.m_held = Counter(
            "liverl_router_held",
            "Requests held because no node could serve them at once (none in rotation for their arm, or all failed "
            "them), by how the hold ended: served, or 503 after serving.router_hold_s (full: over "
            "serving.router_hold_max, not held)",
            ["outcome"],
            registry=r,
        )
        self.m_holding = Gauge("liverl_router_holding", "Requests held now", registry=r)
        self.m_failover = Counter(
            "liverl_router_failovers",
            "Requests re-routed because their node refused, reset or "
            "blackholed the connection, or sent no response head in time",
            ["node"],
            registry=r,
        )
        self.m_upstream_errors = Counter(
            "liverl_router_upstream_errors",
            "Responses cut because their node failed after the response had started (the client sees a broken stream)",
            ["node"],
            registry=r,
        )
        self.m_unkeyed = Counter(
            "liverl_router_unkeyed", "Requests with no user or session key (routed at random)", registry=r
        )
        self.m_nodes = Gauge("liverl_router_nodes", "Nodes in rotation", registry=r)
        self.m_unknown = Counter(
            "liverl_router_unknown_heartbeats",
            "Distinct node names seen in heartbeats that serving.fleet does not name (ignored; each logged once)",
            registry=r,
        )
        self.m_unknown_now = Gauge(
            "liverl_router_unknown_nodes",
            "Heartbeats of nodes serving.fleet does not name, at the last refresh",
            registry=r,
        )
        self.m_unreadable = Counter(
            "liverl_router_unreadable_heartbeats",
            "Heartbeat keys read that hold no heartbeat (another Redis type, or no valid record): skipped, logged",
            registry=r,
        )
        self.m_refresh_errors = Counter(
            "liverl_router_refresh_errors", "Failed reads of the nodes' heartbeats", registry=r
        )
        self.m_refused = Counter(
            "liverl_router_refused_announcements",
            "Reads of the canary announcement refused (routed as if there were no rollout), by reason",
            ["reason"],
            registry=r,
        )
        self.app = web.Application(client_max_size=MAX_BODY)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/livez", self.livez)
        self.app.router.add_get("/readyz", self.readyz)
        self.app.router.add_get("/metrics", self.metrics_route)
        self.app.router.add_get("/fleet", self.fleet)
        self.app.router.add_route("*", "/v1/{tail:.*}", self.proxy)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # ------------------------------------------------------------------------------------------ membership

    def _once(self, what: str, name: str) -> bool:
        """True the first time (``what``, ``name``) is seen (bounded memory: forged names cannot grow it forever)."""
        if (what, name) in self._said or len(self._said) >= MAX_REMEMBERED:
            return False
        self._said.add((what, name))
        return True

    async def refresh(self) -> None:
        unreadable: list[str] = []
        beats = await fleet.read_heartbeats_async(self.redis, self.prefix, unreadable)
        self.m_unreadable.inc(len(unreadable))
        strangers = fleet.unknown(beats, self.allowed)
        for name in strangers:
            if self._once("unknown", name):
                self.m_unknown.inc()
                log.warning(
                    "router: ignoring the heartbeat of node %r (url %r): serving.fleet does not name it",
                    name[:200],
                    (beats[name].url or "")[:200],
                )
        self.m_unknown_now.set(len(strangers))
        nodes = fleet.routable(beats, self.allowed)
        for n in nodes:
            url = (beats[n.name].url or "").rstrip("/")
            if url and url != n.url and self._once(f"url {url[:200]}", n.name):
                log.warning(
                    "router: %s's heartbeat advertises %s; routing to serving.fleet's %s", n.name, url[:200], n.url
                )
        self.rollout = await self._read_rollout()
        if [n.name for n in nodes] != [n.name for n in self.nodes]:
            log.info("router: nodes in rotation: %s", ", ".join(f"{n.name} (v{n.version})" for n in nodes) or "none")
        self.nodes = nodes
        if nodes:
            self._served_at = time.monotonic()
        self.m_nodes.set(len(nodes))

    async def _read_rollout(self) -> RolloutTerms | None:
        """The rollout's terms from the canary announcement, when it verifies (signed by the gate, for this channel
        and deployment, not expired, not older than one accepted before); else None: no rollout, everyone on stable."""
        try:
            ann = await self.announcements.read(self.redis, "canary")
        except fleet.AnnouncementRefused as e:
            self.m_refused.labels(e.reason).inc()
            if self._last_refused != e.reason:  # said once per run of refusals, not every refresh
                self._last_refused = e.reason
                log.error(
                    "router: refusing %s (%s); routing as if there were no rollout",
                    fleet.announcement_key(self.prefix, "canary"),
                    e,
                )
            return None
        self._last_refused = None
        return ann.rollout if ann is not None else None

    async def _refresh_loop(self) -> None:
        while not self._closing:  # not only the cancel: a library that turns it into an error would loop on for ever
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep routing on the last known nodes
                self.m_refresh_errors.inc()
                log.warning("router: cannot read the heartbeats (%s); routing on the last known nodes", e)
            await asyncio.sleep(self.refresh_s)

    async def _start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s, sock_read=self.read_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self.blackholes.start()
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def _stop(self, _app: web.Application) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.blackholes.close()
        if self._session is not None:
            await self._session.close()

    def arm(self, key: str | None) -> bool | None:
        """Whether a request with user key ``key`` goes to the canary (None: no rollout). Unit ``user``: the user's
        keyed bucket in this rollout (sticky); unit ``request``, or no key: a fresh draw."""
        terms = self.rollout
        if terms is None:
            return None
        if terms.unit == "user" and key is not None:
            return fleet.bucket(self.secret, terms.rollout_id, key) < terms.share
        return self._draw.random() < terms.share

    def choose(self, key: str | None, canary: bool | None = None, count: bool = True) -> list[Node]:
        """The nodes to try for ``key``, in order: its rendezvous ranking, nodes that just refused us last. Empty when
        none may serve it (the proxy holds the request). ``canary``: the request's arm when it was drawn already (a
        held request keeps its draw), else drawn here (``arm``). ``count``: add it to the arms' counters (a held
        request's later tries are not counted again)."""
        now = time.monotonic()
        pool = self.nodes
        if canary is None:
            canary = self.arm(key)
        if canary is None or self.rollout is None:  # no rollout (or it ended while the request was held)
            arm = "none"
        else:
            names = set(self.rollout.nodes)
            side = [n for n in self.nodes if (n.name in names) == canary]
            if side:
                pool = side
            elif canary:  # no canary node in rotation: its users get stable, which is proven
                pool = [n for n in self.nodes if n.name not in names]
            else:  # no stable node in rotation: never the candidate for the stable arm's users
                pool = []
            arm = "canary" if canary and side else "stable"
        if count:
            self.m_arm.labels(arm).inc()
        nodes = rank(key, pool) if key is not None else random.sample(pool, len(pool))
        return [n for n in nodes if self._down.get(n.name, 0) <= now] + [
            n for n in nodes if self._down.get(n.name, 0) > now
        ]

    # ------------------------------------------------------------------------------------------ routes

    async def healthz(self, _request: web.Request) -> web.Response:
        if not self.nodes:
            return web.Response(status=503, text="no serving node in rotation")
        return web.Response(text=f"ok: {len(self.nodes)} nodes")

    def stable_nodes(self) -> list[Node]:
        """The nodes in rotation that may serve the stable arm: all of them with no rollout, else those the canary
        does not name."""
        canary = set(self.rollout.nodes) if self.rollout is not None else set()
        return [n for n in self.nodes if n.name not in canary]

    async def livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, _request: web.Request) -> web.Response:
        stable = self.stable_nodes()
        reason = None
        if self.draining:
            reason = "draining: the router is stopping"
        elif not self.nodes and (self._served_at is None or time.monotonic() - self._served_at > self.hold_s):
            reason = "no serving node in rotation"
        body = {"ready": reason is None, "reason": reason, "nodes": len(self.nodes), "stable_nodes": len(stable)}
        if reason is None and not stable:  # ready: every router sees the same fleet, and this one holds what it can't
            body["note"] = (
                "no node in rotation for moments: requests are held (serving.router_hold_s)"
                if not self.nodes
                else "no node of the stable arm in rotation: its requests are held until the rollout ends"
            )
        return web.json_response(body, status=200 if reason is None else 503)

    async def metrics_route(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics), content_type="text/plain")

    async def fleet(self, _request: web.Request) -> web.Response:
        return web.json_response([{"node": n.name, "url": n.url, "version": n.version} for n in self.nodes])

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = fleet.user_key(request.headers, body)
        if key is None:
            self.m_unkeyed.inc()
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED)
        canary = self.arm(key)
        nodes = self.choose(key, canary)
        resp = await self._try(request, nodes, body, headers)
        if resp is not None:
            return resp
        if self.hold_s <= 0 or self.holding >= self.hold_max:
            if self.hold_s > 0:
                self.m_held.labels("full").inc()
            return self._unavailable(canary)
        self.holding += 1
        self.m_holding.set(self.holding)
        deadline = time.monotonic() + self.hold_s
        try:
            while (left := deadline - time.monotonic()) > 0 and not self._closing:
                await asyncio.sleep(min(left, HOLD_POLL_S))
                now = time.monotonic()
                # nodes that just failed this request wait out their down_s; a blackholed node is not paid for again
                nodes = [n for n in self.choose(key, canary, count=False) if self._down.get(n.name, 0) <= now]
                resp = await self._try(request, nodes, body, headers)
                if resp is not None:
                    self.m_held.labels("served").inc()
                    return resp
        finally:
            self.holding -= 1
            self.m_holding.set(self.holding)
        self.m_held.labels("503").inc()
        return self._unavailable(canary)

    def _unavailable(self, canary: bool | None) -> web.Response:
        if canary is False and not self.stable_nodes():
            self.m_no_stable.inc()
        self.m_requests.labels("none", "503").inc()
        return web.json_response(NO_NODE, status=503)

    async def _try(
        self, request: web.Request, nodes: list[Node], body: bytes, headers: CIMultiDict
    ) -> web.StreamResponse | None:
        """Send the request to ``nodes`` in turn; the response of the first that answers (relayed), else None (none
        did, and nothing has reached the client)."""
        for node in nodes:
            try:
                upstream = await self.blackholes.send(
                    node.name,
                    self._session.request(
                        request.method, node.url + request.path_qs, data=body, headers=headers, allow_redirects=False
                    ),
                    probe_url=node.url + "/livez",
                )
            except FAILOVER as e:
                # refused, reset, closed or silent before any byte came back (a pooled keep-alive connection to a
                # node that just stopped fails this way too): nothing has reached the client, the next node answers
                self._down[node.name] = time.monotonic() + self.down_s
                if unreachable(e):  # blackholed: what waits on it waits in vain
                    self.blackholes.found(node.name)
                self.m_failover.labels(node.name).inc()
                log.warning(
                    "router: %s failed before answering (%s: %s); trying the next node", node.name, type(e).__name__, e
                )
                continue
            if upstream.status == 503 and upstream.headers.get(DRAINING_HEADER):
                # the node is stopping and did nothing with the request: it leaves the rotation at the next refresh
                upstream.release()
                self._down[node.name] = time.monotonic() + self.down_s
                self.m_failover.labels(node.name).inc()
                log.info("router: %s is draining; trying the next node", node.name)
                continue
            try:
                return await relay(self, request, upstream, node)
            finally:
                upstream.release()
        return None


async def relay(
    router: Router, request: web.Request, upstream: aiohttp.ClientResponse, node: Node
) -> web.StreamResponse:
    """Pass ``node``'s response back to the client: its status, headers (``X-Liverl-Node`` added) and bytes."""
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for k, v in upstream.headers.items():
        if k.lower() not in HOP_BY_HOP:
            resp.headers.add(k, v)
    resp.headers["X-Liverl-Node"] = node.name
    await resp.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
        # the node failed mid-response: the client has the head already, so it gets a broken stream (raising
        # makes aiohttp drop the connection instead of ending the response as if it were complete)
        if not isinstance(e, ConnectionResetError):  # not the client leaving
            router._down[node.name] = time.monotonic() + router.down_s
            router.m_upstream_errors.labels(node.name).inc()
            log.warning("router: %s failed mid-response (%s: %s)", node.name, type(e).__name__, e)
        raise
    await resp.write_eof()
    router.m_requests.labels(node.name, str(upstream.status)).inc()
    return resp


def _verifier(cfg: LiverlConfig):
    """The announcement verifier of ``security.verify_key``. Without a key: None (unsigned canary announcements are
    followed) with ``security.allow_unsigned``, else ValueError."""
    path = verify_key_path(cfg)
    if path is not None:
        return Verifier(path)
    if cfg.security.allow_unsigned:
        log.warning(
            "UNSIGNED ANNOUNCEMENTS: the router follows any canary announcement written to Redis "
            "(security.allow_unsigned = true)"
        )
        return None
    raise ValueError(
        "the router takes a rollout's terms only from a signed canary announcement and has no key to "
        "verify one: set security.verify_key (or put it at "
        f"{cfg.state_path / 'keys' / 'announce.pub'}; `liverl up` makes a pair there), or, UNSAFE and "
        "only where every Redis writer is trusted, set security.allow_unsigned = true"
    )


UNREADY_S = 5.0
"""How long a stopping router keeps routing with its ``/readyz`` at 503 before it stops listening: longer than a
balancer's health checks take to drop it (HAProxy as ``packaging/haproxy`` configures it: 1-2 s; as the compose file's
does: 2-4 s)."""


def run_router(cfg: LiverlConfig, redis_url: str, host: str, port: int, unready_s: float = UNREADY_S) -> None:
    """Blocking entry point (``liverl route``): route until SIGTERM or SIGINT, then stop gracefully (``/readyz`` 503
    for ``unready_s``, then no new connections, the requests in flight finished) and return."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        rds = redis_from_url(redis_url, asyncio=True)
        try:
            router = Router(cfg, rds)  # refuses to start without serving.fleet or the assignment key
            runner = web.AppRunner(router.app, access_log=None, shutdown_timeout=cfg.serving.drain_timeout_s)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port).start()
                log.info(
                    "router on http://%s:%d: %d of the %d configured nodes in rotation",
                    host,
                    port,
                    len(router.nodes),
                    len(router.allowed),
                )
                print(
                    f"router on http://{host}:{port} ({len(router.nodes)} of the {len(router.allowed)} configured "
                    "nodes in rotation; GET /fleet lists them)",
                    flush=True,
                )
                await stop.wait()
                router.draining = True
                log.info("router stopping: /readyz 503 for %.1f s, then the requests in flight finish", unready_s)
                await asyncio.sleep(unready_s)
            finally:
                await runner.cleanup()  # stops listening, waits for the handlers in flight, then the app's cleanup
        finally:
            await rds.aclose()

    asyncio.run(main())
