"""The ingest stream processor: join live feedback with the generation it judges, shape a reward, emit samples.

Inputs (raw bytes, JSON per ``liverl.core.schemas``), both keyed by ``generation_id`` so they are co-partitioned:
``<prefix>.generations`` (the serving tier logs every generation) and ``<prefix>.feedback`` (the product
reports a user's accept / reject / edit). Outputs: ``<prefix>.samples`` (one ``TrainingSample`` per judged
generation, ``sample_id = generation_id``), ``<prefix>.heldout`` (the same, for a fixed hash-share of generations,
``ingest.heldout_share``: the gate's off-policy evidence, never trained on) and ``<prefix>.dead-letters`` (every
refused input, with why).

Why a table rather than a join operator: faust-streaming's stream-stream join raises NotImplementedError, and
feedback can arrive before the generation record (two producers, two topics). So the join is state keyed by
``generation_id`` in one faust table, ``join`` (``ingest.join`` describes its entries and decisions), kept in
RocksDB under ``<state_dir>/faust`` (``ingest.store = "rocksdb"``, the default: a restart reads only the tail of
the changelog) or in memory (rebuilt from the whole changelog on every start).

Guarantee: at-least-once, nothing dropped silently. One agent consumes both topics in batches; a batch's samples
and dead letters are acknowledged by the broker and its counters written to Redis before its offsets are
acknowledged. An event that fails is dead-lettered on its own (``internal_error``), the batch goes on. When the
broker or Redis fails, the worker exits at once (code ``EXIT_INFRA``) without acknowledging the batch, because
faust acknowledges a batch whose agent raises: the uncommitted offsets are replayed after the restart. The
batch's table writes wait for the broker to have its samples, so a kill -9 at any moment loses nothing: a replayed
input either joins again (the learner dedupes the re-sent sample by ``sample_id``) or is a duplicate of a judgement
whose sample the broker has; the live counters dedupe by ``feedback_id``. The table uses the producer's partitioner (murmur2 of
the generation id, as kafka-python and aiokafka use for the inputs), so its changelog partitions line up with the
input partitions; the timers look only at partitions this worker is assigned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import faust
from faust.types import TP

from ingest import store as _store
from ingest.join import InfraError, Ingest, Source, key_text
from ingest.metrics import IngestMetrics
from liverl.core.bus import aiokafka_security, faust_credentials
from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.ingest")

BATCH_MAX = 200  # events per processing batch (one Redis round trip and one ack wait per batch)
BATCH_WITHIN_S = 0.05  # the most a batch waits to fill: the added latency at low load
FETCH_MAX_WAIT_MS = 200  # consumer long-poll wait (faust's own is 1.5 s, see _shorter_fetch_wait)
STALL_CHECK_S = 1.0  # how often the stall watchdog looks
STALL_AFTER_S = 3.0  # input waiting beyond the committed offsets, and no batch for this long: re-seek
EVICT_INTERVAL_S = 60.0  # how often the table is scanned for expiry
PRODUCER_DELIVERY_TIMEOUT_S = 120.0  # kafka-python's default delivery_timeout_ms, what generation producers use
EXIT_INFRA = 75  # exit code when the broker or Redis failed mid-batch (EX_TEMPFAIL: restart me)
STOP_GRACE_S = 30.0  # on shutdown, how long a batch in progress may take to finish


def die(reason: str) -> None:
    """Stop the process now, acknowledging nothing: the batch in hand and everything uncommitted is replayed."""
    log.critical("ingest worker stops without acknowledging its batch: %s", reason)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001, S110 - best effort before exiting
            pass
    sys.stderr.flush()
    os._exit(EXIT_INFRA)


async def _log_end_offsets(bootstrap: str, reported: Mapping[Any, int | None],
                           security: Mapping[str, Any] | None = None) -> dict[Any, int | None]:
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
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100,
                                **(security or {}))
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


def _use_true_end_offsets(app: faust.App, bootstrap: str, on_ends=None, security: Mapping[str, Any] | None = None) -> None:
    """Make the app's consumer report fetch-based end offsets to table recovery (see ``_log_end_offsets``)."""
    make_consumer = app._new_consumer

    def new_consumer():
        consumer = make_consumer()
        broker_end_offsets = consumer.highwaters
        consumer.liverl_listed_end_offsets = broker_end_offsets
        _shorter_fetch_wait(consumer)

        async def highwaters(*partitions):
            ends = await _log_end_offsets(bootstrap, await broker_end_offsets(*partitions), security)
            if on_ends is not None:
                on_ends(ends)
            return ends

        consumer.highwaters = highwaters
        return consumer

    app._new_consumer = new_consumer


