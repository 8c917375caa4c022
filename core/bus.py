"""Kafka plumbing shared by the stages: topic creation, well-configured kafka-python clients, and the one place
that turns ``broker.*`` security settings into each client library's options.

Every client here works against any Kafka-compatible broker by bootstrap URL. The consumer defaults
are tuned so that the embedded Tansu broker (whose group join waits for the rebalance timeout) is usable.

Security (TLS, SASL): liverl talks to Kafka through three client libraries, each with its own option names:
kafka-python (the SDK, the learner, the gate, the admin), aiokafka (the ingest worker) and librdkafka (the
gateway's producer). ``kafka_python_security``, ``aiokafka_security`` and ``librdkafka_security`` map one
``BrokerConfig`` onto each; every client liverl creates goes through them.
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from core.config import BrokerConfig, LiverlConfig
from core.services import ServiceError
from liverl_sdk.client import FeedbackClient, producer_options


class BrokerUnavailable(ServiceError, RuntimeError):
    """The Kafka bootstrap did not answer within the time given."""


log = logging.getLogger("liverl.core.bus")


def _sasl_credentials(broker: BrokerConfig) -> tuple[str, str]:
    """(user name, password) of a SASL protocol: BrokerConfig's validator refuses a SASL protocol without both."""
    assert broker.sasl_username is not None and broker.sasl_password is not None
    return broker.sasl_username, broker.sasl_password.get_secret_value()


def kafka_python_security(broker: BrokerConfig | None) -> dict[str, Any]:
    """kafka-python's keyword arguments for the broker's security settings (empty for PLAINTEXT)."""
    if broker is None or broker.security_protocol == "PLAINTEXT":
        return {}
    kw: dict[str, Any] = {"security_protocol": broker.security_protocol}
    if broker.security_protocol.startswith("SASL"):
        user, password = _sasl_credentials(broker)
        kw.update(sasl_mechanism=broker.sasl_mechanism, sasl_plain_username=user, sasl_plain_password=password)
    if broker.security_protocol.endswith("SSL"):
        kw.update(
            {
                k: v
                for k, v in (
                    ("ssl_cafile", broker.ssl_cafile),
                    ("ssl_certfile", broker.ssl_certfile),
                    ("ssl_keyfile", broker.ssl_keyfile),
                )
                if v
            }
        )
    return kw


def _ssl_context(broker: BrokerConfig):
    ctx = ssl.create_default_context(cafile=broker.ssl_cafile)
    if broker.ssl_certfile:
        ctx.load_cert_chain(broker.ssl_certfile, broker.ssl_keyfile)
    return ctx


def aiokafka_security(broker: BrokerConfig | None) -> dict[str, Any]:
    """aiokafka's keyword arguments (it takes an ``ssl.SSLContext`` instead of file names)."""
    if broker is None or broker.security_protocol == "PLAINTEXT":
        return {}
    kw: dict[str, Any] = {"security_protocol": broker.security_protocol}
    if broker.security_protocol.startswith("SASL"):
        user, password = _sasl_credentials(broker)
        kw.update(sasl_mechanism=broker.sasl_mechanism, sasl_plain_username=user, sasl_plain_password=password)
    if broker.security_protocol.endswith("SSL"):
        kw["ssl_context"] = _ssl_context(broker)
    return kw


def librdkafka_security(broker: BrokerConfig | None) -> dict[str, str]:
    """librdkafka's configuration properties (confluent-kafka, kcat)."""
    if broker is None or broker.security_protocol == "PLAINTEXT":
        return {}
    conf = {"security.protocol": broker.security_protocol.lower()}
    if broker.security_protocol.startswith("SASL"):
        user, password = _sasl_credentials(broker)
        conf.update({"sasl.mechanism": broker.sasl_mechanism, "sasl.username": user, "sasl.password": password})
    if broker.security_protocol.endswith("SSL"):
        conf.update(
            {
                k: v
                for k, v in (
                    ("ssl.ca.location", broker.ssl_cafile),
                    ("ssl.certificate.location", broker.ssl_certfile),
                    ("ssl.key.location", broker.ssl_keyfile),
                )
                if v
            }
        )
    return conf


def topic_configs(cfg: LiverlConfig) -> dict[str, str]:
    """The configs liverl sets on the topics it creates: retention (``topics.retention_s``), which bounds how long
    users' content stays on the broker."""
    r = cfg.topics.retention_s
    return {} if r is None else {"retention.ms": str(int(r * 1000))}


