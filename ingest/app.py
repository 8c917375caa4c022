"""The ingest worker: join live feedback with the generation it judges, shape a reward, emit samples.

Inputs (raw bytes, JSON per ``liverl.core.schemas``), both keyed by ``generation_id`` so they are co-partitioned:
``<prefix>.generations`` (the serving tier logs every generation) and ``<prefix>.feedback`` (the product
reports a user's accept / reject / edit). Outputs: ``<prefix>.samples`` (one ``TrainingSample`` per judged
generation, ``sample_id = generation_id``), ``<prefix>.heldout`` (the same, for a fixed hash-share of generations,
``ingest.heldout_share``: the gate's off-policy evidence, never trained on) and ``<prefix>.dead-letters`` (every
refused input, with why).

How it runs: one Kafka consumer group, ``<prefix>-ingest`` (aiokafka; the range assignor gives a worker the same
partition numbers of both inputs, so a generation and its feedback meet in one worker). The worker takes records
in batches of up to ``BATCH_MAX`` (``getmany``) and, per batch:

1. ``ingest.join`` decides every event against the join table (``ingest.table``: one database per partition,
   RocksDB by default, kept by a compacted changelog topic) and the table writes of batches decided before it;
2. the batch's samples and dead letters go to the broker as one record batch per partition, and are acknowledged;
3. once the batch before it is settled, its counters go to Redis (the live counters exactly once per
   ``feedback_id``) and its table changes join the table's write buffer;
4. about once a second (``TABLE_FLUSH_S``, or sooner when the buffer holds ``TABLE_BUFFER_WRITES`` entries or
   ``TABLE_BUFFER_BYTES``), the buffer goes to the changelog, is acknowledged, then to the databases (with the
   changelog offset it reaches, in the same write); only then are the input offsets of the batches it holds
   committed.

Steps 2-4 run in the background while the next batch is decided (``SETTLING_MAX`` batches at most): the worker's
CPU decides while the broker and Redis answer. Batches settle in the order they were decided. The write buffer is
Kafka Streams' record cache: a generation written waiting and judged within the same second reaches the changelog
and the database once, as judged (on the bench's backlog 1.4-1.9 changelog records per judged generation instead of
2). A kill -9 replays at most the input of the unflushed buffer, as it replays an unsettled batch.

Why not faust's stream and table machinery (the first design): faust hands records to an agent one by one and
produces one by one; on the demo's records its consume path alone tops out near 6,000 pairs/s on one core, a
third of the target (``liverl bench ingest`` measures it beside this worker). Batches cost a few microseconds a
record at each step.

Guarantee: at-least-once delivery, effects exactly once. A kill -9 at any step replays the uncommitted batch: an
input either joins again (the learner dedupes the re-sent sample by ``sample_id``) or is a duplicate of a
judgement whose sample the broker has (the table never says "judged" before the broker has the sample); the live
counters dedupe by ``feedback_id``. When the broker or Redis fails, the worker exits at once (code
``EXIT_INFRA``) without committing, so a supervisor restarts it and the batch is replayed. An event that fails on
its own is dead-lettered ``internal_error`` and the batch goes on.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

from ingest.join import InfraError, Ingest, Source
from ingest.metrics import IngestMetrics
from ingest.table import MAX_BATCH_BYTES, MAX_REQUEST_BYTES, JoinTable, Outbox, changelog_topic, warm_hashes
from liverl.core.bus import aiokafka_security
from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.ingest")

BATCH_MAX = 5000  # input records per batch: one produce round trip per output topic-partition, one Redis script call
POLL_TIMEOUT_MS = 100  # the most a poll waits for records (then the timers run)
FETCH_MAX_WAIT_MS = 100  # the broker's long-poll wait: the added latency at low load
EVICT_INTERVAL_S = 60.0  # how often the table is scanned for expiry
PRODUCER_DELIVERY_TIMEOUT_S = 120.0  # kafka-python's default delivery_timeout_ms, what generation producers use
FEEDBACK_LEAD_S = 1.0  # how far (record timestamps) feedback may be read ahead of a generations backlog
HOLD_MAX_S = 60.0  # the longest a feedback partition is held at once; then it is read freely as long again
SETTLING_MAX = 3  # batches settling at once: decisions run ahead of the broker's acknowledgements by this much
DECIDE_SLICE = 500  # input records decided between two yields to the event loop (earlier batches settle meanwhile)
TABLE_FLUSH_S = 1.0  # how often the table's write buffer goes to the changelog (then the input offsets are committed)
TABLE_BUFFER_WRITES = 50_000  # ... or sooner, once it holds this many entries
TABLE_BUFFER_BYTES = 32 << 20  # ... or this many bytes of values
EXIT_INFRA = 75  # exit code when the broker or Redis failed mid-batch (EX_TEMPFAIL: restart me)
MEMBER_FILE = "group-member-id"
LOCK_FILE = "LOCK"


def die(reason: str) -> None:
    """Stop the process now, committing nothing: the batch in hand and everything uncommitted is replayed."""
    log.critical("ingest worker stops without acknowledging its batch: %s", reason)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001, S110 - best effort before exiting
            pass
    sys.stderr.flush()
    os._exit(EXIT_INFRA)


def state_dir(cfg: LiverlConfig):
    return cfg.state_path / "ingest"


async def leave_previous_member(cfg: LiverlConfig, bootstrap: str) -> bool:
    """Ask the group coordinator to drop the consumer-group member this worker had before it was killed.

    Why: a worker that died without leaving the group (kill -9, OOM, power) stays a member until its session times
    out, and the group's next join waits for it: on the embedded broker a restarted worker then sat ~12 s before it
    was given partitions. The member id is kept in the worker's state folder (``MEMBER_FILE``), which no two
    workers share (``LOCK_FILE``). A member that is already gone is answered with an error, which is fine.
    Returns True when a leave was sent. Static membership (group.instance.id) would do this in the protocol, but
    the embedded broker does not shorten the wait for it.
    """
    from aiokafka.client import AIOKafkaClient, CoordinationType
    from aiokafka.protocol.group import LeaveGroupRequest

    path = state_dir(cfg) / MEMBER_FILE
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


class IngestWorker:
    """One ingest worker: its consumer-group member, producer, join table, web server and timers.

    ``web_port``: None uses ``cfg.ingest.web_port``; 0 disables the web server (``/metrics``, ``/healthz``).
    """

    def __init__(self, cfg: LiverlConfig, bootstrap: str, redis_url: str, *, web_port: int | None = None,
                 web_bind: str = "127.0.0.1", evict_interval_s: float = EVICT_INTERVAL_S):
        if not bootstrap:
            raise ValueError("ingest needs a Kafka bootstrap (host:port); start the stack or set broker.bootstrap")
        if not redis_url:
            raise ValueError("ingest needs a Redis URL (redis://host:port/db); start the stack or set redis.url")
        ic = cfg.ingest
        if ic.pending_ttl_s < PRODUCER_DELIVERY_TIMEOUT_S:
            log.warning("ingest.pending_ttl_s=%g s is shorter than a generation producer's delivery timeout (%g s): "
                        "feedback whose record is still being retried may be dead-lettered unknown_generation",
                        ic.pending_ttl_s, PRODUCER_DELIVERY_TIMEOUT_S)
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.security = aiokafka_security(cfg.broker)
        self.group = f"{cfg.topics.prefix}-ingest"
        self.inputs = (cfg.topics.generations, cfg.topics.feedback)
        self.web_port = ic.web_port if web_port is None else int(web_port)
        self.web_bind = web_bind
        self.evict_interval_s = evict_interval_s
        self.sweep_s = max(0.1, min(1.0, ic.pending_ttl_s / 4))
        self.state = state_dir(cfg)
        self.metrics = IngestMetrics(cfg.topics.prefix, redis_url)
        self.table = JoinTable(changelog_topic(cfg.topics.prefix), cfg.broker.partitions,
                               self.state if ic.store == "rocksdb" else None)
        self.ingest = Ingest(cfg, self.metrics, self.table, self._send, end_offset=self._end_offset,
                             assigned=self._assigned, partition_of=self.table.partition, flush=self._flush_outputs)
        self.consumer: Any = None
        self.producer: Any = None  # samples, held-out samples, dead letters
        self.outbox: Outbox | None = None
        # The join table's changelog has its own producer: a client sends one produce request per broker at a time,
        # so a second of table changes (megabytes) would hold up the next batches' samples behind it.
        self.table_producer: Any = None
        self.table_outbox: Outbox | None = None
        self.busy = asyncio.Lock()  # a batch, a timer or a rebalance callback: one at a time
        self.epoch = 0  # bumped by every rebalance: a batch fetched before one is not processed
        self.done: dict[Any, int] = {}  # next offset to commit, per input partition
        self._unflushed: dict[Any, int] = {}  # next offsets of settled batches whose table writes are still buffered
        self._flush_at = 0.0  # when the table's write buffer is next written (monotonic)
        self._table_flush: asyncio.Task | None = None  # the buffer on its way to the changelog and the databases
        self.committed: dict[Any, int] = {}
        self._committing: asyncio.Task | None = None
        self._settling: list[asyncio.Future] = []  # batches decided and not yet settled, oldest first
        self._held: dict[int, tuple[float, float]] = {}  # partitions _hold_back paused: (held record's time, since)
        # the records _hold_back kept back, per feedback partition: the consumer's position is past them (they are not
        # fetched again); _pace hands them to the next batch when it resumes the partition. Dropped only by a
        # rebalance, which moves the position back to the committed offset (before them).
        self._held_records: dict[Any, list] = {}
        self._released: dict[Any, list] = {}
        self._uncounted: Counter = Counter()  # records the consumer returned ("fetched") and held back, not counted yet
        self._free_until: dict[int, float] = {}  # partitions released after HOLD_MAX_S: not held again until then
        self.stopping = False
        self._next_sweep = 0.0
        self._next_evict = time.monotonic() + evict_interval_s
        self._lock_fd: int | None = None

    # -- the join's ports --------------------------------------------------------------------------

    def _send(self, topic: str, key: str, value: bytes):
        return self.outbox.send(topic, key, value)

    async def _flush_outputs(self) -> None:
        await self.outbox.flush()

    def _buffer_full(self) -> bool:
        t = self.table
        return len(t.buffered) >= TABLE_BUFFER_WRITES or t.buffered_bytes >= TABLE_BUFFER_BYTES

    def _table_flushing(self) -> bool:
        return self._table_flush is not None and not self._table_flush.done()

    async def _write_table(self, force: bool = False) -> None:
        """Start writing the table's write buffer when it is due (``TABLE_FLUSH_S``) or full: in the background, so
        batches go on settling into a new buffer meanwhile (one write at a time: a full buffer waits for the one in
        flight). ``force``: write it now and wait until the databases have it."""
        if self._table_flushing():
            if not (force or self._buffer_full()):
                return
            await self._table_flush
        now = time.monotonic()
        if not self.table.dirty or not (force or now >= self._flush_at or self._buffer_full()):
            return
        self._flush_at = now + TABLE_FLUSH_S
        # the settled batches whose changes this write holds: their input offsets may be committed once it is done
        self._table_flush = asyncio.ensure_future(self._flush_table(dict(self._unflushed)))
        if force:
            await self._table_flush

    async def _flush_table(self, covered: dict) -> None:
        try:
            await self.table.flush(self.table_outbox)
        except Exception as e:  # noqa: BLE001 - the broker failed: restart and replay
            die(f"writing the join table's changelog failed: {type(e).__name__}: {e}")
        self.done.update(covered)
        for tp, off in covered.items():
            if self._unflushed.get(tp) == off:
                del self._unflushed[tp]
        self._table_flush = None
        self._release(committed=bool(covered))

    def _assigned(self, partition: int) -> bool:
        from aiokafka import TopicPartition

        return TopicPartition(self.cfg.topics.feedback, partition) in self.consumer.assignment()

    async def _end_offset(self, partition: int) -> int | None:
        """The generations partition's end: the larger of the last fetch's high watermark and the broker's
        ListOffsets answer (the embedded broker's can fall short of the end, see ``ingest.table``)."""
        from aiokafka import TopicPartition

        tp = TopicPartition(self.cfg.topics.generations, partition)
        ends = [self.consumer.highwater(tp) if tp in self.consumer.assignment() else None,
                (await self.consumer.end_offsets([tp])).get(tp)]
        ends = [e for e in ends if e is not None]
        return max(ends) if ends else None

    # -- lifecycle ---------------------------------------------------------------------------------

    def _lock_state(self) -> None:
        """One worker per state folder: its databases and its remembered group member are its own."""
        self.state.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"another ingest worker uses {self.state}: give each worker its own state_dir") from None
        self._lock_fd = fd

    async def run(self) -> int:
        """Consume until SIGTERM / SIGINT (then finish the batch, commit, leave the group: exit 0)."""
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.coordinator.assignors.range import RangePartitionAssignor

        self._lock_state()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        rebalance_ms = int(float(self.cfg.broker.rebalance_timeout_s) * 1000)
        self.producer, self.table_producer = (AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, client_id=f"{self.group}{suffix}", acks="all", linger_ms=0,
            max_batch_size=MAX_BATCH_BYTES, max_request_size=MAX_REQUEST_BYTES,
            request_timeout_ms=30_000, **self.security) for suffix in ("", "-table"))
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.group, client_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS, max_partition_fetch_bytes=4 << 20,
            # Tansu completes a group join only after the rebalance timeout: keep it short or the first poll waits
            # minutes. The session timeout must not be shorter than the heartbeat cadence allows.
            rebalance_timeout_ms=rebalance_ms, session_timeout_ms=max(rebalance_ms, 6000), heartbeat_interval_ms=1000,
            partition_assignment_strategy=(RangePartitionAssignor,), **self.security)
        web = None
        await self.producer.start()
        try:
            await self.table_producer.start()
            self.outbox = Outbox(self.producer)
            self.table_outbox = Outbox(self.table_producer)
            self.consumer.subscribe(list(self.inputs), listener=_listener(self))
            await self.consumer.start()
            web = await self._start_web()
            log.info("ingest worker up: group %s, inputs %s, store %s", self.group, ", ".join(self.inputs),
                     self.cfg.ingest.store)
            while not self.stopping:
                epoch = self.epoch
                try:
                    got = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=BATCH_MAX)
                except Exception as e:  # noqa: BLE001 - the broker failed: restart and replay
                    die(f"consuming failed: {type(e).__name__}: {e}")
                async with self.busy:
                    self._uncounted["fetched"] += sum(len(msgs) for msgs in got.values())
                    if self._released and epoch == self.epoch and self.ingest.ready:
                        got = self._with_released(got)
                    if got and epoch == self.epoch and self.ingest.ready:
                        await self._batch(got)
                    if epoch == self.epoch and self.ingest.ready:
                        await self._pace()
                    if self.ingest.ready and self._timers_due():
                        await self._drain()
                        await self._timers()
            async with self.busy:
                await self._drain()
                await self._commit_now()
            log.info("ingest worker stopping: offsets committed")
        finally:
            await self._close(web)
        return 0

    def stop(self) -> None:
        self.stopping = True

    async def _close(self, web) -> None:
        for what, fn in (("consumer", self.consumer.stop if self.consumer else None),
                         ("producer", self.producer.stop), ("table producer", self.table_producer.stop),
                         ("web", web.cleanup if web else None),
                         ("redis", self.metrics.close)):
            if fn is None:
                continue
            try:
                await asyncio.wait_for(fn(), 15)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.warning("stopping the %s failed: %s: %s", what, type(e).__name__, e)
        self.table.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

    # -- the batch ---------------------------------------------------------------------------------

    async def _batch(self, got: dict) -> None:
        """Decide a batch now and settle it in the background: its broker and Redis round trips overlap the next
        batch's decisions (at most ``SETTLING_MAX`` batches settle at once, in order)."""
        assignment = self.consumer.assignment()
        gens: list[tuple[Source, bytes | None]] = []
        fbs: list[tuple[Source, bytes | None]] = []
        ends = {}
        got = await self._hold_back(got, assignment)
        for tp, msgs in got.items():
            if tp not in assignment or not msgs:
                continue
            into = gens if tp.topic == self.cfg.topics.generations else fbs
            for m in msgs:
                into.append((Source(tp.topic, tp.partition, m.offset, m.key,
                                    m.timestamp / 1000.0 if m.timestamp is not None and m.timestamp >= 0 else None),
                             m.value))
            ends[tp] = msgs[-1].offset + 1
        if not ends:
            return
        warm_hashes([m.key for msgs in got.values() for m in msgs if m.key is not None])  # the join checks each
        if len(self._unsettled()) >= SETTLING_MAX:
            t0 = time.monotonic()
            while len(self._unsettled()) >= SETTLING_MAX:
                await asyncio.wait([self._settling[0]])
            self.metrics.settle_wait.inc(time.monotonic() - t0)
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
                self.ingest.decide_some(out, events[i:i + DECIDE_SLICE])
            self.ingest.end(out)
        except InfraError as e:
            die(str(e))
        except Exception as e:  # noqa: BLE001 - decide() dead-letters per event; anything here is the worker's
            log.exception("batch failed")
            die(f"{type(e).__name__}: {e}")
        self.outbox.flush()  # the batch's samples and dead letters leave now, while the previous batch settles
        prev = self._settling[-1] if self._settling else None
        self._settling.append(asyncio.ensure_future(self._settle(prev, out, ends)))

    async def _hold_back(self, got: dict, assignment) -> dict:
        """Read the two inputs of a partition in step: feedback more than ``FEEDBACK_LEAD_S`` newer (Kafka timestamps)
        than the generations read on its partition waits while that generations partition has records not read
        yet. The batch keeps the feedback up to the first such record; the records from there on are kept here
        (``_held_records``, at most one fetch per partition) and the partition paused until ``_pace`` resumes it and
        hands them to the next batch.

        Why: feedback records are a fifth of a generation record's size, so on a backlog (a worker restarted after an
        outage, a new worker catching up) a fetch brings feedback far ahead of the generations it judges. Each such
        event then waits as pending (written, read back and parsed again), and a backlog longer than
        ``ingest.max_pending`` would dead-letter feedback ``pending_full`` only because of the read order. Kafka
        Streams synchronises a join's inputs by timestamp for the same reason. Nothing is skipped (the held records
        come back in order before anything fetched after them; going back to their offset instead had the broker send
        a sixth of a backlog's records twice), and a generations partition read to its end never holds feedback. A
        partition is held ``HOLD_MAX_S`` at most and then read freely as long again, so a record with a wrong clock
        (a timestamp far ahead) cannot stall its partition's feedback while the generations never catch up.
        """
        from aiokafka import TopicPartition

        fb_topic, gen_topic = self.cfg.topics.feedback, self.cfg.topics.generations
        gens_read: dict[int, tuple[float | None, int | None]] = {}
        for tp, msgs in got.items():
            if tp.topic == gen_topic and msgs:
                gen_t, _ = self.ingest.generations_read(tp.partition)
                newest = max((m.timestamp for m in msgs if m.timestamp is not None and m.timestamp >= 0), default=-1)
                if newest >= 0:
                    gen_t = max(gen_t or 0.0, newest / 1000.0)
                gens_read[tp.partition] = (gen_t, msgs[-1].offset + 1)
        out = dict(got)
        now = time.monotonic()
        for tp, msgs in got.items():
            gen_tp = TopicPartition(gen_topic, tp.partition)
            if tp.topic != fb_topic or not msgs or tp not in assignment or gen_tp not in assignment:
                continue  # (a worker given feedback without its generations partition: logged at assignment)
            if self._free_until.get(tp.partition, 0.0) > now:
                continue
            gen_t, gen_next, end = await self._generations_progress(gen_tp, gens_read.get(tp.partition))
            if end is None or end <= gen_next:  # not fetched yet, or read to its end
                continue
            limit = -1.0 if gen_t is None else (gen_t + FEEDBACK_LEAD_S) * 1000.0
            cut = next((i for i, m in enumerate(msgs) if m.timestamp is not None and m.timestamp > limit), None)
            if cut is None:
                continue
            self._held_records[tp] = msgs[cut:]
            self._uncounted["held"] += len(msgs) - cut
            self.consumer.pause(tp)  # (records it had fetched ahead are dropped; the position stays after the held)
            self._held[tp.partition] = (msgs[cut].timestamp / 1000.0, now)
            log.debug("feedback partition %d held at offset %d: its generations are read up to %s", tp.partition,
                      msgs[cut].offset, gen_t)
            out[tp] = msgs[:cut]
        return out

    def _unhold(self, tp) -> None:
        """The partition's held records go to the next batch (before anything fetched after them)."""
        msgs = self._held_records.pop(tp, None)
        if msgs:
            self._released[tp] = self._released.get(tp, []) + msgs

    def _with_released(self, got: dict) -> dict:
        """``got`` with the records ``_pace`` released put before what was fetched after them, per partition."""
        out = dict(got)
        for tp, msgs in self._released.items():
            out[tp] = msgs + list(out.get(tp, ()))
        self._released = {}
        return out

    async def _generations_progress(self, gen_tp, read: tuple[float | None, int | None] | None = None
                                    ) -> tuple[float | None, int, int | None]:
        """(newest generation time read, next offset to read, end offset: None until the partition is fetched) of a
        generations partition; ``read`` overrides what the join has decided (a batch not decided yet)."""
        gen_t, gen_next = read or self.ingest.generations_read(gen_tp.partition)
        if gen_next is None:  # none decided since the assignment: where the consumer stands
            gen_next = await self.consumer.position(gen_tp)
        return gen_t, gen_next, self.consumer.highwater(gen_tp)

    async def _pace(self) -> None:
        """Resume held feedback partitions whose generations have caught up (``_hold_back``)."""
        if not self._held:
            return
        from aiokafka import TopicPartition

        fb_topic, gen_topic = self.cfg.topics.feedback, self.cfg.topics.generations
        assignment = self.consumer.assignment()
        resume = []
        now = time.monotonic()
        for p, (held_t, since) in list(self._held.items()):
            tp, gen_tp = TopicPartition(fb_topic, p), TopicPartition(gen_topic, p)
            if tp not in assignment or gen_tp not in assignment:
                self._held.pop(p)
                if tp in assignment:
                    resume.append(tp)
                    self._unhold(tp)
                continue
            gen_t, gen_next, end = await self._generations_progress(gen_tp)
            if now - since >= HOLD_MAX_S:
                log.warning("feedback partition %d held %.0f s behind a generations backlog that does not catch up "
                            "(record time %.3f): read freely for %.0f s", p, now - since, held_t, HOLD_MAX_S)
                self._free_until[p] = now + HOLD_MAX_S
            elif not (end is None or gen_next >= end or (gen_t is not None and gen_t + FEEDBACK_LEAD_S >= held_t)):
                continue
            resume.append(tp)
            self._held.pop(p)
            self._unhold(tp)
        if resume:
            self.consumer.resume(*resume)
        self.metrics.paced.set(len(self._held))

    async def _settle(self, prev: asyncio.Future | None, out, ends: dict) -> None:
        """Wait for the broker to have this batch's output and count it in Redis (both while earlier batches settle),
        then, after the batch decided before this one, put its changes in the table (``Ingest.apply``; the table's
        write buffer is written when due), then commit its input offsets in the background."""
        try:
            await self.ingest.acknowledged(out)
            counting = asyncio.ensure_future(self.ingest.count(out))
            try:
                if prev is not None:
                    await prev
                self.ingest.apply(out)
                await self._write_table()
            finally:
                await counting
        except InfraError as e:
            die(str(e))
        except Exception as e:  # noqa: BLE001 - anything here is the worker's
            log.exception("settling a batch failed")
            die(f"{type(e).__name__}: {e}")
        self._unflushed.update(ends)  # (after the count: an offset is committed only once Redis has the batch)
        self._release()

    def _release(self, committed: bool = False) -> None:
        """Once the table holds no buffered change and none is on its way, the input offsets of every settled batch
        may be committed (in the background: the next batch need not wait). ``committed``: ``done`` just grew."""
        if self._unflushed and not self.table.dirty and not self._table_flushing():
            self.done.update(self._unflushed)
            self._unflushed.clear()
            committed = True
        if committed and (self._committing is None or self._committing.done()):
            self._committing = asyncio.ensure_future(self._commit())

    def _unsettled(self) -> list[asyncio.Future]:
        """The settling batches, oldest first (the finished ones dropped here, not by a done callback: awaiting a
        finished task does not yield to the loop, so a loop waiting for such a callback would spin forever)."""
        self._settling = [t for t in self._settling if not t.done()]
        return self._settling

    async def _drain(self) -> None:
        """Wait until every decided batch is settled and the table's write buffer is written (before a timer, a
        rebalance or a stop)."""
        while self._unsettled():
            await asyncio.wait(self._settling)
        await self._write_table(force=True)
        if self._table_flushing():  # (nothing was buffered, one was still on its way)
            await self._table_flush
        self._release()

    async def _commit_now(self) -> None:
        """Commit what is done, after any commit still in flight (a rebalance or a stop)."""
        if self._committing is not None:
            await asyncio.wait([self._committing])
        await self._commit()

    async def _commit(self) -> None:
        todo = {tp: off for tp, off in self.done.items() if self.committed.get(tp) != off}
        if not todo or self.consumer is None:
            return
        try:
            await self.consumer.commit(todo)
            self.committed.update(todo)
        except Exception as e:  # noqa: BLE001 - a rebalance in progress: the revoke callback commits again
            log.info("offset commit deferred (%s: %s)", type(e).__name__, e)

    def _timers_due(self) -> bool:
        """Whether a timer has work (the caller then settles every batch first: timers read the table)."""
        now = time.monotonic()
        if now >= self._next_sweep and not self.ingest.pending:  # nothing can expire: no need to stop the pipeline
            self._next_sweep = now + self.sweep_s
        if self.table.dirty and now >= self._flush_at and not self._unsettled():  # no batch came to write the buffer
            return True
        return now >= self._next_sweep or now >= self._next_evict

    async def _timers(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_s
            await self._guarded("expire_pending", self.ingest.expire_pending)
        if now >= self._next_evict:
            self._next_evict = now + self.evict_interval_s
            await self._guarded("evict_old", self.ingest.evict_old)

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

    # -- rebalances --------------------------------------------------------------------------------

    async def revoked(self, revoked) -> None:
        async with self.busy:
            self.epoch += 1
            self.ingest.ready = False
            self._drop_held()
            await self._drain()
            await self._commit_now()

    def _drop_held(self) -> None:
        """Forget the records held back: after a rebalance the consumer reads each partition again from its committed
        offset, which is before them (a held record's offset is never committed before it is processed)."""
        self._held_records.clear()
        self._released.clear()

    async def assigned(self, assigned) -> None:
        async with self.busy:
            self.epoch += 1
            await self._drain()
            t0 = time.monotonic()
            mine = set(assigned)
            parts = {tp.partition for tp in mine if tp.topic in self.inputs}
            gens = {tp.partition for tp in mine if tp.topic == self.cfg.topics.generations}
            fbs = {tp.partition for tp in mine if tp.topic == self.cfg.topics.feedback}
            if gens != fbs:
                log.error("this worker holds generations %s but feedback %s: the inputs must have the same partition "
                          "count (broker.partitions) and every worker the same subscription", sorted(gens), sorted(fbs))
            self.done = {tp: off for tp, off in self.done.items() if tp in mine}
            self._held.clear()
            self._drop_held()
            self._free_until.clear()
            paused = self.consumer.paused() & mine
            if paused:
                self.consumer.resume(*paused)
            self.metrics.paced.set(0)
            self.committed = {tp: off for tp, off in self.committed.items() if tp in mine}
            self.table.hold(parts)
            try:
                stats = await self.table.recover(self.bootstrap, self.security)
            except Exception as e:  # noqa: BLE001 - without its table the worker must not join anything
                die(f"reading the join table's changelog failed: {type(e).__name__}: {e}")
            self.ingest.recovered()
            self._remember_member()
            log.info("join table ready: partitions %s, %d changelog records read, %d feedback pending (%.2f s)",
                     stats["partitions"], stats["read"], len(self.ingest._pending), time.monotonic() - t0)

    def _remember_member(self) -> None:
        try:
            member_id = self.consumer._coordinator.member_id
        except AttributeError:
            return
        if member_id:
            path = self.state / MEMBER_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(member_id)
            os.replace(tmp, path)

    # -- web ---------------------------------------------------------------------------------------

    async def _start_web(self):
        """``/metrics`` (Prometheus) and ``/healthz``; nothing else (no view of prompts or feedback)."""
        if self.web_port <= 0:
            return None
        from aiohttp import web

        async def metrics_view(request):
            return web.Response(body=self.metrics.exposition(), headers={"Content-Type": "text/plain; version=0.0.4"})

        async def healthz(request):
            return web.json_response({"ok": True, "app": self.group, "rebalancing": not self.ingest.ready,
                                      "ready": self.ingest.ready,
                                      "partitions": sorted(self.table.parts)})

        app = web.Application()
        app.router.add_get("/metrics", metrics_view)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.web_bind, self.web_port).start()
        return runner


def _listener(worker: IngestWorker):
    from aiokafka.abc import ConsumerRebalanceListener

    class Listener(ConsumerRebalanceListener):
        async def on_partitions_revoked(self, revoked):
            await worker.revoked(revoked)

        async def on_partitions_assigned(self, assigned):
            await worker.assigned(assigned)

    return Listener()

