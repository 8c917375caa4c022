"""Hostile input, fuzzed: the ingest parse/join path never crashes, and every refusal is dead-lettered with its reason.

Hypothesis drives ``ingest.join.Ingest`` (the decisions the ingest worker makes per event) with feedback,
generation and sample records: sizes at and past the limits, deep nesting, huge integers, NaN and infinities,
byte order marks and other encodings, unknown fields and wrong types. The join state is a dict and the broker a
list here, because thousands of examples through a real broker would take hours; Redis is the real one. The same
inputs go through the real worker process in ``test_hostile_inputs_through_the_worker`` (test_app.py).

Examples per test: ``LIVERL_FUZZ_EXAMPLES`` (default 60 in CI); the long run is
``LIVERL_FUZZ_EXAMPLES=5000 pytest tests/ingest/test_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import keys
from core.config import load_config
from core.schemas import DeadLetter, FeedbackEvent, GenerationRecord, TrainingSample, WireError
from ingest.join import DEAD_VALUE_BYTES, MAX_RECORD_BYTES, InfraError, Ingest, Source
from ingest.metrics import IngestMetrics
from tests.ingest.conftest import make_generation

EXAMPLES = int(os.environ.get("LIVERL_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
MAX_EVENT = 512 * 1024


class Broker:
    """Records what ingest produces; every send is acknowledged at once (or fails, when told to)."""

    def __init__(self):
        self.sent: list[tuple[str, str, bytes]] = []
        self.fail = False

    def send(self, topic: str, key: str, value: bytes):
        if self.fail:
            raise ConnectionError("broker down")
        assert len(value) <= MAX_RECORD_BYTES, (topic, len(value))
        self.sent.append((topic, key, value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def flush(self):
        """(every send is acknowledged at once: nothing to flush)"""
        fut = asyncio.get_running_loop().create_future()
        fut.set_result({})
        return fut

    def of(self, topic: str) -> list[tuple[str, bytes]]:
        return [(k, v) for t, k, v in self.sent if t == topic]


@pytest.fixture
def world(stack, tmp_path):
    cfg = load_config(
        env={},
        state_dir=str(tmp_path),
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
        ingest__max_event_bytes=MAX_EVENT,
        ingest__heldout_share=0.0,
        ingest__pending_ttl_s=150.0,
    )
    metrics = IngestMetrics(cfg.topics.prefix, stack.redis_url)
    loop = asyncio.new_event_loop()
    yield cfg, metrics, loop
    loop.run_until_complete(metrics.close())
    loop.close()
    r = redis.Redis.from_url(stack.redis_url)
    keys = list(r.scan_iter(f"{cfg.topics.prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i : i + 500])
    r.close()


def _ingest(world, table=None) -> tuple[Ingest, Broker]:
    cfg, metrics, _ = world
    broker = Broker()
    return Ingest(cfg, metrics, {} if table is None else table, broker), broker


# -- hostile values ------------------------------------------------------------------------------


def _feedback(rng: random.Random, gid: str | None = None) -> dict:
    kind = rng.choice(["accept", "reject", "edit"])
    d = {
        "schema_version": 1,
        "feedback_id": f"f{rng.getrandbits(48):x}",
        "generation_id": gid or f"g{rng.getrandbits(48):x}",
        "kind": kind,
        "segment": rng.choice([None, "a", "b"]),
        "ts": 1.79e9 + rng.random(),
    }
    if kind == "edit":
        d["edited_text"] = "fixed"
    return d


def _generation(rng: random.Random, gid: str | None = None) -> dict:
    return json.loads(make_generation(gid or f"g{rng.getrandbits(48):x}", rng.randrange(100), rng=rng).to_bytes())


def _sample(rng: random.Random) -> dict:
    g = _generation(rng)
    return {
        "schema_version": 1,
        "sample_id": g["generation_id"],
        "generation_id": g["generation_id"],
        "feedback_id": "f1",
        "policy_version": g["policy_version"],
        "kind": "accept",
        "reward": 0.75,
        "prompt_token_ids": g["prompt_token_ids"],
        "completion_token_ids": g["completion_token_ids"],
        "behaviour_logprobs": g["completion_logprobs"],
        "sampling": g["sampling"],
        "ts_generation": g["ts"],
        "ts_feedback": g["ts"] + 1,
    }


WRONG = [
    None,
    True,
    0,
    -1,
    1.5,
    "x",
    "",
    [],
    {},
    [1, "a"],
    {"a": 1},
    10**30,
    -(10**30),
    "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
]
NONFINITE = [float("nan"), float("inf"), float("-inf")]


def _mutate(doc: dict, how: str, rng: random.Random) -> bytes:
    """A hostile variant of a valid record (some variants happen to stay valid: padding, unicode)."""
    d = dict(doc)
    field = rng.choice(sorted(d))
    if how == "unknown_field":
        d[rng.choice(["extra", "__proto__", "x" * 300, "é"])] = rng.choice(WRONG)
    elif how == "wrong_type":
        d[field] = rng.choice(WRONG)
    elif how == "missing_field":
        d.pop(field)
    elif how == "nonfinite":
        for f in ("ts", "ts_feedback", "ts_generation", "reward"):
            if f in d:
                d[f] = rng.choice(NONFINITE)
        for f in ("completion_logprobs", "behaviour_logprobs"):
            if d.get(f):
                d[f] = [rng.choice(NONFINITE)] + d[f][1:]
        if "sampling" in d:
            d["sampling"] = dict(d["sampling"], temperature=rng.choice(NONFINITE))
    elif how == "huge_int":
        digits = rng.choice([20, 400, 4300, 4301, 20_000])
        text = json.dumps(d)
        target = rng.choice(["ts", "policy_version", "schema_version", field])
        if f'"{target}": ' in text:
            head, _, tail = text.partition(f'"{target}": ')
            rest = tail.split(",", 1)[1] if "," in tail else "}"
            return f'{head}"{target}": {"9" * digits}, {rest}'.encode()
        return text.replace("{", '{"n": ' + "9" * digits + ", ", 1).encode()
    elif how == "schema_version":
        d["schema_version"] = rng.choice([True, 1.0, "1", 2, 0, None, [1], 10**40])
    elif how == "time_range":
        for f in ("ts", "ts_feedback", "ts_generation"):
            if f in d:
                d[f] = rng.choice([-1.0, 0.0, 1e300, 5e9, 1e12])
    elif how == "deep":
        depth = rng.choice([100, 5_000, 100_000])
        d[field] = "@@DEEP@@"
        return json.dumps(d).replace('"@@DEEP@@"', "[" * depth + "]" * depth).encode()
    elif how == "deep_object":
        depth = rng.choice([1_000, 50_000])
        return ('{"a":' * depth + "1" + "}" * depth).encode()
    raw = json.dumps(d, allow_nan=True).encode()
    if how == "bom":
        return b"\xef\xbb\xbf" + raw
    if how == "utf16":
        return json.dumps(d).encode(rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32"]))
    if how == "latin1":
        return json.dumps(dict(d, segment="café"), ensure_ascii=False).encode("latin-1")
    if how == "pad":
        size = rng.choice([MAX_EVENT - 1, MAX_EVENT, MAX_EVENT + 1, 1_000_000, 1_048_576, 1_048_577])
        return raw[:-1] + b" " * max(0, size - len(raw)) + b"}"
    if how == "pad_string":  # a valid record whose one string is at the limit
        return json.dumps(
            dict(d, segment="s" * 64, **({"edited_text": "\x01" * 65536} if d.get("kind") == "edit" else {}))
        ).encode()
    if how == "bytes":
        return rng.randbytes(rng.choice([0, 1, 7, 300, 5000]))
    if how == "not_object":
        return json.dumps(rng.choice([[d], "x", 1, None, True])).encode()
    return raw


# Variants that can never be valid, whatever the random choices.
MUST_REFUSE = {
    "unknown_field",
    "nonfinite",
    "huge_int",
    "schema_version",
    "time_range",
    "deep",
    "deep_object",
    "bom",
    "utf16",
    "latin1",
    "bytes",
    "not_object",
}
HOW = [
    "unknown_field",
    "wrong_type",
    "missing_field",
    "nonfinite",
    "huge_int",
    "schema_version",
    "time_range",
    "deep",
    "deep_object",
    "bom",
    "utf16",
    "latin1",
    "pad",
    "pad_string",
    "bytes",
    "not_object",
    "valid",
]


def _check_outcome(ingest_cfg, kind: str, value: bytes, letters: list[DeadLetter], table: dict) -> None:
    """The one outcome a single input may have: dead-lettered with the parser's reason, or taken in."""
    model = FeedbackEvent if kind == "feedback" else GenerationRecord
    if len(value) > ingest_cfg.max_event_bytes:
        expected = "too_large"
    else:
        try:
            model.from_bytes(value)
            expected = None
        except WireError as e:
            expected = e.reason
    assert all(d.reason != "internal_error" for d in letters), [d.detail for d in letters]
    for d in letters:
        assert len(d.to_bytes()) < DEAD_VALUE_BYTES * 6 + 4096
        assert d.value_size == len(value) and d.detail
        assert d.value_truncated == (len(value) > DEAD_VALUE_BYTES)
    if expected is None:
        assert not letters, [(d.reason, d.detail) for d in letters]
        assert len(table) == 1
    else:
        assert [d.reason for d in letters] == [expected]


