"""The gateway runs inside the vLLM node's API-server process: no second process, no second HTTP hop.

Why: a gateway as a separate server in front of the node's OpenAI server makes every request and response cross a
second process and a second HTTP exchange, and on a machine whose cores the engine keeps busy each crossing waits for
a time slice (``liverl bench serve`` measured such a gateway at 0.45-0.55 of the bare node). So:

- ``GatewayMiddleware``, an ASGI middleware vLLM loads with ``--middleware`` (a supported extension point, like
  ``serving.node.auth``; nothing in vLLM is changed), starts ``serving.node.gateway.Gateway`` on the server's lifespan
  start, in this process and on its event loop, and stops it (flushing its Kafka producer) on shutdown.
  ``LIVERL_NODE_GATEWAY`` (JSON: the config and the bootstrap, set by ``serving.agent.launch.start_node``) says what to
  start; without it the middleware passes everything through.
- The gateway's aiohttp server listens on ``serving.host:serving.gateway_port``, the product's front door as
  before (the router forwards there), while vLLM's own server keeps ``serving.node_host:serving.vllm_port`` behind
  the node key. The gateway's node client is ``InProcessNode``: each call is an ASGI call in memory, not an HTTP
  exchange over a socket. Generation calls go to vLLM's route object itself, inside FastAPI's exception handlers
  (``InProcessNode._target``); other calls (``/v1/models``, ``/liverl/spans``) go through vLLM's whole app. The
  first of them, at start, installs ``serving.node.versions``' span recorder. A call silent for ``timeout_s`` ends
  with ``NodeUnreachable``, as over HTTP.
- The swap bookkeeping happens here too, with no round trip: ``serving.node.swap`` marks the swap's start on this
  gateway just before it pauses the engine, and its end, with the version it left served, after the resume, so a
  request is known to have crossed a swap exactly.
- The serving process's agent (``serving.agent.agent``) decides what to serve and talks to this process over the node's
  keyed HTTP routes: ``POST /liverl/swap`` for a swap, ``POST /liverl/gateway`` (this middleware, inside the key
  check) for the state the gateway takes from it: the served version and checksum at start, and a node taken out of
  service (``GatewayLink`` is its side of that route). ``GET /liverl/gateway`` answers the gateway's state. The
  agent's counters (swaps, pauses, re-verifications) are the serving process's own, on its own ``/metrics``
  (``serving.agent.metrics``); this route carries state only.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from serving.node.auth import read_body, reply_json
from serving.node.client import ENV_GATEWAY
from serving.node.rawhttp import NodeUnreachable

log = logging.getLogger("liverl.serving.node_gateway")

ENV_PROFILE = "LIVERL_NODE_PROFILE"  # a path: profile this process's event loop (cProfile) while the gateway runs
CONTROL_PATH = "/liverl/gateway"
DIRECT_ROUTES = ("/v1/completions", "/v1/chat/completions")  # called on vLLM's route itself (InProcessNode._target)

_current = None  # the Gateway running in this process (one per node process), for serving.node.swap


def current():
    """The ``Gateway`` this process runs, or None (no gateway here, or not started yet)."""
    return _current


class _Call:
    """One in-memory ASGI exchange with the node's app: the response start, its body chunks, its end."""

    def __init__(self, body: bytes):
        self.body = body
        self.sent = False
        self.status = 0
        self.headers_done = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.disconnected = asyncio.Event()

    async def receive(self) -> dict:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnected.wait()  # the client left (or the exchange is over): tell the app
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "http.response.start":
            self.status = msg["status"]
            if not self.headers_done.done():
                self.headers_done.set_result(None)
        elif kind == "http.response.body":
            if msg.get("body"):
                self.chunks.put_nowait(msg["body"])
            if not msg.get("more_body"):
                self.chunks.put_nowait(None)


