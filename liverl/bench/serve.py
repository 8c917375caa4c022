"""``liverl bench serve``: generations/s through the gateway against the vLLM node alone, same load, one run.

The stack is started once (embedded broker and Redis, one vLLM node with the gateway running inside its API-server
process, and the agent, in a child process as ``liverl serve`` runs them). Then ``--rounds`` rounds of three runs,
each ``--clients`` closed-loop clients for ``--duration`` seconds: against the gateway; against the node's own
OpenAI server with the same request (the demo product's: one prompt, its ``max_tokens`` and temperature, plain or
streamed); and against the node with the request as the gateway forwards it (token ids and the sampled log-probs
asked for, which liverl must log). The order rotates each round, so drift of the machine's load hits every side
alike. ``ratio`` is gateway / node (the issue's measure); ``ratio, same request`` is gateway / node doing the same
work, i.e. the gateway's own cost. A generation counts when its response is complete (HTTP 200, or the stream's
``[DONE]``) inside the measured window; a ``--warmup`` before each window is not counted.

Nothing is pinned: the node, the broker and the clients share the machine's cores, which is what a single-box
deployment sees. The CPU the node's API-server process spends per generation is printed for the gateway's side and
the node's: the gateway runs in that process, so the difference is what it costs there.
``LIVERL_BENCH_PROFILE=PATH`` runs the node's API-server event loop under cProfile (``serving.node.gateway_host``) and
writes its stats to PATH when the node stops (``python -m pstats PATH``): where the time of that process goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from core.config import LiverlConfig, load_config
from liverl.bench.subcommand import add_bench_parser

PROFILE_ENV = (
    "LIVERL_BENCH_PROFILE"  # a path: the node's API-server event loop runs under cProfile, stats written there
)
DEFAULTS = {"clients": 64, "duration": 20.0, "rounds": 3, "warmup": 3.0, "api": "completions"}


# ------------------------------------------------------------------------------------------------ the stack


def _serve_child(cfg_json: str, model_dir: str, bootstrap: str, redis_url: str) -> None:
    """The serving process: the node (its gateway inside) and the agent, as ``liverl serve`` runs them (no registry:
    nothing swaps)."""
    from serving.agent.main import run_serving

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_serving(LiverlConfig.model_validate_json(cfg_json), model_dir, bootstrap, redis_url, None)


def _serve_child_registry(cfg_json: str, model_dir: str, bootstrap: str, redis_url: str, registry_url: str) -> None:
    """The serving process with a registry, so its agent swaps (``liverl bench swap``)."""
    from serving.agent.main import run_serving

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_serving(LiverlConfig.model_validate_json(cfg_json), model_dir, bootstrap, redis_url, registry_url)


def _wait_http(url: str, proc: multiprocessing.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError(f"the serving process exited with code {proc.exitcode} before it served")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads (Linux /proc); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Every process below ``pid`` (vLLM's engine core and its helpers under the API server)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals) - idle) / tck, sum(vals) / tck


def _cpu_split(groups: dict[str, list[int]]) -> dict[str, float]:
    out = {name: sum(_cpu_seconds(p) for p in pids) for name, pids in groups.items()}
    t = os.times()
    out["bench clients"] = t.user + t.system
    out["machine"] = _machine_cpu()[0]
    return out


# ------------------------------------------------------------------------------------------------ the load


def _requests(api: str, stream: bool, n_prompts: int = 64) -> list[tuple[str, bytes]]:
    """(path, body) pairs: the demo product's request on distinct prompts."""
    from liverl.demo import task

    out = []
    for p in task.heldout_prompts(n_prompts, seed=1):
        body: dict[str, Any] = {"model": "liverl", "max_tokens": task.MAX_TOKENS, "temperature": task.TEMPERATURE}
        if api == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": p.text}]
        else:
            path, body["prompt"] = "/v1/completions", p.text
        if stream:
            body["stream"] = True
        out.append((path, json.dumps(body).encode()))
    return out