@FUZZ
@given(kind=st.sampled_from(["feedback", "generation"]), how=st.sampled_from(HOW), seed=st.integers(0, 2**32))
def test_one_hostile_record_is_taken_in_or_dead_lettered_with_its_reason(world, kind, how, seed):
    cfg, _, loop = world
    rng = random.Random(seed)
    value = _mutate(_feedback(rng) if kind == "feedback" else _generation(rng), how, rng)
    ing, broker = _ingest(world)
    topic = cfg.topics.feedback if kind == "feedback" else cfg.topics.generations
    loop.run_until_complete(ing.process([(Source(topic, 0, 7, "k"), value)]))
    letters = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    _check_outcome(cfg.ingest, kind, value, letters, ing.table)
    if how in MUST_REFUSE or len(value) > MAX_EVENT:
        assert len(letters) == 1 and not ing.table, (how, value[:200])
    for entry in ing.table.values():
        assert len(entry) <= MAX_RECORD_BYTES


@FUZZ
@given(how=st.sampled_from(HOW), seed=st.integers(0, 2**32))
def test_sample_records_parse_or_refuse_with_a_reason(how, seed):
    """What the learner reads: ``TrainingSample.from_bytes`` raises WireError and nothing else."""
    rng = random.Random(seed)
    value = _mutate(_sample(rng), how, rng)
    try:
        TrainingSample.from_bytes(value)
    except WireError as e:
        assert e.reason and len(e.detail) < 2000