class InProcessStream:
    """``serving.node.rawhttp.NodeStream``'s interface over an in-memory exchange: ``status``, ``body()``,
    ``events()`` (the SSE ``data:`` payloads)."""

    def __init__(self, call: _Call, task: asyncio.Task, timeout_s: float = 120.0):
        self.call, self.task, self.timeout_s = call, task, timeout_s
        self.status = call.status

    async def _next(self) -> bytes | None:
        """The next body chunk (None at the end); ``NodeUnreachable`` after ``timeout_s`` of silence, as the HTTP
        client raises it (the gateway then ends the client's stream with an error event)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.call.chunks.get()
        except TimeoutError:
            raise NodeUnreachable(f"no output from the vLLM engine within {self.timeout_s:g} s") from None

    async def body(self) -> bytes:
        out = bytearray()
        while (chunk := await self._next()) is not None:
            out += chunk
        return bytes(out)

    async def events(self) -> AsyncIterator[bytes]:
        buf = b""
        while (chunk := await self._next()) is not None:
            buf += chunk
            while (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2 :]
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
                    elif line.startswith(b"data:"):
                        yield line[5:]


class InProcessNode:
    """The gateway's node client (``serving.node.client.NodeClient``'s hot-path interface) as ASGI calls on the node's
    own app in this process."""

    def __init__(self, app, key: str, state: dict | None = None, timeout_s: float = 120.0):
        self.app, self.key, self.state, self.timeout_s = app, key, state, timeout_s
        self._auth = f"Bearer {key}".encode()
        self._targets: dict[tuple[str, str], Any] = {}

    def _target(self, method: str, path: str):
        """What a call goes to: for the generation routes (``DIRECT_ROUTES``), vLLM's own route, inside the same
        two layers FastAPI puts around its router (``ExceptionMiddleware`` with the app's exception handlers, so
        vLLM's validation errors keep their status and body, and ``AsyncExitStackMiddleware``), skipping the
        middlewares a product request from outside needs and this trusted in-process call does not (the node key
        check, vLLM's HTTP metrics and CORS, the swap and spans routes): measured, they were about a sixth of the API
        server's CPU per generation. Anything else goes through the whole app."""
        target = self._targets.get((method, path))
        if target is None:
            target = self.app
            router = getattr(self.app, "router", None)
            route = next(
                (
                    r
                    for r in getattr(router, "routes", ())
                    if path in DIRECT_ROUTES and getattr(r, "path", None) == path and method in (r.methods or ())
                ),
                None,
            )
            if route is not None:
                from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware  # noqa: PLC0415 vLLM's
                from starlette.middleware.exceptions import ExceptionMiddleware  # noqa: PLC0415 likewise

                handlers = {k: v for k, v in self.app.exception_handlers.items() if k not in (500, Exception)}
                target = ExceptionMiddleware(AsyncExitStackMiddleware(route), handlers=handlers)
            self._targets[method, path] = target
        return target

    def _scope(self, method: str, path: str, body: bytes) -> dict:
        path, _, query = path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [
                (b"host", b"liverl-gateway"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"authorization", self._auth),
            ],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        if self.state is not None:
            scope["state"] = dict(self.state)
        scope["app"] = self.app  # what Starlette sets: vLLM's handlers find their state on it
        return scope

    def _start(self, method: str, path: str, body: bytes) -> tuple[_Call, asyncio.Task]:
        call = _Call(body)
        task = asyncio.ensure_future(
            self._target(method, path)(self._scope(method, path, body), call.receive, call.send)
        )

        def done(t: asyncio.Task) -> None:
            if not call.headers_done.done():
                call.status = 500
                call.headers_done.set_result(None)
                why = "cancelled" if t.cancelled() else t.exception()
                call.chunks.put_nowait(json.dumps({"error": f"the node's app failed: {why}"}).encode())
                call.chunks.put_nowait(None)
            elif t.cancelled() or t.exception() is not None:
                call.chunks.put_nowait(None)

        task.add_done_callback(done)
        return call, task

    async def _headers(self, call: _Call) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.headers_done
        except TimeoutError:
            raise NodeUnreachable(f"no answer from the vLLM engine within {self.timeout_s:g} s") from None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of a generation call; ``NodeUnreachable`` after ``timeout_s`` of silence."""
        call, task = self._start("POST", path, body)
        try:
            await self._headers(call)
            out = await InProcessStream(call, task, self.timeout_s).body()
        finally:
            call.disconnected.set()
        return call.status, out

    @asynccontextmanager
    async def stream(self, path: str, body: bytes) -> AsyncIterator[InProcessStream]:
        call, task = self._start("POST", path, body)
        try:
            await self._headers(call)
            yield InProcessStream(call, task, self.timeout_s)
        finally:
            call.disconnected.set()  # leaving early: vLLM sees the client gone and aborts the request

    async def request(self, method: str, path: str, retry: bool = True, **kw) -> tuple[int, Any]:
        body = json.dumps(kw["json"]).encode() if "json" in kw else b""
        call, task = self._start(method, path, body)
        try:
            await self._headers(call)
            raw = await InProcessStream(call, task, self.timeout_s).body()
        finally:
            call.disconnected.set()
        try:
            return call.status, json.loads(raw) if raw else None
        except ValueError:
            return call.status, {"raw": raw.decode(errors="replace")}

    async def max_model_len(self) -> int:
        status, body = await self.request("GET", "/v1/models")
        if status != 200:
            raise RuntimeError(f"vLLM node GET /v1/models -> HTTP {status}: {body}")
        return int(body["data"][0]["max_model_len"])

    async def rpc(self, method: str, *args, timeout_s: float = 120.0) -> dict:
        """``collective_rpc`` of a ``LiverlWorkerExtension`` method on the engine client itself (no HTTP); the single
        worker's result dict (``serving.node.client.NodeClient.rpc`` over HTTP)."""
        engine = self.app.state.engine_client
        results = await engine.collective_rpc(method, timeout=timeout_s, args=args)
        if len(results) != 1 or not isinstance(results[0], dict):
            raise RuntimeError(f"collective_rpc {method}: expected one worker result, got {results!r}"[:500])
        return results[0]

    async def spans(self, rid: str, prompts: int = 1) -> dict[str, dict[str, list[list]]]:
        status, body = await self.request("GET", f"/liverl/spans?rid={urllib.parse.quote(rid)}&prompts={prompts}")
        if status != 200:
            raise RuntimeError(f"vLLM node GET /liverl/spans -> HTTP {status}: {body}")
        return body["requests"]


class GatewayMiddleware:
    """Pure ASGI: runs the gateway in this process over the server's lifespan (when ``LIVERL_NODE_GATEWAY`` says
    so) and answers ``/liverl/gateway``; every other request passes through untouched. Listed before
    ``serving.node.auth.NodeKeyMiddleware`` on vLLM's command line, so it sits inside the key check."""

    def __init__(self, app):
        self.app = app
        self.spec = json.loads(os.environ[ENV_GATEWAY]) if os.environ.get(ENV_GATEWAY) else None
        self.gateway = None
        self.runner = None
        self.profile = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") == CONTROL_PATH:
            return await self._control(scope, receive, send)
        if scope["type"] != "lifespan" or self.spec is None:
            return await self.app(scope, receive, send)
        root, state = scope.get("app"), scope.get("state")

        async def send_wrapped(msg):
            if msg["type"] == "lifespan.startup.complete":
                try:
                    await self._start(root, state)
                except Exception as e:  # the server must not serve without its gateway: vLLM exits, and says why
                    log.exception("the gateway did not start in the node's process")
                    await send({"type": "lifespan.startup.failed", "message": f"liverl gateway: {e}"})
                    return
            elif msg["type"] == "lifespan.shutdown.complete":
                await self._stop()
            await send(msg)

        return await self.app(scope, receive, send_wrapped)

    async def _start(self, root, state) -> None:
        global _current
        from aiohttp import web  # noqa: PLC0415 only in a node that runs a gateway

        from core.config import LiverlConfig  # noqa: PLC0415 pydantic settings: only with a gateway
        from serving.node.auth import ENV_KEY  # noqa: PLC0415 likewise
        from serving.node.gateway import Gateway  # noqa: PLC0415 likewise (aiohttp, confluent-kafka)

        cfg = LiverlConfig.model_validate_json(self.spec["config"])
        gw = Gateway(
            cfg, InProcessNode(root, os.environ[ENV_KEY], state), cfg.serving.node_name, self.spec["bootstrap"]
        )
        await gw.start()
        runner = web.AppRunner(gw.app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, cfg.serving.host, cfg.serving.gateway_port).start()
        except OSError:
            await runner.cleanup()
            await gw.close()
            raise
        self.gateway, self.runner, _current = gw, runner, gw
        if os.environ.get(ENV_PROFILE):  # liverl bench serve: where this process's event loop spends its time
            import cProfile  # noqa: PLC0415 only when asked

            self.profile = cProfile.Profile()
            self.profile.enable()
        log.info("gateway on http://%s:%d, in the vLLM node's process", cfg.serving.host, cfg.serving.gateway_port)

    async def _stop(self) -> None:
        global _current
        _current = None
        if self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(os.environ[ENV_PROFILE])
        if self.runner is not None:
            await self.runner.cleanup()
        if self.gateway is not None:
            await self.gateway.close()

    async def _control(self, scope, receive, send) -> None:
        gw = self.gateway
        if gw is None:
            return await reply_json(send, 503, {"error": "no gateway runs in this node"})
        if scope.get("method") == "POST":
            raw = await read_body(receive)
            try:
                apply_ops(gw, json.loads(raw)["ops"])
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                return await reply_json(send, 400, {"error": f"bad {CONTROL_PATH} ops: {type(e).__name__}: {e}"})
        elif scope.get("method") != "GET":
            return await reply_json(send, 405, {"error": f"{CONTROL_PATH} takes GET or POST"})
        await reply_json(send, 200, state_of(gw))


def state_of(gw) -> dict:
    return {
        "version": gw.version,
        "checksum": gw.checksum,
        "unhealthy_reason": gw.unhealthy_reason,
        "swapping": gw.swapping,
        "swap_epoch": gw.swap_epoch,
        "inflight": gw.inflight,
        "active": gw.active,
        "draining": gw.draining,
        "last_swap_pause_ms": gw.last_swap_pause_ms,
    }


def apply_ops(gw, ops: list) -> None:
    """Apply the agent's reports in order: ``["served", version, checksum]``, ``["unhealthy", reason]``,
    ``["draining"]`` (the serving process is stopping: from now on no generation is admitted; never undone)."""
    for op in ops:
        kind = op[0]
        if kind == "served":
            gw.set_served(int(op[1]), str(op[2]))
        elif kind == "unhealthy":
            gw.unhealthy_reason = None if op[1] is None else str(op[1])
        elif kind == "draining":
            gw.draining = True
        else:
            raise ValueError(f"unknown op {kind!r}")


class GatewayLink:
    """The serving agent's side of the gateway that runs in the node's process: what the gateway takes from the
    agent, the served ``version`` and ``checksum`` (``set_served``) and ``unhealthy_reason``, kept here and sent by
    ``flush()`` when changed (the agent flushes before each heartbeat, after a swap and after a re-verification).
    What is sent is the state itself, not a log of changes: a node unreachable for long gets the latest state once it
    answers. The swap's own bookkeeping (its start, the version it leaves served, its end) is done in the node by
    ``serving.node.swap``, exactly at the pause, not from here."""

    def __init__(self, node, node_name: str):
        self.node, self.node_name = node, node_name
        self.version: int | None = None
        self.checksum: str | None = None
        self._unhealthy: str | None = "not initialised"
        self.draining = False  # the serving process is stopping (``drain``)
        self._changed = False
        self._lock = asyncio.Lock()

    @property
    def unhealthy_reason(self) -> str | None:
        return self._unhealthy

    @unhealthy_reason.setter
    def unhealthy_reason(self, reason: str | None) -> None:
        self._unhealthy, self._changed = reason, True

    def set_served(self, version: int, checksum: str) -> None:
        self.version, self.checksum, self._unhealthy, self._changed = version, checksum, None, True

    def drain(self) -> None:
        """The serving process is stopping: the gateway admits no new generation once this is flushed."""
        self.draining, self._changed = True, True

    def ops(self) -> list[list]:
        """The state as ``apply_ops`` takes it: the served version (which clears the gateway's unhealthy reason),
        then the reason, then whether it drains."""
        served = [] if self.version is None else [["served", self.version, self.checksum]]
        return [*served, ["unhealthy", self._unhealthy], *([["draining"]] if self.draining else [])]

    async def flush(self) -> None:
        """Send the state if it changed since the last flush; on failure it is sent with the next flush and this
        raises."""
        async with self._lock:
            if not self._changed:
                return
            self._changed = False
            ops = self.ops()
            try:
                status, body = await self.node.request("POST", CONTROL_PATH, retry=False, json={"ops": ops})
            except BaseException:
                self._changed = True
                raise
            if status == 400:  # a state the gateway refuses would be refused again: say so, send the next change
                log.error("the node's gateway refused the agent's state %s: %s", ops, body)
            elif status != 200:
                self._changed = True
                raise RuntimeError(f"the node's gateway answered {CONTROL_PATH} with HTTP {status}: {body}")
