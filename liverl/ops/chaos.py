"""``liverl chaos``: the pipeline under the demo's load while its processes are killed with SIGKILL, then an audit.

For ``--duration`` seconds the demo product's simulated users send traffic and feedback, and every ``--kill-every``
seconds (jittered) one process is killed with ``kill -9``, the kind chosen in shuffled rounds so every kind is hit:

- ``ingest``, ``learn``, ``gate``, ``serve`` (the gateway and the hot-swap agent) and ``vllm`` (the node's server);
- ``learn@checkpoint``: the learner while its checkpoint's temporary file is being written;
- ``serve@swap``: the serving process within a fraction of a second of a new version being announced, while the
  agent drains, pauses vLLM and writes the delta.

A kind is only killed once its process is back up (the supervisor restarts what dies, as ``liverl up`` does).
With ``--restarts N`` the whole pipeline (``liverl up``: the embedded broker and its storage, every supervised
process, every vLLM node) is also restarted N times under the load, at even intervals of up time (the load runs
``--duration`` seconds while the pipeline is up). The odd restarts stop it as Ctrl-C does; the even ones kill -9 every
process it started at once (a crash of all of them; not a power loss: the page cache keeps what they wrote, see
``broker.embedded_fsync``). Each time it starts again on the same state folder, as the next ``liverl up`` would. The
users keep sending through it; what they send while it is down fails or waits in the SDK's producer, as it would for a
product. Then the users stop, the learner is held (no new candidates), and the run drains: until ``liverl audit`` finds
nothing queued or in flight and every node serves the stable version, verified by checksum. The summary (printed,
and JSON with ``--summary``) has the kills by kind, the events, lost, trained twice and the time to converge.
The feedback client counts what the broker acknowledged, and the audit checks that the topic holds all of it.
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import json
import logging
import os
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from core import fleet, keys, procs
from core.bus import delivery_timeout_s, kafka_python_security
from core.config import LiverlConfig
from core.product import DEMO_PRODUCT, load_product
from deploy.registry.registry import open_registry
from learner.ledger import checkpoint_path_for
from liverl.ops.audit import print_report, run_audit
from liverl.stack.up import Pipeline
from liverl_sdk import FeedbackClient

log = logging.getLogger("liverl.chaos")

KINDS = ("ingest", "learn", "gate", "serve", "vllm", "learn@checkpoint", "serve@swap")
ROLE_OF = {
    "ingest": "ingest",
    "learn": "learn",
    "gate": "gate",
    "serve": "serve",
    "vllm": "serve",
    "learn@checkpoint": "learn",
    "serve@swap": "serve",
}
MIN_UPTIME_S = {"ingest": 20.0, "learn": 15.0, "gate": 10.0, "serve": 5.0}


def _acked_client(bootstrap: str, topic: str, broker=None):
    """The SDK's client, counting the records the broker acknowledged."""

    class Counting(FeedbackClient):
        acked = 0
        _ack_lock = threading.Lock()

        def _track(self, fut, name):
            def ok(_metadata) -> None:
                with self._ack_lock:
                    Counting.acked += 1

            fut.add_callback(ok)
            return super()._track(fut, name)

    return Counting(
        bootstrap, topic, security=kafka_python_security(broker), delivery_timeout_s=delivery_timeout_s(broker)
    )


