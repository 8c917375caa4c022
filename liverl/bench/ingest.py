"""``liverl bench ingest``: joined feedback events/s of the ingest worker against a raw consumer, one run.

What it measures, on one broker (the embedded one, or ``broker.bootstrap``) and one Redis:

1. A backlog of ``--pairs`` generation records and their feedback (the demo's sizes: a short prompt, a
   completion with its log-probs; every second user accepts) is written to fresh topics with ``--partitions``
   partitions, keyed by generation id as the gateway and the SDK write them, with a product's timestamps
   (``GENERATIONS_PER_S``, each judged ``FEEDBACK_DELAY_S`` after it was served): the backlog a worker catches up
   on after an outage. Generations first, then feedback; the worker reads the two in step by timestamp
   (``ingest.app`` ``_hold_back``), so each feedback finds its generation waiting, the common case.
2. **raw consumer**: an aiokafka consumer (the client faust runs on) reads both topics from the start to the end;
   **raw + parse** does the same and also validates every record with ``core.schemas``; **faust agent,
   consume only** is a faust app that takes the same records in ``take_events`` batches, as ingest does, and does
   nothing with them. These are the ceilings: what the broker hands one Python process, what is left after
   parsing, and what faust's own consume path leaves for any faust-based worker.
3. **ingest, N workers**: ``liverl ingest`` processes (N = each of ``--workers``) start on fresh topics and a
   fresh consumer group per run, so each run does the whole work. Once every worker's ``/healthz`` says it is
   ready and together they hold every partition (``start s`` after their start), the backlog is written, and the
   bench reads the joined count from the live counters in Redis every 20 ms: the per-version ``events``, counted
   exactly once per ``feedback_id`` (the operational ``joined`` counter is at-least-once: a batch replayed after a
   rebalance counts again, which would flatter several workers). Writing the backlog only then measures N running
   workers: started on a waiting backlog, one of two workers came up a second after the other, which meanwhile
   took half the backlog alone. ``events/s`` is joined feedback events per second from the first joined event to
   the last, ``CPU us/event`` the workers' CPU time per event meanwhile (less sensitive to a shared machine's
   noise), ``core use`` how much of a core each worker kept busy (under 100%: it waited for the broker, Redis or
   a core the machine did not give it). ``broker + Redis us/event`` is the CPU the broker and Redis spent per
   event meanwhile (where they run on this machine), and ``machine busy`` the share of all the machine's cores in
   use: near 100%, the figure is the machine's, not the workers'.

``scaling`` is the events/s of N workers over 1 worker's, in the same run. A second worker only helps if a core
is free for it: the table prints the machine's cores, and the broker, Redis and the bench share them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from core import fleet
from core.config import load_config
from core.schemas import FeedbackEvent, GenerationRecord, SamplingParams, WireError
from core.services import forget_prefix
from liverl.bench.ingest_workers import run_workers
from liverl.bench.serve import _free_port, _machine
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {"pairs": 50_000, "partitions": 4, "workers": "1,2", "timeout": 600.0, "repeat": 1}


# ------------------------------------------------------------------------------------------------ the backlog


GENERATIONS_PER_S = 200  # the backlog's pace: the last GENERATIONS_PER_S x seconds of a product's traffic
FEEDBACK_DELAY_S = (2.0, 30.0)  # a user judges a generation this long after it was served


BENCH_USERS = 5000
"""Distinct users the bench's generations come from (as in the demo's population)."""


def _records(n: int, seed: int = 0) -> tuple[list[tuple[bytes, bytes, int]], list[tuple[bytes, bytes, int]]]:
    """``n`` (key, generation record, timestamp ms) and (key, feedback event, timestamp ms) pairs, valid under the wire
    schemas, timed and from ``BENCH_USERS`` users (the canary's per-user sums cost Redis work). The timestamps are a
    product's: generations ``GENERATIONS_PER_S`` a second, each judged
    ``FEEDBACK_DELAY_S`` later, all in the past (a backlog a worker catches up on)."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    now = time.time()
    gens, fbs = [], []
    start = now - n / GENERATIONS_PER_S - FEEDBACK_DELAY_S[1]
    run = f"{os.getpid()}{rng.randrange(1 << 30):x}"
    for i in range(n):
        gid = f"g-{run}-{i}"
        t_gen = start + i / GENERATIONS_PER_S
        t_fb = t_gen + rng.uniform(*FEEDBACK_DELAY_S)
        n_prompt, n_comp = rng.randint(12, 24), rng.randint(3, 8)
        rec = GenerationRecord(
            generation_id=gid,
            policy_version=0,
            node="bench",
            prompt="What is 12 + 34?",
            completion=" 46",
            prompt_token_ids=[rng.randrange(1, 500) for _ in range(n_prompt)],
            completion_token_ids=[rng.randrange(1, 500) for _ in range(n_comp)],
            completion_logprobs=[-rng.random() * 3 for _ in range(n_comp)],
            sampling=sampling,
            finish_reason="stop",
            latency_s=rng.uniform(0.05, 0.5),
            unit=fleet.unit_id(f"user-{rng.randrange(BENCH_USERS)}"),
            ts=t_gen,
        )
        fb = FeedbackEvent(feedback_id=f"f-{run}-{i}", generation_id=gid, kind="accept" if i % 2 else "reject", ts=t_fb)
        key = gid.encode()
        gens.append((key, rec.model_dump_json().encode(), int(t_gen * 1000)))
        fbs.append((key, fb.model_dump_json().encode(), int(t_fb * 1000)))
    return gens, fbs


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, int]]) -> None:
    """Write records with librdkafka, partitioned like kafka-python and aiokafka (murmur2 of the key)."""
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",
            "linger.ms": 20,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 1_000_000,
            "acks": "all",
        }
    )
    failed: list[str] = []

    def report(err, _msg):
        if err is not None:
            failed.append(str(err))

    for key, value, ts_ms in records:
        while True:
            try:
                p.produce(topic, value=value, key=key, timestamp=ts_ms, on_delivery=report)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(120)
    if left or failed:
        raise RuntimeError(f"writing the backlog to {topic} failed: {left} not delivered, errors {failed[:3]}")