@FUZZ
@given(seed=st.integers(0, 2**32), n=st.integers(1, 40), junk=st.floats(0.0, 0.5), batch=st.integers(1, 50))
def test_any_interleaving_ends_each_feedback_in_one_sample_or_one_dead_letter(world, seed, n, junk, batch):
    """Generations and feedback in any order, redelivered, mixed with junk, in batches of any size: afterwards each
    feedback_id is in exactly one sample or one dead letter, and each sample_id is sampled once."""
    cfg, _, loop = world
    rng = random.Random(seed)
    ing, broker = _ingest(world)
    events: list[tuple[str, bytes]] = []
    fids: dict[str, str] = {}
    unknown: set[str] = set()
    for _ in range(n):
        g = _generation(rng)
        fb = _feedback(rng, g["generation_id"])
        fids[fb["feedback_id"]] = g["generation_id"]
        r = rng.random()
        if r < 0.1:
            unknown.add(fb["feedback_id"])
            events.append(("feedback", json.dumps(fb).encode()))
        else:
            events += [("generation", json.dumps(g).encode()), ("feedback", json.dumps(fb).encode())]
            if r < 0.3:  # a second, different judgement of the same generation
                other = _feedback(rng, g["generation_id"])
                events.append(("feedback", json.dumps(other).encode()))
        if rng.random() < junk:
            events.append((rng.choice(["feedback", "generation"]), _mutate(_feedback(rng), rng.choice(HOW[:-1]), rng)))
    rng.shuffle(events)
    events += rng.sample(events, k=len(events) // 4)  # redeliveries
    topic = {"feedback": cfg.topics.feedback, "generation": cfg.topics.generations}
    src = [(Source(topic[k], 0, i, "k"), v) for i, (k, v) in enumerate(events)]
    for i in range(0, len(src), batch):
        loop.run_until_complete(ing.process(src[i : i + batch], now=1.8e9))
    ing.index.resumed = 0.0
    loop.run_until_complete(ing.expire_pending(now=1.8e9 + 10 * cfg.ingest.pending_ttl_s + 600))

    samples = [TrainingSample.from_bytes(v) for _, v in broker.of(cfg.topics.samples)]
    letters = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    assert not [d for d in letters if d.reason == "internal_error"]
    by_gid: dict[str, str] = {}
    for s in samples:
        assert by_gid.setdefault(s.generation_id, s.feedback_id) == s.feedback_id  # one judgement per generation
    sampled = set(by_gid.values())
    refused = {
        FeedbackEvent.model_validate_json(d.value).feedback_id
        for d in letters
        if d.reason in ("unknown_generation", "already_judged") and d.value.startswith("{") and _parses(d.value)
    }
    ours = set(fids)
    assert ours <= sampled | refused, "feedback lost"
    assert not (sampled & ours & {f for f in refused if f in unknown}), "trained and dead-lettered"
    assert unknown.isdisjoint(sampled)
    assert len(samples) == len(by_gid)  # no sample sent twice without a crash
    assert all(entry[:1] != b"P" for entry in ing.table.values())  # nothing left waiting past the TTLs


def _parses(text: str) -> bool:
    try:
        FeedbackEvent.model_validate_json(text)
        return True
    except ValueError:
        return False


def test_not_trainable_records_are_judged_and_counted_but_make_no_sample(world):
    cfg, _, loop = world
    ing, broker = _ingest(world)
    rec = make_generation("g-greedy", 3).model_copy(update={"trainable": False, "untrainable_reason": "greedy"})
    fb = FeedbackEvent(feedback_id="f-greedy", generation_id="g-greedy", kind="accept")
    trainable = make_generation("g-ok", 3)
    fb2 = FeedbackEvent(feedback_id="f-ok", generation_id="g-ok", kind="reject")
    loop.run_until_complete(
        ing.process(
            [
                (Source(cfg.topics.generations, 0, 1, "g"), rec.to_bytes()),
                (Source(cfg.topics.generations, 0, 2, "g"), trainable.to_bytes()),
                (Source(cfg.topics.feedback, 0, 1, "g"), fb.to_bytes()),
                (Source(cfg.topics.feedback, 0, 2, "g"), fb2.to_bytes()),
            ]
        )
    )
    samples = [TrainingSample.from_bytes(v) for _, v in broker.of(cfg.topics.samples)]
    assert [s.generation_id for s in samples] == ["g-ok"]
    assert samples[0].sampling == trainable.sampling
    assert not broker.of(cfg.topics.dead_letters)
    r = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
    try:
        counters = r.hgetall(f"{cfg.topics.prefix}:ingest:counters")
        live = r.hgetall(keys.live(cfg.topics.prefix, 3))
    finally:
        r.close()
    assert counters["drop:not_trainable"] == "1" and counters["joined"] == "2" and counters["samples_out"] == "1"
    assert keys.live_totals(live) == {"accept": "1", "reject": "1", "events": "2"}  # still counts in live acceptance
    # A redelivery is a duplicate, not a second join.
    loop.run_until_complete(ing.process([(Source(cfg.topics.feedback, 0, 1, "g"), fb.to_bytes())]))
    assert len(broker.of(cfg.topics.samples)) == 1


def test_an_exception_inside_one_event_dead_letters_that_event_only(world, monkeypatch):
    cfg, _, loop = world
    ing, broker = _ingest(world)
    gens = [make_generation(f"g{i}", 1) for i in range(5)]
    fbs = [FeedbackEvent(feedback_id=f"f{i}", generation_id=f"g{i}", kind="accept") for i in range(5)]
    real = ing.decider._join

    def flaky(gid, rec, body, fb, out, now, src):
        if gid == "g2":
            raise RuntimeError("a bug")
        return real(gid, rec, body, fb, out, now, src)

    monkeypatch.setattr(ing.decider, "_join", flaky)
    batch = [(Source(cfg.topics.generations, 0, i, f"g{i}"), g.to_bytes()) for i, g in enumerate(gens)]
    batch += [(Source(cfg.topics.feedback, 0, i, f"g{i}"), f.to_bytes()) for i, f in enumerate(fbs)]
    loop.run_until_complete(ing.process(batch))
    assert sorted(k for k, _ in broker.of(cfg.topics.samples)) == ["g0", "g1", "g3", "g4"]
    (letter,) = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    assert (letter.reason, letter.offset, letter.key) == ("internal_error", 2, "g2")
    assert "RuntimeError: a bug" in letter.detail
    assert ing.table["g2"][:1] == b"W"  # still waiting: a redelivery (after a fix) can join it


def test_a_broker_failure_raises_before_any_table_write(world):
    """Infrastructure failures are not swallowed: the batch raises InfraError (the worker then exits without
    acknowledging it) and the table is untouched, so the replay after the restart starts from the same state."""
    cfg, _, loop = world
    ing, broker = _ingest(world)
    rec = make_generation("g-x", 1)
    loop.run_until_complete(ing.process([(Source(cfg.topics.generations, 0, 1, "g"), rec.to_bytes())]))
    before = dict(ing.table)
    broker.fail = True
    fb = FeedbackEvent(feedback_id="f-x", generation_id="g-x", kind="accept")
    with pytest.raises(InfraError):
        loop.run_until_complete(ing.process([(Source(cfg.topics.feedback, 0, 1, "g"), fb.to_bytes())]))
    assert ing.table == before
    broker.fail = False
    loop.run_until_complete(ing.process([(Source(cfg.topics.feedback, 0, 1, "g"), fb.to_bytes())]))
    assert [k for k, _ in broker.of(cfg.topics.samples)] == ["g-x"]


def test_a_redis_failure_raises(stack, tmp_path):
    from tests.conftest import free_port

    cfg = load_config(env={}, state_dir=str(tmp_path), topics__prefix=f"t{uuid.uuid4().hex[:10]}")
    metrics = IngestMetrics(cfg.topics.prefix, f"redis://127.0.0.1:{free_port()}/0")
    broker = Broker()
    ing = Ingest(cfg, metrics, {}, broker)

    async def run():
        try:
            metrics_apply = metrics.apply

            async def quick(tally, retry_s=0.5):
                return await metrics_apply(tally, retry_s=retry_s)

            metrics.apply = quick
            await ing.process([(Source(cfg.topics.generations, 0, 1, "g"), make_generation("g-r", 1).to_bytes())])
        finally:
            await metrics.close()

    with pytest.raises(InfraError, match="Redis"):
        asyncio.run(run())


@FUZZ
@given(
    seed=st.integers(0, 2**32 - 1),
    reward=st.floats(allow_nan=False, allow_infinity=False, width=64),
    text=st.one_of(st.none(), st.text(max_size=40)),
    segment=st.one_of(st.none(), st.text(max_size=20)),
)
def test_the_joins_sample_json_is_the_models_own(seed, reward, text, segment):
    """The join builds a sample's JSON from the validated record without validating it again (``sample_json``): it
    must be byte for byte ``TrainingSample(...).model_dump_json()``, whatever the floats, text and optional fields; a
    non-finite reward from the product is refused, as the model refuses it."""
    from core.schemas import SamplingParams
    from ingest.join import WAITING, pack, record_parts, sample_json, unpack

    rng = random.Random(seed)
    g = _generation(rng)
    g["sampling"] = SamplingParams(
        temperature=rng.choice([0.7, 1.0, 1e-7]),
        top_p=rng.random(),
        top_k=rng.randrange(-1, 50),
        seed=rng.choice([None, rng.getrandbits(40)]),
        max_tokens=rng.randrange(1, 4096),
    ).model_dump()
    g["completion_logprobs"] = [
        rng.choice([-rng.random() * 30, -0.0, -1e-300, -5e-324]) for _ in g["completion_token_ids"]
    ]
    g["latency_s"] = rng.choice([None, rng.random() * 10])
    rec = GenerationRecord.model_validate(g)
    fb = FeedbackEvent(
        feedback_id=f"f{seed}",
        generation_id=rec.generation_id,
        kind="edit" if text is not None else "accept",
        edited_text=text,
        segment=segment,
        ts=1.79e9 + rng.random(),
    )
    joined = rng.uniform(1.7e9, 1.9e9)  # ingest's clock at the join
    want = (
        TrainingSample(
            sample_id=rec.generation_id,
            generation_id=rec.generation_id,
            feedback_id=fb.feedback_id,
            policy_version=rec.policy_version,
            kind=fb.kind,
            reward=reward,
            segment=fb.segment,
            prompt_token_ids=rec.prompt_token_ids,
            completion_token_ids=rec.completion_token_ids,
            behaviour_logprobs=rec.completion_logprobs,
            sampling=rec.sampling,
            edited_text=fb.edited_text,
            ts_generation=rec.ts,
            ts_feedback=fb.ts,
            ts_joined=joined,
        )
        .model_dump_json()
        .encode()
    )
    gid = rec.generation_id
    _, _, meta, body = unpack(pack(WAITING, 1.79e9, *record_parts(rec)))
    assert sample_json(gid, meta, body, fb, reward, joined) == want  # the waiting entry's path (through the table)
    assert sample_json(gid, *record_parts(rec), fb, reward, joined) == want  # the pending feedback's path
    for bad in NONFINITE:
        with pytest.raises(ValueError, match="finite"):
            sample_json(gid, *record_parts(rec), fb, bad, joined)


@FUZZ
@given(
    values=st.lists(
        st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 0.01, 0.05, 60.0, 300.0, 301.0, 1e308])), max_size=200
    )
)
def test_a_batch_of_observations_is_what_one_by_one_gives(values):
    """The worker observes a batch's feedback delays at once (``observe_many``: one increment per bucket); the
    exposition must be the one ``Histogram.observe`` per value gives, non-finite values left out, negatives as 0."""
    import math

    from prometheus_client import CollectorRegistry, Histogram

    from ingest.metrics import observe_many

    buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("d", "d", buckets=buckets, registry=one)
    h2 = Histogram("d", "d", buckets=buckets, registry=many)
    for v in values:
        if math.isfinite(v):
            h1.observe(max(v, 0.0))
    observe_many(h2, values)
    assert _sums_agree(one, many)


