"""The `liverl` command: one subcommand per process of the pipeline, plus the admin verbs.

This module parses arguments and loads config only; each subcommand imports its heavy modules
(torch, vLLM, faust) when it runs, so `liverl --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from liverl.config import LiverlConfig, load_config

DESCRIPTION = """\
liverl turns live product feedback (accept / reject / edit) into a better served model, safely.

The pipeline, one process each:
  serve    vLLM node + OpenAI-compatible gateway that logs every generation + hot-swap agent
  ingest   faust worker: joins feedback with generations, dedupes, shapes rewards -> samples
  learn    continuous learner: policy-gradient micro-epochs on the MoE policy -> candidates
  gate     release gate: integrity + held-out eval -> promote (the agent then hot-swaps)

Start here:
  liverl demo                 the whole loop on the embedded stack, ~10 minutes, with a live view
  liverl status               what is served, what is pending, live acceptance per version
  liverl versions             every version with its lineage, delta size and gate verdict

Config: --config FILE (TOML) or $LIVERL_CONFIG, overridden by LIVERL__SECTION__FIELD env vars,
e.g. LIVERL__BROKER__BOOTSTRAP=kafka:9092 LIVERL__LEARNER__LR=1e-4. `liverl config` prints it all.
"""

ADMIN_EPILOG = "The admin verbs read the registry (registry.url) and Redis (redis.url) named by the config."


def _cfg(args: argparse.Namespace) -> LiverlConfig:
    return load_config(args.config)


def cmd_demo(args: argparse.Namespace) -> int:
    from liverl.demo import run_demo

    cfg = _cfg(args)
    if args.duration is not None:
        cfg.demo.duration_s = args.duration
    if args.users is not None:
        cfg.demo.users = args.users
    if args.state_dir is not None:
        cfg.state_dir = args.state_dir
    summary = run_demo(cfg, summary_path=args.summary, plot_path=args.plot, live=not args.no_live)
    return 0 if summary.get("ok", False) or not args.strict else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from learner.policy import ensure_base_policy
    from liverl.stack import resolve_services
    from serving.agent import run_serving

    cfg = _cfg(args)
    bootstrap, redis_url = resolve_services(cfg)
    model_dir = ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed)
    run_serving(cfg, model_dir, bootstrap, redis_url, cfg.registry_url)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from ingest.worker import run_worker
    from liverl.stack import resolve_services

    cfg = _cfg(args)
    bootstrap, redis_url = resolve_services(cfg)
    return run_worker(cfg, bootstrap, redis_url)


def cmd_learn(args: argparse.Namespace) -> int:
    from learner.trainer import run_learner
    from liverl.stack import resolve_services

    import signal
    import threading

    cfg = _cfg(args)
    resolve_services(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # finish the update, checkpoint, commit, exit
    run_learner(cfg, stop_event=stop, max_steps=args.max_steps, metrics_port=args.metrics_port)
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from deploy.gate import run_gate

    cfg = _cfg(args)
    run_gate(cfg, once=args.once)
    return 0


def cmd_build_policy(args: argparse.Namespace) -> int:
    from learner.policy import ensure_base_policy

    cfg = _cfg(args)
    path = ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed if args.seed is None else args.seed)
    print(path)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from deploy.admin import cmd_status as run

    return run(_cfg(args))


def cmd_versions(args: argparse.Namespace) -> int:
    from deploy.admin import cmd_versions as run

    return run(_cfg(args), limit=args.limit)


def cmd_history(args: argparse.Namespace) -> int:
    from deploy.admin import cmd_history as run

    return run(_cfg(args))


def cmd_promote(args: argparse.Namespace) -> int:
    from deploy.admin import cmd_promote as run

    return run(_cfg(args), version=args.version, reason=args.reason, actor=args.actor, force=args.force)


def cmd_rollback(args: argparse.Namespace) -> int:
    from deploy.admin import cmd_rollback as run

    return run(_cfg(args), to=args.to, reason=args.reason, actor=args.actor)


def cmd_schema(args: argparse.Namespace) -> int:
    from liverl.schemas import json_schemas

    schemas = json_schemas()
    print(json.dumps(schemas if args.name is None else schemas[args.name], indent=2))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(json.dumps(_cfg(args).model_dump(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="liverl", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: $LIVERL_CONFIG, else built-in defaults)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", help="run the whole loop on the embedded stack with a live view",
                       description="Start the embedded broker and Redis, build the base policy, run serving, ingest, learner "
                       "and gate, drive simulated users against the gateway for --duration seconds, then print a summary "
                       "and write it as JSON (--summary) and a PNG of live acceptance per version (--plot).")
    d.add_argument("--duration", type=float, help="seconds to run (default: demo.duration_s = 600)")
    d.add_argument("--users", type=int, help="concurrent simulated users (default: demo.users)")
    d.add_argument("--summary", metavar="PATH", help="write the summary JSON here (default: <state_dir>/demo/summary.json)")
    d.add_argument("--plot", metavar="PATH", help="write the acceptance plot here (default: <state_dir>/demo/acceptance.png)")
    d.add_argument("--state-dir", help="state folder (default: state_dir = .liverl)")
    d.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    d.add_argument("--strict", action="store_true", help="exit 1 unless the run met its goals (>=3 promotions, +15 points)")
    d.set_defaults(fn=cmd_demo)

    for name, fn, text in [
        ("serve", cmd_serve, "run a vLLM node + gateway + hot-swap agent (serving.*)"),
        ("ingest", cmd_ingest, "run the faust ingest worker (ingest.*)"),
    ]:
        s = sub.add_parser(name, help=text, description=text)
        s.set_defaults(fn=fn)
    s = sub.add_parser("learn", help="run the continuous learner (learner.*)", description="run the continuous learner")
    s.add_argument("--max-steps", type=int, help="stop after this many updates")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics (liverl_learner_*) on this port")
    s.set_defaults(fn=cmd_learn)
    s = sub.add_parser("gate", help="run the release gate (deploy.gate)", description="run the release gate loop")
    s.add_argument("--once", action="store_true", help="process pending candidates once and exit")
    s.set_defaults(fn=cmd_gate)
    s = sub.add_parser("build-policy", help="build (or find cached) the base policy and print its folder")
    s.add_argument("--seed", type=int, help="seed (default: model.seed)")
    s.set_defaults(fn=cmd_build_policy)

    s = sub.add_parser("status", help="served version per node, pending candidates, live acceptance", epilog=ADMIN_EPILOG)
    s.set_defaults(fn=cmd_status)
    s = sub.add_parser("versions", help="list versions: lineage, status, delta size, gate scores", epilog=ADMIN_EPILOG)
    s.add_argument("--limit", type=int, default=20, help="most recent N versions (default 20)")
    s.set_defaults(fn=cmd_versions)
    s = sub.add_parser("history", help="the audit log: who promoted or rolled back what, and why", epilog=ADMIN_EPILOG)
    s.set_defaults(fn=cmd_history)
    s = sub.add_parser("promote", help="make VERSION the served version (the agents hot-swap to it)", epilog=ADMIN_EPILOG)
    s.add_argument("version", type=int)
    s.add_argument("--reason", default="manual promote", help="recorded in the audit log")
    s.add_argument("--actor", default=os.environ.get("USER", "admin"), help="who (default: $USER)")
    s.add_argument("--force", action="store_true", help="promote even a version the gate rejected")
    s.set_defaults(fn=cmd_promote)
    s = sub.add_parser("rollback", help="serve the previous stable version again (or --to VERSION)", epilog=ADMIN_EPILOG)
    s.add_argument("--to", type=int, help="version to return to (default: the one before the current stable)")
    s.add_argument("--reason", default="manual rollback", help="recorded in the audit log")
    s.add_argument("--actor", default=os.environ.get("USER", "admin"), help="who (default: $USER)")
    s.set_defaults(fn=cmd_rollback)

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
    except RuntimeError as e:  # StackError and friends: a part that could not start, named in the message
        if type(e).__module__.startswith(("liverl", "serving", "ingest", "learner", "deploy")):
            print(f"liverl: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
