"""The serving agent: keeps the node on the version the release gate wants, and reports what it serves.

Runs as an asyncio task inside the gateway process. Every ``cfg.serving.swap_poll_s`` it reads the signed
announcements ``<prefix>:desired`` and ``<prefix>:canary`` (``VersionAnnouncement``s) from Redis through
``liverl.core.fleet`` (verified, bound to their channel, prefix and expiry, replays refused); its target is the canary
when the canary's signed terms name this node, else the desired version. The registry must call the target ``stable``
(desired channel) or ``canary`` (canary channel). When the target differs from the served version it
1. plans the delta(s) that move the node there, OUTSIDE the pause: stored registry deltas along the version tree
   (``Registry.deltas_between``; XOR deltas apply in either direction, so a rollback to the parent uses the current
   version's own delta) when the chain is short, else one delta encoded on the fly from registry-materialized
   weights (logged), and checks the first delta's header against the served checksum;
2. closes the gateway's swap gate (new requests wait, in-flight ones drain), ``POST /pause?mode=wait``, applies
   each delta in the worker (``collective_rpc liverl_apply_delta <file>``, verified before any weight changes),
   ``POST /reset_prefix_cache`` (no old-weight KV is reused), reads back the served checksum
   (``liverl_checksum``) and compares it with the announcement; on any failure it re-applies the deltas already
   applied (an XOR delta is its own inverse) so the old version keeps serving, and records the failure in
   ``<prefix>:swap_errors``; then ``POST /resume`` and reopens the gate.
Each swap is appended to ``<prefix>:swaps`` (JSON: from, to, pause_ms, drain_ms, apply_ms, verify_ok, ...), and a
heartbeat ``<prefix>:served:<node>`` = {version, checksum, ts, last_swap_pause_ms} is refreshed every poll.

The process that runs node, gateway and agent together is ``serving.main``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from deploy.signing import Verifier
from liverl.core import fleet, keys
from liverl.core.config import LiverlConfig, advertised_url
from liverl.core.schemas import VersionAnnouncement
from liverl.core.services import required_verify_key
from serving.gateway import DrainTimeout, Gateway
from serving.node import NodeClient, delta_dir

log = logging.getLogger("liverl.serving.agent")



def _registry_errors() -> tuple[type[BaseException], ...]:
    """What a registry call may raise when the database or the blob store is unreachable or not initialised
    (``deploy.registry`` is imported on first use: it brings torch, which the gateway needs only for swaps)."""
    from deploy.registry import RegistryError

    return RegistryError, SQLAlchemyError, OSError



class SwapError(RuntimeError):
    """A swap that could not be done; the node still serves the previous version unless ``restored`` is False."""

    def __init__(self, message: str, restored: bool = True):
        super().__init__(message)
        self.restored = restored


class SwapPostponed(SwapError):
    """The requests in flight did not drain before the deadline; nothing changed, and the next poll retries."""


MAX_DRAIN_S = 120.0  # the node client's own request timeout: no request outlives it


class Agent:
    def __init__(self, cfg: LiverlConfig, gateway: Gateway, redis, registry=None, work_dir: Path | None = None,
                 max_chain: int = 4, retry_failed_after_s: float = 60.0):
        self.cfg = cfg
        self.gw = gateway
        self.node: NodeClient = gateway.node
        self.redis = redis
        self.registry = registry
        self.prefix = cfg.topics.prefix
        self.name = gateway.node_name
        self.work_dir = Path(work_dir or delta_dir(cfg))  # the only folder the node's worker reads deltas from
        self.max_chain = max_chain
        self.retry_failed_after_s = retry_failed_after_s
        self._failed: dict[tuple[str, int, str], float] = {}  # (channel, version, checksum) -> when it failed
        self.drain_s = cfg.serving.swap_drain_s  # doubled after each postponed swap, reset by a swap that drains
        self._verified_at = time.monotonic()  # the served checksum was last read back then (init, swaps, reverify)
        self.swaps: collections.deque[dict] = collections.deque(maxlen=keys.LIST_CAP)
        key = required_verify_key(cfg)  # none: ValueError, unless security.allow_unsigned
        self.verifier = Verifier(key) if key else None  # with a key, unsigned announcements are refused
        self.announcements = fleet.AnnouncementReader(self.prefix, self.verifier)
        self.refused_announcements = 0
        self.refused_by_reason: collections.Counter[str] = collections.Counter()
        self.registry_errors = _registry_errors() if registry is not None else (SQLAlchemyError, OSError)
        self._last_refused: dict[str, str] = {}  # channel -> the refusal last logged

    # ------------------------------------------------------------------------------------------ setup

    async def init(self) -> None:
        """Learn what the node serves (read back from the live weights) and check it against the registry."""
        r = await self.node.rpc("liverl_checksum")
        if not r.get("ok"):
            raise RuntimeError(f"cannot read the served weights' checksum: {r.get('error')}")
        self.gw.set_served(int(r["version"]), r["checksum"])
        log.info("node %s serves version %s (checksum %s)", self.name, r["version"], r["checksum"][:12])
        if self.registry is not None:
            try:
                row = await asyncio.to_thread(self.registry.get, int(r["version"]))
            except self.registry_errors as e:  # registry not initialised yet: serve, swaps will say what is missing
                log.warning("registry has no version %s yet (%s); serving the model dir as is", r["version"], e)
                return
            if row.checksum != r["checksum"]:
                msg = (f"served weights (checksum {r['checksum'][:12]}) are not registry version {row.version} "
                       f"(checksum {row.checksum[:12]}); refusing to label generations with that version")
                self.gw.unhealthy_reason = msg
                await self._report_error(row.version, row.version, msg, restored=True)
                log.error(msg)
        await self.heartbeat()

    # ------------------------------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event, node_alive=lambda: True) -> None:
        """Poll, swap, heartbeat until ``stop`` is set. Errors are logged and reported, never fatal."""
        while not stop.is_set():
            if not node_alive():
                raise RuntimeError("the vLLM node process died")
            try:
                await self.step()
            except Exception as e:  # noqa: BLE001 - the agent outlives any one poll; each failure is counted
                self.gw.m_agent_errors.labels(kind=type(e).__name__).inc()
                log.exception("agent step failed")
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.serving.swap_poll_s)
            except TimeoutError:
                pass

    async def step(self) -> dict | None:
        """One poll: swap if the desired version differs from the served one; heartbeat. Returns the swap record."""
        ann = await self.desired()
        record = None
        if ann is not None and (ann.version != self.gw.version or ann.checksum != self.gw.checksum):
            key = (ann.channel, ann.version, ann.checksum)
            failed_at = self._failed.get(key)
            if failed_at is None or time.monotonic() - failed_at > self.retry_failed_after_s:
                try:
                    record = await self.swap_to(ann)
                    self._failed.pop(key, None)
                except SwapPostponed:
                    pass  # logged where it happened; retried at the next poll
                except SwapError as e:
                    self._failed[key] = time.monotonic()
                    log.error("swap to version %d failed: %s", ann.version, e)
        if record is not None:
            self._verified_at = time.monotonic()
        elif self.cfg.serving.reverify_s and time.monotonic() - self._verified_at >= self.cfg.serving.reverify_s:
            await self.reverify()
        await self.heartbeat()
        return record

    async def reverify(self) -> bool:
        """Read the served weights back and compare their checksum with the version the gateway labels generations
        with. A mismatch (weights changed behind the agent's back) marks the node unhealthy: it stops serving until
        an operator looks, rather than mislabel every generation. True when they match."""
        self._verified_at = time.monotonic()
        ck = await self.node.rpc("liverl_checksum")
        if not ck.get("ok"):
            self.gw.m_reverify.labels(result="error").inc()
            log.error("re-verification could not read the served weights back: %s", ck.get("error"))
            return False
        if ck["checksum"] == self.gw.checksum:
            self.gw.m_reverify.labels(result="ok").inc()
            return True
        self.gw.m_reverify.labels(result="mismatch").inc()
        msg = (f"SERVED WEIGHTS CHANGED: the node serves checksum {ck['checksum'][:12]}, not version "
               f"{self.gw.version}'s {self.gw.checksum[:12]}; the node stops serving")
        log.critical(msg)
        self.gw.unhealthy_reason = msg
        await self._report_error(self.gw.version, self.gw.version, msg, restored=False)
        return False

    async def desired(self) -> VersionAnnouncement | None:
        """What this node should serve (``fleet.serving_target``): the canary announcement when its signed terms name
        this node, else the fleet's desired one; each read and checked by ``fleet.AnnouncementReader``. A refused
        announcement is counted (``refused_announcements``, by reason) and logged once per distinct refusal, and
        counts as none: a refused canary leaves the node on desired, a refused desired one changes nothing."""
        got: dict[str, VersionAnnouncement | None] = {}
        for channel in fleet.CHANNELS:
            try:
                got[channel] = await self.announcements.read(self.redis, channel)
                self._last_refused.pop(channel, None)
            except fleet.AnnouncementRefused as e:
                got[channel] = None
                self.refused_announcements += 1
                self.refused_by_reason[e.reason] += 1
                if self._last_refused.get(channel) != str(e):  # say it once per distinct refusal, not every poll
                    self._last_refused[channel] = str(e)
                    log.error("refusing %s: %s", fleet.announcement_key(self.prefix, channel), e)
        return fleet.serving_target(self.name, got["desired"], got["canary"])

    async def heartbeat(self) -> None:
        beat = keys.ServedHeartbeat(version=self.gw.version, checksum=self.gw.checksum,
                                    last_swap_pause_ms=self.gw.last_swap_pause_ms,
                                    healthy=self.gw.unhealthy_reason is None, url=advertised_url(self.cfg.serving))
        ttl = max(10, int(20 * self.cfg.serving.swap_poll_s))
        await self.redis.set(keys.served(self.prefix, self.name), beat.to_json(), ex=ttl)

    # ------------------------------------------------------------------------------------------ swapping

    async def swap_to(self, ann: VersionAnnouncement) -> dict:
        """Move the node to ``ann`` (plan outside the pause, then apply under the gate). Raises SwapError."""
        cur_v, cur_sum = self.gw.version, self.gw.checksum
        try:
            blobs, how = await asyncio.to_thread(self._plan, cur_v, cur_sum, ann)
        except Exception as e:
            msg = f"cannot plan the swap {cur_v} -> {ann.version}: {e}"
            await self._report_error(cur_v, ann.version, msg, restored=True)
            self.gw.m_swaps.labels(outcome="refused").inc()
            raise SwapError(msg) from e
        return await self.apply_blobs(blobs, ann.version, ann.checksum, how=how)

    def _plan(self, cur_v: int, cur_sum: str, ann: VersionAnnouncement) -> tuple[list[bytes], str]:
        """(delta blobs in order, how they were obtained). Runs in a thread: registry and codec calls block."""
        from deploy.delta import encode_delta

        if self.registry is None:
            raise RuntimeError("no registry configured")
        row = self.registry.get(ann.version)
        if row.checksum != ann.checksum:
            raise RuntimeError(f"announced checksum {ann.checksum[:12]} differs from the registry's "
                               f"{row.checksum[:12]} for version {ann.version}")
        want = "canary" if ann.channel == "canary" else "stable"  # the channel the reader verified it came on
        if row.status != want:  # Redis says what to serve; the registry what may be served
            raise RuntimeError(f"version {ann.version} is {row.status} in the registry, not {want}: refusing to serve "
                               f"it on the {ann.channel} channel (only a promotion or a rollback makes a version "
                               "servable as desired, and only the gate's canary on the canary channel)")
        path_len = sum(map(len, self.registry.path(cur_v, ann.version)))
        if path_len <= self.max_chain:
            return self.registry.deltas_between(cur_v, ann.version), f"stored x{path_len}"
        log.info("no short chain of stored deltas from %d to %d (%d steps): encoding one delta from "
                 "registry-materialized weights", cur_v, ann.version, path_len)
        base, target = self.registry.materialize(cur_v), self.registry.materialize(ann.version)
        return [encode_delta(base, target, cur_v, ann.version)], "encoded"

    async def apply_blobs(self, blobs: list[bytes], target_version: int, target_checksum: str,
                          how: str = "given") -> dict:
        """Apply delta blobs under the swap gate and verify the served checksum; restore on failure."""
        from deploy.delta import DeltaError

        from_v, from_sum = self.gw.version, self.gw.checksum
        try:  # cheap refusal before pausing: the chain must start at the served weights and end at the target
            ends = chain_ends(blobs, from_sum, target_checksum)
        except DeltaError as e:
            msg = f"delta refused before pausing: {e}"
            await self._report_error(from_v, target_version, msg, restored=True)
            self.gw.m_swaps.labels(outcome="refused").inc()
            raise SwapError(msg) from e
        self.work_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, blob in enumerate(blobs):
            p = self.work_dir / f"{os.getpid()}-{from_v}-{target_version}-{i}.delta"
            p.write_bytes(blob)
            paths.append(p)
        rec: dict[str, Any] = {"node": self.name, "from": from_v, "to": target_version, "how": how,
                               "deltas": len(paths), "verify_ok": False}
        error: SwapError | None = None
        t_close = time.perf_counter()
        try:
            async with self.gw.gate.closed(self.drain_s) as drain_ms:
                rec["drain_ms"] = round(drain_ms, 3)
                t_apply = time.perf_counter()
                try:
                    await self.node.pause("wait")
                    rec["vllm_pause_ms"] = round((time.perf_counter() - t_apply) * 1e3, 3)
                except Exception as e:
                    error = SwapError(f"vLLM /pause failed, nothing applied: {e}", restored=True)
                else:
                    try:
                        error = await self._apply_verify(paths, ends, target_version, target_checksum, from_v,
                                                         from_sum, rec)
                    finally:
                        try:
                            await self.node.resume()
                        except Exception as e:
                            self.gw.unhealthy_reason = f"vLLM /resume failed after a swap: {e}"
                            error = error or SwapError(self.gw.unhealthy_reason, restored=False)
                rec["apply_ms"] = round((time.perf_counter() - t_apply) * 1e3, 3)
        except DrainTimeout as e:  # nothing was touched: admissions resumed, the next poll tries again
            self.gw.m_swaps.labels(outcome="postponed").inc()
            log.warning("swap %d -> %d postponed: %s; retrying with a %.0f s drain deadline", from_v, target_version,
                        e, min(2 * self.drain_s, MAX_DRAIN_S))
            self.drain_s = min(2 * self.drain_s, MAX_DRAIN_S)
            raise SwapPostponed(str(e)) from e
        finally:
            for p in paths:
                p.unlink(missing_ok=True)
        self.drain_s = self.cfg.serving.swap_drain_s
        rec["pause_ms"] = round((time.perf_counter() - t_close) * 1e3, 3)
        rec["ts"] = time.time()
        self.gw.last_swap_pause_ms = rec["pause_ms"]
        self.gw.m_pause.observe(rec["pause_ms"] / 1e3)
        self.gw.m_swaps.labels(outcome="ok" if error is None else "failed").inc()
        self.swaps.append(rec)
        await self.redis.rpush(keys.swaps(self.prefix), keys.SwapRecord.model_validate(rec).to_json())
        await self.redis.ltrim(keys.swaps(self.prefix), -keys.LIST_CAP, -1)
        if error is not None:
            await self._report_error(from_v, target_version, str(error), restored=error.restored)
            raise error
        log.info("swapped %d -> %d (%s): pause %.1f ms (drain %.1f, apply %.1f)", from_v, target_version, how,
                 rec["pause_ms"], rec["drain_ms"], rec["apply_ms"])
        await self.heartbeat()
        if self.registry is not None:
            try:
                await asyncio.to_thread(self.registry.update_fleet, self.name, target_version, target_checksum)
            except self.registry_errors as e:
                log.warning("could not record node %s in the registry's fleet table: %s", self.name, e)
        return rec

    async def _apply_verify(self, paths: list[Path], ends: list[str], target_version: int, target_checksum: str,
                            from_v: int, from_sum: str, rec: dict) -> SwapError | None:
        """Inside the pause: apply, reset caches, verify. Returns the error (after restoring), or None."""
        applied: list[tuple[Path, str]] = []  # (delta, checksum before it)
        try:
            for p, before, after in zip(paths, [from_sum, *ends[:-1]], ends):
                r = await self.node.rpc("liverl_apply_delta", str(p), after)
                if not r.get("ok"):
                    raise SwapError(f"worker refused delta {p.name}: {r.get('error')}")
                applied.append((p, before))
                rec.setdefault("worker_ms", []).append(r.get("rpc_ms"))
            t = time.perf_counter()
            await self.node.reset_prefix_cache()
            rec["reset_cache_ms"] = round((time.perf_counter() - t) * 1e3, 3)
            t = time.perf_counter()
            ck = await self.node.rpc("liverl_checksum")
            rec["verify_ms"] = round((time.perf_counter() - t) * 1e3, 3)
            if not ck.get("ok"):
                raise SwapError(f"cannot read back the served checksum: {ck.get('error')}")
            if ck["checksum"] != target_checksum or int(ck["version"]) != target_version:
                log.error("SERVED CHECKSUM MISMATCH after swap %d -> %d: served %s (version %s), expected %s",
                          from_v, target_version, ck["checksum"][:12], ck["version"], target_checksum[:12])
                raise SwapError(f"served checksum {ck['checksum'][:12]} (version {ck['version']}) does not match "
                                f"version {target_version}'s {target_checksum[:12]}")
            rec["verify_ok"] = True
            self.gw.set_served(target_version, ck["checksum"])
            return None
        except Exception as e:  # whatever went wrong, put the old weights back before reopening
            restored = await self._restore(applied, from_v, from_sum)
            rec["restored"] = restored
            return SwapError(str(e), restored=restored)

    async def _restore(self, applied: list[tuple[Path, str]], from_v: int, from_sum: str) -> bool:
        """Undo applied deltas (each XOR delta is its own inverse) and check the old checksum is served again."""
        try:
            for p, before in reversed(applied):
                r = await self.node.rpc("liverl_apply_delta", str(p), before)
                if not r.get("ok"):
                    raise RuntimeError(f"re-applying {p.name} failed: {r.get('error')}")
            await self.node.reset_prefix_cache()
            ck = await self.node.rpc("liverl_checksum")
            if ck.get("ok") and ck["checksum"] == from_sum:
                self.gw.set_served(from_v, from_sum)
                return True
            raise RuntimeError(f"after restoring, the node serves {ck.get('checksum', '?')[:12]}, not {from_sum[:12]}")
        except Exception as e:
            self.gw.unhealthy_reason = f"swap failed and the previous weights could not be restored: {e}"
            log.critical("node %s: %s", self.name, self.gw.unhealthy_reason)
            return False

    async def _report_error(self, from_v: int | None, to_v: int, error: str, restored: bool) -> None:
        entry = keys.SwapErrorRecord.model_validate(
            {"node": self.name, "from": from_v, "to": to_v, "error": error, "restored": restored})
        try:
            await self.redis.rpush(keys.swap_errors(self.prefix), entry.to_json())
            await self.redis.ltrim(keys.swap_errors(self.prefix), -keys.LIST_CAP, -1)
        except (RedisError, OSError) as e:
            log.error("could not report swap error to Redis (%s): %s", e, entry)


def chain_ends(blobs: list[bytes], start_checksum: str, target_checksum: str) -> list[str]:
    """Checksum reached after each delta of a chain that starts at ``start_checksum``; raises DeltaError if the
    chain is empty, does not connect, or does not end at ``target_checksum`` (headers only: cheap)."""
    from deploy.delta import DeltaError, read_header

    if not blobs:
        raise DeltaError("no deltas to apply")
    cur, ends = start_checksum, []
    for i, blob in enumerate(blobs):
        h = read_header(blob)
        if cur == h.base_checksum:
            cur = h.target_checksum
        elif cur == h.target_checksum:
            cur = h.base_checksum
        else:
            raise DeltaError(f"delta #{i} ({h.base_version}<->{h.target_version}) does not apply to weights at "
                             f"checksum {cur[:12]} (it joins {h.base_checksum[:12]} and {h.target_checksum[:12]})")
        ends.append(cur)
    if cur != target_checksum:
        raise DeltaError(f"the deltas lead to checksum {cur[:12]}, not the target {target_checksum[:12]}")
    return ends
