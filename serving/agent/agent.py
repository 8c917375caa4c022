"""The serving agent: keeps the node on the version the release gate wants, and reports what it serves.

Runs as an asyncio task in the serving process (``serving.agent.main``), beside the node whose API-server process runs
the gateway; it tells that gateway what it serves and whether it may serve through
``serving.node.gateway_host.GatewayLink`` (the swap's own start and end are marked on the gateway inside the node, at
the pause), and counts its own events (swaps, swap pauses, re-verifications, poll errors, refused announcements) in
``serving.agent.metrics.AgentMetrics``, which the serving process serves on ``serving.agent_port``.

Every ``cfg.serving.swap_poll_s`` it reads the signed announcements ``<prefix>:desired`` and ``<prefix>:canary``
(``VersionAnnouncement``s) from Redis through ``core.fleet`` (verified, bound to their channel, prefix and expiry,
replays refused); its target is the canary when the canary's signed terms name this node, else the desired version.
The registry must call the target ``stable`` (desired channel) or ``canary`` (canary channel). When the target
differs from the served version it
1. plans the delta(s) that move the node there, OUTSIDE the pause: stored registry deltas along the version tree
   (``Registry.deltas_between``; XOR deltas apply in either direction, so a rollback to the parent uses the current
   version's own delta) when the chain is short, else one delta encoded on the fly from registry-materialized
   weights (logged), and checks the first delta's header against the served checksum;
2. swaps without a drain, in ONE call to the node (``POST /liverl/swap``, ``serving.node.swap``; ``via`` from
   ``serving.swap_via``: vLLM's weight-update calls or liverl's worker RPC inside the pause), which runs in the
   node's API-server process: the worker verifies and decodes the deltas in a thread while generation goes on; then
   the engine core pauses (``mode=keep, clear_cache=true``: vLLM stops at the end of the current scheduler step;
   every request stays, frozen, new ones queue), the worker writes only the changed tensors and reads them back
   (``liverl_commit``), the weights are labelled (``update_weight_version``: vLLM tags every token sampled from then
   on with it, which is how a request spanning the swap is attributed token by token, see
   ``serving.node.versions``), and the engine resumes; then the whole served state is read back and compared with
   the announcement's checksum (``liverl_checksum``). On a failure inside the pause the node puts the old weights
   back before resuming; a read-back mismatch after it stops the node serving. The agent records failures in
   ``<prefix>:swap_errors``. (Driving pause, apply, checksum, label and resume as five HTTP calls from here, each
   waiting for the node's busy event loop, kept the engine paused 2.5-4.4 s under streaming load on 2 cores.)

The prefix cache: ``clear_cache=true`` makes vLLM reset it at the pause, and to free every block it preempts the
frozen requests: they keep their tokens and resume after the swap with their KV recomputed (one prefill of prompt
and tokens so far) under the new weights. So no KV computed by old weights survives the swap: a new request cannot
hit an old-weight prefix, and each token labelled with the new version was sampled from the new weights over its
whole context, exactly. The trade-off: keeping the frozen requests' KV (no reset) would save that re-prefill, but
their next tokens would come from new weights reading old-weight KV, a mixture no version label describes (the
logged log-probs would still be the exact behaviour probabilities, but a learner recomputing them under "the new
version" would not match), and new requests could reuse old-weight prefixes for as long as those blocks stay cached.
The re-prefill runs after the resume, outside the pause; it is one prefill per frozen request.

Each swap is appended to ``<prefix>:swaps`` (JSON: from, to, pause_ms = the engine's pause measured in the node, its
phases stage_ms (before the pause) / pause_call_ms / apply_ms / label_ms / resume_ms / verify_ms (after it), call_ms =
the agent's whole call, called_at = when it began (epoch s), inflight, ...),
and a heartbeat ``<prefix>:served:<node>`` = {version, checksum, ts, last_swap_pause_ms} is refreshed every
``swap_poll_s`` by a task of its own, so a long plan, swap or re-verification never lets it expire.

The process that starts the node (the gateway inside it) and runs the agent is ``serving.agent.main``.
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

from core import fleet, keys
from core.config import LiverlConfig, advertised_url
from core.schemas import VersionAnnouncement
from core.services import required_verify_key
from deploy.registry.signing import Verifier
from serving.agent.fleet_record import FleetRecord
from serving.agent.kept import KeptAnnouncement
from serving.agent.launch import delta_dir
from serving.agent.metrics import AgentMetrics
from serving.node.client import NodeClient
from serving.node.gateway_host import GatewayLink

log = logging.getLogger("liverl.serving.agent")


def _registry_errors() -> tuple[type[BaseException], ...]:
    """What a registry call may raise when the database or the blob store is unreachable or not initialised
    (``deploy.registry.registry`` is imported on first use: it brings torch, which the gateway needs only for swaps)."""
    from deploy.registry.registry import RegistryError  # noqa: PLC0415 torch: via deploy.registry.registry, for swaps only

    return RegistryError, SQLAlchemyError, OSError


class SwapError(RuntimeError):
    """A swap that could not be done; the node still serves the previous version unless ``restored`` is False."""

    def __init__(self, message: str, restored: bool = True):
        super().__init__(message)
        self.restored = restored


class Agent:
    def __init__(
        self,
        cfg: LiverlConfig,
        gateway: GatewayLink,
        redis,
        registry=None,
        work_dir: Path | None = None,
        max_chain: int = 4,
        retry_failed_after_s: float = 60.0,
        metrics: AgentMetrics | None = None,
    ):
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
        self._verified_at = time.monotonic()  # the served checksum was last read back then (init, swaps, reverify)
        self.last_swap_pause_ms: float | None = None  # the last swap's engine pause, measured in the node
        self._swaps_made = 0  # for serving.swap_via = alternate
        self.metrics = metrics or AgentMetrics()  # what the serving process serves on serving.agent_port
        # the heartbeat outlives about 20 polls: the router drops the node only when its agent stops writing it
        self.heartbeat_ttl_s = max(10, int(20 * cfg.serving.swap_poll_s))
        self.swaps: collections.deque[dict] = collections.deque(maxlen=keys.LIST_CAP)
        key = required_verify_key(cfg)  # none: ValueError, unless security.allow_unsigned
        self.verifier = Verifier(key) if key else None  # with a key, unsigned announcements are refused
        self.announcements = fleet.AnnouncementReader(self.prefix, self.verifier)
        self.refused_announcements = 0
        self.refused_by_reason: collections.Counter[str] = collections.Counter()
        self.registry_errors = _registry_errors() if registry is not None else (SQLAlchemyError, OSError)
        self.fleet_record = FleetRecord(registry, self.name, self.metrics.errors, self.registry_errors)
        self._last_refused: dict[str, str] = {}  # channel -> the refusal last logged
        # followed when no desired announcement in Redis is valid (the gate down past its expiry, a restart meanwhile)
        self.kept = KeptAnnouncement(cfg.state_path, self.name, self.prefix, self.verifier)

    # ------------------------------------------------------------------------------------------ setup

    async def init(self) -> None:
        """Learn what the node serves (read back from the live weights) and check it against the registry."""
        r = await self.node.rpc("liverl_checksum")
        if not r.get("ok"):
            raise RuntimeError(f"cannot read the served weights' checksum: {r.get('error')}")
        await self.node.set_weight_version(int(r["version"]))  # the label vLLM puts on every token from now on
        self.gw.set_served(int(r["version"]), r["checksum"])
        self.metrics.verified.set_to_current_time()
        log.info("node %s serves version %s (checksum %s)", self.name, r["version"], r["checksum"][:12])
        if self.registry is not None:
            try:
                row = await asyncio.to_thread(self.registry.get, int(r["version"]))
            except self.registry_errors as e:  # registry not initialised yet: serve, swaps will say what is missing
                log.warning("registry has no version %s yet (%s); serving the model dir as is", r["version"], e)
                return
            if row.checksum != r["checksum"]:
                msg = (
                    f"served weights (checksum {r['checksum'][:12]}) are not registry version {row.version} "
                    f"(checksum {row.checksum[:12]}); refusing to label generations with that version"
                )
                self.gw.unhealthy_reason = msg
                await _report_error(self, row.version, row.version, msg, restored=True)
                log.error(msg)
        await self.heartbeat()

    # ------------------------------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event, node_alive=lambda: True) -> None:
        """Poll, swap, heartbeat until ``stop`` is set. Errors are logged and reported, never fatal. The heartbeat is
        written by a task of its own (``beat_forever``): a poll can take far longer than the heartbeat's TTL (planning
        a long chain, a swap's staging and read-back, a re-verification of tens of GB), and the node keeps serving
        through all of them, so it must stay in rotation meanwhile."""
        beats = asyncio.create_task(self.beat_forever(stop), name=f"heartbeat {self.name}")
        try:
            while not stop.is_set():
                if not node_alive():
                    raise RuntimeError("the vLLM node process died")
                try:
                    await self.step()
                except Exception as e:  # noqa: BLE001 - the agent outlives any one poll; each failure is counted
                    self.metrics.errors.labels(kind=type(e).__name__).inc()
                    log.exception("agent step failed")
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.serving.swap_poll_s)
                except TimeoutError:
                    pass
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)

    async def beat_forever(self, stop: asyncio.Event) -> None:
        """Write the heartbeat every ``serving.swap_poll_s`` until ``stop`` is set, whatever the poll is doing. A
        failed write is counted and logged; the next one is tried a poll later (the TTL spans about 20 of them)."""
        while not stop.is_set():
            try:
                await self.beat()
            except Exception as e:  # noqa: BLE001 - a lost write is retried at the next beat; each failure is counted
                self.metrics.errors.labels(kind=f"heartbeat {type(e).__name__}").inc()
                log.error("could not write node %s's heartbeat: %s", self.name, e)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.serving.swap_poll_s)
            except TimeoutError:
                pass

    async def step(self) -> dict | None:
        """One poll: swap if the desired version differs from the served one; heartbeat. Returns the swap record."""
        ann = await self.desired()
        record = None
        now = time.monotonic()  # a failure past its retry window is as good as none: at most one a poll is kept
        self._failed = {k: at for k, at in self._failed.items() if now - at <= self.retry_failed_after_s}
        if ann is not None and (ann.version != self.gw.version or ann.checksum != self.gw.checksum):
            key = (ann.channel, ann.version, ann.checksum)
            failed_at = self._failed.get(key)
            if failed_at is None or time.monotonic() - failed_at > self.retry_failed_after_s:
                try:
                    record = await self.swap_to(ann)
                    self._failed.pop(key, None)
                except SwapError as e:
                    self._failed[key] = time.monotonic()
                    log.error("swap to version %d failed: %s", ann.version, e)
        if record is not None:
            self._verified_at = time.monotonic()
        elif self.cfg.serving.reverify_s and time.monotonic() - self._verified_at >= self.cfg.serving.reverify_s:
            await self.reverify()
        await self.fleet_record.flush()  # a record the registry refused at the swap: a canary waits for it
        await self.heartbeat()
        return record

    async def reverify(self) -> bool:
        """Read the served weights back and compare their checksum with the version the gateway labels generations
        with. A mismatch (weights changed behind the agent's back) marks the node unhealthy: it stops serving until
        an operator looks, rather than mislabel every generation. True when they match."""
        self._verified_at = time.monotonic()
        ck = await self.node.rpc("liverl_checksum")
        if not ck.get("ok"):
            self.metrics.reverify.labels(result="error").inc()
            log.error("re-verification could not read the served weights back: %s", ck.get("error"))
            await self._flush()
            return False
        self.metrics.verified.set_to_current_time()
        if ck["checksum"] == self.gw.checksum:
            self.metrics.reverify.labels(result="ok").inc()
            await self._flush()
            return True
        self.metrics.reverify.labels(result="mismatch").inc()
        msg = (
            f"SERVED WEIGHTS CHANGED: the node serves checksum {ck['checksum'][:12]}, not version "
            f"{self.gw.version}'s {self.gw.checksum[:12]}; the node stops serving"
        )
        log.critical(msg)
        self.gw.unhealthy_reason = msg
        await self._flush()
        await _report_error(self, self.gw.version, self.gw.version, msg, restored=False)
        return False

    async def desired(self) -> VersionAnnouncement | None:
        """What this node should serve (``fleet.serving_target``): the canary announcement when its signed terms name
        this node, else the fleet's desired one; each read and checked by ``fleet.AnnouncementReader``. A refused
        announcement is counted (``refused_announcements``, by reason) and logged once per distinct refusal, and
        counts as none: a refused canary leaves the node on desired. With no valid desired announcement in Redis the
        agent follows the last one it verified (``serving.agent.kept``)."""
        got: dict[str, VersionAnnouncement | None] = {}
        for channel in fleet.CHANNELS:
            try:
                got[channel] = await self.announcements.read(self.redis, channel)
                self._last_refused.pop(channel, None)
            except fleet.AnnouncementRefused as e:
                got[channel] = None
                self.refused_announcements += 1
                self.refused_by_reason[e.reason] += 1
                self.metrics.refused.labels(reason=e.reason).inc()
                if self._last_refused.get(channel) != str(e):  # say it once per distinct refusal, not every poll
                    self._last_refused[channel] = str(e)
                    log.error("refusing %s: %s", fleet.announcement_key(self.prefix, channel), e)
        if got["desired"] is not None:
            self.kept.keep(got["desired"])
        else:
            got["desired"] = self.kept.read()
        target = fleet.serving_target(self.name, got["desired"], got["canary"])
        if target is not None:
            self.metrics.target_version.set(target.version)
        return target

    def health(self) -> tuple[bool, dict]:
        """(ok, body) of the serving process's ``/healthz``: ok while the node serves a version the agent verified."""
        reason = self.gw.unhealthy_reason
        return reason is None, {"ok": reason is None, "reason": reason, "version": self.gw.version, "node": self.name}

    async def drain(self) -> None:
        """The serving process is stopping: the node's gateway admits no new generation (its ``/readyz`` goes 503)
        and the heartbeat says the node is out of service, so routers drop it at their next read."""
        self.gw.drain()
        await self._flush()
        try:
            await self.beat()
        except Exception as e:  # noqa: BLE001 - the heartbeat expires anyway; the gateway refuses meanwhile
            log.error("could not mark node %s out of rotation: %s", self.name, e)

    async def _flush(self) -> None:
        """Send the served state to the gateway in the node's process (``GatewayLink.flush``); a failure is logged,
        and the state goes with the next flush."""
        try:
            await self.gw.flush()
        except Exception as e:  # noqa: BLE001 - the node answers again or dies (then node_alive ends the agent)
            log.error("could not report to the node's gateway: %s", e)

    async def heartbeat(self) -> None:
        """Report the served state to the node's gateway, then write the heartbeat."""
        await self._flush()
        await self.beat()

    async def beat(self) -> None:
        """Write ``<prefix>:served:<node>`` (expires after ``heartbeat_ttl_s``): what the node serves, whether it is
        healthy, where the router reaches it. Only Redis is called: a node busy with a swap does not delay it."""
        beat = keys.ServedHeartbeat(
            version=self.gw.version,
            checksum=self.gw.checksum,
            last_swap_pause_ms=self.last_swap_pause_ms,
            healthy=self.gw.unhealthy_reason is None and not self.gw.draining,
            url=advertised_url(self.cfg.serving),
        )
        await self.redis.set(keys.served(self.prefix, self.name), beat.to_json(), ex=self.heartbeat_ttl_s)

    # ------------------------------------------------------------------------------------------ swapping

    async def swap_to(self, ann: VersionAnnouncement) -> dict:
        """Move the node to ``ann`` (plan outside the pause, then apply under the gate). Raises SwapError."""
        cur_v, cur_sum = self.gw.version, self.gw.checksum
        try:
            blobs, how = await asyncio.to_thread(self._plan, cur_v, cur_sum, ann)
        except Exception as e:
            msg = f"cannot plan the swap {cur_v} -> {ann.version}: {e}"
            await _report_error(self, cur_v, ann.version, msg, restored=True)
            self.metrics.swaps.labels(outcome="refused").inc()
            raise SwapError(msg) from e
        return await self.apply_blobs(blobs, ann.version, ann.checksum, how=how)

    def _plan(self, cur_v: int, cur_sum: str, ann: VersionAnnouncement) -> tuple[list[bytes], str]:
        """(delta blobs in order, how they were obtained): ``plan_swap``. Runs in a thread: registry calls block."""
        return plan_swap(self.registry, self.max_chain, cur_v, ann)

    async def apply_blobs(
        self, blobs: list[bytes], target_version: int, target_checksum: str, how: str = "given"
    ) -> dict:
        """Apply delta blobs inside a keep-mode pause and verify the served checksum; restore on failure."""
        from deploy.registry.delta import DeltaError  # noqa: PLC0415 torch: via deploy.registry.delta, for swaps only

        from_v, from_sum = self.gw.version, self.gw.checksum
        try:  # cheap refusal before pausing: the chain must start at the served weights and end at the target
            ends = chain_ends(blobs, from_sum, target_checksum)
        except DeltaError as e:
            msg = f"delta refused before pausing: {e}"
            await _report_error(self, from_v, target_version, msg, restored=True)
            self.metrics.swaps.labels(outcome="refused").inc()
            raise SwapError(msg) from e
        self.work_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, blob in enumerate(blobs):
            p = self.work_dir / f"{os.getpid()}-{from_v}-{target_version}-{i}.delta"
            p.write_bytes(blob)
            paths.append(p)
        via = self.cfg.serving.swap_via
        if via == "alternate":
            via = ("vllm", "liverl")[self._swaps_made % 2]
        self._swaps_made += 1
        rec: dict[str, Any] = {
            "node": self.name,
            "from": from_v,
            "to": target_version,
            "how": how,
            "via": via,
            "deltas": len(paths),
            "verify_ok": False,
        }
        error: SwapError | None = None
        rec["called_at"] = time.time()  # when the node was asked to swap (``ts``: when the record was written)
        t_call = time.perf_counter()
        try:
            try:
                r = await self.node.swap(
                    [(str(p), e) for p, e in zip(paths, ends, strict=True)],
                    (from_v, from_sum),
                    (target_version, target_checksum),
                    via=via,
                )
            except Exception as e:  # noqa: BLE001 whatever the call did (HTTP error, no answer), the weights say what happened
                r = await after_lost_swap(self.node, e, from_v, from_sum, target_version, target_checksum)
            rec["call_ms"] = round((time.perf_counter() - t_call) * 1e3, 3)
            rec["inflight"] = r.get("inflight")  # requests frozen by this swap (kept, not dropped), counted in the node
            rec["pause_ms"] = r.get("pause_ms")  # measured in the node: the time the engine stepped no request
            rec["pause_wall"] = r.get("pause_wall")
            rec.update({k: v for k, v in (r.get("phases") or {}).items()})
            rec["apply_ms"] = (r.get("phases") or {}).get("apply_ms")
            rec["worker"] = r.get("worker")
            if r.get("resume_error"):
                self.gw.unhealthy_reason = f"vLLM did not resume after a swap: {r['resume_error']}"
                error = SwapError(self.gw.unhealthy_reason, restored=False)
            if r.get("ok"):
                rec["verify_ok"] = True
                self.metrics.verified.set_to_current_time()
                self.gw.set_served(target_version, r["checksum"])
            else:
                rec["restored"] = r.get("restored")
                if r.get("restored") is False:
                    self.gw.unhealthy_reason = (
                        f"swap failed and the previous weights could not be restored: {r.get('error')}"
                    )
                    log.critical("node %s: %s", self.name, self.gw.unhealthy_reason)
                else:
                    self.gw.set_served(from_v, from_sum)
                error = error or SwapError(str(r.get("error")), restored=r.get("restored") is not False)
        finally:
            for p in paths:
                p.unlink(missing_ok=True)
        rec["ts"] = time.time()
        if rec.get("pause_ms") is not None:
            self.last_swap_pause_ms = rec["pause_ms"]
            self.metrics.pause.observe(rec["pause_ms"] / 1e3)
        self.metrics.swaps.labels(outcome="ok" if error is None else "failed").inc()
        await self._flush()
        self.swaps.append(rec)
        await self.redis.rpush(keys.swaps(self.prefix), keys.SwapRecord.model_validate(rec).to_json())
        await self.redis.ltrim(keys.swaps(self.prefix), -keys.LIST_CAP, -1)
        if error is not None:
            await _report_error(self, from_v, target_version, str(error), restored=error.restored)
            raise error
        log.info(
            "swapped %d -> %d (%s): engine paused %.1f ms (apply %.1f, verify %.1f), call %.1f ms, "
            "%d request(s) frozen",
            from_v,
            target_version,
            how,
            rec["pause_ms"] or -1,
            rec["apply_ms"] or 0,
            rec.get("verify_ms") or 0,
            rec["call_ms"],
            rec["inflight"],
        )
        await self.heartbeat()
        self.fleet_record.swapped(target_version, target_checksum)
        await self.fleet_record.flush()
        return rec


async def _report_error(agent: Agent, from_v: int | None, to_v: int, error: str, restored: bool) -> None:
    """A failed swap into ``<prefix>:swap_errors`` (capped at ``keys.LIST_CAP``); a Redis failure is logged."""
    entry = keys.SwapErrorRecord.model_validate(
        {"node": agent.name, "from": from_v, "to": to_v, "error": error, "restored": restored}
    )
    try:
        await agent.redis.rpush(keys.swap_errors(agent.prefix), entry.to_json())
        await agent.redis.ltrim(keys.swap_errors(agent.prefix), -keys.LIST_CAP, -1)
    except (RedisError, OSError) as e:
        log.error("could not report swap error to Redis (%s): %s", e, entry)


def chain_ends(blobs: list[bytes], start_checksum: str, target_checksum: str) -> list[str]:
    """Checksum reached after each delta of a chain that starts at ``start_checksum``; raises DeltaError if the
    chain is empty, does not connect, or does not end at ``target_checksum`` (headers only: cheap)."""
    from deploy.registry.delta import DeltaError, read_header  # noqa: PLC0415 torch: via deploy.registry.delta, for swaps only

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
            raise DeltaError(
                f"delta #{i} ({h.base_version}<->{h.target_version}) does not apply to weights at "
                f"checksum {cur[:12]} (it joins {h.base_checksum[:12]} and {h.target_checksum[:12]})"
            )
        ends.append(cur)
    if cur != target_checksum:
        raise DeltaError(f"the deltas lead to checksum {cur[:12]}, not the target {target_checksum[:12]}")
    return ends


def plan_swap(registry, max_chain: int, cur_v: int, ann: VersionAnnouncement) -> tuple[list[bytes], str]:
    """The delta blobs that move a node from ``cur_v`` to ``ann`` (in order) and how they were obtained: stored
    deltas along the version tree when the chain is at most ``max_chain`` long, else one encoded from
    registry-materialized weights. Raises unless the registry has the announced checksum and calls the version what
    its channel needs (``stable`` on desired, ``canary`` on canary)."""
    from deploy.registry.delta import encode_delta  # noqa: PLC0415 torch: via deploy.registry.delta, for swaps only

    if registry is None:
        raise RuntimeError("no registry configured")
    row = registry.get(ann.version)
    if row.checksum != ann.checksum:
        raise RuntimeError(
            f"announced checksum {ann.checksum[:12]} differs from the registry's "
            f"{row.checksum[:12]} for version {ann.version}"
        )
    want = "canary" if ann.channel == "canary" else "stable"  # the channel the reader verified it came on
    if row.status != want:  # Redis says what to serve; the registry what may be served
        raise RuntimeError(
            f"version {ann.version} is {row.status} in the registry, not {want}: refusing to serve "
            f"it on the {ann.channel} channel (only a promotion or a rollback makes a version "
            "servable as desired, and only the gate's canary on the canary channel)"
        )
    path_len = sum(map(len, registry.path(cur_v, ann.version)))
    if path_len <= max_chain:
        return registry.deltas_between(cur_v, ann.version), f"stored x{path_len}"
    log.info(
        "no short chain of stored deltas from %d to %d (%d steps): encoding one delta from "
        "registry-materialized weights",
        cur_v,
        ann.version,
        path_len,
    )
    base, target = registry.materialize(cur_v), registry.materialize(ann.version)
    return [encode_delta(base, target, cur_v, ann.version)], "encoded"


async def after_lost_swap(
    node: NodeClient, e: Exception, from_v: int, from_sum: str, target_version: int, target_checksum: str
) -> dict:
    """The swap call failed or its answer was lost: resume the engine (harmless if it runs) and read the served
    checksum back; the node's state decides what the gateway labels. Shaped like the node's answer."""
    log.error("swap call %d -> %d failed: %s; reading the served weights back", from_v, target_version, e)
    out: dict[str, Any] = {"ok": False, "error": f"swap call failed: {e}", "pause_ms": None}
    try:
        await node.resume()
        ck = await node.rpc("liverl_checksum")
    except Exception as e2:  # noqa: BLE001 - reported: the node is then unhealthy
        out.update(restored=False, resume_error=f"{e2}")
        return out
    if ck.get("ok") and ck["checksum"] == target_checksum:
        await node.set_weight_version(target_version)
        out.update(ok=True, checksum=ck["checksum"])
    else:
        out["restored"] = bool(ck.get("ok") and ck["checksum"] == from_sum)
    return out
