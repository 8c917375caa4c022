"""The ingest worker's web server: ``/metrics`` (Prometheus), ``/healthz``, ``/livez`` and ``/readyz``, and the
product's erasure requests (``POST /v1/erasures``, ``GET /v1/erasures/{id}``, with the product key:
``ingest.erasures``); no view of prompts or feedback.

- ``/livez``: 200 whenever it answers. It runs on the worker's own event loop, so an answer means the loop is not
  wedged (a batch that blocked it would leave the probe unanswered, and the orchestrator restarts the worker).
- ``/readyz``: 200 only while the worker joins: its join table is restored, it holds at least one partition of the
  inputs, and it is not stopping; else 503 with the reason. A worker in a group with more members than partitions
  holds none and stays unready (it takes over when a member leaves).
- ``/healthz``: 200 with the worker's state (``ready``, ``rebalancing``, ``partitions``) as JSON, whatever it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web


def readiness(health: dict) -> str | None:
    """Why the worker is not ready (from its ``health()``), or None: it is."""
    if health.get("stopping"):
        return "stopping: the batch in hand is committed, then the worker leaves its group"
    if not health.get("ready"):
        return "rebalancing: the join table is being restored"
    if not health.get("partitions"):
        return "holds no partition of the inputs"
    return None


async def start_web(
    exposition: Callable[[], bytes], health: Callable[[], dict], bind: str, port: int, routes: Any = None
):
    """Serve on ``bind:port`` (0: no server; returns None), else the aiohttp runner to ``cleanup()`` at the end.
    ``routes``: more routes (``add_to(app)``), e.g. ``ingest.erasures.ErasureRoutes``."""
    if port <= 0:
        return None

    async def metrics_view(request):
        return web.Response(body=exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def healthz(request):
        return web.json_response(health())

    async def livez(request):
        return web.json_response({"ok": True})

    async def readyz(request):
        state = health()
        reason = readiness(state)
        body = {"ready": reason is None, "reason": reason, "partitions": state.get("partitions", [])}
        return web.json_response(body, status=200 if reason is None else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    if routes is not None:
        routes.add_to(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, bind, port).start()
    return runner
