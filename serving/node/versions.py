"""Which policy version sampled which token: vLLM's own per-token weight-version spans, read in the node's process.

A hot-swap does not drain: the agent freezes the engine at a scheduler step (``/pause?mode=keep``), writes the
changed weights, labels them (``/update_weight_version``) and resumes. A request in flight across that swap has its
first tokens from the old version and the rest from the new one. vLLM 0.32 records exactly that: each engine step's
outputs carry the engine's weight-version label, and a finished ``CompletionOutput`` has ``weight_versions``, the
``[start, end)`` output-token spans each label sampled. Its OpenAI routes drop them, so this module, an ASGI
middleware loaded with ``--middleware`` (a supported extension point; nothing in vLLM is changed), keeps them:

- On the first request it wraps ``app.state.engine_client.generate`` of this app's engine client (the object, not
  the class) so that every finished choice's spans are remembered under the engine request id
  (``cmpl-<rid>-<p>`` for prompt ``p`` of a completions request, ``chatcmpl-<rid>`` for a chat request, ``rid``
  being the ``request_id`` the gateway put in the body), the newest ``MAX_KEPT`` requests only.
- ``GET /liverl/spans?rid=<rid>&prompts=<P>`` answers ``{"requests": {"<engine id>": {"<choice>": [[version, start,
  end], ...]}}}`` for the ids it still holds. The gateway asks only for requests that overlapped a swap.

It sits inside ``serving.node.auth.NodeKeyMiddleware`` (listed first on the command line), so the route needs the
node key like every other. This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import collections
import logging
import urllib.parse

from serving.node.auth import reply_json

log = logging.getLogger("liverl.serving.node_versions")

SPANS_PATH = "/liverl/spans"
MAX_KEPT = 65536  # finished requests remembered (a few hundred bytes each); the gateway asks within seconds


class SpanRecorder:
    """Wraps one engine client's ``generate``; holds the spans of the last ``max_kept`` finished requests."""

    def __init__(self, engine_client, max_kept: int = MAX_KEPT):
        self.spans: collections.OrderedDict[str, dict[str, list[list]]] = collections.OrderedDict()
        self.max_kept = max_kept
        inner = engine_client.generate

        async def generate(*args, **kwargs):
            request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
            gen = inner(*args, **kwargs)
            try:
                async for out in gen:
                    for o in out.outputs:
                        if o.weight_versions:
                            self._keep(str(request_id), o.index, o.weight_versions)
                    yield out
            finally:
                await gen.aclose()  # a client that left: vLLM's generator aborts the request

        engine_client.generate = generate  # this instance only

    def _keep(self, request_id: str, index: int, spans) -> None:
        entry = self.spans.get(request_id)
        if entry is None:
            entry = self.spans[request_id] = {}
            while len(self.spans) > self.max_kept:
                self.spans.popitem(last=False)
        entry[str(index)] = [[s.version, s.start, s.end] for s in spans]

    def lookup(self, rid: str, prompts: int) -> dict[str, dict[str, list[list]]]:
        names = [f"chatcmpl-{rid}", f"cmpl-{rid}"] + [f"cmpl-{rid}-{p}" for p in range(prompts)]
        return {n: self.spans[n] for n in names if n in self.spans}


class VersionSpansMiddleware:
    """Pure ASGI: installs the ``SpanRecorder`` on first use and answers ``GET /liverl/spans``."""

    def __init__(self, app):
        self.app = app
        self.recorder: SpanRecorder | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.recorder is None:
            engine = getattr(scope["app"].state, "engine_client", None)
            if engine is not None:
                self.recorder = SpanRecorder(engine)
        if scope.get("path") != SPANS_PATH:
            return await self.app(scope, receive, send)
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        rid = (query.get("rid") or [""])[0]
        try:
            prompts = int((query.get("prompts") or ["1"])[0])
        except ValueError:
            prompts = -1
        if not rid or not 1 <= prompts <= 64 or self.recorder is None:
            status, body = 400, {"error": "GET /liverl/spans needs rid=<request_id> and prompts=1..64"}
        else:
            status, body = 200, {"requests": self.recorder.lookup(rid, prompts)}
        await reply_json(send, status, body)
