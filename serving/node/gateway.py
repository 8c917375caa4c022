"""The product's front door: an OpenAI-compatible gateway that logs every generation with its exact policy version.

It runs inside the vLLM node's API-server process (``serving.node.gateway_host`` starts it there, with a node client
that calls vLLM's route in memory); with an HTTP ``serving.node.client.NodeClient`` it runs anywhere (the unit tests).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain or streamed, any ``n``; the chat template
is the model's, applied by the node, so a record's prompt token ids are exactly what the model read),
``GET /v1/models``, and ``POST /v1/feedback`` (the feedback JSON of the topic, for backends that cannot speak
Kafka; it takes the product key, ``security.feedback_key``, in the ``X-Liverl-Product-Key`` header;
``serving.node.feedback``). Request validation and response shaping are in ``serving.node.openai_api``, the records'
publishing in ``serving.node.generation_log``, the Prometheus metrics in ``serving.node.gateway_metrics``.

Each choice of a response is one generation: it gets a ``generation_id``, and a ``GenerationRecord`` (prompt and
completion token ids, the sampled tokens' log-probs, the sampling parameters, trainable or why not) is queued for
the generations topic, keyed by generation id, and the response waits for the broker's ack (at most
``serving.log_wait_s``, 2 s by default; an expired wait is counted), so a crash cannot leave a client holding the id
of a record that was never logged; a record Kafka refuses is counted and logged. ``POST /v1/feedback`` always answers
after the broker's ack. The client finds the ids and the version in the body (``liverl`` and each choice's
``generation_id``), in every chunk of a stream, and in the ``X-Liverl-Generation-Id`` (comma-separated, in choice order)
and ``X-Liverl-Version`` headers. For a user it can forget (the request names its user and the node seals), each
choice also gets an edit key (``liverl_sdk.edits``), in ``X-Liverl-Edit-Key`` (in choice order) and in the body beside
the ids (``edit_key``): the product seals that user's edit under it, and the key lives on only in the sealed record.

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
import logging
import os
import random
import time

import aiohttp
from aiohttp import web
from pydantic_core import from_json, to_json

from core import fleet
from core.bus import ensure_topics, librdkafka_security, topic_configs
from core.config import LiverlConfig
from core.probes import DRAINING_HEADER
from liverl_sdk.edits import EDIT_KEY_HEADER, new_edit_key
from serving.node import openai_api as oa
from serving.node.client import NodeClient, NodeUnreachable
from serving.node.feedback import FeedbackRoute
from serving.node.gateway_metrics import GatewayMetrics
from serving.node.gateway_routing import RoutingReader
from serving.node.generation_log import GenerationLog, first_version, mixed, record_hold_s
from serving.node.producer import AsyncProducer

log = logging.getLogger("liverl.serving.gateway")

KEY_RETRY_DOWN_S = 5.0
"""While the registry's database does not answer, a user's key is asked for again after this (off the event loop;
each try waits at most the connection timeout)."""
HELD_CLOSE_S = 10.0
"""At shutdown, records held for their users' keys are waited for this long."""
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
        self.swap_epoch = 0  # swaps begun; a request that sees it change may span two versions
        self.swapping = False  # between swap_begin and swap_end (the engine is, or is about to be, paused)
        self.inflight = 0  # generation requests at the node (what a swap freezes)
        self.active = 0  # generation requests anywhere in their handler (what a drain waits for)
        self.draining = False  # the serving process is stopping: no new generation is admitted (``/readyz`` 503)
        self.version: int | None = None
        self.checksum: str | None = None
        self.unhealthy_reason: str | None = "not initialised"
        self.last_swap_pause_ms: float | None = None
        self.max_model_len = 0
        self.producer = None
        self._ids = random.Random(os.urandom(32))  # generation ids: 128 random bits, no syscall per id
        self.metrics = GatewayMetrics()
        self.records: GenerationLog | None = None  # the generation log, once the producer has started
        self.user_keys = None  # core.shred.UserKeys, once started with a key-encryption key
        self.routing = RoutingReader(node, self.metrics)  # serving.record_routing: the choices' routing
        self.feedback_route = FeedbackRoute(cfg, lambda: self.producer, self.metrics.m_feedback, feedback_wait_s)
        self.app = self._make_app()

    # ------------------------------------------------------------------------------------------ lifecycle

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_post("/v1/feedback", self.feedback_route.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/liverl/version", self.version_info)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_text)
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
        if self.cfg.serving.record_routing:
            await self.routing.start()
        self.records = GenerationLog(
            producer,
            self.cfg.topics.generations,
            self.node_name,
            self.max_model_len,
            self.metrics,
            self.log_wait_s,
            max_bytes=self.cfg.ingest.max_event_bytes,
            keys=self._key_cache(),
            hold_s=record_hold_s(self.cfg),
            hold_max=self.cfg.serving.log_hold_max,
        )

    def _key_cache(self):
        """The users' data keys (``core.shred``), when the node has the key-encryption key; None (logged) else."""
        from core.shred import KeyCache, UserKeys, load_kek  # noqa: PLC0415 (cryptography, sqlalchemy: at start)

        kek = load_kek(self.cfg)
        if kek is None:
            log.warning(
                "no key-encryption key (security.shred_key): users' text is logged unsealed, and a user cannot be "
                "forgotten from the topics"
            )
            return None
        self.user_keys = UserKeys(self.cfg.registry_url, kek)
        return KeyCache(self.user_keys, retry_s=KEY_RETRY_DOWN_S)

    async def close(self) -> None:
        if self.producer is not None:
            producer, records, self.producer, self.records = self.producer, self.records, None, None
            if records is not None:
                await records.close(HELD_CLOSE_S)
            await producer.close()
        if self.user_keys is not None:
            self.user_keys.close()
            self.user_keys = None

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
        self.metrics.m_version.set(version)

    # ------------------------------------------------------------------------------------------ generations

    async def generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.path
        if self.draining:  # refused before anything is read: a router sends it to its next node
            self.metrics.count(route, 503)
            resp = oa.error_response(503, "node draining: it is stopping", kind="service_unavailable")
            resp.headers[DRAINING_HEADER] = "1"
            return resp
        self.active += 1
        try:
            resp = await self._generate(request, route)
        except oa.BadRequest as e:
            resp = oa.error_response(e.status, str(e), e.param)
        except TimeoutError as e:
            resp = oa.error_response(503, str(e), kind="service_unavailable")
        except NodeUnreachable as e:
            resp = oa.error_response(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
        except ClientLeft as e:
            self.metrics.count(route, 499)
            return e.resp
        finally:
            self.active -= 1
        self.metrics.count(route, resp.status)
        self.metrics.m_seconds.observe(time.perf_counter() - t0)
        return resp

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        model, add_chunk = ROUTES[route]
        raw_body = await request.read()
        req = model.parse(raw_body)
        unit = fleet.unit_id(fleet.user_key(request.headers, raw_body))  # the user, pseudonymised, for the record
        if self.unhealthy_reason is not None:
            raise oa.BadRequest(f"node not serving: {self.unhealthy_reason}", status=503)
        ids = [f"{self._ids.getrandbits(128):032x}" for _ in range(req.n_choices)]
        # a user it can forget: each choice's edit is sealed under a key of its own, kept in the sealed record
        edit_keys = [new_edit_key() for _ in ids] if unit is not None and self.records.keys is not None else None
        node_body = req.node_body()
        node_body["request_id"] = ids[0]  # vLLM's request id: how its per-token version spans are found
        body = to_json(node_body)
        t0 = time.perf_counter()
        swap = _SwapWatch(self)
        version = self.version
        self.inflight += 1
        self.metrics.m_inflight.inc()
        try:
            if req.stream:
                return await self._stream(request, req, add_chunk, body, ids, edit_keys, version, t0, unit, swap)
            status, raw = await self.node.post(route, body)
        finally:
            self.inflight -= 1
            self.metrics.m_inflight.dec()
        if status != 200:  # vLLM's own validation errors keep their status and message
            return web.Response(body=raw, status=status, content_type="application/json")
        out = from_json(raw)
        choices: dict[int, oa.Choice] = {}
        add_chunk(req, out, choices)
        latency_s = time.perf_counter() - t0
        spans = await swap.spans(req, ids[0]) if swap.crossed() else None
        routes = await self.routing.read(req, ids[0], choices, range(req.n_choices))
        acks = [
            self.records.log(
                req,
                choices.get(i),
                ids[i],
                version,
                latency_s,
                unit,
                spans is not None,
                (spans or {}).get(i),
                routes.get(i),
                edit_keys[i] if edit_keys else None,
            )
            for i in range(req.n_choices)
        ]
        await self.records.wait_acks(acks)
        if spans is not None:
            version = first_version(spans.get(0), version)
            for c in out.get("choices") or ():
                if mixed(spans.get(c["index"])):
                    c["version_spans"] = spans.get(c["index"])
        return web.Response(
            body=to_json(oa.for_client(req, out, ids, version, edit_keys)),
            content_type="application/json",
            headers=self._headers(ids, version, edit_keys),
        )

    async def _stream(
        self,
        request: web.Request,
        req: oa._GenerationRequest,
        add_chunk,
        body: bytes,
        ids: list[str],
        edit_keys: list[str] | None,
        version: int,
        t0: float,
        unit: str | None,
        swap: _SwapWatch,
    ) -> web.StreamResponse:
        """Relay the node's SSE stream chunk by chunk; log each choice when it finishes, ``[DONE]`` after the acks."""
        async with self.node.stream(req.route, body) as r:
            if r.status != 200:
                return web.Response(body=await r.body(), status=r.status, content_type="application/json")
            resp = web.StreamResponse(headers={**SSE_HEADERS, **self._headers(ids, version, edit_keys)})
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
                        routes = await self.routing.read(req, ids[0], choices, finished) if finished else {}
                        for i in finished:
                            acks.append(
                                self.records.log(
                                    req,
                                    choices[i],
                                    ids[i],
                                    version,
                                    time.perf_counter() - t0,
                                    unit,
                                    spans is not None,
                                    (spans or {}).get(i),
                                    routes.get(i),
                                    edit_keys[i] if edit_keys else None,
                                )
                            )
                        if spans is not None:
                            for c in chunk["choices"]:
                                if c["index"] in finished and mixed(spans.get(c["index"])):
                                    c["version_spans"] = spans.get(c["index"])
                        data = to_json(oa.for_client(req, chunk, ids, version, edit_keys))
                    await resp.write(b"data: " + data + b"\n\n")
                self.metrics.m_log_fail.inc(
                    req.n_choices - len(acks)
                )  # choices the node never finished (an error came)
                await self.records.wait_acks(acks)
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
    def _headers(ids: list[str], version: int, edit_keys: list[str] | None) -> dict[str, str]:
        headers = {"X-Liverl-Generation-Id": ",".join(ids), "X-Liverl-Version": str(version)}
        if edit_keys:
            headers[EDIT_KEY_HEADER] = ",".join(edit_keys)
        return headers

    # ------------------------------------------------------------------------------------------ the rest

    async def models(self, request: web.Request) -> web.Response:
        try:
            status, out = await self.node.request("GET", "/v1/models")
        except aiohttp.ClientError as e:
            return oa.error_response(502, f"vLLM node unreachable: {e}", kind="bad_gateway")
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

    def not_ready(self) -> str | None:
        """Why a completion sent now would not get 200, or None: it would (``/readyz``)."""
        if self.draining:
            return "draining: the node is stopping"
        if self.producer is None or self.records is None:
            return "the generation log's producer is not started"
        if self.unhealthy_reason is not None:
            return self.unhealthy_reason
        if self.version is None:
            return "no verified version served yet"
        return None

    async def livez(self, request: web.Request) -> web.Response:
        """200 whenever it answers: the node's API-server event loop (the gateway's and vLLM's) is not wedged."""
        return web.json_response({"ok": True, "node": self.node_name})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 only while a completion sent now would be served: the engine is loaded (the gateway starts after it),
        the generation log's producer runs, the agent has verified the version served, and the node is not
        draining; else 503 with the reason."""
        reason = self.not_ready()
        return web.json_response(
            {"ready": reason is None, "reason": reason, "version": self.version, "node": self.node_name},
            status=200 if reason is None else 503,
        )

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.unhealthy_reason is None and self.producer is not None
        return web.json_response(
            {"ok": ok, "reason": self.unhealthy_reason, "version": self.version, "node": self.node_name},
            status=200 if ok else 503,
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": self.metrics.content_type})
