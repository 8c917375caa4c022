"""The learner's update path over N ranks on generated samples: FSDP2, DCP checkpoints, tokens/s.

Run under torchrun (or alone, as a group of one)::

    torchrun --standalone --nproc-per-node 2 -m learner.dist_check --size tiny --steps 4 --backend gloo

Each update is ``PolicyTrainer.train_step`` (the learner's own code: per-token log-probs, the off-policy corrected
PG loss with its KL term, backward, global grad-norm clip, AdamW) on a batch that every rank receives whole and
trains its share of (``learner.dist``). Samples are generated from ``--seed``: random prompts and completions whose
behaviour log-probs are the starting policy's own (on-policy at step 0), rewards +0.75 / -0.25. The same seed gives
the same samples in the same order for any number of ranks, which is what the gloo tests compare.

``--model DIR`` trains an existing model dir; ``--size`` generates a Qwen3-MoE dir of a named size into
``--work`` (random bf16 weights, no tokenizer: the update path needs none). ``--ckpt-every K`` writes a DCP
checkpoint every K updates; ``--resume`` first loads the latest complete one; ``--save-weights FILE`` writes the
final fp32 weights (file names) from rank 0. Rank 0 prints a table with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from core.config import LearnerConfig
from core.schemas import TrainingSample
from learner import dist as ldist
from learner.families import FAMILIES
from learner.model import _seeded, state_dict_from_model
from learner.policy_trainer import PolicyTrainer

SIZES: dict[str, dict] = {
    # ~0.1M parameters: the gloo tests on 2 CPU cores
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "intermediate_size": 128,
        "vocab_size": 512,
    },
    # ~24M parameters: the "generated MoE of at least 20M parameters"
    "moe24m": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "intermediate_size": 1024,
        "vocab_size": 8192,
    },
    # ~0.4B parameters, 16 experts top-4: a GPU-sized step
    "moe400m": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 768,
        "intermediate_size": 2816,
        "vocab_size": 32000,
    },
}


def generate_model(size: str, out: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE model dir of ``size`` (config.json + model.safetensors, bf16), built once per size and seed."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
    out = Path(out) / f"qwen3_moe-{size}-s{seed}"
    if (out / "model.safetensors").is_file():
        return out
    spec = SIZES[size]
    config = Qwen3MoeConfig(
        **spec,
        max_position_embeddings=4096,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        initializer_range=0.02,
    )
    config.architectures = [FAMILIES["qwen3_moe"].architecture]
    config.dtype = "bfloat16"
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.liverl_family = FAMILIES["qwen3_moe"]
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    save_file(
        state_dict_from_model(model, dtype=torch.bfloat16), str(tmp / "model.safetensors"), metadata={"format": "pt"}
    )
    try:
        os.replace(tmp, out)
    except OSError:  # another process built it at the same time: keep theirs
        if not (out / "model.safetensors").is_file():
            raise

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_samples(n: int, seed: int, vocab: int, prompt_len: tuple[int, int], completion_len: tuple[int, int]):
    """``n`` valid TrainingSamples from ``seed`` (behaviour log-probs filled in later by ``on_policy``)."""
    rng = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        P, C = rng.randint(*prompt_len), rng.randint(*completion_len)
        ok = rng.random() < 0.5
        out.append(
            TrainingSample(
                sample_id=f"s{seed}-{i}",
                generation_id=f"g{seed}-{i}",
                feedback_id=f"f{seed}-{i}",
                policy_version=0,
                kind="accept" if ok else "reject",
                reward=0.75 if ok else -0.25,
                segment=f"seg{i % 3}",
                prompt_token_ids=[rng.randrange(2, vocab) for _ in range(P)],
                completion_token_ids=[rng.randrange(2, vocab) for _ in range(C)],
                behaviour_logprobs=[-1.0] * C,
                ts_generation=now,
                ts_feedback=now,
            )
        )
    return out


def on_policy(trainer, samples, chunk: int = 16):
    """The samples with the trainer's current per-token log-probs as their behaviour (a collective)."""
    out = []
    for i in range(0, len(samples), chunk):
        part = samples[i : i + chunk]
        lps = trainer.token_logprobs(part)
        out += [
            s.model_copy(update={"behaviour_logprobs": [min(x, 0.0) for x in lp]})
            for s, lp in zip(part, lps, strict=True)
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m learner.dist_check", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="an existing model dir (else --size generates one)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "liverl-dist-check",
        help="where generated models go",
    )
    ap.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with CUDA, else gloo")
    ap.add_argument("--steps", type=int, default=4, help="updates to run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=0, help="updates run first and not timed")
    ap.add_argument("--batch", type=int, default=8, help="samples per update")
    ap.add_argument("--prompt-len", default="8-16", help="prompt tokens, MIN-MAX")
    ap.add_argument("--completion-len", default="4-12", help="completion tokens, MIN-MAX")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="the samples' seed")
    ap.add_argument("--model-seed", type=int, default=0, help="the generated model's seed")
    ap.add_argument("--ckpt", type=Path, help="DCP checkpoint folder")
    ap.add_argument("--ckpt-every", type=int, default=0, help="write a checkpoint every K updates (0: never)")
    ap.add_argument("--resume", action="store_true", help="load the latest complete checkpoint in --ckpt first")
    ap.add_argument("--save-weights", type=Path, help="rank 0 writes the final fp32 weights here (safetensors)")
    ap.add_argument("--json", type=Path, help="rank 0 writes the measured numbers here")
    ap.add_argument(
        "--experts",
        choices=("eager", "grouped_mm", "batched_mm"),
        help="transformers' MoE experts kernel (default: transformers' choice)",
    )
    args = ap.parse_args(argv)
    if args.ckpt_every and args.ckpt is None:
        ap.error("--ckpt-every needs --ckpt")
    span = [tuple(int(v) for v in a.split("-")) for a in (args.prompt_len, args.completion_len)]
    if any(len(s) != 2 or not 1 <= s[0] <= s[1] for s in span):
        ap.error("--prompt-len and --completion-len are MIN-MAX with 1 <= MIN <= MAX")

    ranks = ldist.setup(args.backend)
    try:
        model_dir = args.model
        if model_dir is None:
            if ranks.main:
                model_dir = generate_model(args.size, args.work, seed=args.model_seed)
            model_dir = ldist.broadcast(model_dir, ranks)
        lcfg = LearnerConfig(lr=args.lr, batch_size=args.batch, micro_epochs=1, max_batch_tokens=1 << 30)
        trainer = PolicyTrainer(model_dir, lcfg, ranks=ranks)
        if args.experts:
            for m in (trainer.model, trainer.ref):
                m.set_experts_implementation(args.experts)
        n_params = sum(p.numel() for p in trainer.model.parameters())  # DTensor numel is the global size
        vocab = trainer.vocab_size
        total = args.warmup + args.steps
        samples = on_policy(trainer, make_samples(total * args.batch, args.seed, vocab, *span))
        ckpts = ldist.CheckpointDir(args.ckpt, ranks) if args.ckpt is not None else None
        step = 0
        if args.resume and ckpts is not None:
            meta = ckpts.load(trainer.model, trainer.opt)
            if meta is not None:
                step = int(meta["step"])
                trainer.baseline.load_state_dict(meta["baseline"])
        times, tokens, scatter = [], 0, []
        while step < total:
            t_s = time.perf_counter()  # as in ``liverl learn``: rank 0 reads the batch and sends it to every rank
            batch = ldist.broadcast(samples[step * args.batch : (step + 1) * args.batch] if ranks.main else None, ranks)
            t_s = time.perf_counter() - t_s
            if ranks.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.train_step(batch)
            if ranks.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step += 1
            if step > args.warmup:
                times.append(dt)
                scatter.append(t_s)
                tokens += sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch)
            if ckpts is not None and args.ckpt_every and step % args.ckpt_every == 0:
                ckpts.save(
                    step, trainer.model, trainer.opt, {"baseline": trainer.baseline.state_dict(), "loss": m["loss"]}
                )
            if ranks.main:
                print(
                    f"step {step}: loss {m['loss']:.5f} kl {m['kl']:.5f} grad_norm {m['grad_norm']:.4f} in {dt:.3f}s",
                    flush=True,
                )
        weights = trainer.weights(torch.float32) if args.save_weights is not None else None
        if ranks.main:
            if weights is not None:
                args.save_weights.parent.mkdir(parents=True, exist_ok=True)
                save_file(weights, str(args.save_weights))
            report(args, argv, ranks, n_params, times, tokens, scatter)
        ldist.teardown(barrier=True)
        return 0
    finally:
        ldist.teardown()


def report(args, argv, ranks, n_params: int, times: list[float], tokens: int, scatter: list[float]) -> None:
    secs = sum(times)
    dev = torch.cuda.get_device_name(ranks.device) if ranks.device.type == "cuda" else "cpu"
    row = {
        "ranks": ranks.world,
        "experts": args.experts or "default",
        "backend": ranks.backend,
        "device": dev,
        "params_M": round(n_params / 1e6, 2),
        "batch": args.batch,
        "timed_steps": len(times),
        "s_per_step": round(secs / len(times), 4) if times else None,
        "tokens_per_s": round(tokens / secs, 1) if secs else None,
        "samples_per_s": round(len(times) * args.batch / secs, 2) if secs else None,
        "scatter_ms_per_step": round(1000 * sum(scatter) / len(scatter), 2) if scatter else None,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2))
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    given = argv if argv is not None else sys.argv[1:]
    print(
        f"reproduce: torchrun --standalone --nproc-per-node {ranks.world} -m learner.dist_check "
        + " ".join(shlex.quote(a) for a in given)
    )


if __name__ == "__main__":
    sys.exit(main())
