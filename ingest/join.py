"""The join of the ingest stage: one table entry per generation id, one decision per input event.

The logic here knows nothing of Kafka and never calls back into the worker: it reads and writes a
``MutableMapping[str, bytes]`` (``ingest.table`` in production, a dict in the property tests), hands its output to an
``Output`` (``send`` queues a record and returns an awaitable resolved once the broker has it, after ``flush``:
``ingest.outbox.Outbox``), and takes what it needs of the consumer as values (the assigned partitions and the
generations partitions' end offsets, ``expire_pending``). Everything
per event is plain calls; only a batch's end awaits (the broker, the table, Redis): a coroutine per step per event
was a tenth of the worker's time.
``ingest.app`` wires it to the broker; ``ingest.commit`` settles its batches.

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
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Generator, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core import keys
from core.config import LiverlConfig, redact_url
from core.product import load_product
from core.schemas import FeedbackEvent, GenerationRecord, TrainingSample, WireError
from ingest.entry import (
    ACCEPT_KEPT,
    JUDGED,
    PENDING,
    WAITING,
    expiry_class,
    head,
    ms,
    pack,
    pending_info,
    unpack,
    without_payload,
)
from ingest.metrics import IngestMetrics, Tally
from ingest.partitioner import partition_of
from ingest.records import (
    DEAD_VALUE_BYTES,
    MAX_RECORD_BYTES,
    REVERT_SUFFIX,
    Source,
    _counted_again,
    _guardrails,
    dead_letter,
    is_heldout,
    judged_bucket,
    key_text,
    legacy_parts,
    record_parts,
    sample_json,
    unit_bucket_of,
)

log = logging.getLogger("liverl.ingest")

EVICT_MAX = 200_000  # entries one expiry run drops or cuts at most (the rest wait for the next run)
PENDING_HARD_LIMIT_X = 10  # early feedback is dropped after this many TTLs even if generations still lag


class Output(Protocol):
    """Where the join's samples and dead letters go: ``send`` queues a record and returns an awaitable that resolves
    once the broker has it, after a ``flush`` (``ingest.outbox.Outbox``)."""

    def send(self, topic: str, key: str, value: bytes) -> Awaitable[Any]: ...

    def flush(self) -> Awaitable[Any]: ...


# (names of ingest.entry and ingest.records the tests and tools import from here)
__all__ = [
    "DEAD_VALUE_BYTES",
    "JUDGED",
    "MAX_RECORD_BYTES",
    "PENDING",
    "REVERT_SUFFIX",
    "WAITING",
    "InfraError",
    "Ingest",
    "Source",
    "head",
    "is_heldout",
    "legacy_parts",
    "pack",
    "record_parts",
    "sample_json",
    "unpack",
]


class InfraError(RuntimeError):
    """The broker or Redis failed: the batch must not be acknowledged (the worker stops and replays it)."""


@dataclass
class _Batch:
    tally: Tally = field(default_factory=Tally)
    futs: list[Any] = field(default_factory=list)
    samples: int = 0
    writes: dict[str, bytes | None] = field(default_factory=dict)  # table writes, applied once futs are done
    new_pending: int = 0
    now: float = 0.0  # the time the batch's decisions count as made (one for the batch)
    generations_in: int = 0
    feedback_in: int = 0


class Ingest:
    """Join state and decisions. Every coroutine runs under ``self.lock`` (agent batch or timer)."""

    def __init__(
        self,
        cfg: LiverlConfig,
        metrics: IngestMetrics,
        table: MutableMapping[str, bytes],
        output: Output,
        *,
        partitions: int | None = None,
    ):
        """``output``: where samples and dead letters go (``ingest.outbox.Outbox``; a recorder in the property tests).
        ``partitions``: the inputs' partition count, to refuse input on the wrong partition (``_misplaced``); None: not
        checked."""
        self.cfg = cfg
        self.ic = cfg.ingest
        self.product = load_product(cfg)  # reward shaping is the product's (default: [ingest.rewards])
        self.topics = cfg.topics
        # (the topic names are properties that format a string: read once, not per event)
        self._topic_generations, self._topic_samples = cfg.topics.generations, cfg.topics.samples
        self._topic_heldout, self._topic_dead = cfg.topics.heldout, cfg.topics.dead_letters
        self.metrics = metrics
        self.table = table
        self.output = output
        self._partitions = partitions
        self.lock = asyncio.Lock()
        # In-memory index of the pending entries, rebuilt by ``recovered()`` after every rebalance; bounded by
        # ``max_pending``.
        self._pending: dict[str, tuple[float, float, int | None]] = {}  # gid -> (t, kafka ts, input partition)
        self._pending_in_order = True  # whether ``_pending`` runs oldest first (it does unless a caller's clock jumps)
        self._pending_newest = 0.0
        # Progress of the generations stream per partition (bounded by the partition count): Kafka timestamp of
        # the newest record processed, and the offset after the last one processed.
        self._gen_clock: dict[int, float] = {}
        self._gen_next: dict[int, int] = {}
        # Table writes of batches decided but not settled, newest value per generation id (None: a deletion), and
        # how many of them are new pending feedback; empty whenever no batch is in flight.
        self._ahead: dict[str, bytes | None] = {}
        self._ahead_pending = 0
        self._resumed = time.time()
        self.ready = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def recovered(self, entries: Callable[[], Any] | None = None) -> None:
        """The table holds this worker's partitions again (after a start or a rebalance): rebuild the indexes.

        ``entries``: (generation id, entry) pairs to rebuild from instead of the table (tests). The worker calls
        ``restore``, which does the same a chunk at a time. Waiting starts over from now: feedback that was pending
        before a restart gets a whole TTL again, and the generations stream counts as quiet only after a TTL of this
        worker's own reading.
        """
        if entries is not None:
            found = [(gid, pending_info(v)) for gid, v in entries() if v[:1] == PENDING]
        else:
            found = list(pending_in(self.table))
        self._rebuilt(found)

    async def restore(self, chunk: int = 10_000) -> None:
        """``recovered``, reading the table's pending index (O(pending entries), never the whole table) a chunk at a
        time with the event loop's other work in between (the consumer group's heartbeats)."""
        found = []
        for gid, info in pending_in(self.table):
            found.append((gid, info))
            if len(found) % chunk == 0:
                await asyncio.sleep(0)
        self._rebuilt(found)

    def _rebuilt(self, found: list[tuple[str, tuple[float, float, int | None]]]) -> None:
        found.sort(key=lambda f: f[1][0])  # oldest first: the sweep stops at the first entry too young to expire
        self._pending = dict(found)
        self._pending_newest = found[-1][1][0] if found else 0.0
        self._pending_in_order = True
        self._gen_clock.clear()
        self._gen_next.clear()
        self._ahead.clear()  # (empty: the worker settles every batch before a rebalance)
        self._ahead_pending = 0
        self._resumed = time.time()
        self.ready = True
        self.metrics.pending.set(len(self._pending))

    # -- per event ---------------------------------------------------------------------------------

    async def process(self, events: Sequence[tuple[Source, bytes | None]], now: float | None = None) -> None:
        """Handle a batch; raises ``InfraError`` (and only that) when the batch must not be acknowledged."""
        await self.settle(self.decide(events, now))

    def decide(self, events: Sequence[tuple[Source, bytes | None]], now: float | None = None) -> _Batch:
        """Decide every event of a batch (plain calls, no waiting); ``settle`` then makes the batch's effects durable.

        Batches may be decided ahead of their settling (the worker decides batch N+1 while N's output and table
        writes are on their way): a decided batch's table writes are read by later decisions (``_ahead``) until its
        ``settle`` has put them in the table. Settle batches in the order they were decided, one at a time.
        Raises ``InfraError`` when an output could not be queued.

        In parts: ``begin``, ``decide_some`` for each slice of the events, ``end``. Between slices the caller may
        yield to the event loop (earlier batches settle meanwhile; no other decision may run).
        """
        out = self.begin(now)
        self.decide_some(out, events)
        return self.end(out)

    def begin(self, now: float | None = None) -> _Batch:
        return _Batch(now=time.time() if now is None else now)

    def decide_some(self, out: _Batch, events: Sequence[tuple[Source, bytes | None]]) -> None:
        now = out.now
        gen_topic = self._topic_generations
        gens = 0
        for src, value in events:
            try:
                if src.topic == gen_topic:
                    gens += 1
                    self._on_generation(src, value, out, now)
                else:
                    self._on_feedback(src, value, out, now)
            except InfraError:
                raise
            except Exception as e:
                log.exception("internal error on %s[%s]@%s; dead-lettered", src.topic, src.partition, src.offset)
                self._dead(out, "internal_error", f"{type(e).__name__}: {e}", src, value)
        out.generations_in += gens
        out.feedback_in += len(events) - gens

    def end(self, out: _Batch) -> _Batch:
        """The batch is decided: later batches read its table writes until it is settled."""
        self._ahead.update(out.writes)
        self._ahead_pending += out.new_pending
        for name, n in (
            ("generations_in", out.generations_in),
            ("feedback_in", out.feedback_in),
            ("joined", sum(out.tally.joined_kinds.values())),
        ):
            if n:
                out.tally.inc(name, n)
        return out

    def _parse(self, model, value: bytes | None):
        if value is None:
            return WireError("empty", "a record without a value (tombstone)")
        if len(value) > self.ic.max_event_bytes:
            return WireError("too_large", f"{len(value)} bytes > ingest.max_event_bytes {self.ic.max_event_bytes}")
        try:
            return model.from_bytes(value)
        except WireError as e:
            return e

    def _on_generation(self, src: Source, value: bytes | None, out: _Batch, now: float) -> None:
        if src.partition is not None:
            self._gen_clock[src.partition] = max(self._gen_clock.get(src.partition, 0.0), src.ts or now)
            if src.offset is not None:
                self._gen_next[src.partition] = max(self._gen_next.get(src.partition, 0), src.offset + 1)
        rec = self._parse(GenerationRecord, value)
        if isinstance(rec, WireError):
            self._dead(out, rec.reason, rec.detail, src, value)
            return
        gid = rec.generation_id
        if self._misplaced(gid, src, value, out):
            return
        entry = self._get(gid, out)
        kind = entry[:1] if entry else None
        if kind in (WAITING, JUDGED):  # a redelivery (or a reused id: never trained on twice)
            out.tally.inc("generation_duplicates")
            if kind == JUDGED:  # the replay of a join whose counters a crash may have lost: idempotent
                _, t, meta, _ = unpack(entry)
                self._count_again(out, meta, t)
            return
        parts = record_parts(rec)
        if kind == PENDING:
            _, _, meta, payload = unpack(entry)
            self._join(gid, *parts, FeedbackEvent.model_validate_json(payload), out, now, src)
            return
        new = pack(WAITING, now, *parts)
        if len(new) > MAX_RECORD_BYTES:
            self._dead(out, "too_large", f"the record's waiting entry is {len(new)} bytes", src, value)
            return
        out.writes[gid] = new

    def _on_feedback(self, src: Source, value: bytes | None, out: _Batch, now: float) -> None:
        fb = self._parse(FeedbackEvent, value)
        if isinstance(fb, WireError):
            self._dead(out, fb.reason, fb.detail, src, value)
            return
        gid, fid = fb.generation_id, fb.feedback_id
        if self._misplaced(gid, src, value, out):
            return
        entry = self._get(gid, out)
        kind = entry[:1] if entry else None
        if fb.kind == "revert":
            self._on_revert(fb, entry, kind, src, value, out, now)
            return
        if kind == JUDGED:
            _, t, meta, _ = unpack(entry)
            if meta["f"] == fid:
                out.tally.inc("duplicates")
                self._count_again(out, meta, t)  # idempotent; heals a crash
            else:
                self._dead(
                    out, "already_judged", f"generation {gid} was already judged by feedback {meta['f']}", src, value
                )
        elif kind == WAITING:
            _, _, meta, body = unpack(entry)
            if "v" not in meta:  # an entry from before entries kept parts: our own canonical JSON of the record
                meta, body = legacy_parts(body)
            self._join(gid, meta, body, fb, out, now, src)
        elif kind == PENDING:
            _, _, meta, _ = unpack(entry)
            if meta["f"] == fid:
                out.tally.inc("duplicates")
            else:
                self._dead(
                    out,
                    "already_judged",
                    f"generation {gid} already has feedback {meta['f']} waiting for it",
                    src,
                    value,
                )
        elif len(self._pending) + self._ahead_pending + out.new_pending >= self.ic.max_pending:
            self._dead(
                out,
                "pending_full",
                f"{len(self._pending)} feedback events already wait for their generation (ingest.max_pending)",
                src,
                value,
            )
        else:
            kts = src.ts or now
            meta = {"f": fid, "kts": kts, "src": [src.topic, src.partition, src.offset, key_text(src.key)]}
            out.writes[gid] = pack(PENDING, now, meta, fb.model_dump_json().encode())
            out.new_pending += 1
            out.tally.inc("pended")

    def _on_revert(
        self,
        fb: FeedbackEvent,
        entry: bytes | None,
        kind: bytes | None,
        src: Source,
        value: bytes | None,
        out: _Batch,
        now: float,
    ) -> None:
        """A follow-up on an accepted generation: counted once per generation in its version's live counters
        (``revert``), so the gate sees how many accepted answers were kept, and, when the accept trained, trains the
        correction: the accepted sample again (sample id ``<generation>:revert``) with reward ``rewards.revert``. An
        acceptance a user later undid is what a policy that games acceptance earns; the learner must see it too. When
        the accept was held out, that record goes to the held-out stream instead: the gate's off-policy check scores
        the generation with the revert's reward (``deploy.gate.offpolicy.merge_heldout``), not as the accept it was."""
        gid = fb.generation_id
        if kind != JUDGED:
            self._dead(
                out,
                "revert_unjudged",
                f"generation {gid} has no judgement to revert (a revert follows "
                f"an accept; judgements are kept ingest.judged_ttl_s)",
                src,
                value,
            )
            return
        _, t, meta, accepted = unpack(entry)  # accepted: the sample its accept trained, kept for this correction
        # counted by when, and for whom, the reverted generation was judged (an entry from before units: in '*' only)
        counted = (fb.feedback_id, meta["v"], keys.revert_field(t), unit_bucket_of(meta, t), meta.get("u"))
        mixed = bool(meta.get("m"))  # sampled by several versions: counted for none (see _join)
        if meta.get("r") == fb.feedback_id:
            out.tally.inc("duplicates")
            if not mixed:
                out.tally.live.append(counted)  # idempotent; heals a crash before Redis
        elif meta.get("r") is not None:
            self._dead(out, "already_reverted", f"generation {gid} was already reverted by {meta['r']}", src, value)
        elif meta["k"] != "accept":
            self._dead(
                out,
                "revert_unaccepted",
                f"generation {gid} was judged {meta['k']}, not accept: only an accepted generation can be reverted",
                src,
                value,
            )
        else:
            out.writes[gid] = pack(JUDGED, t, {**meta, "r": fb.feedback_id})
            out.tally.inc("reverted")
            if mixed:
                out.tally.inc("mixed_versions_reverted")
            else:
                out.tally.live.append(counted)
            if not accepted:  # not trainable, or judged more than ingest.revert_sample_ttl_s ago: counted only
                out.tally.inc("drop:revert_no_sample")
            elif len(gid) + len(REVERT_SUFFIX) <= 128:  # (ids are at most 128 characters) the correction
                s = TrainingSample.model_validate_json(accepted)
                fix = s.model_copy(
                    update={
                        "sample_id": f"{gid}{REVERT_SUFFIX}",
                        "feedback_id": fb.feedback_id,
                        "kind": "revert",
                        "reward": float(self.product.reward("revert", s.segment)),
                        "ts_feedback": fb.ts,
                    }
                )
                held = meta.get("h") == 1  # held out: the gate's stream gets the revert's reward, never the learner
                out.futs.append(
                    self._emit(
                        self._topic_heldout if held else self.topics.samples, gid, fix.model_dump_json().encode()
                    )
                )
                if held:
                    out.tally.inc("heldout_out")
                else:
                    out.samples += 1
                    out.tally.inc("revert_samples_out")

    def _join(
        self, gid: str, rec: dict[str, Any], body: bytes, fb: FeedbackEvent, out: _Batch, now: float, src: Source
    ) -> None:
        """Judge a generation: ``rec`` and ``body`` are its validated record's ``record_parts``."""
        version = rec["v"]
        meta = {"f": fb.feedback_id, "v": version, "k": fb.kind, "n": rec["n"], "b": judged_bucket(fb.ts, now)}
        if "ms" in rec:
            meta["ms"] = rec["ms"]
        unit = rec.get("u")
        if unit is not None:  # the user, so a later revert counts in their sums too
            meta["u"] = unit
        mixed = "m" in rec  # a hot-swap mid-generation: two versions (or unknown ones) sampled its tokens
        if mixed:  # (kept in the judgement, so a redelivery or a revert is not counted for a version either)
            meta["m"] = 1
        guardrails = _guardrails(meta)
        sample = b""
        if "x" not in rec:
            sample = sample_json(gid, rec, body, fb, float(self.product.reward(fb.kind, fb.segment)))
            if len(sample) > MAX_RECORD_BYTES:
                self._dead(
                    out,
                    "sample_too_large",
                    f"the joined sample of {gid} would be {len(sample)} bytes",
                    src,
                    fb.model_dump_json().encode(),
                )
                sample = b""
        else:
            out.tally.inc("drop:not_trainable")
        heldout = is_heldout(gid, self.ic.heldout_share)
        if heldout:  # (marked: a later revert's record goes where the accept's went, whatever the share is then)
            meta["h"] = 1
        # an accepted sample is kept beside its judgement, so a later revert can train the correction (or, held
        # out, send the gate the revert's reward for it)
        keep = sample if fb.kind == "accept" else b""
        out.writes[gid] = pack(JUDGED, now, meta, keep)
        if sample:
            out.futs.append(self._emit(self._topic_heldout if heldout else self._topic_samples, gid, sample))
            if heldout:
                out.tally.inc("heldout_out")
            else:
                out.samples += 1
        out.tally.joined_kinds[fb.kind] += 1  # ("joined" is their sum, counted once per batch)
        if mixed:
            # No version may claim it: not in any version's live counters, per-user sums (keys.units) or anything
            # else the gate and the canary read. Its sample still trains (behaviour log-probs are per token).
            out.tally.inc("mixed_versions")
        else:
            out.tally.live.append((fb.feedback_id, version, fb.kind + guardrails, meta["b"], unit))
        out.tally.feedback_delays_s.append(now - fb.ts)

    @staticmethod
    def _count_again(out: _Batch, meta: dict, t: float) -> None:
        """Count a redelivered judgement again in the live counters (idempotent: guarded by its feedback id)."""
        again = _counted_again(meta, t)
        if again is not None:  # (None: a generation of mixed versions, counted for no version)
            out.tally.live.append(again)

    def _misplaced(self, gid: str, src: Source, value: bytes | None, out: _Batch) -> bool:
        """Dead-letter (``wrong_partition``) an input that is not on the partition its generation id hashes to.

        The join needs a generation and its feedback on the same partition (so one worker sees both): producers must
        key records by ``generation_id`` with Kafka's default partitioner (murmur2; librdkafka clients need
        ``partitioner=murmur2_random``). Misplaced input would join only while one worker owns every partition, and
        expire as ``unknown_generation`` once there are several; refusing it at once names the producer's mistake.
        """
        if self._partitions is None or src.partition is None:
            return False
        want = partition_of(gid.encode(), self._partitions)
        if want == src.partition:
            return False
        self._dead(
            out,
            "wrong_partition",
            f"generation {gid} belongs on partition {want} (murmur2 of the "
            f"generation id), not {src.partition}: key records by generation_id with Kafka's default "
            "partitioner (librdkafka: partitioner=murmur2_random)",
            src,
            value,
        )
        return True

    def _get(self, gid: str, out: _Batch) -> bytes | None:
        if gid in out.writes:
            return out.writes[gid]
        if gid in self._ahead:  # decided in an earlier batch that is not settled yet (None: deleted there)
            return self._ahead[gid]
        return self.table.get(gid)

    def generations_read(self, partition: int) -> tuple[float | None, int | None]:
        """(timestamp of the newest generation record, offset after the last one) decided on ``partition`` since the
        last rebalance; None where none was."""
        return self._gen_clock.get(partition), self._gen_next.get(partition)

    @property
    def pending(self) -> int:
        """Feedback waiting for its generation (settled batches)."""
        return len(self._pending)

    def _dead(self, out: _Batch, reason: str, detail: str, src: Source, value: bytes | None) -> None:
        letter = dead_letter(reason, detail, src, value)
        log.debug("dead letter %s: %s (%s[%s]@%s)", reason, letter.detail, src.topic, src.partition, src.offset)
        out.futs.append(self._emit(self.topics.dead_letters, letter.key or "", letter.to_bytes()))
        out.tally.inc(f"dlq:{reason}")

    def _emit(self, topic: str, key: str, value: bytes) -> Awaitable[Any]:
        try:
            return self.output.send(topic, key, value)
        except Exception as e:
            raise InfraError(f"producing to {topic} failed: {type(e).__name__}: {e}") from e

    async def settle(self, out: _Batch) -> None:
        """Wait until the broker has the batch's output, then put its writes in the table, then count (Redis +
        Prometheus). Making the table's writes durable is the caller's (``JoinTable.flush``, after this).

        In parts, for a caller that overlaps batches (``ingest.commit``): ``acknowledged``, then ``apply`` (in the order
        the batches were decided), and ``count`` once acknowledged (any order: the live counters are guarded by
        feedback id, the rest are operational; neither needs the table's write: a replay heals either way)."""
        await self.acknowledged(out)
        self.apply(out)
        await self.count(out)

    async def acknowledged(self, out: _Batch) -> None:
        """Wait until the broker has the batch's samples and dead letters."""
        await self._settle_futures(out)
        out.tally.inc("samples_out", out.samples)
        out.samples = 0

    def apply(self, out: _Batch) -> None:
        """Put an acknowledged batch's writes in the table (its write buffer) and the pending index."""
        ahead = self._ahead
        for gid, entry in out.writes.items():
            if gid in ahead and ahead[gid] is entry:  # no later decided batch changed it since: the table has it now
                del ahead[gid]
            if entry is None:
                self.table.pop(gid, None)
                self._pending.pop(gid, None)
                continue
            self.table[gid] = entry
            if entry[:1] == PENDING:
                info = pending_info(entry)
                t = info[0]
                if gid in self._pending or t < self._pending_newest:  # (only a caller's own clock goes back)
                    self._pending_in_order = False
                self._pending_newest = max(self._pending_newest, t)
                self._pending[gid] = info
            else:
                self._pending.pop(gid, None)
        out.writes.clear()
        self._ahead_pending -= out.new_pending
        out.new_pending = 0
        if not self._pending:
            self._pending_in_order = True
        self.metrics.pending.set(len(self._pending))

    async def count(self, out: _Batch) -> None:
        """Write an acknowledged batch's counters to Redis (the live counters once per feedback id) and Prometheus."""
        try:
            await self.metrics.apply(out.tally, retry_s=self.ic.redis_retry_s, unit_ttl_s=self.ic.unit_ttl_s)
        except Exception as e:
            raise InfraError(f"Redis at {redact_url(self.metrics.redis_url)} failed: {type(e).__name__}: {e}") from e

    # -- timers ------------------------------------------------------------------------------------

    def _waited(self, t: float, kts: float, part: int | None, now: float, ttl: float) -> str | None:
        """Has this feedback waited long enough for its generation? None, "hard", "clock" or "caught_up".

        Waiting ``ttl`` of wall time (counted from when this worker resumed, if later; ``ttl`` is at least the
        producers' delivery timeout) is not enough on its own: when the generations stream lags the feedback stream
        (a backlog after a restart, a stalled worker, a slow partition) the record may still be unread. So either
        the generations partition co-partitioned with the feedback has moved ``ttl`` past the feedback's own
        timestamp ("clock"), or this worker has read that partition to its end ("caught_up": checked against the
        broker by the caller). A hard limit of ``PENDING_HARD_LIMIT_X`` x ``ttl`` (at least 10 min) bounds memory
        if a partition never catches up.
        """
        if now - t >= max(PENDING_HARD_LIMIT_X * ttl, 600.0):
            return "hard"
        if now - max(t, self._resumed) < ttl:
            return None
        clock = self._gen_clock.get(part) if part is not None else None
        if clock is not None and clock >= kts + ttl:
            return "clock"
        return "caught_up"

    def _due(self, now: float, ttl: float) -> list[tuple[str, tuple[float, float, int | None]]]:
        """The pending entries old enough to be considered: all of them, or, while they are kept oldest first, those
        before the first one that has not waited ``ttl`` yet (a sweep per second need not visit every entry)."""
        if not self._pending_in_order:
            return list(self._pending.items())
        due = []
        for item in self._pending.items():
            if now - item[1][0] < ttl:
                break
            due.append(item)
        return due

    def _caught_up(self, part: int | None, ends: Mapping[int, int | None] | None) -> bool:
        """Has this worker processed every generation record the broker has on ``part`` (``ends``: the generations
        partitions' end offsets, as the caller read them from the broker; None: no broker, every partition is)?"""
        if part is None or ends is None:
            return True
        end = ends.get(part)
        return end is not None and self._gen_next.get(part, 0) >= end

    def ends_needed(self, now: float, assigned: Collection[int] | None = None) -> set[int]:
        """The generations partitions whose end offset ``expire_pending`` needs at ``now``: where feedback has waited a
        TTL and the partition's clock has not passed it (whether it was read to its end then decides)."""
        ttl = self.ic.pending_ttl_s
        return {
            part
            for _, (t, kts, part) in self._due(now, ttl)
            if part is not None
            and (assigned is None or part in assigned)
            and self._waited(t, kts, part, now, ttl) == "caught_up"
        }

    async def expire_pending(
        self,
        now: float | None = None,
        *,
        assigned: Collection[int] | None = None,
        ends: Mapping[int, int | None] | None = None,
    ) -> int:
        """Dead-letter feedback whose generation did not arrive within ``pending_ttl_s``.

        ``assigned``: the input partitions this worker holds (None: all); feedback of others is left alone. ``ends``:
        the end offsets of the generations partitions ``ends_needed`` named (None: count every partition as read to
        its end). Values, not callbacks into the worker: the worker asks the broker, the join decides."""
        now = time.time() if now is None else now
        ttl = self.ic.pending_ttl_s
        expired = []
        for gid, (t, kts, part) in list(self._due(now, ttl)):
            if part is not None and assigned is not None and part not in assigned:
                continue
            why = self._waited(t, kts, part, now, ttl)
            if why == "caught_up" and not self._caught_up(part, ends):
                continue
            if why is not None:
                expired.append(gid)
        if not expired:
            return 0
        out = _Batch()
        gone = []
        for gid in expired:
            entry = self.table.get(gid)
            if entry is None or entry[:1] != PENDING:  # joined meanwhile (the index is only a hint)
                self._pending.pop(gid, None)
                continue
            _, _, meta, payload = unpack(entry)
            topic, partition, offset, key = meta["src"]
            self._dead(
                out,
                "unknown_generation",
                f"no generation record {gid} arrived within {ttl:g} s of the feedback",
                Source(topic, partition, offset, key),
                payload,
            )
            gone.append(gid)
        # Dead letters first, deletion after: a crash in between repeats the dead letter, never loses it.
        await self._settle_futures(out)
        for gid in gone:
            self.table.pop(gid, None)
            self._pending.pop(gid, None)
        await self.settle(out)
        return len(gone)

    async def _settle_futures(self, out: _Batch) -> None:
        if out.futs:
            try:
                await self.output.flush()
                await asyncio.gather(*out.futs)
            except Exception as e:
                raise InfraError(f"the broker did not take the dead letters: {type(e).__name__}: {e}") from e
            out.futs.clear()

    async def evict_old(self, now: float | None = None, chunk: int = 2000, limit: int = EVICT_MAX) -> int:
        """Drop unjudged generations and judgements past their TTLs, and cut the accepted sample out of a judgement
        older than ``revert_sample_ttl_s`` (only a revert within that time trains its correction). Returns how many
        entries were dropped.

        Reads only the entries due, oldest first, from the table's expiry index (``ingest.store``; a plain mapping is
        scanned), at most ``limit`` per call (the rest at the next). Takes the lock a chunk at a time (each entry
        re-checked under it) and yields to the loop between chunks. Pending feedback is the other timer's.
        """
        now = time.time() if now is None else now
        ic = self.ic
        ttls = {WAITING: ic.generation_ttl_s, JUDGED: ic.judged_ttl_s, ACCEPT_KEPT: ic.judged_ttl_s}
        cut_after = min(ic.revert_sample_ttl_s, ic.judged_ttl_s)
        tally = Tally()
        acted = 0
        for cls, before in (
            (WAITING, now - ic.generation_ttl_s),
            (JUDGED, now - ic.judged_ttl_s),
            (ACCEPT_KEPT, now - cut_after),
        ):
            due = due_in(self.table, cls, before)
            more = True
            while more and acted < limit:
                async with self.lock:
                    for _ in range(min(chunk, limit - acted)):
                        gid = next(due, None)
                        if gid is None:
                            more = False
                            break
                        entry = self.table.get(gid)
                        got = None if entry is None else expiry_class(entry)
                        if got is None or got[0] != cls:  # (changed since the index was written)
                            continue
                        age = now - head(entry)[1]
                        if age >= ttls[cls]:
                            self.table.pop(gid, None)
                            tally.inc("generations_expired" if cls == WAITING else "judgements_expired")
                        elif cls == ACCEPT_KEPT and age >= cut_after:
                            self.table[gid] = without_payload(entry)
                            tally.inc("revert_samples_expired")
                        else:
                            continue
                        acted += 1
                await asyncio.sleep(0)
            due.close()
        if tally.counts:
            try:
                await self.metrics.apply(tally)
            except Exception as e:
                raise InfraError(
                    f"Redis at {redact_url(self.metrics.redis_url)} failed: {type(e).__name__}: {e}"
                ) from e
        estimate = getattr(self.table, "estimate", None)
        self.metrics.tracked.set(estimate() if estimate is not None else len(self.table))
        return tally.counts["generations_expired"] + tally.counts["judgements_expired"]


def pending_in(table: MutableMapping[str, bytes]) -> Iterator[tuple[str, tuple[float, float, int | None]]]:
    """The pending feedback of a table: from its pending index (``ingest.table.JoinTable``), or, for a plain mapping
    (the property tests' dict), a scan."""
    index = getattr(table, "pending_entries", None)
    if index is not None:
        return index()
    return ((gid, pending_info(v)) for gid, v in list(table.items()) if v[:1] == PENDING)


def due_in(table: MutableMapping[str, bytes], cls: bytes, before: float) -> Generator[str, None, None]:
    """The generation ids of a table whose entry is of expiry class ``cls`` and older than ``before``: from its
    expiry index (``ingest.table.JoinTable.due``), or, for a plain mapping, a scan."""
    index = getattr(table, "due", None)
    if index is not None:
        yield from index(cls, before)
        return
    before_ms = ms(before)
    found = [
        (c[1], gid) for gid, v in list(table.items()) if (c := expiry_class(v)) and c[0] == cls and c[1] < before_ms
    ]
    for _, gid in sorted(found):
        yield gid
