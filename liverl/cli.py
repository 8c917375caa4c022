"""The `liverl` command: one subcommand per process of the pipeline, plus the admin verbs.

This module parses arguments and loads config only; each subcommand imports its heavy modules
(torch, vLLM, aiokafka) when it runs, so `liverl --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from core.config import LiverlConfig, load_config, redact_url
from core.schemas import json_schemas
from core.services import (
    LiverlError,
    kafka_bootstrap,
    redis_from_url,
    redis_url,
    required_verify_key,
    setup_redis,
)
from liverl.bench import canary as bench_canary  # light: heavy imports happen when they run
from liverl.bench import ingest as bench_ingest
from liverl.bench import learn as bench_learn
from liverl.bench import logprobs as bench_logprobs
from liverl.bench import serve as bench_serve
from liverl.bench import swap as bench_swap

# what `liverl chaos` can kill (liverl.ops.chaos.KINDS; spelled here so --help does not import the pipeline)
KILL_KINDS = ("ingest", "learn", "gate", "serve", "vllm", "learn@checkpoint", "serve@swap")

DESCRIPTION = """\
liverl turns live product feedback (accept / reject / edit) into a better served model, safely.

The pipeline, one process each:
  serve    vLLM node + OpenAI-compatible gateway that logs every generation + hot-swap agent
  ingest   ingest worker: joins feedback with generations, dedupes, shapes rewards -> samples
  learn    continuous learner: policy-gradient micro-epochs on the MoE policy -> candidates
  gate     release gate: integrity, drift, collapse, product suite -> promote (the agents hot-swap)

Start here:
  liverl demo                 the whole loop on the embedded stack, ~10 minutes, with a live view
  liverl up --model DIR       the whole pipeline for your model, until Ctrl-C
  liverl status               what is served, what is pending, live acceptance per version
  liverl versions             every version with its lineage, delta size and gate verdict

