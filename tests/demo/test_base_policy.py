"""The base policy: tokenizer, reproducible cached build, acceptance in range, exact eval, vLLM parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

from learner import model as model_io
from liverl.demo import base_policy as policy
from liverl.demo import task
from liverl.demo.score import heldout_score, sample_completions, score_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The real base policy (seed 0), shared by this module; LIVERL_TEST_MODEL_CACHE reuses a cache."""
    cache = os.environ.get("LIVERL_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("models"))
    return policy.ensure_base_policy(Path(cache), seed=0, progress=False)


@pytest.fixture
def quick_recipe(monkeypatch):
    """A recipe that stops at the first evaluation, to test the build mechanics in seconds."""
    sft = dict(policy.RECIPE["sft"], target_acceptance=0.0, eval_every=3, batch_size=32)
    monkeypatch.setitem(policy.RECIPE, "sft", sft)


# --------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_in_transformers(base_dir):
    tok = model_io.load_tokenizer(base_dir)
    texts = ["[a]23+45=68", "[b]99+99=198!", "0123456789+=![]ab"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == policy.encode_text(text)  # no BOS/EOS added, one token per character
        assert tok.decode(ids) == text  # no spaces inserted
        assert tok.decode(ids + [policy.EOS_ID], skip_special_tokens=True) == text
    assert tok.eos_token_id == policy.EOS_ID and tok.pad_token_id == policy.PAD_ID
    assert len(tok) == policy.RECIPE["model"]["vocab_size"]
    with pytest.raises(ValueError, match="not in the task alphabet"):
        policy.encode_text("1 + 2")


# ----------------------------------------------------------------------------------------------- weights
def test_state_dict_conversion_round_trips(base_dir):
    sd = model_io.load_state_dict(base_dir)
    assert all(v.dtype == torch.bfloat16 and v.is_contiguous() for v in sd.values())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in sd and "lm_head.weight" in sd
    model = model_io.load_model(base_dir)
    back = model_io.state_dict_from_model(model)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # the in-memory (fused experts) model matches transformers' own loading of the dir
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    ids = torch.tensor([policy.encode_text("[b]12+34=46!")])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_save_model_dir_and_load_with_given_weights(base_dir, tmp_path):
    sd = model_io.load_state_dict(base_dir)
    sd2 = {k: (v * 0 if k == "lm_head.weight" else v) for k, v in sd.items()}
    out = model_io.save_model_dir(base_dir, sd2, tmp_path / "v1")
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    loaded = model_io.load_state_dict(out)
    assert torch.equal(loaded["lm_head.weight"], sd2["lm_head.weight"])
    m = model_io.load_model(base_dir, sd2)
    assert float(m.lm_head.weight.detach().abs().sum()) == 0.0
    with pytest.raises(ValueError, match="missing"):
        model_io.load_model(base_dir, {k: v for k, v in sd.items() if k != "lm_head.weight"})


# ------------------------------------------------------------------------------------------------- build
def test_build_is_reproducible_cached_and_safe_when_concurrent(tmp_path, quick_recipe, monkeypatch):
    a = policy.ensure_base_policy(tmp_path / "a", seed=3, progress=False)
    b = policy.ensure_base_policy(tmp_path / "b", seed=3, progress=False)
    assert a.name == b.name == f"base-{policy.recipe_hash(3)}"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = policy.ensure_base_policy(tmp_path / "a", seed=4, progress=False)
    assert c != a and (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()

    # cached: no rebuild
    builds = []
    real_build = policy._build
    monkeypatch.setattr(policy, "_build", lambda *a_: (builds.append(a_), real_build(*a_))[1])
    t0 = time.monotonic()
    assert policy.ensure_base_policy(tmp_path / "a", seed=3, progress=False) == a
    assert builds == [] and time.monotonic() - t0 < 1.0

    # two builders at once: one builds, the other waits on the lock and gets the same dir
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(policy.ensure_base_policy(tmp_path / "c", seed=5, progress=False))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1] and len(builds) == 1
    assert not [p for p in (tmp_path / "c").iterdir() if p.is_dir() and p.name.startswith(".")]  # no temp left


def test_bad_seed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="seed"):
        policy.ensure_base_policy(tmp_path, seed=-1)


# ------------------------------------------------------------------------------------------ acceptance
def test_base_is_reproducible_and_records_its_recipe(base_dir):
    meta = json.loads((base_dir / "liverl_base.json").read_text())
    assert meta["seed"] == 0 and meta["recipe_hash"] == policy.recipe_hash(0)
    cfg = json.loads((base_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == policy.EOS_ID


def test_sampled_acceptance_of_base_is_in_range_and_matches_exact_eval(base_dir):
    model = model_io.load_model(base_dir)  # bf16 weights, as served
    prompts = task.heldout_prompts(256) * 4
    samples = sample_completions(model, prompts, seed=1)
    sampled = sum(t is not None and task.user_accepts(p, t) for p, (_, t) in zip(prompts, samples, strict=True)) / len(
        prompts
    )
    assert 0.2 <= sampled <= 0.6, f"base sampled acceptance {sampled:.3f} outside [0.2, 0.6]"
    t0 = time.monotonic()
    score = heldout_score(base_dir, model_io.load_state_dict(base_dir), n_prompts=256)
    elapsed = time.monotonic() - t0
    assert abs(score["expected_acceptance"] - sampled) < 0.05, (score, sampled)
    assert 0.2 <= score["expected_acceptance"] <= 0.6
    assert 0.0 <= score["greedy_acceptance"] <= 1.0 and score["entropy"] > 0.0
    assert set(score["per_segment"]) == set(task.SEGMENTS)
    assert elapsed < 2.0, f"heldout_score took {elapsed:.2f}s"


def test_exact_eval_is_exact_on_a_sharpened_policy(base_dir):
    """Scaling the logits up makes the policy nearly greedy: expected acceptance → greedy acceptance."""
    sd = model_io.load_state_dict(base_dir)
    sharp = dict(sd, **{"lm_head.weight": (sd["lm_head.weight"].float() * 50).to(torch.bfloat16)})
    s = heldout_score(base_dir, sharp, n_prompts=64)
    assert abs(s["expected_acceptance"] - s["greedy_acceptance"]) < 0.02
    assert s["entropy"] < 0.05
    with pytest.raises(ValueError):
        score_model(model_io.load_model(base_dir), [])


# ------------------------------------------------------------------------------------------------- vLLM
_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys

    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        model_dir, prompts_path, out_path = sys.argv[1:4]
        prompts = json.load(open(prompts_path))
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=32, max_num_seqs=64, seed=0,
                  enforce_eager=True, gpu_memory_utilization=0.5)
        sp = SamplingParams(temperature=float(sys.argv[4]), max_tokens=int(sys.argv[5]), logprobs=0)
        res = []
        for o in llm.generate(prompts, sp, use_tqdm=False):
            c = o.outputs[0]
            res.append({"prompt_token_ids": list(o.prompt_token_ids), "text": c.text,
                        "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
        json.dump({"arch": llm.llm_engine.model_config.architecture, "results": res}, open(out_path, "w"))
""")


@pytest.mark.slow
def test_vllm_serves_the_base_exactly(base_dir, tmp_path):
    pytest.importorskip("vllm")
    prompts = task.heldout_prompts(256) * 4
    (tmp_path / "prompts.json").write_text(json.dumps([p.text for p in prompts]))
    (tmp_path / "run.py").write_text(_VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "run.py"),
            str(base_dir),
            str(tmp_path / "prompts.json"),
            str(tmp_path / "out.json"),
            str(task.TEMPERATURE),
            str(task.MAX_TOKENS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["arch"] == "Qwen3MoeForCausalLM"  # the native vLLM model, not the Transformers fallback
    res = out["results"]

    tok = model_io.load_tokenizer(base_dir)
    model = model_io.load_model(base_dir, dtype=torch.bfloat16)
    diffs, accepted = [], 0
    for p, r in zip(prompts, res, strict=True):
        assert r["prompt_token_ids"] == policy.encode_text(p.text)
        ids = r["token_ids"]
        body = ids[:-1] if ids and ids[-1] == policy.EOS_ID else ids
        assert r["text"] == tok.decode(body, skip_special_tokens=True)  # exact detokenization, no spaces
        if r["finish_reason"] == "stop":
            assert ids[-1] == policy.EOS_ID and policy.EOS_ID not in ids[:-1]
        accepted += task.user_accepts(p, r["text"])
    # vLLM's sampled-token log-probs vs transformers' (bf16) teacher-forced log-probs of the same tokens
    seqs = [r["prompt_token_ids"] + r["token_ids"] for r in res]
    T = max(map(len, seqs))
    ids_BT = torch.full((len(seqs), T), policy.PAD_ID)
    for i, s in enumerate(seqs):
        ids_BT[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        logp_BTV = torch.log_softmax(model(input_ids=ids_BT).logits.float() / task.TEMPERATURE, dim=-1)
    for i, r in enumerate(res):
        n = len(r["prompt_token_ids"])
        for j, (t, lp) in enumerate(zip(r["token_ids"], r["logprobs"], strict=True)):
            diffs.append(abs(float(logp_BTV[i, n + j - 1, t]) - lp))
    mean_diff = sum(diffs) / len(diffs)
    assert mean_diff < 0.05, f"mean |logp_vllm - logp_hf| = {mean_diff:.4f}"
    # what product users experience matches the exact held-out number
    expected = heldout_score(base_dir, None, n_prompts=256)["expected_acceptance"]
    print(
        f"vLLM vs HF: mean |dlogp| {mean_diff:.4f} over {len(diffs)} tokens; vLLM sampled acceptance "
        f"{accepted / len(prompts):.3f}, exact {expected:.3f}"
    )
    assert abs(accepted / len(prompts) - expected) < 0.07  # 1024 samples: standard error ~0.015
