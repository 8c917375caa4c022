"""Where a restore stops reading the join table's changelog: at the high watermark a fetch answered, never at the
broker's listed end, which on the embedded broker stops short of the last batch's records. Driven with a stand-in
consumer (the real broker's answers are covered by tests/ingest/test_restart.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from ingest.restore import _true_end_offsets


class _Consumer:
    """Lists ``listed`` as each partition's end; answers fetches with ``highwater`` once ``answers_after`` fetches
    went unanswered (None: never)."""

    def __init__(self, listed: dict[TopicPartition, int], highwater: dict[TopicPartition, int], answers_after):
        self.listed, self.hw, self.answers_after = listed, highwater, answers_after
        self.fetches, self.seen = 0, {}

    async def end_offsets(self, tps):
        return {tp: self.listed[tp] for tp in tps}

    def assign(self, tps):
        pass

    def seek(self, tp, offset):
        pass

    async def getmany(self, timeout_ms=0, max_records=None):
        self.fetches += 1
        if self.answers_after is not None and self.fetches > self.answers_after:
            self.seen = dict(self.hw)
        await asyncio.sleep(0)
        return {}

    def highwater(self, tp):
        return self.seen.get(tp)


TPS = {0: TopicPartition("t", 0), 1: TopicPartition("t", 1)}
LISTED = {TPS[0]: 7, TPS[1]: 0}  # the base offset of the last batch + 1, and an empty partition
TRUE = {TPS[0]: 12, TPS[1]: 0}


def test_the_end_is_the_fetched_high_watermark_not_the_listed_offset():
    consumer = _Consumer(LISTED, TRUE, answers_after=3)
    assert asyncio.run(_true_end_offsets(consumer, TPS, timeout_s=5.0)) == {0: 12, 1: 0}


def test_without_an_answered_fetch_the_restore_fails_instead_of_stopping_at_the_listed_end():
    """A broker that answers no fetch: the restore fails (the worker dies and is restarted), and no end short of the
    last batch is ever returned."""
    consumer = _Consumer(LISTED, TRUE, answers_after=None)
    with pytest.raises(RuntimeError, match="no fetch of the changelog answered"):
        asyncio.run(_true_end_offsets(consumer, TPS, timeout_s=0.3))
    assert consumer.fetches > 1
