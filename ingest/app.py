"""The ingest stream processor: join live feedback with the generation it judges, shape a reward, emit samples.

Inputs (raw bytes, JSON per ``liverl.core.schemas``), both keyed by ``generation_id`` so they are co-partitioned:
``<prefix>.generations`` (the serving tier logs every generation) and ``<prefix>.feedback`` (the product
reports a user's accept / reject / edit). Outputs: ``<prefix>.samples`` (one ``TrainingSample`` per judged
generation, ``sample_id = generation_id``) and ``<prefix>.dead-letters`` (every refused input, with why).

Why tables rather than a join operator: faust-streaming's stream-stream join raises NotImplementedError, and
feedback can arrive before the generation record (two producers, two topics). So the join is state keyed by
``generation_id``, kept in two faust tables (memory store, recovered from their changelog topics on
restart):

- ``generations``: the record while it waits for feedback (dropped unjudged after ``generation_ttl_s``),
  then, once joined, the judgement that was used (kept ``judged_ttl_s``), so that a redelivered feedback_id
  is dropped (``duplicates``) and a *different* feedback for the same generation is dead-lettered
  ``already_judged`` (one sample per generation: the first judgement wins);
- ``pending``: feedback that came first; it waits ``cfg.ingest.pending_ttl_s`` and is then dead-lettered
  ``unknown_generation`` by a timer (measured against the generations stream's progress, so a lagging
  generations stream does not expire feedback whose record is still in the backlog).

Guarantee: at-least-once. One agent consumes both topics in batches; a batch's samples and dead letters are
acknowledged by the broker and its counters written to Redis before its offsets are acknowledged, so a
crash replays the batch; the learner dedupes samples by ``sample_id``, the live counters dedupe by
``feedback_id``. Tables use the producer's partitioner (murmur2 of the generation id, the same as
kafka-python and aiokafka use for the inputs), so their changelog partitions line up with the input
partitions and the timer may modify them too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import faust

from ingest.metrics import IngestMetrics, Tally
from liverl.core.config import LiverlConfig
from liverl.core.schemas import DeadLetter, FeedbackEvent, GenerationRecord, TrainingSample, WireError

log = logging.getLogger("liverl.ingest")

GENERATION_TTL_S = 6 * 3600.0  # a generation nobody judged within this is dropped (no sample, no reward)
JUDGED_TTL_S = 24 * 3600.0  # how long redelivered / late feedback is recognised as a duplicate
EVICT_INTERVAL_S = 60.0  # how often the (large) generations table is scanned for expiry
BATCH_MAX = 200  # events per processing batch (one Redis round trip and one ack wait per batch)
BATCH_WITHIN_S = 0.05  # the most a batch waits to fill: the added latency at low load
PENDING_HARD_LIMIT_X = 10  # early feedback is dropped after this many TTLs even if generations still lag


@dataclass
class _Batch:
    """Output of one batch: broker futures to wait on, then counter increments to apply."""

    tally: Tally = field(default_factory=Tally)
    sample_futs: list[Any] = field(default_factory=list)
    other_futs: list[Any] = field(default_factory=list)


class Ingest:
    """The join logic over faust tables. Every method runs under ``self.lock`` (agent batch or timer)."""

    def __init__(self, app: faust.App, cfg: LiverlConfig, metrics: IngestMetrics, *, generation_ttl_s: float,
                 judged_ttl_s: float):
        t = cfg.topics
        n = cfg.broker.partitions
        raw = {"key_type": str, "key_serializer": "raw", "value_serializer": "raw", "partitions": n}
        self.cfg = cfg
        self.metrics = metrics
        self.generation_ttl_s = generation_ttl_s
        self.judged_ttl_s = judged_ttl_s
        self.inputs = app.topic(t.generations, t.feedback, **raw)
        self.samples_topic = app.topic(t.samples, **raw)
        self.dead_topic = app.topic(t.dead_letters, **raw)
        schema = faust.Schema(key_type=str, key_serializer="raw", value_serializer="json")
        tbl = {"schema": schema, "key_type": str, "partitions": n, "use_partitioner": True}
        # One entry per generation through its life: {"t", "g": record JSON} while it waits for feedback,
        # then {"t", "f": feedback_id, "v": policy_version, "k": kind} once judged (the record is dropped).
        # One table rather than two halves the changelog writes of a join.
        self.state = app.Table("generations", help="generation_id -> waiting record or judgement", **tbl)
        # Feedback that came before its generation: {"t", "f", "raw", "src": [topic, partition, offset, key]}.
        # Small, so the timer scans it often.
        self.pending = app.Table("pending", help="generation_id -> early feedback", **tbl)
        self.lock = asyncio.Lock()
        # Progress of the generations stream per partition, so that a *lagging* generations stream does not
        # expire feedback whose generation is still in the backlog: Kafka timestamp (s) of the newest
        # generation record processed, and the wall time one last arrived.
        self._gen_clock: dict[int, float] = {}
        self._gen_seen: dict[int, float] = {}
        self._started = time.time()

    # -- per event ---------------------------------------------------------------------------------

    async def process(self, events: list) -> None:
        out = _Batch()
        now = time.time()
        for ev in events:
            if ev.message.topic == self.cfg.topics.generations:
                await self._on_generation(ev, out, now)
            else:
                await self._on_feedback(ev, out, now)
        await self._settle(out)

    async def _on_generation(self, ev, out: _Batch, now: float) -> None:
        out.tally.inc("generations_in")
        part, kts = ev.message.partition, ev.message.timestamp or now
        self._gen_seen[part] = now
        self._gen_clock[part] = max(self._gen_clock.get(part, 0.0), kts)
        try:
            rec = GenerationRecord.from_bytes(ev.value)
        except WireError as e:
            await self._dead(out, e.reason, e.detail, ev.message.topic, ev.message.partition, ev.message.offset,
                             ev.key, ev.value)
            return
        gid = rec.generation_id
        if gid in self.state:  # waiting or judged: a redelivery (or a reused id: never trained on twice)
            out.tally.inc("generation_duplicates")
            return
        early = self.pending.get(gid)
        if early is not None:
            del self.pending[gid]
            await self._join(rec, FeedbackEvent.model_validate_json(early["raw"]), out, now)
            return
        self.state[gid] = {"t": now, "g": _text(ev.value)}

    async def _on_feedback(self, ev, out: _Batch, now: float) -> None:
        out.tally.inc("feedback_in")
        src = (ev.message.topic, ev.message.partition, ev.message.offset, ev.key, ev.value)
        try:
            fb = FeedbackEvent.from_bytes(ev.value)
        except WireError as e:
            await self._dead(out, e.reason, e.detail, *src)
            return
        gid, fid = fb.generation_id, fb.feedback_id
        entry = self.state.get(gid)
        if entry is not None and "f" in entry:
            if entry["f"] == fid:
                out.tally.inc("duplicates")
                out.tally.live.append((fid, entry["v"], entry["k"]))  # idempotent; heals a crash before Redis
            else:
                await self._dead(out, "already_judged",
                                 f"generation {gid} was already judged by feedback {entry['f']}", *src)
            return
        if entry is not None:
            await self._join(GenerationRecord.model_validate_json(entry["g"]), fb, out, now)
            return
        early = self.pending.get(gid)
        if early is None:
            key = ev.key.decode("utf-8", "replace") if isinstance(ev.key, bytes) else ev.key
            self.pending[gid] = {"t": now, "kts": ev.message.timestamp or now, "f": fid, "raw": _text(ev.value),
                                 "src": [ev.message.topic, ev.message.partition, ev.message.offset, key]}
        elif early["f"] == fid:
            out.tally.inc("duplicates")
        else:
            await self._dead(out, "already_judged",
                             f"generation {gid} already has feedback {early['f']} waiting for it", *src)

    async def _join(self, rec: GenerationRecord, fb: FeedbackEvent, out: _Batch, now: float) -> None:
        gid = rec.generation_id
        sample = TrainingSample(
            sample_id=gid, generation_id=gid, feedback_id=fb.feedback_id, policy_version=rec.policy_version,
            kind=fb.kind, reward=float(getattr(self.cfg.ingest.rewards, fb.kind)), segment=fb.segment,
            prompt_token_ids=rec.prompt_token_ids, completion_token_ids=rec.completion_token_ids,
            behaviour_logprobs=rec.completion_logprobs, edited_text=fb.edited_text,
            ts_generation=rec.ts, ts_feedback=fb.ts,
        )
        self.state[gid] = {"t": now, "f": fb.feedback_id, "v": rec.policy_version, "k": fb.kind}
        out.sample_futs.append(await self.samples_topic.send(key=gid, value=sample.to_bytes()))
        out.tally.inc("joined")
        out.tally.joined_kinds[fb.kind] += 1
        out.tally.live.append((fb.feedback_id, rec.policy_version, fb.kind))
        out.tally.feedback_delays_s.append(now - fb.ts)

    async def _dead(self, out: _Batch, reason: str, detail: str, topic: str, partition: int | None,
                    offset: int | None, key: Any, value: bytes | str) -> None:
        key_s = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        letter = DeadLetter(reason=reason, detail=detail, source_topic=topic, partition=partition, offset=offset,
                            key=key_s, value=_text(value))
        log.debug("dead letter %s: %s (%s[%s]@%s)", reason, detail, topic, partition, offset)
        out.other_futs.append(await self.dead_topic.send(key=key_s, value=letter.to_bytes()))
        out.tally.inc(f"dlq:{reason}")

    async def _settle(self, out: _Batch) -> None:
        """Wait until the broker has the batch's output, then count it (Redis + Prometheus)."""
        if out.sample_futs or out.other_futs:
            await asyncio.gather(*out.sample_futs, *out.other_futs)
        out.tally.inc("samples_out", len(out.sample_futs))
        await self.metrics.apply(out.tally)
        self.metrics.pending.set(len(self.pending))
        self.metrics.tracked.set(len(self.state))

    # -- timers ------------------------------------------------------------------------------------

    def _expired(self, p: dict, now: float, ttl: float) -> bool:
        """Has this feedback waited ``ttl`` for its generation, with the generations stream not lagging?

        Waiting ``ttl`` of wall time is not enough on its own: when the generations stream lags the feedback
        stream (a backlog after a restart, a slow partition) the record may still be on its way. So the
        feedback also needs the generations partition it is co-partitioned with to have moved ``ttl`` past
        the feedback's own timestamp, or to have been quiet for ``ttl`` (caught up). A hard limit of
        ``PENDING_HARD_LIMIT_X`` x ``ttl`` (at least 10 min) bounds memory if a partition never catches up.
        """
        waited = now - p["t"]
        if waited < ttl:
            return False
        if waited >= max(PENDING_HARD_LIMIT_X * ttl, 600.0):
            return True
        part = p["src"][1]
        clock = self._gen_clock.get(part)
        if clock is not None and clock >= p.get("kts", p["t"]) + ttl:
            return True
        return now - self._gen_seen.get(part, self._started) >= ttl

    async def expire_pending(self, now: float | None = None) -> int:
        """Dead-letter feedback whose generation did not arrive within ``pending_ttl_s``."""
        now = time.time() if now is None else now
        ttl = self.cfg.ingest.pending_ttl_s
        expired = [(gid, p) for gid, p in list(self.pending.items()) if self._expired(p, now, ttl)]
        if not expired:
            return 0
        out = _Batch()
        for gid, p in expired:
            topic, partition, offset, key = p["src"]
            await self._dead(out, "unknown_generation",
                             f"no generation record {gid} arrived within {ttl:g} s of the feedback",
                             topic, partition, offset, key, p["raw"])
        # Dead letters first, deletion after: a crash in between repeats the dead letter, never loses it.
        await asyncio.gather(*out.other_futs)
        out.other_futs.clear()
        for gid, _ in expired:
            self.pending.pop(gid, None)
        await self._settle(out)
        return len(expired)

    async def evict_old(self, now: float | None = None) -> int:
        """Drop unjudged generations and old judgements past their TTLs (bounded memory)."""
        now = time.time() if now is None else now
        unjudged = judged = 0
        for gid, v in list(self.state.items()):
            if "g" in v and now - v["t"] >= self.generation_ttl_s:
                unjudged += 1
            elif "f" in v and now - v["t"] >= self.judged_ttl_s:
                judged += 1
            else:
                continue
            self.state.pop(gid, None)
        if unjudged:
            tally = Tally()
            tally.inc("generations_expired", unjudged)
            await self.metrics.apply(tally)
        self.metrics.tracked.set(len(self.state))
        return unjudged + judged


