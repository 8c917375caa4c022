"""The `liverl` subcommands that run the whole pipeline on this machine: demo, chaos and up.

Each command imports its heavy modules (the pipeline, torch, vLLM) when it runs, so building the parser stays light.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from liverl.cliargs import add_model_args, cfg_from_args, model_dir_for

if TYPE_CHECKING:
    from core.config import LiverlConfig

# what `liverl chaos` can kill (liverl.ops.chaos.KINDS; spelled here so --help does not import the pipeline)
KILL_KINDS = ("ingest", "learn", "gate", "serve", "vllm", "learn@checkpoint", "serve@swap")

CHAOS_HELP = """\
Prove the delivery claims: run the pipeline under the demo's simulated users and, for --duration seconds, kill -9
one process every --kill-every seconds (jittered): ingest, learn, gate, serve (gateway + agent), the vLLM node,
the learner in the middle of a checkpoint write, and the serving process in the middle of a hot-swap. Every kind
is hit in each shuffled round; the supervisor restarts what dies. Then the load stops, the learner is held, and
the run drains until `liverl audit` finds every acknowledged feedback event trained once, refused or dead-lettered
with its reason, and every node serving the stable version (by checksum). Exit code 1 otherwise.

--restarts N also restarts the whole pipeline N times under the load, as an operator restarting `liverl up` would:
the odd restarts stop it as Ctrl-C does, the even ones kill -9 every process it started at once (broker and its
storage, vLLM, every worker), and each time it comes back on the same state folder. --kill-every 0 kills nothing else.

  liverl chaos --duration 600 --kill-every 15 --summary out/chaos.json
  liverl chaos --duration 300 --kill-every 0 --restarts 3       # only whole-pipeline restarts