Config: --config FILE (TOML) or $LIVERL_CONFIG, overridden by LIVERL__SECTION__FIELD env vars,
e.g. LIVERL__BROKER__BOOTSTRAP=kafka:9092 LIVERL__LEARNER__LR=1e-4. `liverl config` prints it all.
"""

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

ADMIN_EPILOG = (
    "The admin verbs read the registry (registry.url) and Redis (redis.url) named by the config. Verbs "
    "that change anything need an operator token ($LIVERL_TOKEN or --token-file; `liverl operator`) and "
    "a --reason; both land in the audit log, chained by HMAC with security.audit_key (`liverl history --verify`)."
)


def _cfg(args: argparse.Namespace) -> LiverlConfig:
    cfg = load_config(args.config)
    if getattr(args, "model", None):
        cfg.model.path = args.model
    if getattr(args, "product", None):
        cfg.product = args.product
    if getattr(args, "state_dir", None):
        cfg.state_dir = args.state_dir
    return cfg


def cmd_demo(args: argparse.Namespace) -> int:
    from liverl.demo.run import run_demo

    cfg = _cfg(args)
    if args.duration is not None:
        cfg.demo.duration_s = args.duration
    if args.users is not None:
        cfg.demo.users = args.users
    if args.concurrency is not None:
        cfg.demo.concurrency = args.concurrency
    if args.trap is not None:
        cfg.demo.trap = args.trap == "on"
    if args.integrity_only:
        cfg.gate.integrity_only = True
    summary = run_demo(cfg, model_dir_for(cfg), summary_path=args.summary, plot_path=args.plot, live=not args.no_live)
    return 0 if summary.get("ok", False) or not args.strict else 1


def cmd_chaos(args: argparse.Namespace) -> int:
    from liverl.ops.chaos import run_chaos

    cfg = _cfg(args)
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


def cmd_up(args: argparse.Namespace) -> int:
    from liverl.stack.up import run_up

    cfg = _cfg(args)
    return run_up(cfg, model_dir_for(cfg), fresh=args.fresh)


def cmd_hold(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_hold as run

    return run(_cfg(args), hold=not args.release, reason=args.reason, token=_token(args))


def model_dir_for(cfg: LiverlConfig):
    """The base model directory: ``model.path``, else the built-in demo policy (built once, then cached)."""
    if cfg.model.path:
        from learner.model import model_family

        path = Path(cfg.model.path).resolve()
        model_family(path)  # a family liverl does not translate yet is refused here, before anything starts
        return path
    from liverl.demo.base_policy import ensure_base_policy

    return ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed)


def _bound(cfg: LiverlConfig, role: str) -> None:
    """A pipeline process refuses to start on a Redis prefix another deployment claims than the one its registry
    belongs to (``liverl.stack.deployment.check_process``)."""
    import redis

    from liverl.stack.deployment import check_process

    url = redis_url(cfg)
    r = redis_from_url(url)  # connects only when the registry names a deployment to check
    try:
        check_process(cfg, r, role)
    except redis.RedisError as e:
        raise LiverlError(f"liverl {role}: cannot check the deployment's Redis namespace at {url}: {e}") from None
    finally:
        r.close()


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.agent.main import run_serving

    cfg = _cfg(args)
    _bound(cfg, "serve")
    required_verify_key(cfg)  # refused before the model is built or loaded (serving.agent.main.serve checks it too)
    run_serving(cfg, model_dir_for(cfg), kafka_bootstrap(cfg), redis_url(cfg), cfg.registry_url)
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    from serving.router.router import run_router

    cfg = _cfg(args)
    _bound(cfg, "route")
    run_router(cfg, redis_url(cfg), args.host or cfg.serving.host, args.port or cfg.serving.router_port)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from ingest.worker import run_worker

    cfg = _cfg(args)
    _bound(cfg, "ingest")
    return run_worker(cfg, kafka_bootstrap(cfg), redis_url(cfg))


def cmd_learn(args: argparse.Namespace) -> int:
    from learner.trainer import run_learner

    cfg = _cfg(args)
    _bound(cfg, "learn")
    model_dir = model_dir_for(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # finish the update, checkpoint, commit, exit
    run_learner(cfg, model_dir, stop_event=stop, max_steps=args.max_steps, metrics_port=args.metrics_port)
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from core.product import load_product
    from deploy.gate.gate import run_gate
    from learner.evaluate import PolicyEvaluator

    cfg = _cfg(args)
    _bound(cfg, "gate")
    model_dir, suite = model_dir_for(cfg), load_product(cfg).eval_suite()
    run_gate(
        cfg,
        lambda probes: PolicyEvaluator(model_dir, suite, probes, max_probes=cfg.gate.probe_generations),
        once=args.once,
    )
    return 0


def cmd_build_policy(args: argparse.Namespace) -> int:
    from liverl.demo.base_policy import ensure_base_policy

    cfg = _cfg(args)
    path = ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed if args.seed is None else args.seed)
    print(path)
    return 0


def cmd_bench_delta(args: argparse.Namespace) -> int:
    from liverl.bench.delta import run

    cfg = _cfg(args)
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


def cmd_status(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_status as run

    return run(_cfg(args))


def cmd_diff(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_diff as run

    return run(_cfg(args), args.a, args.b, top=args.top)


def cmd_oncall(args: argparse.Namespace) -> int:
    from liverl.ops.oncall import serve

    cfg = _cfg(args)
    return serve(cfg, args.host or cfg.serving.host, args.port, refresh_s=args.refresh)


def cmd_versions(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_versions as run

    return run(_cfg(args), limit=args.limit)


def cmd_history(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_history as run

    return run(_cfg(args), verify=args.verify)


def _token(args: argparse.Namespace) -> str | None:
    """The operator's token: --token-file, else $LIVERL_TOKEN."""
    if getattr(args, "token_file", None):
        return Path(args.token_file).read_text().strip()
    return os.environ.get("LIVERL_TOKEN")


