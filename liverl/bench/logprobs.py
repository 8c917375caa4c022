"""``liverl bench logprobs``: does the learner see the distribution vLLM sampled from, family by family?

For each model (the tiny test model of each architecture family by default, or ``--model DIR``), a vLLM node
serves it exactly as liverl does (``serving.node``: bf16, the liverl worker extension, processed log-probs);
completions are sampled at temperature 1 for chat-templated prompts, and the log-prob vLLM recorded for each
sampled token is compared with the learner's (``PolicyTrainer.token_logprobs``: transformers, fp32 compute on
the same bf16 weights). The table gives the mean and max absolute difference per token: the gap between the
behaviour policy the learner's importance ratios assume and the one that ran. For scale, the reference column
is the same difference between transformers in bf16 and in fp32: in a MoE model a near-tie in the router
can send one token to other experts under either rounding, which moves that token's log-prob by whole nats.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from core.config import LearnerConfig, load_config
from core.schemas import TrainingSample
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {"prompts": 32, "max_tokens": 16, "seed": 0}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``logprobs`` under the ``liverl bench`` subcommands."""
    p = add_bench_parser(
        subparsers,
        "logprobs",
        "learner vs vLLM log-probs of the served tokens, per model family",
        __doc__,
    )
    p.add_argument(
        "--families",
        nargs="+",
        metavar="FAMILY",
        help="test-model families to measure, or 'all' (default: the four tested on the full path)",
    )
    p.add_argument("--model", action="append", metavar="DIR", help="measure this model dir (repeatable) instead")
    p.add_argument("--prompts", type=int, default=DEFAULTS["prompts"], help="completions sampled per model")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"], help="tokens per completion at most")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed of the prompts and of vLLM's sampling")
    p.add_argument("--cache", metavar="DIR", help="where test models are built (default $LIVERL_TEST_MODEL_CACHE)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(fn=run)
    return p


def command_line(args: argparse.Namespace) -> str:
    """The ``liverl bench logprobs`` command that reproduces ``args``."""
    parts = ["liverl", "bench", "logprobs"]
    if args.model:
        for m in args.model:
            parts += ["--model", m]
    elif args.families:
        parts += ["--families", *args.families]
    for key, flag in (("prompts", "--prompts"), ("max_tokens", "--max-tokens"), ("seed", "--seed")):
        if getattr(args, key) != DEFAULTS[key]:
            parts += [flag, str(getattr(args, key))]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """Measure every model, print the table and the command that reproduces it."""
    from liverl.testing.models import SPECS, TESTED, ensure_test_model

    if args.prompts < 1 or args.max_tokens < 1:
        raise ValueError("--prompts and --max-tokens must be >= 1")
    if args.model:
        targets = [(Path(m).name, Path(m)) for m in args.model]
    else:
        from learner.families import FAMILIES

        families = sorted(FAMILIES, key=list(SPECS).index) if args.families == ["all"] else args.families or TESTED
        targets = [(f, ensure_test_model(f, args.cache, seed=0)) for f in families]
    rows = []
    for label, model_dir in targets:
        print(f"measuring {label} ({model_dir}) ...", file=sys.stderr, flush=True)
        rows.append(dict(measure(model_dir, args.prompts, args.max_tokens, args.seed), model=label))
    print(format_table(rows))
    print(f"\ncommand: {command_line(args)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def format_table(rows: list[dict]) -> str:
    head = (
        "model",
        "architecture",
        "completions",
        "tokens",
        "mean |Δ logp|",
        "p99 |Δ logp|",
        "max |Δ logp|",
        "ref: HF bf16 vs fp32 mean / max",
        "mean logp",
        "node start s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['architecture']} | {r['completions']} | {r['tokens']} | "
            f"{r['mean_abs_diff']:.4f} | {r['p99_abs_diff']:.4f} | {r['max_abs_diff']:.4f} | "
            f"{r['ref_mean_abs_diff']:.4f} / {r['ref_max_abs_diff']:.4f} | {r['mean_logp']:.3f} | "
            f"{r['node_s']:.0f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- one model


def chat_prompts(model_dir: Path, n: int, seed: int) -> list[str]:
    """``n`` user messages of made-up text, rendered with the model's chat template (generation prompt added)."""
    from learner.model import load_tokenizer
    from liverl.testing.models import made_up_text

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    lines = made_up_text(seed + 1, n_sentences=4 * n)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": " ".join(rng.sample(lines, rng.randint(1, 3)))}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for _ in range(n)
    ]


def sample(node_url: str, prompts: list[str], max_tokens: int, seed: int, key: str = "") -> list[dict]:
    """One completion per prompt at temperature 1 from the node: prompt/completion token ids and vLLM's log-probs."""

    def one(i: int) -> dict:
        body = {
            "model": "liverl",
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": seed * 100_003 + i,
        }
        req = urllib.request.Request(
            node_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            c = json.loads(r.read())["choices"][0]
        return {
            "prompt_token_ids": c["prompt_token_ids"],
            "completion_token_ids": c["token_ids"],
            "logprobs": c["logprobs"]["token_logprobs"],
        }

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(len(prompts))))


def compare(model_dir: Path, completions: list[dict]) -> dict:
    """The learner's log-probs of the sampled tokens against vLLM's: mean / max absolute difference per token."""
    import torch

    from learner.model import load_model
    from learner.policy_trainer import PolicyTrainer

    trainer = PolicyTrainer(model_dir, LearnerConfig())
    now = time.time()
    samples = [
        TrainingSample(
            sample_id=f"b{i}",
            generation_id=f"b{i}",
            feedback_id=f"b{i}",
            policy_version=0,
            kind="accept",
            reward=0.0,
            prompt_token_ids=c["prompt_token_ids"],
            completion_token_ids=c["completion_token_ids"],
            behaviour_logprobs=c["logprobs"],
            ts_generation=now,
            ts_feedback=now,
        )
        for i, c in enumerate(completions)
    ]
    ours = trainer.token_logprobs(samples)
    diffs = [
        abs(a - b)
        for s, mine in zip(samples, ours, strict=True)
        for a, b in zip(mine, s.behaviour_logprobs, strict=True)
    ]
    served = [x for s in samples for x in s.behaviour_logprobs]
    # reference: how far transformers itself moves when it computes in bf16 (vLLM's dtype) instead of fp32
    bf16 = trainer.token_logprobs(samples, model=load_model(model_dir, dtype=torch.bfloat16))
    ref = [abs(a - b) for mine, theirs in zip(ours, bf16, strict=True) for a, b in zip(mine, theirs, strict=True)]
    ranked = sorted(diffs)
    return {
        "completions": len(samples),
        "tokens": len(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "p99_abs_diff": ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))],
        "max_abs_diff": ranked[-1],
        "ref_mean_abs_diff": sum(ref) / len(ref),
        "ref_max_abs_diff": max(ref),
        "mean_logp": sum(served) / len(served),
        "architecture": type(trainer.model).__name__,
    }


def measure(model_dir: Path, n_prompts: int, max_tokens: int, seed: int) -> dict:
    """Serve ``model_dir`` on a fresh vLLM node, sample, stop the node, compare."""
    from serving.agent.launch import start_node

    model_dir = Path(model_dir).resolve()
    prompts = chat_prompts(model_dir, n_prompts, seed)
    with tempfile.TemporaryDirectory(prefix="liverl-bench-logprobs-") as tmp:
        cfg = load_config(env={}, state_dir=tmp, serving__vllm_port=_free_port())
        node = start_node(cfg, model_dir, Path(tmp) / "vllm.log")
        try:
            completions = sample(node.url, prompts, max_tokens, seed, key=node.key)
        finally:
            node.stop()
    return dict(compare(model_dir, completions), node_s=round(node.start_s, 1))


def _free_port() -> int:
    from core.services import free_port as pick

    return pick()


def main(argv: list[str] | None = None) -> int:
    """``python -m liverl.bench.logprobs``: the same as ``liverl bench logprobs``."""
    ap = argparse.ArgumentParser(prog="liverl bench")
    add_parser(ap.add_subparsers(dest="bench", required=True))
    args = ap.parse_args(["logprobs", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
