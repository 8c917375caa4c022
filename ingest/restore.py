"""Restore: bring each held partition's database up to its changelog's end after an assignment.

A database stores the changelog offset it has applied (``ingest.store``), so a restarted worker reads only the
changelog's tail, and a worker given a partition another one kept reads it all. Memory stays bounded whatever the
table's size: ``RESTORE_CHUNK`` records are applied at a time, with the event loop's other work (the group's
heartbeats) in between. What the join then needs of the table (the pending feedback) comes from its pending index
(``ingest.join.Ingest.restore``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import TopicPartition

from core.bus import make_aio_consumer
from core.config import BrokerConfig

log = logging.getLogger("liverl.ingest")

RECOVERY_READ_TIMEOUT_S = 120.0  # the longest a restore may go without reading anything
RESTORE_CHUNK = 5000  # changelog records applied at once during a restore (bounds its memory, whatever the table)


async def restore(topic: str, parts: dict[int, Any], bootstrap: str, broker: BrokerConfig | None) -> dict[str, Any]:
    """Read each held partition's changelog from the offset its database has applied to the changelog's end.

    A database ahead of its changelog belongs to another broker history (a broker whose log was lost or replaced,
    e.g. one run with ``broker.embedded_storage = "memory"``, while the state folder outlived it): it is emptied and
    read from the start. The embedded broker keeps its log in the state folder by default, so a restart keeps the
    table. ``topic`` is the changelog topic, ``parts`` the held partitions' stores (``ingest.table.JoinTable.parts``).
    Returns what was read.
    """
    if not parts:
        return {"read": 0, "wiped": [], "partitions": []}
    consumer = make_aio_consumer(bootstrap, broker, fetch_max_wait_ms=100, max_partition_fetch_bytes=4 << 20)
    await consumer.start()
    read = 0
    wiped = []
    try:
        tps = {p: TopicPartition(topic, p) for p in parts}
        ends = await _true_end_offsets(consumer, tps)
        start: dict[int, int] = {}
        for p, part in parts.items():
            end = ends[p]
            if part.offset is not None and part.offset >= end:
                was = part.offset
                part.wipe()
                wiped.append(p)
                log.warning(
                    "join table partition %d: local state (changelog offset %d) is ahead of the changelog "
                    "(end %d), so it is from another broker history; dropped it",
                    p,
                    was,
                    end,
                )
            nxt = 0 if part.offset is None else part.offset + 1
            if nxt < end:
                start[p] = nxt
        if start:
            consumer.assign([tps[p] for p in start])
            for p, off in start.items():
                consumer.seek(tps[p], off)
            left = dict(start)
            deadline = time.monotonic() + RECOVERY_READ_TIMEOUT_S
            while left:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"reading the changelog {topic} made no progress for "
                        f"{RECOVERY_READ_TIMEOUT_S:g} s (partitions {sorted(left)})"
                    )
                got = await consumer.getmany(*[tps[p] for p in left], timeout_ms=200, max_records=RESTORE_CHUNK)
                for tp, msgs in got.items():
                    p = tp.partition
                    msgs = [m for m in msgs if m.offset < ends[p]]
                    if msgs:
                        parts[p].apply([(m.key, m.value) for m in msgs if m.key is not None], msgs[-1].offset)
                        read += len(msgs)
                        deadline = time.monotonic() + RECOVERY_READ_TIMEOUT_S  # (a deadline for progress)
                await asyncio.sleep(0)  # (a chunk at a time: the consumer group's heartbeats run in between)
                for p in list(left):
                    if await consumer.position(tps[p]) >= ends[p]:
                        left.pop(p)
    finally:
        await consumer.stop()
    return {"read": read, "wiped": wiped, "partitions": sorted(parts)}


async def _true_end_offsets(
    consumer, tps: dict[int, Any], timeout_s: float = RECOVERY_READ_TIMEOUT_S, warn_after_s: float = 10.0
) -> dict[int, int]:
    """The log end offset of each partition, from a fetch response's high watermark.

    Why: the embedded Tansu broker answers ListOffsets(latest) with the base offset of the last record *batch* + 1,
    not the offset after its last record; reading a changelog up to that answer would silently lose the tail of its
    last batch (a batch of table changes is one record batch). A fetch response carries the correct high watermark
    (every answered fetch sets it, records or none). On Apache Kafka the two agree and this costs one short fetch per
    partition at rebalance time.

    A broker that answers no fetch within ``timeout_s`` is a failed restore (``RuntimeError``), never a restore up
    to the ListOffsets answer, which on Tansu stops short of the last batch's entries; it is logged after
    ``warn_after_s``.
    """
    listed = await consumer.end_offsets(list(tps.values()))
    consumer.assign(list(tps.values()))
    for tp in tps.values():
        consumer.seek(tp, max((listed.get(tp) or 0) - 1, 0))
    t0 = time.monotonic()
    warned = False
    while any(consumer.highwater(tp) is None for tp in tps.values()):
        waited = time.monotonic() - t0
        missing = sorted(p for p, tp in tps.items() if consumer.highwater(tp) is None)
        if waited > timeout_s:
            raise RuntimeError(
                f"no fetch of the changelog answered within {timeout_s:g} s (partitions {missing}): its end is "
                "unknown, and the broker's listed end may stop short of the last batch"
            )
        if waited > warn_after_s and not warned:
            warned = True
            log.warning("no high watermark for partitions %s after %g s; still waiting", missing, warn_after_s)
        await consumer.getmany(timeout_ms=200, max_records=1)
    return {p: max(consumer.highwater(tp), listed.get(tp) or 0) for p, tp in tps.items()}
