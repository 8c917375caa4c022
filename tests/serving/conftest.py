"""The serving stack for every test in this package: one vLLM node on CPU + gateway + agent (started once,
about 30-60 s), a registry whose version 0 is the demo policy, on the session's broker and Redis."""

from __future__ import annotations

import os
import time
import types
import uuid
from pathlib import Path

import pytest

from core.config import load_config
from core.schemas import GenerationRecord
from tests.conftest import free_port


@pytest.fixture(scope="package")
def srv(stack, tmp_path_factory):
    """One node + gateway + agent for the package, with a registry whose version 0 is the base policy."""
    import redis

    from core.credentials import ensure_secrets
    from deploy.registry.blobstore import LocalBlobStore
    from deploy.registry.registry import Registry
    from deploy.registry.signing import Signer, generate_keypair
    from liverl.demo.base_policy import ensure_base_policy, load_state_dict
    from tests.serving.harness import ServingThread

    cache = Path(os.environ.get("LIVERL_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("models"))
    model_dir = ensure_base_policy(cache, seed=0, progress=False)
    cfg = load_config(
        env={},
        state_dir=str(tmp_path_factory.mktemp("serving")),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
        serving__gateway_port=free_port(),
        serving__vllm_port=free_port(),
        serving__agent_port=free_port(),
        serving__swap_poll_s=0.1,
        serving__max_num_seqs=32,
    )
    private, _ = generate_keypair(cfg.state_path / "keys")  # what `liverl up` does: serve needs the verify key
    ensure_secrets(cfg)  # and the router's assignment key and the product key /v1/feedback takes
    registry = Registry(cfg.registry_url, LocalBlobStore(cfg.blob_location))
    base = load_state_dict(model_dir)
    registry.init_base(base, str(model_dir))
    serving = ServingThread(cfg, model_dir, stack.bootstrap, stack.redis_url, cfg.registry_url).start()
    ns = types.SimpleNamespace(
        cfg=cfg,
        url=serving.url,
        node_url=serving.node.url,
        node_key=serving.node.key,
        model_dir=model_dir,
        registry=registry,
        base=base,
        serving=serving,
        signer=Signer(private),
        redis=redis.Redis.from_url(stack.redis_url),
        bootstrap=stack.bootstrap,
    )
    yield ns
    serving.stop()
    ns.redis.close()
    registry.close()


def records(srv, ids: set[str], timeout_s: float = 30) -> dict[str, GenerationRecord]:
    """Generation records with the given ids, read from every partition of the generations topic."""
    from kafka import KafkaConsumer, TopicPartition

    topic = srv.cfg.topics.generations
    consumer = KafkaConsumer(bootstrap_servers=srv.bootstrap, enable_auto_commit=False, consumer_timeout_ms=500)
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        found: dict[str, GenerationRecord] = {}
        deadline = time.monotonic() + timeout_s
        while ids - set(found) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                for msg in batch:
                    rec = GenerationRecord.from_bytes(msg.value)
                    assert msg.key.decode() == rec.generation_id
                    if rec.generation_id in ids:
                        found[rec.generation_id] = rec
        return found
    finally:
        consumer.close()
