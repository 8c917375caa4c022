"""Your model, family by family, on the full path: served, logged, trained on, stored, hot-swapped, verified.

For each tested architecture family (Qwen3-MoE, Mixtral, Qwen2-MoE, dense Qwen3: ``liverl.testing.models``),
a tiny model dir built locally (random weights, locally trained tokenizer with a chat template) goes through
the real parts, one vLLM start per family:
1. the serving stack (vLLM node + gateway + agent) serves chat-templated prompts;
2. the gateway logs every generation to Kafka; the learner's log-probs of the served tokens are close to the
   ones vLLM recorded;
3. the learner (the Kafka consumer, ``Learner.run``) makes one update on samples built from those records and
   emits a candidate, stored in the registry as a delta;
4. the release is announced; the agent hot-swaps the node to it;
5. the weights the node serves, read back from its live parameters, have the candidate's checksum, which is
   the learner's own bf16 weights'; and what the node computes now is the new weights' distribution.

The other handled families (OLMoE, Granite-MoE, PhiMoE, Llama) pass the same test; CI runs the four above to
keep its time down. ``LIVERL_TEST_FAMILIES=all`` (or a comma-separated list) runs others.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid

import pytest
import torch

from core import keys
from core.config import load_config
from core.schemas import GenerationRecord, TrainingSample
from learner.families import FAMILIES
from liverl.testing.models import TESTED, default_cache, ensure_test_model
from tests.conftest import free_port

_CHOSEN = os.environ.get("LIVERL_TEST_FAMILIES", "")
RUN_FAMILIES = sorted(FAMILIES) if _CHOSEN == "all" else [f for f in _CHOSEN.split(",") if f] or list(TESTED)

N_PROMPTS = 8
MAX_TOKENS = 12


def _post(url: str, body: dict, timeout: float = 120, key: str = "") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _generate(url: str, prompts: list[str], seed: int) -> list[dict]:
    out = []
    for i, p in enumerate(prompts):
        status, body = _post(
            url + "/v1/completions",
            {
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 1.0,
                "seed": seed + i,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        c = body["choices"][0]
        out.append(
            {
                "gid": body["liverl"]["generation_id"],
                "version": body["liverl"]["policy_version"],
                "prompt_token_ids": c["prompt_token_ids"],
                "completion_token_ids": c["token_ids"],
                "logprobs": c["logprobs"]["token_logprobs"],
            }
        )
    return out


def _node_scores(node_url: str, gen: dict, key: str) -> list[float]:
    """The node's log-probs of a generation's completion tokens, scored as a prompt (``prompt_logprobs``)."""
    ids = gen["prompt_token_ids"] + gen["completion_token_ids"]
    status, body = _post(
        node_url + "/v1/completions",
        {"model": "liverl", "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        key=key,
    )
    assert status == 200, body
    per_pos = body["choices"][0]["prompt_logprobs"]
    return [
        per_pos[len(gen["prompt_token_ids"]) + i][str(t)]["logprob"] for i, t in enumerate(gen["completion_token_ids"])
    ]


def _records(bootstrap: str, topic: str, ids: set[str], timeout_s: float = 30) -> dict[str, GenerationRecord]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=500)
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
                    if rec.generation_id in ids:
                        found[rec.generation_id] = rec
        return found
    finally:
        consumer.close()


def _logprobs(model, gens: list[dict]) -> list[float]:
    """A transformers model's log-prob of every served completion token (fp32 compute), flattened."""
    out = []
    for g in gens:
        ids = torch.tensor([g["prompt_token_ids"] + g["completion_token_ids"]])
        with torch.no_grad():
            logp_TV = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        p = len(g["prompt_token_ids"])
        out += [logp_TV[p - 1 + i, t].item() for i, t in enumerate(g["completion_token_ids"])]
    return out


