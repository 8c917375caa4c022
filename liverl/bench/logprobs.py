"""``liverl bench logprobs``: does the learner see the distribution vLLM sampled from, family by family?

For each model (the tiny test model of each architecture family by default, or ``--model DIR``), a vLLM node
serves it exactly as liverl does (``serving.node``: bf16, the liverl worker extension, processed log-probs);
completions are sampled at temperature 1 for chat-templated prompts, and the log-prob vLLM recorded for each
sampled token is compared with the learner's (``PolicyTrainer.token_logprobs``: transformers, fp32 compute on
the same bf16 weights). The table gives the mean and max absolute difference per token: the gap between the
behaviour policy the learner's importance ratios assume and the one that ran. For scale, the reference column
is the same difference between transformers in bf16 and in fp32: in a MoE model a near-tie in the router
can send one token to other experts under either rounding, which moves that token's log-prob by whole nats.

The node runs with ``serving.record_routing`` (prefix caching off, the worker's routing capture on), so each
completion also comes with the experts vLLM's router chose for it, read from the worker as the gateway reads them
(``serving.node.gateway_routing``). The same difference is then given with those experts replayed in the learner's
forward (``learner.routing_replay = "rollout"``), with the k3 KL estimate of both (``learner.mismatch``). A second
table gives what recording and replaying the routing costs, each beside its baseline in the same run
(``liverl.bench.logprobs_routing``): bytes per position, the record's size, ingest's joined events/s and the
learner's update time, without and with routing.
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

DEFAULTS = {
    "prompts": 32,
    "max_tokens": 16,
    "seed": 0,
    "pairs": 4000,
    "rounds": 3,
    "batch": 16,
    "steps": 8,
    "redis": "redis://127.0.0.1:6379",
}


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
    p.add_argument("--pairs", type=int, default=DEFAULTS["pairs"], help="generation/feedback pairs per ingest run")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="ingest runs of each side (median)")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="samples per timed learner update")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="timed learner updates per side (median)")
    p.add_argument(
        "--redis", default=DEFAULTS["redis"], metavar="URL", help="the Redis ingest's join counts in (own key prefix)"
    )
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
    for key, flag in (
        ("prompts", "--prompts"),
        ("max_tokens", "--max-tokens"),
        ("seed", "--seed"),
        ("pairs", "--pairs"),
        ("rounds", "--rounds"),
        ("batch", "--batch"),
        ("steps", "--steps"),
        ("redis", "--redis"),
    ):
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
        rows.append(dict(measure(model_dir, args.prompts, args.max_tokens, args.seed, args), model=label))
    print(format_table(rows))
    print()
    print(format_costs(rows))
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
        "replayed: mean / max |Δ logp|",
        "KL (k3) own / replayed",
        "rows = learner's experts",
        "ref: HF bf16 vs fp32 mean / max",
        "mean logp",
        "node start s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        replayed = (
            "-"
            if r.get("replay_mean_abs_diff") is None
            else (f"{r['replay_mean_abs_diff']:.4f} / {r['replay_max_abs_diff']:.4f}")
        )
        kl = f"{r['kl']:.5f} / " + ("-" if r.get("replay_kl") is None else f"{r['replay_kl']:.5f}")
        agree = "-" if r.get("rows_agree") is None else f"{r['rows_agree']:.3f}"
        lines.append(
            f"| {r['model']} | {r['architecture']} | {r['completions']} | {r['tokens']} | "
            f"{r['mean_abs_diff']:.4f} | {r['p99_abs_diff']:.4f} | {r['max_abs_diff']:.4f} | {replayed} | {kl} | "
            f"{agree} | {r['ref_mean_abs_diff']:.4f} / {r['ref_max_abs_diff']:.4f} | {r['mean_logp']:.3f} | "
            f"{r['node_s']:.0f} |"
        )
    return "\n".join(lines)


def format_costs(rows: list[dict]) -> str:
    """What recording and replaying routing costs, each beside its baseline."""

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = (
        "model",
        "routing B / position (base64)",
        "record B without / with routing",
        "ingest join events/s without / with",
        "update ms own / replayed / replayed + mismatch forward",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {num(r['routing_bytes_per_position'], '.2f')} "
            f"({num(r['routing_b64_per_position'], '.2f')}) | {r['record_bytes']:.0f} / "
            f"{num(r['record_bytes_routed'], '.0f')} | {r['ingest_eps']:.0f} / {num(r['ingest_eps_routed'], '.0f')} | "
            f"{r['update_ms']:.1f} / {r['update_ms_replay']:.1f} / {r['update_ms_replay_both']:.1f} |"
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


def sample(
    node_url: str, prompts: list[str], max_tokens: int, seed: int, key: str = "", routing: bool = False
) -> list[dict]:
    """One completion per prompt at temperature 1 from the node: prompt/completion token ids and vLLM's log-probs,
    and with ``routing`` the experts its router chose (read from the worker's capture as the gateway reads them)."""
    from liverl.bench.logprobs_routing import node_rpc

    def one(i: int) -> dict:
        body = {
            "request_id": f"bench{seed}x{i}",
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
            "prompt": prompts[i],
            "text": c["text"],
            "prompt_token_ids": c["prompt_token_ids"],
            "completion_token_ids": c["token_ids"],
            "logprobs": c["logprobs"]["token_logprobs"],
        }

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(len(prompts))))
    if routing:
        keys = [f"cmpl-bench{seed}x{i}-0" for i in range(len(prompts))]  # serving.node.gateway_routing.choice_key
        positions = [len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) - 1 for c in out]
        got = node_rpc(node_url, key, "liverl_routing", keys, positions)
        if not got.get("ok"):
            raise RuntimeError(f"the node's routing capture: {got.get('error')}")
        for k, c in zip(keys, out, strict=True):
            c["routing"] = got["routing"].get(k)
    return out


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
    kl = _k3(ours, samples)
    routed = [
        s.model_copy(update={"routed_experts": c.get("routing")}) for s, c in zip(samples, completions, strict=True)
    ]
    replay_cols = {"replay_mean_abs_diff": None, "replay_max_abs_diff": None, "replay_kl": None, "rows_agree": None}
    replayer = PolicyTrainer(model_dir, LearnerConfig(routing_replay="rollout"))
    if replayer.routing is not None and all(s.routed_experts for s in routed):
        refused = [r for s in routed if (r := replayer.refusal(s))]
        if refused:
            raise RuntimeError(f"the node's routing does not fit the model: {refused[:3]}")
        theirs = replayer.token_logprobs(routed)
        rd = [
            abs(a - b)
            for s, lp in zip(routed, theirs, strict=True)
            for a, b in zip(lp, s.behaviour_logprobs, strict=True)
        ]
        replay_cols.update(
            replay_mean_abs_diff=sum(rd) / len(rd), replay_max_abs_diff=max(rd), replay_kl=_k3(theirs, routed)
        )
        replay_cols["rows_agree"] = _rows_agree(model_dir, replayer.pad_id, routed)
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
        "kl": kl,
        **replay_cols,
        "samples": routed,
    }


