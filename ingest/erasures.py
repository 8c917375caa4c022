"""The product's erasure requests over HTTP, on ingest's web server: ``POST /v1/erasures`` and ``GET
/v1/erasures/{id}``.

Forgetting a user is the product's to ask, so the routes take the product key, as ``POST /v1/feedback`` does
(``security.feedback_key``, in the ``X-Liverl-Product-Key`` header, compared in constant time): 401 without a valid
one, 403 when this worker has no key file at all. A request only records the erasure (a row in the registry's
``erasures`` table, state ``pending``, ``core.erasures``) and answers 202 with its id; the erasure itself runs where
the rights to do it are: the gate's loop (``forget.run_in_gate``) or an operator's ``liverl forget --resume``
(``liverl.ops.forget``). ``GET`` returns the row as it stands: its state, and its report once steps have run.

The body is ``{"user": USER_KEY, "reason": TEXT}``: the user key the product sends with completions (X-Liverl-User or
the OpenAI ``user`` field). Only its unit id (``core.fleet.unit_id``) is stored. The database calls run on a thread,
so the join's event loop never waits for them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

import sqlalchemy as sa
from aiohttp import web

from core import erasures, fleet
from core.config import LiverlConfig
from core.credentials import PRODUCT_KEY_HEADER, load_feedback_keys

log = logging.getLogger("liverl.ingest")

MAX_BODY = 16 * 1024
MAX_USER, MAX_REASON = 512, 2000


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


class ErasureRoutes:
    """The two routes over the registry's database at ``cfg.registry_url`` (its engine made at the first request)."""

    def __init__(self, cfg: LiverlConfig):
        self.url = cfg.registry_url
        self.keys = load_feedback_keys(cfg)
        self._engine: sa.Engine | None = None
        if self.keys is None:
            log.warning("no product key (security.feedback_key): POST /v1/erasures refuses every request")

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/erasures", self.post)
        app.router.add_get("/v1/erasures/{id}", self.get)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()

    def _db(self) -> sa.Engine:
        if self._engine is None:
            from deploy.registry.tables import make_engine  # noqa: PLC0415 torch-free; only with a request to serve

            self._engine = make_engine(self.url)
        return self._engine

    def _refuse(self, request: web.Request) -> web.Response | None:
        if self.keys is None:
            return _error(
                403,
                "erasures over HTTP are off on this ingest worker: it has no product key (security.feedback_key)",
                "permission_error",
            )
        given = request.headers.get(PRODUCT_KEY_HEADER)
        if not given:
            return _error(401, f"/v1/erasures needs the product key in the {PRODUCT_KEY_HEADER} header", "auth_error")
        raw = given.encode("utf-8", "surrogateescape")
        if not any([hmac.compare_digest(raw, k) for k in self.keys]):  # a list: every key compared
            return _error(401, f"the {PRODUCT_KEY_HEADER} header does not hold a valid product key", "auth_error")
        return None

    async def post(self, request: web.Request) -> web.Response:
        """Record an erasure of the body's ``user``: 202 with its id, 400 for a bad body."""
        if (refused := self._refuse(request)) is not None:
            return refused
        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            return _error(413, f"the body is over {MAX_BODY} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, 'the body is JSON: {"user": "<user key>", "reason": "<why>"}', "invalid_request_error")
        user, reason = (body.get("user"), body.get("reason")) if isinstance(body, dict) else (None, None)
        if not isinstance(user, str) or not 0 < len(user) <= MAX_USER:
            return _error(
                400, f"user: the user key the product sends (1 to {MAX_USER} characters)", "invalid_request_error"
            )
        if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
            return _error(
                400, f"reason: why the user is forgotten (1 to {MAX_REASON} characters)", "invalid_request_error"
            )
        unit = fleet.unit_id(user)
        assert unit is not None

        def record() -> erasures.Erasure:
            with self._db().begin() as c:
                return erasures.insert(c, unit, "product", reason.strip(), "api")

        try:
            e = await asyncio.to_thread(record)
        except sa.exc.SQLAlchemyError as err:
            log.error("erasure request not recorded: %s", err)
            return _error(503, "the registry's database did not take the request; retry", "service_unavailable")
        log.info("erasure %s of user unit %s requested by the product", e.id, unit)
        return web.json_response({"id": e.id, "state": e.state, "status_url": f"/v1/erasures/{e.id}"}, status=202)

    async def get(self, request: web.Request) -> web.Response:
        """The erasure's row: 200 with its state and report, 404 for an unknown id."""
        if (refused := self._refuse(request)) is not None:
            return refused
        eid = request.match_info["id"]
        if not erasures.valid_id(eid):
            return _error(404, f"no erasure {eid!r}", "not_found_error")

        def read() -> erasures.Erasure | None:
            with self._db().connect() as c:
                return erasures.get(c, eid)

        try:
            e = await asyncio.to_thread(read)
        except sa.exc.SQLAlchemyError as err:
            log.error("erasure %s not read: %s", eid, err)
            return _error(503, "the registry's database did not answer; retry", "service_unavailable")
        if e is None:
            return _error(404, f"no erasure {eid!r}", "not_found_error")
        return web.json_response(e.as_dict())
