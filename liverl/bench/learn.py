"""``liverl bench learn``: tokens/s and samples/s of the learner's update path against a plain transformers loop.

Both sides train the same model (loaded from the same dir) on the same generated samples in the same order, with
the same maths per update:

- learner: ``learner.policy_trainer.PolicyTrainer.train_step`` (what ``liverl learn`` and ``learner.dist_check``
  run): per-token log-probs of the completion tokens, the PG loss with its off-policy correction (truncated IS,
  masked IS) and the full KL to the frozen reference, backward, global grad-norm clip 1.0, AdamW.
- plain: what a user writes with transformers alone: right-padded batch, ``model(...).logits`` ->
  ``log_softmax`` over every position -> ``gather`` of the next tokens, the same REINFORCE-style loss written out
  in torch (importance weights, the sequence mask, the full KL to a frozen copy), ``backward``,
  ``clip_grad_norm_``, ``torch.optim.AdamW.step``. Only the advantages (a leave-one-out baseline per segment, host
  side, O(batch)) come from ``learner.loss.advantages``, so that the two losses can be compared exactly.

Samples are those of ``learner.dist_check``: random prompts and completions whose behaviour log-probs are the
starting policy's own, rewards +0.75 / -0.25. Both sides start from the same weights; the loss and gradient norm of
their first two (untimed) updates must agree (checked, ``--tol``; the second one, after an AdamW step, covers the KL
term, which is 0 at the reference), which is what makes the speeds comparable. Each round then runs ``--steps``
timed updates of each side over the same batches, the two sides alternating update by update (the learner's update
of batch i, the plain loop's of batch i, then batch i+1; the order flips every round), so that a neighbour's burst
on the shared box falls on both sides of a pair, not on one side's whole block; tokens are real tokens (prompt +
completion, no padding). On CPU each side runs on ``--threads`` threads
(the learner's own setting is 1: the box is shared with vLLM and ingest). The ratio is the median over rounds of
the plain side's time over the learner's (same batches, alternating). ``--profile`` prints torch.profiler's
top 10 operators (self CPU time) of one update of each side. ``--device cuda`` runs the learner as ``liverl learn``
does on a GPU (FSDP2 over a group of one, NCCL) and the plain loop on the same GPU, each step timed to a synchronize.

Models: ``demo`` (the demo's base policy) and any size of ``learner.dist_check.SIZES`` (a generated Qwen3-MoE;
``moe24m`` is the issue's >= 20M-parameter model).

``--drift 3e-4,1e-6`` measures something else: what each learning rate does to the gate's drift check. The learner
alone trains each model from its base, ``--drift-steps`` updates on fresh on-policy samples per rate, and after
updates 1, 2, 5, 10, ... prints the mean per-token KL(policy || base) over the vocabulary on held-out samples (the
measure of ``learner.evaluate.PolicyEvaluator.drift``) against ``gate.max_kl``: how many updates a candidate may carry
before the gate refuses it for drift.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from core.config import GateConfig, LearnerConfig, load_config
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {
    "models": ["demo", "moe24m"],
    "rounds": 4,
    "steps": None,
    "warmup": 1,
    "batch": 16,
    "seed": 0,
    "lr": 1e-4,
    "threads": 1,
    "tol": 1e-4,
}
SPANS = {  # (prompt MIN-MAX, completion MIN-MAX) per model when --prompt-len / --completion-len are not given
    "demo": ((6, 20), (2, 5)),  # the demo task: short prompts, completions of at most task.MAX_TOKENS=5; 32 positions
    "default": ((16, 96), (8, 32)),
}
STEPS = {"demo": 20, "default": 4}  # timed updates per side per round without --steps: a demo update takes ~50 ms
COLUMNS = (
    "model",
    "params M",
    "side",
    "batch",
    "timed steps",
    "s/step (median)",
    "tokens/s",
    "tokens/s min-max",
    "samples/s",
    "learner / plain (median, min-max of rounds)",
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``learn`` under the ``liverl bench`` subcommands."""
    p = add_bench_parser(
        subparsers,
        "learn",
        "learner update path vs a plain transformers loop: tokens/s, samples/s",
        __doc__,
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=DEFAULTS["models"],
        metavar="MODEL",
        help="'demo', a generated size (tiny, moe24m, moe400m) or a model dir (default: demo moe24m)",
    )
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="alternating rounds of both sides")
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULTS["steps"],
        help="timed updates per side per round (default: 20 on the demo model, 4 on others)",
    )
    p.add_argument(
        "--warmup", type=int, default=DEFAULTS["warmup"], help="untimed updates per side after the first (checked) one"
    )
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="samples per update")
    p.add_argument("--prompt-len", metavar="MIN-MAX", help="prompt tokens (default: per model, see SPANS)")
    p.add_argument("--completion-len", metavar="MIN-MAX", help="completion tokens (default: per model)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="AdamW learning rate of both sides")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="the samples' seed")
    p.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="torch CPU threads of both sides")
    p.add_argument(
        "--tol",
        type=float,
        default=DEFAULTS["tol"],
        help="relative tolerance on the untimed updates' loss and grad norm, learner vs plain",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "liverl-dist-check",
        help="where generated models are built (shared with learner.dist_check)",
    )
    p.add_argument("--cache", type=Path, help="where the demo policy is built (default: the config's model cache)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the learner runs as in `liverl learn` on a GPU (FSDP2 over a group of one, NCCL); the "
        "plain loop on the same GPU",
    )
    p.add_argument(
        "--transformers-forward",
        action="store_true",
        help="the learner side through transformers' forward (learner.fast_forward = false), to see what "
        "learner/fastpath.py saves",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="the learner side with learner.compile (its forward under torch.compile; the untimed first updates "
        "compile it, and the table's note says how long that took)",
    )
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top 10 of one step per side")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--drift", metavar="LR,LR", help="instead: KL from the base after N updates at each learning rate")
    p.add_argument("--drift-steps", type=int, default=20, help="updates per learning rate with --drift")
    p.set_defaults(fn=run)
    return p


