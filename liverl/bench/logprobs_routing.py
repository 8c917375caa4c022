"""What recording and replaying the router's choices costs, measured beside its baseline (``liverl bench logprobs``).

For one model's sampled completions (``liverl.bench.logprobs``, with the node's routing capture on,
``serving.record_routing``):

- **record size**: the routing's bytes per position (the ``core.routing`` blob, and in base64 as the record carries
  it), and the generation record's bytes with and without it;
- **ingest**: joined events/s of ingest's join (``ingest.join.Ingest.process``: parse, routing check, the sample,
  the live counters in Redis) on the same records with and without routing, in this process, against a broker
  stand-in that acknowledges every send at once: the join's own cost, not the broker's (``liverl bench ingest``
  measures the whole worker). Rounds alternate between the two, the median is reported;
- **learner**: one update (``PolicyTrainer.train_step``, ``learner.mismatch_measure = "trained"``) on a batch of the
  samples with the learner's own routing (``routing_replay = "off"``) and with the server's replayed
  (``"rollout"``), and with replay plus the second routing's mismatch forward (``mismatch_measure = "both"``),
  alternating update by update, median ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
import uuid

from core.config import LearnerConfig, load_config
from core.schemas import FeedbackEvent, GenerationRecord, SamplingParams, TrainingSample


def node_rpc(node_url: str, key: str, method: str, *args) -> dict:
    """``collective_rpc`` of a liverl worker method on a node (its keyed dev route); the single worker's result."""
    body = json.dumps({"method": method, "args": list(args), "timeout": 60}).encode()
    req = urllib.request.Request(
        node_url + "/collective_rpc",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        results = json.loads(r.read()).get("results") or []
    if len(results) != 1 or not isinstance(results[0], dict):
        raise RuntimeError(f"collective_rpc {method}: expected one worker result, got {results!r}"[:300])
    return results[0]


def records(completions: list[dict], routing: bool) -> list[GenerationRecord]:
    """The generation records the gateway would log for ``completions``, with their routing or without."""
    return [
        GenerationRecord(
            generation_id=f"g{i:06d}",
            policy_version=0,
            node="bench",
            prompt=c.get("prompt", ""),
            completion=c.get("text", ""),
            prompt_token_ids=c["prompt_token_ids"],
            completion_token_ids=c["completion_token_ids"],
            completion_logprobs=c["logprobs"],
            sampling=SamplingParams(temperature=1.0, max_tokens=len(c["completion_token_ids"])),
            finish_reason="length",
            routed_experts=c.get("routing") if routing else None,
        )
        for i, c in enumerate(completions)
    ]


def record_sizes(completions: list[dict]) -> dict:
    """Routing bytes per position (blob, base64) and mean record bytes without and with routing."""
    from core import routing as codec

    routed = [c for c in completions if c.get("routing")]
    out = {
        "record_bytes": statistics.mean(len(r.to_bytes()) for r in records(completions, False)),
        "record_bytes_routed": None,
        "routing_bytes_per_position": None,
        "routing_b64_per_position": None,
    }
    if routed:
        positions = sum(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) - 1 for c in routed)
        out["routing_bytes_per_position"] = sum(len(codec.from_text(c["routing"])) for c in routed) / positions
        out["routing_b64_per_position"] = sum(len(c["routing"]) for c in routed) / positions
        out["record_bytes_routed"] = statistics.mean(len(r.to_bytes()) for r in records(completions, True))
    return out


class _Acks:
    """A broker stand-in: every send acknowledged at once."""

    def __init__(self):
        self.sent = 0

    def send(self, topic: str, key: str, value: bytes):
        self.sent += 1
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def flush(self):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result({})
        return fut


def _join_rate(redis_url: str, recs: list[GenerationRecord], pairs: int) -> float:
    """Joined events/s of ``Ingest.process`` over ``pairs`` generations (copies of ``recs``) and their feedback."""
    import redis

    from ingest.join import Ingest, Source
    from ingest.metrics import IngestMetrics

    prefix = f"bench{uuid.uuid4().hex[:10]}"
    cfg = load_config(env={}, redis__url=redis_url, topics__prefix=prefix, ingest__heldout_share=0.0)
    loop = asyncio.new_event_loop()
    metrics = IngestMetrics(prefix, redis_url)
    try:
        ing = Ingest(cfg, metrics, {}, _Acks())
        gens, fbs = [], []
        for i in range(pairs):
            gid = f"{prefix}-{i}"
            raw = recs[i % len(recs)].model_copy(update={"generation_id": gid}).to_bytes()
            gens.append((Source(cfg.topics.generations, 0, i, gid), raw))
            fb = FeedbackEvent(feedback_id=f"f-{gid}", generation_id=gid, kind="accept").to_bytes()
            fbs.append((Source(cfg.topics.feedback, 0, i, gid), fb))
        t0 = time.perf_counter()
        for k in range(0, pairs, 500):
            loop.run_until_complete(ing.process(gens[k : k + 500]))
        for k in range(0, pairs, 500):
            loop.run_until_complete(ing.process(fbs[k : k + 500]))
        return pairs / (time.perf_counter() - t0)
    finally:
        loop.run_until_complete(metrics.close())
        loop.close()
        r = redis.Redis.from_url(redis_url)
        try:
            found = list(r.scan_iter(f"{prefix}:*", count=1000))
            for i in range(0, len(found), 500):
                r.delete(*found[i : i + 500])
        finally:
            r.close()


def ingest_rates(completions: list[dict], redis_url: str, pairs: int, rounds: int) -> dict:
    """Median joined events/s without and with routing on the records (rounds alternate)."""
    plain, routed = records(completions, False), records(completions, True)
    has = any(c.get("routing") for c in completions)
    runs: dict[str, list[float]] = {"plain": [], "routed": []}
    for k in range(rounds):
        order = ("plain", "routed") if k % 2 == 0 else ("routed", "plain")
        for side in order:
            if side == "routed" and not has:
                continue
            runs[side].append(_join_rate(redis_url, plain if side == "plain" else routed, pairs))
    return {
        "ingest_eps": statistics.median(runs["plain"]),
        "ingest_eps_routed": statistics.median(runs["routed"]) if runs["routed"] else None,
    }


def update_times(model_dir, samples: list[TrainingSample], batch: int, steps: int) -> dict:
    """Median ms of one update without replay, with replay, and with replay and the mismatch's second forward."""
    from learner.policy_trainer import PolicyTrainer

    sides = {
        "update_ms": LearnerConfig(routing_replay="off", mismatch_measure="trained"),
        "update_ms_replay": LearnerConfig(routing_replay="rollout", mismatch_measure="trained"),
        "update_ms_replay_both": LearnerConfig(routing_replay="rollout", mismatch_measure="both"),
    }
    trainers = {k: PolicyTrainer(model_dir, c) for k, c in sides.items()}
    rewarded = [s.model_copy(update={"reward": 1.0 if i % 2 else -1.0}) for i, s in enumerate(samples)]
    batches = [[rewarded[(j * batch + i) % len(rewarded)] for i in range(batch)] for j in range(steps + 1)]
    times: dict[str, list[float]] = {k: [] for k in sides}
    for j, b in enumerate(batches):
        order = list(sides) if j % 2 == 0 else list(reversed(sides))
        for k in order:
            tr = trainers[k]
            use = b if tr.routing is not None else [s.model_copy(update={"routed_experts": None}) for s in b]
            t0 = time.perf_counter()
            tr.train_step(use)
            if j > 0:  # the first update of each side is a warm-up
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}
