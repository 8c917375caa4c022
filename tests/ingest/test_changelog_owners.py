"""Two workers write one changelog partition: its new owner after a rebalance, and its old owner cut off from the group
(its event loop stalled on a query to a database whose link was cut) that still flushes the batch it had decided. The
old owner's database must not claim the changelog offset of its own late write, past the new owner's records between:
a restore from that offset would skip them, and feedback the new owner held pending and committed would be nowhere
(what a 32-fault host run found: 114 acknowledged events lost). Real broker."""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaProducer

from core.bus import ensure_topics
from ingest.join import PENDING, WAITING, pack
from ingest.table import JoinTable, Outbox, applied_through, changelog_topic

NOW = 1.8e9


def test_applied_through_claims_only_writes_that_follow_what_the_database_has():
    assert applied_through(None, [(0, 3)]) == 2  # an empty partition, this worker's first write
    assert applied_through(9, [(10, 2), (12, 5)]) == 16  # two record batches, back to back
    assert applied_through(9, [(11, 2)]) is None  # another writer's record at 10
    assert applied_through(9, [(10, 2), (13, 1)]) is None  # ... or between this flush's own batches
    assert applied_through(None, [(4, 1)]) is None  # records this database never read
    assert applied_through(9, None) is None and applied_through(9, []) is None


def test_an_old_owners_late_write_does_not_hide_the_new_owners_records_from_its_next_restore(stack, tmp_path):
    topic = changelog_topic(f"t{uuid.uuid4().hex[:10]}")
    ensure_topics(stack.bootstrap, [topic], 1)
    waiting, pending = pack(WAITING, NOW), pack(PENDING, NOW, {"f": "fb-1", "kts": NOW, "src": ["t.feedback", 0, 7]})

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        old = JoinTable(topic, 1, tmp_path / "old")
        new = JoinTable(topic, 1, tmp_path / "new")
        try:
            old.hold({0})
            await old.recover(stack.bootstrap, None)
            old["gen-1"] = waiting
            await old.flush(Outbox(producer))
            assert old.parts[0].offset == 0
            # a rebalance gives the partition to the other worker: it restores, then holds feedback pending
            new.hold({0})
            await new.recover(stack.bootstrap, None)
            assert new.get("gen-1") == waiting and new.parts[0].offset == 0
            new["gen-2"] = pending
            await new.flush(Outbox(producer))
            assert new.parts[0].offset == 1
            # the old owner, stalled through the rebalance, flushes the batch it had decided
            old["gen-3"] = waiting
            await old.flush(Outbox(producer))
            assert old.parts[0].offset == 0, "claimed the offset of its own write, past the new owner's record"
            assert old.get("gen-2") is None  # not read yet
            # it rejoins and is given the partition back: its restore reads what it missed
            old.close()
            old.hold({0})
            await old.recover(stack.bootstrap, None)
            assert old.get("gen-2") == pending and old.get("gen-3") == waiting and old.parts[0].offset == 2
            # the new owner's database, too, skipped the old owner's late record: it keeps its offset
            new["gen-4"] = waiting
            await new.flush(Outbox(producer))
            assert new.parts[0].offset == 1
            # and a worker that is the only writer again claims its writes as before
            old["gen-5"] = waiting
            await old.flush(Outbox(producer))
            assert old.parts[0].offset == 2  # gen-4 (offset 3) came between: not claimed
            old.close()
            old.hold({0})
            await old.recover(stack.bootstrap, None)
            assert old.parts[0].offset == 4 and old.get("gen-4") == waiting
            old["gen-6"] = waiting
            await old.flush(Outbox(producer))
            assert old.parts[0].offset == 5
        finally:
            await producer.stop()
            old.close()
            new.close()

    asyncio.run(run())
