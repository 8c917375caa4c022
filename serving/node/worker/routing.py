"""The router's choices, captured inside the vLLM worker: which experts each position of each request went to.

vLLM 0.32's own ``--enable-return-routed-experts`` runs only with its V2 model runner, which the CPU build cannot run
(``docs/serving.md``, "Recording the router's choices"). The hook it uses is there on every runner: a MoE layer's
router (``BaseRouter``; on CPU ``CPURouter``) calls ``capture_fn(topk_ids)`` with the logical expert ids of the
step's tokens once ``set_capture_fn`` set it, inside vLLM's ``moe_forward`` op, at every step. ``RoutingCapture``
binds one per MoE layer and maps every row of a step to its request and position:

- it wraps the model runner's ``execute_model`` (this instance's) to know the step's ``SchedulerOutput``;
- at the first MoE layer of a forward it reads the layout ``GPUModelRunner._prepare_inputs`` gave the step: the
  requests of ``input_batch.req_ids`` in order, ``num_scheduled_tokens[req_id]`` tokens each, from position
  ``input_batch.num_computed_tokens_cpu[i]``;
- after the forward it appends each request's rows at their positions; a request recomputed from an earlier
  position (preempted) is cut back there first; one whose positions do not follow what it holds (a prefix-cache hit
  skipped them) is marked incomplete, and its routing is never handed out.

Requirements, checked at ``start``: no speculative decoding (rejected draft tokens would leave rows), and prefix
caching off (a cached prompt block is never recomputed: its positions would have no routing). Profile and dummy runs
(no step) are ignored. The newest ``max_requests`` requests are kept; ``take`` hands a finished request's routing out
as a ``core.routing`` blob (MoE layers in layer order, the positions it computed: prompt and completion but the
last token) and forgets it; the gateway asks for each choice's when it has its response
(``serving.node.gateway_routing``).
"""

from __future__ import annotations

import collections
import functools
import logging

import numpy as np

from core import routing

log = logging.getLogger("liverl.serving.worker_routing")


class _Request:
    __slots__ = ("complete", "rows")

    def __init__(self):
        self.rows: list[np.ndarray] = []  # [positions, layers, top_k] chunks, in position order
        self.complete = True

    def length(self) -> int:
        return sum(len(r) for r in self.rows)

    def put(self, start: int, rows: np.ndarray) -> None:
        n = self.length()
        if start < n:  # recomputed from an earlier position (a preemption): the newer rows replace the older
            kept, at = [], 0
            for r in self.rows:
                if at + len(r) <= start:
                    kept.append(r)
                elif at < start:
                    kept.append(r[: start - at])
                at += len(r)
            self.rows = kept
        elif start > n:  # positions never computed here (a prefix-cache hit): no routing for them
            self.complete = False
        self.rows.append(rows)


class RoutingCapture:
    """Captures the routing of every request the worker's model runner computes (see the module docstring)."""

    def __init__(self, runner, max_requests: int = 4096):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter  # noqa: PLC0415 the worker's
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: PLC0415 the worker's

        cfg = runner.vllm_config
        if cfg.speculative_config is not None:
            raise ValueError("routing capture: speculative decoding is on (rejected draft tokens would leave rows)")
        if cfg.cache_config.enable_prefix_caching:
            raise ValueError(
                "routing capture needs prefix caching off (--no-enable-prefix-caching): a cached prompt block is never "
                "recomputed, so its positions would have no routing"
            )
        found = {}
        for m in runner.get_model().modules():
            if isinstance(m, MoERunner):
                if not isinstance(m.router, BaseRouter):
                    raise ValueError(f"routing capture: router {type(m.router).__name__} has no capture hook")
                found[m.layer_id] = m.router
        if not found:
            raise ValueError("routing capture: the model has no MoE layer")
        self.layer_ids = sorted(found)
        routers = [found[i] for i in self.layer_ids]
        self.top_k = int(routers[0].top_k)
        self.n_experts = int(routers[0].global_num_experts)
        self.runner = runner
        self.max_requests = max_requests
        self.kept: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self._step = None  # the SchedulerOutput of the step running
        self._layout: list[tuple[str, int, int]] | None = None  # (request, first position, tokens) in row order
        self._rows: np.ndarray | None = None  # the step's [tokens, layers, top_k]
        for ordinal, r in enumerate(routers):
            r.set_capture_fn(functools.partial(self._capture, ordinal))
        inner = runner.execute_model

        @functools.wraps(inner)
        def execute_model(scheduler_output, *args, **kwargs):
            self._step, self._layout, self._rows = scheduler_output, None, None
            try:
                return inner(scheduler_output, *args, **kwargs)
            finally:
                self._keep()
                self._step, self._layout, self._rows = None, None, None

        runner.execute_model = execute_model  # this instance only
        log.info(
            "liverl routing capture on: MoE layers %s, %d experts, top-%d", self.layer_ids, self.n_experts, self.top_k
        )

    def _capture(self, ordinal: int, topk_ids) -> None:
        so = self._step
        if so is None:  # a profile or dummy run
            return
        n = int(so.total_num_scheduled_tokens)
        if self._layout is None:
            ib = self.runner.input_batch
            layout, total = [], 0
            for i, rid in enumerate(ib.req_ids):
                k = int(so.num_scheduled_tokens.get(rid, 0))
                layout.append((rid, int(ib.num_computed_tokens_cpu[i]), k))
                total += k
            assert total == n, f"the step's requests hold {total} tokens, it scheduled {n}"
            self._layout = layout
            self._rows = np.zeros((n, len(self.layer_ids), self.top_k), dtype=np.int32)
        assert self._rows is not None
        self._rows[:, ordinal] = topk_ids[:n].cpu().numpy()

    def _keep(self) -> None:
        if self._layout is None or self._rows is None:
            return
        at = 0
        for rid, start, k in self._layout:
            req = self.kept.get(rid)
            if req is None:
                req = self.kept[rid] = _Request()
                while len(self.kept) > self.max_requests:
                    self.kept.popitem(last=False)
            req.put(start, self._rows[at : at + k].copy())
            at += k

    def take(self, keys: list[str], positions: list[int] | None = None) -> dict[str, str | None]:
        """The routing of finished requests, as {key: base64 blob}, forgotten once read; {key: None} for one that is
        incomplete or holds fewer than its ``positions``. A key is an engine id without the ``-<8 characters>``
        ``InputProcessor.assign_request_id`` appends: ``cmpl-<rid>-<prompt>``, ``chatcmpl-<rid>``, or, for a choice
        of a request with ``n > 1``, ``<choice>_<that>`` (``ParentRequest.get_child_info``). ``positions[i]``: how
        many positions key ``i``'s sequence has (prompt and completion but the last token); rows past it (a step
        scheduled before the request was known to be finished) are left out. Keys not held are absent."""
        want = dict(zip(keys, positions if positions is not None else [None] * len(keys), strict=True))
        out: dict[str, str | None] = {}
        for rid in list(self.kept):
            key = rid.rsplit("-", 1)[0] if rid not in want else rid
            if key not in want:
                continue
            req = self.kept.pop(rid)
            rows = np.concatenate(req.rows) if req.rows else np.zeros((0, len(self.layer_ids), self.top_k), np.int32)
            n = want[key]
            if not req.complete or (n is not None and len(rows) < n):
                out[key] = None
                continue
            out[key] = routing.to_text(routing.encode(rows if n is None else rows[:n], self.n_experts))
        return out
