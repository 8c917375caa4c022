"""``liverl bench routers``: what a ``kill -9`` of a router costs, with two routers behind HAProxy and with one alone.

One serving node (vLLM on CPU with the demo policy, its gateway and agent, as ``liverl serve`` runs them) on the
embedded broker and Redis, started once. Then each round runs two fronts, in turn, on that node:

- **HAProxy**: two ``liverl route`` processes behind HAProxy with liverl's configuration
  (``liverl/ops/templates/haproxy.cfg.in``: health checks on ``/healthz``, connection failures and empty responses
  replayed on the other router);
- **one router** (the baseline): one ``liverl route``, the clients connect to it directly; after the kill it is
  started again at once, as the supervisor of ``liverl up`` would.

Each front gets the same load: ``--clients`` closed-loop clients, each request a chat completion of the demo product
(``--max-tokens``, ``ignore_eos``) for one of ``--users`` user keys (the OpenAI ``user`` field, so the router routes
it sticky), streamed and plain in turn. A client that sees a failure waits ``--fail-pause`` seconds before its next
request (a client's back-off; it bounds what the baseline's downtime counts). After ``--before`` seconds one router
is killed with SIGKILL; the load goes on ``--after`` seconds more.

Columns: ``answered/s``: requests answered per second before the kill and after it (the same node behind either
front; after the kill HAProxy has one router left); ``in flight at the kill``: requests sent before the kill and not
yet answered; ``failed, in flight``: those of them that failed (a stream cut after its head: its bytes were already
on their way to the client, so nothing can replay it); ``failed, sent after the kill``: requests sent after the kill
that failed, and ``of which after marked down / back`` those sent after the balancer marked the router down (or
after the restarted router answered); ``down after``: seconds from the kill until HAProxy's health checks marked the
router DOWN (polled every 50 ms), or, for the baseline, until the restarted router answered ``/healthz``;
``replayed``: requests HAProxy sent again to the other router (its ``wredis`` counter). A failed request with a
response head names its router (``X-Liverl-Router``, set by HAProxy): every one of them must name the killed router.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from core.config import LiverlConfig
from liverl.bench.routers_load import LOAD, Front, kill_under_load, summarize
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {
    "clients": LOAD["clients"],
    "users": LOAD["users"],
    "max_tokens": LOAD["max_tokens"],
    "fail_pause": LOAD["fail_pause_s"],
    "before": 10.0,
    "after": 15.0,
    "rounds": 1,
}
FRONTS = ("haproxy", "one router")


# ------------------------------------------------------------------------------------------------ the bench


def run(
    clients: int = DEFAULTS["clients"],
    users: int = DEFAULTS["users"],
    max_tokens: int = DEFAULTS["max_tokens"],
    before_s: float = DEFAULTS["before"],
    after_s: float = DEFAULTS["after"],
    fail_pause_s: float = DEFAULTS["fail_pause"],
    rounds: int = DEFAULTS["rounds"],
    config: str | None = None,
    model: str | None = None,
    json_path: str | None = None,
    command: str = "liverl bench routers",
) -> dict:
    """Start the node, run each round's two fronts, print the table and the command; returns the rows."""
    from core.credentials import ensure_secrets
    from deploy.registry.signing import generate_keypair
    from liverl.bench.serve import _machine, _node_config, _run_loop, _serve_child, _wait_http
    from liverl.stack.stack import start_stack

    if clients < 1 or rounds < 1 or before_s <= 0 or after_s <= 0 or users < 1 or max_tokens < 1:
        raise ValueError("clients, users, max-tokens and rounds must be >= 1; before and after > 0")
    if shutil.which("haproxy") is None:
        raise ValueError("liverl bench routers runs HAProxy: install it (Debian/Ubuntu: apt-get install haproxy)")
    cfg, model_dir = _node_config(config, model, "routers", "bench")
    state = cfg.state_path
    gateway_url = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    cfg.serving.fleet = {cfg.serving.node_name: gateway_url}
    print(
        f"bench routers: {clients} clients, {users} users, {max_tokens} tokens a completion (streamed and plain in "
        f"turn), a router killed after {before_s:g} s, {after_s:g} s more; {rounds} round(s); logs in {state}",
        flush=True,
    )
    generate_keypair(state / "keys")  # the node and the routers verify announcements with it (none is made here)
    ensure_secrets(cfg)  # the routers' assignment key
    stack = start_stack(cfg)
    cfg.redis.url = stack.redis_url
    proc = subprocess_node(cfg, model_dir, stack, _serve_child)
    load = {"clients": clients, "users": users, "max_tokens": max_tokens, "fail_pause_s": fail_pause_s}
    rows: list[dict] = []
    try:
        proc.start()
        _wait_http(gateway_url + "/healthz", proc, timeout_s=600)
        for r in range(rounds):
            for front_name in FRONTS if r % 2 == 0 else FRONTS[::-1]:
                balancer = front_name == "haproxy"
                front = Front(
                    cfg, state / f"round{r + 1}-{front_name.replace(' ', '-')}", 2 if balancer else 1, balancer
                )
                try:
                    front.start()
                    res = _run_loop(kill_under_load(front, before_s, after_s, restart=not balancer, **load))
                finally:
                    front.stop()
                row = {"round": r + 1, "front": front_name, **summarize(res)}
                rows.append(row)
                print(
                    f"  round {r + 1}, {front_name}: {json.dumps({k: v for k, v in row.items() if k != 'round'})}",
                    flush=True,
                )
    finally:
        if proc.pid is not None:
            proc.terminate()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        stack.close()
    summary = {
        "rows": rows,
        "load": load,
        "before_s": before_s,
        "after_s": after_s,
        "command": command,
        "machine": _machine(),
    }
    print(_table(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def subprocess_node(cfg: LiverlConfig, model_dir: Path, stack, target):
    import multiprocessing

    return multiprocessing.get_context("spawn").Process(
        target=target,
        args=(cfg.model_dump_json(), str(model_dir), stack.bootstrap, stack.redis_url),
        name="liverl-serving",
    )


def _table(summary: dict) -> str:
    lines = [
        "",
        "| round | front | requests (failed) | answered/s before / after the kill | in flight at the kill | failed, "
        "in flight (streams) | failed, sent after the kill | of which after marked down / back | down after (s) | "
        "replayed by HAProxy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        down = "-" if r["down_after_s"] is None else f"{r['down_after_s']:.2f}"
        if r["front"] == "one router" and r["down_after_s"] is not None:
            down += " (back)"
        replayed = "-" if r["front"] != "haproxy" else str(r["redispatches"])
        lines.append(
            f"| {r['round']} | {r['front']} | {r['requests']} ({r['failed']}) | "
            f"{r['ok_per_s_before']:.1f} / {r['ok_per_s_after']:.1f} | {r['in_flight']} | "
            f"{r['failed_in_flight']} ({r['failed_in_flight_streams']}) | {r['failed_after_kill']} | "
            f"{r['failed_after_down']} | {down} | {replayed} |"
        )
    load = summary["load"]
    lines += [
        "",
        f"load: {load['clients']} clients, {load['users']} users, {load['max_tokens']} tokens, a failed client pauses "
        f"{load['fail_pause_s']:g} s; kill after {summary['before_s']:g} s, {summary['after_s']:g} s more",
        f"machine: {summary['machine']}",
        f"reproduce: `{summary['command']}`",
    ]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``routers`` under ``liverl bench``."""
    s = add_bench_parser(
        subparsers, "routers", "kill -9 of a router: two behind HAProxy vs one alone (failed requests)", __doc__
    )
    s.add_argument("--clients", type=int, default=DEFAULTS["clients"], help="concurrent clients (default 8)")
    s.add_argument("--users", type=int, default=DEFAULTS["users"], help="distinct user keys (default 64)")
    s.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"], help="tokens per completion (default 16)")
    s.add_argument("--before", type=float, default=DEFAULTS["before"], metavar="S", help="load before the kill (10)")
    s.add_argument("--after", type=float, default=DEFAULTS["after"], metavar="S", help="load after the kill (15)")
    s.add_argument(
        "--fail-pause",
        type=float,
        default=DEFAULTS["fail_pause"],
        metavar="S",
        help="a client's pause after a failure (0.1)",
    )
    s.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="rounds of the two fronts (default 1)")
    s.add_argument("--model", metavar="DIR", help="model directory (default: model.path, else the demo policy)")
    s.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    names = {"clients": "clients", "users": "users", "max_tokens": "max-tokens", "before": "before", "after": "after"}
    names |= {"fail_pause": "fail-pause", "rounds": "rounds"}
    command = "liverl bench routers" + "".join(
        f" --{flag} {getattr(args, name):g}"
        if isinstance(getattr(args, name), float)
        else f" --{flag} {getattr(args, name)}"
        for name, flag in names.items()
        if getattr(args, name) != DEFAULTS[name]
    )
    run(
        clients=args.clients,
        users=args.users,
        max_tokens=args.max_tokens,
        before_s=args.before,
        after_s=args.after,
        fail_pause_s=args.fail_pause,
        rounds=args.rounds,
        config=getattr(args, "config", None),
        model=args.model,
        json_path=args.json,
        command=command,
    )
    return 0
