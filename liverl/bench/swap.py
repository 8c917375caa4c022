"""``liverl bench swap``: how long a hot-swap pauses the engine under streaming load, and what clients feel of it.

The stack is started once (embedded broker and Redis, a registry in the state dir, one vLLM node with the gateway and
its agent in a child process as ``liverl serve`` runs them). ``--clients`` closed-loop clients stream completions of
``--max-tokens`` sampled tokens through the gateway, while ``--swaps`` new versions are promoted one after the other,
``--interval`` seconds apart, each a delta of ``--changed`` (share of elements) on its parent, announced and signed as
the gate does. ``--via`` picks how the node commits each swap inside the pause (``serving.swap_via``): ``vllm``
(vLLM's pause keep, ``update_weights`` through the ``liverl_delta`` backend, ``finish_weight_update`` with the
version), ``liverl`` (the engine core's pause, liverl's ``liverl_commit`` RPC, ``update_weight_version``), or
``alternate`` (the default: every other swap each way, so both are measured in one run under the same load).
Reported per swap path, from the agent's swap records: ``pause`` (measured in the node: the engine stepped no
request from the pause call to the resume's reply), its phases, and the agent's whole call. Reported per request:
failures (not HTTP 200 or no ``[DONE]``), and the requests that waited more than ``--stall-ms`` for a chunk (or the
first chunk) across an engine pause, beside those that waited as long with no pause in the wait (what this machine's
load does anyway), so the swap's own share is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from liverl.bench.serve import _machine, _node_config, _run_loop, _serve_child_registry, _wait_http
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {
    "swaps": 12,
    "clients": 16,
    "interval": 2.0,
    "max_tokens": 20,
    "changed": 0.1,
    "stall_ms": 100.0,
    "via": "alternate",
}
VIAS = ("alternate", "vllm", "liverl")


def _perturb(state: dict, seed: int, share: float) -> dict:
    """A child version: ``share`` of each tensor's elements moved by a small random step (bf16 kept)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        x = v.float()
        mask = torch.rand(x.shape, generator=g) < share
        step = 0.05 * (x.std() if x.numel() > 1 else x.abs() + 1e-3) * torch.randn(x.shape, generator=g)
        out[k] = torch.where(mask, x + step, x).to(v.dtype)
    return out


async def _load(url: str, body: bytes, clients: int, stop: threading.Event, out: list[dict]) -> None:
    import aiohttp

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            rec: dict[str, Any] = {"t0": time.time(), "times": [], "done": False, "status": None}
            try:
                async with session.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    rec["status"] = r.status
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            rec["times"].append(time.time())
                            if line.startswith(b"data: [DONE]"):
                                rec["done"] = True
            except aiohttp.ClientError as e:
                rec["error"] = str(e)
            out.append(rec)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*[client(session) for _ in range(clients)])


