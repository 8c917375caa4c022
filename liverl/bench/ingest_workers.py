"""The worker side of ``liverl bench ingest``: start N ``liverl ingest`` processes on fresh topics, wait until they
share every partition, write the backlog, and time the join from the live counters in Redis, with the CPU the
workers, the broker and Redis spent meanwhile (``run_workers``; ``liverl.bench.ingest`` says what each figure means).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from core import keys
from core.services import free_port

POLL_S = 0.02  # how often the bench reads the joined count from Redis (the span is known to this much)


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all the machine's cores so far, from ``/proc/stat``."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user time
    return total - idle, total


def _helper_pids(stack, r) -> dict[str, int]:
    """The broker's and Redis's processes, where they run on this machine (their CPU is part of each event's cost)."""
    pids = {name: proc.pid for name, proc in stack.procs if name in ("broker", "redis")}
    if "redis" not in pids:
        try:
            pid = int(r.info("server")["process_id"])
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("redis"):
                pids["redis"] = pid
        except (OSError, KeyError, ValueError):
            pass  # Redis elsewhere: its CPU is not this machine's
    return pids


def _wait_ready(
    ports: list[int], procs: list[subprocess.Popen], partitions: int, timeout_s: float, log_dir: Path
) -> None:
    """Until every worker's ``/healthz`` says its join table is ready and together they hold every partition."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held: list[int] = []
        ready = 0
        for port, p in zip(ports, procs, strict=True):
            if p.poll() is not None:
                raise RuntimeError(f"an ingest worker exited with code {p.returncode}; see {log_dir}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    health = json.loads(resp.read())
            except (OSError, ValueError):
                continue  # not listening yet
            if health.get("ready") and health.get("partitions"):
                ready += 1
                held += health["partitions"]
        if ready == len(ports) and sorted(held) == list(range(partitions)):
            return
        time.sleep(0.1)
    raise RuntimeError(
        f"{len(ports)} ingest worker(s) did not share the {partitions} partitions within "
        f"{timeout_s:.0f} s; see the logs in {log_dir}"
    )


def run_workers(cfg, stack, n_workers: int, pairs: int, timeout_s: float, log_dir: Path, write) -> dict:
    """Start ``n_workers`` ``liverl ingest`` processes on the empty topics of ``cfg.topics``; once every one is
    ready, ``write()`` the backlog and time the join.

    The workers start before the backlog so that the figure is N running workers' throughput: started on a
    waiting backlog, one worker on a shared machine came up a second after the other and the first took half the
    backlog alone meanwhile (a 50,000-pair backlog takes two workers about 1.3 s). The start-up is reported apart.
    """
    import redis

    env_base = {
        **os.environ,
        "LIVERL__BROKER__BOOTSTRAP": stack.bootstrap,
        "LIVERL__REDIS__URL": stack.redis_url,
        "LIVERL__TOPICS__PREFIX": cfg.topics.prefix,
        "LIVERL__BROKER__PARTITIONS": str(cfg.broker.partitions),
        "PYTHONUNBUFFERED": "1",
    }
    r = redis.Redis.from_url(stack.redis_url)
    helpers = _helper_pids(stack, r)
    ckey = keys.ingest_counters(cfg.topics.prefix)
    lkey = keys.live(cfg.topics.prefix, 0)  # the backlog's generations are all policy version 0
    procs: list[subprocess.Popen] = []
    logs = []
    t_start = time.perf_counter()
    ports = [free_port() for _ in range(n_workers)]
    try:
        for i in range(n_workers):
            env = {
                **env_base,
                "LIVERL__STATE_DIR": str(Path(cfg.state_dir) / f"worker{n_workers}-{i}"),
                "LIVERL__INGEST__WEB_PORT": str(ports[i]),
            }
            log = open(log_dir / f"ingest-{cfg.topics.prefix}-{i}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "liverl.cli", "ingest"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        _wait_ready(ports, procs, cfg.broker.partitions, timeout_s, log_dir)
        t_ready = time.perf_counter()
        write()
        m = _time_join(r, lkey, procs, helpers, pairs, timeout_s, log_dir)
        counters = {k.decode(): int(v) for k, v in r.hgetall(ckey).items()}
    finally:
        _stop(procs, logs)
        r.close()
    if m["joined"] < pairs:
        raise RuntimeError(
            f"{n_workers} worker(s) joined {m['joined']} of {pairs} events within {timeout_s:.0f} s; "
            f"see the logs in {log_dir}"
        )
    return _result(n_workers, m, counters, t_ready - t_start)


def _time_join(
    r, lkey: str, procs: list[subprocess.Popen], helpers: dict[str, int], pairs: int, timeout_s: float, log_dir: Path
) -> dict:
    """Poll the joined count until ``pairs`` events are joined (or ``timeout_s``), with the CPU and machine ticks at
    the first poll that saw joins and at the last."""
    t_first = None
    joined = joined_first = 0
    cpu_first = 0.0
    helpers_first: dict[str, float] = {}
    ticks_first = (0, 0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = r.hget(lkey, "events")
        joined = int(raw or 0)
        now = time.perf_counter()
        if joined and t_first is None:
            t_first, joined_first = now, joined
            cpu_first = sum(_cpu_seconds(p.pid) for p in procs)
            helpers_first = {name: _cpu_seconds(pid) for name, pid in helpers.items()}
            ticks_first = _machine_ticks()
        if joined >= pairs:
            break
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"an ingest worker exited with code {p.returncode}; see {log_dir}")
        time.sleep(POLL_S)
    t_last = time.perf_counter()
    cpu = sum(_cpu_seconds(p.pid) for p in procs)
    helpers_cpu = {name: _cpu_seconds(pid) - helpers_first.get(name, 0.0) for name, pid in helpers.items()}
    ticks = _machine_ticks()
    return {
        "joined": joined,
        "joined_first": joined_first,
        "t_first": t_first,
        "t_last": t_last,
        "cpu": cpu,
        "cpu_first": cpu_first,
        "helpers_cpu": helpers_cpu,
        "ticks": ticks,
        "ticks_first": ticks_first,
    }


def _stop(procs: list[subprocess.Popen], logs: list) -> None:
    """Terminate the workers (kill one that does not exit within 30 s) and close their logs."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    for log in logs:
        log.close()


def _result(n_workers: int, m: dict, counters: dict[str, int], start_s: float) -> dict:
    """One worker count's row from the join's measurements ``m`` (``_time_join``)."""
    joined, joined_first, t_first, t_last = m["joined"], m["joined_first"], m["t_first"], m["t_last"]
    ticks, ticks_first = m["ticks"], m["ticks_first"]
    dead = sum(v for k, v in counters.items() if k.startswith("dlq:"))
    span = max(t_last - (t_first or t_last), 1e-9)
    # events/s counts the events joined between the first poll that saw joins and the last one (those the first poll
    # saw were joined before the span began: counting them in it flattered a worker whose first count came late); a
    # backlog joined before the second poll has no span: its rate is shown as at least what one poll interval gives
    # CPU while joining (start-up imports and the group join left out): what a worker costs per event, and how much
    # of a core each worker kept busy (below 100%: it waited for the broker or Redis)
    cpu_join = m["cpu"] - m["cpu_first"]
    n_span = max(joined - joined_first, 1)
    busy, total = ticks[0] - ticks_first[0], ticks[1] - ticks_first[1]
    return {
        "workers": n_workers,
        "joined": joined,
        "replayed": counters.get("joined", 0) - joined,
        "dead_letters": dead,
        "start_s": start_s,
        "seconds": span,
        "events_per_s": (joined - joined_first) / span if joined > joined_first else joined / max(span, POLL_S),
        "cpu_us_per_event": 1e6 * cpu_join / n_span,
        # what the broker and Redis spent per event meanwhile, and how busy the machine's cores were: a machine
        # near 100% holds no more events/s whatever the number of workers
        "helpers_us_per_event": {name: 1e6 * c / n_span for name, c in m["helpers_cpu"].items()},
        "machine_busy": busy / total if total > 0 else float("nan"),
        "core_use": cpu_join / span / n_workers,
        "counters": counters,
    }