def cmd_operator(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_operator as run

    return run(_cfg(args), args.action, args.name, args.role, args.reason, _token(args))


def cmd_promote(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_promote as run

    return run(_cfg(args), version=args.version, reason=args.reason, token=_token(args), force=args.force)


def cmd_rollback(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_rollback as run

    return run(_cfg(args), reason=args.reason, token=_token(args), to=args.to)


def cmd_rollout(args: argparse.Namespace) -> int:
    from liverl.ops.admin import cmd_rollout as run

    return run(_cfg(args), args.action, reason=args.reason, token=_token(args))


def cmd_gc(args: argparse.Namespace) -> int:
    from liverl.ops.admin import gc_command

    return gc_command(
        _cfg(args), dry_run=args.dry_run, grace_s=args.grace, token=_token(args), prune_rejected_s=args.prune_rejected
    )


def cmd_audit(args: argparse.Namespace) -> int:
    from deploy.registry.registry import open_registry
    from liverl.ops.audit import print_report, run_audit

    cfg = _cfg(args)
    r, registry = setup_redis(cfg), open_registry(cfg)
    try:
        rep = run_audit(cfg, kafka_bootstrap(cfg), r, registry)
    finally:
        r.close()
        registry.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print_report(rep)
    return 0 if not rep.problems() else 1


def cmd_lineage(args: argparse.Namespace) -> int:
    from deploy.registry.registry import open_registry
    from learner.ledger import checkpoint_path_for, ledger_path
    from liverl.ops.lineage import print_trace, trace

    cfg = _cfg(args)
    registry = open_registry(cfg)
    try:
        tr = trace(args.feedback_id, args.ledger or ledger_path(checkpoint_path_for(cfg)), registry)
    finally:
        registry.close()
    if args.json:
        print(json.dumps(tr, indent=2))
    else:
        print_trace(tr)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    schemas = json_schemas()
    print(json.dumps(schemas if args.name is None else schemas[args.name], indent=2))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The effective config as JSON; passwords in URLs and secrets are masked."""
    cfg = _cfg(args).model_dump(mode="json")
    for section, name in (("redis", "url"), ("registry", "url"), ("broker", "bootstrap")):
        cfg[section][name] = redact_url(cfg[section][name])
    print(json.dumps(cfg, indent=2))
    return 0


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
"""

AUDIT_HELP = """\
Reconcile a deployment's accounts: the feedback, generations, samples and dead-letter topics, the learner's
ledger (every sample it trained on or refused, beside its checkpoint), the live counters in Redis, the registry
and the serving nodes' heartbeats. Every acknowledged feedback event must end in exactly one place: trained
once, refused by the learner with a reason, dead-lettered with a reason, or dropped as not trainable; events
still queued or in flight are shown as such. Exit code 1 when anything is lost, trained twice, counted wrong,
or when the registry or the fleet disagree about the stable version.

Run it where the learner runs (it reads <state_dir>/learner), with the deployment's config:
  liverl audit --state-dir .liverl          # after `liverl up` / `liverl demo`
  liverl audit --json > audit.json
"""

UP_HELP = """\
Run the whole pipeline for your model on this machine until Ctrl-C: the embedded Kafka-compatible broker,
Redis (the local one, or a private one), the SQLite registry, then `serve` (vLLM + gateway + hot-swap agent),
`ingest`, `learn` and `gate` as supervised processes. It prints the OpenAI endpoint, how to send feedback
(SDK, HTTP, kcat) and where the logs and metrics are. State (registry, blobs, checkpoints, logs) stays in
--state-dir, so a second `liverl up` resumes where the first stopped (--fresh starts over).

  liverl up --model ./my-moe --product my_product.liverl:PRODUCT

--model is a Hugging Face causal-LM directory (config.json, safetensors, tokenizer with a chat template) that
transformers and vLLM both load; an architecture family liverl does not handle yet is refused at start.
Without --model the built-in demo policy is served.
"""


def _token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", metavar="FILE", help="file holding your operator token (default: $LIVERL_TOKEN)")


def _model_args(p: argparse.ArgumentParser, product_help: str | None = None) -> None:
    p.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face causal-LM directory to serve and train (default: model.path, else the built-in demo policy)",
    )
    p.add_argument(
        "--product",
        metavar="MODULE:ATTR",
        help=product_help
        or "your product's liverl interface "
        "(rewards, evaluation suite; default: product, else rewards from [ingest.rewards] and no suite)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="liverl", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (default: $LIVERL_CONFIG, else built-in defaults)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

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
    _model_args(d, product_help="product (default: the demo's, liverl.demo.product:PRODUCT)")
    d.set_defaults(fn=cmd_demo)

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
    _model_args(c, product_help="product with simulated users (default: the demo's)")
    c.set_defaults(fn=cmd_chaos)

    u = sub.add_parser(
        "up",
        help="run the whole pipeline for your model on the embedded stack until Ctrl-C",
        description=UP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(u)
    u.add_argument("--state-dir", help="state folder (default: state_dir = .liverl)")
    u.add_argument(
        "--fresh",
        action="store_true",
        help="start from scratch: delete this state dir's registry, blobs, checkpoints and Redis keys",
    )
    u.set_defaults(fn=cmd_up)

    for name, fn, text in [
        ("serve", cmd_serve, "run a vLLM node + gateway + hot-swap agent (serving.*)"),
        ("ingest", cmd_ingest, "run an ingest worker: the join of feedback with generations (ingest.*)"),
    ]:
        s = sub.add_parser(name, help=text, description=text)
        _model_args(s)
        s.set_defaults(fn=fn)
    s = sub.add_parser(
        "route",
        help="the fleet's front door: spread requests over the serving nodes, sticky per user",
        description="Route the OpenAI-compatible API (/v1/...) over the serving nodes serving.fleet "
        "names (node name -> gateway URL) whose heartbeat is live and healthy, sticky per user (X-Liverl-User header, the body's OpenAI 'user' field, or "
        "X-Session-Id; rendezvous hashing, so nodes joining or leaving move only their own users). A "
        "node that refuses connections is skipped and the request goes to the next one. Start one "
        "`liverl serve` per node, each with its own serving.node_name and ports. GET /fleet lists the "
        "nodes in rotation; GET /metrics has liverl_router_*.",
    )
    s.add_argument("--port", type=int, default=None, help="port (default serving.router_port, 8080)")
    s.add_argument("--host", default=None, help="address to bind (default serving.host)")
    s.set_defaults(fn=cmd_route)
    s = sub.add_parser("learn", help="run the continuous learner (learner.*)", description="run the continuous learner")
    s.add_argument("--max-steps", type=int, help="stop after this many updates")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics (liverl_learner_*) on this port")
    _model_args(s)
    s.set_defaults(fn=cmd_learn)
    s = sub.add_parser("gate", help="run the release gate (deploy.gate.gate)", description="run the release gate loop")
    s.add_argument("--once", action="store_true", help="process pending candidates once and exit")
    _model_args(s)
    s.set_defaults(fn=cmd_gate)
    s = sub.add_parser("build-policy", help="build (or find cached) the base policy and print its folder")
    s.add_argument("--seed", type=int, help="seed (default: model.seed)")
    s.set_defaults(fn=cmd_build_policy)

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print a table: delta (the codec), serve (gateway vs "
        "vLLM node), logprobs (learner vs vLLM per model family), ingest (workers vs a raw consumer), canary (the sequential test)",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench.set_defaults(fn=lambda _args: bench.print_help() or 2)
    s = bench_sub.add_parser(
        "delta",
        help="delta codec: ratio vs zstd, xor+zstd and entropy bounds, speed, memory",
        description=BENCH_DELTA_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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

    bench_serve.add_parser(bench_sub)
    bench_swap.add_parser(bench_sub)
    bench_logprobs.add_parser(bench_sub)
    bench_ingest.add_parser(bench_sub)
    bench_canary.add_parser(bench_sub)
    bench_learn.add_parser(bench_sub)

    s = sub.add_parser(
        "status", help="served version per node, pending candidates, live acceptance", epilog=ADMIN_EPILOG
    )
    s.set_defaults(fn=cmd_status)
    s = sub.add_parser(
        "diff",
        help="what changed between two versions: tensors, and the gate's evidence side by side",
        epilog=ADMIN_EPILOG,
        description="Rebuild versions A and B from the registry (checksum-verified) "
        "and list the tensors that differ (share of elements changed, largest change, relative L2 "
        "change), then each version's gate checks and live acceptance side by side.",
    )
    s.add_argument("a", type=int, help="version A (e.g. the stable version)")
    s.add_argument("b", type=int, help="version B (e.g. a candidate)")
    s.add_argument("--top", type=int, default=20, help="how many tensors to list, largest relative change first")
    s.set_defaults(fn=cmd_diff)
    s = sub.add_parser(
        "oncall",
        help="serve the on-call page: release, fleet, live acceptance, gate checks, audit",
        epilog=ADMIN_EPILOG,
        description="Serve a page for on-call, refreshed live: the stable version "
        "and whether every node serves it, versions and lineage, live acceptance by version (a chart), "
        "every gate check with its value, threshold and reason, and the audit log. Read-only (no token). "
        "GET /api/state has the same data as JSON.",
    )
    s.add_argument("--port", type=int, default=6068, help="port (default 6068; 0: any free port)")
    s.add_argument("--host", default=None, help="address to bind (default serving.host, loopback)")
    s.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS", help="page refresh interval (default 2)")
    s.set_defaults(fn=cmd_oncall)
    s = sub.add_parser("versions", help="list versions: lineage, status, delta size, gate scores", epilog=ADMIN_EPILOG)
    s.add_argument("--limit", type=int, default=20, help="most recent N versions (default 20)")
    s.set_defaults(fn=cmd_versions)
    s = sub.add_parser("history", help="the audit log: who promoted or rolled back what, and why", epilog=ADMIN_EPILOG)
    s.add_argument(
        "--verify",
        action="store_true",
        help="first check the log's chain (HMAC with security.audit_key) "
        "and its head anchored in Redis: exit 1 if an entry was rewritten, removed or added, or the tail cut",
    )
    s.set_defaults(fn=cmd_history)
    s = sub.add_parser(
        "promote", help="make VERSION the served version (the agents hot-swap to it)", epilog=ADMIN_EPILOG
    )
    s.add_argument("version", type=int)
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    _token_arg(s)
    s.add_argument("--force", action="store_true", help="promote even a version the gate rejected or has not judged")
    s.set_defaults(fn=cmd_promote)
    s = sub.add_parser(
        "rollback", help="serve the previous stable version again (or --to VERSION)", epilog=ADMIN_EPILOG
    )
    s.add_argument("--to", type=int, help="version to return to (default: the one before the current stable)")
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    _token_arg(s)
    s.set_defaults(fn=cmd_rollback)

    s = sub.add_parser(
        "hold",
        help="stop (or --release: resume) the learner emitting candidates; it keeps training",
        epilog=ADMIN_EPILOG,
    )
    s.add_argument("--release", action="store_true", help="let the learner emit candidates again")
    s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
    _token_arg(s)
    s.set_defaults(fn=cmd_hold)

    s = sub.add_parser(
        "operator",
        help="operator identities: add NAME --role R, disable NAME, list",
        epilog=ADMIN_EPILOG,
        description="Who may change the registry. Each operator has a role (viewer < operator < admin) "
        "and a token, shown once when added; only its hash is stored. The first operator of a registry "
        "is added without a token; after that, adding or disabling needs an admin token.",
    )
    s.add_argument("action", choices=["add", "disable", "list"])
    s.add_argument("name", nargs="?")
    s.add_argument("--role", default="operator", choices=["viewer", "operator", "admin"])
    s.add_argument("--reason", help="why (recorded in the audit log)")
    _token_arg(s)
    s.set_defaults(fn=cmd_operator)

    for action, text in (
        ("abort", "abort the canary in progress: reject it, its nodes return to stable"),
        ("pause", "pause the canary: it keeps its share of users but is not promoted"),
        ("resume", "resume a paused canary"),
    ):
        s = sub.add_parser(
            action,
            help=text,
            description=text + ". Needs an operator token and a reason (audited).",
            epilog=ADMIN_EPILOG,
        )
        s.add_argument("--reason", required=True, help="why (recorded in the audit log with who you are)")
        _token_arg(s)
        s.set_defaults(fn=cmd_rollout, action=action)
    s = sub.add_parser(
        "gc",
        help="delete snapshot/delta blobs that no version references",
        epilog=ADMIN_EPILOG,
        description="Delete blobs in the blob store that no registry version references (left by "
        "crashed writers or removed versions). Blobs younger than --grace are kept: a "
        "writer may be about to commit the version that references them. Use --dry-run "
        "first to see what would go.",
    )
    s.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    s.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="keep unreferenced blobs younger than this (default 3600)",
    )
    s.add_argument(
        "--prune-rejected",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also delete the deltas of rejected versions older than this whose descendants are all "
        "rejected (the rows, gate results and audit entries stay; such a version can no longer be "
        "rebuilt). A rejected version that a live version descends from is always kept",
    )
    _token_arg(s)
    s.set_defaults(fn=cmd_gc)

    s = sub.add_parser(
        "audit",
        help="where every feedback event went: trained once, refused or dead-lettered with a reason, or lost",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=AUDIT_HELP,
    )
    s.add_argument("--state-dir", help="state folder of the deployment (default: state_dir = .liverl)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_audit)

    s = sub.add_parser(
        "lineage",
        help="one feedback event's path: sample, learner step, candidate, gate verdicts, promotion, first "
        "served, each with its time",
        description="The path of one feedback event to a served model, read from the "
        "learner's ledger and the registry (liverl.ops.lineage says where each fact lives). Run it where the learner runs.",
    )
    s.add_argument("feedback_id", help="the FeedbackEvent.feedback_id the product sent")
    s.add_argument("--state-dir", help="state folder of the deployment (default: state_dir = .liverl)")
    s.add_argument("--ledger", help="the learner's ledger file (default: beside its checkpoint in the state folder)")
    s.add_argument("--json", action="store_true", help="print the path as JSON")
    s.set_defaults(fn=cmd_lineage)

    s = sub.add_parser("schema", help="print the JSON Schemas of the wire messages (for non-Python producers)")
    s.add_argument("name", nargs="?", choices=["feedback", "generation", "sample", "dead_letter", "version"])
    s.set_defaults(fn=cmd_schema)
    s = sub.add_parser("config", help="print the effective config (file + environment)")
    s.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("kafka", "aiokafka"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(f"liverl: error: {e}", file=sys.stderr)
        return 2
    except LiverlError as e:  # a part that could not start or a refused operation, named in the message
        print(f"liverl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