MEMBER_FILE = "group-member-id"


async def leave_previous_member(cfg: LiverlConfig, bootstrap: str) -> bool:
    """Ask the group coordinator to drop the consumer-group member this worker had before it was killed.

    Why: a worker that died without leaving the group (kill -9, OOM, power) stays a member until its session times
    out, and the group's next join waits for it: on the embedded broker a restarted worker then sat ~12 s before it
    was given partitions. The member id is kept in the worker's state folder (``remember_member``), which no two
    workers share (RocksDB locks it). A member that is already gone is answered with an error, which is fine.
    Returns True when a leave was sent. Static membership (group.instance.id) would do this in the protocol, but
    the embedded broker does not shorten the wait for it.
    """
    from aiokafka.client import AIOKafkaClient, CoordinationType
    from aiokafka.protocol.group import LeaveGroupRequest

    path = cfg.state_path / "faust" / MEMBER_FILE
    try:
        member_id = path.read_text().strip()
    except OSError:
        return False
    if not member_id:
        return False
    group = f"{cfg.topics.prefix}-ingest"
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **aiokafka_security(cfg.broker))
    try:
        await client.bootstrap()
        node = await client.coordinator_lookup(CoordinationType.GROUP, group)
        await client.send(node, LeaveGroupRequest(group, member_id))
        log.info("asked the coordinator to drop this worker's previous group member %s", member_id)
        return True
    except Exception as e:  # noqa: BLE001 - best effort: without it the join only waits longer
        log.info("previous group member %s not dropped (%s: %s); the group join waits for its session",
                 member_id, type(e).__name__, e)
        return False
    finally:
        await client.close()


def _remember_member(app: faust.App, cfg: LiverlConfig) -> None:
    try:
        member_id = app.consumer._thread._consumer._coordinator.member_id
    except AttributeError:
        return
    if member_id:
        path = cfg.state_path / "faust" / MEMBER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(member_id)
        os.replace(tmp, path)


def _shorter_fetch_wait(consumer) -> None:
    """Fetch with a ``FETCH_MAX_WAIT_MS`` long poll instead of faust's fixed 1.5 s.

    Why: a broker that holds a fetch for its whole wait (the embedded Tansu broker does) makes every round of
    table recovery and every quiet-time event wait up to that long; a restarted worker pays it several times before
    it joins again. The cost is a few more (empty) fetch requests per second when idle.
    """
    thread = getattr(consumer, "_thread", None)
    make = getattr(thread, "_create_worker_consumer", None)
    if make is None:
        log.warning("faust's consumer has no _create_worker_consumer; keeping its 1.5 s fetch wait")
        return

    def create(transport):
        client = make(transport)
        client._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # read when the consumer starts its fetcher
        return client

    thread._create_worker_consumer = create


