"""The hot-swap, run inside the vLLM node's API-server process: one HTTP call from the agent, no round trip inside.

Why here: driven from the agent, a swap takes five HTTP calls to the node (``/pause``, ``/collective_rpc`` apply,
``/collective_rpc`` checksum, ``/update_weight_version``, ``/resume``), the engine paused across all of them, each
waiting its turn on the API server's event loop, which under streaming load is busy relaying tokens. On a 2-core
test box that pause measured 2.5 and 4.4 s, almost all of it inside the ``/pause`` HTTP call. This ASGI middleware,
loaded with ``--middleware`` like ``serving.node.auth`` (a supported extension point; nothing in vLLM is changed),
answers ``POST /liverl/swap`` and runs the whole sequence on the engine client in this process, with the decoding
moved before the pause, so the engine is paused only for the engine-core calls themselves (``liverl bench swap``,
same box: median 22-27 ms over 12 swaps under 16 streams; the slow ones wait for a long scheduler step to end):

0. Before the pause: ``collective_rpc liverl_stage`` has the worker verify and decode the delta chain in a thread
   (every check ``liverl_apply_delta`` makes, each arriving state hashed and compared with its expected checksum),
   polled with ``liverl_staged``. A refused chain ends the call here: nothing was paused or written.
1. ``pause_scheduler(mode="keep", clear_cache=True)`` on the engine core: requests freeze at a scheduler step, new
   ones queue, and the prefix cache is reset. (``AsyncLLM.pause_generation`` would add a fixed 20 ms sleep meant
   for abort mode's final outputs; keep mode has none, so the engine-core call is made directly when it exists.)
   Resetting the prefix cache preempts the frozen requests: they keep their tokens and are re-prefilled after the
   resume under the new weights, so every token labelled with a version was sampled from that version's weights over
   its whole context (exact attribution; see ``serving.agent.agent`` for the trade-off).
2. ``collective_rpc liverl_commit``: the staged tensors are written, read back from the live weights and checked
   tensor by tensor (and the CPU kernels probed); a mismatch writes the previous values back.
3. ``update_weight_version``: every token sampled from now on carries the new version in its request's spans.
4. ``resume_scheduler``, always (in ``finally``). On any failure in 2-3 the node is brought back to the old weights
   (deltas already committed are applied again in reverse: an XOR delta is its own inverse) and the old checksum is
   checked before resuming.
5. After the resume, ``liverl_checksum`` reads the whole served state back (outside the pause: it costs a full
   read-back, which on a large model would dominate the pause); a mismatch answers ``ok: false, restored: false``
   and the agent stops the node serving.

Steps 2-3 run one of two ways, the body's ``via`` (``serving.swap_via``): ``vllm`` makes vLLM's own weight-update
calls on the engine client, the ones its RL routes make (``start_weight_update``, opened before the pause;
``update_weights``, whose ``liverl_delta`` backend, ``serving.node.worker.transfer``, commits the chain staged in
step 0 with the checks of step 2; ``finish_weight_update`` with the version, which labels); ``liverl`` is the
sequence above. The pause (1) and the resume (4) are vLLM's keep mode either way.
The read-back of step 5 is liverl's either way: vLLM's ``/weight_checker`` hashes its own fused and packed
parameters, which no registry checksum describes (docs/serving.md, "vLLM's weight-update API").

Body: ``{"deltas": [[path, checksum_after], ...], "from": [version, checksum], "to": [version, checksum], "via":
"vllm" | "liverl"}`` (``via`` defaults to ``vllm``); the paths are files in the agent's delta folder (the worker
refuses any other). Answer (always HTTP 200 once the body is
valid): ``{"ok", "version", "checksum", "restored", "error", "pause_ms", "phases": {...}, "worker": [...]}``, where
``pause_ms`` runs from the pause call to the resume's reply, measured here: the time the engine stepped no request.
One swap at a time (a second concurrent call gets 409). The route sits inside ``NodeKeyMiddleware``. This module
imports neither torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from serving.node import gateway_host as node_gateway
from serving.node.auth import read_body, reply_json

log = logging.getLogger("liverl.serving.node_swap")

SWAP_PATH = "/liverl/swap"
RPC_TIMEOUT_S = 120.0
STAGE_POLL_S = 0.005  # how often the route asks whether the worker's staging thread is done


class SwapBodyError(ValueError):
    """A malformed ``/liverl/swap`` body."""


VIAS = ("vllm", "liverl")


def parse_body(raw: bytes) -> tuple[list[tuple[str, str]], tuple[int, str], tuple[int, str], str]:
    """(deltas as (path, checksum after), (from version, checksum), (to version, checksum), via); SwapBodyError if
    bad."""
    try:
        body = json.loads(raw)
        deltas = [(str(p), str(after)) for p, after in body["deltas"]]
        frm = (int(body["from"][0]), str(body["from"][1]))
        to = (int(body["to"][0]), str(body["to"][1]))
        via = str(body.get("via", "vllm"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise SwapBodyError(
            f'POST {SWAP_PATH} needs JSON {{"deltas": [[path, checksum_after], ...], '
            f'"from": [version, checksum], "to": [version, checksum], "via": "vllm" | "liverl"}} '
            f"({type(e).__name__}: {e})"
        ) from e
    if not deltas:
        raise SwapBodyError("no deltas to apply")
    if deltas[-1][1] != to[1]:
        raise SwapBodyError("the last delta does not lead to the target checksum")
    if via not in VIAS:
        raise SwapBodyError(f'"via" is one of {", ".join(VIAS)}, not {via!r}')
    return deltas, frm, to, via


class EngineSwap:
    """The swap sequence on one engine client (vLLM's ``AsyncLLM``)."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = asyncio.Lock()

    async def _rpc(self, method: str, *args: str) -> dict:
        results = await self.engine.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)
        if len(results) != 1 or not isinstance(results[0], dict):
            raise RuntimeError(f"collective_rpc {method}: expected one worker result, got {results!r}"[:500])
        return results[0]

    async def _pause(self) -> None:
        """vLLM's keep-mode pause: the engine-core call ``AsyncLLM.pause_generation`` (and ``POST /pause?mode=keep``)
        makes, without the 20 ms sleep that follows it there (for abort mode's last outputs; measured: the pause call
        median 45 ms through ``pause_generation``, 16 ms direct, docs/serving.md)."""
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode="keep", clear_cache=True)
        else:  # another engine client: its public call (may sleep a little after pausing)
            await self.engine.pause_generation(mode="keep", clear_cache=True)

    async def _stage(self, deltas: list[tuple[str, str]], out: dict) -> str | None:
        """Before the pause: have the worker verify and decode the chain in a thread; None when ready, else why not."""
        t = time.perf_counter()
        r = await self._rpc("liverl_stage", [p for p, _ in deltas], [a for _, a in deltas])
        out["phases"]["stage_call_ms"] = _ms(t, time.perf_counter())
        if not r.get("ok"):
            return f"worker refused to stage the deltas: {r.get('error')}"
        deadline = t + RPC_TIMEOUT_S
        polls = 0
        while True:
            polls += 1
            out["phases"]["stage_polls"] = polls
            r = await self._rpc("liverl_staged")
            if not r.get("ok") or r.get("ready"):
                break
            if time.perf_counter() > deadline:
                return f"staging took more than {RPC_TIMEOUT_S:.0f} s"
            await asyncio.sleep(STAGE_POLL_S)
        out["phases"]["stage_ms"] = _ms(t, time.perf_counter())
        out["phases"]["stage_worker_ms"] = r.get("stage_ms")
        if not r.get("ok") or r.get("error"):
            return f"worker refused the deltas: {r.get('error')}"
        return None

    async def run(
        self,
        deltas: list[tuple[str, str]],
        frm: tuple[int, str],
        to: tuple[int, str],
        gateway=None,
        via: str = "vllm",
    ) -> dict[str, Any]:
        """The swap; ``gateway``: the ``serving.node.gateway.Gateway`` in this process (``serving.node.gateway_host``),
        told just before the pause that a swap begins and, after the resume and the read-back, which version it left
        served (or why the node must stop serving) and that it ended. ``via``: ``vllm`` commits through vLLM's
        weight-update calls and the ``liverl_delta`` backend, ``liverl`` through liverl's worker RPC."""
        out: dict[str, Any] = {
            "ok": False,
            "version": frm[0],
            "checksum": frm[1],
            "restored": None,
            "error": None,
            "via": via,
            "phases": {},
            "worker": [],
        }
        refused = await self._stage(deltas, out)
        if refused:  # nothing paused, nothing written
            out.update(error=refused, restored=True, pause_ms=0.0)
            return out
        if via == "vllm":  # a session flag in the worker: opened before the pause, so the pause holds no extra call
            t = time.perf_counter()
            await self.engine.start_weight_update()
            out["phases"]["start_ms"] = _ms(t, time.perf_counter())
        if gateway is None:
            return await self._paused(deltas, frm, to, out, via)
        out["inflight"] = gateway.swap_begin()  # requests in flight now: frozen by the pause, kept
        try:
            await self._paused(deltas, frm, to, out, via)
        finally:
            _book(gateway, out, frm, to)
            gateway.swap_end()  # after the version is set: a request sent before it asks for its spans
        return out

    async def _paused(
        self, deltas: list[tuple[str, str]], frm: tuple[int, str], to: tuple[int, str], out: dict[str, Any], via: str
    ) -> dict[str, Any]:
        ph = out["phases"]
        t0, w0 = time.perf_counter(), time.time()
        pause = asyncio.ensure_future(self._pause())  # vLLM's keep mode either way (see _pause)
        # a probe queued right behind the pause: the engine core runs it just after it took the pause, so its start
        # time says how long the pause request took to reach the core (it waits for the step in flight), and the rest
        # of pause_call_ms is the wait for the core to go idle plus the cache reset
        probe = asyncio.ensure_future(self._rpc("liverl_version"))
        try:
            await pause  # raises: nothing written, the caller sees HTTP 500 (and resumes the engine to be sure)
        except BaseException:
            if via == "vllm":  # close the session opened before the pause (nothing was written)
                await asyncio.gather(self.engine.finish_weight_update(), return_exceptions=True)
            raise
        finally:
            seen = await asyncio.gather(probe, return_exceptions=True)
        t = time.perf_counter()
        ph["pause_call_ms"] = _ms(t0, t)
        if isinstance(seen[0], dict) and "t_wall" in seen[0]:
            ph["pause_reached_core_ms"] = round((seen[0]["t_wall"] - w0) * 1e3, 3)
        applied: list[tuple[str, str]] = []  # (delta, checksum before it)
        chain = [(p, before) for (p, _), before in zip(deltas, [frm[1], *[a for _, a in deltas[:-1]]], strict=True)]
        try:
            try:
                if via == "vllm":
                    await self._commit_vllm(deltas, to, out)
                    applied = chain
                    t1 = time.perf_counter()
                    ph["apply_ms"] = _ms(t, t1)
                    await self.engine.finish_weight_update(str(to[0]))  # labels: before resume, no token mislabelled
                else:
                    r = await self._rpc("liverl_commit", to[1])
                    keep = ("rpc_ms", "write_ms", "readback_ms", "changed_tensors")
                    out["worker"].append({k: r.get(k) for k in keep})
                    if not r.get("ok"):
                        raise RuntimeError(f"worker did not commit the staged deltas: {r.get('error')}")
                    applied = chain
                    t1 = time.perf_counter()
                    ph["apply_ms"] = _ms(t, t1)
                    if r["checksum"] != to[1] or int(r["version"]) != to[0]:
                        raise RuntimeError(
                            f"the worker arrived at {r['checksum'][:12]} (version {r['version']}), not "
                            f"version {to[0]}'s {to[1][:12]}"
                        )
                    await self.engine.update_weight_version(str(to[0]))  # before resume: no token is mislabelled
                ph["label_ms"] = _ms(t1, time.perf_counter())
                out.update(ok=True, version=to[0], checksum=to[1])
            except Exception as e:  # noqa: BLE001 whatever went wrong, the old weights go back before reopening
                out["error"] = f"{type(e).__name__}: {e}"
                out["restored"] = await self._restore(applied, frm)
                if not out["restored"]:
                    out.update(version=None, checksum=None)
        finally:
            t3 = time.perf_counter()
            try:
                await self.engine.resume_generation()
            except Exception as e:  # noqa: BLE001 reported as resume_error: the agent marks the node unhealthy
                out["resume_error"] = f"{type(e).__name__}: {e}"
                out["ok"] = False
            t4 = time.perf_counter()
            ph["resume_ms"] = _ms(t3, t4)
            out["pause_ms"] = _ms(t0, t4)
            out["pause_wall"] = [w0, w0 + (t4 - t0)]  # epoch seconds: when the engine paused and resumed
        if out["ok"]:  # the whole served state read back, now that generation runs again
            t5 = time.perf_counter()
            ck = await self._rpc("liverl_checksum")
            ph["verify_ms"] = _ms(t5, time.perf_counter())
            if not ck.get("ok") or ck["checksum"] != to[1]:
                out.update(
                    ok=False,
                    restored=False,
                    version=None,
                    checksum=None,
                    error=f"after the swap the served weights read back as {ck.get('checksum', '?')[:12]}, "
                    f"not version {to[0]}'s {to[1][:12]} ({ck.get('error')})",
                )
        return out

    async def _commit_vllm(self, deltas: list[tuple[str, str]], to: tuple[int, str], out: dict[str, Any]) -> None:
        """vLLM's ``update_weights`` with the ``liverl_delta`` backend (``serving.node.worker.transfer``): it commits
        the chain staged above (every changed tensor read back and checked; a mismatch writes the previous values
        back and raises), or raises before any write. It returns nothing, so success is the proof of arrival."""
        from vllm.distributed.weight_transfer.base import (  # noqa: PLC0415 vllm: this process runs it; kept light
            WeightTransferUpdateRequest,
        )

        info = {"deltas": [[p, a] for p, a in deltas], "version": to[0]}
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def _restore(self, applied: list[tuple[str, str]], frm: tuple[int, str]) -> bool:
        """Undo the applied deltas (in the pause: nothing ran since, so no KV of the new weights exists)."""
        try:
            for path, before in reversed(applied):
                r = await self._rpc("liverl_apply_delta", path, before)
                if not r.get("ok"):
                    raise RuntimeError(f"re-applying {path} failed: {r.get('error')}")
            ck = await self._rpc("liverl_checksum")
            if ck.get("ok") and ck["checksum"] == frm[1]:
                return True
            log.critical("after restoring, the node serves %s, not %s", ck.get("checksum", "?")[:12], frm[1][:12])
        except Exception:  # reported as restored=False: the agent marks the node unhealthy
            log.exception("restoring the previous weights failed")
        return False