--hosts runs the pipeline on hosts of its own instead (one network namespace and address per host: broker, Redis,
PostgreSQL, serving nodes, routers behind HAProxy, gate, learner, ingest workers; needs root) and hits it with a
schedule of host losses (every process of a host killed with SIGKILL, the host back after a while) and partitions
(a host's link down for 30-120 s), each kind of host reached; then it prints one row per fault: requests that failed
at the front door (in flight on the lost host, or other), lost and trained twice (liverl audit), seconds for the fleet
to converge after the heal, and answers from a version the gate had not chosen. --duration, --kill-every,
--restarts and --kinds do not apply to it.

  liverl chaos --hosts --faults 32 --summary out/chaos-hosts.json        # the long schedule (a benchmark)
  liverl chaos --hosts --nodes 1 --ingest-workers 1 --fault loss:router-1 --fault cut:ingest-1:30
"""

UP_HELP = """\
Run the whole pipeline for your model on this machine until Ctrl-C: the embedded Kafka-compatible broker,
Redis (the local one, or a private one), the SQLite registry, then `serve` (vLLM + gateway + hot-swap agent),
`ingest`, `learn` and `gate` as supervised processes. It prints the OpenAI endpoint, how to send feedback
(SDK, HTTP, kcat) and where the logs and metrics are. State (registry, blobs, checkpoints, logs) stays in
--state-dir, so a second `liverl up` resumes where the first stopped (--fresh starts over).
A state dir and its Redis prefix (topics.prefix) are one deployment: another deployment's prefix is refused,
naming it; if that deployment is gone (its state dir deleted), `liverl release-prefix` frees the prefix (audited).

  liverl up --model ./my-moe --product my_product.liverl:PRODUCT

--model is a Hugging Face causal-LM directory (config.json, safetensors, tokenizer with a chat template) that
transformers and vLLM both load; an architecture family liverl does not handle yet is refused at start.
Without --model the built-in demo policy is served.
"""


def cmd_demo(args: argparse.Namespace) -> int:
    from liverl.demo.run import run_demo

    cfg = demo_config(args)
    summary = run_demo(cfg, model_dir_for(cfg), summary_path=args.summary, plot_path=args.plot, live=not args.no_live)
    return 0 if summary.get("ok", False) or not args.strict else 1


def demo_config(args: argparse.Namespace) -> LiverlConfig:
    """The config `liverl demo` runs: the file's and the environment's, with the demo's flags applied (the demo's
    profile fills in the rest, ``liverl.demo.run.apply_demo_profile``)."""
    cfg = cfg_from_args(args)
    if args.duration is not None:
        cfg.demo.duration_s = args.duration
    if args.users is not None:
        cfg.demo.users = args.users
    if args.concurrency is not None:
        cfg.demo.concurrency = args.concurrency
    if args.trap is not None:
        cfg.demo.trap = args.trap == "on"
    if args.chase_accepts is not None:
        cfg.ingest.train_reverts = args.chase_accepts == "off"
    if args.integrity_only:
        cfg.gate.integrity_only = True
    return cfg


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.hosts:
        return cmd_chaos_hosts(args)
    from liverl.ops.chaos import run_chaos

    cfg = cfg_from_args(args)
    cfg.learner.max_batch_wait_s = min(cfg.learner.max_batch_wait_s, 5.0)  # the drain waits for partial batches
    summary = run_chaos(
        cfg,
        model_dir_for(cfg),
        duration_s=args.duration,
        kill_every_s=args.kill_every,
        seed=args.seed,
        drain_timeout_s=args.drain_timeout,
        summary_path=args.summary,
        kinds=tuple(args.kinds),
        restarts=args.restarts,
    )
    return 0 if summary["ok"] else 1


def cmd_chaos_hosts(args: argparse.Namespace) -> int:
    from liverl.bench.chaos_hosts import Fault, hosts_config, run_chaos_hosts

    one_host = {"duration": 600.0, "kill_every": 15.0, "restarts": 0, "kinds": list(KILL_KINDS)}
    set_here = [f"--{k.replace('_', '-')}" for k, v in one_host.items() if getattr(args, k) != v]
    if set_here:
        raise SystemExit(f"liverl chaos: {', '.join(set_here)} apply to the one-host run, not to --hosts")
    cfg = hosts_config(cfg_from_args(args), args.nodes)
    faults = [Fault.parse(f) for f in args.fault] if args.fault else None
    summary = run_chaos_hosts(
        cfg,
        model_dir_for(cfg),
        faults=faults,
        n_faults=args.faults,
        seed=args.seed,
        nodes=args.nodes,
        ingest=args.ingest_workers,
        concurrency=args.concurrency,
        warm_s=args.warm,
        gap_s=args.gap,
        drain_timeout_s=args.drain_timeout,
        summary_path=args.summary,
        command=chaos_hosts_command(args),
    )
    return 0 if summary["ok"] else 1


def chaos_hosts_command(args: argparse.Namespace) -> str:
    """The command line that reproduces a ``--hosts`` run (the table prints it)."""
    cmd = "liverl chaos --hosts"
    cmd += "".join(f" --fault {f}" for f in args.fault) if args.fault else f" --faults {args.faults} --seed {args.seed}"
    for flag, value, default in (
        ("--nodes", args.nodes, 2),
        ("--ingest-workers", args.ingest_workers, 2),
        ("--concurrency", args.concurrency, 8),
        ("--warm", args.warm, 30.0),
        ("--gap", args.gap, 10.0),
    ):
        cmd += f" {flag} {value:g}" if value != default else ""
    return cmd


def cmd_up(args: argparse.Namespace) -> int:
    from liverl.stack.up import run_up

    cfg = cfg_from_args(args)
    return run_up(cfg, model_dir_for(cfg), fresh=args.fresh)


def register(sub) -> None:
    """Add demo, chaos and up to the `liverl` subcommands."""
    _add_demo(sub)
    _add_chaos(sub)
    _add_up(sub)


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo",
        help="run the whole loop on the embedded stack with a live view",
        description="Start the embedded broker and Redis, build the base policy, run serving, ingest, learner "
        "and gate, drive simulated users against the gateway for --duration seconds, then print a summary "
        "and write it as JSON (--summary) and a PNG of live acceptance per version (--plot).",
    )
    d.add_argument("--duration", type=float, help="seconds to run (default: demo.duration_s = 600)")
    d.add_argument("--users", type=int, help="distinct simulated users, the population (default: demo.users = 5000)")
    d.add_argument(
        "--concurrency",
        type=int,
        help="simulated requests in flight at once, the traffic (default: demo.concurrency = 48)",
    )
    d.add_argument(
        "--trap",
        choices=("on", "off"),
        help="the reward-hacking trap: some users accept a tempting "
        "wrong answer and revert it later (default: demo.trap)",
    )
    d.add_argument(
        "--chase-accepts",
        choices=("on", "off"),
        help="on: reverts train no correction (ingest.train_reverts = false), so the learner chases raw acceptance, "
        "falls for the trap's bait and gives the gate exploiting candidates to catch; the gate's evidence is the "
        "same either way (default: off, unless config sets ingest.train_reverts)",
    )
    d.add_argument(
        "--integrity-only",
        action="store_true",
        help="cut the gate down to integrity checks: every "
        "candidate whose delta is sound goes live at once (gate.integrity_only), to see what the evidence "
        "checks are worth; compare with a default run",
    )
    d.add_argument(
        "--summary", metavar="PATH", help="write the summary JSON here (default: <state_dir>/demo/summary.json)"
    )
    d.add_argument(
        "--plot", metavar="PATH", help="write the acceptance plot here (default: <state_dir>/demo/acceptance.png)"
    )
    d.add_argument("--state-dir", help="state folder (default: state_dir = .liverl)")
    d.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    d.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 unless the run met its goals (>=3 promotions, +25 points on >=300 events each)",
    )
    add_model_args(d, product_help="product (default: the demo's, liverl.demo.product:PRODUCT)")
    d.set_defaults(fn=cmd_demo)


def _add_chaos(sub) -> None:
    c = sub.add_parser(
        "chaos",
        help="kill -9 every kind of process under the demo's load, then drain and audit",
        description=CHAOS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--duration", type=float, default=600.0, help="seconds of load and kills (default 600)")
    c.add_argument(
        "--kill-every", type=float, default=15.0, help="mean seconds between kills (default 15; 0: no single kills)"
    )
    c.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="also restart the whole pipeline N times, evenly spread, alternating Ctrl-C and kill -9 (default 0)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the kill schedule and the users (default 0)")
    c.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="seconds to wait after the load for the audit to come out clean (default 600)",
    )
    c.add_argument("--summary", metavar="PATH", help="write the summary JSON here")
    c.add_argument(
        "--kinds",
        nargs="+",
        default=list(KILL_KINDS),
        choices=KILL_KINDS,
        metavar="KIND",
        help=f"what to kill (default: all of {', '.join(KILL_KINDS)})",
    )
    c.add_argument("--state-dir", help="state folder (default: state_dir = .liverl; the run starts it fresh)")
    h = c.add_argument_group("faults between hosts (--hosts)")
    h.add_argument("--hosts", action="store_true", help="run the pipeline on hosts of its own and fault whole hosts")
    h.add_argument("--faults", type=int, default=16, help="faults in the generated schedule (default 16)")
    h.add_argument(
        "--fault",
        action="append",
        metavar="WHAT:HOST[:S]",
        help="an explicit fault instead of the schedule (repeat): loss:HOST or cut:HOST, S seconds down (default 30)",
    )
    h.add_argument("--nodes", type=int, default=2, help="serving nodes, each on its own host (default 2)")
    h.add_argument("--ingest-workers", type=int, default=2, help="ingest workers, each on its own host (default 2)")
    h.add_argument("--concurrency", type=int, default=8, help="simulated requests in flight at once (default 8)")
    h.add_argument("--warm", type=float, default=30.0, metavar="S", help="load before the first fault (default 30)")
    h.add_argument(
        "--gap", type=float, default=10.0, metavar="S", help="load after each fault's audit, before the next (10)"
    )
    add_model_args(c, product_help="product with simulated users (default: the demo's)")
    c.set_defaults(fn=cmd_chaos)


def _add_up(sub) -> None:
    u = sub.add_parser(
        "up",
        help="run the whole pipeline for your model on the embedded stack until Ctrl-C",
        description=UP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(u)
    u.add_argument("--state-dir", help="state folder (default: state_dir = .liverl)")
    u.add_argument(
        "--fresh",
        action="store_true",
        help="start from scratch: delete this state dir's registry, blobs, checkpoints and Redis keys (its "
        "deployment id stays, so the Redis prefix stays its own; a prefix still claimed by a deployment whose state "
        "dir was deleted is freed first with `liverl release-prefix`)",
    )
    u.set_defaults(fn=cmd_up)
