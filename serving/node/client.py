"""The vLLM node's contract and its client: the names of what the node loads (worker extension, middlewares),
the environment variable that carries the gateway's bootstrap, and ``NodeClient``, the node's HTTP client (the
OpenAI routes and the dev/RL routes the hot-swap agent drives). The serving process (``serving/agent``) launches the
node with these names; the gateway inside the node talks to vLLM through the same client interface.
This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp

from serving.node.rawhttp import NodeHTTP, NodeStream, NodeUnreachable  # noqa: F401  (NodeUnreachable: re-exported)

log = logging.getLogger("liverl.serving.node")

SERVED_MODEL_NAME = "liverl"
WORKER_EXTENSION = "serving.node.worker.extension.LiverlWorkerExtension"
WEIGHT_TRANSFER_BACKEND = "liverl_delta"  # serving.node.worker.transfer: vLLM's weight-update calls apply deltas
NODE_MIDDLEWARE = "serving.node.auth.NodeKeyMiddleware"
SPANS_MIDDLEWARE = "serving.node.versions.VersionSpansMiddleware"  # listed before the key check: inside it
SWAP_MIDDLEWARE = "serving.node.swap.SwapMiddleware"  # likewise
GATEWAY_MIDDLEWARE = "serving.node.gateway_host.GatewayMiddleware"  # likewise: its control route is keyed
ENV_GATEWAY = (
    "LIVERL_NODE_GATEWAY"  # JSON {config, bootstrap}: the gateway serving.node.gateway_host starts in the node
)
NODE_KEEPALIVE_S = 75  # > NodeClient's aiohttp pool (30 s); its raw pool retries a request the node closed on unread


class NodeClient:
    """HTTP client of one vLLM node: the OpenAI routes for the gateway's hot path (raw bytes in and out, over
    ``serving.node.rawhttp``) and the dev/RL routes the hot-swap agent drives (JSON, over aiohttp)."""

    def __init__(self, url: str, timeout_s: float = 120.0, max_connections: int = 256, key: str = ""):
        self.url = url.rstrip("/")
        self.key = key
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None
        self.http: NodeHTTP | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            connector=aiohttp.TCPConnector(limit=8, keepalive_timeout=30),  # < NODE_KEEPALIVE_S
            headers={"Authorization": f"Bearer {self.key}"} if self.key else None,
        )
        host, port = urllib.parse.urlsplit(self.url).hostname, urllib.parse.urlsplit(self.url).port
        self.http = NodeHTTP(host, port, self._timeout_s, self._max_connections, key=self.key)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.http is not None:
            await self.http.close()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body to an OpenAI route, return (status, raw body). Raises ``NodeUnreachable``."""
        return await self.http.post(path, body)

    def stream(self, path: str, body: bytes) -> AbstractAsyncContextManager[NodeStream]:
        """POST a streaming request; the block gets the open ``NodeStream`` (leaving it early closes the
        connection, which makes vLLM abort the request)."""
        return self.http.stream(path, body)

    async def request(self, method: str, path: str, retry: bool = True, **kw) -> tuple[int, Any]:
        """One JSON call; retried once (unless ``retry`` is False: calls that must not run twice) when a pooled
        connection turns out closed before any response came."""
        assert self.session is not None, "NodeClient.start() first"
        for attempt in (0, 1) if retry else (1,):
            try:
                async with self.session.request(method, self.url + path, **kw) as r:
                    raw = await r.read()
                    try:
                        return r.status, json.loads(raw) if raw else None
                    except ValueError:
                        return r.status, {"raw": raw.decode(errors="replace")}
            except aiohttp.ServerDisconnectedError:
                if attempt:
                    raise
                log.warning("vLLM node closed a pooled connection; retrying %s %s once", method, path)
        raise AssertionError("unreachable")

    async def _ok(self, method: str, path: str, retry: bool = True, **kw) -> Any:
        status, body = await self.request(method, path, retry=retry, **kw)
        if status != 200:
            raise RuntimeError(f"vLLM node {method} {path} -> HTTP {status}: {body}")
        return body

    async def max_model_len(self) -> int:
        """The served model's context length, from the node's ``/v1/models``."""
        body = await self._ok("GET", "/v1/models")
        return int(body["data"][0]["max_model_len"])

    async def swap(
        self, deltas: list[tuple[str, str]], frm: tuple[int, str], to: tuple[int, str], via: str = "vllm"
    ) -> dict:
        """One whole hot-swap inside the node (``serving.node.swap``): never retried (an XOR delta applied twice is
        undone). ``via``: ``vllm`` (vLLM's weight-update calls) or ``liverl`` (liverl's worker RPC) inside the pause.
        Returns the node's answer (``ok``, ``version``, ``checksum``, ``restored``, ``pause_ms``, ...)."""
        return await self._ok(
            "POST",
            "/liverl/swap",
            retry=False,
            json={"deltas": [list(d) for d in deltas], "from": list(frm), "to": list(to), "via": via},
        )

    async def set_weight_version(self, version: int) -> None:
        """Label the engine's weights: every token sampled from now on carries ``version`` in its request's spans."""
        await self._ok("POST", "/update_weight_version", json={"new_version": str(version)})

    async def spans(self, rid: str, prompts: int = 1) -> dict[str, dict[str, list[list]]]:
        """Per-token weight-version spans of a finished request (``serving.node.versions``), by engine request id."""
        body = await self._ok("GET", f"/liverl/spans?rid={urllib.parse.quote(rid)}&prompts={prompts}")
        return body["requests"]

    async def resume(self) -> None:
        await self._ok("POST", "/resume")

    async def rpc(self, method: str, *args, timeout_s: float = 120.0) -> dict:
        """``collective_rpc`` of a LiverlWorkerExtension method; returns the (single) worker's result dict."""
        body = await self._ok(
            "POST",
            "/collective_rpc",
            retry=False,  # an XOR delta applied twice is undone
            json={"method": method, "args": list(args), "timeout": timeout_s},
        )
        results = (body or {}).get("results") or []
        if len(results) != 1 or not isinstance(results[0], dict):
            raise RuntimeError(f"collective_rpc {method}: expected one worker result, got {body}")
        return results[0]
