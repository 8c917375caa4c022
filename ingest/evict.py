"""Eviction: the join table's entries past their TTLs are dropped, an old accept's kept sample is cut.

A timer of the worker (``ingest.app``, every ``EVICT_INTERVAL_S``), run between batches with every decided batch
settled: nothing else reads or writes the table meanwhile, so eviction needs no lock of its own. It reads only the
entries due, oldest first, from the table's expiry index (``ingest.store``; a plain mapping is scanned). Pending
feedback is the other timer's (``Ingest.expire_pending``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, MutableMapping

from core.config import IngestConfig
from ingest.batch import count_in_redis
from ingest.entry import ACCEPT_KEPT, JUDGED, WAITING, expiry_class, head, ms, without_payload
from ingest.metrics import IngestMetrics, Tally

EVICT_MAX = 200_000  # entries one expiry run drops or cuts at most (the rest wait for the next run)


async def evict_old(
    table: MutableMapping[str, bytes],
    ic: IngestConfig,
    metrics: IngestMetrics,
    now: float | None = None,
    chunk: int = 2000,
    limit: int = EVICT_MAX,
) -> int:
    """Drop unjudged generations and judgements past their TTLs, and cut the accepted sample out of a judgement older
    than ``revert_sample_ttl_s`` (only a revert within that time trains its correction). Returns how many entries
    were dropped.

    At most ``limit`` entries per call (the rest at the next), each re-checked against the table (the index may be
    behind it); yields to the event loop every ``chunk`` entries (the consumer group's heartbeats).
    """
    now = time.time() if now is None else now
    ttls = {WAITING: ic.generation_ttl_s, JUDGED: ic.judged_ttl_s, ACCEPT_KEPT: ic.judged_ttl_s}
    cut_after = min(ic.revert_sample_ttl_s, ic.judged_ttl_s)
    tally = Tally()
    acted = 0
    for cls, before in (
        (WAITING, now - ic.generation_ttl_s),
        (JUDGED, now - ic.judged_ttl_s),
        (ACCEPT_KEPT, now - cut_after),
    ):
        due = due_in(table, cls, before)
        more = True
        while more and acted < limit:
            for _ in range(min(chunk, limit - acted)):
                gid = next(due, None)
                if gid is None:
                    more = False
                    break
                entry = table.get(gid)
                got = None if entry is None else expiry_class(entry)
                if entry is None or got is None or got[0] != cls:  # (changed since the index was written)
                    continue
                age = now - head(entry)[1]
                if age >= ttls[cls]:
                    table.pop(gid, None)
                    tally.inc("generations_expired" if cls == WAITING else "judgements_expired")
                elif cls == ACCEPT_KEPT and age >= cut_after:
                    table[gid] = without_payload(entry)
                    tally.inc("revert_samples_expired")
                else:
                    continue
                acted += 1
            await asyncio.sleep(0)
        due.close()
    if tally.counts:
        await count_in_redis(metrics, tally)
    estimate = getattr(table, "estimate", None)
    metrics.tracked.set(estimate() if estimate is not None else len(table))
    return tally.counts["generations_expired"] + tally.counts["judgements_expired"]


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