def _vllm_pid(serve_pid: int) -> int | None:
    """The vLLM server process the serving process started (its child running the OpenAI entrypoint)."""
    try:
        for child in psutil.Process(serve_pid).children(recursive=True):
            if any("vllm.entrypoints" in part for part in child.cmdline()):
                return child.pid
    except psutil.Error:
        return None
    return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Killer:
    """Chooses and performs the kills; every kill is recorded with its kind, time and what it hit."""

    def __init__(self, cfg: LiverlConfig, pipe: Pipeline, rng: random.Random, kinds: tuple[str, ...] = KINDS):
        self.cfg, self.pipe, self.rng, self.kinds = cfg, pipe, rng, kinds
        self.kills: list[dict] = []
        self.round: list[str] = []
        self.started: dict[int, float] = {}  # pid -> when first seen

    def _child(self, role: str):
        for c in self.pipe.supervisor.children:
            if c.role == role and c.proc.poll() is None:
                return c
        return None

    def ready(self, kind: str) -> bool:
        role = ROLE_OF[kind]
        c = self._child(role)
        if c is None:
            return False
        first = self.started.setdefault(c.proc.pid, time.monotonic())
        if time.monotonic() - first < MIN_UPTIME_S[role]:
            return False
        if role == "serve":
            return _healthy(f"{self.pipe.gateway_url}/healthz")
        return True

    def next_kind(self) -> str | None:
        if not self.round:
            self.round = list(self.kinds)
            self.rng.shuffle(self.round)
        for kind in list(self.round):
            if self.ready(kind):
                self.round.remove(kind)
                return kind
        return None

    def kill(self, kind: str, t0: float) -> dict:
        c = self._child(ROLE_OF[kind])
        note = ""
        if kind == "learn@checkpoint":
            note = self._wait_for_checkpoint_write(timeout_s=20.0)
        elif kind == "serve@swap":
            note = self._wait_for_announcement(timeout_s=90.0)
        pid = c.proc.pid
        if kind == "vllm":
            pid = _vllm_pid(c.proc.pid)
            if pid is None:
                note = "no vLLM child found; killed the serving process"
                pid = c.proc.pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            note = (note + "; " if note else "") + "already gone"
        rec = {"t": round(time.monotonic() - t0, 1), "kind": kind, "pid": pid, "note": note}
        self.kills.append(rec)
        log.warning("chaos: kill -9 %s (pid %d) at %.1f s %s", kind, pid, rec["t"], note)
        return rec

    def _wait_for_checkpoint_write(self, timeout_s: float) -> str:
        """Spin until the learner's checkpoint temp file exists (it lives a few milliseconds)."""
        pattern = str(checkpoint_path_for(self.cfg)) + ".tmp*"
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if glob.glob(pattern):
                return "while writing the checkpoint"
            if time.monotonic() >= next_check:  # the supervisor keeps restarting what an earlier kill hit
                self._supervise()
                next_check = time.monotonic() + 0.5
            time.sleep(0.001)
        return "checkpoint write not caught within 20 s"

    def _wait_for_announcement(self, timeout_s: float) -> str:
        """Wait for the next announced version, then kill within the swap (the agent polls every swap_poll_s)."""
        r, prefix = self.pipe.redis, self.cfg.topics.prefix

        def announced() -> int | None:  # the version, not the bytes: the gate re-signs the same one as it expires
            ann = fleet.read_desired(r, prefix)
            return None if ann is None else ann.version

        before = announced()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if announced() != before:
                time.sleep(self.rng.uniform(0.1, 0.1 + self.cfg.serving.swap_poll_s))
                return "during a hot-swap (just after an announcement)"
            self._supervise()
            time.sleep(0.1)
        return "no announcement within 90 s"

    def _supervise(self) -> None:
        failure = self.pipe.supervisor.check()
        if failure:
            raise RuntimeError(f"chaos: {failure}")


def run_chaos(
    cfg: LiverlConfig,
    model_dir: Path,
    duration_s: float,
    kill_every_s: float,
    seed: int = 0,
    drain_timeout_s: float = 600.0,
    summary_path: str | None = None,
    kinds: tuple[str, ...] = KINDS,
    restarts: int = 0,
) -> dict:
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    product, users = _product_users(cfg)
    rng = random.Random(seed)
    started = time.time()
    _print_plan(cfg, duration_s, kill_every_s, kinds, restarts)
    pipe = _start_pipeline(cfg, model_dir, fresh=True)
    up_restarts: list[dict] = []
    try:
        sdk = _acked_client(pipe.stack.bootstrap, cfg.topics.feedback, cfg.broker)
        stats = product.simulated_stats()
        stop_users, thread = _start_users(users, pipe, sdk, cfg, stats, seed)
        killer = Killer(cfg, pipe, rng, kinds)
        t0 = time.monotonic()
        next_kill = t0 + kill_every_s * rng.uniform(0.5, 1.5) if kinds and kill_every_s > 0 else float("inf")
        # the load runs ``duration_s`` while the pipeline is up: a restart's down time extends it, and the next
        # restart comes an even share of the up time after the pipeline is back
        every = duration_s / (restarts + 1)
        restart_at, end = (t0 + every if restarts else float("inf")), t0 + duration_s
        try:
            while time.monotonic() < end:
                failure = pipe.supervisor.check()
                if failure:
                    raise RuntimeError(f"chaos: {failure}")
                if time.monotonic() >= restart_at:
                    how = "stop" if len(up_restarts) % 2 == 0 else "kill -9"
                    pipe, rec = _restart_pipeline(cfg, model_dir, pipe, how, t0)
                    killer.pipe = pipe
                    up_restarts.append(rec)
                    end += rec["down_s"]
                    restart_at = time.monotonic() + every if len(up_restarts) < restarts else float("inf")
                    next_kill = max(next_kill, time.monotonic() + MIN_UPTIME_S["ingest"])
                    _print_restart(rec, how)
                    continue
                if time.monotonic() >= next_kill:
                    kind = killer.next_kind()
                    if kind is not None:
                        rec = killer.kill(kind, t0)
                        print(f"  {rec['t']:7.1f} s  kill -9 {kind:<17} pid {rec['pid']:<7} {rec['note']}", flush=True)
                        next_kill = time.monotonic() + kill_every_s * rng.uniform(0.5, 1.5)
                time.sleep(0.25)
        finally:
            stop_users()
            thread.join(timeout=60)
        sdk.flush()
        load_end = time.monotonic()
        print(
            f"load stopped after {load_end - t0:.0f} s, {len(killer.kills)} kills and {len(up_restarts)} restarts of "
            "the pipeline; draining ...",
            flush=True,
        )
        report, converge_s = _drain(cfg, pipe, load_end, drain_timeout_s)
        sdk.close()
        restarts_by_role = dict(pipe.supervisor.restarts)
    finally:
        pipe.__exit__(None, None, None)
    leftover = _leftover_processes(cfg, started)
    run = {"duration_s": duration_s, "kill_every_s": kill_every_s, "seed": seed}
    summary = _summary(
        run, kinds, killer.kills, restarts_by_role, up_restarts, sdk.acked, stats, converge_s, report, leftover
    )
    _print_summary(summary, report, converge_s, drain_timeout_s)
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2))
        print(f"summary: {summary_path}")
    return summary


