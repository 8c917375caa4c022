"""The `liverl bench` group: the codec benchmark's subcommand here, every other benchmark's from its module.

The benchmark modules import their heavy dependencies when they run, so building the parser stays light.
"""

from __future__ import annotations

import argparse

from liverl.bench import broker as bench_broker
from liverl.bench import canary as bench_canary
from liverl.bench import forget as bench_forget
from liverl.bench import ingest as bench_ingest
from liverl.bench import learn as bench_learn
from liverl.bench import logprobs as bench_logprobs
from liverl.bench import routers as bench_routers
from liverl.bench import serve as bench_serve
from liverl.bench import swap as bench_swap
from liverl.bench.subcommand import add_bench_parser
from liverl.cliargs import cfg_from_args

BENCH_DELTA_HELP = """\
Benchmark the weight-delta codec (deploy.registry.delta) on realistic RL updates and print one row per case:

  demo lr=L every N     the demo policy -> itself after N AdamW steps at learning rate L (N = 1, 10, 50;
                        L = 1e-6, 3e-6, 1e-5; causal-LM loss on random tokens, weights in bf16)
  synthetic G GiB P%    a >= G GiB bf16 model -> one Adam-like step (lr * sign) on its fp32 master,
                        lr chosen so that P% of the elements change (P = 1, 2, 5)

Columns (a ratio is raw bytes / compressed bytes; higher is better):
  changed        fraction of elements whose bits differ between base and target
  raw            size of the target's weights
  liverl         the codec: raw / len(encode_delta(base, target)), header and checksums included
  zstd           plain zstd level 3 of the target's bytes (what shipping full weights costs)
  xor+zstd       zstd level 3 of base XOR target (the obvious delta, without byte planes)
  order-0 bound  raw bits / (n*H2(k/n) + k*H(xor)): which k of n elements changed, plus the empirical
                 entropy of the changed elements' XOR values (one 16-bit symbol each)
  cond. bound    the same within each group of elements sharing the base's exponent field, summed: what
                 a coder that conditions on the base element's exponent could reach
  liverl vs xor+zstd   how many times smaller the codec's delta is than xor+zstd
  liverl vs order-0    order-0 bound bytes / codec bytes (1.0 = at the bound; above 1 = beats it)
  encode GB/s    raw bytes / seconds of encode_delta
  apply GB/s     raw bytes / seconds of decoding and applying the delta to a copy of the base
                 (apply_delta_inplace: container and whole-base verification, decode, apply, verify)
  peak RSS       the most anonymous resident memory above the level before the call, sampled every
                 2 ms, during encode / during decode-apply: the codec's working memory
  delta          bytes of the encoded delta

Every decoded result is checked bit-exact against the target (the command fails if not). The command that
reproduces the table and the machine are printed under it. Takes a few minutes with the 1 GiB model.
"""


def cmd_bench_delta(args: argparse.Namespace) -> int:
    from liverl.bench.delta import run

    cfg = cfg_from_args(args)
    command = "liverl bench delta" + "".join(
        [
            f" --synthetic-gb {args.synthetic_gb:g}" if args.synthetic_gb != 1.0 else "",
            " --skip-demo" if args.skip_demo else "",
            " --skip-synthetic" if args.skip_synthetic else "",
            f" --repeat {args.repeat}" if args.repeat != 1 else "",
        ]
    )
    run(
        cache_dir=cfg.model_cache_path,
        seed=cfg.model.seed,
        synthetic_gb=args.synthetic_gb,
        skip_demo=args.skip_demo,
        skip_synthetic=args.skip_synthetic,
        repeat=args.repeat,
        json_path=args.json,
        command=command,
    )
    return 0


def register(sub) -> None:
    """Add `bench` and its benchmarks to the `liverl` subcommands."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks that print a table: delta (the codec), serve (gateway vs "
        "vLLM node), routers (kill -9 of a router behind HAProxy vs alone), logprobs (learner vs vLLM per model "
        "family), ingest (workers vs a raw consumer), canary (the sequential test), learn (update time and drift), "
        "broker (the embedded broker's produce batcher)",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench.set_defaults(fn=lambda _args: bench.print_help() or 2)
    add_delta_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    bench_routers.add_parser(bench_sub)
    bench_swap.add_parser(bench_sub)
    bench_logprobs.add_parser(bench_sub)
    bench_ingest.add_parser(bench_sub)
    bench_canary.add_parser(bench_sub)
    bench_learn.add_parser(bench_sub)
    bench_broker.add_parser(bench_sub)
    bench_forget.add_parser(bench_sub)


def add_delta_parser(bench_sub) -> argparse.ArgumentParser:
    """Register ``delta`` under ``liverl bench``; its entry is here because the codec's module loads numpy and
    zstandard."""
    s = add_bench_parser(
        bench_sub, "delta", "delta codec: ratio vs zstd, xor+zstd and entropy bounds, speed, memory", BENCH_DELTA_HELP
    )
    s.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list of objects")
    s.add_argument(
        "--synthetic-gb",
        type=float,
        default=1.0,
        metavar="GB",
        help="GiB of bf16 weights in the synthetic model (default 1.0; needs about 4x that in RAM)",
    )
    s.add_argument("--skip-synthetic", action="store_true", help="only the demo-model cases (seconds, not minutes)")
    s.add_argument("--skip-demo", action="store_true", help="only the synthetic cases")
    s.add_argument(
        "--repeat", type=int, default=1, metavar="N", help="time each encode and apply N times, keep the best"
    )
    s.set_defaults(fn=cmd_bench_delta)
    return s