def ensure_topics(
    bootstrap: str,
    names: list[str],
    partitions: int,
    timeout_s: float = 30.0,
    broker: BrokerConfig | None = None,
    configs: dict[str, str] | None = None,
) -> None:
    """Create the topics that do not exist yet (idempotent), with ``configs`` (``topic_configs``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=bootstrap, client_id="liverl-admin", **kafka_python_security(broker)
            )
            break
        except KafkaError as e:
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"Kafka at {bootstrap} does not answer: {e}") from e
            time.sleep(0.5)
    try:
        existing = set(admin.list_topics())
        missing = [
            NewTopic(n, num_partitions=partitions, replication_factor=1, topic_configs=dict(configs or {}))
            for n in names
            if n not in existing
        ]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


def all_topics(cfg: LiverlConfig) -> list[str]:
    t = cfg.topics
    return [t.feedback, t.generations, t.samples, t.dead_letters, t.heldout]


def delivery_timeout_s(broker: BrokerConfig | None) -> float:
    """How long a producer retries a record (``broker.delivery_timeout_s``; its default without a config)."""
    return (broker or BrokerConfig()).delivery_timeout_s


def librdkafka_producer_config(broker: BrokerConfig | None) -> dict[str, str | int]:
    """A librdkafka producer's delivery timeout (``message.timeout.ms``, librdkafka's default 300 s otherwise) and
    security settings: what every librdkafka producer liverl builds starts from."""
    return {"message.timeout.ms": int(delivery_timeout_s(broker) * 1000), **librdkafka_security(broker)}


def make_producer(bootstrap: str, broker: BrokerConfig | None = None, **kw) -> KafkaProducer:
    """A producer with the options every liverl producer shares (``liverl_sdk.client.producer_options``: acks=all, not
    idempotent, one request in flight, ``liverl_sdk.client.PRODUCER_ORDER`` says why), that gives up on a record after
    ``broker.delivery_timeout_s`` (set explicitly: ingest's pending_ttl_s is checked against it)."""
    return KafkaProducer(**producer_options(bootstrap, delivery_timeout_s(broker), kafka_python_security(broker), **kw))


def feedback_client(cfg: LiverlConfig, bootstrap: str | None = None, **producer_kw: Any) -> FeedbackClient:
    """The product's feedback client for ``cfg.topics.feedback`` at ``bootstrap`` (default ``cfg.broker.bootstrap``),
    with the broker's security settings and delivery timeout."""
    bootstrap = bootstrap or cfg.broker.bootstrap
    if not bootstrap:
        raise ValueError("no Kafka bootstrap: pass bootstrap= (e.g. Stack.bootstrap) or set broker.bootstrap")
    return FeedbackClient(
        bootstrap,
        cfg.topics.feedback,
        security=kafka_python_security(cfg.broker),
        delivery_timeout_s=cfg.broker.delivery_timeout_s,
        **producer_kw,
    )


def make_consumer(
    bootstrap: str,
    group: str,
    topics: list[str],
    rebalance_timeout_s: float = 3.0,
    broker: BrokerConfig | None = None,
    **kw,
) -> KafkaConsumer:
    """A consumer that commits by hand (after the work is durable) and starts from the earliest offset. ``topics``
    empty: subscribed to nothing, for a caller that assigns its partitions itself and commits to ``group`` without
    joining it (the learner: ``Learner._assign``)."""
    opts = dict(
        **kafka_python_security(broker),
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
    if topics:
        consumer.subscribe(topics)
    return consumer


def make_reader(bootstrap: str, broker: BrokerConfig | None = None, **kw) -> KafkaConsumer:
    """A consumer in no group that never commits: the caller assigns partitions and seeks (the gate's tails, the
    audit's full reads)."""
    return KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **kafka_python_security(broker), **kw
    )


# -- aiokafka (the ingest worker) -----------------------------------------------------------------------------------
# (aiokafka is imported in these functions, not at the top: only the ingest worker runs an event-loop client, and the
# other processes that import this module, the CLI among them, need not load it)


def make_aio_producer(bootstrap: str, broker: BrokerConfig | None, client_id: str, **kw) -> Any:
    """An aiokafka producer, acks=all, sending at once (ingest batches records itself, ``ingest.outbox``), that gives
    up on a request after 30 s (then the worker stops and replays: its outputs are not what ``pending_ttl_s`` waits
    for). Not started: ``await producer.start()``."""
    from aiokafka import AIOKafkaProducer  # noqa: PLC0415 aiokafka: only the ingest worker loads it

    opts: dict[str, Any] = dict(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=False,  # liverl_sdk.client.PRODUCER_ORDER
        linger_ms=0,
        request_timeout_ms=30_000,
        **aiokafka_security(broker),
    )
    opts.update(kw)
    return AIOKafkaProducer(**opts)


def make_aio_consumer(bootstrap: str, broker: BrokerConfig | None, group: str | None = None, **kw) -> Any:
    """An aiokafka consumer that commits by hand and starts from the earliest offset; ``group`` None: no consumer
    group (assign partitions yourself). With a group, the rebalance timeout is ``broker.rebalance_timeout_s`` (Tansu
    completes a join only after it: kept short, or the first poll waits minutes) and the session timeout no shorter
    than the heartbeat cadence allows. Not started: ``await consumer.start()``."""
    from aiokafka import AIOKafkaConsumer  # noqa: PLC0415 aiokafka: only the ingest worker loads it

    opts: dict[str, Any] = dict(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **aiokafka_security(broker),
    )
    if group is not None:
        rebalance_ms = int(float((broker or BrokerConfig()).rebalance_timeout_s) * 1000)
        opts.update(
            client_id=group,
            rebalance_timeout_ms=rebalance_ms,
            session_timeout_ms=max(rebalance_ms, 6000),
            heartbeat_interval_ms=1000,
        )
    opts.update(kw)
    return AIOKafkaConsumer(**opts)


def make_aio_client(bootstrap: str, broker: BrokerConfig | None, **kw) -> Any:
    """aiokafka's low-level client (one request at a time, e.g. a LeaveGroup). Not started: ``await c.bootstrap()``."""
    from aiokafka.client import AIOKafkaClient  # noqa: PLC0415 aiokafka: only the ingest worker loads it

    opts: dict[str, Any] = dict(bootstrap_servers=bootstrap, request_timeout_ms=5000, **aiokafka_security(broker))
    opts.update(kw)
    return AIOKafkaClient(**opts)
