"""The product's front door: an OpenAI-compatible gateway that logs every generation with its exact policy version.

It runs inside the vLLM node's API-server process (``serving.node.gateway_host`` starts it there, with a node client
that calls vLLM's route in memory); with an HTTP ``serving.node.client.NodeClient`` it runs anywhere (the unit tests).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain or streamed, any ``n``; the chat template
is the model's, applied by the node, so a record's prompt token ids are exactly what the model read),
``GET /v1/models``, and ``POST /v1/feedback`` (the feedback JSON of the topic, for backends that cannot speak
Kafka; it takes the product key, ``security.feedback_key``, in the ``X-Liverl-Product-Key`` header). Request validation
and response shaping are in ``serving.node.openai_api``.

Each choice of a response is one generation: it gets a ``generation_id``, and a ``GenerationRecord`` (prompt and
completion token ids, the sampled tokens' log-probs, the sampling parameters, trainable or why not) is queued for
the generations topic, keyed by generation id, and the response waits for the broker's ack (at most
``serving.log_wait_s``, 2 s by default; an expired wait is counted), so a crash cannot leave a client holding the id
of a record that was never logged; a record Kafka refuses is counted and logged. ``POST /v1/feedback`` always answers
after the broker's ack. The client finds the ids and the version in the body (``liverl`` and each choice's
``generation_id``), in every chunk of a stream, and in the ``X-Liverl-Generation-Id`` (comma-separated, in choice order)
and ``X-Liverl-Version`` headers.

Exact version attribution without a drain: a hot-swap freezes the engine at a scheduler step, writes the changed
weights, labels them and resumes (``serving.node.swap``, in the same process); requests in flight are neither dropped
nor held back for more than that pause. The swap marks its start and end here (``swap_begin``/``swap_end``). A request
during which no swap began, and that did not start inside one, was sampled by one version: the one served when it was
sent. Any other asks the node for vLLM's per-token weight-version spans (``serving.node.versions``, the request is sent
with ``request_id`` = its first generation id) and its record carries them (``GenerationRecord.version_spans``,
``policy_version`` = the first span's): the learner keeps exact per-token behaviour log-probs, and
``GenerationRecord.mixed_versions`` keeps a generation two versions sampled out of any one version's live counters. A
streamed response's headers and chunks name the version served when it was sent; the final chunk of a choice that
spanned a swap adds ``version_spans``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic_core import from_json, to_json

from core import fleet
from core.bus import ensure_topics, librdkafka_security, topic_configs
from core.config import LiverlConfig
from core.credentials import PRODUCT_KEY_HEADER, load_feedback_keys
from core.schemas import FeedbackEvent, GenerationRecord, WireError
from serving.node import openai_api as oa
from serving.node.client import NodeClient, NodeUnreachable
from serving.node.producer import AsyncProducer

log = logging.getLogger("liverl.serving.gateway")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
ROUTES = {
    oa.CompletionRequest.route: (oa.CompletionRequest, oa.add_completion_chunk),
    oa.ChatCompletionRequest.route: (oa.ChatCompletionRequest, oa.add_chat_chunk),
}


def event_loop_factory():
    """uvloop's loop when it is installed (vLLM depends on it), else asyncio's: the gateway's HTTP server and client
    spend less CPU per request on it."""
    try:
        import uvloop  # noqa: PLC0415 uvloop: optional, else asyncio's loop
    except ImportError:
        log.info("uvloop is not installed; the gateway runs on asyncio's default event loop")
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> web.Response:
    return web.Response(
        body=to_json(oa.error_body(status, message, param, kind)), status=status, content_type="application/json"
    )


class _SwapWatch:
    """Whether a hot-swap overlapped one request, and if so the node's per-token version spans of its choices."""

    __slots__ = ("epoch", "gw", "in_swap")

    def __init__(self, gw: Gateway):
        self.gw, self.epoch, self.in_swap = gw, gw.swap_epoch, gw.swapping

    def crossed(self) -> bool:
        return self.in_swap or self.gw.swap_epoch != self.epoch

    async def spans(self, req: oa._GenerationRequest, rid: str) -> dict[int, list[list[int]]]:
        """Choice index -> [[version, start, end], ...] for the choices the node finished (none on error: logged)."""
        prompts = len(req.prompts) if isinstance(req, oa.CompletionRequest) else 1
        try:
            got = await self.gw.node.spans(rid, prompts)
        except (aiohttp.ClientError, RuntimeError, KeyError, TypeError) as e:
            log.error("cannot read the version spans of request %s: %s", rid, e)
            return {}
        out: dict[int, list[list[int]]] = {}
        for engine_id, choices in got.items():
            base = 0
            if engine_id.startswith("cmpl-") and engine_id.rsplit("-", 1)[-1].isdigit() and engine_id != f"cmpl-{rid}":
                base = int(engine_id.rsplit("-", 1)[-1]) * req.n
            for j, spans in choices.items():
                try:
                    out[base + int(j)] = [[int(v), int(a), int(b)] for v, a, b in spans]
                except (TypeError, ValueError):  # a label that is no version (the engine's "default"): unknown
                    continue
        return out


