"""The ingest worker's web server: ``/metrics`` (Prometheus) and ``/healthz``; nothing else (no view of prompts or
feedback)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


async def start_web(exposition: Callable[[], bytes], health: Callable[[], dict], bind: str, port: int):
    """Serve on ``bind:port`` (0: no server; returns None), else the aiohttp runner to ``cleanup()`` at the end."""
    if port <= 0:
        return None

    async def metrics_view(request):
        return web.Response(body=exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def healthz(request):
        return web.json_response(health())

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, bind, port).start()
    return runner
