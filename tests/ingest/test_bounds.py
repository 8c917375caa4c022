"""Everything in ingest that grows with traffic has a bound, and the bound holds.

| what                              | bound                                                        |
|-----------------------------------|--------------------------------------------------------------|
| join table, waiting generations   | ``ingest.generation_ttl_s`` (6 h), then dropped (counted)     |
| join table, judgements            | ``ingest.judged_ttl_s`` (24 h)                               |
| join table, pending feedback      | ``ingest.max_pending`` entries, ``pending_ttl_s`` (hard limit 10 x TTL) |
| one table entry / sample          | ``MAX_RECORD_BYTES`` (inputs over ``max_event_bytes`` refused) |
| one dead letter                   | value cut to ``DEAD_VALUE_BYTES``, detail and key cut        |
| Redis guard keys ``counted:*``    | ``COUNTED_TTL_S`` (7 days) each                              |
| Redis/Prometheus counter names    | fixed reason codes (never input text)                        |
| RocksDB memory                    | 16 MiB block cache + 2 x 16 MiB write buffers per partition  |
| the partitioner's hash cache      | two generations of ``ingest.partitioner._HASHES_MAX`` (65,536)  |
| the join table's write buffer     | ``ingest.commit.TABLE_BUFFER_WRITES``, ``TABLE_BUFFER_BYTES``, ``TABLE_FLUSH_S`` |
| one batch (records, outputs)      | ``ingest.app.BATCH_MAX`` input records                       |
| batches decided, not yet settled  | ``ingest.commit.SETTLING_MAX`` + the one being decided          |
| held feedback partitions          | the partitions assigned (one entry each)                     |

The join table's dict stands in for ``ingest.table.JoinTable`` here (the decisions are the same code); Redis is the
real one.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from core import keys
from core.config import IngestConfig, load_config
from core.schemas import DeadLetter, FeedbackEvent
from ingest.join import JUDGED, PENDING, WAITING, Ingest, Source, head, pack
from ingest.metrics import COUNTED_TTL_S, IngestMetrics, Tally
from tests.ingest.test_fuzz import Broker

NOW = 1.8e9


@pytest.fixture
def env(stack, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cfg = load_config(
        env={},
        state_dir=str(tmp_path),
        redis__url=stack.redis_url,
        topics__prefix=prefix,
        ingest__max_pending=50,
        ingest__pending_ttl_s=150.0,
        ingest__heldout_share=0.0,
    )
    metrics = IngestMetrics(prefix, stack.redis_url)
    yield cfg, metrics  # each test closes metrics in the event loop that used it
    r = redis.Redis.from_url(stack.redis_url)
    for k in r.scan_iter(f"{prefix}:*", count=1000):
        r.delete(k)
    r.close()


def test_table_entries_expire_after_their_ttls(env):
    cfg, metrics = env
    ic = cfg.ingest
    table = {f"w-old{i}": pack(WAITING, NOW - ic.generation_ttl_s - 1, None, b"{}") for i in range(100)}
    table.update({f"w-new{i}": pack(WAITING, NOW - ic.generation_ttl_s + 60, None, b"{}") for i in range(10)})
    table.update(
        {f"j-old{i}": pack(JUDGED, NOW - ic.judged_ttl_s - 1, {"f": "x", "v": 1, "k": "accept"}) for i in range(100)}
    )
    table.update({f"j-new{i}": pack(JUDGED, NOW - 60, {"f": "x", "v": 1, "k": "accept"}) for i in range(10)})

    async def run():
        ing = Ingest(cfg, metrics, table, Broker())
        try:
            return await ing.evict_old(now=NOW, chunk=7)
        finally:
            await metrics.close()

    assert asyncio.run(run()) == 200
    assert sorted(table) == sorted([f"w-new{i}" for i in range(10)] + [f"j-new{i}" for i in range(10)])
    r = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
    try:
        counters = r.hgetall(f"{cfg.topics.prefix}:ingest:counters")
    finally:
        r.close()
    assert counters == {"generations_expired": "100", "judgements_expired": "100"}


def test_pending_feedback_is_capped_and_expires(env):
    cfg, metrics = env
    broker = Broker()
    table: dict = {}

    async def run():
        ing = Ingest(cfg, metrics, table, broker)
        ing.recovered()
        fbs = [FeedbackEvent(feedback_id=f"f{i}", generation_id=f"g{i}", kind="accept", ts=NOW) for i in range(80)]
        await ing.process(
            [(Source(cfg.topics.feedback, 0, i, f"g{i}"), f.to_bytes()) for i, f in enumerate(fbs)], now=NOW
        )
        full = len(ing.index.entries)
        ing.index.resumed = 0.0
        expired = await ing.expire_pending(now=NOW + 10 * cfg.ingest.pending_ttl_s + 600)
        await metrics.close()
        return full, expired, len(ing.index.entries)

    full, expired, left = asyncio.run(run())
    assert full == cfg.ingest.max_pending == 50
    letters = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    assert sum(d.reason == "pending_full" for d in letters) == 30
    assert expired == 50 and left == 0 and not table
    assert sum(d.reason == "unknown_generation" for d in letters) == 50


@pytest.mark.parametrize("order", ["in time order", "clock went back", "after a restart"])
def test_the_sweep_expires_exactly_the_feedback_that_waited_its_ttl(env, order):
    """The sweep (once a second) visits pending feedback oldest first and stops at the first entry that has not
    waited its TTL; entries written out of time order (a caller's clock going back) or rebuilt from the table after a
    restart (any order) must still expire exactly when due."""
    cfg, metrics = env
    ttl = cfg.ingest.pending_ttl_s
    broker = Broker()
    table: dict = {}
    times = [NOW + 10.0 * i for i in range(10)]
    if order == "clock went back":
        times = times[5:] + times[:5]

    async def run():
        ing = Ingest(cfg, metrics, table, broker)
        ing.recovered()
        for i, t in enumerate(times):
            fb = FeedbackEvent(feedback_id=f"f{i}", generation_id=f"g{i}", kind="accept", ts=NOW)
            await ing.process([(Source(cfg.topics.feedback, 0, i, f"g{i}"), fb.to_bytes())], now=t)
        if order == "after a restart":
            shuffled = list(table.items())
            shuffled.reverse()
            ing.recovered(lambda: shuffled)
        ing.index.resumed = 0.0
        ing.index.clock[0] = NOW + 100 * ttl  # the generations stream is far ahead: waiting long enough is enough
        first = await ing.expire_pending(now=NOW + 45.0 + ttl)  # entries written at NOW .. NOW + 40 are due
        second = await ing.expire_pending(now=NOW + 90.0 + ttl)
        await metrics.close()
        return first, second, sorted(ing.index.entries)

    first, second, left = asyncio.run(run())
    assert (first, second, left) == (5, 5, [])
    letters = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    assert [d.key for d in letters[:5]] and {d.key for d in letters[:5]} == {
        f"g{i}" for i, t in enumerate(times) if t <= NOW + 45.0
    }


def test_timers_touch_only_assigned_partitions(env):
    cfg, metrics = env
    broker = Broker()
    table: dict = {}

    async def run():
        ing = Ingest(cfg, metrics, table, broker)
        ing.recovered()
        batch = [
            (
                Source(cfg.topics.feedback, p, 1, f"g{p}"),
                FeedbackEvent(feedback_id=f"f{p}", generation_id=f"g{p}", kind="reject", ts=NOW).to_bytes(),
            )
            for p in (0, 1)
        ]
        await ing.process(batch, now=NOW)
        ing.index.resumed = 0.0
        try:
            return await ing.expire_pending(now=NOW + 10_000, assigned={0})
        finally:
            await metrics.close()

    assert asyncio.run(run()) == 1
    assert [head(v)[0] for v in table.values()] == [PENDING] and "g1" in table  # partition 1: another worker's


def test_the_table_forgets_partitions_now_owned_elsewhere(tmp_path):
    """After a rebalance the table answers only for the partitions this worker holds (in memory and on disk): an
    entry of a partition another worker took is not acted on here, and comes back from disk when it returns."""
    from ingest.table import JoinTable, partition_of

    keys_ = [f"gen-{i}" for i in range(200)]
    for state in (None, tmp_path / "ingest"):
        table = JoinTable("p-ingest-join-changelog", 4, state)
        table.hold({0, 1, 2, 3})
        for p, part in table.parts.items():
            part.apply([(k.encode(), b"x") for k in keys_ if partition_of(k.encode(), 4) == p], 7)
        assert len(table) == len(keys_)
        table.hold({1})
        assert set(table) == {k for k in keys_ if partition_of(k.encode(), 4) == 1}
        assert all(table.get(k) is None for k in keys_ if partition_of(k.encode(), 4) != 1)
        table.hold({0, 1})
        back = {k for k in keys_ if partition_of(k.encode(), 4) in (0, 1)}
        assert set(table) == (back if state is not None else {k for k in back if partition_of(k.encode(), 4) == 1})
        table.close()


def test_redis_guard_keys_expire(env):
    cfg, metrics = env

    async def run():
        t = Tally()
        t.live.append(("fid-ttl", 9, "accept"))
        await metrics.apply(t)
        await metrics.close()

    asyncio.run(run())
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        ttl = r.ttl(keys.counted(cfg.topics.prefix, 9, "fid-ttl"))
    finally:
        r.close()
    assert 0 < ttl <= COUNTED_TTL_S == 7 * 24 * 3600


def test_pending_ttl_default_outlasts_a_producers_delivery_timeout():
    from core.config import DELIVERY_MARGIN_S, BrokerConfig

    assert IngestConfig().pending_ttl_s >= BrokerConfig().delivery_timeout_s + DELIVERY_MARGIN_S


def test_a_timer_that_raises_is_counted_and_runs_again(env):
    """A sweep that raises must not end the worker's loop: the sweeps log and count instead (an infrastructure
    failure still stops the worker, see test_restart.py)."""
    from ingest.app import IngestWorker

    cfg, _ = env
    worker = IngestWorker(cfg, "127.0.0.1:9", cfg.redis.url, web_port=0)
    calls = []

    async def sweep():
        calls.append(1)
        raise ValueError("a bug in a sweep")

    async def run():
        await worker._guarded("expire_pending", sweep)
        await worker._guarded("expire_pending", sweep)
        await worker.metrics.close()

    asyncio.run(run())
    assert len(calls) == 2
    assert worker.metrics.timer_errors.labels("expire_pending")._value.get() == 2


def test_input_on_the_wrong_partition_is_dead_lettered_naming_the_right_one(env):
    """A record keyed or partitioned differently from Kafka's murmur2 of its generation id is refused
    (``wrong_partition``) instead of waiting for a generation another worker holds; the right partition joins."""
    import json
    import random

    from ingest.table import partition_of
    from tests.ingest.test_fuzz import _feedback, _generation

    cfg, metrics = env
    n, broker, table = 4, Broker(), {}
    rng = random.Random(3)
    gid = "g-wrong-partition"
    right = partition_of(gid.encode(), n)
    wrong = (right + 1) % n
    rec, fb = json.dumps(_generation(rng, gid)).encode(), json.dumps(_feedback(rng, gid)).encode()

    async def run():
        ing = Ingest(cfg, metrics, table, broker, partitions=n)
        ing.recovered()
        try:
            await ing.process(
                [(Source(cfg.topics.generations, right, 1, gid), rec), (Source(cfg.topics.feedback, wrong, 1, gid), fb)]
            )
            first = list(broker.sent)
            await ing.process([(Source(cfg.topics.feedback, right, 2, gid), fb)])
            return first
        finally:
            await metrics.close()

    first = asyncio.run(run())
    dead = [DeadLetter.from_bytes(v) for t, _, v in first if t == cfg.topics.dead_letters]
    assert [d.reason for d in dead] == ["wrong_partition"]
    assert f"partition {right}" in dead[0].detail and "murmur2" in dead[0].detail
    assert not [t for t, _, _ in first if t == cfg.topics.samples]
    assert len(broker.of(cfg.topics.samples)) == 1


def test_a_fixed_hash_share_of_joined_samples_goes_to_the_held_out_stream(env):
    """The held-out stream the gate estimates on, which the learner never reads. The share is decided by
    the generation id alone, so a replay (or another worker) sends a sample the same way."""
    import json
    import random

    from ingest.join import is_heldout
    from tests.ingest.test_fuzz import _feedback, _generation

    cfg, metrics = env
    cfg = cfg.model_copy(update={"ingest": cfg.ingest.model_copy(update={"heldout_share": 0.25})})
    gids = [f"g-held-{i}" for i in range(400)]
    share = sum(is_heldout(g, 0.25) for g in gids) / len(gids)
    assert 0.18 < share < 0.32 and [is_heldout(g, 0.25) for g in gids] == [is_heldout(g, 0.25) for g in gids]
    assert not any(is_heldout(g, 0.0) for g in gids)
    # the hash is part of the data's history: another one would move generations between the streams across versions
    import hashlib

    def keyed(g: str) -> float:
        return (
            int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8, person=b"liverl-heldout").digest(), "big") / 2**64
        )

    assert [is_heldout(g, 0.25) for g in gids] == [keyed(g) < 0.25 for g in gids]
    rng = random.Random(5)
    broker = Broker()

    async def run():
        ing = Ingest(cfg, metrics, {}, broker)
        ing.recovered()
        try:
            for i, g in enumerate(gids):
                fb = dict(_feedback(rng, g), kind="accept")
                fb.pop("edited_text", None)
                await ing.process(
                    [
                        (Source(cfg.topics.generations, 0, i, g), json.dumps(_generation(rng, g)).encode()),
                        (Source(cfg.topics.feedback, 0, i, g), json.dumps(fb).encode()),
                    ]
                )
        finally:
            await metrics.close()

    asyncio.run(run())
    held = {k for k, _ in broker.of(cfg.topics.heldout)}
    trained = {k for k, _ in broker.of(cfg.topics.samples)}
    assert held == {g for g in gids if is_heldout(g, 0.25)} and trained == set(gids) - held
    counters = redis.Redis.from_url(cfg.redis.url, decode_responses=True).hgetall(
        f"{cfg.topics.prefix}:ingest:counters"
    )
    assert int(counters["heldout_out"]) == len(held) and int(counters["samples_out"]) == len(trained)


def test_murmur2_is_kafkas():
    """The join's partitioner must agree with the producers' (aiokafka, kafka-python: Kafka's murmur2) on every key,
    or a generation and its feedback would be judged on different partitions."""
    import random

    from aiokafka.partitioner import murmur2 as aiokafka_murmur2
    from kafka.partitioner.default import murmur2 as kafka_murmur2

    from ingest.table import murmur2, murmur2_many

    rng = random.Random(5)
    keys_ = [b"", b"a", b"ab", b"abc", "généré-ü".encode()] + [
        rng.randbytes(rng.randrange(0, 200)) for _ in range(5000)
    ]
    for k in keys_:
        assert murmur2(k) == aiokafka_murmur2(k) == kafka_murmur2(k) & 0xFFFFFFFF, k
    assert murmur2_many(keys_) == [murmur2(k) for k in keys_]  # the batch path (numpy, keys grouped by length)
    same_length = [rng.randbytes(37) for _ in range(1000)] + [k[:3] for k in keys_ if len(k) >= 3]
    assert murmur2_many(same_length) == [aiokafka_murmur2(k) for k in same_length]
    assert murmur2_many([]) == []


def test_the_partitioners_hash_cache_is_bounded():
    from ingest import partitioner as table

    def bounded() -> bool:
        return len(table._HASHES) <= table._HASHES_MAX and len(table._HASHES_OLD) <= table._HASHES_MAX

    table._HASHES.clear()
    table._HASHES_OLD.clear()
    for i in range(2 * table._HASHES_MAX + 1000):
        table.partition_of(f"gen-{i}".encode(), 4)
        assert bounded()
    assert table._cached_hash(b"gen-1") is None  # two generations ago: dropped
    assert table._cached_hash(f"gen-{table._HASHES_MAX + 10}".encode()) is not None  # the previous one still hits
    assert table.partition_of(b"gen-1", 4) == (table.murmur2(b"gen-1") & 0x7FFFFFFF) % 4
    for start in (0, table._HASHES_MAX // 2, table._HASHES_MAX):  # a batch's keys hashed at once: the same bound
        table.warm_hashes([f"batch-{i}".encode() for i in range(start, start + table._HASHES_MAX // 2 + 1000)])
        assert bounded()
    assert table.partition_of(b"batch-70000", 4) == (table.murmur2(b"batch-70000") & 0x7FFFFFFF) % 4
    # many keys at once (the changelog's writes): cached in either generation or not at all, the same partitions
    keys_ = [f"gen-{i}".encode() for i in range(0, 3 * table._HASHES_MAX, 97)] + [b"", b"x" * 300]
    assert table.partitions_of(keys_, 7) == [(table.murmur2(k) & 0x7FFFFFFF) % 7 for k in keys_]
    assert bounded()


def test_table_writes_stay_readable_while_the_changelog_has_them_in_flight(stack, tmp_path):
    """The worker decides the next batch while the previous batch's table writes are on their way to the changelog
    (real broker): a read in that window must see them. A miss there made feedback wait as if its generation were
    unknown, and expire as ``unknown_generation``."""
    from aiokafka import AIOKafkaProducer

    from core.bus import ensure_topics
    from ingest.table import JoinTable, Outbox, changelog_topic

    topic = changelog_topic(f"t{uuid.uuid4().hex[:10]}")
    ensure_topics(stack.bootstrap, [topic], 2)
    keys_ = [f"gen-{i}" for i in range(50)]
    entry = pack(WAITING, NOW)

    async def run():
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        table = JoinTable(topic, 2, tmp_path / "ingest")
        try:
            table.hold({0, 1})
            for k in keys_:
                table[k] = entry
            flushing = asyncio.ensure_future(table.flush(Outbox(producer)))
            await asyncio.sleep(0)  # the flush has handed the changes to the producer and waits for the broker
            assert not flushing.done()
            assert all(table.get(k) == entry for k in keys_)
            assert set(table) == set(keys_)
            assert await flushing == len(keys_)
            assert all(table.get(k) == entry for k in keys_) and not table.dirty
            assert sum(1 for p in table.parts.values() for _ in p.keys()) == len(keys_)  # in the databases now
        finally:
            await producer.stop()
            table.close()

    asyncio.run(run())


def test_a_wrong_typed_counter_key_is_replaced_and_the_batch_still_counts(env):
    """A string where ingest keeps a hash (``live:{v}``, ``ingest:counters``, a per-user sums bucket) makes Redis
    answer WRONGTYPE; the worker must not stop on it (it would replay the batch into the same error for ever): the key
    is replaced, counted and logged, and the batch counts once."""
    cfg, metrics = env
    p = cfg.topics.prefix
    r = redis.Redis.from_url(cfg.redis.url)
    bucket = keys.unit_bucket(1_700_000_000.0)
    for k in (keys.live(p, 12), keys.ingest_counters(p), keys.units(p, 12, bucket)):
        r.set(k, "x")

    async def run():
        try:
            t = Tally()
            t.live += [("fid-a", 12, "accept", bucket, "u1"), ("fid-b", 12, "reject", bucket, "u2")]
            t.inc("joined", 2)
            await metrics.apply(t)
        finally:
            await metrics.close()

    try:
        asyncio.run(run())
        live = {k.decode(): int(v) for k, v in r.hgetall(keys.live(p, 12)).items()}
        counters = {k.decode(): int(v) for k, v in r.hgetall(keys.ingest_counters(p)).items()}
        units = keys.read_unit_buckets(r, p, 12, [bucket])[bucket]
    finally:
        r.close()
    assert live == {"accept": 1, "reject": 1, "events": 2}
    assert counters == {"joined": 2}
    assert units["u1"]["a"] == 1 and units["*"]["e"] == 2
    assert metrics.wrong_type._value.get() == 3


def test_a_generation_over_max_event_bytes_is_logged_untrainable_and_its_feedback_counted(env):
    """A completion of 20,000 tokens makes a record of about 600 KB, over ``ingest.max_event_bytes`` (512 KiB). The
    gateway logs it without its text, token ids and log-probs (untrainable ``too_large``, its length kept); ingest
    joins its feedback, counts the judgement for its version at its true length, and counts the sample it cannot make
    (``drop:too_large``) instead of letting the feedback expire as ``unknown_generation``."""
    import json

    from core.schemas import GenerationRecord
    from serving.node import openai_api as oa
    from serving.node.gateway_metrics import GatewayMetrics
    from serving.node.generation_log import GenerationLog

    cfg, metrics = env
    sent: list[tuple[str, str, bytes]] = []

    class Producer:
        def produce(self, topic, key, value):
            sent.append((topic, key, value))
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

    n = 20_000
    choice = oa.Choice(
        prompt="p" * 200,
        prompt_token_ids=list(range(50)),
        text=["w "] * n,
        token_ids=[1_000_000 + i for i in range(n)],
        logprobs=[-1.2345678901234567] * n,
        finish_reason="length",
    )
    gid = "g-long-answer"
    gw = GatewayMetrics()
    req = oa.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    p = cfg.topics.prefix
    fb = json.dumps(
        {"schema_version": 1, "feedback_id": "f-long", "generation_id": gid, "kind": "accept", "ts": NOW}
    ).encode()

    async def run():
        log = GenerationLog(Producer(), cfg.topics.generations, "node-a", 32_768, gw, 0.0, max_bytes=512 * 1024)
        full = GenerationRecord(
            generation_id=gid,
            policy_version=3,
            node="node-a",
            prompt=choice.prompt,
            completion="".join(choice.text),
            prompt_token_ids=choice.prompt_token_ids,
            completion_token_ids=choice.token_ids,
            completion_logprobs=choice.logprobs,
            sampling=req.sampling(32_768),
        )
        assert len(full.to_bytes()) > cfg.ingest.max_event_bytes  # what would have been logged
        assert log.log(req, choice, gid, version=3, unit="u1") is not None
        broker = Broker()
        ing = Ingest(cfg, metrics, {}, broker)
        ing.recovered()
        try:
            ((_, _, value),) = sent
            await ing.process([(Source(cfg.topics.generations, 0, 1, gid), value)], now=NOW)
            await ing.process([(Source(cfg.topics.feedback, 0, 1, gid), fb)], now=NOW + 1)
        finally:
            await metrics.close()
        return value, broker

    value, broker = asyncio.run(run())
    rec = GenerationRecord.from_bytes(value)
    assert len(value) <= cfg.ingest.max_event_bytes
    assert (rec.trainable, rec.untrainable_reason, rec.completion_tokens) == (False, "too_large", n)
    assert next(s.value for s in gw.m_untrainable.collect()[0].samples if s.labels.get("reason") == "too_large") == 1
    assert not broker.of(cfg.topics.dead_letters) and not broker.of(cfg.topics.samples)
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        live = {k.decode(): int(v) for k, v in r.hgetall(keys.live(p, 3)).items()}
        counters = {k.decode(): int(v) for k, v in r.hgetall(keys.ingest_counters(p)).items()}
    finally:
        r.close()
    assert live["accept"] == 1 and live["events"] == 1 and live["tokens"] == n
    assert counters.get("drop:too_large") == 1 and "dlq:unknown_generation" not in counters