async def _log_end_offsets(bootstrap: str, reported: Mapping[Any, int | None]) -> dict[Any, int | None]:
    """The true log end offset of each partition, from a fetch response's high watermark.

    Why: the embedded Tansu broker answers ListOffsets(latest) with the base offset of the last record
    *batch* + 1, not the offset after its last record; faust's table recovery reads changelogs up to that
    answer, so the tail of the last batch (several table updates when the producer batched them) would be
    silently lost on restart. A fetch response carries the correct high watermark. On Apache Kafka the two
    agree and this costs one short fetch per changelog partition at rebalance time.
    """
    from aiokafka import AIOKafkaConsumer

    tps = list(reported)
    if not tps:
        return dict(reported)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, max((reported[tp] or 0) - 1, 0))
        deadline = time.monotonic() + 10.0
        while any(consumer.highwater(tp) is None for tp in tps) and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200, max_records=1)
        out: dict[Any, int | None] = {}
        for tp in tps:
            hw = consumer.highwater(tp)
            if hw is None:
                log.warning("no high watermark for %s within 10 s; using the broker's end offset %s", tp, reported[tp])
            out[tp] = reported[tp] if hw is None else max(hw, reported[tp] or 0)
        return out
    finally:
        await consumer.stop()


def _use_true_end_offsets(app: faust.App, bootstrap: str) -> None:
    """Make the app's consumer report fetch-based end offsets to table recovery (see ``_log_end_offsets``)."""
    make_consumer = app._new_consumer

    def new_consumer():
        consumer = make_consumer()
        broker_end_offsets = consumer.highwaters

        async def highwaters(*partitions):
            return await _log_end_offsets(bootstrap, await broker_end_offsets(*partitions))

        consumer.highwaters = highwaters
        return consumer

    app._new_consumer = new_consumer


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def build_app(cfg: LiverlConfig, bootstrap: str, redis_url: str, *, web_port: int | None = None,
              web_bind: str = "127.0.0.1", generation_ttl_s: float = GENERATION_TTL_S,
              judged_ttl_s: float = JUDGED_TTL_S, evict_interval_s: float = EVICT_INTERVAL_S) -> faust.App:
    """The faust app of the ingest stage (consumer group ``<prefix>-ingest``).

    ``web_port``: None uses ``cfg.ingest.web_port``; 0 disables the web server (and ``/metrics``).
    """
    if not bootstrap:
        raise ValueError("ingest needs a Kafka bootstrap (host:port); start the stack or set broker.bootstrap")
    if not redis_url:
        raise ValueError("ingest needs a Redis URL (redis://host:port/db); start the stack or set redis.url")
    prefix = cfg.topics.prefix
    port = cfg.ingest.web_port if web_port is None else int(web_port)
    rebalance_s = float(cfg.broker.rebalance_timeout_s)
    datadir = cfg.state_path / "faust"
    datadir.mkdir(parents=True, exist_ok=True)  # faust creates only the last level
    app = faust.App(
        f"{prefix}-ingest",
        broker=f"kafka://{bootstrap}",
        store="memory://",
        autodiscover=False,
        datadir=str(datadir),
        topic_partitions=cfg.broker.partitions,
        topic_replication_factor=1,
        # Tansu completes a group join only after the rebalance timeout: keep it short or the first poll
        # waits minutes. Session timeout must not be shorter than the heartbeat cadence allows.
        broker_rebalance_timeout=rebalance_s,
        broker_session_timeout=max(rebalance_s, 6.0),
        broker_heartbeat_interval=1.0,
        processing_guarantee="at_least_once",
        # Batch produce requests a little: a batch's output is awaited as a whole anyway, and fewer
        # requests is most of what a small machine can save per event.
        producer_linger=0.005,
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=port > 0,
        web_port=port if port > 0 else 6066,
        web_bind=web_bind,
        web_host=web_bind,
    )
    _use_true_end_offsets(app, bootstrap)
    metrics = IngestMetrics(prefix, redis_url)
    ingest = Ingest(app, cfg, metrics, generation_ttl_s=generation_ttl_s, judged_ttl_s=judged_ttl_s)
    app.liverl_ingest = ingest  # for tests and embedding

    @app.agent(ingest.inputs, name="join")
    async def join(stream):
        # A batch writes up to ~BATCH_MAX changelog records before it yields; faust's default buffer bound
        # (100) would make it stall and warn on every batch. The bound stays: 4 batches' worth.
        app.producer.buffer.max_messages = max(app.producer.buffer.max_messages, 4 * BATCH_MAX)
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            async with ingest.lock:
                await ingest.process(list(events))

    sweep_s = max(0.1, min(1.0, cfg.ingest.pending_ttl_s / 4))

    @app.timer(interval=sweep_s, name="expire_pending")
    async def expire_pending():
        if app.rebalancing:
            return
        async with ingest.lock:
            await ingest.expire_pending()

    @app.timer(interval=evict_interval_s, name="evict_old")
    async def evict_old():
        if app.rebalancing:
            return
        async with ingest.lock:
            await ingest.evict_old()

    @app.page("/metrics")
    async def metrics_view(web, request):
        return web.bytes(metrics.exposition(), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web, request):
        return web.json({"ok": True, "app": app.conf.id, "rebalancing": bool(app.rebalancing)})

    @app.on_before_shutdown.connect
    async def _close_redis(sender, **kwargs):
        await metrics.close()

    return app
