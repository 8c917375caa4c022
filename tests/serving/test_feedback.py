"""Feedback without the Python SDK: ``POST /v1/feedback`` on the gateway (with the product key; without it:
test_feedback_auth.py), and a librdkafka client (confluent-kafka) publishing to the embedded broker as docs/product.md
shows. Both land where the SDK's record would: the feedback topic, keyed by generation id, on the partition the Java
client's murmur2 partitioner picks."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest
from kafka.partitioner.default import murmur2

from core.bus import all_topics, ensure_topics
from core.credentials import PRODUCT_KEY_HEADER, load_feedback_keys
from core.schemas import FeedbackEvent
from tests.ingest.conftest import TopicTail


def _partition(key: str, partitions: int) -> int:
    """The partition kafka-python (and the Java client) choose for ``key``."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def _post(url: str, raw: bytes, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({PRODUCT_KEY_HEADER: key} if key else {})}
    req = urllib.request.Request(url, data=raw, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_feedback_over_http(srv):
    cfg = srv.cfg
    key = load_feedback_keys(cfg)[0].decode()  # the product key (the srv fixture makes it, as `liverl up` does)
    gids = [f"gen-{uuid.uuid4().hex}" for _ in range(6)]
    for i, gid in enumerate(gids):
        body = {
            "feedback_id": f"fb-{gid}",
            "generation_id": gid,
            "kind": "accept" if i % 2 else "reject",
            "segment": "a",
        }
        status, out = _post(srv.url + "/v1/feedback", json.dumps(body).encode(), key)
        assert status == 202 and out["feedback_id"] == f"fb-{gid}" and out["generation_id"] == gid
    with TopicTail(srv.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        recs = tail.wait_for(tail.keys(set(gids)), n=len(gids))
    for r in recs:
        event = FeedbackEvent.from_bytes(r.value)
        assert r.key.decode() == event.generation_id and event.feedback_id == f"fb-{event.generation_id}"
        assert r.partition == _partition(event.generation_id, cfg.broker.partitions)

    for raw, param in [
        (b'{"feedback_id": "f1", "generation_id": "g1", "kind": "love"}', "kind"),
        (b'{"feedback_id": "f1", "generation_id": "g1", "kind": "edit"}', None),
        (b'{"generation_id": "g1", "kind": "accept"}', "feedback_id"),
        (b"{not json", None),
        (b"[1]", None),
    ]:
        status, out = _post(srv.url + "/v1/feedback", raw, key)
        assert status == 400 and out["error"]["param"] == param, out
        reason = out["error"]["message"].split(":")[0]
        assert reason in ("invalid_field", "malformed_json", "not_an_object"), out


def test_confluent_kafka_publishes_feedback_like_the_readme(cfg):
    """The librdkafka settings docs/product.md gives: key = generation id, partitioner murmur2_random."""
    from confluent_kafka import Producer

    ensure_topics(cfg.broker.bootstrap, all_topics(cfg), cfg.broker.partitions)
    producer = Producer(
        {"bootstrap.servers": cfg.broker.bootstrap, "enable.idempotence": True, "partitioner": "murmur2_random"}
    )
    gids = [f"gen-{uuid.uuid4().hex}" for _ in range(8)]
    delivered: dict[str, int] = {}
    for gid in gids:
        value = json.dumps({"feedback_id": f"fb-{gid}", "generation_id": gid, "kind": "reject"})
        producer.produce(
            cfg.topics.feedback,
            key=gid,
            value=value,
            on_delivery=lambda err, msg: delivered.__setitem__(msg.key().decode(), msg.partition()),
        )
    assert producer.flush(30) == 0
    with TopicTail(cfg.broker.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        recs = tail.wait_for(tail.keys(set(gids)), n=len(gids))
    assert cfg.broker.partitions > 1
    for r in recs:
        gid = r.key.decode()
        assert FeedbackEvent.from_bytes(r.value).generation_id == gid
        assert r.partition == delivered[gid] == _partition(gid, cfg.broker.partitions)