def build_app(cfg: LiverlConfig, bootstrap: str, redis_url: str, *, web_port: int | None = None,
              web_bind: str = "127.0.0.1", evict_interval_s: float = EVICT_INTERVAL_S) -> faust.App:
    """The faust app of the ingest stage (consumer group ``<prefix>-ingest``).

    ``web_port``: None uses ``cfg.ingest.web_port``; 0 disables the web server (and ``/metrics``). The web server
    serves only ``/metrics`` and ``/healthz``: faust's table and router views are off (they would show prompts and
    feedback to anyone who can reach the port).
    """
    if not bootstrap:
        raise ValueError("ingest needs a Kafka bootstrap (host:port); start the stack or set broker.bootstrap")
    if not redis_url:
        raise ValueError("ingest needs a Redis URL (redis://host:port/db); start the stack or set redis.url")
    ic = cfg.ingest
    if ic.pending_ttl_s < PRODUCER_DELIVERY_TIMEOUT_S:
        log.warning("ingest.pending_ttl_s=%g s is shorter than a generation producer's delivery timeout (%g s): "
                    "feedback whose record is still being retried may be dead-lettered unknown_generation",
                    ic.pending_ttl_s, PRODUCER_DELIVERY_TIMEOUT_S)
    prefix = cfg.topics.prefix
    port = ic.web_port if web_port is None else int(web_port)
    rebalance_s = float(cfg.broker.rebalance_timeout_s)
    datadir = cfg.state_path / "faust"
    datadir.mkdir(parents=True, exist_ok=True)  # faust creates only the last level
    store = f"{_store.register()}://" if ic.store == "rocksdb" else "memory://"
    app = faust.App(
        f"{prefix}-ingest",
        broker=f"kafka://{bootstrap}",
        broker_credentials=faust_credentials(cfg.broker),
        store=store,
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
        web_tables_enabled=False,
        web_router_enabled=False,
    )
    tables: list = []  # the join table, once built (the end-offset check below needs it)
    _use_true_end_offsets(app, bootstrap, on_ends=lambda ends: [_drop_foreign_state(app, t, ends) for t in tables],
                          security=aiokafka_security(cfg.broker))
    metrics = IngestMetrics(prefix, redis_url)
    t = cfg.topics
    n = cfg.broker.partitions
    raw = {"key_type": str, "key_serializer": "raw", "value_serializer": "raw", "partitions": n}
    inputs = app.topic(t.generations, t.feedback, **raw)
    outputs = {name: app.topic(name, **raw) for name in (t.samples, t.heldout, t.dead_letters)}
    # RocksDB defaults are sized for a dedicated machine (2 GiB block cache); the join table needs far less.
    options = {"block_cache_size": 64 << 20, "write_buffer_size": 16 << 20, "max_write_buffer_number": 2}
    table = app.Table("join", help="generation_id -> waiting record, pending feedback or judgement",
                      key_type=str, value_type=bytes, partitions=n, use_partitioner=True,
                      schema=faust.Schema(key_type=str, key_serializer="raw", value_serializer="raw"),
                      options=options if ic.store == "rocksdb" else None)
    if ic.store == "rocksdb":
        tables.append(table)

    async def send(topic: str, key: str, value: bytes):
        return await outputs[topic].send(key=key, value=value)

    async def end_offset(partition: int) -> int | None:
        """The generations partition's end: the larger of the last fetch's high watermark and the broker's
        ListOffsets answer (Tansu's can fall short of the end, see ``_log_end_offsets``)."""
        tp = TP(t.generations, partition)
        consumer = app.consumer
        ends = [consumer.highwater(tp), (await consumer.liverl_listed_end_offsets(tp)).get(tp)]
        ends = [e for e in ends if e is not None]
        return max(ends) if ends else None

    def assigned(partition: int) -> bool:
        return TP(t.feedback, partition) in app.assignor.assigned_actives()

    ingest = Ingest(cfg, metrics, table, send, end_offset=end_offset, assigned=assigned,
                    partition_of=lambda gid: _store.partition_of(gid.encode(), n))
    app.liverl_ingest = ingest  # for tests and embedding

    @table.on_recover
    async def _recovered():
        if ic.store == "memory":
            _forget_unassigned(app, table)
        t0 = time.monotonic()
        async with ingest.lock:
            ingest.recovered()
        log.info("join table ready: %d feedback pending (%.2f s)", len(ingest._pending), time.monotonic() - t0)

    @app.on_partitions_revoked.connect
    async def _revoked(sender, revoked, **kwargs):
        ingest.ready = False

    @app.on_partitions_assigned.connect
    async def _assigned(sender, assigned, **kwargs):
        _remember_member(app, cfg)

    @app.agent(inputs, name="join")
    async def join(stream):
        # A batch writes up to ~BATCH_MAX changelog records before it yields; faust's default buffer bound
        # (100) would make it stall and warn on every batch. The bound stays: 4 batches' worth.
        app.producer.buffer.max_messages = max(app.producer.buffer.max_messages, 4 * BATCH_MAX)
        async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
            batch = [(Source(ev.message.topic, ev.message.partition, ev.message.offset, key_text(ev.message.key),
                             ev.message.timestamp), ev.message.value) for ev in events]
            watchdog.busy = True
            try:
                await _run_batch(ingest, batch)
            finally:
                watchdog.busy = False
                watchdog.last_batch = time.monotonic()

    watchdog = _StallWatchdog(app, {t.generations, t.feedback})

    @table.on_recover
    async def _watch_from_now():
        watchdog.last_batch = time.monotonic()

    @app.timer(interval=STALL_CHECK_S, name="stall_watchdog")
    async def stall_watchdog():
        if not _idle():
            await _guarded(metrics, "stall_watchdog", None, watchdog.check)

    sweep_s = max(0.1, min(1.0, ic.pending_ttl_s / 4))

    def _idle() -> bool:
        return app.rebalancing or not ingest.ready

    @app.timer(interval=sweep_s, name="expire_pending")
    async def expire_pending():
        if not _idle():
            await _guarded(metrics, "expire_pending", ingest.lock, ingest.expire_pending)

    @app.timer(interval=evict_interval_s, name="evict_old")
    async def evict_old():
        if not _idle():
            await _guarded(metrics, "evict_old", None, ingest.evict_old)  # takes the lock chunk by chunk

    @app.page("/metrics")
    async def metrics_view(web, request):
        return web.bytes(metrics.exposition(), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web, request):
        return web.json({"ok": True, "app": app.conf.id, "rebalancing": bool(app.rebalancing),
                         "ready": ingest.ready})

    @app.on_before_shutdown.connect
    async def _close_redis(sender, **kwargs):
        await metrics.close()

    return app


