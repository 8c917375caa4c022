"""The join of the ingest stage: one table entry per generation id, one decision per input event.

The logic here knows nothing of Kafka and never calls back into the worker: it reads and writes a
``MutableMapping[str, bytes]`` (``ingest.table`` in production, a dict in the property tests), hands its output to an
``Output`` (``ingest.batch``; ``ingest.outbox.Outbox`` in production), and takes what it needs of the consumer as
values (the assigned partitions and the generations partitions' end offsets, ``expire_pending``). Everything per event
is plain calls (``ingest.decide``); only a batch's end awaits (the broker, the table, Redis): a coroutine per step per
event would cost a tenth of the worker's time.

``Ingest`` holds the join's state and is its one door: ``ingest.app`` decides batches through it, ``ingest.commit``
settles them through ``Settle`` (its three settling methods), ``ingest.pacing`` reads ``generations_read`` and
``ingest.tasks`` calls ``revoked`` and ``restore``. Its parts: the decisions (``ingest.decide``), the pending index
(``ingest.pending``), the output (``ingest.batch``), eviction (``ingest.evict``).

One entry per generation id, so that every state change of a generation is one write to one changelog
partition (ordered, all or nothing):

==========  =========================================================================================
``W``       waiting: what a join needs of the generation record (``record_parts``), no feedback yet
``P``       pending: feedback that came before its record (canonical JSON) and where it came from
``J``       judged: the judgement only (feedback id, version, kind, the user's unit), so redelivered feedback is a
            duplicate and a different judgement of the same generation is dead-lettered ``already_judged``; the
            time written is the judgement's (a revert rewrites the entry with it); ``b`` the per-user sums'
            bucket, of the feedback's own time (``records.judged_bucket``: ingest's lag moves no judgement across
            buckets); ``m`` when the generation's tokens came from more than one version
            (``GenerationRecord.mixed_versions``): its sample trains, but it counts for no version (live counters,
            per-user sums), only in ``mixed_versions``
==========  =========================================================================================

A batch's table writes are held back until the broker has acknowledged the batch's samples and dead letters
(later events of the batch see them). So the table never says "judged" for a sample the broker does not have:
a kill -9 before the writes leaves the entry waiting or pending, and the replayed input joins again (the learner
dedupes the re-sent sample by ``sample_id``); a kill -9 after them replays inputs that are now duplicates.

An entry is ``kind|t|meta-json\\npayload-json``: the kind and the time it was written are read without parsing
JSON, so the timers scan cheaply. Entries are built from re-serialised, validated models (never the raw input
bytes), and every entry is checked against ``MAX_RECORD_BYTES`` before it is written.

Failure handling, per event: an input that does not parse or validate is dead-lettered with the parser's reason;
an input larger than ``ingest.max_event_bytes`` is dead-lettered ``too_large`` unparsed; any other exception while
handling one event dead-letters that event ``internal_error`` (counted) and the batch goes on. Failures of the
infrastructure (the broker refusing output, Redis unreachable) raise ``InfraError``: the caller must then stop the
worker without acknowledging the batch, so the uncommitted offsets are replayed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from core.config import LiverlConfig
from core.product import load_product
from core.shred import UserKeys, open_user_keys
from ingest.batch import Batch, Emitter, InfraError, Output, count_in_redis
from ingest.decide import Decider
from ingest.entry import JUDGED, PENDING, WAITING, head, pack, pending_info, unpack
from ingest.evict import EVICT_MAX, evict_old
from ingest.metrics import IngestMetrics
from ingest.pending import PENDING_HARD_LIMIT_X, PendingIndex, pending_in
from ingest.records import (
    DEAD_VALUE_BYTES,
    MAX_RECORD_BYTES,
    REVERT_SUFFIX,
    Source,
    is_heldout,
    record_parts,
    sample_json,
)

# (names of the join's parts the tests and tools import from here)
__all__ = [
    "DEAD_VALUE_BYTES",
    "JUDGED",
    "MAX_RECORD_BYTES",
    "PENDING",
    "PENDING_HARD_LIMIT_X",
    "REVERT_SUFFIX",
    "WAITING",
    "InfraError",
    "Ingest",
    "Output",
    "Source",
    "head",
    "is_heldout",
    "pack",
    "record_parts",
    "sample_json",
    "unpack",
]


class Ingest:
    """The join's state (the table, the pending index, the batches decided ahead of their settling) and its
    decisions. One caller at a time: the worker decides, settles and runs its timers in turn (``ingest.app``)."""

    def __init__(
        self,
        cfg: LiverlConfig,
        metrics: IngestMetrics,
        table: MutableMapping[str, bytes],
        output: Output,
        *,
        partitions: int | None = None,
        user_keys: UserKeys | None | bool = True,
    ):
        """``output``: where samples and dead letters go (``ingest.outbox.Outbox``; a recorder in the property tests).
        ``partitions``: the inputs' partition count, to refuse input on the wrong partition (``wrong_partition``);
        None: not checked. ``user_keys``: the users' data keys that open sealed generations (``ingest.sealing``);
        True: the registry's, when the config has a key-encryption key (``core.shred.load_kek``); None: none."""
        if user_keys is True:
            user_keys = open_user_keys(cfg)
        self.ic = cfg.ingest
        self.product = load_product(cfg)  # reward shaping is the product's (default: [ingest.rewards])
        self.metrics = metrics
        self.table = table
        self.index = PendingIndex()  # bounded by ``max_pending``; rebuilt by ``recovered``/``restore``
        self.emitter = Emitter(output, cfg.topics.dead_letters)
        self.user_keys = user_keys or None
        self.decider = Decider(
            self.ic, cfg.topics, self.product, table, self.index, self.emitter, partitions, self.user_keys
        )
        self.ready = False  # the indexes are rebuilt for the partitions the worker holds
        self._key_pool: ThreadPoolExecutor | None = None  # reads the users' keys (``prefetch_keys``)

    # -- lifecycle ---------------------------------------------------------------------------------

    def recovered(self, entries: Callable[[], Any] | None = None) -> None:
        """The table holds this worker's partitions again (after a start or a rebalance): rebuild the indexes.

        ``entries``: (generation id, entry) pairs to rebuild from instead of the table (tests). The worker calls
        ``restore``, which does the same a chunk at a time (``PendingIndex.rebuild`` says what waiting then counts
        from).
        """
        if entries is not None:
            found = [(gid, pending_info(v)) for gid, v in entries() if v[:1] == PENDING]
        else:
            found = list(pending_in(self.table))
        self._rebuilt(found)

    async def restore(self, chunk: int = 10_000) -> int:
        """``recovered``, reading the table's pending index (O(pending entries), never the whole table) a chunk at a
        time with the event loop's other work in between (the consumer group's heartbeats). Returns how much
        feedback is pending."""
        found = []
        for gid, info in pending_in(self.table):
            found.append((gid, info))
            if len(found) % chunk == 0:
                await asyncio.sleep(0)
        self._rebuilt(found)
        return len(self.index)

    def _rebuilt(self, found: list) -> None:
        self.index.rebuild(found)
        self.decider.reset()  # (nothing ahead: the worker settles every batch before a rebalance)
        self.ready = True
        self.metrics.pending.set(len(self.index))

    def revoked(self) -> None:
        """The worker's partitions are being taken away: nothing is decided until ``restore``."""
        self.ready = False

    # -- a batch -----------------------------------------------------------------------------------

    async def process(self, events: Sequence[tuple[Source, bytes | None]], now: float | None = None) -> None:
        """Handle a batch; raises ``InfraError`` (and only that) when the batch must not be acknowledged."""
        await self.settle(self.decide(events, now))

    def decide(self, events: Sequence[tuple[Source, bytes | None]], now: float | None = None) -> Batch:
        """Decide every event of a batch (plain calls, no waiting); ``settle`` then makes the batch's effects durable.

        Batches may be decided ahead of their settling (the worker decides batch N+1 while N's output and table
        writes are on their way): a decided batch's table writes are read by later decisions until its ``settle``
        has put them in the table. Settle batches in the order they were decided, one at a time.
        Raises ``InfraError`` when an output could not be queued.

        In parts: ``begin``, ``decide_some`` for each slice of the events, ``end``. Between slices the caller may
        yield to the event loop (earlier batches settle meanwhile; no other decision may run).
        """
        out = self.begin(now)
        self.decide_some(out, events)
        return self.end(out)

    def begin(self, now: float | None = None) -> Batch:
        return Batch(now=time.time() if now is None else now)

    def decide_some(self, out: Batch, events: Sequence[tuple[Source, bytes | None]], prefetched: bool = False) -> None:
        self.decider.decide_some(out, events, prefetched)

    async def prefetch_keys(self, out: Batch, events: Sequence[tuple[Source, bytes | None]]) -> bool:
        """Read the users' keys that deciding ``events`` will need (``ingest.sealing``) on a thread of the join's own,
        so that a registry database slow to answer, or cut off, holds up this batch but never the event loop (the
        consumer's heartbeats, the settling batches, the probes). Returns whether it read them (False: no keys)."""
        units = self.decider.units_for(out, events)
        if units is None or self.decider.keys is None:
            return False
        if self._key_pool is None:
            self._key_pool = ThreadPoolExecutor(1, thread_name_prefix="liverl-ingest-keys")
        await asyncio.get_running_loop().run_in_executor(self._key_pool, self.decider.keys.prefetch, units)
        return True

    def end(self, out: Batch) -> Batch:
        """The batch is decided: later batches read its table writes until it is settled."""
        return self.decider.end(out)

    # -- settling (``ingest.batch.Settle``) ----------------------------------------------------------

    async def settle(self, out: Batch) -> None:
        """Wait until the broker has the batch's output, then put its writes in the table, then count (Redis +
        Prometheus). Making the table's writes durable is the caller's (``JoinTable.flush``, after this).

        In parts, for a caller that overlaps batches (``ingest.commit``): ``acknowledged``, then ``apply`` (in the order
        the batches were decided), and ``count`` once acknowledged (any order: the live counters are guarded by
        feedback id, the rest are operational; neither needs the table's write: a replay heals either way)."""
        await self.acknowledged(out)
        self.apply(out)
        await self.count(out)

    async def acknowledged(self, out: Batch) -> None:
        """Wait until the broker has the batch's samples and dead letters."""
        await self.emitter.sent(out)
        out.tally.inc("samples_out", out.samples)
        out.samples = 0

    def apply(self, out: Batch) -> None:
        """Put an acknowledged batch's writes in the table (its write buffer) and the pending index."""
        ahead, table, index = self.decider.ahead, self.table, self.index
        for gid, entry in out.writes.items():
            if gid in ahead and ahead[gid] is entry:  # no later decided batch changed it since: the table has it now
                del ahead[gid]
            if entry is None:
                table.pop(gid, None)
                index.pop(gid)
                continue
            table[gid] = entry
            index.put(gid, entry)
        out.writes.clear()
        self.decider.ahead_pending -= out.new_pending
        out.new_pending = 0
        index.settled()
        self.metrics.pending.set(len(index))

    async def count(self, out: Batch) -> None:
        """Write an acknowledged batch's counters to Redis (the live counters once per feedback id) and Prometheus."""
        await count_in_redis(self.metrics, out.tally, retry_s=self.ic.redis_retry_s, unit_ttl_s=self.ic.unit_ttl_s)

    # -- what the worker reads -----------------------------------------------------------------------

    def generations_read(self, partition: int) -> tuple[float | None, int | None]:
        """(timestamp of the newest generation record, offset after the last one) decided on ``partition`` since the
        last rebalance; None where none was."""
        return self.index.generations_read(partition)

    @property
    def pending(self) -> int:
        """Feedback waiting for its generation (settled batches)."""
        return len(self.index)

    # -- timers ------------------------------------------------------------------------------------

    def ends_needed(self, now: float, assigned: Collection[int] | None = None) -> set[int]:
        """The generations partitions whose end offset ``expire_pending`` needs at ``now``: where feedback has waited a
        TTL and the partition's clock has not passed it (whether it was read to its end then decides)."""
        return self.index.ends_needed(now, self.ic.pending_ttl_s, assigned)

    async def expire_pending(
        self,
        now: float | None = None,
        *,
        assigned: Collection[int] | None = None,
        ends: Mapping[int, int | None] | None = None,
    ) -> int:
        """Dead-letter feedback whose generation did not arrive within ``pending_ttl_s`` (``PendingIndex.waited``).

        ``assigned``: the input partitions this worker holds (None: all); feedback of others is left alone. ``ends``:
        the end offsets of the generations partitions ``ends_needed`` named (None: count every partition as read to
        its end). Values, not callbacks into the worker: the worker asks the broker, the join decides."""
        now = time.time() if now is None else now
        ttl = self.ic.pending_ttl_s
        expired = self.index.expired(now, ttl, assigned, ends)
        if not expired:
            return 0
        out = Batch()
        gone = []
        for gid in expired:
            entry = self.table.get(gid)
            if entry is None or entry[:1] != PENDING:  # joined meanwhile (the index is only a hint)
                self.index.pop(gid)
                continue
            _, _, meta, payload = unpack(entry)
            topic, partition, offset, key = meta["src"]
            self.emitter.dead(
                out,
                "unknown_generation",
                f"no generation record {gid} arrived within {ttl:g} s of the feedback",
                Source(topic, partition, offset, key),
                payload,
            )
            gone.append(gid)
        # Dead letters first, deletion after: a crash in between repeats the dead letter, never loses it.
        await self.emitter.sent(out)
        for gid in gone:
            self.table.pop(gid, None)
            self.index.pop(gid)
        await self.settle(out)
        return len(gone)

    async def evict_old(self, now: float | None = None, chunk: int = 2000, limit: int = EVICT_MAX) -> int:
        """The table's entries past their TTLs dropped, old accepts' samples cut (``ingest.evict``); returns how many
        entries were dropped."""
        return await evict_old(self.table, self.ic, self.metrics, now, chunk, limit)
