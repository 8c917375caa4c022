"""The router's choices on the gateway's records: each choice's routing read from the worker, by its engine id.

With ``serving.record_routing`` the gateway starts the worker's capture (``liverl_routing_start``,
``serving.node.worker.routing``) once the engine is up, and once a choice has finished asks the worker for its
routing (``liverl_routing``, one engine RPC per response, or per finishing chunk of a stream) and puts it on the
choice's ``GenerationRecord.routed_experts``. Which engine request computed which choice is vLLM's naming, with the
``request_id`` the gateway put in the body (``rid``):

- ``/v1/completions``: prompt ``p`` is the engine request ``cmpl-<rid>-<p>`` (``OpenAIServingCompletion``), and
  choice ``i`` is prompt ``i // n``'s;
- ``/v1/chat/completions``: ``chatcmpl-<rid>``;
- with ``n > 1`` each choice ``j`` of a prompt is a child request ``<j>_<that>`` (``ParentRequest.get_child_info``);

and the engine appends ``-<8 random characters>`` to each (``InputProcessor.assign_request_id``), which the worker
strips. Every choice's sequence is its own engine request (prefix caching is off: no prompt is shared), so each
blob covers exactly its own prompt and completion but the last token. A choice whose routing the worker does not
hold whole is logged without routing and counted (``liverl_gateway_routing{routing="missing"}``): the learner trains
it on its own routing.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import logging

from serving.node import openai_api as oa

log = logging.getLogger("liverl.serving.gateway")


def choice_key(req: oa._GenerationRequest, rid: str, index: int) -> str:
    """The engine id, less its random suffix, of the request that computed choice ``index``."""
    if isinstance(req, oa.CompletionRequest):
        base = f"cmpl-{rid}-{index // req.n}"
    else:
        base = f"chatcmpl-{rid}"
    return f"{index % req.n}_{base}" if req.n > 1 else base


def positions(choice: oa.Choice) -> int:
    """The positions a choice's routing covers: its prompt and completion but the last token."""
    return len(choice.prompt_token_ids) + len(choice.token_ids) - 1


class RoutingReader:
    """Reads finished choices' routing from the node's worker (``node.rpc``), counting what it could not read."""

    def __init__(self, node, metrics):
        self.node, self.metrics = node, metrics
        self.on = False  # the worker captures (the model has MoE layers)

    async def start(self) -> None:
        """Start the worker's capture. A dense model leaves it off (logged); any other refusal raises."""
        got = await self.node.rpc("liverl_routing_start")
        if not got.get("ok"):
            err = str(got.get("error"))
            if "no MoE layer" in err:
                log.warning("serving.record_routing is ignored: the served model has no MoE layer (%s)", err)
                return
            raise RuntimeError(f"serving.record_routing: the worker did not start its routing capture: {err}")
        self.on = True
        log.info(
            "routing capture on: %d MoE layers, %s experts, top-%s",
            len(got.get("layers") or ()),
            got.get("experts"),
            got.get("top_k"),
        )

    async def read(self, req: oa._GenerationRequest, rid: str, choices: dict[int, oa.Choice], indices) -> dict:
        """Choice index -> base64 routing for the finished choices ``indices``; a choice not held whole is absent."""
        if not self.on:
            return {}
        indices = [i for i in indices if i in choices]
        keys = [choice_key(req, rid, i) for i in indices]
        try:
            got = await self.node.rpc("liverl_routing", keys, [positions(choices[i]) for i in indices])
        except Exception as e:  # noqa: BLE001 the engine RPC boundary: counted, the records go without routing
            got = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if not got.get("ok"):
            log.error("cannot read the routing of request %s: %s", rid, got.get("error"))
            got = {"routing": {}}
        out = {}
        for i, key in zip(indices, keys, strict=True):
            blob = got["routing"].get(key)
            self.metrics.m_routing.labels(routing="missing" if blob is None else "recorded").inc()
            if blob is not None:
                out[i] = blob
        return out