def _product_users(cfg: LiverlConfig):
    """The product (the demo's when none is set) and its simulated users, which drive the load."""
    if cfg.product is None:
        cfg.product = DEMO_PRODUCT
    product = load_product(cfg)
    users = product.simulated_users()
    if users is None:
        raise ValueError(f"product {cfg.product!r} has no simulated users to drive the load")
    return product, users


def _print_plan(cfg: LiverlConfig, duration_s: float, kill_every_s: float, kinds: tuple[str, ...], restarts: int):
    what = [f"a kill -9 every ~{kill_every_s:.0f} s"] if kinds and kill_every_s > 0 else []
    what += [f"{restarts} restarts of the whole pipeline"] if restarts else []
    print(
        f"liverl chaos: {duration_s:.0f} s of load, {' and '.join(what) or 'no kills'}, then drain and audit "
        f"(state in {cfg.state_path})",
        flush=True,
    )


def _print_restart(rec: dict, how: str) -> None:
    print(
        f"  {rec['t']:7.1f} s  restart of the whole pipeline ({how}): {rec['processes']} processes, "
        f"down {rec['down_s']:.0f} s",
        flush=True,
    )


def _drain(cfg: LiverlConfig, pipe: Pipeline, load_end: float, drain_timeout_s: float):
    """Hold the learner, then audit every 10 s until nothing moves, no candidate is pending and every node serves
    the stable version (or ``drain_timeout_s`` passed); returns the last audit and the time it took (None if not)."""
    pipe.redis.set(keys.learner_hold(cfg.topics.prefix), "1")
    registry = open_registry(cfg)
    try:
        report, converge_s = None, None
        while time.monotonic() - load_end < drain_timeout_s:
            failure = pipe.supervisor.check()
            if failure:
                raise RuntimeError(f"chaos: {failure}")
            report = run_audit(cfg, pipe.stack.bootstrap, pipe.redis, registry)
            pending = [c.version for c in registry.candidates()]
            if report.moving == 0 and report.converged and not pending:
                converge_s = time.monotonic() - load_end
                break
            print(
                f"  drain {time.monotonic() - load_end:5.0f} s: {report.moving} events moving, candidates "
                f"pending {pending}, nodes converged {report.converged}",
                flush=True,
            )
            time.sleep(10)
    finally:
        registry.close()
    return report, converge_s


def _summary(
    run: dict, kinds, kills, restarts_by_role, up_restarts, acked, stats, converge_s, report, leftover
) -> dict:
    """The run's summary (``--summary``'s JSON): ``run`` (its duration, kill interval and seed) and what happened;
    ``ok`` when the audit found no problem, the pipeline converged, the topic holds every acknowledged record and no
    process outlived the pipeline."""
    by_kind = {k: sum(1 for x in kills if x["kind"] == k) for k in kinds}
    summary = {
        **run,
        "kills": len(kills),
        "kills_by_kind": by_kind,
        "kill_log": kills,
        "restarts": restarts_by_role,
        "pipeline_restarts": up_restarts,
        "acked_feedback_records": acked,
        "requests": stats.requests,
        "request_errors": stats.errors,
        "converge_s": None if converge_s is None else round(converge_s, 1),
        "audit": report.as_dict() if report is not None else None,
    }
    missing = acked - (report.feedback_records if report else 0)
    summary["acked_not_in_topic"] = max(missing, 0)
    summary["leftover_processes"] = leftover
    summary["ok"] = bool(
        report is not None and not report.problems() and converge_s is not None and missing <= 0 and not leftover
    )
    return summary


