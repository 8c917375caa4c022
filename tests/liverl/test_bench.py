"""The delta benchmark: its rows, its entropy bounds on hand-made changes, and the CLI path on the demo model."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

import numpy as np
import pytest
import torch

from liverl.bench.delta import ROW_KEYS, ChangeCounter, measure
from liverl.bench.delta_cases import step_lr_for, synthetic_cases, synthetic_layout
from tests.deploy.conftest import perturb, tiny_model


def h2(p: float) -> float:
    return -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def test_bounds_one_change_in_four():
    base = np.array([0x3F80, 0x3F80, 0x4000, 0x0001], dtype=np.uint16)
    target = base.copy()
    target[2] ^= 0x0005
    c = ChangeCounter()
    c.add(base, target)
    bits = c.bits()
    assert (bits["n"], bits["k"]) == (4, 1)
    assert bits["order0"] == pytest.approx(4 * h2(1 / 4))  # which one changed; one XOR symbol costs 0 bits
    assert bits["conditional"] == pytest.approx(0.0)  # its exponent group {0x4000} has a single element


def test_bounds_by_hand_with_exponent_groups():
    # exponent field (bits >> 7) & 0xFF: 0x3F80 -> 127, 0x4000 -> 128; both groups have 4 elements
    base = np.array([0x3F80] * 4 + [0x4000] * 4, dtype=np.uint16)
    target = base.copy()
    target[0] ^= 1  # group 127: 2 of 4 changed, XORs {1, 2}
    target[1] ^= 2
    target[4] ^= 1  # group 128: 1 of 4 changed, XOR {1}
    c = ChangeCounter()
    c.add(base[:5], target[:5])  # in two pieces: counts accumulate
    c.add(base[5:], target[5:])
    bits = c.bits()
    assert (bits["n"], bits["k"]) == (8, 3)
    # order 0: 8*H2(3/8) + 3*H({1: 2/3, 2: 1/3})
    assert bits["order0"] == pytest.approx(8 * h2(3 / 8) + 3 * h2(1 / 3))
    # per group: (4*H2(2/4) + 2*H({1, 2})) + (4*H2(1/4) + 0)
    assert bits["conditional"] == pytest.approx(4 * 1 + 2 * 1 + 4 * h2(1 / 4))


def test_bounds_nothing_changed():
    base = np.arange(1000, dtype=np.uint16)
    bits = ChangeCounter()
    bits.add(base, base.copy())
    assert bits.bits() == {"n": 1000, "k": 0, "order0": 0.0, "conditional": 0.0}


def test_measure_row():
    base = tiny_model()
    target = perturb(base, 0.05)
    row = measure("tiny", base, target)
    assert set(ROW_KEYS) <= set(row)
    assert row["case"] == "tiny"
    changed = sum(int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum()) for k in base)
    total = sum(t.numel() for t in base.values())
    assert row["changed_fraction"] == pytest.approx(changed / total)
    for key in ROW_KEYS[2:9]:
        assert row[key] > 0, key
    assert row["ratio_conditional_bound"] >= row["ratio_entropy_bound"]  # conditioning never costs bits
    assert row["peak_rss_bytes"] >= 0
    assert row["raw_bytes"] == 2 * total


def test_synthetic_hits_the_changed_fraction():
    layout = synthetic_layout(0.005)
    assert sum(math.prod(s) for _, s, _ in layout) * 2 >= 0.005 * (1 << 30)
    assert step_lr_for(0.01, layout) < step_lr_for(0.05, layout)
    ((name, base, target),) = synthetic_cases(0.005, fractions=(0.02,))
    assert name == "synthetic 0.005 GiB 2% changed"
    changed = sum(int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum()) for k in base)
    assert changed / sum(t.numel() for t in base.values()) == pytest.approx(0.02, rel=0.1)


def test_cli_demo_json(tmp_path, capsys, monkeypatch):
    """The demo cases through the real CLI: ~20 s, plus ~25 s the first time the base policy is built."""
    from liverl.cli import main

    out = tmp_path / "bench.json"
    cache = os.environ.get("LIVERL_TEST_MODEL_CACHE") or os.path.join(tempfile.gettempdir(), "liverl-test-models")
    monkeypatch.setenv("LIVERL__MODEL__CACHE_DIR", cache)
    assert main(["bench", "delta", "--skip-synthetic", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows][:3] == [
        "demo lr=1e-06 every 1",
        "demo lr=1e-06 every 10",
        "demo lr=1e-06 every 50",
    ]
    assert len(rows) == 9
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert r["ratio_liverl"] > 0 and r["encode_gbps"] > 0
    printed = capsys.readouterr().out
    assert "reproduce: liverl bench delta --skip-synthetic" in printed
    assert "machine: " in printed


def test_logprobs_compare_scores_the_tokens_it_is_given():
    """``liverl bench logprobs``'s comparison half, without vLLM: behaviour log-probs set to the learner's own
    (so the difference is 0) and then shifted by 0.5 nats (so it is 0.5)."""
    from core.config import LearnerConfig
    from core.schemas import TrainingSample
    from learner.policy_trainer import PolicyTrainer
    from liverl.bench.logprobs import compare
    from liverl.testing.models import ensure_test_model

    model_dir = ensure_test_model("qwen3", os.environ.get("LIVERL_TEST_MODEL_CACHE"))
    done = [
        {"prompt_token_ids": [5, 6, 7], "completion_token_ids": [8, 9, 10]},
        {"prompt_token_ids": [11, 12], "completion_token_ids": [13]},
    ]
    tr = PolicyTrainer(model_dir, LearnerConfig())
    probe = [
        TrainingSample(
            sample_id=f"p{i}",
            generation_id=f"p{i}",
            feedback_id=f"p{i}",
            policy_version=0,
            kind="accept",
            reward=0.0,
            prompt_token_ids=c["prompt_token_ids"],
            completion_token_ids=c["completion_token_ids"],
            behaviour_logprobs=[-1.0] * len(c["completion_token_ids"]),
            ts_generation=time.time(),
            ts_feedback=time.time(),
        )
        for i, c in enumerate(done)
    ]
    exact = tr.token_logprobs(probe)
    for c, lp in zip(done, exact, strict=True):
        c["logprobs"] = lp
    row = compare(model_dir, done)
    assert row["tokens"] == 4 and row["completions"] == 2 and row["max_abs_diff"] < 1e-5
    for c in done:
        c["logprobs"] = [x - 0.5 for x in c["logprobs"]]
    row = compare(model_dir, done)
    assert abs(row["mean_abs_diff"] - 0.5) < 1e-4 and row["architecture"] == "Qwen3ForCausalLM"


def test_serve_bench_forwards_the_gateways_own_request_and_prints_both_ratios():
    """``liverl bench serve``'s third side sends the node exactly what the gateway forwards, and the table shows the
    ratio against the plain node (the issue's measure) and against the node doing the same work."""
    from liverl.bench.serve import _forwarded, _requests, _table
    from serving.node.openai_api import CompletionRequest

    plain = _requests("completions", stream=False, n_prompts=3)
    fwd = _forwarded(plain)
    for (path, body), (fpath, fbody) in zip(plain, fwd, strict=True):
        assert path == fpath == "/v1/completions"
        assert json.loads(fbody) == CompletionRequest.model_validate_json(body).node_body()
        assert json.loads(fbody)["return_token_ids"] is True and json.loads(fbody)["logprobs"] == 0
    chat = _forwarded(_requests("chat", stream=True, n_prompts=1))
    assert json.loads(chat[0][1])["logprobs"] is True and json.loads(chat[0][1])["stream"] is True

    side = {"gen_per_s": 100.0, "p50_ms": 200.0, "errors": 0, "total_ok": 2000, "api_cpu_s": 1.0}
    rows = [
        {
            "round": 1,
            "first": "gateway",
            "gateway": side,
            "node": dict(side, gen_per_s=200.0),
            "node_fwd": dict(side, gen_per_s=125.0),
            "ratio": 0.5,
            "ratio_fwd": 0.8,
        }
    ]
    out = _table(
        {
            "rows": rows,
            "median_ratio": 0.5,
            "median_ratio_fwd": 0.8,
            "median_p50_overhead_ms": 0.0,
            "machine": "m",
            "command": "c",
        }
    )
    assert (
        "**0.500**" in out and "0.800" in out and "| 0.50 / 0.50 / 0.50 |" in out
    )  # API-server CPU ms/gen: 1 s / 2000


def test_ingest_bench_joins_every_pair_once_and_prints_its_table(stack, tmp_path, monkeypatch, capsys):
    """``liverl bench ingest`` end to end on a small backlog, on the test broker and Redis: the worker joins every
    pair exactly once (no dead letter), the ceilings read the whole backlog, and the table names the command."""
    from liverl.bench.ingest import run

    monkeypatch.setenv("LIVERL__BROKER__BOOTSTRAP", stack.bootstrap)
    monkeypatch.setenv("LIVERL__REDIS__URL", stack.redis_url)
    monkeypatch.setenv("LIVERL__STATE_DIR", str(tmp_path))
    pairs = 400
    summary = run(pairs=pairs, partitions=2, workers=(1,), timeout_s=180, command="liverl bench ingest --pairs 400")
    sides = [r["side"] for r in summary["rows"]]
    assert sides == ["raw consumer", "raw consumer + parse", "faust agent, consume only", "ingest, 1 worker"]
    for r in summary["rows"][:3]:
        assert r["records"] == 2 * pairs
    worker = summary["rows"][3]
    assert worker["joined"] == pairs and worker["dead_letters"] == 0
    c = worker["counters"]
    assert c["samples_out"] + c.get("heldout_out", 0) == pairs and c["feedback_in"] == pairs
    assert worker["scaling"] == 1.0
    # the shared parts' cost per event: Redis runs on this machine (the test stack's), the broker too but was started
    # by the session's stack, not the bench's, so only Redis's process is known to the bench
    assert set(worker["helpers_us_per_event"]) == {"redis"} and worker["helpers_us_per_event"]["redis"] >= 0
    assert math.isnan(worker["machine_busy"]) or 0 < worker["machine_busy"] <= 1  # nan: all joined at the first poll
    out = capsys.readouterr().out
    assert "| broker + Redis us/event | machine busy |" in out
    assert "| ingest, 1 worker |" in out and "reproduce: `liverl bench ingest --pairs 400`" in out


def test_bench_learn_drift_prints_the_kl_each_learning_rate_reaches(tmp_path, capsys):
    """``liverl bench learn --drift``: one row per model and rate, the KL from the base growing with the rate."""
    from liverl.bench.learn import main

    assert (
        main(
            ["--models", "tiny", "--drift", "1e-2,1e-6", "--drift-steps", "2", "--batch", "4", "--work", str(tmp_path)]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| tiny |")]
    assert [r[1] for r in rows] == ["0.01", "1e-06"]
    fast, slow = (float(r[3]) for r in rows)  # KL after 2 updates
    assert fast > max(100 * abs(slow), 1e-3)  # 1e-6 barely moves it (its KL is within rounding of 0)
    assert "--drift 1e-2,1e-6" in out