def _k3(logps: list[list[float]], samples: list[TrainingSample]) -> float:
    """Mean per token of the k3 KL terms ``exp(d) - 1 - d``, ``d`` = learner's log-prob - behaviour's."""
    import math

    terms = [
        math.expm1(a - b) - (a - b)
        for s, lp in zip(samples, logps, strict=True)
        for a, b in zip(lp, s.behaviour_logprobs, strict=True)
    ]
    return sum(terms) / len(terms)


def _rows_agree(model_dir: Path, pad_id: int, samples: list[TrainingSample]) -> float:
    """The share of (position, MoE layer) rows where vLLM's experts are the learner's own (bf16, as vLLM runs)."""
    import numpy as np
    import torch

    from core import routing
    from learner import replay, replay_own
    from learner.model import load_model

    model = load_model(model_dir, dtype=torch.bfloat16)
    own = replay_own.routing_of(model, samples, pad_id)
    same = total = 0
    for s, w in zip(samples, own, strict=True):
        n = replay.positions(s)
        a = np.sort(routing.decode(routing.from_text(s.routed_experts), positions=n), -1)
        b = np.sort(routing.decode(routing.from_text(w), positions=n), -1)
        agree = (a == b).all(-1)
        same, total = same + int(agree.sum()), total + agree.size
    return same / total


def measure(
    model_dir: Path, n_prompts: int, max_tokens: int, seed: int, args: argparse.Namespace | None = None
) -> dict:
    """Serve ``model_dir`` on a fresh vLLM node with its routing capture, sample, stop the node, compare; with
    ``args``, also what routing costs (``liverl.bench.logprobs_routing``)."""
    from liverl.bench import logprobs_routing as costs
    from serving.agent.launch import start_node

    model_dir = Path(model_dir).resolve()
    prompts = chat_prompts(model_dir, n_prompts, seed)
    with tempfile.TemporaryDirectory(prefix="liverl-bench-logprobs-") as tmp:
        cfg = load_config(env={}, state_dir=tmp, serving__vllm_port=_free_port(), serving__record_routing=True)
        node = start_node(cfg, model_dir, Path(tmp) / "vllm.log")
        try:
            started = costs.node_rpc(node.url, node.key, "liverl_routing_start")
            moe = bool(started.get("ok"))
            if not moe and "no MoE layer" not in str(started.get("error")):
                raise RuntimeError(f"the node's routing capture did not start: {started.get('error')}")
            completions = sample(node.url, prompts, max_tokens, seed, key=node.key, routing=moe)
        finally:
            node.stop()
    out = dict(compare(model_dir, completions), node_s=round(node.start_s, 1))
    samples = out.pop("samples")
    if args is not None:
        out.update(costs.record_sizes(completions))
        out.update(costs.ingest_rates(completions, args.redis, args.pairs, args.rounds))
        out.update(costs.update_times(model_dir, samples, args.batch, args.steps))
    return out


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
