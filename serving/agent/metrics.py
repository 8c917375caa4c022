"""The serving process's own Prometheus metrics: what the hot-swap agent counts, served on ``serving.agent_port``.

The agent runs in the serving process, the gateway in the node's API-server process (``serving.node.gateway_host``);
each process serves what it counts. The gateway's ``/metrics`` has the product's traffic (``liverl_gateway_requests``,
latency, generations logged, the served version); this endpoint has the agent's events. Four of them keep the
``liverl_gateway_`` names the dashboards and ``deploy/alerts/liverl.rules.yml`` use: ``liverl_gateway_swaps``
(by outcome: ok, failed, refused), ``liverl_gateway_swap_pause_seconds``, ``liverl_gateway_reverify`` (by result: ok,
mismatch, error) and ``liverl_gateway_agent_errors`` (by exception type). ``liverl_agent_*`` are what only the agent
knows: the announcements it refused, the version the announcements point this node at, and when it last read the
served weights back.

``GET /healthz`` answers the agent's view of the node: 200 while it serves a version it has verified, else 503 with
the reason (the gateway's own ``/healthz`` says the same to the product's side). ``GET /livez``: 200 while the serving
process's event loop answers and its vLLM node runs. ``GET /readyz``: 200 while the agent has a verified version
served and the node is not draining (the gateway's own ``/readyz``, on the product's side, is the one that also knows
its producer runs: probes use that one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("liverl.serving.agent")


class AgentMetrics:
    """The agent's Prometheus metrics, in a registry of their own (``registry``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.swaps = Counter("liverl_gateway_swaps", "Hot-swaps attempted", ["outcome"], registry=r)
        self.pause = Histogram(
            "liverl_gateway_swap_pause_seconds",
            "Time a swap kept the engine paused (requests in flight frozen, new ones queued)",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.reverify = Counter(
            "liverl_gateway_reverify",
            "Read-backs of the served weights between swaps, by result (ok, mismatch, error)",
            ["result"],
            registry=r,
        )
        self.errors = Counter(
            "liverl_gateway_agent_errors",
            "Hot-swap agent polls that failed, by exception type (logged; the agent goes on)",
            ["kind"],
            registry=r,
        )
        self.refused = Counter(
            "liverl_agent_refused_announcements",
            "Version announcements the agent refused (bad signature, wrong channel or prefix, expired, replayed), "
            "by reason",
            ["reason"],
            registry=r,
        )
        self.target_version = Gauge(
            "liverl_agent_target_version",
            "The version the gate's announcements point this node at (differs from the served one until a swap "
            "succeeds)",
            registry=r,
        )
        self.verified = Gauge(
            "liverl_agent_weights_verified_timestamp_seconds",
            "When the served weights were last read back and their checksum compared (start, swaps, re-verification)",
            registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


Probe = Callable[[], tuple[bool, dict]]


async def start_agent_server(
    metrics: AgentMetrics, health: Probe, host: str, port: int, live: Probe | None = None, ready: Probe | None = None
) -> web.AppRunner | None:
    """Serve ``GET /metrics``, ``/healthz``, ``/livez`` and ``/readyz`` on ``host:port`` (0: no server, None
    returned), on the running event loop; returns the aiohttp runner to ``cleanup()`` at the end. ``health()``,
    ``live()`` and ``ready()`` give (ok, JSON body); ``live`` defaults to always ok, ``ready`` to ``health``. A port
    in use raises ``OSError``: the serving process then does not start, as it does when the gateway's port is taken."""
    if port <= 0:
        return None

    async def metrics_view(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def probe(fn: Probe):
        async def view(request: web.Request) -> web.Response:
            ok, body = fn()
            return web.json_response(body, status=200 if ok else 503)

        return view

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", probe(health))
    app.router.add_get("/livez", probe(live or (lambda: (True, {"ok": True}))))
    app.router.add_get("/readyz", probe(ready or health))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("agent metrics on http://%s:%d/metrics", host, port)
    return runner