def _span(text: str | None, flag: str) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(v) for v in text.split("-"))
    except ValueError:
        raise ValueError(f"{flag} must be MIN-MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{flag} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def command_line(args: argparse.Namespace) -> str:
    """The ``liverl bench learn`` command that reproduces ``args``."""
    parts = ["liverl", "bench", "learn"]
    if list(args.models) != DEFAULTS["models"]:
        parts += ["--models", *args.models]
    for key in ("rounds", "steps", "warmup", "batch", "lr", "seed", "threads", "tol"):
        if getattr(args, key) != DEFAULTS[key]:
            parts += ["--" + key, str(getattr(args, key))]
    for key in ("prompt_len", "completion_len"):
        if getattr(args, key) is not None:
            parts += ["--" + key.replace("_", "-"), getattr(args, key)]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if getattr(args, "transformers_forward", False):
        parts.append("--transformers-forward")
    if getattr(args, "compile", False):
        parts.append("--compile")
    if args.profile:
        parts.append("--profile")
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """Measure every model, print the table and the command that reproduces it."""
    for key in ("rounds", "steps", "batch", "threads"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise ValueError(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0 or not args.tol > 0 or not args.lr > 0:
        raise ValueError("--warmup must be >= 0, --tol and --lr > 0")
    spans = (_span(args.prompt_len, "--prompt-len"), _span(args.completion_len, "--completion-len"))
    if args.drift:
        return run_drift(args, spans)
    rows, profiles = [], []
    ranks = None
    if args.device == "cuda":
        from learner import dist as ldist

        ranks = ldist.setup("nccl")
    try:
        for name in args.models:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            res = measure(resolve_model(name, args), name, args, spans, ranks)
            rows += res["rows"]
            profiles += res["profiles"]
    finally:
        if ranks is not None:
            ldist.teardown()
    print(format_table(rows))
    for r in rows:
        if r["side"] == "learner":
            print(
                f"first update, {r['model']}: loss learner {r['loss_learner']:.6g} plain {r['loss_plain']:.6g}; "
                f"grad norm learner {r['gnorm_learner']:.6g} plain {r['gnorm_plain']:.6g}; "
                f"{r['padded_frac']:.0%} of the padded batch is padding; {r['device']}, {r['threads']} CPU thread(s); "
                f"the learner's untimed calls took {r['warmup_s']:.1f} s"
                + (" (compiling)" if getattr(args, "compile", False) else "")
            )
    for title, table in profiles:
        print(f"\n{title}\n{table}")
    print(f"\ncommand: {command_line(args)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def run_drift(args: argparse.Namespace, spans) -> int:
    """``--drift``: the KL from the base after 1, 2, 5, 10, ... updates at each learning rate, per model."""
    import torch

    from learner.dist_check import make_samples, on_policy
    from learner.loss import full_kl
    from learner.policy_trainer import PolicyTrainer

    try:
        lrs = [float(x) for x in args.drift.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--drift takes learning rates separated by commas, e.g. 3e-4,1e-6; got {args.drift!r}"
        ) from None
    if not lrs or any(not lr > 0 for lr in lrs) or args.drift_steps < 1:
        raise ValueError("--drift needs learning rates > 0 and --drift-steps >= 1")
    max_kl = GateConfig().max_kl
    marks = sorted(
        m for m in {1, 2, 5, *range(10, args.drift_steps + 1, 10), args.drift_steps} if m <= args.drift_steps
    )
    out = [
        f"| model | lr | {' | '.join(f'KL after {m}' for m in marks)} | updates until KL > gate.max_kl {max_kl:g} |",
        "|---|---|" + "---|" * (len(marks) + 1),
    ]
    for name in args.models:
        model_dir = resolve_model(name, args)
        for lr in lrs:
            print(f"drift: {name} at lr {lr:g} ...", file=sys.stderr, flush=True)
            lcfg = LearnerConfig(lr=lr, batch_size=args.batch, micro_epochs=1, max_batch_tokens=1 << 30)
            tr = PolicyTrainer(model_dir, lcfg)
            torch.set_num_threads(args.threads)
            prompt, completion = SPANS["demo" if name == "demo" else "default"]
            prompt, completion = spans[0] or prompt, spans[1] or completion
            held = on_policy(tr, make_samples(32, args.seed + 10_000, tr.vocab_size, prompt, completion))
            x = tr._collate(held)
            kls, over = {}, None
            for step in range(1, args.drift_steps + 1):
                batch = make_samples(args.batch, args.seed + step, tr.vocab_size, prompt, completion)
                tr.train_step(on_policy(tr, batch))
                if step in marks or over is None:
                    with torch.no_grad():
                        _, lp = tr._token_logp(tr.model, x)
                        _, ref = tr._token_logp(tr.ref, x)
                        kl = float((full_kl(lp, ref) * x["mask_BT"]).sum() / x["mask_BT"].sum())
                    if step in marks:
                        kls[step] = kl
                    if over is None and kl > max_kl:
                        over = step
            cells = " | ".join(f"{kls[m]:.3g}" for m in marks)
            out.append(f"| {name} | {lr:g} | {cells} | {over if over is not None else f'> {args.drift_steps}'} |")
    print("\n".join(out))
    print(
        f"\ncommand: liverl bench learn --models {' '.join(args.models)} --drift {args.drift} "
        f"--drift-steps {args.drift_steps}"
    )
    return 0


def resolve_model(name: str, args: argparse.Namespace) -> Path:
    """The model dir for ``name``: the demo policy, a generated size, or a dir."""
    from learner.dist_check import SIZES, generate_model

    if name == "demo":
        from liverl.demo.base_policy import ensure_base_policy

        cache = args.cache
        if cache is None:
            cache = load_config().model_cache_path
        return ensure_base_policy(Path(cache), seed=0, progress=False)
    if name in SIZES:
        return generate_model(name, args.work)
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {name!r} is neither 'demo', a size ({', '.join(SIZES)}) nor a model dir")
    return path


def format_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})" if r["side"] == "learner" else ""
        lines.append(
            f"| {r['model']} | {r['params_M']:.2f} | {r['side']} | {r['batch']} | {r['timed_steps']} | "
            f"{r['s_per_step']:.4f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_min']:.0f}-"
            f"{r['tokens_per_s_max']:.0f} | {r['samples_per_s']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the plain loop


class PlainLoop:
    """The update a user writes with transformers and torch alone (see the module docstring). Right padding."""

    def __init__(self, model_dir: Path, lcfg, device):
        import torch
        from transformers import AutoModelForCausalLM

        self.lcfg, self.device = lcfg, device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).train()
        self.ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        self.ref.requires_grad_(False)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lcfg.lr, weight_decay=0.0)
        from learner.loss import RunningBaseline

        self.baseline = RunningBaseline()

    def train_step(self, samples) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        from learner.loss import DEFAULT_MASK_HI, DEFAULT_MASK_LO, advantages

        B = len(samples)
        L = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        comp = torch.zeros((B, L - 1))  # 1 where position i's logits predict a completion token (i + 1)
        beh = torch.zeros((B, L - 1))
        for b, s in enumerate(samples):
            P, C = len(s.prompt_token_ids), len(s.completion_token_ids)
            ids[b, : P + C] = torch.tensor(s.prompt_token_ids + s.completion_token_ids)
            attn[b, : P + C] = 1
            comp[b, P - 1 : P + C - 1] = 1.0
            beh[b, P - 1 : P + C - 1] = torch.tensor(s.behaviour_logprobs)
        ids, attn, comp, beh = (t.to(self.device) for t in (ids, attn, comp, beh))
        adv = advantages(torch.tensor([s.reward for s in samples]), [s.segment for s in samples], self.baseline).to(
            self.device
        )

        logprobs = F.log_softmax(self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), dim=-1)
        logp = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            ref_logprobs = F.log_softmax(self.ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), dim=-1)
            logratio = ((logp - beh) * comp).clamp(-20.0, 20.0)
            w = logratio.exp().clamp(max=self.lcfg.tis_cap)
            seq_ratio = (logratio.sum(1) / comp.sum(1)).exp()
            keep = ((seq_ratio >= DEFAULT_MASK_LO) & (seq_ratio <= DEFAULT_MASK_HI)).float()
        n = comp.sum()
        loss_pg = -(w * adv[:, None] * logp * keep[:, None] * comp).sum() / n
        kl = ((logprobs.exp() * (logprobs - ref_logprobs)).sum(-1) * comp).sum() / n
        loss = loss_pg + self.lcfg.kl_coef * kl
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return {"loss": float(loss.detach()), "grad_norm": float(gnorm), "kl": float(kl.detach())}


