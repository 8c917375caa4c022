"""Timeouts that agree: every producer liverl builds gives up on a record after
``broker.delivery_timeout_s``, set explicitly, and the config refuses a ``ingest.pending_ttl_s`` that does not exceed
it by ``DELIVERY_MARGIN_S``. Otherwise a librdkafka producer retries a generation record for librdkafka's default
300 s while ingest dead-letters the feedback waiting for it at 150 s."""

from __future__ import annotations

import asyncio

import pytest

from core.config import DELIVERY_MARGIN_S, load_config


def test_a_pending_ttl_below_the_delivery_timeout_plus_margin_is_refused_at_load():
    with pytest.raises(
        ValueError, match=r"ingest.pending_ttl_s \(80 s\) must exceed broker.delivery_timeout_s \(60 s\)"
    ):
        load_config(env={}, ingest__pending_ttl_s=80.0)
    with pytest.raises(ValueError, match="broker.delivery_timeout_s"):
        load_config(env={"LIVERL__BROKER__DELIVERY_TIMEOUT_S": "200"})
    cfg = load_config(env={})
    assert cfg.ingest.pending_ttl_s >= cfg.broker.delivery_timeout_s + DELIVERY_MARGIN_S
    assert load_config(env={}, ingest__pending_ttl_s=40.0, broker__delivery_timeout_s=10.0)


def test_every_producer_liverl_builds_carries_the_configured_delivery_timeout(cfg):
    from core.bus import feedback_client, librdkafka_producer_config, make_producer
    from serving.node.producer import AsyncProducer

    cfg = load_config(env={}, broker__bootstrap=cfg.broker.bootstrap, broker__delivery_timeout_s=42.0)
    want_ms = 42_000
    assert want_ms + DELIVERY_MARGIN_S * 1000 <= cfg.ingest.pending_ttl_s * 1000
    p = make_producer(cfg.broker.bootstrap, broker=cfg.broker)  # learner, gate, admin, demo
    try:
        assert p.config["delivery_timeout_ms"] == want_ms
        assert p.config["request_timeout_ms"] < want_ms
    finally:
        p.close()
    sdk = feedback_client(cfg)  # the feedback SDK, as the server's config builds it
    try:
        assert sdk._producer.config["delivery_timeout_ms"] == want_ms
    finally:
        sdk.close()
    default = make_producer(cfg.broker.bootstrap)  # no config at hand: the documented default, never kafka-python's
    try:
        assert default.config["delivery_timeout_ms"] == int(load_config(env={}).broker.delivery_timeout_s * 1000)
    finally:
        default.close()

    async def gateway_producer():  # the gateway's librdkafka producer, built as serving.node.gateway builds it
        gw = AsyncProducer(cfg.broker.bootstrap, "t-gw", delivery_timeout_s=cfg.broker.delivery_timeout_s)
        return gw.settings

    assert asyncio.run(gateway_producer())["message.timeout.ms"] == want_ms
    assert librdkafka_producer_config(cfg.broker)["message.timeout.ms"] == want_ms
    with pytest.raises(TypeError):  # no librdkafka producer without an explicit delivery timeout
        AsyncProducer(cfg.broker.bootstrap, "t-gw")


def test_the_sdk_default_delivery_timeout_is_the_servers():
    """A product's client built without liverl's config gives up on a record when the server's default says."""
    from core.config import BrokerConfig
    from liverl_sdk.client import DELIVERY_TIMEOUT_S

    assert BrokerConfig().delivery_timeout_s == DELIVERY_TIMEOUT_S
