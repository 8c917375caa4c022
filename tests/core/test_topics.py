"""The topics liverl creates bound how long users' content stays on the broker (review finding: dead letters, logged
generations and samples kept user content with no retention), created on the real embedded broker."""

from __future__ import annotations

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from core.bus import all_topics, ensure_topics, topic_configs


def _described(bootstrap: str, topic: str) -> dict:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="liverl-test")
    try:
        return admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)]).get("topic", {}).get(topic, {})
    finally:
        admin.close()


def test_every_topic_liverl_creates_carries_topics_retention_s(cfg, monkeypatch):
    cfg.topics.retention_s = 3600.0
    assert topic_configs(cfg) == {"retention.ms": "3600000"}
    created = []
    real = KafkaAdminClient.create_topics

    def create_topics(self, new_topics, *a, **kw):  # a spy: the request goes to the broker unchanged
        created.extend(new_topics)
        return real(self, new_topics, *a, **kw)

    monkeypatch.setattr(KafkaAdminClient, "create_topics", create_topics)
    ensure_topics(cfg.broker.bootstrap, all_topics(cfg), 1, configs=topic_configs(cfg))
    assert {t.name: t.topic_configs for t in created} == {t: {"retention.ms": "3600000"} for t in all_topics(cfg)}
    for topic in all_topics(cfg):
        described = _described(cfg.broker.bootstrap, topic)
        # the embedded Tansu broker answers DescribeConfigs with no entries, so there the request above is the
        # evidence; a broker that reports topic configs (Apache Kafka, Redpanda) must report this one
        if described:
            assert described.get("retention.ms") == "3600000", (topic, described)
    cfg.topics.retention_s = None  # the broker's default
    assert topic_configs(cfg) == {}
