"""Input pacing: read a partition's two inputs in step (Kafka Streams' timestamp sync of a join's inputs).

Feedback more than ``FEEDBACK_LEAD_S`` newer (Kafka timestamps) than the generations read on its partition waits
while that generations partition has records not read yet. A batch keeps the feedback up to the first such record; the
records from there on are kept here (``held_records``, at most one fetch per partition) and the partition paused until
``pace`` resumes it and hands them to the next batch.

Why: feedback records are a fifth of a generation record's size, so on a backlog (a worker restarted after an outage, a
new worker catching up) a fetch brings feedback far ahead of the generations it judges. Each such event then waits as
pending (written, read back and parsed again), and a backlog longer than ``ingest.max_pending`` would dead-letter
feedback ``pending_full`` only because of the read order. Nothing is skipped (the held records come back in order
before anything fetched after them; going back to their offset instead would have the broker send a sixth of a
backlog's records twice), and a generations partition read to its end never holds feedback. A partition is held
``HOLD_MAX_S`` at most and then read freely as long again, so a record with a wrong clock (a timestamp far ahead) cannot
stall its partition's feedback while the generations never catch up.

A held record's offset is never committed before it is processed: the batches' committed offsets stop before it
(``ingest.commit``). After a rebalance the consumer reads each partition again from its committed offset, so what is
held here is dropped (``drop``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition

from ingest.metrics import IngestMetrics

log = logging.getLogger("liverl.ingest")

FEEDBACK_LEAD_S = 1.0  # how far (record timestamps) feedback may be read ahead of a generations backlog
HOLD_MAX_S = 60.0  # the longest a feedback partition is held at once; then it is read freely as long again


class Pacer:
    """The feedback partitions held back, and their records, for one consumer."""

    def __init__(
        self,
        consumer: Any,
        generations_read: Callable[[int], tuple[float | None, int | None]],
        metrics: IngestMetrics,
        generations: str,
        feedback: str,
    ):
        self.consumer = consumer  # (an aiokafka consumer: pause, resume, position, highwater)
        # what the join has decided of a generations partition: (newest record time, next offset), None where nothing
        # was (``Ingest.generations_read``)
        self.generations_read = generations_read
        self.metrics = metrics
        self.generations, self.feedback = generations, feedback
        self.held: dict[int, tuple[float, float]] = {}  # partitions held: (held record's time, since when)
        # the records held back, per feedback partition: the consumer's position is past them (they are not fetched
        # again); ``pace`` hands them to the next batch when it resumes the partition
        self.held_records: dict[Any, list] = {}
        self._released: dict[Any, list] = {}
        self._free_until: dict[int, float] = {}  # partitions released after HOLD_MAX_S: not held again until then

    def has_released(self) -> bool:
        return bool(self._released)

    async def hold_back(self, got: dict, assignment) -> tuple[dict, int]:
        """``got`` (a fetch) without the feedback that runs ahead of its generations, and how many records were held."""
        fb_topic, gen_topic = self.feedback, self.generations
        gens_read: dict[int, tuple[float | None, int | None]] = {}
        for tp, msgs in got.items():
            if tp.topic == gen_topic and msgs:
                gen_t, _ = self.generations_read(tp.partition)
                newest = max((m.timestamp for m in msgs if m.timestamp is not None and m.timestamp >= 0), default=-1)
                if newest >= 0:
                    gen_t = max(gen_t or 0.0, newest / 1000.0)
                gens_read[tp.partition] = (gen_t, msgs[-1].offset + 1)
        out = dict(got)
        held = 0
        now = time.monotonic()
        for tp, msgs in got.items():
            gen_tp = TopicPartition(gen_topic, tp.partition)
            if tp.topic != fb_topic or not msgs or tp not in assignment or gen_tp not in assignment:
                continue  # (a worker given feedback without its generations partition: logged at assignment)
            if self._free_until.get(tp.partition, 0.0) > now:
                continue
            gen_t, gen_next, end = await self.generations_progress(gen_tp, gens_read.get(tp.partition))
            if end is None or end <= gen_next:  # not fetched yet, or read to its end
                continue
            limit = -1.0 if gen_t is None else (gen_t + FEEDBACK_LEAD_S) * 1000.0
            cut = next((i for i, m in enumerate(msgs) if m.timestamp is not None and m.timestamp > limit), None)
            if cut is None:
                continue
            self.held_records[tp] = msgs[cut:]
            held += len(msgs) - cut
            self.consumer.pause(tp)  # (records it had fetched ahead are dropped; the position stays after the held)
            self.held[tp.partition] = (msgs[cut].timestamp / 1000.0, now)
            log.debug(
                "feedback partition %d held at offset %d: its generations are read up to %s",
                tp.partition,
                msgs[cut].offset,
                gen_t,
            )
            out[tp] = msgs[:cut]
        return out, held

    def _unhold(self, tp) -> None:
        """The partition's held records go to the next batch (before anything fetched after them)."""
        msgs = self.held_records.pop(tp, None)
        if msgs:
            self._released[tp] = self._released.get(tp, []) + msgs

    def with_released(self, got: dict) -> dict:
        """``got`` with the records ``pace`` released put before what was fetched after them, per partition."""
        out = dict(got)
        for tp, msgs in self._released.items():
            out[tp] = msgs + list(out.get(tp, ()))
        self._released = {}
        return out

    async def generations_progress(
        self, gen_tp, read: tuple[float | None, int | None] | None = None
    ) -> tuple[float | None, int, int | None]:
        """(newest generation time read, next offset to read, end offset: None until the partition is fetched) of a
        generations partition; ``read`` overrides what the join has decided (a batch not decided yet)."""
        gen_t, gen_next = read or self.generations_read(gen_tp.partition)
        if gen_next is None:  # none decided since the assignment: where the consumer stands
            gen_next = await self.consumer.position(gen_tp)
        return gen_t, gen_next, self.consumer.highwater(gen_tp)

    async def pace(self) -> None:
        """Resume held feedback partitions whose generations have caught up."""
        if not self.held:
            return
        assignment = self.consumer.assignment()
        resume = []
        now = time.monotonic()
        for p, (held_t, since) in list(self.held.items()):
            tp, gen_tp = TopicPartition(self.feedback, p), TopicPartition(self.generations, p)
            if tp not in assignment or gen_tp not in assignment:
                self.held.pop(p)
                if tp in assignment:
                    resume.append(tp)
                    self._unhold(tp)
                continue
            gen_t, gen_next, end = await self.generations_progress(gen_tp)
            if now - since >= HOLD_MAX_S:
                log.warning(
                    "feedback partition %d held %.0f s behind a generations backlog that does not catch up "
                    "(record time %.3f): read freely for %.0f s",
                    p,
                    now - since,
                    held_t,
                    HOLD_MAX_S,
                )
                self._free_until[p] = now + HOLD_MAX_S
            elif not (end is None or gen_next >= end or (gen_t is not None and gen_t + FEEDBACK_LEAD_S >= held_t)):
                continue
            resume.append(tp)
            self.held.pop(p)
            self._unhold(tp)
        if resume:
            self.consumer.resume(*resume)
        self.metrics.paced.set(len(self.held))

    def drop(self) -> None:
        """Forget the records held back: after a rebalance the consumer reads each partition again from its committed
        offset, which is before them (a held record's offset is never committed before it is processed)."""
        self.held_records.clear()
        self._released.clear()

    def reset(self, mine: set) -> None:
        """A new assignment: nothing held, every assigned partition resumed."""
        self.held.clear()
        self.drop()
        self._free_until.clear()
        paused = self.consumer.paused() & mine
        if paused:
            self.consumer.resume(*paused)
        self.metrics.paced.set(0)
