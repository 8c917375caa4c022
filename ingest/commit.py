"""The commit: batches settle in order, their table writes go through the write buffer, then their offsets commit.

Per batch, in the background while the next one is decided (``SETTLING_MAX`` batches at most, in the order decided):
the broker acknowledges its samples and dead letters (``Settle.acknowledged``), its counters go to Redis
(``Settle.count``), and, after the batch before it, its table writes join the table's write buffer (``Settle.apply``);
``ingest.batch.Settle`` is all of the join the committer sees.
About once a second (``TABLE_FLUSH_S``, or sooner when the buffer holds ``TABLE_BUFFER_WRITES`` entries or
``TABLE_BUFFER_BYTES``) the buffer goes to the changelog, is acknowledged, then to the databases
(``table.JoinTable.flush``); only then are the input offsets of the batches it holds committed. The write buffer is
Kafka Streams' record cache: a generation written waiting and judged within the same second reaches the changelog and
the database once, as judged. A kill -9 replays at most the input of the unflushed buffer, as it replays an unsettled
batch. Any failure here stops the worker without committing (``die``): the uncommitted input is replayed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

from core.services import EXIT_TEMPFAIL
from ingest.batch import Batch, InfraError, Settle
from ingest.outbox import Outbox
from ingest.table import JoinTable

log = logging.getLogger("liverl.ingest")

SETTLING_MAX = 3  # batches settling at once: decisions run ahead of the broker's acknowledgements by this much
TABLE_FLUSH_S = 1.0  # how often the table's write buffer goes to the changelog (then the input offsets are committed)
TABLE_BUFFER_WRITES = 50_000  # ... or sooner, once it holds this many entries
TABLE_BUFFER_BYTES = 32 << 20  # ... or this many bytes of values
EXIT_INFRA = EXIT_TEMPFAIL  # exit code when the broker or Redis failed mid-batch (EX_TEMPFAIL: restart me)


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


class Committer:
    """The settling batches, the table's write buffer on its way, and the input offsets they make committable."""

    def __init__(self, join: Settle, table: JoinTable, table_outbox: Outbox, consumer: Any):
        self.join = join
        self.table = table
        self.table_outbox = table_outbox
        self.consumer = consumer  # (an aiokafka consumer: it commits the offsets)
        self.done: dict[Any, int] = {}  # next offset to commit, per input partition
        self.committed: dict[Any, int] = {}
        self._unflushed: dict[Any, int] = {}  # next offsets of settled batches whose table writes are still buffered
        self._flush_at = 0.0  # when the table's write buffer is next written (monotonic)
        self._table_flush: asyncio.Task | None = None  # the buffer on its way to the changelog and the databases
        self._committing: asyncio.Task | None = None
        self._settling: list[asyncio.Future] = []  # batches decided and not yet settled, oldest first

    # -- batches -----------------------------------------------------------------------------------

    def unsettled(self) -> list[asyncio.Future]:
        """The settling batches, oldest first (the finished ones dropped here, not by a done callback: awaiting a
        finished task does not yield to the loop, so a loop waiting for such a callback would spin forever)."""
        self._settling = [t for t in self._settling if not t.done()]
        return self._settling

    async def room(self) -> float:
        """Wait until fewer than ``SETTLING_MAX`` batches settle; returns the seconds waited."""
        if len(self.unsettled()) < SETTLING_MAX:
            return 0.0
        t0 = time.monotonic()
        while len(self.unsettled()) >= SETTLING_MAX:
            await asyncio.wait([self._settling[0]])
        return time.monotonic() - t0

    def add(self, out: Batch, ends: dict) -> None:
        """Settle a decided batch in the background, after the one decided before it; ``ends``: its input offsets."""
        prev = self._settling[-1] if self._settling else None
        self._settling.append(asyncio.ensure_future(self._settle(prev, out, ends)))

    async def _settle(self, prev: asyncio.Future | None, out: Batch, ends: dict) -> None:
        """Wait for the broker to have this batch's output and count it in Redis (both while earlier batches settle),
        then, after the batch decided before this one, put its changes in the table (``Settle.apply``; the table's
        write buffer is written when due), then commit its input offsets in the background."""
        try:
            await self.join.acknowledged(out)
            counting = asyncio.ensure_future(self.join.count(out))
            try:
                if prev is not None:
                    await prev
                self.join.apply(out)
                await self.write_table()
            finally:
                await counting
        except InfraError as e:
            die(str(e))
        except Exception as e:  # noqa: BLE001 - anything here is the worker's
            log.exception("settling a batch failed")
            die(f"{type(e).__name__}: {e}")
        self._unflushed.update(ends)  # (after the count: an offset is committed only once Redis has the batch)
        self._release()

    async def drain(self) -> None:
        """Wait until every decided batch is settled and the table's write buffer is written (before a timer, a
        rebalance or a stop)."""
        while self.unsettled():
            await asyncio.wait(self._settling)
        await self.write_table(force=True)
        if self._flushing():  # (nothing was buffered, one was still on its way)
            assert self._table_flush is not None
            await self._table_flush
        self._release()

    # -- the table's write buffer --------------------------------------------------------------------

    def buffer_full(self) -> bool:
        t = self.table
        return len(t.buffered) >= TABLE_BUFFER_WRITES or t.buffered_bytes >= TABLE_BUFFER_BYTES

    def _flushing(self) -> bool:
        return self._table_flush is not None and not self._table_flush.done()

    def flush_due(self) -> bool:
        """The buffer holds changes, is due, and no batch is settling to write it."""
        return self.table.dirty and time.monotonic() >= self._flush_at and not self.unsettled()

    async def write_table(self, force: bool = False) -> None:
        """Start writing the table's write buffer when it is due (``TABLE_FLUSH_S``) or full: in the background, so
        batches go on settling into a new buffer meanwhile (one write at a time: a full buffer waits for the one in
        flight). ``force``: write it now and wait until the databases have it."""
        if self._flushing():
            if not (force or self.buffer_full()):
                return
            assert self._table_flush is not None
            await self._table_flush
        now = time.monotonic()
        if not self.table.dirty or not (force or now >= self._flush_at or self.buffer_full()):
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

    # -- offsets -----------------------------------------------------------------------------------

    def _release(self, committed: bool = False) -> None:
        """Once the table holds no buffered change and none is on its way, the input offsets of every settled batch
        may be committed (in the background: the next batch need not wait). ``committed``: ``done`` just grew."""
        if self._unflushed and not self.table.dirty and not self._flushing():
            self.done.update(self._unflushed)
            self._unflushed.clear()
            committed = True
        if committed and (self._committing is None or self._committing.done()):
            self._committing = asyncio.ensure_future(self._commit())

    async def commit_now(self) -> None:
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

    def keep_only(self, mine: set) -> None:
        """A new assignment: forget the offsets of partitions this worker no longer holds."""
        self.done = {tp: off for tp, off in self.done.items() if tp in mine}
        self.committed = {tp: off for tp, off in self.committed.items() if tp in mine}
