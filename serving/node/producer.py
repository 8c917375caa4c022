"""The gateway's Kafka producer: librdkafka (confluent-kafka), with delivery reports resolved as asyncio futures.

Why not kafka-python here: its producer does its network I/O in a Python thread, which holds the GIL while the
event loop wants it; under load every socket call of the gateway then waits for that thread, and the gateway's
latency doubled (measured with ``liverl bench serve``). librdkafka's threads run without the GIL and ``produce`` is
a C call. Delivery reports are served on the event loop's thread by a task calling ``poll(0)``: every
``IDLE_POLL_S`` normally (the reports only settle counters), every ``WAIT_POLL_S`` while someone awaits an ack.

Settings: ``acks=all``, not idempotent and one request in flight, in order across retries (a retry may write a
record twice, which ingest dedupes; idempotence lost acknowledged records on the embedded broker:
``liverl_sdk.client.PRODUCER_ORDER``);
``message.timeout.ms`` from ``broker.delivery_timeout_s`` (librdkafka's default, 300 s, outlived ingest's
pending_ttl_s, so feedback would be dead-lettered while its generation record was still retried);
``partitioner=murmur2_random``, the Java client's and kafka-python's partitioner, so a record lands on the
partition every other liverl client (the feedback SDK, ingest's producers) picks for the same key, which the
feedback/generation join needs (librdkafka's default, ``consistent_random``, picks differently).
"""

from __future__ import annotations

import asyncio
import logging

from confluent_kafka import KafkaException, Producer

log = logging.getLogger("liverl.serving.producer")

IDLE_POLL_S = 0.05
WAIT_POLL_S = 0.001


class AsyncProducer:
    def __init__(self, bootstrap: str, client_id: str, delivery_timeout_s: float, linger_ms: float = 2.0, **config):
        self.settings = {
            "bootstrap.servers": bootstrap,
            "client.id": client_id,
            "enable.idempotence": False,
            "max.in.flight.requests.per.connection": 1,
            "acks": "all",
            "partitioner": "murmur2_random",
            "linger.ms": linger_ms,
            "message.timeout.ms": int(delivery_timeout_s * 1000),
            **config,
        }
        """What the librdkafka producer was built with (``logger`` aside): tests read its delivery timeout here."""
        self._producer = Producer({**self.settings, "logger": log})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting = 0  # callers inside wait(): poll fast
        self._wake = asyncio.Event()
        self._poller: asyncio.Task | None = None

    async def start(self, topics: list[str], timeout_s: float = 10.0) -> None:
        """Fetch the topics' metadata now (so the first records do not wait for it) and start polling."""
        md = await asyncio.to_thread(self._producer.list_topics, None, timeout_s)
        missing = [t for t in topics if t not in md.topics or md.topics[t].error is not None]
        if missing:
            raise RuntimeError(f"topics {missing} are not on the broker")
        self._loop = asyncio.get_running_loop()
        self._poller = asyncio.create_task(self._poll(), name="liverl-producer-poll")

    def produce(self, topic: str, key: str, value: bytes) -> asyncio.Future:
        """Queue one record; the future resolves when the broker has it (or fails with the KafkaError).
        Raises ``BufferError`` when the local queue is full, ``ValueError`` when librdkafka refuses the record."""
        fut = self._loop.create_future()
        try:
            self._producer.produce(topic, value=value, key=key, on_delivery=lambda err, _msg: _settle(fut, err))
        except KafkaException as e:
            raise ValueError(f"Kafka refused the record: {e}") from None
        return fut

    async def wait(self, acks: list[asyncio.Future], timeout_s: float) -> int:
        """Wait until every ack is settled, at most ``timeout_s``; returns how many were still pending."""
        pending = [a for a in acks if not a.done()]
        if not pending:
            return 0
        self._waiting += 1
        self._wake.set()
        try:
            _, late = await asyncio.wait(pending, timeout=timeout_s)
        finally:
            self._waiting -= 1
        return len(late)

    async def _poll(self) -> None:
        while True:
            self._producer.poll(0)  # runs the delivery callbacks, here on the loop's thread
            self._wake.clear()
            try:
                async with asyncio.timeout(WAIT_POLL_S if self._waiting else IDLE_POLL_S):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (at most ``timeout_s``), then stop polling."""
        deadline = self._loop.time() + timeout_s
        while len(self._producer) and self._loop.time() < deadline:
            self._producer.poll(0)
            await asyncio.sleep(0.01)
        self._producer.poll(0)
        if len(self._producer):
            log.error("%d records were not delivered to Kafka before shutdown", len(self._producer))
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)


def _settle(fut: asyncio.Future, err) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(RuntimeError(f"Kafka did not take the record: {err}"))
    else:
        fut.set_result(None)