# ------------------------------------------------------------------------------------------------ the ceilings


async def _raw_consume(bootstrap: str, topics: list[str], partitions: int, expect: int, parse: bool) -> dict:
    """Read ``expect`` records from the start of ``topics`` with one aiokafka consumer; optionally parse each."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    model = {topics[0]: GenerationRecord, topics[1]: FeedbackEvent}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        fetch_max_wait_ms=200,
        max_partition_fetch_bytes=4 << 20,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        seen = bad = 0
        t0 = None
        deadline = time.monotonic() + 300
        while seen < expect and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=10_000)
            if t0 is None and batch:
                t0 = time.perf_counter()
            for tp, msgs in batch.items():
                seen += len(msgs)
                if parse:
                    m = model[tp.topic]
                    for msg in msgs:
                        try:
                            m.from_bytes(msg.value)
                        except WireError:
                            bad += 1
        elapsed = time.perf_counter() - (t0 or time.perf_counter())
    finally:
        await consumer.stop()
    if seen < expect:
        raise RuntimeError(f"the raw consumer read {seen} of {expect} records within 300 s")
    if bad:
        raise RuntimeError(f"{bad} backlog records did not parse")
    return {"records": seen, "seconds": elapsed, "records_per_s": seen / elapsed, "events_per_s": seen / 2 / elapsed}


def _faust_floor_child(bootstrap: str, topics: list[str], partitions: int, expect: int, out_path: str) -> None:
    """A faust app that only consumes: both topics, ``take_events`` batches as ingest takes them, no work."""
    import faust

    logging.basicConfig(level=logging.WARNING)
    app = faust.App(
        f"floor{os.getpid()}",
        broker=f"kafka://{bootstrap}",
        store="memory://",
        autodiscover=False,
        web_enabled=False,
        topic_partitions=partitions,
        broker_rebalance_timeout=3.0,
        broker_session_timeout=6.0,
        broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="raw",
    )
    inputs = app.topic(*topics, key_type=str, key_serializer="raw", value_serializer="raw", partitions=partitions)
    state = {"n": 0, "t0": None}

    @app.agent(inputs)
    async def count(stream):
        async for events in stream.take_events(200, within=0.05):
            if state["t0"] is None:
                state["t0"] = time.perf_counter()
            state["n"] += len(events)
            if state["n"] >= expect:
                elapsed = time.perf_counter() - state["t0"]
                Path(out_path).write_text(json.dumps({"records": state["n"], "seconds": elapsed}))
                os._exit(0)

    worker = faust.Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False)
    worker.spinner = None
    worker.execute_from_commandline()


def _faust_floor(bootstrap: str, topics: list[str], partitions: int, expect: int, work_dir: Path) -> dict:
    """What faust's consume path alone costs: the ceiling of any faust-based worker on this machine."""
    if importlib.util.find_spec("faust") is None:
        raise ValueError(
            "`liverl bench ingest` compares the worker with faust-streaming, which is not installed: "
            "pip install 'liverl[bench]' (scripts/setup.sh installs it)"
        )

    out = work_dir / "faust-floor.json"
    out.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(
        target=_faust_floor_child, args=(bootstrap, topics, partitions, expect, str(out)), name="faust-floor"
    )
    proc.start()
    proc.join(600)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    if not out.exists():
        raise RuntimeError(f"the consume-only faust app did not read {expect} records (exit code {proc.exitcode})")
    res = json.loads(out.read_text())
    res["records_per_s"] = res["records"] / res["seconds"]
    res["events_per_s"] = res["records_per_s"] / 2
    return res