class _StallWatchdog:
    """Re-seek the inputs to their committed offsets when records wait there but nothing is processed.

    Why: faust 0.15 can lose the records fetched while a rebalance's recovery completes (the stream buffers are
    cleared when flow resumes, after the fetcher has already moved past them), and the worker then reports
    "Worker ready" and consumes nothing until new records arrive; the records in between are never processed or
    committed. Seen on the embedded broker after restarts (about 1 in 20 in the restart loop). Checking the effect rather
    than the cause: if an input partition's end is past its committed offset and no batch ran for
    ``STALL_AFTER_S``, the inputs are sought back to their committed offsets (a replay, absorbed as duplicates).
    """

    def __init__(self, app: faust.App, topics: set[str]):
        self.app = app
        self.topics = topics
        self.last_batch = time.monotonic()
        self.busy = False  # a batch is being processed (however long it takes, that is not a stall)
        self.reseeks = 0

    async def check(self) -> None:
        if self.busy or time.monotonic() - self.last_batch < STALL_AFTER_S:
            return
        consumer = self.app.consumer
        tps = [tp for tp in consumer.assignment() if tp.topic in self.topics]
        behind = {}
        for tp in tps:
            end = consumer.highwater(tp)
            committed = consumer._committed_offset.get(tp) or 0
            if end is not None and end > committed:
                behind[tp] = (committed, end)
        if not behind:
            return
        self.reseeks += 1
        log.warning("input stalled for %.0f s with records waiting (%s); seeking the inputs back to their committed "
                    "offsets", time.monotonic() - self.last_batch,
                    ", ".join(f"{tp.topic}[{tp.partition}] {c}..{e}" for tp, (c, e) in sorted(behind.items())))
        for tp in tps:
            await consumer.seek(tp, consumer._committed_offset.get(tp) or 0)
        self.last_batch = time.monotonic()


