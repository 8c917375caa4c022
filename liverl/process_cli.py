"""The `liverl` subcommands that run one process of the pipeline each: serve, ingest, route, learn, gate.

Each command imports its process's heavy modules (torch, vLLM, aiokafka) when it runs, so building the parser
stays light.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from core.services import EXIT_TEMPFAIL, kafka_bootstrap, redis_url, required_verify_key
from liverl.cliargs import add_model_args, cfg_from_args, check_bound, model_dir_for


def exit_now(code: int = 0) -> None:
    """End a process whose work is done and whose connections are closed, without the interpreter's teardown: with
    torch and vLLM's modules loaded its final garbage collection took 12-30 s on a busy 2-core machine, long enough
    for a supervisor's or Kubernetes' kill timeout after a stop that was clean."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.agent.main import run_serving

    cfg = cfg_from_args(args)
    check_bound(cfg, "serve")
    required_verify_key(cfg)  # refused before the model is built or loaded (serving.agent.main.serve checks it too)
    run_serving(cfg, model_dir_for(cfg), kafka_bootstrap(cfg), redis_url(cfg), cfg.registry_url)
    exit_now(0)  # stopped and drained (SIGTERM): nothing is left to flush in this process
    return 0


def cmd_route(args: argparse.Namespace) -> int:
    from serving.router.router import run_router

    cfg = cfg_from_args(args)
    check_bound(cfg, "route")
    run_router(cfg, redis_url(cfg), args.host or cfg.serving.host, args.port or cfg.serving.router_port)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from ingest.worker import run_worker

    cfg = cfg_from_args(args)
    check_bound(cfg, "ingest")
    # /metrics and /healthz on the interface the other roles' servers bind (serving.host)
    return run_worker(cfg, kafka_bootstrap(cfg), redis_url(cfg), web_bind=cfg.serving.host)


def cmd_learn(args: argparse.Namespace) -> int:
    import kafka.errors
    import redis
    import sqlalchemy.exc

    from core.bus import BrokerUnavailable
    from learner.trainer import run_learner

    # what Redis's, the broker's and the registry's clients raise once a service has not answered for longer than they
    # retry
    service_down = (
        BrokerUnavailable,
        kafka.errors.KafkaError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        sqlalchemy.exc.OperationalError,
        ConnectionError,
    )

    cfg = cfg_from_args(args)
    check_bound(cfg, "learn")
    model_dir = model_dir_for(cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # finish the update, checkpoint, commit, exit
    try:
        run_learner(cfg, model_dir, stop_event=stop, max_steps=args.max_steps, metrics_port=args.metrics_port)
    except service_down as e:  # Redis or the broker gone longer than the clients retry: a supervisor starts it again
        logging.getLogger("liverl.learner").error("learner: a service it needs stopped answering: %r", e)
        print(
            f"liverl: error: the learner lost a service it needs ({type(e).__name__}: {e}); it starts again from its "
            "last checkpoint, and what it had not committed is read again then",
            file=sys.stderr,
        )
        exit_now(EXIT_TEMPFAIL)
    exit_now(0)  # checkpointed and committed
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from core.product import load_product
    from deploy.gate.gate import run_gate
    from learner.evaluate import PolicyEvaluator
    from liverl.ops.forget import gate_chore

    cfg = cfg_from_args(args)
    check_bound(cfg, "gate")
    model_dir, suite = model_dir_for(cfg), load_product(cfg).eval_suite()
    run_gate(
        cfg,
        lambda probes: PolicyEvaluator(model_dir, suite, probes, max_probes=cfg.gate.probe_generations),
        once=args.once,
        chores=[gate_chore] if cfg.forget.run_in_gate else [],
    )
    exit_now(0)  # its loop ended after the step in hand; the registry, Redis and the tails are closed
    return 0


def cmd_build_policy(args: argparse.Namespace) -> int:
    from liverl.demo.base_policy import ensure_base_policy

    cfg = cfg_from_args(args)
    path = ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed if args.seed is None else args.seed)
    print(path)
    return 0


def register(sub) -> None:
    """Add the pipeline's processes (and build-policy) to the `liverl` subcommands."""
    for name, fn, text in [
        ("serve", cmd_serve, "run a vLLM node + gateway + hot-swap agent (serving.*)"),
        ("ingest", cmd_ingest, "run an ingest worker: the join of feedback with generations (ingest.*)"),
    ]:
        s = sub.add_parser(name, help=text, description=text)
        add_model_args(s)
        s.set_defaults(fn=fn)
    s = sub.add_parser(
        "route",
        help="the fleet's front door: spread requests over the serving nodes, sticky per user",
        description="Route the OpenAI-compatible API (/v1/...) over the serving nodes serving.fleet "
        "names (node name -> gateway URL) whose heartbeat is live and healthy, sticky per user (X-Liverl-User header, "
        "the body's OpenAI 'user' field, or X-Session-Id; rendezvous hashing, so nodes joining or leaving move only "
        "their own users). A node that refuses connections is skipped and the request goes to the next one. Start one "
        "`liverl serve` per node, each with its own serving.node_name and ports. GET /fleet lists the "
        "nodes in rotation; GET /metrics has liverl_router_*.",
    )
    s.add_argument("--port", type=int, default=None, help="port (default serving.router_port, 8080)")
    s.add_argument("--host", default=None, help="address to bind (default serving.host)")
    s.set_defaults(fn=cmd_route)
    s = sub.add_parser("learn", help="run the continuous learner (learner.*)", description="run the continuous learner")
    s.add_argument("--max-steps", type=int, help="stop after this many updates")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics (liverl_learner_*) on this port")
    add_model_args(s)
    s.set_defaults(fn=cmd_learn)
    s = sub.add_parser("gate", help="run the release gate (deploy.gate.gate)", description="run the release gate loop")
    s.add_argument("--once", action="store_true", help="process pending candidates once and exit")
    add_model_args(s)
    s.set_defaults(fn=cmd_gate)
    s = sub.add_parser("build-policy", help="build (or find cached) the base policy and print its folder")
    s.add_argument("--seed", type=int, help="seed (default: model.seed)")
    s.set_defaults(fn=cmd_build_policy)
