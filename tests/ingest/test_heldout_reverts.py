"""A revert of a held-out accepted generation reaches the held-out stream: the gate's off-policy
check scores that generation with the product's revert reward, as the learner trains the correction of a trained one.
With ``ingest.train_reverts`` off (the demo's learner that chases raw acceptance) the learner gets no correction, and
the gate's evidence is the same: the held-out revert records and the live counters.

The join runs in process (``Ingest`` with the join table as a dict and the broker's sends recorded, as in
test_bounds.py); Redis is the real one.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import pytest
import redis

from core import keys
from core.config import load_config
from core.product import Product
from core.schemas import TrainingSample
from deploy.gate.offpolicy import merge_heldout
from deploy.gate.tail import parse_heldout
from ingest.join import REVERT_SUFFIX, Ingest, Source, is_heldout
from ingest.metrics import IngestMetrics
from tests.ingest.test_fuzz import Broker, _generation


@pytest.fixture(params=[True, False], ids=["reverts-trained", "reverts-not-trained"])
def env(stack, tmp_path, request):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cfg = load_config(
        env={},
        state_dir=str(tmp_path),
        redis__url=stack.redis_url,
        topics__prefix=prefix,
        ingest__heldout_share=0.5,
        ingest__pending_ttl_s=150.0,
        ingest__train_reverts=request.param,
    )
    metrics = IngestMetrics(prefix, stack.redis_url)
    yield cfg, metrics
    r = redis.Redis.from_url(stack.redis_url)
    for k in r.scan_iter(f"{prefix}:*", count=1000):
        r.delete(k)
    r.close()


def _fb(gid: str, kind: str, ts: float) -> bytes:
    return json.dumps(
        {
            "schema_version": 1,
            "feedback_id": f"f-{kind}-{gid}",
            "generation_id": gid,
            "kind": kind,
            "segment": None,
            "ts": ts,
        }
    ).encode()


def test_a_revert_of_a_held_out_accept_goes_to_the_held_out_stream_with_the_products_revert_reward(env):
    """Both ways of ``ingest.train_reverts``: the held-out stream, what the gate reads of it and the live counters are
    the same; only the learner's topic differs (a correction per trained accept, or none)."""
    cfg, metrics = env
    rng = random.Random(3)
    gids = [f"g-rv-{i}" for i in range(40)]
    held = [g for g in gids if is_heldout(g, cfg.ingest.heldout_share)]
    trained = [g for g in gids if g not in held]
    assert held and trained
    broker = Broker()
    t0 = 1.8e9

    async def run():
        ing = Ingest(cfg, metrics, {}, broker)
        ing.recovered()
        try:
            for i, g in enumerate(gids):
                await ing.process(
                    [
                        (Source(cfg.topics.generations, 0, i, g), json.dumps(_generation(rng, g)).encode()),
                        (Source(cfg.topics.feedback, 0, 2 * i, g), _fb(g, "accept", t0 + i)),
                    ]
                )
            for i, g in enumerate(gids):  # every accept later undone
                await ing.process([(Source(cfg.topics.feedback, 0, 2 * i + 1, g), _fb(g, "revert", t0 + 600 + i))])
        finally:
            await metrics.close()

    asyncio.run(run())
    revert_reward = Product(cfg.ingest.rewards).reward("revert", None)
    on_heldout = [TrainingSample.from_bytes(v) for _, v in broker.of(cfg.topics.heldout)]
    on_samples = [TrainingSample.from_bytes(v) for _, v in broker.of(cfg.topics.samples)]
    # held out: the accept and its revert record, never on the learner's topic; trained: the accept and its correction
    # (none when the learner chases raw acceptance: a reverted accept pays it as much as a kept one)
    assert sorted((s.sample_id, s.kind) for s in on_heldout) == sorted(
        [(g, "accept") for g in held] + [(g + REVERT_SUFFIX, "revert") for g in held]
    )
    corrections = [(g + REVERT_SUFFIX, "revert") for g in trained] if cfg.ingest.train_reverts else []
    assert sorted((s.sample_id, s.kind) for s in on_samples) == sorted([(g, "accept") for g in trained] + corrections)
    assert all(s.reward == Product(cfg.ingest.rewards).reward("accept", None) for s in on_samples if s.kind == "accept")
    assert {s.reward for s in on_heldout if s.kind == "revert"} == {revert_reward}
    # what the gate makes of the held-out stream: one sample per generation, scored as reverted, judged at its accept
    kept, young = merge_heldout([parse_heldout(v) for _, v in broker.of(cfg.topics.heldout)], judged_before=t0 + 1e6)
    assert young == 0 and sorted(s.generation_id for s in kept) == sorted(held)
    accept_reward = Product(cfg.ingest.rewards).reward("accept", None)
    assert all(
        s.reward == accept_reward + revert_reward and s.kind == "revert" and s.judged_at < t0 + 600 for s in kept
    )
    r = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
    counters = r.hgetall(f"{cfg.topics.prefix}:ingest:counters")
    assert int(counters["heldout_out"]) == 2 * len(held) and int(counters["reverted"]) == len(gids)
    if cfg.ingest.train_reverts:
        assert int(counters["revert_samples_out"]) == len(trained) and "drop:revert_not_trained" not in counters
    else:
        assert int(counters["drop:revert_not_trained"]) == len(trained) and "revert_samples_out" not in counters
    # the gate's live counters count every revert either way: kept acceptance and the revert-rate guardrail
    live = [
        keys.live_totals({k: int(n) for k, n in r.hgetall(k).items()})
        for k in r.scan_iter(keys.live_pattern(cfg.topics.prefix))
    ]
    assert sum(c.get("revert", 0) for c in live) == sum(c.get("accept", 0) for c in live) == len(gids)