def _mixed(spans: list[list[int]] | None) -> bool:
    return spans is not None and len({v for v, _, _ in spans}) > 1


def _first_version(spans: list[list[int]] | None, default: int) -> int:
    return spans[0][0] if spans else default


class ClientLeft(Exception):
    """The client closed the connection mid-stream (the node's stream was closed too, so vLLM aborted)."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp


class Gateway:
    """The aiohttp app plus the served-version state the agent updates."""

    def __init__(
        self, cfg: LiverlConfig, node: NodeClient, node_name: str, bootstrap: str, feedback_wait_s: float = 10.0
    ):
        self.cfg = cfg
        self.node = node
        self.node_name = node_name
        self.bootstrap = bootstrap
        self.log_wait_s = cfg.serving.log_wait_s
        self.feedback_wait_s = feedback_wait_s
        self.swap_epoch = 0  # swaps begun; a request that sees it change may span two versions
        self.swapping = False  # between swap_begin and swap_end (the engine is, or is about to be, paused)
        self.inflight = 0
        self.version: int | None = None
        self.checksum: str | None = None
        self.unhealthy_reason: str | None = "not initialised"
        self.last_swap_pause_ms: float | None = None
        self.max_model_len = 0
        self.producer = None
        self._ids = random.Random(os.urandom(32))  # generation ids: 128 random bits, no syscall per id
        r = self.metrics_registry = CollectorRegistry()
        self.m_requests = Counter(
            "liverl_gateway_requests",
            "Requests by route and HTTP status (499: the client left mid-stream)",
            ["route", "status"],
            registry=r,
        )
        self.m_seconds = Histogram(
            "liverl_gateway_request_seconds",
            "Generation latency, any swap pause included",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.m_version = Gauge("liverl_gateway_policy_version", "Policy version being served", registry=r)
        self.m_swaps = Counter("liverl_gateway_swaps", "Hot-swaps attempted", ["outcome"], registry=r)
        self.m_reverify = Counter(
            "liverl_gateway_reverify",
            "Read-backs of the served weights between swaps, by result (ok, mismatch, error)",
            ["result"],
            registry=r,
        )
        self.m_pause = Histogram(
            "liverl_gateway_swap_pause_seconds",
            "Time a swap kept the engine paused (requests in flight frozen, new ones queued)",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.m_inflight = Gauge("liverl_gateway_inflight_requests", "Requests being generated", registry=r)
        self.m_logged = Counter(
            "liverl_gateway_generations_logged", "Generation records acknowledged by Kafka", registry=r
        )
        self.m_untrainable = Counter(
            "liverl_gateway_untrainable_generations",
            "Generations logged as not trainable, by reason",
            ["reason"],
            registry=r,
        )
        self.m_mixed = Counter(
            "liverl_gateway_mixed_version_generations",
            "Generations a hot-swap split between "
            "versions (spans read: exact), or whose spans could not be read (unknown)",
            ["spans"],
            registry=r,
        )
        self.m_log_fail = Counter(
            "liverl_gateway_generation_log_failures",
            "Generation records Kafka did not take (error), or choices the node never finished",
            registry=r,
        )
        self.m_log_slow = Counter(
            "liverl_gateway_generation_log_slow",
            "Responses sent before Kafka acknowledged the record (bounded wait expired)",
            registry=r,
        )
        self._request_counters: dict[tuple[str, int], Any] = {}
        self.m_agent_errors = Counter(
            "liverl_gateway_agent_errors",
            "Hot-swap agent polls that failed, by exception type (logged; the agent goes on)",
            ["kind"],
            registry=r,
        )
        self.m_feedback = Counter("liverl_gateway_feedback", "POST /v1/feedback by HTTP status", ["status"], registry=r)
        self.feedback_keys = load_feedback_keys(
            cfg
        )  # the product keys /v1/feedback takes (None: feedback over HTTP off)
        if self.feedback_keys is None:
            log.warning(
                "no product key (security.feedback_key): POST /v1/feedback refuses every request; publish "
                "feedback to Kafka, or give the gateway a key file"
            )
        self.app = self._make_app()

    # ------------------------------------------------------------------------------------------ lifecycle

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_post("/v1/feedback", self.feedback)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/liverl/version", self.version_info)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        """Create the generations and feedback topics if needed, start the producer, read the context length."""
        topics = [self.cfg.topics.generations, self.cfg.topics.feedback]
        await asyncio.to_thread(
            ensure_topics,
            self.bootstrap,
            topics,
            self.cfg.broker.partitions,
            broker=self.cfg.broker,
            configs=topic_configs(self.cfg),
        )

        producer = AsyncProducer(
            self.bootstrap,
            client_id=f"liverl-gateway-{self.node_name}",
            delivery_timeout_s=self.cfg.broker.delivery_timeout_s,
            **librdkafka_security(self.cfg.broker),
        )
        await producer.start(topics)
        self.producer = producer
        self.max_model_len = await self.node.max_model_len()

    async def close(self) -> None:
        if self.producer is not None:
            producer, self.producer = self.producer, None
            await producer.close()

    def swap_begin(self) -> int:
        """Called by the agent before it pauses the engine; returns the requests in flight now."""
        self.swap_epoch += 1
        self.swapping = True
        return self.inflight

    def swap_end(self) -> None:
        """Called by the agent once the engine has resumed (or the swap failed)."""
        self.swapping = False

    def set_served(self, version: int, checksum: str) -> None:
        self.version, self.checksum, self.unhealthy_reason = version, checksum, None
        self.m_version.set(version)

    # ------------------------------------------------------------------------------------------ generations

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.path
        try:
            resp = await self._generate(request, route)
        except oa.BadRequest as e:
            resp = _error(e.status, str(e), e.param)
        except TimeoutError as e:
            resp = _error(503, str(e), kind="service_unavailable")
        except NodeUnreachable as e:
            resp = _error(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
        except ClientLeft as e:
            self._count(route, 499)
            return e.resp
        self._count(route, resp.status)
        self.m_seconds.observe(time.perf_counter() - t0)
        return resp

    def _count(self, route: str, status: int) -> None:
        counter = self._request_counters.get((route, status))
        if counter is None:
            counter = self._request_counters[route, status] = self.m_requests.labels(route=route, status=str(status))
        counter.inc()

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        model, add_chunk = ROUTES[route]
        raw_body = await request.read()
        req = model.parse(raw_body)
        unit = fleet.unit_id(fleet.user_key(request.headers, raw_body))  # the user, pseudonymised, for the record
        if self.unhealthy_reason is not None:
            raise oa.BadRequest(f"node not serving: {self.unhealthy_reason}", status=503)
        ids = [f"{self._ids.getrandbits(128):032x}" for _ in range(req.n_choices)]
        node_body = req.node_body()
        node_body["request_id"] = ids[0]  # vLLM's request id: how its per-token version spans are found
        body = to_json(node_body)
        t0 = time.perf_counter()
        swap = _SwapWatch(self)
        version = self.version
        self.inflight += 1
        self.m_inflight.inc()
        try:
            if req.stream:
                return await self._stream(request, req, add_chunk, body, ids, version, t0, unit, swap)
            status, raw = await self.node.post(route, body)
        finally:
            self.inflight -= 1
            self.m_inflight.dec()
        if status != 200:  # vLLM's own validation errors keep their status and message
            return web.Response(body=raw, status=status, content_type="application/json")
        out = from_json(raw)
        choices: dict[int, oa.Choice] = {}
        add_chunk(req, out, choices)
        latency_s = time.perf_counter() - t0
        spans = await swap.spans(req, ids[0]) if swap.crossed() else None
        acks = [
            self._log(req, choices.get(i), ids[i], version, latency_s, unit, spans is not None, (spans or {}).get(i))
            for i in range(req.n_choices)
        ]
        await self._wait_acks(acks)
        if spans is not None:
            version = _first_version(spans.get(0), version)
            for c in out.get("choices") or ():
                if _mixed(spans.get(c["index"])):
                    c["version_spans"] = spans.get(c["index"])
        return web.Response(
            body=to_json(oa.for_client(req, out, ids, version)),
            content_type="application/json",
            headers=self._headers(ids, version),
        )

    async def _stream(
        self,
        request: web.Request,
        req: oa._GenerationRequest,
        add_chunk,
        body: bytes,
        ids: list[str],
        version: int,
        t0: float,
        unit: str | None,
        swap: _SwapWatch,
    ) -> web.StreamResponse:
        """Relay the node's SSE stream chunk by chunk; log each choice when it finishes, ``[DONE]`` after the acks."""
        async with self.node.stream(req.route, body) as r:
            if r.status != 200:
                return web.Response(body=await r.body(), status=r.status, content_type="application/json")
            resp = web.StreamResponse(headers={**SSE_HEADERS, **self._headers(ids, version)})
            await resp.prepare(request)
            choices: dict[int, oa.Choice] = {}
            acks: list[asyncio.Future | None] = []
            try:
                async for data in r.events():
                    if data == b"[DONE]":
                        break
                    chunk = from_json(data)
                    if "choices" in chunk:
                        finished = add_chunk(req, chunk, choices)
                        spans = await swap.spans(req, ids[0]) if finished and swap.crossed() else None
                        for i in finished:
                            acks.append(
                                self._log(
                                    req,
                                    choices[i],
                                    ids[i],
                                    version,
                                    time.perf_counter() - t0,
                                    unit,
                                    spans is not None,
                                    (spans or {}).get(i),
                                )
                            )
                        if spans is not None:
                            for c in chunk["choices"]:
                                if c["index"] in finished and _mixed(spans.get(c["index"])):
                                    c["version_spans"] = spans.get(c["index"])
                        data = to_json(oa.for_client(req, chunk, ids, version))
                    await resp.write(b"data: " + data + b"\n\n")
                self.m_log_fail.inc(req.n_choices - len(acks))  # choices the node never finished (an error came)
                await self._wait_acks(acks)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except NodeUnreachable as e:  # the node's stream broke: tell the client in the stream
                error = oa.error_body(502, f"vLLM node stream broke: {e}", kind="bad_gateway")
                await resp.write(b"data: " + to_json(error) + b"\n\n")
                await resp.write_eof()
            except ConnectionResetError:
                raise ClientLeft(resp) from None
        return resp

    @staticmethod
    def _headers(ids: list[str], version: int) -> dict[str, str]:
        return {"X-Liverl-Generation-Id": ",".join(ids), "X-Liverl-Version": str(version)}

    def _log(
        self,
        req: oa._GenerationRequest,
        choice: oa.Choice | None,
        generation_id: str,
        version: int,
        latency_s: float | None = None,
        unit: str | None = None,
        crossed: bool = False,
        spans: list[list[int]] | None = None,
    ) -> asyncio.Future | None:
        """Publish one generation's record (``unit``: the user's ``fleet.unit_id``; ``crossed``: the request overlapped
        a swap, and ``spans`` are this choice's version spans read from the node, None when they could not be read);
        returns the broker's ack (None when it could not even be queued)."""
        try:
            if choice is None:
                raise ValueError("the node's response has no such choice")
            reason = req.untrainable_reason()
            version_spans = None
            if crossed:
                version_spans = spans
                if version_spans is None:  # not read: no version may claim it, and the learner skips it
                    version_spans, reason = [], reason or "version_unknown"
                    self.m_mixed.labels(spans="unknown").inc()
                elif _mixed(version_spans):
                    self.m_mixed.labels(spans="read").inc()
                    version = version_spans[0][0]
                else:
                    version, version_spans = _first_version(version_spans, version), None
            record = GenerationRecord(
                generation_id=generation_id,
                policy_version=version,
                version_spans=version_spans,
                node=self.node_name,
                prompt=choice.prompt,
                completion="".join(choice.text),
                prompt_token_ids=choice.prompt_token_ids,
                completion_token_ids=choice.token_ids,
                completion_logprobs=choice.logprobs,
                sampling=req.sampling(req.max_tokens_for(self.max_model_len, len(choice.prompt_token_ids))),
                finish_reason=choice.finish_reason,
                trainable=reason is None,
                untrainable_reason=reason,
                latency_s=latency_s,
                unit=unit,
            )
            ack = self.producer.produce(self.cfg.topics.generations, generation_id, record.to_bytes())
        except (ValueError, TypeError, BufferError) as e:  # a malformed node response, or Kafka refused: count, serve
            self.m_log_fail.inc()
            log.error("generation %s not logged: %s", generation_id, e)
            return None
        if reason is not None:
            self.m_untrainable.labels(reason=reason).inc()
        ack.add_done_callback(self._on_ack)
        return ack

    def _on_ack(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.m_log_fail.inc()
            log.error(
                "generation record not acknowledged by Kafka: %s", "cancelled" if fut.cancelled() else fut.exception()
            )
        else:
            self.m_logged.inc()

    async def _wait_acks(self, acks: list[asyncio.Future | None]) -> None:
        if self.log_wait_s > 0:
            self.m_log_slow.inc(await self.producer.wait([a for a in acks if a is not None], self.log_wait_s))

    # ------------------------------------------------------------------------------------------ feedback

    async def feedback(self, request: web.Request) -> web.Response:
        """The feedback topic's JSON over HTTP: 202 once the broker has it, 400 with the reason when invalid; 401
        without a valid product key in ``X-Liverl-Product-Key`` (403 when this gateway has no key at all)."""
        resp = self._refuse_feedback(request.headers.get(PRODUCT_KEY_HEADER))
        if resp is None:
            resp = await self._feedback(await request.read())
        self.m_feedback.labels(status=str(resp.status)).inc()
        return resp

    def _refuse_feedback(self, given: str | None) -> web.Response | None:
        """Feedback trains the model and decides canaries, so only the product may send it: None when ``given`` is
        one of the product keys (constant-time comparison), else the refusal."""
        if self.feedback_keys is None:
            return _error(
                403,
                "feedback over HTTP is off on this gateway: it has no product key "
                "(security.feedback_key); publish feedback to Kafka instead",
                kind="permission_error",
            )
        if not given:
            return _error(
                401,
                f"POST /v1/feedback needs the product key in the {PRODUCT_KEY_HEADER} header "
                "(the file security.feedback_key; liverl up makes <state_dir>/keys/feedback.key)",
                kind="authentication_error",
            )
        raw = given.encode("utf-8", "surrogateescape")
        if not any([hmac.compare_digest(raw, k) for k in self.feedback_keys]):  # a list: every key compared
            return _error(
                401,
                f"the {PRODUCT_KEY_HEADER} header does not hold a valid product key (security.feedback_key)",
                kind="authentication_error",
            )
        return None

    async def _feedback(self, raw: bytes) -> web.Response:
        try:
            event = FeedbackEvent.from_bytes(raw)
        except WireError as e:
            param = e.detail.split(":", 1)[0] if e.reason == "invalid_field" and ":" in e.detail else None
            return _error(400, str(e), param if param != "<root>" else None)
        if self.producer is None:
            return _error(503, "the gateway is not connected to Kafka", kind="service_unavailable")
        try:
            ack = self.producer.produce(self.cfg.topics.feedback, event.generation_id, event.to_bytes())
        except BufferError as e:
            ack = None
            problem = str(e)
        else:
            late = await self.producer.wait([ack], self.feedback_wait_s)
            problem = f"no ack within {self.feedback_wait_s:g} s" if late else ack.exception()
        if problem:
            return _error(
                503,
                f"Kafka did not take the feedback ({problem}); retry with the same feedback_id",
                kind="service_unavailable",
            )
        return web.json_response(
            {"feedback_id": event.feedback_id, "generation_id": event.generation_id, "topic": self.cfg.topics.feedback},
            status=202,
        )

    # ------------------------------------------------------------------------------------------ the rest

    async def models(self, request: web.Request) -> web.Response:
        try:
            status, out = await self.node.request("GET", "/v1/models")
        except aiohttp.ClientError as e:
            return _error(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
        return web.json_response(out, status=status)

    async def version_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": self.version,
                "checksum": self.checksum,
                "node": self.node_name,
                "swapping": self.swapping,
                "last_swap_pause_ms": self.last_swap_pause_ms,
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.unhealthy_reason is None and self.producer is not None
        return web.json_response(
            {"ok": ok, "reason": self.unhealthy_reason, "version": self.version, "node": self.node_name},
            status=200 if ok else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics_registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
