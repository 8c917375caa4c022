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
from tests.conftest import free_port

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
        # the first record of a user waits for the key, read on a thread; then the key is at hand
        await log.log(req, choice, "g1", 3, latency_s=0.01, unit="0123456789abcdef")
        for gid, unit in (("g2", None), ("g3", "0123456789abcdef")):
            assert log.log(req, choice, gid, 3, latency_s=0.01, unit=unit).done()
        await log.close(1.0)
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
        await log.log(req, choice, "g1", 3, unit="0123456789abcdef")
        await log.close(1.0)
        return producer.sent

    ((_, _, raw),) = asyncio.run(run())
    rec = GenerationRecord.from_bytes(raw)
    assert rec.untrainable_reason == "too_large" and rec.completion_tokens == 3 and rec.sealed is None
    assert b"PANGOLIN" not in raw and b"TAPIR" not in raw


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
    """Pipe one connection to 127.0.0.1:``port`` (the database, reachable again)."""
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()

    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)


def test_a_record_waits_for_its_users_key_while_the_database_is_away_and_is_logged_sealed_once_it_answers(pg_url):
    """The registry's PostgreSQL is away (nothing listens where the gateway reaches it): a user's first record is
    held, not logged unsealed and not dropped, while the event loop goes on; once the database answers again the
    record is logged, sealed under the user's key. Past ``log_hold_max`` records a record is not logged (counted), and
    one still without its key after ``hold_s`` is given up on (counted)."""
    RegistryDB(pg_url).close()  # the registry's schema, the user_keys table among it
    port = free_port()
    pg_port = int(pg_url.split("@127.0.0.1:")[1].split("/")[0])
    keys = UserKeys(pg_url.replace(f"127.0.0.1:{pg_port}", f"127.0.0.1:{port}"), KEK)
    req = oa.CompletionRequest.parse(json.dumps({"prompt": "PANGOLIN-9917", "max_tokens": 4}).encode())
    choice = oa.Choice("PANGOLIN-9917", [7, 8, 9], ["TAPIR-", "3301"], [11, 12], [-0.1, -0.2], "stop")

    async def run():
        producer, metrics = _Producer(), GatewayMetrics()
        log = GenerationLog(producer, "t.g", "node-a", 64, metrics, 1.0, keys=KeyCache(keys, retry_s=0.2),
                            hold_s=60.0, hold_max=1)  # fmt: skip
        held = log.log(req, choice, "g1", 3, unit="0123456789abcdef")
        assert held is not None and not held.done()
        assert log.log(req, choice, "g2", 3, unit="fedcba9876543210") is None  # over log_hold_max: not logged
        ticks = 0
        for _ in range(20):  # the loop runs on while the key is asked for, and asked for again
            await asyncio.sleep(0.05)
            ticks += 1
        assert ticks == 20 and not held.done() and producer.sent == []
        assert metrics.m_log_held._value.get() == 1 and metrics.m_log_fail._value.get() == 1
        server = await asyncio.start_server(lambda r, w: _forward(r, w, pg_port), "127.0.0.1", port)
        try:
            await asyncio.wait_for(held, 30)
            ((_, gid, raw),) = producer.sent
            assert gid == "g1" and b"PANGOLIN" not in raw and metrics.m_log_held._value.get() == 0
            rec = GenerationRecord.from_bytes(raw)
            key = await asyncio.to_thread(keys.key_for, rec.unit, False)  # (through the forwarder on this loop)
            assert open_record(key, rec).prompt == "PANGOLIN-9917"
        finally:
            server.close()
        await log.close(1.0)
        # a database away for longer than hold_s: given up on, counted, nothing logged
        keys_away = UserKeys(pg_url.replace(f"127.0.0.1:{pg_port}", f"127.0.0.1:{free_port()}"), KEK)
        brief = GenerationLog(producer, "t.g", "node-a", 64, metrics, 1.0, keys=KeyCache(keys_away, retry_s=0.2),
                              hold_s=0.5, hold_max=10)  # fmt: skip
        await asyncio.wait_for(brief.log(req, choice, "g3", 3, unit="0123456789abcdef"), 30)
        assert len(producer.sent) == 1 and metrics.m_log_fail._value.get() == 2
        await brief.close(1.0)
        keys_away.close()

    try:
        asyncio.run(run())
    finally:
        keys.close()


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


def test_a_record_waits_for_its_key_only_as_long_as_the_feedback_on_it_waits_for_it():
    """What ``ingest.pending_ttl_s`` leaves beyond the producers' delivery timeout and its margin: a record logged at
    the end of that wait still reaches ingest before the feedback on it expires."""
    from core.config import load_config
    from serving.node.generation_log import record_hold_s

    assert record_hold_s(load_config(env={})) == 150.0 - 60.0 - 30.0
    assert record_hold_s(load_config(env={}, ingest__pending_ttl_s=90.0)) == 0.0
    assert record_hold_s(load_config(env={}, ingest__pending_ttl_s=40.0, broker__delivery_timeout_s=10.0)) == 20.0
