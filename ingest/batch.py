"""A decided batch and how it settles: its output on its way to the broker, its table writes, its counters.

The join (``ingest.join``) decides a batch into a ``Batch``; ``Emitter`` queues the batch's samples and dead letters
on an ``Output`` and waits for the broker's acknowledgement. ``Settle`` is all of the join that the committer
(``ingest.commit``) sees: acknowledge, apply, count. Failures of the infrastructure raise ``InfraError``: the worker
then stops without acknowledging the batch, so its uncommitted input is replayed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.config import redact_url
from ingest.metrics import IngestMetrics, Tally
from ingest.records import Source, dead_letter

log = logging.getLogger("liverl.ingest")


class InfraError(RuntimeError):
    """The broker or Redis failed: the batch must not be acknowledged (the worker stops and replays it)."""


class KeyMissing(InfraError):
    """A sealed generation and no key-encryption key to open it (``security.shred_key``): the worker stops without
    acknowledging its batch, as for a failed broker, rather than dead-letter every sealed user's feedback; started
    again with the key, it decides them all."""


class Output(Protocol):
    """Where the join's samples and dead letters go: ``send`` queues a record and returns an awaitable that resolves
    once the broker has it, after a ``flush`` (``ingest.outbox.Outbox``)."""

    def send(self, topic: str, key: str, value: bytes) -> Awaitable[Any]: ...

    def flush(self) -> Awaitable[Any]: ...


@dataclass
class Batch:
    """One batch's decisions, until it is settled."""

    tally: Tally = field(default_factory=Tally)
    futs: list[Any] = field(default_factory=list)  # the broker's acknowledgements of its samples and dead letters
    samples: int = 0
    writes: dict[str, bytes | None] = field(default_factory=dict)  # table writes, applied once futs are done
    new_pending: int = 0
    now: float = 0.0  # the time the batch's decisions count as made (one for the batch)
    generations_in: int = 0
    feedback_in: int = 0


class Settle(Protocol):
    """What the committer needs of the join (``ingest.join.Ingest``), per decided batch: ``acknowledged`` (the broker
    has its output), then ``apply`` (its table writes, in the order the batches were decided), and ``count`` once
    acknowledged (Redis and Prometheus, any order)."""

    async def acknowledged(self, out: Batch) -> None: ...

    def apply(self, out: Batch) -> None: ...

    async def count(self, out: Batch) -> None: ...


class Emitter:
    """Queues a batch's samples and dead letters on the ``Output`` and waits until the broker has them."""

    def __init__(self, output: Output, dead_letters: str):
        self.output = output
        self.dead_letters = dead_letters  # the dead-letter topic

    def emit(self, out: Batch, topic: str, key: str, value: bytes) -> None:
        try:
            fut = self.output.send(topic, key, value)
        except Exception as e:
            raise InfraError(f"producing to {topic} failed: {type(e).__name__}: {e}") from e
        out.futs.append(fut)

    def dead(self, out: Batch, reason: str, detail: str, src: Source, value: bytes | None) -> None:
        """Dead-letter an input (``reason``, counted as ``dlq:<reason>``)."""
        letter = dead_letter(reason, detail, src, value)
        log.debug("dead letter %s: %s (%s[%s]@%s)", reason, letter.detail, src.topic, src.partition, src.offset)
        self.emit(out, self.dead_letters, letter.key or "", letter.to_bytes())
        out.tally.inc(f"dlq:{reason}")

    async def sent(self, out: Batch) -> None:
        """Wait until the broker has every record the batch queued."""
        if out.futs:
            try:
                await self.output.flush()
                await asyncio.gather(*out.futs)
            except Exception as e:
                raise InfraError(f"the broker did not take the dead letters: {type(e).__name__}: {e}") from e
            out.futs.clear()


async def count_in_redis(metrics: IngestMetrics, tally: Tally, **kw: Any) -> None:
    """``metrics.apply``, a failure raised as ``InfraError``."""
    try:
        await metrics.apply(tally, **kw)
    except Exception as e:
        raise InfraError(f"Redis at {redact_url(metrics.redis_url)} failed: {type(e).__name__}: {e}") from e
