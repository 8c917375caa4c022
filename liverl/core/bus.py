"""Kafka plumbing shared by the stages: topic creation and well-configured kafka-python clients.

Every client here works against any Kafka-compatible broker by bootstrap URL. The consumer defaults
are tuned so that the embedded Tansu broker (whose group join waits for the rebalance timeout) is usable.
"""

from __future__ import annotations

import logging
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.serializer import Serializer

from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.core.bus")


def ensure_topics(bootstrap: str, names: list[str], partitions: int, timeout_s: float = 30.0) -> None:
    """Create the topics that do not exist yet (idempotent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="liverl-admin")
            break
        except KafkaError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kafka at {bootstrap} does not answer: {e}") from e
            time.sleep(0.5)
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names if n not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


def all_topics(cfg: LiverlConfig) -> list[str]:
    t = cfg.topics
    return [t.feedback, t.generations, t.samples, t.dead_letters]


class KeySerializer(Serializer):
    """Keys are generation ids (str); bytes pass through."""

    def serialize(self, topic, key):
        return key.encode() if isinstance(key, str) else key


def make_producer(bootstrap: str, **kw) -> KafkaProducer:
    """Idempotent, acks=all producer whose values are bytes and keys str (uncompressed: every consumer reads it)."""
    opts = dict(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        key_serializer=KeySerializer(),
    )
    opts.update(kw)
    return KafkaProducer(**opts)


def make_consumer(bootstrap: str, group: str, topics: list[str], rebalance_timeout_s: float = 3.0, **kw) -> KafkaConsumer:
    """A consumer that commits by hand (after the work is durable) and starts from the earliest offset."""
    opts = dict(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_interval_ms=max(int(rebalance_timeout_s * 1000), 1000),
        session_timeout_ms=max(int(rebalance_timeout_s * 1000), 6000),
        heartbeat_interval_ms=1000,
    )
    opts.update(kw)
    consumer = KafkaConsumer(**opts)
    consumer.subscribe(topics)
    return consumer
