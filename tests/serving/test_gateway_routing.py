"""The router's choices on the gateway's records (``serving.record_routing``): a CPU vLLM node serving the demo's
Qwen3-MoE with the gateway in its process, several concurrent requests (batched prompts, ``n > 1``, a stream), and
every generation record read back from the broker carries routing that decodes for its own tokens and names, position
by position, the experts the learner's router picks on the same tokens (bar the few rows where bf16 kernels round a
close call the other way), which the learner's replay takes as it is."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request
import uuid

import numpy as np
import pytest

from core.config import load_config
from tests.conftest import free_port
from tests.serving.conftest import records

PROMPTS = ["[a]23+45=", "[b]17+61=", "[a]90+9=", "[b]50+44="]


@pytest.fixture(scope="module")
def moe_node(stack, tmp_path_factory):
    """One node with ``serving.record_routing`` on the demo's base policy (Qwen3-MoE, 8 experts, top-2)."""
    from core.credentials import ensure_secrets
    from deploy.registry.blobstore import LocalBlobStore
    from deploy.registry.registry import Registry
    from deploy.registry.signing import generate_keypair
    from liverl.demo.base_policy import ensure_base_policy, load_state_dict
    from liverl.testing.models import default_cache
    from tests.serving.harness import ServingThread

    model_dir = ensure_base_policy(default_cache(), seed=0, progress=False)
    cfg = load_config(
        env={},
        state_dir=str(tmp_path_factory.mktemp("serving")),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
        serving__gateway_port=free_port(),
        serving__vllm_port=free_port(),
        serving__agent_port=free_port(),
        serving__max_num_seqs=16,
        serving__record_routing=True,
        serving__engine_ready_timeout_s=900.0,  # a shared 2-core machine can take minutes to start the engine
    )
    generate_keypair(cfg.state_path / "keys")
    ensure_secrets(cfg)
    registry = Registry(cfg.registry_url, LocalBlobStore(cfg.blob_location))
    registry.init_base(load_state_dict(model_dir), str(model_dir))
    serving = ServingThread(cfg, model_dir, stack.bootstrap, stack.redis_url, cfg.registry_url).start(timeout_s=900)
    try:
        yield cfg, serving, model_dir, stack.bootstrap
    finally:
        serving.stop()
        registry.close()


def _post(url: str, body: dict) -> list[str]:
    """The generation ids of one request (its header, in choice order); a stream is read to its end."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        r.read()
        return r.headers["X-Liverl-Generation-Id"].split(",")


@pytest.mark.slow
def test_every_records_routing_is_its_own_and_what_the_learner_replays(moe_node):
    import torch

    from core import routing
    from core.config import LearnerConfig
    from core.schemas import TrainingSample
    from learner import replay, replay_own
    from learner.model import load_model, load_state_dict
    from learner.policy_trainer import PolicyTrainer

    cfg, serving, model_dir, bootstrap = moe_node
    base = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}/v1/completions"
    common = {"max_tokens": 8, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
    bodies = [
        {**common, "prompt": PROMPTS[0]},
        {**common, "prompt": PROMPTS[1], "n": 3},  # three child requests of one prompt
        {**common, "prompt": PROMPTS[2:4], "n": 2},  # two prompts, two choices each
        {**common, "prompt": PROMPTS[3], "n": 2, "stream": True},
        {**common, "prompt": PROMPTS[0], "max_tokens": 5},
        {**common, "prompt": PROMPTS[1], "max_tokens": 11},
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:  # all in flight together
        ids = [gid for got in pool.map(lambda b: _post(base, b), bodies) for gid in got]
    assert len(ids) == 1 + 3 + 4 + 2 + 1 + 1
    ns = type("S", (), {"cfg": cfg, "bootstrap": bootstrap})
    recs = records(ns, set(ids))
    assert set(recs) == set(ids), f"records missing: {set(ids) - set(recs)}"
    model = load_model(model_dir, dtype=torch.bfloat16)
    shape = replay.moe_shape(model)
    samples = [
        TrainingSample(
            sample_id=gid,
            generation_id=gid,
            feedback_id=gid,
            policy_version=r.policy_version,
            kind="accept",
            reward=1.0,
            prompt_token_ids=r.prompt_token_ids,
            completion_token_ids=r.completion_token_ids,
            behaviour_logprobs=r.completion_logprobs,
            ts_generation=1.8e9,
            ts_feedback=1.8e9,
            routed_experts=r.routed_experts,
        )
        for gid, r in recs.items()
    ]
    want = replay_own.routing_of(model, samples)
    same = total = 0
    for s, w in zip(samples, want, strict=True):
        assert s.routed_experts is not None, f"record {s.generation_id} has no routing"
        n = replay.positions(s)
        got = routing.decode(
            routing.from_text(s.routed_experts),
            positions=n,
            layers=shape.layers,
            top_k=shape.top_k,
            n_experts=shape.n_experts,
        )
        agree = (np.sort(got, -1) == np.sort(routing.decode(routing.from_text(w), positions=n), -1)).all(-1)
        completion = agree[len(s.prompt_token_ids) - 1 :]  # the rows no sibling choice shares
        assert agree.mean() > 0.8 and completion.mean() > 0.75, (
            f"record {s.generation_id}: {agree.mean():.2f} of its rows, {completion.mean():.2f} of its completion's, "
            "name the learner's experts (routing of another request?)"
        )
        same, total = same + int(agree.sum()), total + agree.size
    assert same / total > 0.9
    tr = PolicyTrainer(model_dir, LearnerConfig(routing_replay="rollout"))
    assert all(tr.refusal(s) is None for s in samples)  # every record's routing is what the learner replays
    x = tr._collate(samples)
    route_RNLK, routed_RN = x["route"]
    assert int(routed_RN.sum()) == sum(replay.positions(s) for s in samples)
    # the gate's default bound is sized from this: the node's log-probs pass it with and without replay, and a learner
    # whose weights are not the ones served (each weight scaled by 1 + 0.5 N(0, 1)) does not
    bound = load_config(env={}).gate.max_logprob_mismatch
    gap = {name: _mean_abs(tr, batch) for name, batch in (("own", _without(samples)), ("replayed", samples))}
    assert gap["own"] < bound and gap["replayed"] < bound, gap
    torch.manual_seed(0)
    served = load_state_dict(model_dir)
    other = {k: v * (1 + 0.5 * torch.randn(v.shape)).to(v.dtype) for k, v in served.items()}
    gap["other weights"] = _mean_abs(PolicyTrainer(model_dir, LearnerConfig(), state_dict=other), _without(samples))
    assert gap["other weights"] > bound, gap
    print(
        f"gateway records: {same}/{total} (position, MoE layer) rows name the learner's experts; "
        f"mean |logp_vllm - logp_learner| {gap} (gate.max_logprob_mismatch {bound})"
    )


def _without(samples):
    return [s.model_copy(update={"routed_experts": None}) for s in samples]


def _mean_abs(trainer, samples) -> float:
    lps = trainer.token_logprobs(samples)
    diffs = [
        abs(a - b) for s, lp in zip(samples, lps, strict=True) for a, b in zip(lp, s.behaviour_logprobs, strict=True)
    ]
    return sum(diffs) / len(diffs)