# ---------------------------------------------------------------------------------------------- one model


def measure(model_dir: Path, name: str, args: argparse.Namespace, spans, ranks=None) -> dict:
    """Both sides on ``model_dir``: rows for the table (learner row carries the ratio) and optional profiles."""
    import torch

    from learner.dist_check import make_samples, on_policy
    from learner.policy_trainer import PolicyTrainer

    lcfg = LearnerConfig(
        lr=args.lr,
        batch_size=args.batch,
        micro_epochs=1,
        max_batch_tokens=1 << 30,
        fast_forward=not getattr(args, "transformers_forward", False),
        compile=getattr(args, "compile", False),
    )
    learner = PolicyTrainer(model_dir, lcfg, ranks=ranks)
    plain = PlainLoop(model_dir, lcfg, learner.device)
    torch.set_num_threads(args.threads)  # after PolicyTrainer, which sets 1 for the shared box
    n_params = sum(p.numel() for p in learner.model.parameters())
    prompt, completion = SPANS["demo" if name == "demo" else "default"]
    prompt, completion = spans[0] or prompt, spans[1] or completion
    if prompt[1] + completion[1] > learner.max_len:
        raise ValueError(
            f"{name}: prompts up to {prompt[1]} + completions up to {completion[1]} tokens exceed the "
            f"model's {learner.max_len} positions; pass shorter --prompt-len / --completion-len"
        )
    steps = args.steps or STEPS["demo" if name == "demo" else "default"]
    n_batches = max(steps, 1 + args.warmup)
    t_warm = time.perf_counter()  # the learner's untimed calls (with --compile: where it compiles)
    samples = on_policy(
        learner, make_samples(n_batches * args.batch, args.seed, learner.vocab_size, prompt, completion)
    )
    warm_s = time.perf_counter() - t_warm
    batches = [samples[i * args.batch : (i + 1) * args.batch] for i in range(n_batches)]
    sides = {"learner": learner, "plain": plain}
    sync = torch.cuda.synchronize if learner.device.type == "cuda" else (lambda: None)

    untimed = {}  # both sides' untimed updates, from the same weights on the same batches
    for side, t in sides.items():
        t0 = time.perf_counter()
        untimed[side] = [t.train_step(batches[i % n_batches]) for i in range(1 + args.warmup)]
        if side == "learner":
            warm_s += time.perf_counter() - t0
    # The first update checks the PG part (at the reference the full KL and its gradient are 0); the second, after an
    # AdamW step, also checks the KL term.
    for i in range(min(2, 1 + args.warmup)):
        check_agreement(f"{name}, update {i + 1}", {s: u[i] for s, u in untimed.items()}, args.tol)
    first = {s: u[0] for s, u in untimed.items()}

    times = {s: [] for s in sides}  # per round: seconds per timed step
    tokens = {s: [] for s in sides}  # per round: real tokens trained
    for r in range(args.rounds):
        order = ("learner", "plain") if r % 2 == 0 else ("plain", "learner")
        for side in order:
            times[side].append([])
            tokens[side].append(0)
        for i in range(steps):  # the sides alternate update by update: a pair of updates sees the same box
            batch = batches[i]
            for side in order:
                sync()
                t0 = time.perf_counter()
                sides[side].train_step(batch)
                sync()
                times[side][-1].append(time.perf_counter() - t0)
                tokens[side][-1] += sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch)

    padded = sum(len(b) * max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in b) for b in batches)
    real = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
    rows = []
    for side in sides:
        secs = [sum(d) for d in times[side]]
        per_round = [tok / s for tok, s in zip(tokens[side], secs, strict=True)]
        rows.append(
            {
                "model": name,
                "params_M": n_params / 1e6,
                "side": side,
                "batch": args.batch,
                "timed_steps": args.rounds * steps,
                "s_per_step": statistics.median(x for d in times[side] for x in d),
                "tokens_per_s": sum(tokens[side]) / sum(secs),
                "tokens_per_s_min": min(per_round),
                "tokens_per_s_max": max(per_round),
                "samples_per_s": args.rounds * steps * args.batch / sum(secs),
            }
        )
    # The ratio pairs the two sides round by round (their updates alternated, under the same load from the rest of
    # the box) and takes the median round: one round slowed down by a neighbour does not decide it.
    paired = [sum(p) / sum(lt) for lt, p in zip(times["learner"], times["plain"], strict=True)]
    rows[0].update(
        ratio=statistics.median(paired),
        ratio_min=min(paired),
        ratio_max=max(paired),
        loss_learner=first["learner"]["loss"],
        loss_plain=first["plain"]["loss"],
        gnorm_learner=first["learner"]["grad_norm"],
        gnorm_plain=first["plain"]["grad_norm"],
        padded_frac=1 - real / padded,
        warmup_s=warm_s,
        threads=args.threads,
        model_dir=str(model_dir),
        device=torch.cuda.get_device_name() if learner.device.type == "cuda" else "cpu",
    )
    profiles = []
    if args.profile:
        for side, t in sides.items():
            profiles.append(
                (
                    f"torch.profiler, {name}, one {side} update: top 10 by self "
                    f"{'CUDA' if learner.device.type == 'cuda' else 'CPU'} time",
                    profile_step(t, batches[0]),
                )
            )
    return {"rows": rows, "profiles": profiles}


def check_agreement(name: str, first: dict[str, dict], tol: float) -> None:
    """The two sides' update (same weights, same batch) must give the same loss, gradient norm and KL."""
    for key in ("loss", "grad_norm", "kl"):
        a, b = first["learner"][key], first["plain"][key]
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > tol * max(abs(a), abs(b), 1e-3):
            raise AssertionError(
                f"{name}: the learner and the plain loop disagree on {key}: "
                f"{a!r} vs {b!r} (relative tolerance {tol}); they do not compute the same maths"
            )


def profile_step(trainer, batch) -> str:
    """torch.profiler's top 10 operators by self CPU time over one update."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=10)


def main(argv: list[str] | None = None) -> int:
    """``python -m liverl.bench.learn``: the same as ``liverl bench learn``."""
    ap = argparse.ArgumentParser(prog="liverl bench")
    add_parser(ap.add_subparsers(dest="bench", required=True))
    args = ap.parse_args(["learn", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
