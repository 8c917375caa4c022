"""The ingest worker's poll loop (Kafka Streams' StreamThread): fetch a batch, pace it, decide it, hand it on.

``IngestWorker.run`` owns the consumer (group ``<prefix>-ingest``, both inputs), two producers (samples, held-out
samples and dead letters; the join table's changelog) and the web server, and loops: ``getmany`` up to ``BATCH_MAX``
records, hold back feedback that runs ahead of its generations (``ingest.pacing``), decide the batch a slice at a time
(``ingest.join``, plain calls), send its output (``ingest.outbox``) and settle it in the background while the next
batch is decided (``ingest.commit``: acknowledgement, Redis, the table's write buffer, the offset commit). Between
batches the timers run: pending feedback that waited ``pending_ttl_s`` is dead-lettered, and the table's expired
entries dropped. Rebalances are ``ingest.tasks``'. The package docstring (``ingest``) has the whole design.

Why batches rather than faust's stream and table machinery: faust hands records to an agent one by one and
produces one by one; on the demo's records its consume path alone tops out near 6,000 pairs/s on one core, a
third of the target (``liverl bench ingest`` measures it beside this worker). Batches cost a few microseconds a
record at each step.

Guarantee: at-least-once delivery, effects exactly once (the three ordering invariants of ``ingest``). When the broker
or Redis fails, the worker exits at once (code ``EXIT_INFRA``) without committing, so a supervisor restarts it and the
batch is replayed. An event that fails on its own is dead-lettered ``internal_error`` and the batch goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter

from aiokafka import TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from core.bus import make_aio_consumer, make_aio_producer
from core.config import LiverlConfig
from ingest.batch import InfraError
from ingest.commit import EXIT_INFRA, Committer, die
from ingest.erasures import ErasureRoutes
from ingest.join import Ingest
from ingest.metrics import IngestMetrics
from ingest.outbox import MAX_BATCH_BYTES, MAX_REQUEST_BYTES, Outbox
from ingest.pacing import Pacer
from ingest.records import Source
from ingest.table import JoinTable, changelog_topic, warm_hashes
from ingest.tasks import Tasks, leave_previous_member, lock_state, state_dir
from ingest.web import start_web

log = logging.getLogger("liverl.ingest")

# (the names the worker's entry point and the tests import from here)
__all__ = ["EXIT_INFRA", "IngestWorker", "die", "leave_previous_member", "state_dir"]

BATCH_MAX = 5000  # input records per batch: one produce round trip per output topic-partition, one Redis script call
POLL_TIMEOUT_MS = 100  # the most a poll waits for records (then the timers run)
FETCH_MAX_WAIT_MS = 100  # the broker's long-poll wait: the added latency at low load
EVICT_INTERVAL_S = 60.0  # how often the table's expiry index is read
DECIDE_SLICE = 500  # input records decided between two yields to the event loop (earlier batches settle meanwhile)


class IngestWorker:
    """One ingest worker: its consumer-group member, producers, join table, web server and timers.

    ``web_port``: None uses ``cfg.ingest.web_port``; 0 disables the web server (``/metrics``, ``/healthz``).
    """

    def __init__(
        self,
        cfg: LiverlConfig,
        bootstrap: str,
        redis_url: str,
        *,
        web_port: int | None = None,
        web_bind: str = "127.0.0.1",
        evict_interval_s: float = EVICT_INTERVAL_S,
    ):
        if not bootstrap:
            raise ValueError("ingest needs a Kafka bootstrap (host:port); start the stack or set broker.bootstrap")
        if not redis_url:
            raise ValueError("ingest needs a Redis URL (redis://host:port/db); start the stack or set redis.url")
        ic = cfg.ingest
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.group = f"{cfg.topics.prefix}-ingest"
        self.inputs = (cfg.topics.generations, cfg.topics.feedback)
        self.web_port = ic.web_port if web_port is None else int(web_port)
        self.web_bind = web_bind
        self.evict_interval_s = evict_interval_s
        self.sweep_s = max(0.1, min(1.0, ic.pending_ttl_s / 4))
        self.state = state_dir(cfg)
        self.metrics = IngestMetrics(cfg.topics.prefix, redis_url)
        self.erasures = ErasureRoutes(cfg)  # POST /v1/erasures: the product's requests, recorded for the gate to run
        self.table = JoinTable(
            changelog_topic(cfg.topics.prefix), cfg.broker.partitions, self.state if ic.store == "rocksdb" else None
        )
        # Samples, held-out samples and dead letters; the join table's changelog has its own producer: a client sends
        # one produce request per broker at a time, so a second of table changes (megabytes) would hold up the next
        # batches' samples behind it. (Producers and consumer are built in ``run``, on the event loop.)
        self.outbox = Outbox(None)
        self.table_outbox = Outbox(None)
        self.ingest = Ingest(cfg, self.metrics, self.table, self.outbox, partitions=cfg.broker.partitions)
        # The consumer and the parts that use it (``committer``, ``pacer``, ``tasks``) are built in ``run``, on the
        # event loop (``_connect``).
        self._uncounted: Counter = Counter()  # records the consumer returned ("fetched") and held back, not counted yet
        self.stopping = False
        self._next_sweep = 0.0
        self._next_evict = time.monotonic() + evict_interval_s
        self._lock_fd: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def _connect(self) -> None:
        """Build the clients (on the running loop) and the parts that use the consumer."""
        b, broker = self.bootstrap, self.cfg.broker
        for outbox, suffix in ((self.outbox, ""), (self.table_outbox, "-table")):
            outbox.producer = make_aio_producer(
                b, broker, f"{self.group}{suffix}", max_batch_size=MAX_BATCH_BYTES, max_request_size=MAX_REQUEST_BYTES
            )
        self.consumer = make_aio_consumer(
            b,
            broker,
            self.group,
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            max_partition_fetch_bytes=4 << 20,
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        cfg, ingest = self.cfg, self.ingest
        self.committer = Committer(ingest, self.table, self.table_outbox, self.consumer)
        self.pacer = Pacer(
            self.consumer, ingest.generations_read, self.metrics, cfg.topics.generations, cfg.topics.feedback
        )
        self.tasks = Tasks(
            cfg,
            self.bootstrap,
            self.consumer,
            self.table,
            self.committer,
            self.pacer,
            self.state,
            revoked=ingest.revoked,
            restore=ingest.restore,
        )

    async def run(self) -> int:
        """Consume until SIGTERM / SIGINT (then finish the batch, commit, leave the group: exit 0)."""
        self._lock_fd = lock_state(self.state)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        self._connect()
        web = None
        await self.outbox.producer.start()
        try:
            await self.table_outbox.producer.start()
            self.consumer.subscribe(list(self.inputs), listener=self.tasks)
            await self.consumer.start()
            web = await start_web(
                self.metrics.exposition, self.health, self.web_bind, self.web_port, routes=self.erasures
            )
            log.info(
                "ingest worker up: group %s, inputs %s, store %s",
                self.group,
                ", ".join(self.inputs),
                self.cfg.ingest.store,
            )
            await self._loop()
            async with self.tasks.busy:
                await self.committer.drain()
                await self.committer.commit_now()
            log.info("ingest worker stopping: offsets committed")
        finally:
            await self._close(web)
        return 0

    async def _loop(self) -> None:
        tasks, ingest = self.tasks, self.ingest
        while not self.stopping:
            epoch = tasks.epoch
            try:
                got = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_MAX)
            except Exception as e:  # noqa: BLE001 - the broker failed: restart and replay
                die(f"consuming failed: {type(e).__name__}: {e}")
            async with tasks.busy:
                self._uncounted["fetched"] += sum(len(msgs) for msgs in got.values())
                current = epoch == tasks.epoch and ingest.ready  # (a batch fetched before a rebalance is dropped)
                if current and self.pacer.has_released():
                    got = self.pacer.with_released(got)
                if got and current:
                    await self._batch(got)
                if current:
                    await self.pacer.pace()
                if ingest.ready and self._timers_due():
                    await self.committer.drain()
                    await self._timers()

    def stop(self) -> None:
        self.stopping = True

    async def _close(self, web) -> None:
        for what, fn in (
            ("consumer", self.consumer.stop),
            ("producer", self.outbox.producer.stop if self.outbox.producer else None),
            ("table producer", self.table_outbox.producer.stop if self.table_outbox.producer else None),
            ("web", web.cleanup if web else None),
            ("redis", self.metrics.close),
        ):
            if fn is None:
                continue
            try:
                await asyncio.wait_for(fn(), 15)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.warning("stopping the %s failed: %s: %s", what, type(e).__name__, e)
        self.table.close()
        self.erasures.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    # -- the batch ---------------------------------------------------------------------------------

    async def _batch(self, got: dict) -> None:
        """Decide a batch now and settle it in the background: its broker and Redis round trips overlap the next
        batch's decisions (at most ``ingest.commit.SETTLING_MAX`` batches settle at once, in order)."""
        assignment = self.consumer.assignment()
        gens: list[tuple[Source, bytes | None]] = []
        fbs: list[tuple[Source, bytes | None]] = []
        ends = {}
        got, held = await self.pacer.hold_back(got, assignment)
        self._uncounted["held"] += held
        for tp, msgs in got.items():
            if tp not in assignment or not msgs:
                continue
            into = gens if tp.topic == self.cfg.topics.generations else fbs
            for m in msgs:
                into.append(
                    (
                        Source(
                            tp.topic,
                            tp.partition,
                            m.offset,
                            m.key,
                            m.timestamp / 1000.0 if m.timestamp is not None and m.timestamp >= 0 else None,
                        ),
                        m.value,
                    )
                )
            ends[tp] = msgs[-1].offset + 1
        if not ends:
            return
        warm_hashes([m.key for msgs in got.values() for m in msgs if m.key is not None])  # the join checks each
        waited = await self.committer.room()
        if waited:
            self.metrics.settle_wait.inc(waited)
        try:
            # generations first: feedback in the same batch then finds its record waiting instead of pending
            events = gens + fbs
            out = self.ingest.begin()
            # the records the consumer returned and those held back (a batch that held back all it got: the next counts)
            out.tally.counts.update(self._uncounted)
            self._uncounted.clear()
            for i in range(0, len(events), DECIDE_SLICE):
                if i:  # the settling batches' acknowledgements and round trips are handled now, not after the batch
                    await asyncio.sleep(0)
                part = events[i : i + DECIDE_SLICE]
                # the users' keys on a thread: a slow registry holds up this batch, never the loop's heartbeats
                prefetched = await self.ingest.prefetch_keys(out, part)
                self.ingest.decide_some(out, part, prefetched)
            self.ingest.end(out)
        except InfraError as e:
            die(str(e))
        except Exception as e:  # noqa: BLE001 - decide() dead-letters per event; anything here is the worker's
            log.exception("batch failed")
            die(f"{type(e).__name__}: {e}")
        self.outbox.flush()  # the batch's samples and dead letters leave now, while the previous batch settles
        self.committer.add(out, ends)

    # -- timers ------------------------------------------------------------------------------------

    def _timers_due(self) -> bool:
        """Whether a timer has work (the caller then settles every batch first: timers read the table)."""
        now = time.monotonic()
        if now >= self._next_sweep and not self.ingest.pending:  # nothing can expire: no need to stop the pipeline
            self._next_sweep = now + self.sweep_s
        if self.committer.flush_due():  # no batch came to write the buffer
            return True
        return now >= self._next_sweep or now >= self._next_evict

    async def _timers(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_s
            await self._guarded("expire_pending", self._expire_pending)
        if now >= self._next_evict:
            self._next_evict = now + self.evict_interval_s
            await self._guarded("evict_old", self.ingest.evict_old)

    async def _expire_pending(self) -> int:
        """The join's pending sweep, given what it needs of the consumer as values: the feedback partitions held and
        the end offsets of the generations partitions it asks about."""
        now, held = time.time(), self.tasks.feedback_partitions
        ends = {p: await self._end_offset(p) for p in self.ingest.ends_needed(now, held)}
        return await self.ingest.expire_pending(now, assigned=held, ends=ends)

    async def _end_offset(self, partition: int) -> int | None:
        """The generations partition's end: the larger of the last fetch's high watermark and the broker's
        ListOffsets answer (the embedded broker's can fall short of the end, see ``ingest.restore``)."""
        tp = TopicPartition(self.cfg.topics.generations, partition)
        ends = [
            self.consumer.highwater(tp) if tp in self.consumer.assignment() else None,
            (await self.consumer.end_offsets([tp])).get(tp),
        ]
        ends = [e for e in ends if e is not None]
        return max(ends) if ends else None

    async def _guarded(self, name: str, fn) -> None:
        """Run a timer body and write what it changed: an infrastructure failure stops the worker, anything else is
        logged and counted (the timer runs again at its next interval)."""
        try:
            await fn()
            await self.table.flush(self.table_outbox)
        except InfraError as e:
            die(f"{name}: {e}")
        except asyncio.CancelledError:
            raise
        except Exception:
            if self.table.dirty:  # changes half made: replaying from the committed offsets is the safe way out
                log.exception("timer %s failed with table changes unwritten", name)
                die(f"timer {name} failed with table changes unwritten")
            log.exception("timer %s failed; it runs again at its next interval", name)
            self.metrics.timer_errors.labels(name).inc()

    # -- web ---------------------------------------------------------------------------------------

    def health(self) -> dict:
        return {
            "ok": True,
            "app": self.group,
            "rebalancing": not self.ingest.ready,
            "ready": self.ingest.ready,
            "stopping": self.stopping,
            "partitions": sorted(self.table.parts),
        }
