"""The gateway's ``POST /v1/feedback``: the feedback topic's JSON over HTTP, for backends that cannot speak Kafka.

Feedback trains the model and decides canaries, so only the product may send it: the request carries the product key
(``security.feedback_key``) in the ``X-Liverl-Product-Key`` header, compared in constant time. A valid event is
published to the feedback topic, keyed by generation id, and answered 202 only after the broker's ack. An edit posted
with its generation's ``edit_key`` is sealed under it here (``liverl_sdk.edits``) before it is published.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import Counter

from core.config import LiverlConfig
from core.credentials import PRODUCT_KEY_HEADER, load_feedback_keys
from core.schemas import FeedbackEvent, WireError
from liverl_sdk.edits import EditSealError, seal_edit
from liverl_sdk.wire import EDIT_MAX_CHARS
from serving.node.openai_api import error_response
from serving.node.producer import AsyncProducer

log = logging.getLogger("liverl.serving.gateway")


def seal_posted_edit(raw: bytes) -> bytes:
    """An event posted with ``edit_key`` (the generation's, as the gateway returned it): its ``edited_text`` sealed
    under that key into ``edited_sealed`` (``liverl_sdk.edits``), and the key dropped, so the topic never holds the
    text in the clear. Anything else is returned for ``FeedbackEvent`` to judge; ``EditSealError`` for a bad key."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict) or "edit_key" not in body:
        return raw
    key, text, gid = body.pop("edit_key"), body.get("edited_text"), body.get("generation_id")
    if key is not None and isinstance(text, str) and isinstance(gid, str) and len(text) <= EDIT_MAX_CHARS:
        body["edited_sealed"] = seal_edit(key, gid, body.pop("edited_text"))
    return json.dumps(body).encode()


class FeedbackRoute:
    """``handle`` is the route; ``producer()`` is the gateway's Kafka producer (None until it has started)."""

    def __init__(
        self, cfg: LiverlConfig, producer: Callable[[], AsyncProducer | None], counter: Counter, wait_s: float = 10.0
    ):
        self.topic = cfg.topics.feedback
        self.producer = producer
        self.counter = counter  # liverl_gateway_feedback, by HTTP status
        self.wait_s = wait_s
        self.keys = load_feedback_keys(cfg)  # the product keys the route takes (None: feedback over HTTP off)
        if self.keys is None:
            log.warning(
                "no product key (security.feedback_key): POST /v1/feedback refuses every request; publish "
                "feedback to Kafka, or give the gateway a key file"
            )

    async def handle(self, request: web.Request) -> web.Response:
        """The feedback topic's JSON over HTTP: 202 once the broker has it, 400 with the reason when invalid; 401
        without a valid product key in ``X-Liverl-Product-Key`` (403 when this gateway has no key at all)."""
        resp = self._refuse_feedback(request.headers.get(PRODUCT_KEY_HEADER))
        if resp is None:
            resp = await self._feedback(await request.read())
        self.counter.labels(status=str(resp.status)).inc()
        return resp

    def _refuse_feedback(self, given: str | None) -> web.Response | None:
        """Feedback trains the model and decides canaries, so only the product may send it: None when ``given`` is
        one of the product keys (constant-time comparison), else the refusal."""
        if self.keys is None:
            return error_response(
                403,
                "feedback over HTTP is off on this gateway: it has no product key "
                "(security.feedback_key); publish feedback to Kafka instead",
                kind="permission_error",
            )
        if not given:
            return error_response(
                401,
                f"POST /v1/feedback needs the product key in the {PRODUCT_KEY_HEADER} header "
                "(the file security.feedback_key; liverl up makes <state_dir>/keys/feedback.key)",
                kind="authentication_error",
            )
        raw = given.encode("utf-8", "surrogateescape")
        if not any([hmac.compare_digest(raw, k) for k in self.keys]):  # a list: every key compared
            return error_response(
                401,
                f"the {PRODUCT_KEY_HEADER} header does not hold a valid product key (security.feedback_key)",
                kind="authentication_error",
            )
        return None

    async def _feedback(self, raw: bytes) -> web.Response:
        try:
            event = FeedbackEvent.from_bytes(seal_posted_edit(raw) if b'"edit_key"' in raw else raw)
        except EditSealError as e:
            return error_response(400, f"edit_key: {e}", "edit_key")
        except WireError as e:
            param = e.detail.split(":", 1)[0] if e.reason == "invalid_field" and ":" in e.detail else None
            return error_response(400, str(e), param if param != "<root>" else None)
        producer = self.producer()
        if producer is None:
            return error_response(503, "the gateway is not connected to Kafka", kind="service_unavailable")
        try:
            ack = producer.produce(self.topic, event.generation_id, event.to_bytes())
        except BufferError as e:
            ack = None
            problem = str(e)
        else:
            late = await producer.wait([ack], self.wait_s)
            problem = f"no ack within {self.wait_s:g} s" if late else ack.exception()
        if problem:
            return error_response(
                503,
                f"Kafka did not take the feedback ({problem}); retry with the same feedback_id",
                kind="service_unavailable",
            )
        return web.json_response(
            {"feedback_id": event.feedback_id, "generation_id": event.generation_id, "topic": self.topic},
            status=202,
        )