async def _run_batch(ingest: Ingest, batch: list[tuple[Source, bytes | None]]) -> None:
    """Process one batch to the end, or stop the process; never return with the batch half done.

    faust acknowledges the batch when this returns *or raises* (``Stream.take_events`` acks in a ``finally``),
    so a failure here must not propagate: it ends the process before the acknowledgement. A shutdown that
    cancels the agent mid-batch waits for the batch to finish first.
    """

    async def work():
        async with ingest.lock:
            await ingest.process(batch)

    task = asyncio.ensure_future(work())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await asyncio.wait_for(asyncio.shield(task), STOP_GRACE_S)
        except BaseException as e:  # noqa: BLE001 - anything here means the batch is not done
            die(f"shutdown interrupted a batch ({type(e).__name__}: {e})")
        raise
    except InfraError as e:
        die(str(e))
    except BaseException as e:
        log.exception("batch failed")
        die(f"{type(e).__name__}: {e}")


async def _guarded(metrics: IngestMetrics, name: str, lock: asyncio.Lock | None, fn) -> None:
    """Run a timer body: an infrastructure failure stops the worker, anything else is logged and counted (a faust
    timer that raises would crash the whole app)."""
    try:
        if lock is None:
            await fn()
        else:
            async with lock:
                await fn()
    except InfraError as e:
        die(f"{name}: {e}")
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("timer %s failed; it runs again at its next interval", name)
        metrics.timer_errors.labels(name).inc()


def _drop_foreign_state(app: faust.App, table, ends: Mapping[Any, int | None]) -> None:
    """Empty a local partition database that is ahead of its changelog: it belongs to another history.

    A worker's RocksDB files outlive the broker's data when the broker is replaced or reset (the embedded broker
    keeps its log in memory, and a demo reuses its state folder). Its stored changelog offset is then past the
    changelog's end; its entries would be joined against generations that no longer exist, and its pending
    feedback dead-lettered for nothing (faust itself refuses to start: ConsistencyError). The changelog is the
    truth: such a database is emptied, and recovery reads the changelog from its start. Called with the end
    offsets table recovery asked for, before it compares them with the stored ones.
    """
    store = table.data
    for tp, end in ends.items():
        if tp.topic != table.changelog_topic_name or end is None:
            continue
        last = end - 1
        db = store._dbs.get(tp.partition)
        persisted = store.persisted_offset(tp) if db is not None else None
        if persisted is None or persisted <= last:
            continue
        keys = [k for k in db.keys() if k != store.offset_key]  # noqa: SIM118 - a RocksDB handle, not a dict
        for k in keys:
            db.delete(k)
        db.delete(store.offset_key)
        app.tables.recovery.active_offsets[tp] = None
        log.warning("join table partition %d: local state (changelog offset %d) is ahead of the changelog (last "
                    "offset %d), so it is from another broker history; dropped its %d entries", tp.partition,
                    persisted, last, len(keys))


def _forget_unassigned(app: faust.App, table) -> None:
    """Drop, locally and without tombstones, memory-store keys of partitions this worker no longer owns.

    faust's memory store forgets only keys it recovered from the changelog; keys this worker wrote itself for a
    partition that a rebalance gave to another worker would linger (and be acted on) otherwise.
    """
    mine = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == table.changelog_topic_name}
    n = table.partitions
    stale = [k for k in list(table.data.keys()) if _store.partition_of(k.encode(), n) not in mine]
    for k in stale:
        del table.data[k]
    if stale:
        log.info("forgot %d join entries of partitions now owned by other workers", len(stale))