def _median_abs(a: list[float], b: list[float]) -> float:
    """Median |a - b|: robust to the few tokens a near-tie in a MoE router sends elsewhere (see BENCHMARKS.md)."""
    assert len(a) == len(b) and a
    d = sorted(abs(x - y) for x, y in zip(a, b, strict=True))
    return d[len(d) // 2]


@pytest.mark.slow
@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_full_path(family, stack, tmp_path):
    import redis

    from core.bus import ensure_topics, make_producer
    from deploy.registry.blobstore import LocalBlobStore
    from deploy.registry.delta import checksum
    from deploy.registry.registry import Registry
    from deploy.registry.signing import Signer, announce, generate_keypair
    from learner.model import load_model, load_state_dict
    from learner.trainer import Learner
    from liverl.bench.logprobs import chat_prompts
    from tests.serving.harness import ServingThread

    model_dir = ensure_test_model(family, default_cache())
    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
        serving__gateway_port=free_port(),
        serving__vllm_port=free_port(),
        serving__agent_port=free_port(),
        serving__swap_poll_s=0.1,
        serving__max_num_seqs=16,
        learner__batch_size=N_PROMPTS,
        learner__candidate_every_steps=1,
        learner__lr=0.05,
    )  # one big step: the new version's distribution is far from the base's
    cfg.state_path.mkdir(parents=True, exist_ok=True)
    private, _ = generate_keypair(cfg.state_path / "keys")  # serve refuses to start without the verify key
    registry = Registry(cfg.registry_url, LocalBlobStore(cfg.blob_location))
    base = load_state_dict(model_dir)
    registry.init_base(base, str(model_dir))
    r = redis.Redis.from_url(stack.redis_url)
    serving = ServingThread(cfg, model_dir, stack.bootstrap, stack.redis_url, cfg.registry_url).start()
    try:
        # 1-2. served through the gateway, logged to Kafka with the tokens and log-probs vLLM sampled
        prompts = chat_prompts(model_dir, N_PROMPTS, seed=0)
        gens = _generate(serving.url, prompts, seed=0)
        recs = _records(stack.bootstrap, cfg.topics.generations, {g["gid"] for g in gens})
        assert len(recs) == len(gens)
        for g in gens:
            rec = recs[g["gid"]]
            assert rec.policy_version == g["version"] == 0 and rec.trainable
            assert (
                rec.prompt_token_ids == g["prompt_token_ids"] and rec.completion_token_ids == g["completion_token_ids"]
            )
            assert rec.completion_logprobs == pytest.approx(g["logprobs"])
        base_model = load_model(model_dir)
        served = [x for g in gens for x in g["logprobs"]]
        assert _median_abs(_logprobs(base_model, gens), served) < 0.1  # bf16 noise (BENCHMARKS.md), not a mix-up

        # 3. one learner update on samples made of those records, emitted as a candidate (a delta in the registry)
        now = time.time()
        samples = [
            TrainingSample(
                sample_id=rec.generation_id,
                generation_id=rec.generation_id,
                feedback_id=f"f{i}",
                policy_version=rec.policy_version,
                kind="accept" if i % 2 else "reject",
                reward=0.75 if i % 2 else -0.25,
                prompt_token_ids=rec.prompt_token_ids,
                completion_token_ids=rec.completion_token_ids,
                behaviour_logprobs=rec.completion_logprobs,
                sampling=rec.sampling,
                ts_generation=rec.ts,
                ts_feedback=now,
            )
            for i, rec in enumerate(recs[g["gid"]] for g in gens)
        ]
        ensure_topics(stack.bootstrap, [cfg.topics.samples], cfg.broker.partitions)
        prod = make_producer(stack.bootstrap)
        try:
            for s in samples:
                prod.send(cfg.topics.samples, key=s.generation_id, value=s.to_bytes())
            prod.flush()
        finally:
            prod.close()
        learner = Learner(cfg, model_dir, stack.bootstrap, registry)
        stats = learner.run(max_steps=1)
        assert (
            stats["step"] == 1
            and stats["samples_trained"] == N_PROMPTS
            and stats["counters"].get("dropped:bad_logprob", 0) == 0
        )
        row = registry.get(stats["last_candidate"])
        assert row.parent == 0 and registry.delta_for(row.version)  # stored as a delta from the base
        trained = learner.trainer.bf16_state_dict()
        assert row.checksum == checksum(trained) == checksum(registry.materialize(row.version))
        assert row.checksum != checksum(base)

        # 4. released (promoted in the registry, then announced, as the gate does): the agent hot-swaps the node
        registry.promote(row.version, actor="test", reason="full-path test")
        announce(r, cfg.topics.prefix, row.version, row.checksum, "full-path test", signer=Signer(private))
        deadline = time.monotonic() + 60
        while serving.gateway.version != row.version and time.monotonic() < deadline:
            time.sleep(0.1)
        assert serving.gateway.version == row.version, r.lrange(keys.swap_errors(cfg.topics.prefix), 0, -1)
        while not r.llen(keys.swaps(cfg.topics.prefix)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the record is written just after the gateway switches
        swap = json.loads(r.lrange(keys.swaps(cfg.topics.prefix), -1, -1)[0])
        assert swap["to"] == row.version and swap["verify_ok"]

        # 5. the node's live weights, read back under the file names, are the learner's bit for bit ...
        status, body = _post(serving.node.url + "/collective_rpc", {"method": "liverl_checksum"}, key=serving.node.key)
        assert status == 200 and body["results"][0]["ok"], body
        assert body["results"][0]["checksum"] == row.checksum
        # ... and the node computes with them: scoring the base's samples again, its log-probs are the new
        # weights' and clearly not the base's
        after = _generate(serving.url, prompts[:2], seed=100)
        assert all(g["version"] == row.version for g in after)
        rescored = [x for g in gens for x in _node_scores(serving.node.url, g, serving.node.key)]
        new_model = load_model(model_dir, state_dict=trained)
        to_new = _median_abs(_logprobs(new_model, gens), rescored)
        to_base = _median_abs(_logprobs(base_model, gens), rescored)
        assert to_new < 0.2 and to_base > 5 * to_new, (to_new, to_base)
    finally:
        serving.stop()
        r.close()
        registry.close()
