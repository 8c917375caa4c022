"""Helpers of the router tests: stand-in gateways, heartbeats, a config with a fleet and its keys, signed rollouts."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from core import keys
from core.config import LiverlConfig
from core.credentials import ensure_secrets
from core.schemas import RolloutTerms
from deploy.registry.signing import Signer, announce, generate_keypair


def gateway(name: str, seen: list | None = None) -> web.Application:
    """Answers as a node's gateway does: JSON naming the node (with the request's headers and raw body), liverl's
    headers, or an SSE stream. Every request it gets is appended to ``seen``."""

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if seen is not None:
            seen.append((request.path_qs, list(request.headers.items()), raw))
        try:
            body = json.loads(raw) if raw[:1] == b"{" else {}
        except (ValueError, RecursionError):
            body = {}
        headers = {"X-Liverl-Version": "3", "X-Liverl-Generation-Id": f"g-{name}"}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
            await resp.prepare(request)
            if body.get("stall_s"):  # one chunk, then silence (a node that hangs mid-stream)
                await resp.write(f"data: {json.dumps({'node': name, 'i': 0})}\n\n".encode())
                await asyncio.sleep(body["stall_s"])
                return resp
            for i in range(5):
                await resp.write(f"data: {json.dumps({'node': name, 'i': i})}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if body.get("think_s"):  # a long generation: the response head comes only when it is done
            await asyncio.sleep(body["think_s"])
        if body.get("prompt") == "bad":
            return web.json_response({"error": {"message": "prompt is bad", "param": "prompt"}}, status=400)
        return web.json_response(
            {"node": name, "echo": body, "headers": list(request.headers.items()), "raw": raw.decode("latin-1")},
            headers=headers,
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def start(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def beat(rds, prefix: str, name: str, url: str | None, healthy: bool = True) -> None:
    hb = keys.ServedHeartbeat(version=3, checksum="c" * 64, healthy=healthy, url=url)
    await rds.set(keys.served(prefix, name), hb.to_json(), ex=60)


async def until(check, what: str = "", timeout_s: float = 10.0) -> None:
    """Waits (at most ``timeout_s``) until ``check()`` is true: the router's refresh has seen what the test wrote to
    Redis (a fixed sleep is too short on a loaded CI machine)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


def front_door(cfg: LiverlConfig, fleet: dict[str, str]) -> tuple[LiverlConfig, Signer]:
    """``cfg`` with ``serving.fleet`` and the keys ``liverl up`` makes (announcement pair, assignment and product
    keys; those already there are kept) in its state dir; and the gate's signer."""
    out = cfg.model_copy(deep=True)
    out.serving.fleet = fleet
    private = out.state_path / "keys" / "announce.key"
    if not private.exists():  # a serving fixture's pair is kept: its agent verifies with it
        generate_keypair(private.parent)
    ensure_secrets(out)
    return out, Signer(private)


def announce_rollout(
    r, cfg: LiverlConfig, signer: Signer | None, rollout_id: int, share: float, nodes: list[str], unit: str = "user"
):
    """The gate's canary announcement of a rollout (``r``: a sync Redis client)."""
    terms = RolloutTerms(rollout_id=rollout_id, share=share, nodes=nodes, unit=unit)
    return announce(r, cfg.topics.prefix, 4, "c" * 64, f"rollout {rollout_id}", signer, channel="canary", rollout=terms)
