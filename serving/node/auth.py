"""The vLLM node answers only its serving process: an ASGI middleware that vLLM loads with ``--middleware``.

Why not vLLM's ``--api-key``: it guards only the ``/v1`` (and ``/v2``, ``/inference``) routes. The dev and RL routes
a hot-swap needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``, registered by
``VLLM_SERVER_DEV_MODE=1``) stay open to anyone who reaches the port, and ``/collective_rpc`` runs worker methods.
This middleware checks ``Authorization: Bearer <key>`` on **every** route except ``/health`` (a liveness probe that
tells nothing), with the key ``serving.node`` generates at each start and hands to the node in its environment
(``LIVERL_NODE_KEY``) and to its own clients (``NodeHandle.key``; a file only the user can read beside the node's
pidfile, for tools on the same machine). A request without it is answered 401 before vLLM sees it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

ENV_KEY = "LIVERL_NODE_KEY"
OPEN_PATHS = ("/health",)


class NodeKeyMiddleware:
    """Pure ASGI: 401 for any HTTP or websocket request without the node's key (``/health`` excepted)."""

    def __init__(self, app):
        key = os.environ.get(ENV_KEY, "")
        if len(key) < 16:
            raise RuntimeError(
                f"{ENV_KEY} is not set (or too short): the vLLM node refuses to serve without the "
                "key its serving process holds"
            )
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await reply_json(send, 401, {"error": "unauthorized: this vLLM node answers only its serving process"})


async def read_body(receive) -> bytes:
    """The whole body of an ASGI HTTP request (the node's own POST routes)."""
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return raw


async def reply_json(send, status: int, body: dict) -> None:
    """Answer an ASGI HTTP request with ``body`` as JSON (the node's own routes: this module's, the swap, the
    spans, the gateway's control route)."""
    raw = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw})


def new_key() -> str:
    return secrets.token_urlsafe(32)
