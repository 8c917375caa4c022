"""The gateway's Kafka producer: librdkafka (confluent-kafka), with delivery reports resolved as asyncio futures.

Why not kafka-python here: its producer does its network I/O in a Python thread, which holds the GIL while the
event loop wants it; under load every socket call of the gateway then waits for that thread, and the gateway's
latency doubled (measured with ``liverl bench serve``). librdkafka's threads run without the GIL, ``produce`` is a
C call, and the delivery callbacks run on the event loop's own thread, from ``poll(0)`` called by a task while
anything is in flight: no thread hand-offs.

Settings: idempotent (``enable.idempotence``, which implies ``acks=all``), so a retried batch is written once;
``partitioner=murmur2_random``, the Java client's and kafka-python's partitioner, so a record lands on the
partition every other liverl client (the feedback SDK, ingest's producers) picks for the same key, which the
feedback/generation join needs (librdkafka's default, ``consistent_random``, picks differently).
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("liverl.serving.producer")

POLL_INTERVAL_S = 0.001


class AsyncProducer:
    def __init__(self, bootstrap: str, client_id: str, linger_ms: float = 2.0, **config):
        from confluent_kafka import Producer

        self._producer = Producer({
            "bootstrap.servers": bootstrap, "client.id": client_id, "enable.idempotence": True, "acks": "all",
            "partitioner": "murmur2_random", "linger.ms": linger_ms, "logger": log, **config})
        self._pending: set[asyncio.Future] = set()
        self._wake = asyncio.Event()
        self._poller: asyncio.Task | None = None

    async def start(self, topics: list[str], timeout_s: float = 10.0) -> None:
        """Fetch the topics' metadata now (so the first records do not wait for it) and start polling."""
        md = await asyncio.to_thread(self._producer.list_topics, None, timeout_s)
        missing = [t for t in topics if t not in md.topics or md.topics[t].error is not None]
        if missing:
            raise RuntimeError(f"topics {missing} are not on the broker")
        self._poller = asyncio.create_task(self._poll(), name="liverl-producer-poll")

    def produce(self, topic: str, key: str, value: bytes) -> asyncio.Future:
        """Queue one record; the future resolves when the broker has it (or fails with the KafkaError).
        Raises ``BufferError`` when the local queue is full."""
        fut = asyncio.get_running_loop().create_future()

        def delivered(err, _msg) -> None:
            self._pending.discard(fut)
            if fut.done():
                return
            if err is not None:
                fut.set_exception(RuntimeError(f"Kafka did not take the record: {err}"))
            else:
                fut.set_result(None)

        self._producer.produce(topic, value=value, key=key, on_delivery=delivered)
        self._pending.add(fut)
        self._wake.set()
        return fut

    async def _poll(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                self._producer.poll(0)
                await asyncio.sleep(POLL_INTERVAL_S)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout_s``), then stop polling."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(self._producer) and asyncio.get_running_loop().time() < deadline:
            self._producer.poll(0)  # callbacks run here, on the loop's thread (flush() would run them elsewhere)
            await asyncio.sleep(0.005)
        self._producer.poll(0)
        if len(self._producer):
            log.error("%d records were not delivered to Kafka before shutdown", len(self._producer))
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