def _sums_agree(one, many) -> bool:
    """Same buckets and counts; the sum equal up to float rounding (one addition per batch, not per value)."""
    a = {s.name + repr(sorted(s.labels.items())): s.value for m in one.collect() for s in m.samples}
    b = {s.name + repr(sorted(s.labels.items())): s.value for m in many.collect() for s in m.samples}
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if "_sum" in k:
            if v != b[k] and not abs(v - b[k]) <= 1e-9 * max(1.0, abs(v)):
                return False
        elif "_created" not in k and v != b[k]:
            return False
    return True


_KIND = st.tuples(
    st.sampled_from(["accept", "reject", "edit", "revert"]),
    st.integers(0, 5),
    st.lists(
        st.tuples(
            st.sampled_from(["tokens", "tokens_sq", "timed", "latency_ms", "latency_ms_sq"]),
            st.one_of(st.integers(0, 1000), st.integers(0, 10**17)),
        ),
        max_size=5,
    ),
)


@FUZZ
@given(
    batches=st.lists(st.lists(st.tuples(st.integers(0, 12), _KIND), min_size=1, max_size=12), min_size=1, max_size=4)
)
def test_the_live_script_sums_what_one_write_per_event_gives(stack, batches):
    """The live counters' script adds up a batch's increments and writes each field once: whatever the batches,
    redeliveries, revert buckets and guardrail values (up to 18 digits, sums past 2^53, where Lua's doubles stop
    being exact), the hash must equal one HINCRBY per field per newly counted event, as the script wrote before."""
    from ingest.metrics import _LIVE_LUA, _script_call

    prefix = f"t{uuid.uuid4().hex[:10]}"
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    want: dict[str, int] = {}
    seen: set[int] = set()
    touched: set[str] = set()
    try:
        live = keys.live(prefix, 1)
        for batch in batches:
            entries = []
            for fid, (base, bucket, fields) in batch:
                kind = f"{base}@{bucket}" if base == "revert" and bucket else base
                entries.append((f"fb-{fid}", 1, kind + "".join(f";{f}={v}" for f, v in fields)))
                if fid in seen:
                    continue
                seen.add(fid)
                for f, v in fields:
                    want[f] = want.get(f, 0) + v
                want[base] = want.get(base, 0) + 1  # a revert's bucket goes to the per-user sums, not this hash
                if base != "revert":
                    want["events"] = want.get("events", 0) + 1
            ks, args = _script_call(prefix, 1, entries, 60)  # (no bucket: the live hash only; test_units.py: the rest)
            touched.update(ks)
            r.eval(_LIVE_LUA, len(ks), *ks, *args)
        assert {f: int(v) for f, v in r.hgetall(live).items()} == want
    finally:
        if touched:  # the keys the script wrote (a SCAN of a shared Redis's whole keyspace costs minutes in CI)
            r.delete(*touched)
        r.close()