def _book(gateway, out: dict[str, Any], frm: tuple[int, str], to: tuple[int, str]) -> None:
    """What the swap left served, on the gateway of this process (before its ``swap_end``)."""
    if out.get("pause_ms") is not None:
        gateway.last_swap_pause_ms = out["pause_ms"]
    if out.get("resume_error"):
        gateway.unhealthy_reason = f"vLLM did not resume after a swap: {out['resume_error']}"
    elif out.get("ok"):
        gateway.set_served(to[0], to[1])
    elif out.get("restored") is False:
        gateway.unhealthy_reason = f"swap failed and the previous weights could not be restored: {out.get('error')}"
    elif out.get("restored"):
        gateway.set_served(frm[0], frm[1])


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1e3, 3)


class SwapMiddleware:
    """Pure ASGI: answers ``POST /liverl/swap``; everything else passes through."""

    def __init__(self, app):
        self.app = app
        self.swap: EngineSwap | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != SWAP_PATH:
            return await self.app(scope, receive, send)
        if scope.get("method") != "POST":
            return await reply_json(send, 405, {"error": f"{SWAP_PATH} takes POST"})
        if self.swap is None:
            engine = getattr(scope["app"].state, "engine_client", None)
            if engine is None:
                return await reply_json(send, 503, {"error": "the engine is not ready"})
            self.swap = EngineSwap(engine)
        raw = await read_body(receive)
        try:
            deltas, frm, to, via = parse_body(raw)
        except SwapBodyError as e:
            return await reply_json(send, 400, {"error": str(e)})
        if self.swap.lock.locked():
            return await reply_json(send, 409, {"error": "a swap is already running on this node"})
        async with self.swap.lock:
            try:
                out = await self.swap.run(deltas, frm, to, gateway=node_gateway.current(), via=via)
            except Exception as e:  # staging or the pause call failed: nothing was written
                log.exception("swap failed before any write")
                return await reply_json(
                    send, 500, {"error": f"swap failed before any write (staging or pausing): {type(e).__name__}: {e}"}
                )
        ok, pause_ms, phases = out["ok"], out["pause_ms"], out["phases"]
        log.info("swap %d -> %d via %s: ok=%s pause %.1f ms %s", frm[0], to[0], via, ok, pause_ms, phases)
        return await reply_json(send, 200, out)
