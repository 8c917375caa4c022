"""The gateway's generation log seals each record that names its user (``core.shred``), under that user's key from
a bounded in-process cache, and logs a record without a user as it is. No vLLM: a recording producer, the registry's
real SQLite database."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from core.schemas import GenerationRecord
from core.shred import KeyCache, UserKeys, open_record
from deploy.registry.regdb import RegistryDB
from serving.node import openai_api as oa
from serving.node.gateway_metrics import GatewayMetrics
from serving.node.generation_log import GenerationLog

KEK = bytes(range(32))


class _Producer:
    def __init__(self):
        self.sent: list[tuple[str, str, bytes]] = []

    def produce(self, topic: str, key: str, value: bytes) -> asyncio.Future:
        self.sent.append((topic, key, value))
        fut = asyncio.get_event_loop().create_future()
        fut.set_result(None)
        return fut


@pytest.fixture
def keys(tmp_path):
    db = RegistryDB(f"sqlite:///{tmp_path / 'registry.db'}")
    k = UserKeys(db, KEK)
    yield k
    k.close()
    db.close()


def test_records_with_a_user_are_sealed_and_records_without_one_are_not(keys):
    async def run():
        producer, cache = _Producer(), KeyCache(keys, size=8)
        log = GenerationLog(producer, "t.generations", "node-a", 64, GatewayMetrics(), 1.0, keys=cache)
        req = oa.CompletionRequest.parse(json.dumps({"prompt": "PANGOLIN-9917", "max_tokens": 4}).encode())
        choice = oa.Choice("PANGOLIN-9917", [7, 8, 9], ["TAPIR-", "3301"], [11, 12], [-0.1, -0.2], "stop")
        for gid, unit in (("g1", "0123456789abcdef"), ("g2", None), ("g3", "0123456789abcdef")):
            log.log(req, choice, gid, 3, latency_s=0.01, unit=unit)
        return producer.sent, cache

    sent, cache = asyncio.run(run())
    recs = {key: GenerationRecord.from_bytes(value) for _, key, value in sent}
    for gid in ("g1", "g3"):
        raw = next(v for _, k, v in sent if k == gid)
        assert b"PANGOLIN" not in raw and b"TAPIR" not in raw and b"[7,8,9]" not in raw
        opened = open_record(keys.key_for(recs[gid].unit, create=False), recs[gid])
        assert (opened.prompt, opened.completion, opened.prompt_token_ids) == ("PANGOLIN-9917", "TAPIR-3301", [7, 8, 9])
        assert opened.completion_token_ids == [11, 12] and recs[gid].completion_logprobs == [-0.1, -0.2]
    assert recs["g2"].sealed is None and recs["g2"].prompt == "PANGOLIN-9917"
    assert cache.misses == 1 and cache.hits == 1  # one registry read for the user's two records


def test_a_sealed_record_over_the_size_limit_is_logged_without_its_text_at_its_true_length(keys):
    async def run():
        producer = _Producer()
        log = GenerationLog(producer, "t.g", "node-a", 64, GatewayMetrics(), 1.0, max_bytes=400, keys=KeyCache(keys))
        req = oa.CompletionRequest.parse(json.dumps({"prompt": "PANGOLIN-9917", "max_tokens": 4}).encode())
        choice = oa.Choice("PANGOLIN-9917" * 20, [7] * 30, ["TAPIR-3301"], [11, 12, 13], [-0.1] * 3, "stop")
        log.log(req, choice, "g1", 3, unit="0123456789abcdef")
        return producer.sent

    ((_, _, raw),) = asyncio.run(run())
    rec = GenerationRecord.from_bytes(raw)
    assert rec.untrainable_reason == "too_large" and rec.completion_tokens == 3 and rec.sealed is None
    assert b"PANGOLIN" not in raw and b"TAPIR" not in raw


def test_sealing_and_the_key_look_up_cost(keys, capsys):
    """The cost per record of sealing and opening, and of the gateway's key look-up (a cache hit, and a miss that
    reads or makes the key in the registry): printed, not asserted (``pytest -s``)."""
    from core.shred import open_sealed, seal

    payload = {"prompt": "x" * 400, "completion": "y" * 200, "prompt_token_ids": list(range(100)),
               "completion_token_ids": list(range(50)), "routed_experts": None}  # fmt: skip
    key, n = keys.key_for("0123456789abcdef"), 2000
    t0 = time.perf_counter()
    blobs = [seal(key, "0123456789abcdef", payload) for _ in range(n)]
    t1 = time.perf_counter()
    for b in blobs:
        open_sealed(key, "0123456789abcdef", b)
    t2 = time.perf_counter()
    cache = KeyCache(keys, size=4096)
    units = [f"{i:016x}" for i in range(300)]
    t3 = time.perf_counter()
    for u in units:
        cache.get(u)  # misses: made in the registry
    t4 = time.perf_counter()
    for u in units:
        cache.get(u)  # hits
    t5 = time.perf_counter()
    cache.ttl_s = 0
    for u in units:
        cache.get(u)  # misses: read from the registry
    t6 = time.perf_counter()
    with capsys.disabled():
        print(
            f"\nseal {1e6 * (t1 - t0) / n:.1f} us, open {1e6 * (t2 - t1) / n:.1f} us per record "
            f"({len(blobs[0])} B sealed); key look-up: hit {1e6 * (t5 - t4) / len(units):.2f} us, miss (read) "
            f"{1e3 * (t6 - t5) / len(units):.2f} ms, miss (made) {1e3 * (t4 - t3) / len(units):.2f} ms (SQLite)"
        )
    assert cache.hits == len(units) and cache.misses == 2 * len(units)