def _print_summary(summary: dict, report, converge_s: float | None, drain_timeout_s: float) -> None:
    by_kind, restarts_by_role = summary["kills_by_kind"], summary["restarts"]
    up_restarts, leftover = summary["pipeline_restarts"], summary["leftover_processes"]
    print("\nkills by kind: " + ", ".join(f"{k} {n}" for k, n in by_kind.items()))
    print(f"restarts by the supervisor: {restarts_by_role}")
    if up_restarts:
        print(
            "restarts of the whole pipeline: "
            + ", ".join(f"{r['how']} at {r['t']:.0f} s (down {r['down_s']:.0f} s)" for r in up_restarts)
        )
    print(
        f"feedback records acknowledged by the broker: {summary['acked_feedback_records']} (in the topic: "
        f"{report.feedback_records if report else '?'}); requests {summary['requests']}, "
        f"errors {summary['request_errors']}"
    )
    if report is not None:
        print_report(report)
    print(
        f"converged {converge_s:.0f} s after the load stopped"
        if converge_s is not None
        else f"NOT converged within {drain_timeout_s:.0f} s"
    )
    print(
        f"processes left running after the pipeline stopped: {len(leftover)}"
        + "".join(f"\n  pid {p['pid']} (parent {p['ppid']}): {p['cmd']}" for p in leftover)
    )


def _start_pipeline(cfg: LiverlConfig, model_dir: Path, fresh: bool) -> Pipeline:
    pipe = Pipeline(cfg, model_dir, fresh=fresh).__enter__()
    pipe.supervisor.max_restarts = 1_000_000  # chaos kills on purpose; the supervisor restarts every time
    pipe.supervisor.backoff_max_s = 0.0  # ... and at once (a kill is not a crash loop)
    return pipe


def _restart_pipeline(cfg: LiverlConfig, model_dir: Path, pipe: Pipeline, how: str, t0: float) -> tuple[Pipeline, dict]:
    """Stop the whole pipeline (``stop``: as Ctrl-C stops ``liverl up``; ``kill -9``: every process it started, at
    once, before anything else), then start it again on the same state folder, as the next ``liverl up`` does."""
    t = time.monotonic()
    quiet = logging.getLogger("kafka")  # the users' feedback client retries while the broker is down: expected
    level, quiet.level = quiet.level, logging.CRITICAL
    victims = [psutil.Process(pid) for pid in procs.descendants() - pipe._before]
    if how == "kill -9":
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=10)
    log.warning("chaos: restarting the whole pipeline (%s, %d processes)", how, len(victims))
    pipe.__exit__(None, None, None)  # after a kill -9: reaps what died, stops what a kill left (nothing should)
    pipe = _start_pipeline(cfg, model_dir, fresh=False)
    quiet.setLevel(level)
    rec = {"t": round(t - t0, 1), "how": how, "processes": len(victims), "down_s": round(time.monotonic() - t, 1)}
    return pipe, rec


def _leftover_processes(cfg: LiverlConfig, since: float, settle_s: float = 10.0) -> list[dict]:
    """Processes this run started that outlived the pipeline: any naming its state folder, and orphaned vLLM engine
    processes (``VLLM::...``, reparented to init) started during the run. A kill -9 must not leak them."""
    me = os.getpid()
    state = str(cfg.state_path)
    deadline = time.monotonic() + settle_s  # a stopped node's engine takes a moment to exit
    while True:
        found = []
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "create_time"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if p.info["pid"] == me or (p.info["create_time"] or 0) < since:
                    continue
                if state in cmd or (cmd.startswith("VLLM::") and p.info["ppid"] == 1):
                    found.append({"pid": p.info["pid"], "ppid": p.info["ppid"], "cmd": cmd[:200]})
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def _concurrency_kwargs(users, cfg: LiverlConfig) -> dict:
    """The demo's traffic (``demo.concurrency``), for a product's users that take it (the demo's do)."""
    return (
        {"concurrency": min(cfg.demo.concurrency, cfg.demo.users)}
        if "concurrency" in inspect.signature(users).parameters
        else {}
    )


def _start_users(users, pipe: Pipeline, sdk, cfg: LiverlConfig, stats, seed: int):
    loop = asyncio.new_event_loop()
    box: dict = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        box["stop"] = asyncio.Event()
        ready.set()
        loop.run_until_complete(
            users(
                pipe.gateway_url,
                sdk,
                cfg.demo.users,
                box["stop"],
                stats,
                seed=seed + 1,
                **_concurrency_kwargs(users, cfg),
            )
        )

    th = threading.Thread(target=main, name="chaos-users", daemon=True)
    th.start()
    ready.wait()
    return (lambda: loop.call_soon_threadsafe(box["stop"].set)), th
