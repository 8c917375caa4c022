"""`liverl demo`: the whole loop on one machine, on the embedded stack, for a bounded time.

The demo is a supervisor, not a shortcut: it starts the same processes an operator would run
(`liverl serve`, `liverl ingest`, `liverl learn`, `liverl gate`), drives simulated users through the
public interfaces only (HTTP to the gateway, feedback through the SDK), watches the live counters,
and writes a summary (JSON) and a plot (PNG) of live acceptance per version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from liverl.core.config import LiverlConfig
from liverl.stack import Stack, StackError, start_stack

log = logging.getLogger("liverl.demo")

ROLES = ("serve", "ingest", "learn", "gate")


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class Timeline:
    """Per-second snapshots of the live counters, for the plot and the summary."""

    t0: float = field(default_factory=time.time)
    points: list[dict] = field(default_factory=list)

    def add(self, served: int | None, live: dict[int, dict[str, int]]) -> None:
        self.points.append({"t": time.time() - self.t0, "served": served,
                            "live": {v: (c.get("accept", 0), c.get("events", 0)) for v, c in live.items()}})


def child_env(cfg: LiverlConfig, stack: Stack) -> dict[str, str]:
    env = dict(os.environ)
    # the config as this process resolved it (file + environment + demo flags), then the live addresses
    for section in ("serving", "ingest", "learner", "gate", "broker", "demo"):
        for key, value in getattr(cfg, section).model_dump().items():
            env[f"LIVERL__{section.upper()}__{key.upper()}"] = json.dumps(value)
    env.update({
        "LIVERL__STATE_DIR": str(cfg.state_path),
        "LIVERL__BROKER__BOOTSTRAP": stack.bootstrap,
        "LIVERL__REDIS__URL": stack.redis_url,
        "LIVERL__REGISTRY__URL": stack.registry_url,
        "LIVERL__REGISTRY__BLOB_DIR": str(stack.blob_dir),
        "LIVERL__MODEL__CACHE_DIR": str(cfg.model_cache_path),
        "LIVERL__MODEL__SEED": str(cfg.model.seed),
        "LIVERL__TOPICS__PREFIX": json.dumps(cfg.topics.prefix),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("LIVERL_CONFIG", None)
    return env


def start_child(role: str, env: dict[str, str], log_dir: Path) -> Child:
    log_path = log_dir / f"{role}.log"
    with open(log_path, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "liverl.cli", role], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Child(role, proc, log_path)


def stop_children(children: list[Child], timeout: float = 20.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop on SIGTERM; killing it", c.role)
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            c.proc.wait()


def wait_http(url: str, timeout: float, children: list[Child], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if c.proc.poll() is not None:
                raise StackError(f"{c.role} exited with code {c.proc.returncode} while waiting for {what}:\n{c.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise StackError(f"{what} not ready at {url} after {timeout:.0f} s")


def reset_state(cfg: LiverlConfig, r) -> None:
    """A demo run starts clean: fresh registry, blobs, checkpoints and Redis keys (the model cache stays)."""
    state = cfg.state_path
    for name in ("registry.db", "registry.db-wal", "registry.db-shm"):
        (state / name).unlink(missing_ok=True)
    for name in ("blobs", "learner", "logs", "serving", "gate"):
        shutil.rmtree(state / name, ignore_errors=True)
    keys = list(r.scan_iter(f"{cfg.topics.prefix}:*", count=1000))
    if keys:
        r.delete(*keys)


def read_live(r, prefix: str) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for key in r.scan_iter(f"{prefix}:live:*", count=1000):
        tail = key.decode().rsplit(":", 1)[-1]
        if tail.isdigit():
            out[int(tail)] = {k.decode(): int(v) for k, v in r.hgetall(key).items()}
    return out


def read_hash(r, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(key).items()}


def feedback_sent(stats) -> int:
    return sum(stats.feedback.get(k, 0) for k in ("accept", "reject", "edit"))


def rate(c: dict[str, int] | None) -> float | None:
    if not c or not c.get("events"):
        return None
    return c.get("accept", 0) / c["events"]


def run_demo(cfg: LiverlConfig, summary_path: str | None = None, plot_path: str | None = None, live: bool = True) -> dict:
    import redis

    from liverl.admin import open_registry
    from deploy.delta import checksum
    from ingest.sdk import FeedbackClient
    from liverl.demo.base_policy import ensure_base_policy, load_state_dict
    from liverl.core.bus import all_topics, ensure_topics
    from liverl.core.schemas import VersionAnnouncement

    # the SDK's producer shares this process with the users' event loop; its "slow task" warnings are noise here
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    state = cfg.state_path
    state.mkdir(parents=True, exist_ok=True)
    if cfg.model.cache_dir is None:
        cfg.model.cache_dir = str(state / "models")
    demo_dir = state / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    summary_path = Path(summary_path) if summary_path else demo_dir / "summary.json"
    plot_path = Path(plot_path) if plot_path else demo_dir / "acceptance.png"
    prefix = cfg.topics.prefix

    print(f"liverl demo: {cfg.demo.duration_s:.0f} s, {cfg.demo.users} simulated users, state in {state}", flush=True)
    print("[1/4] base policy (built once, then cached) ...", flush=True)
    model_dir = ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed, progress=True)

    print("[2/4] embedded stack: Kafka-compatible broker (Tansu), Redis, SQLite registry, blob folder ...", flush=True)
    stack = start_stack(cfg)
    children: list[Child] = []
    try:
        r = redis.Redis.from_url(stack.redis_url)
        reset_state(cfg, r)
        if "://" not in stack.blob_dir:
            Path(stack.blob_dir).mkdir(parents=True, exist_ok=True)
        ensure_topics(stack.bootstrap, all_topics(cfg), cfg.broker.partitions)
        registry = open_registry(cfg)
        base = load_state_dict(model_dir)
        base_row = registry.init_base(base, str(model_dir))
        r.set(f"{prefix}:desired", VersionAnnouncement(version=0, checksum=checksum(base), reason="base").to_bytes())

        print("[3/4] processes: serve (vLLM + gateway + agent), ingest (faust), learn, gate ...", flush=True)
        log_dir = state / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = child_env(cfg, stack)
        children = [start_child(role, env, log_dir) for role in ROLES]
        gateway = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
        wait_http(f"{gateway}/healthz", 240, children, "the gateway (vLLM engine start)")
        print(f"      gateway ready at {gateway}; logs in {log_dir}", flush=True)

        print(f"[4/4] simulated users for {cfg.demo.duration_s:.0f} s ...", flush=True)
        timeline = Timeline()
        sdk = FeedbackClient(stack.bootstrap, cfg.topics.feedback)
        restarts: dict[str, int] = {}
        stats, failure = _drive(cfg, gateway, sdk, r, registry, children, timeline, live, env, restarts)
        sdk.flush()
        time.sleep(3.0)  # let ingest count the last feedback
        summary = build_summary(cfg, r, registry, timeline, stats, base_row)
        summary["failure"] = failure
        summary["process_restarts"] = restarts
        sdk.close()
    finally:
        stop_children(children)
        stack.close()

    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    plot_timeline(timeline, summary, plot_path)
    print_summary(summary, summary_path, plot_path)
    return summary


MAX_RESTARTS = 3


def _drive(cfg, gateway, sdk, r, registry, children, timeline, live, env, restarts) -> tuple[object, str | None]:
    """Run the users in an asyncio loop on a thread while this thread watches and displays."""
    from liverl.demo.sim import SimStats, run_users

    stats = SimStats()
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None
    ready = threading.Event()

    def users_thread():
        nonlocal stop
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        ready.set()
        loop.run_until_complete(run_users(gateway, sdk, cfg.demo.users, stop, stats, seed=cfg.model.seed + 1))

    th = threading.Thread(target=users_thread, name="sim-users", daemon=True)
    th.start()
    ready.wait()
    prefix = cfg.topics.prefix
    t0 = time.time()
    froze = False
    failure = None
    view = LiveView(cfg, live)
    try:
        with view:
            while (elapsed := time.time() - t0) < cfg.demo.duration_s:
                for i, c in enumerate(children):
                    if c.proc.poll() is None:
                        continue
                    # a supervisor restarts what crashed: each process resumes from its durable state
                    # (learner checkpoint, committed offsets, registry), so nothing accepted is lost
                    restarts[c.role] = restarts.get(c.role, 0) + 1
                    log.error("%s exited with code %s (restart %d of %d); last log lines:\n%s", c.role,
                              c.proc.returncode, restarts[c.role], MAX_RESTARTS, c.tail())
                    if restarts[c.role] > MAX_RESTARTS:
                        failure = f"{c.role} exited with code {c.proc.returncode} {restarts[c.role]} times"
                        break
                    children[i] = start_child(c.role, env, c.log_path.parent)
                if failure:
                    break
                if not froze and elapsed >= cfg.demo.duration_s - cfg.demo.final_window_s:
                    r.set(f"{prefix}:learner:frozen", "1")
                    froze = True
                served = _served_version(r, prefix)
                liv = read_live(r, prefix)
                timeline.add(served, liv)
                view.update(elapsed, stats, served, liv, read_hash(r, f"{prefix}:ingest:counters"),
                            read_hash(r, f"{prefix}:learner"), registry, froze)
                time.sleep(1.0)
    finally:
        loop.call_soon_threadsafe(stop.set)
        th.join(timeout=30)
    return stats, failure


def _served_version(r, prefix: str) -> int | None:
    best = None
    for key in r.scan_iter(f"{prefix}:served:*"):
        raw = r.get(key)
        if raw:
            v = json.loads(raw).get("version")
            best = v if best is None else max(best, v)
    return best


class LiveView:
    """The live progress display: rich when on a terminal (or asked), plain lines every 10 s otherwise."""

    def __init__(self, cfg: LiverlConfig, live: bool):
        self.cfg = cfg
        self.live = live and sys.stdout.isatty()
        self._rich = None
        self._last_line = 0.0
        self._last = (time.time(), 0)
        self._rate = 0.0

    def __enter__(self):
        if self.live:
            from rich.live import Live

            self._rich = Live(refresh_per_second=2, transient=False)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc):
        if self._rich is not None:
            self._rich.__exit__(*exc)

    def update(self, elapsed, stats, served, live, ingest, learner, registry, froze) -> None:
        now = time.time()
        sent = feedback_sent(stats)
        t_prev, n_prev = self._last
        if now - t_prev >= 2.0:
            self._rate = (sent - n_prev) / (now - t_prev)
            self._last = (now, sent)
        rows = []
        try:
            versions = registry.list()
        except Exception:  # noqa: BLE001 - a busy SQLite read only delays the display
            versions = []
        by_v = {v.version: v for v in versions}
        # the base, every version users have judged (latest few), and the newest candidate
        judged = sorted(v for v, c in live.items() if c.get("events"))
        shown = {0, *judged[-6:], *([max(by_v)] if by_v else []), *([served] if served is not None else [])}
        for v in sorted(shown):
            row = by_v.get(v)
            acc = rate(live.get(v))
            rows.append((v, row.status if row else "?", live.get(v, {}).get("events", 0), acc))
        if self._rich is not None:
            from rich.table import Table

            t = Table(title=f"liverl demo  {elapsed:5.0f}/{self.cfg.demo.duration_s:.0f} s"
                      + ("  (learner frozen: measuring the last version)" if froze else ""))
            for col in ("version", "status", "live events", "live acceptance"):
                t.add_column(col, justify="right")
            for v, st, ev, acc in rows:
                mark = " <- served" if v == served else ""
                t.add_row(f"v{v}{mark}", st, str(ev), "-" if acc is None else f"{acc:.1%}")
            t.caption = (f"feedback {self._rate:6.1f}/s  sent {sent}  requests {stats.requests}  errors {stats.errors}  "
                         f"samples out {ingest.get('samples_out', 0)}  trained {learner.get('samples_trained', 0)}  "
                         f"step {learner.get('step', 0)}  dead letters "
                         f"{sum(int(v) for k, v in ingest.items() if k.startswith('dlq:'))}")
            self._rich.update(t)
        elif now - self._last_line >= 10.0:
            self._last_line = now
            acc = ", ".join(f"v{v}={'-' if a is None else f'{a:.0%}'}({ev})" for v, _, ev, a in rows)
            print(f"[{elapsed:4.0f}s] served v{served}  feedback {self._rate:.0f}/s (sent {sent})  "
                  f"trained {learner.get('samples_trained', 0)}  live acceptance: {acc}", flush=True)


def build_summary(cfg, r, registry, timeline: Timeline, stats, base_row) -> dict:
    prefix = cfg.topics.prefix
    live = read_live(r, prefix)
    rows = registry.list()
    promoted = [v for v in rows if v.version != 0 and v.promoted_at is not None]
    promoted.sort(key=lambda v: v.promoted_at)
    last = promoted[-1] if promoted else None
    base_c = live.get(0, {})
    last_c = live.get(last.version, {}) if last else {}
    ingest = read_hash(r, f"{prefix}:ingest:counters")
    learner = read_hash(r, f"{prefix}:learner")
    swaps = [json.loads(x) for x in r.lrange(f"{prefix}:swaps", 0, -1)]
    candidates = [v for v in rows if v.version != 0]
    base_acc, last_acc = rate(base_c), rate(last_c)
    summary = {
        "base_acceptance": base_acc,
        "last_promoted_acceptance": last_acc,
        "base_feedback_events": base_c.get("events", 0),
        "last_promoted_feedback_events": last_c.get("events", 0),
        "last_promoted_version": last.version if last else None,
        "lift_points": None if base_acc is None or last_acc is None else round(100 * (last_acc - base_acc), 2),
        "feedback_events": int(ingest.get("feedback_in", 0)),
        "feedback_sent": feedback_sent(stats),
        "users_view": stats.snapshot(),
        "requests": stats.requests,
        "request_errors": stats.errors,
        "samples_trained": int(learner.get("samples_trained", 0)),
        "learner_steps": int(learner.get("step", 0)),
        "versions_produced": len(candidates),
        "versions_promoted": len(promoted),
        "versions_rejected": sum(1 for v in candidates if v.status == "rejected"),
        "delta_bytes": {str(v.version): v.delta_bytes for v in candidates},
        "delta_ratio": {str(v.version): v.ratio for v in candidates},
        "delta_changed_fraction": {str(v.version): v.changed_fraction for v in candidates},
        "delta_codec": codec_report(registry, candidates),
        "hot_swap_pause_ms": [s.get("pause_ms") for s in swaps],
        "swaps": swaps,
        "live_by_version": {str(v): {**c, "acceptance": rate(c)} for v, c in sorted(live.items())},
        "dead_letters": {k.removeprefix("dlq:"): int(v) for k, v in ingest.items() if k.startswith("dlq:")},
        "duplicates_dropped": int(ingest.get("duplicates", 0)),
        "duration_s": cfg.demo.duration_s,
        "users": cfg.demo.users,
    }
    summary["ok"] = bool(
        summary["versions_promoted"] >= 3
        and summary["lift_points"] is not None and summary["lift_points"] >= 15
        and summary["base_feedback_events"] >= 300 and summary["last_promoted_feedback_events"] >= 300
    )
    return summary


def codec_report(registry, candidates, sample: int = 12) -> dict:
    """How the stored deltas compare with the obvious alternatives, on the last ``sample`` versions.

    For each, the same parent -> child change as XOR + zstd(3) and as plain zstd(3) of the child's weights,
    next to the registry's delta (header and checksums included). Medians of the ratios (raw / bytes).
    """
    import numpy as np
    import torch
    import zstandard

    from deploy.delta import read_header

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy()

    rows = []
    recent = sorted((c for c in candidates if c.parent is not None and c.delta_bytes), key=lambda c: c.version)
    for v in recent[-sample:]:
        try:
            parent, child = registry.materialize(v.parent), registry.materialize(v.version)
            methods = read_header(registry.delta_for(v.version)).method_bytes
        except Exception as e:  # noqa: BLE001 -- a report; a missing blob is shown, not fatal
            rows.append({"version": v.version, "error": str(e)})
            continue
        zc = zstandard.ZstdCompressor(level=3)
        xor_zstd = sum(len(zc.compress(np.bitwise_xor(raw(parent[k]), raw(t)).tobytes())) for k, t in child.items())
        plain = sum(len(zc.compress(raw(t).tobytes())) for t in child.values())
        rows.append({"version": v.version, "changed_fraction": v.changed_fraction, "raw_bytes": v.raw_bytes,
                     "delta_bytes": v.delta_bytes, "ratio_liverl": v.raw_bytes / v.delta_bytes,
                     "ratio_xor_zstd": v.raw_bytes / xor_zstd, "ratio_zstd": v.raw_bytes / plain,
                     "method_bytes": methods})

    def median(key):
        xs = sorted(r[key] for r in rows if key in r)
        return xs[len(xs) // 2] if xs else None

    return {"versions": rows, "median_ratio_liverl": median("ratio_liverl"),
            "median_ratio_xor_zstd": median("ratio_xor_zstd"), "median_ratio_zstd": median("ratio_zstd"),
            "median_changed_fraction": median("changed_fraction")}


def plot_timeline(timeline: Timeline, summary: dict, path: Path, window_s: float = 10.0) -> None:
    """Live acceptance per version over time: the rate over each `window_s` window of feedback, colour by version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    pts = timeline.points
    versions = sorted({v for p in pts for v in p["live"]})
    cmap = plt.get_cmap("viridis", max(2, len(versions)))
    for i, v in enumerate(versions):
        xs, ys = [], []
        prev = None
        for p in pts:
            cur = p["live"].get(v)
            if cur is None:
                continue
            if prev is None:
                prev = (p["t"], *cur)
                continue
            if p["t"] - prev[0] >= window_s:
                d_acc, d_ev = cur[0] - prev[1], cur[1] - prev[2]
                if d_ev >= 10:
                    xs.append((p["t"] + prev[0]) / 2)
                    ys.append(d_acc / d_ev)
                prev = (p["t"], *cur)
        if xs:
            final = summary["live_by_version"].get(str(v), {}).get("acceptance")
            label = f"v{v}" + ("" if final is None else f" ({final:.0%} overall)")
            ax.plot(xs, ys, "o-", color=cmap(i), label=label, markersize=3)
    ax.set_xlabel("demo time (s)")
    ax.set_ylabel(f"live acceptance (per {window_s:.0f} s window)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    title = "liverl demo: live acceptance by served version"
    if summary.get("lift_points") is not None:
        title += f"  (base {summary['base_acceptance']:.0%} -> v{summary['last_promoted_version']} " \
                 f"{summary['last_promoted_acceptance']:.0%})"
    ax.set_title(title)
    if versions:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, ncol=1 if len(versions) <= 16 else 2,
                  title="served version")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(summary: dict, summary_path: Path, plot_path: Path) -> None:
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    print()
    print("liverl demo summary")
    print("-------------------")
    print(f"base (v0) live acceptance      {pct(summary['base_acceptance'])} on {summary['base_feedback_events']} events")
    print(f"last promoted (v{summary['last_promoted_version']}) acceptance "
          f"{pct(summary['last_promoted_acceptance'])} on {summary['last_promoted_feedback_events']} events")
    print(f"lift                           {summary['lift_points']} points")
    print(f"feedback events                {summary['feedback_events']}  (samples trained {summary['samples_trained']})")
    print(f"versions produced / promoted / rejected   {summary['versions_produced']} / "
          f"{summary['versions_promoted']} / {summary['versions_rejected']}")
    pauses = [p for p in summary["hot_swap_pause_ms"] if p is not None]
    if pauses:
        print(f"hot-swap pause ms              median {sorted(pauses)[len(pauses) // 2]:.1f}, max {max(pauses):.1f}")
    ratios = [r for r in summary["delta_ratio"].values() if r]
    if ratios:
        print(f"delta ratio (raw/delta)        median {sorted(ratios)[len(ratios) // 2]:.1f}x over {len(ratios)} deltas")
    codec = summary.get("delta_codec") or {}
    if codec.get("median_ratio_liverl"):
        print(f"  same changes, last {len(codec['versions'])}: liverl {codec['median_ratio_liverl']:.1f}x, "
              f"xor+zstd {codec['median_ratio_xor_zstd']:.1f}x, plain zstd {codec['median_ratio_zstd']:.2f}x "
              f"(median {codec['median_changed_fraction']:.1%} of elements changed)")
    if summary["dead_letters"]:
        print(f"dead letters                   {summary['dead_letters']}")
    if summary.get("process_restarts"):
        print(f"process restarts               {summary['process_restarts']} (see .liverl/logs/)")
    if summary.get("failure"):
        print(f"FAILURE: {summary['failure']}")
    print(f"goals met (>=3 promoted, +15 points on >=300 events each): {'yes' if summary['ok'] else 'NO'}")
    print(f"summary: {summary_path}\nplot:    {plot_path}")