def _forwarded(requests: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The same requests as the gateway forwards them to the node (token ids and sampled log-probs asked for)."""
    from serving.node.openai_api import ChatCompletionRequest, CompletionRequest

    model = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    return [(path, json.dumps(model[path].model_validate_json(body).node_body()).encode()) for path, body in requests]


async def _load(
    base_url: str, requests: list[tuple[str, bytes]], clients: int, warmup_s: float, duration_s: float, key: str = ""
) -> dict:
    """``clients`` closed-loop clients for ``warmup_s + duration_s``; counts what completes in the window."""
    import aiohttp

    stream = b'"stream": true' in requests[0][1]
    done = errors = total_ok = 0
    latencies: list[float] = []
    counting = False
    stop = False
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, errors, total_ok
        k = i
        while not stop:
            path, body = requests[k % len(requests)]
            k += clients
            t0 = time.perf_counter()
            try:
                async with session.post(base_url + path, data=body, headers=headers) as r:
                    if stream:
                        ok = r.status == 200
                        async for line in r.content:
                            if line.startswith(b"data: [DONE]"):
                                break
                        else:
                            ok = False
                    else:
                        await r.read()
                        ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            total_ok += ok
            if counting and not stop:
                if ok:
                    done += 1
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=clients, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(client(i, session)) for i in range(clients)]
        await asyncio.sleep(warmup_s)
        counting, t0 = True, time.perf_counter()
        await asyncio.sleep(duration_s)
        stop, elapsed = True, time.perf_counter() - t0
        await asyncio.wait(tasks, timeout=60)  # let in-flight requests finish: the next run starts on an idle node
        for t in tasks:
            t.cancel()
    latencies.sort()
    return {
        "generations": done,
        "errors": errors,
        "total_ok": total_ok,
        "seconds": elapsed,
        "gen_per_s": done / elapsed,
        "p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else None,
    }


# ------------------------------------------------------------------------------------------------ the bench


def run(
    clients: int = DEFAULTS["clients"],
    duration_s: float = DEFAULTS["duration"],
    rounds: int = DEFAULTS["rounds"],
    warmup_s: float = DEFAULTS["warmup"],
    api: str = DEFAULTS["api"],
    stream: bool = False,
    config: str | None = None,
    model: str | None = None,
    json_path: str | None = None,
    command: str = "liverl bench serve",
) -> dict:
    """Start the stack, measure, print the table and the command; returns the rows and the median ratio."""
    from liverl.stack.stack import start_stack

    if clients < 1 or duration_s <= 0 or rounds < 1 or warmup_s < 0:
        raise ValueError("clients and rounds must be >= 1, duration > 0 and warmup >= 0")
    if api not in ("completions", "chat"):
        raise ValueError(f"api must be completions or chat, not {api!r}")
    cfg, model_dir = _node_config(config, model, "serve", "bench")
    state = cfg.state_path
    gateway_url = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    node_url = f"http://{cfg.serving.node_host}:{cfg.serving.vllm_port}"
    requests = _requests(api, stream)
    sides = [
        ("gateway", gateway_url, requests),
        ("node", node_url, requests),
        ("node_fwd", node_url, _forwarded(requests)),
    ]
    print(
        f"bench serve: {clients} clients, {rounds} rounds of {duration_s:g} s (+{warmup_s:g} s warm-up) per side, "
        f"{api}{' streamed' if stream else ''}, model {model_dir}; logs in {state / 'logs'}",
        flush=True,
    )

    from deploy.registry.signing import generate_keypair

    generate_keypair(state / "keys")  # serve refuses to start without a verify key (nothing is announced here)
    stack = start_stack(cfg)
    if os.environ.get(PROFILE_ENV):
        from serving.node.gateway_host import ENV_PROFILE

        os.environ[ENV_PROFILE] = str(Path(os.environ[PROFILE_ENV]).resolve())  # the node inherits it
    proc = multiprocessing.get_context("spawn").Process(
        target=_serve_child,
        args=(cfg.model_dump_json(), str(model_dir), stack.bootstrap, stack.redis_url),
        name="liverl-serving",
    )
    rows: list[dict] = []
    try:
        proc.start()
        _wait_http(gateway_url + "/healthz", proc, timeout_s=600)
        from serving.agent.launch import node_file, read_node_key

        node_key = read_node_key(cfg)  # the node answers only with its key (the serving process wrote it)
        node_pid = int(node_file(cfg, "pid").read_text())
        groups = {  # where the machine's CPU goes, per side: what the table's last columns split
            "API server (gateway inside)": [node_pid],
            "engine core": _children(node_pid),
            "broker": [p.pid for name, p in stack.procs if "redis" not in name],
            "serving process (agent)": [proc.pid],
        }
        for r in range(rounds):
            order = sides[r % 3 :] + sides[: r % 3]  # each side goes first, second and third in turn
            row: dict[str, Any] = {"round": r + 1, "first": order[0][0]}
            for side, url, reqs in order:
                cpu0 = _cpu_split(groups)
                res = _run_loop(
                    _load(url, reqs, clients, warmup_s, duration_s, key="" if side == "gateway" else node_key)
                )
                cpu1 = _cpu_split(groups)
                res["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in cpu0}  # whole run, warm-up included
                res["api_cpu_s"] = res["cpu_s"]["API server (gateway inside)"]
                row[side] = res
            row["ratio"] = row["gateway"]["gen_per_s"] / max(row["node"]["gen_per_s"], 1e-9)
            row["ratio_fwd"] = row["gateway"]["gen_per_s"] / max(row["node_fwd"]["gen_per_s"], 1e-9)
            rows.append(row)
            print(
                f"  round {r + 1}: gateway {row['gateway']['gen_per_s']:.1f} gen/s, node {row['node']['gen_per_s']:.1f}"
                f" gen/s (with the gateway's request {row['node_fwd']['gen_per_s']:.1f}), ratio {row['ratio']:.3f} "
                f"({row['ratio_fwd']:.3f})",
                flush=True,
            )
    finally:
        if proc.pid is not None:
            proc.terminate()  # SIGTERM: the serving process stops its node and flushes its producer
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        stack.close()
    summary = {
        "rows": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "median_ratio_fwd": statistics.median(r["ratio_fwd"] for r in rows),
        "median_p50_overhead_ms": statistics.median(r["gateway"]["p50_ms"] - r["node"]["p50_ms"] for r in rows),
        "clients": clients,
        "duration_s": duration_s,
        "api": api,
        "stream": stream,
        "command": command,
        "machine": _machine(),
    }
    print(_table(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _run_loop(coro):
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _node_config(config: str | None, model: str | None, name: str, prefix: str, **extra):
    """(cfg, model dir) for a bench that runs one serving node: the user's config (``config``), in a state dir of its
    own under theirs, with its own topic prefix and free ports for the embedded broker, Redis and the node;
    ``extra`` overrides more settings."""
    user_cfg = load_config(config)
    model_dir = Path(model or user_cfg.model.path or _demo_model(user_cfg)).resolve()
    user_cfg.state_path.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=user_cfg.state_path))
    cfg = load_config(
        config,
        state_dir=str(state),
        topics__prefix=f"{prefix}{os.getpid()}",
        broker__embedded_port=_free_port(),
        redis__embedded_port=_free_port(),
        serving__gateway_port=_free_port(),
        serving__vllm_port=_free_port(),
        serving__agent_port=_free_port(),
        **extra,
    )
    return cfg, model_dir


def _demo_model(cfg) -> Path:
    from liverl.demo.base_policy import ensure_base_policy

    return ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed)


def _free_port() -> int:
    from core.services import free_port as pick

    return pick()


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def _table(summary: dict) -> str:
    header = (
        "| round | first | gateway gen/s | node gen/s | node gen/s, gateway's request | ratio | ratio, same "
        "request | gateway p50 ms | node p50 ms | p50 overhead ms | API-server CPU ms/gen, gateway / node / node fwd | "
        "errors (gw/node/fwd) |"
    )
    lines = ["", header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        g, n, f = r["gateway"], r["node"], r["node_fwd"]
        cpu_g, cpu_n, cpu_f = (1e3 * x["api_cpu_s"] / max(x["total_ok"], 1) for x in (g, n, f))
        lines.append(
            f"| {r['round']} | {r['first']} | {g['gen_per_s']:.1f} | {n['gen_per_s']:.1f} | "
            f"{f['gen_per_s']:.1f} | **{r['ratio']:.3f}** | {r['ratio_fwd']:.3f} | {g['p50_ms']:.0f} | "
            f"{n['p50_ms']:.0f} | {g['p50_ms'] - n['p50_ms']:.0f} | {cpu_g:.2f} / {cpu_n:.2f} / {cpu_f:.2f} | "
            f"{g['errors']}/{n['errors']}/{f['errors']} |"
        )
    split = [k for k in summary["rows"][0]["gateway"].get("cpu_s", {})]
    if split:
        lines += [
            "",
            "Where the machine's CPU went, ms per completed generation (medians over the rounds; each run's warm-up "
            "included):",
            "",
            "| side | " + " | ".join(split) + " |",
            "|---|" + "---|" * len(split),
        ]
        for side in ("gateway", "node", "node_fwd"):
            per = [
                statistics.median(1e3 * r[side]["cpu_s"][k] / max(r[side]["total_ok"], 1) for r in summary["rows"])
                for k in split
            ]
            lines.append(f"| {side} | " + " | ".join(f"{v:.2f}" for v in per) + " |")
    lines += [
        "",
        f"median ratio (gateway / node): **{summary['median_ratio']:.3f}**; the gateway against the node "
        f"doing the same work (token ids and log-probs asked for): {summary['median_ratio_fwd']:.3f}; "
        f"median p50 overhead {summary['median_p50_overhead_ms']:.0f} ms",
        f"machine: {summary['machine']}",
        f"reproduce: `{summary['command']}`",
    ]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` under ``liverl bench``."""
    s = add_bench_parser(
        subparsers,
        "serve",
        "generations/s through the gateway vs the vLLM node alone (ratio)",
        __doc__,
    )
    s.add_argument("--clients", type=int, default=DEFAULTS["clients"], help="concurrent clients (default 64)")
    s.add_argument(
        "--duration",
        type=float,
        default=DEFAULTS["duration"],
        metavar="S",
        help="measured seconds per run (default 20)",
    )
    s.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="rounds of the three runs (default 3)")
    s.add_argument(
        "--warmup",
        type=float,
        default=DEFAULTS["warmup"],
        metavar="S",
        help="unmeasured seconds before each run (default 3)",
    )
    s.add_argument(
        "--api", choices=["completions", "chat"], default=DEFAULTS["api"], help="which route (default completions)"
    )
    s.add_argument("--stream", action="store_true", help="streamed (SSE) requests")
    s.add_argument("--model", metavar="DIR", help="model directory (default: model.path, else the demo policy)")
    s.add_argument("--json", metavar="PATH", help="also write the rows and the summary as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    command = (
        "liverl bench serve"
        + "".join(
            f" --{name} {getattr(args, name)}"
            for name in ("clients", "duration", "rounds", "warmup", "api")
            if getattr(args, name) != DEFAULTS[name]
        )
        + (" --stream" if args.stream else "")
    )
    run(
        clients=args.clients,
        duration_s=args.duration,
        rounds=args.rounds,
        warmup_s=args.warmup,
        api=args.api,
        stream=args.stream,
        config=getattr(args, "config", None),
        model=args.model,
        json_path=args.json,
        command=command,
    )
    return 0


if __name__ == "__main__":  # the spawned serving process imports this module; only a direct run parses argv
    parser = argparse.ArgumentParser(prog="liverl bench")
    add_parser(parser.add_subparsers(dest="bench"))
    ns = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(ns.fn(ns))