# ------------------------------------------------------------------------------------------------ the bench


def run(
    pairs: int = DEFAULTS["pairs"],
    partitions: int = DEFAULTS["partitions"],
    workers: tuple[int, ...] = (1, 2),
    timeout_s: float = DEFAULTS["timeout"],
    config: str | None = None,
    json_path: str | None = None,
    repeat: int = 1,
    command: str = "liverl bench ingest",
) -> dict:
    """Start the stack, write the backlogs, measure the ceilings and the workers; print the table."""
    from core.bus import all_topics, ensure_topics
    from liverl.stack.stack import start_stack

    if pairs < 100 or partitions < 1 or not workers or min(workers) < 1:
        raise ValueError("pairs must be >= 100, partitions and workers >= 1")
    user_cfg = load_config(config)
    user_cfg.state_path.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=user_cfg.state_path))
    base = f"bi{os.getpid()}"

    cfg = load_config(
        config,
        state_dir=str(state),
        topics__prefix=base,
        broker__partitions=partitions,
        broker__embedded_port=_free_port(),
        redis__embedded_port=_free_port(),
    )
    broker_name = cfg.broker.bootstrap or "embedded Tansu"
    print(
        f"bench ingest: {pairs:,} pairs on {partitions} partitions, workers {','.join(map(str, workers))}, "
        f"broker {broker_name}; logs in {state / 'logs'}",
        flush=True,
    )
    gens, fbs = _records(pairs)
    stack = start_stack(cfg)
    rows: list[dict[str, Any]] = []
    try:
        (state / "logs").mkdir(parents=True, exist_ok=True)

        def topics_for(prefix: str):
            run_cfg = load_config(
                config, state_dir=str(state / prefix), topics__prefix=prefix, broker__partitions=partitions
            )
            ensure_topics(stack.bootstrap, all_topics(run_cfg), partitions)
            return run_cfg

        def backlog(run_cfg) -> None:
            t0 = time.perf_counter()
            _produce(stack.bootstrap, run_cfg.topics.generations, gens)
            _produce(stack.bootstrap, run_cfg.topics.feedback, fbs)
            print(
                f"  backlog {run_cfg.topics.prefix}: {2 * pairs:,} records written in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )

        raw_cfg = topics_for(f"{base}raw")
        backlog(raw_cfg)
        rows += _ceilings(stack, [raw_cfg.topics.generations, raw_cfg.topics.feedback], partitions, pairs, state)
        for n in workers:
            runs = []
            for k in range(max(1, repeat)):
                run_cfg = topics_for(f"{base}w{n}" + (f"r{k}" if k else ""))
                res = run_workers(run_cfg, stack, n, pairs, timeout_s, state / "logs", lambda c=run_cfg: backlog(c))
                runs.append(res)
                _print_run(n, k, res)
            rows.append(_median_run(n, runs))
    finally:
        try:
            forget_prefix(stack.redis_url, base)
        finally:
            stack.close()
    summary = _summary(rows, pairs, partitions, broker_name, command)
    print(_table(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _ceilings(stack, topics: list[str], partitions: int, pairs: int, state: Path) -> list[dict[str, Any]]:
    """The raw consumer's rows (without and with parsing) and the faust agent's, on the backlog in ``topics``."""
    rows: list[dict[str, Any]] = []
    for parse in (False, True):
        res = asyncio.run(_raw_consume(stack.bootstrap, topics, partitions, 2 * pairs, parse))
        res["side"] = "raw consumer + parse" if parse else "raw consumer"
        rows.append(res)
        print(
            f"  {res['side']}: {res['records_per_s']:,.0f} records/s ({res['events_per_s']:,.0f} pairs/s)",
            flush=True,
        )
    res = _faust_floor(stack.bootstrap, topics, partitions, 2 * pairs, state)
    res["side"] = "faust agent, consume only"
    rows.append(res)
    print(f"  {res['side']}: {res['records_per_s']:,.0f} records/s ({res['events_per_s']:,.0f} pairs/s)", flush=True)
    return rows


def _median_run(n: int, runs: list[dict]) -> dict:
    """The median of one worker count's runs, with every run's events/s."""
    res = sorted(runs, key=lambda r: r["events_per_s"])[len(runs) // 2]  # the median run
    res = {**res, "runs": [r["events_per_s"] for r in runs]}
    res["side"] = f"ingest, {n} worker{'s' if n > 1 else ''}"
    return res


def _print_run(n: int, k: int, res: dict) -> None:
    print(
        f"  ingest, {n} worker(s), run {k + 1}: {res['events_per_s']:,.0f} joined events/s, "
        f"{res['cpu_us_per_event']:.0f} us CPU per event, {res['core_use']:.0%} of a core per worker, "
        f"{_helpers(res)} us per event in {'/'.join(res['helpers_us_per_event']) or 'no local helper'}, "
        f"machine {_share(res['machine_busy'])} busy, "
        f"all ready {res['start_s']:.1f} s after start, "
        f"{res['replayed']} joins replayed",
        flush=True,
    )


def _summary(rows: list[dict[str, Any]], pairs: int, partitions: int, broker_name: str, command: str) -> dict:
    """The rows with each worker count's scaling against one worker's, and what the table's footer shows."""
    one = next((r for r in rows if r.get("workers") == 1), None)
    for r in rows:
        if "workers" in r and one is not None:
            r["scaling"] = r["events_per_s"] / one["events_per_s"]
    raw = rows[0]
    return {
        "rows": rows,
        "pairs": pairs,
        "partitions": partitions,
        "broker": broker_name,
        "command": command,
        "machine": _machine(),
        "raw_events_per_s": raw["events_per_s"],
    }


def _table(summary: dict) -> str:
    raw = summary["raw_events_per_s"]
    lines = [
        "",
        "| side | joined events/s | vs raw consumer | scaling vs 1 worker | CPU us/event | core use | "
        "broker + Redis us/event | machine busy | start s | dead letters | joins replayed | runs (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        if "workers" in r:
            scaling = f"{r['scaling']:.2f}x" if "scaling" in r else ""
            lines.append(
                f"| {r['side']} | **{r['events_per_s']:,.0f}** | 1/{raw / r['events_per_s']:.1f} | {scaling} | "
                f"{r['cpu_us_per_event']:.0f} | {r['core_use']:.0%} | {_helpers(r)} | {_share(r['machine_busy'])} | "
                f"{r['start_s']:.1f} | {r['dead_letters']} | {r.get('replayed', 0)} | "
                f"{_spread(r.get('runs', []))} |"
            )
        else:
            lines.append(
                f"| {r['side']} | {r['events_per_s']:,.0f} pairs/s ({r['records_per_s']:,.0f} records/s) | "
                f"1/{raw / r['events_per_s']:.1f} | | | | | | | | | |"
            )
    lines += [
        "",
        f"{summary['pairs']:,} generation + feedback pairs, {summary['partitions']} partitions, broker "
        f"{summary['broker']}; targets: 20,000 events/s per worker, 1.7x with 2 workers",
        f"machine: {summary['machine']}",
        f"reproduce: `{summary['command']}`",
    ]
    return "\n".join(lines)


def _share(x: float) -> str:
    return f"{x:.0%}" if math.isfinite(x) else "-"  # a backlog joined before the second poll has no span


def _helpers(r: dict) -> str:
    """The broker's and Redis's CPU per event, as ``broker + Redis`` (a part running elsewhere is left out)."""
    parts = r.get("helpers_us_per_event", {})
    return " + ".join(f"{parts[k]:.0f}" for k in ("broker", "redis") if k in parts) or "-"


def _spread(runs: list[float]) -> str:
    if len(runs) < 2:
        return "1"
    return f"{len(runs)} ({min(runs):,.0f}-{max(runs):,.0f})"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ingest`` under ``liverl bench``."""
    s = add_bench_parser(
        subparsers,
        "ingest",
        "joined feedback events/s of ingest workers vs a raw consumer",
        __doc__,
    )
    s.add_argument(
        "--pairs",
        type=int,
        default=DEFAULTS["pairs"],
        help="generation + feedback pairs (default 50000: two workers join it in about 1.5 s on 2 "
        "cores; raise it on a bigger machine, where workers finish it too fast to time well)",
    )
    s.add_argument("--partitions", type=int, default=DEFAULTS["partitions"], help="partitions per topic (default 4)")
    s.add_argument(
        "--workers",
        default=DEFAULTS["workers"],
        metavar="N,M",
        help="worker counts to run, comma-separated (default 1,2)",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=DEFAULTS["timeout"],
        metavar="S",
        help="most seconds one worker run may take (default 600)",
    )
    s.add_argument(
        "--repeat",
        type=int,
        default=DEFAULTS["repeat"],
        metavar="K",
        help="run each worker count K times on fresh backlogs; the table shows the median run and the "
        "range (default 1; the machine's noise is why)",
    )
    s.add_argument("--json", metavar="PATH", help="also write the rows and the summary as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    workers = tuple(int(w) for w in str(args.workers).split(",") if w.strip())
    command = "liverl bench ingest" + "".join(
        f" --{name} {getattr(args, name)}"
        for name in ("pairs", "partitions", "workers", "timeout", "repeat")
        if str(getattr(args, name)) != str(DEFAULTS[name])
    )
    run(
        pairs=args.pairs,
        partitions=args.partitions,
        workers=workers,
        timeout_s=args.timeout,
        repeat=args.repeat,
        config=getattr(args, "config", None),
        json_path=args.json,
        command=command,
    )
    return 0
