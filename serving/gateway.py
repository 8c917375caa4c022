"""The product's front door: an OpenAI-compatible gateway that logs every generation with its exact policy version.

``POST /v1/completions`` forwards to the vLLM node with the sampled-token log-prob (``logprobs=0``) and
``return_token_ids=true``, assigns a ``generation_id``, publishes a ``GenerationRecord`` to the generations topic
(keyed by generation id; idempotent producer, acks=all) and answers with the node's OpenAI response plus
``"liverl": {"generation_id", "policy_version"}`` and the ``X-Liverl-Generation-Id`` / ``X-Liverl-Version`` headers.

Exact version attribution: the gateway owns a ``SwapGate``. A hot-swap closes it: new requests wait (they are not
dropped), in-flight requests drain, the weights change, the gate reopens. A request is admitted only while the gate
is open and the swap waits for every admitted request to finish, so the version read at admission produced every
token of that request. Only ``n=1`` non-streaming completions are accepted (one record per generation).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from liverl.core.config import LiverlConfig
from liverl.core.schemas import GenerationRecord, SamplingParams

log = logging.getLogger("liverl.serving.gateway")

SERVED_MODEL_NAME = "liverl"  # the node's --served-model-name (serving.node)
MAX_PROMPT_CHARS = 100_000
MAX_LOGPROBS = 20


class BadRequest(ValueError):
    """A client error, answered with HTTP 400 and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SwapGate:
    """Admission control that makes a weight swap atomic with respect to requests.

    ``admit()`` waits while a swap is pending, then counts the request in flight. ``closed()`` stops admissions,
    waits until nothing is in flight, and yields; admissions resume when it exits. All on one event loop, so the
    check-and-increment in ``admit`` cannot interleave with ``closed``.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._lock = asyncio.Lock()  # one swap at a time

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @asynccontextmanager
    async def admit(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self._open.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("a weight swap is in progress; retry shortly")
            try:
                await asyncio.wait_for(self._open.wait(), remaining)
            except TimeoutError:
                continue
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    @asynccontextmanager
    async def closed(self):
        """Close, drain, yield ``drain_ms``; reopen on exit (also on error)."""
        async with self._lock:
            self._open.clear()
            t0 = time.perf_counter()
            try:
                await self._idle.wait()
                yield (time.perf_counter() - t0) * 1e3
            finally:
                self._open.set()


class NodeClient:
    """HTTP client of one vLLM node: OpenAI routes plus the dev/RL routes used for hot-swaps."""

    def __init__(self, url: str, timeout_s: float = 120.0, max_connections: int = 256):
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=30),  # < node's 75 s
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def request(self, method: str, path: str, retry: bool = True, **kw) -> tuple[int, Any]:
        """One HTTP call; retried once (unless ``retry`` is False: calls that must not run twice) when a pooled
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

    async def pause(self, mode: str = "wait") -> None:
        await self._ok("POST", f"/pause?mode={mode}")

    async def resume(self) -> None:
        await self._ok("POST", "/resume")

    async def reset_prefix_cache(self, attempts: int = 50) -> None:
        """Reset the prefix cache; vLLM refuses while blocks are held, so retry briefly."""
        for _ in range(attempts):
            body = await self._ok("POST", "/reset_prefix_cache")
            if body and body.get("success"):
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("vLLM did not reset its prefix cache (blocks still held)")

    async def rpc(self, method: str, *args: str, timeout_s: float = 120.0) -> dict:
        """``collective_rpc`` of a LiverlWorkerExtension method; returns the (single) worker's result dict."""
        body = await self._ok("POST", "/collective_rpc", retry=False,  # an XOR delta applied twice is undone
                              json={"method": method, "args": list(args), "timeout": timeout_s})
        results = (body or {}).get("results") or []
        if len(results) != 1 or not isinstance(results[0], dict):
            raise RuntimeError(f"collective_rpc {method}: expected one worker result, got {body}")
        return results[0]


