"""The `liverl` command: the root parser and the dispatch to one subcommand per process, plus the admin verbs.

Each area registers its own subcommands (liverl.up_cli, liverl.process_cli, liverl.bench_cli, liverl.admin_cli,
liverl.keys_cli) and imports its heavy modules (torch, vLLM, aiokafka) only when a subcommand runs, so `liverl --help`
stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from core.config import redact_url
from core.schemas import json_schemas
from core.services import EXIT_TEMPFAIL, LiverlError, ServiceError
from liverl import admin_cli, bench_cli, keys_cli, process_cli, up_cli
from liverl.cliargs import cfg_from_args

__all__ = ["build_parser", "main"]

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


def cmd_schema(args: argparse.Namespace) -> int:
    schemas = json_schemas()
    print(json.dumps(schemas if args.name is None else schemas[args.name], indent=2))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """The effective config as JSON; passwords in URLs and secrets are masked."""
    cfg = cfg_from_args(args).model_dump(mode="json")
    for section, name in (("redis", "url"), ("registry", "url"), ("broker", "bootstrap")):
        cfg[section][name] = redact_url(cfg[section][name])
    print(json.dumps(cfg, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="liverl", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", metavar="FILE", help="TOML config file (default: $LIVERL_CONFIG, else built-in defaults)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    up_cli.register(sub)
    process_cli.register(sub)
    bench_cli.register(sub)
    admin_cli.register_reads(sub)
    admin_cli.register(sub)
    keys_cli.register(sub)
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
    except ServiceError as e:  # a service it needs did not answer: a supervisor starts it again
        print(f"liverl: error: {e}", file=sys.stderr)
        return EXIT_TEMPFAIL
    except LiverlError as e:  # a part that could not start or a refused operation, named in the message
        print(f"liverl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