def run(
    swaps: int = DEFAULTS["swaps"],
    clients: int = DEFAULTS["clients"],
    interval_s: float = DEFAULTS["interval"],
    max_tokens: int = DEFAULTS["max_tokens"],
    changed: float = DEFAULTS["changed"],
    stall_ms: float = DEFAULTS["stall_ms"],
    via: str = DEFAULTS["via"],
    config: str | None = None,
    model: str | None = None,
    json_path: str | None = None,
    command: str = "liverl bench swap",
) -> dict:
    """Start the stack, swap under load, print the table and the command; returns the summary."""
    import redis

    from deploy.registry.blobstore import open_blob_store
    from deploy.registry.registry import Registry
    from deploy.registry.signing import Signer, announce, generate_keypair
    from liverl.demo.base_policy import load_state_dict
    from liverl.stack.stack import start_stack

    if swaps < 1 or clients < 1 or interval_s <= 0 or max_tokens < 1 or not 0 < changed <= 1:
        raise ValueError("swaps, clients and max_tokens must be >= 1, interval > 0 and changed in (0, 1]")
    if via not in VIAS:
        raise ValueError(f"--via is one of {', '.join(VIAS)}, not {via!r}")
    cfg, model_dir = _node_config(config, model, "swap", "benchswap", serving__swap_poll_s=0.1, serving__swap_via=via)
    state = cfg.state_path
    url = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    print(
        f"bench swap: {swaps} swaps {interval_s:g} s apart, {clients} streaming clients of {max_tokens} tokens, "
        f"{changed:.0%} of elements changed per version, model {model_dir}; logs in {state / 'logs'}",
        flush=True,
    )
    private, _ = generate_keypair(state / "keys")
    signer = Signer(private)
    stack = start_stack(cfg)
    registry = Registry(cfg.registry_url, open_blob_store(cfg.blob_location))
    base = load_state_dict(model_dir)
    registry.init_base(base, str(model_dir))
    proc = multiprocessing.get_context("spawn").Process(
        target=_serve_child_registry,
        args=(cfg.model_dump_json(), str(model_dir), stack.bootstrap, stack.redis_url, cfg.registry_url),
        name="liverl-serving",
    )
    rds = redis.Redis.from_url(stack.redis_url)
    results: list[dict] = []
    stop = threading.Event()
    loader = None
    try:
        proc.start()
        _wait_http(url + "/healthz", proc, timeout_s=600)
        body = json.dumps(
            {
                "model": "liverl",
                "prompt": "[a]23+45=",
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        loader = threading.Thread(target=_run_loop, args=(_load(url, body, clients, stop, results),), daemon=True)
        loader.start()
        time.sleep(3.0)  # warm
        cur = base
        for k in range(1, swaps + 1):
            cur = _perturb(cur, seed=k, share=changed)
            row = registry.add_candidate(cur, parent=k - 1, metrics={}, sample_offsets={}, learner_step=k)
            registry.promote(row.version, actor="bench", reason="bench swap")
            announce(rds, cfg.topics.prefix, row.version, row.checksum, "bench swap", signer)
            deadline = time.monotonic() + 60
            while json.loads(_get(url + "/liverl/version"))["version"] != row.version:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"version {row.version} not served after 60 s; swap errors: "
                        f"{rds.lrange(cfg.topics.prefix + ':swap_errors', 0, -1)}"
                    )
                time.sleep(0.05)
            time.sleep(interval_s)
    finally:
        stop.set()
        if loader is not None:
            loader.join(120)
        if proc.pid is not None:
            proc.terminate()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        records = [json.loads(x) for x in rds.lrange(f"{cfg.topics.prefix}:swaps", 0, -1)]
        rds.close()
        registry.close()
        stack.close()
    summary = _summarise(records, results, stall_ms)
    summary.update(command=command, machine=_machine(), clients=clients, max_tokens=max_tokens, changed=changed)
    print(_table(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


PHASES = ("stage_ms", "start_ms", "pause_call_ms", "apply_ms", "label_ms", "resume_ms", "verify_ms", "call_ms")


def _summarise(swaps: list[dict], requests: list[dict], stall_ms: float) -> dict:
    windows = [tuple(s["pause_wall"]) for s in swaps if s.get("pause_wall")]  # the engine's pause, in the node
    failed = [r for r in requests if r["status"] != 200 or not r["done"]]
    behind = outside = 0
    n_overlap = 0
    for r in requests:
        marks = [r["t0"], *r["times"]]
        gaps = list(itertools.pairwise(marks))
        overlaps = any(a < we and b > ws for a, b in gaps for ws, we in windows)
        n_overlap += overlaps
        long = [(a, b) for a, b in gaps if (b - a) * 1e3 > stall_ms]
        if any(a < we and b > ws for a, b in long for ws, we in windows):
            behind += 1
        elif long:
            outside += 1
    by_via = {}
    for via in sorted({str(s.get("via")) for s in swaps}):
        mine = [s for s in swaps if str(s.get("via")) == via]
        pauses = [s["pause_ms"] for s in mine if s.get("pause_ms") is not None]
        by_via[via] = {
            "n_swaps": len(mine),
            "ok_swaps": sum(bool(s.get("verify_ok")) for s in mine),
            "pause_ms_median": statistics.median(pauses) if pauses else None,
            "pause_ms_p99": _pct(pauses, 0.99),
            "pause_ms_max": max(pauses, default=None),
            "phases_median_ms": {
                k: statistics.median([s[k] for s in mine if s.get(k) is not None] or [0.0]) for k in PHASES
            },
        }
    return {
        "swaps": swaps,
        "by_via": by_via,
        "requests": len(requests),
        "failed": len(failed),
        "overlapping_swap": n_overlap,
        "waited_behind_swap": behind,
        "waited_outside_swaps": outside,
        "stall_ms": stall_ms,
    }


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _table(s: dict) -> str:
    f = _f
    lines = [
        "",
        "| via | swaps (ok) | pause median ms | pause p99 ms | pause max ms | in the pause, median ms: pause call / "
        "write + read-back / label / resume | outside it: stage / start session / full verify | agent call "
        "median ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for via, v in s["by_via"].items():
        ph = v["phases_median_ms"]
        lines.append(
            f"| {via} | {v['n_swaps']} ({v['ok_swaps']}) | **{f(v['pause_ms_median'])}** | "
            f"**{f(v['pause_ms_p99'])}** | {f(v['pause_ms_max'])} | {f(ph['pause_call_ms'])} / {f(ph['apply_ms'])} / "
            f"{f(ph['label_ms'])} / {f(ph['resume_ms'])} | {f(ph['stage_ms'])} / {f(ph['start_ms'])} / "
            f"{f(ph['verify_ms'])} | {f(ph['call_ms'])} |"
        )
    lines += [
        "",
        f"| requests | failed | in flight across a pause | waited > {s['stall_ms']:.0f} ms for a chunk across a "
        f"pause | waited > {s['stall_ms']:.0f} ms, no pause in that wait |",
        "|---|---|---|---|---|",
        f"| {s['requests']} | **{s['failed']}** | {s['overlapping_swap']} | **{s['waited_behind_swap']}** | "
        f"{s['waited_outside_swaps']} |",
        "",
        f"{s['clients']} streaming clients of {s['max_tokens']} tokens, {s['changed']:.0%} of elements changed per "
        f"version; machine: {s['machine']}",
        f"reproduce: `{s['command']}`",
    ]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``swap`` under ``liverl bench``."""
    s = add_bench_parser(
        subparsers,
        "swap",
        "hot-swap pause under streaming load (engine pause, client stalls)",
        __doc__,
    )
    s.add_argument("--swaps", type=int, default=DEFAULTS["swaps"], help="versions promoted in turn (default 12)")
    s.add_argument("--clients", type=int, default=DEFAULTS["clients"], help="streaming clients (default 16)")
    s.add_argument(
        "--interval",
        type=float,
        default=DEFAULTS["interval"],
        metavar="S",
        help="seconds between a swap and the next announcement (default 2)",
    )
    s.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"], help="tokens per stream (default 20)")
    s.add_argument(
        "--changed",
        type=float,
        default=DEFAULTS["changed"],
        help="share of elements each version changes (default 0.1)",
    )
    s.add_argument(
        "--stall-ms",
        type=float,
        default=DEFAULTS["stall_ms"],
        help="a wait for a chunk longer than this counts as a stall (default 100)",
    )
    s.add_argument(
        "--via",
        choices=VIAS,
        default=DEFAULTS["via"],
        help="how the node commits a swap in the pause: vllm (vLLM's weight-update calls), liverl (liverl's worker "
        "RPC), alternate (each swap the other way; default)",
    )
    s.add_argument("--model", metavar="DIR", help="model directory (default: model.path, else the demo policy)")
    s.add_argument("--json", metavar="PATH", help="also write the swap records and the summary as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    names = {
        "swaps": "swaps",
        "clients": "clients",
        "interval": "interval",
        "max_tokens": "max-tokens",
        "changed": "changed",
        "stall_ms": "stall-ms",
        "via": "via",
    }
    command = (
        "liverl bench swap"
        + "".join(f" --{flag} {getattr(args, n)}" for n, flag in names.items() if getattr(args, n) != DEFAULTS[n])
        + (f" --model {args.model}" if args.model else "")
    )
    run(
        swaps=args.swaps,
        clients=args.clients,
        interval_s=args.interval,
        max_tokens=args.max_tokens,
        changed=args.changed,
        stall_ms=args.stall_ms,
        via=args.via,
        config=getattr(args, "config", None),
        model=args.model,
        json_path=args.json,
        command=command,
    )
    return 0