def _openai_error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{key}' must be a number", key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def validate_completion_request(body: Any) -> tuple[dict, dict]:
    """Check a /v1/completions body; return (body to forward, what the client asked to see). Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' is required and must be one string (batched or token-id prompts are not "
                         "supported: each generation is logged separately)", "prompt")
    if not prompt or len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"'prompt' must have 1..{MAX_PROMPT_CHARS} characters", "prompt")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            raise BadRequest(f"'{key}' must be 1: the gateway logs one generation per request (got {v!r}); "
                             "send separate requests instead", key)
    if body.get("stream"):
        raise BadRequest("'stream' is not supported: every generation is logged whole", "stream")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", "echo")
    if body.get("use_beam_search"):
        raise BadRequest("'use_beam_search' is not supported (it is not sampling from the policy)", "use_beam_search")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    wants = {"logprobs": logprobs is not None, "token_ids": bool(body.get("return_token_ids"))}
    fwd = dict(body)
    fwd.update(model=SERVED_MODEL_NAME, prompt=prompt, n=1, stream=False, max_tokens=max_tokens,
               temperature=temperature, top_p=top_p, logprobs=logprobs if logprobs is not None else 0,
               return_token_ids=True)
    fwd.pop("best_of", None)
    return fwd, wants


class Gateway:
    """The aiohttp app plus the served-version state the agent updates."""

    def __init__(self, cfg: LiverlConfig, node: NodeClient, node_name: str, bootstrap: str,
                 ack_wait_s: float = 2.0, admit_timeout_s: float = 60.0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.cfg = cfg
        self.node = node
        self.node_name = node_name
        self.bootstrap = bootstrap
        self.ack_wait_s = ack_wait_s
        self.admit_timeout_s = admit_timeout_s
        self.gate = SwapGate()
        self.version: int | None = None
        self.checksum: str | None = None
        self.unhealthy_reason: str | None = "not initialised"
        self.last_swap_pause_ms: float | None = None
        self.producer = None
        self._pending_acks: set[asyncio.Future] = set()
        r = self.metrics_registry = CollectorRegistry()
        self.m_requests = Counter("liverl_gateway_requests", "Completion requests by HTTP status", ["status"],
                                  registry=r)
        self.m_seconds = Histogram("liverl_gateway_request_seconds", "Completion latency, admission wait included",
                                   registry=r, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.m_version = Gauge("liverl_gateway_policy_version", "Policy version being served", registry=r)
        self.m_swaps = Counter("liverl_gateway_swaps", "Hot-swaps attempted", ["outcome"], registry=r)
        self.m_pause = Histogram("liverl_gateway_swap_pause_seconds", "Time new requests were held by a swap",
                                 registry=r, buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.m_inflight = Gauge("liverl_gateway_inflight_requests", "Requests being generated", registry=r)
        self.m_logged = Counter("liverl_gateway_generations_logged", "Generation records acknowledged by Kafka",
                                registry=r)
        self.m_log_fail = Counter("liverl_gateway_generation_log_failures",
                                  "Generation records Kafka did not acknowledge (error)", registry=r)
        self.m_log_slow = Counter("liverl_gateway_generation_log_slow",
                                  "Responses sent before Kafka acknowledged the record (bounded wait expired)",
                                  registry=r)
        self.app = self._make_app()

    # ------------------------------------------------------------------------------------------ lifecycle

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/liverl/version", self.version_info)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        """Create the generations topic if needed and start the producer (kafka-python, idempotent, acks=all).

        kafka-python rather than aiokafka: aiokafka's idempotent producer fails InitProducerId against the embedded
        Tansu broker (UnknownError), kafka-python's works. Its sends are non-blocking (a background I/O thread);
        acks are bridged back to the event loop.
        """
        from liverl.core.bus import ensure_topics, make_producer

        topic = self.cfg.topics.generations
        await asyncio.to_thread(ensure_topics, self.bootstrap, [topic], self.cfg.broker.partitions)

        def connect():
            producer = make_producer(self.bootstrap, client_id=f"liverl-gateway-{self.node_name}", max_block_ms=2000)
            producer.partitions_for(topic)  # fetch metadata now, so send() never blocks the loop on it
            return producer

        self.producer = await asyncio.to_thread(connect)

    async def close(self) -> None:
        if self._pending_acks:
            await asyncio.wait(list(self._pending_acks), timeout=10)
        if self.producer is not None:
            producer, self.producer = self.producer, None
            await asyncio.to_thread(producer.close, 10)  # flushes what is still buffered

    def set_served(self, version: int, checksum: str) -> None:
        self.version, self.checksum, self.unhealthy_reason = version, checksum, None
        self.m_version.set(version)

    # ------------------------------------------------------------------------------------------ handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp = await self._completions(request)
        self.m_requests.labels(status=str(resp.status)).inc()
        self.m_seconds.observe(time.perf_counter() - t0)
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            return _openai_error(400, f"the request body is not valid JSON: {e}")
        try:
            fwd, wants = validate_completion_request(body)
        except BadRequest as e:
            return _openai_error(400, str(e), e.param)
        if self.unhealthy_reason is not None:
            return _openai_error(503, f"node not serving: {self.unhealthy_reason}", kind="service_unavailable")
        try:
            async with self.gate.admit(self.admit_timeout_s):
                version = self.version
                self.m_inflight.inc()
                try:
                    status, out = await self.node.request("POST", "/v1/completions", json=fwd)
                finally:
                    self.m_inflight.dec()
                if version != self.version:  # cannot happen while the gate works; refuse to mislabel
                    return _openai_error(500, "policy version changed during generation", kind="internal_error")
        except TimeoutError as e:
            return _openai_error(503, str(e), kind="service_unavailable")
        except aiohttp.ClientError as e:
            return _openai_error(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
        if status != 200:  # vLLM's own validation errors keep their status and message
            return web.json_response(out if isinstance(out, dict) else {"error": out}, status=status)
        try:
            choice = out["choices"][0]
            record = GenerationRecord(
                generation_id=uuid.uuid4().hex, policy_version=version, node=self.node_name,
                prompt=fwd["prompt"], completion=choice["text"],
                prompt_token_ids=choice["prompt_token_ids"], completion_token_ids=choice["token_ids"],
                completion_logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                sampling=SamplingParams(temperature=fwd["temperature"], top_p=fwd["top_p"],
                                        max_tokens=fwd["max_tokens"]),
                finish_reason=choice.get("finish_reason"),
            )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            log.error("unexpected vLLM response %s: %s", out, e)
            return _openai_error(502, f"unexpected response from the vLLM node: {e}", kind="bad_gateway")
        await self._log_record(record)
        if not wants["logprobs"]:
            choice.pop("logprobs", None)
        if not wants["token_ids"]:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        out["liverl"] = {"generation_id": record.generation_id, "policy_version": version}
        return web.json_response(out, headers={"X-Liverl-Generation-Id": record.generation_id,
                                               "X-Liverl-Version": str(version)})

    async def _log_record(self, record: GenerationRecord) -> None:
        """Publish the record; wait for the broker's ack at most ``ack_wait_s``, count every failure."""
        loop = asyncio.get_running_loop()
        ack: asyncio.Future = loop.create_future()

        def settle(result=None, error: BaseException | None = None) -> None:
            if ack.done():
                return
            if error is not None:
                ack.set_exception(error)
            else:
                ack.set_result(result)

        try:
            kfut = self.producer.send(self.cfg.topics.generations, value=record.to_bytes(), key=record.generation_id)
        except Exception as e:  # buffer full past max_block_ms, producer closed, ...
            self.m_log_fail.inc()
            log.error("generation %s not logged: %s", record.generation_id, e)
            return
        self._pending_acks.add(ack)
        ack.add_done_callback(self._on_ack)
        kfut.add_callback(lambda md: loop.call_soon_threadsafe(settle, md))
        kfut.add_errback(lambda e: loop.call_soon_threadsafe(settle, None, e))
        done, _ = await asyncio.wait([ack], timeout=self.ack_wait_s)
        if not done:
            self.m_log_slow.inc()

    def _on_ack(self, fut: asyncio.Future) -> None:
        self._pending_acks.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            self.m_log_fail.inc()
            log.error("generation record not acknowledged by Kafka: %s",
                      "cancelled" if fut.cancelled() else fut.exception())
        else:
            self.m_logged.inc()

    async def models(self, request: web.Request) -> web.Response:
        try:
            status, out = await self.node.request("GET", "/v1/models")
        except aiohttp.ClientError as e:
            return _openai_error(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
        return web.json_response(out, status=status)

    async def version_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version, "checksum": self.checksum, "node": self.node_name,
                                  "swapping": not self.gate.is_open, "last_swap_pause_ms": self.last_swap_pause_ms})

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.unhealthy_reason is None and self.producer is not None
        return web.json_response({"ok": ok, "reason": self.unhealthy_reason, "version": self.version,
                                  "node": self.node_name}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.metrics_registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
