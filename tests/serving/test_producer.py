"""The gateway's producer (``serving/node/producer.py``) on the real broker: review finding 13, "the gateway hands out
ids for records never logged". The gateway answers a client only after ``wait`` says the broker has the generation
record (``serving.log_wait_s``, bounded): an acknowledged record is in the topic at that moment, and a wait that
cannot be met returns after its bound, counted, instead of holding the client."""

from __future__ import annotations

import asyncio
import time

from kafka import KafkaConsumer, TopicPartition

from core.bus import all_topics, ensure_topics
from serving.node.producer import AsyncProducer


def _keys(bootstrap: str, topic: str, partitions: int, want: int) -> set[str]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        got: set[str] = set()
        deadline = time.monotonic() + 10
        while len(got) < want and time.monotonic() < deadline:
            got |= {r.key.decode() for rs in c.poll(timeout_ms=200).values() for r in rs}
        return got
    finally:
        c.close()


def test_an_acknowledged_record_is_in_the_topic_and_a_wait_is_bounded(cfg):
    bootstrap, topic, parts = cfg.broker.bootstrap, cfg.topics.generations, cfg.broker.partitions
    ensure_topics(bootstrap, all_topics(cfg), parts)

    async def main():
        p = AsyncProducer(bootstrap, "test-gateway", delivery_timeout_s=60.0)
        await p.start([topic])
        try:
            acks = [p.produce(topic, f"g-{i}", b"{}") for i in range(5)]
            late = await p.wait(acks, 10.0)
            settled = [a.done() and a.exception() is None for a in acks]
            never = asyncio.get_running_loop().create_future()  # an ack that does not come (a broker gone)
            t0 = time.monotonic()
            late_never = await p.wait([never], 0.3)
            return late, settled, late_never, time.monotonic() - t0
        finally:
            await p.close()

    late, settled, late_never, waited = asyncio.run(main())
    assert late == 0 and all(settled)  # every delivery report is the broker's acknowledgement, none failed
    assert _keys(bootstrap, topic, parts, 5) == {f"g-{i}" for i in range(5)}
    assert late_never == 1 and 0.25 <= waited < 2.0  # bounded, and reported as late (the gateway counts it)
