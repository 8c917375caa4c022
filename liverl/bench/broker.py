"""``liverl bench broker``: what the embedded durable broker's produce batcher buys, and what it costs a producer.

Tansu's ``s3://`` engine writes each produce request's record batch as its own object, updates the partition's
watermark object, and updates one cluster-wide metadata object by a conditional put, which concurrent producers make
conflict and retry: 6-10 PUTs per record here without the batcher, most of them that metadata object. Its produce
batcher (``s3://bucket/?batch_min_size=BYTES&batch_max_delay=DURATION``, set by ``broker.embedded_batch_delay_ms``)
holds produce requests until ``batch_min_size`` bytes have gathered or ``batch_max_delay`` has passed and writes them
together; each acknowledgement still waits for its write (``tests/liverl/test_broker_crash.py`` kills the broker
mid-write with it on). A liverl gateway waits for that acknowledgement before it answers (``serving.log_wait_s``), so
the delay can land on a request's latency.

Each setting gets its own object store (``liverl.stack.objstore``, merging as the stack runs it) and broker. For
``--seconds``, ``--producers`` threads each send records of ``--record-bytes`` at ``--rate`` records/s in all, each
waiting for its acknowledgement as the gateway does (kafka-python, ``acks=all``, ``linger_ms`` 2), into a topic of
``--partitions`` partitions that one consumer tails (its partitions assigned, as the learner assigns its own).
Reported per setting: records acknowledged, the acknowledgement's p50/p99, produce-to-consume p50/p99 (the tail lag a
consumer such as ingest sees), the object store's PUTs and ListObjectsV2 requests per 1,000 records, and the broker's
and object store's CPU seconds.

Every record carries its producer, its sequence number and a digest of its bytes (``_record``), and the consumer
checks each one it reads (``_Reader``): a row also says how many records came back intact, how many with other bytes
than were sent, how many twice, and the first error the client raised reading them (a CRC the client refuses, for
example). A setting that loses or changes a record is not a setting to run, whatever it saves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import queue
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {
    "settings": "off,5ms,20ms,100ms",
    "min_size": 1 << 20,
    "seconds": 30.0,
    "rate": 200.0,
    "producers": 16,
    "partitions": 4,
    "record_bytes": 800,
}


def storage_url(bucket: str, setting: str, min_size: int) -> str:
    """The broker's storage URL for a batcher ``setting`` ("off", or a delay such as "20ms")."""
    if setting == "off":
        return f"s3://{bucket}/"
    if not setting.rstrip("ms").replace(".", "", 1).isdigit() or not setting.endswith("ms"):
        raise ValueError(f"a batcher setting is 'off' or a delay in milliseconds such as '20ms', got {setting!r}")
    return f"s3://{bucket}/?batch_min_size={min_size}&batch_max_delay={setting}"


def _cpu_s(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _requests(log: Path) -> tuple[int, int]:
    """(PUTs, ListObjectsV2 requests) in the object store's access log."""
    puts = lists = 0
    for line in log.read_text(errors="replace").splitlines():
        if '"PUT /' in line:
            puts += 1
        elif "list-type=2" in line:
            lists += 1
    return puts, lists


HEADER = struct.Struct("<dII")  # sent at, producer, sequence number
DIGEST = 16


def _record(t0: float, producer: int, seq: int, pad: bytes) -> bytes:
    """A record's bytes: its header, then a digest of the header and the padding, then the padding."""
    head = HEADER.pack(t0, producer, seq)
    return head + hashlib.blake2b(head + pad, digest_size=DIGEST).digest() + pad


class _Reader:
    """What the consumer read: each record's lag, and whether its bytes are the ones sent."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.got = self.corrupt = self.duplicates = 0
        self.seen: set[tuple[int, int]] = set()
        self.error: str | None = None

    def poll(self, consumer) -> None:
        if self.error is not None:
            return  # past a record the client refuses, a consumer cannot read on without skipping it
        try:
            batches = consumer.poll(timeout_ms=200)
        except Exception as e:  # noqa: BLE001 - reported in the row: what the client refused to read
            self.error = f"{type(e).__name__}: {e}"[:200]
            return
        now = time.time()
        for recs in batches.values():
            for r in recs:
                self.got += 1
                v = r.value or b""
                if len(v) < HEADER.size + DIGEST:
                    self.corrupt += 1
                    continue
                head, digest, pad = v[: HEADER.size], v[HEADER.size : HEADER.size + DIGEST], v[HEADER.size + DIGEST :]
                if hashlib.blake2b(head + pad, digest_size=DIGEST).digest() != digest:
                    self.corrupt += 1
                    continue
                t0, producer, seq = HEADER.unpack(head)
                if (producer, seq) in self.seen:
                    self.duplicates += 1
                self.seen.add((producer, seq))
                self.lags.append(now - t0)


def _produce(boot: str, producers: int, rate: float, record_bytes: int, seconds: float, result) -> None:
    """``producers`` threads, each sending a record and waiting for its acknowledgement, paced to ``rate`` in all, for
    ``seconds``; puts (acknowledgement times, failures) on ``result``."""
    from kafka import KafkaProducer

    acks: list[float] = []
    errors = [0]
    lock = threading.Lock()
    end = time.time() + seconds

    def one(producer: int) -> None:
        p = KafkaProducer(bootstrap_servers=boot, acks="all", linger_ms=2)
        gap, pad = producers / rate, os.urandom(max(0, record_bytes - HEADER.size - DIGEST))
        nxt, seq = time.time(), 0
        while time.time() < end:
            t0 = time.time()
            seq += 1
            try:
                p.send("bench", value=_record(t0, producer, seq, pad)).get(timeout=30)
                with lock:
                    acks.append(time.time() - t0)
            except Exception:  # noqa: BLE001 - counted: a bench row reports failures, it does not stop
                with lock:
                    errors[0] += 1
            nxt += gap
            time.sleep(max(0.0, nxt - time.time()))
        p.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 60)
    result.put((acks, errors[0]))


def run_setting(setting: str, args: argparse.Namespace) -> dict:
    """One batcher setting on a fresh object store and broker: the figures of one row."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    from core.services import free_port
    from liverl.stack import stack

    os.environ["LIVERL_OBJSTORE_ACCESS_LOG"] = "1"
    root = Path(tempfile.mkdtemp(prefix="liverl-bench-broker-"))
    logs = root / "logs"
    logs.mkdir()
    store, sport = stack.start_object_store(root / "broker", logs)
    port = free_port()
    url = storage_url(stack.BROKER_BUCKET, setting, args.min_size)
    broker = stack.start_broker(port, logs, url, stack.broker_env(sport))
    boot = f"127.0.0.1:{port}"
    reader = _Reader()
    try:
        KafkaAdminClient(bootstrap_servers=boot).create_topics([NewTopic("bench", args.partitions, 1)])
        # assigned, as the learner assigns its partitions: a group's join takes seconds on this broker, and records
        # sent meanwhile would be read late for a reason that is not the broker's read path
        consumer = KafkaConsumer(bootstrap_servers=boot, auto_offset_reset="earliest", enable_auto_commit=False)
        consumer.assign([TopicPartition("bench", i) for i in range(args.partitions)])
        consumer.poll(timeout_ms=500)
        cpu0 = _cpu_s(broker.pid) + _cpu_s(store.pid)
        puts0, lists0 = _requests(logs / "broker-storage.log")

        ctx = multiprocessing.get_context("spawn")  # the producers in their own process: the GIL they would share with
        # the consumer here made its reads seconds late (6.4 s p50 in one process, 0.1 s apart)
        result = ctx.Queue()
        producers = ctx.Process(
            target=_produce,
            args=(boot, args.producers, args.rate, args.record_bytes, args.seconds, result),
            daemon=True,
        )
        t_start = time.time()
        producers.start()
        done = None
        while done is None:  # read while the producers run, until they hand in their figures
            reader.poll(consumer)
            try:
                done = result.get_nowait()
            except queue.Empty:
                if time.time() - t_start > args.seconds + 120:
                    raise RuntimeError("the producers' process did not finish") from None
        acks, errors = done
        producers.join(timeout=30)
        deadline = time.time() + 20
        while reader.got < len(acks) and reader.error is None and time.time() < deadline:
            reader.poll(consumer)
        consumer.close()
        cpu = _cpu_s(broker.pid) + _cpu_s(store.pid) - cpu0
        puts, lists = _requests(logs / "broker-storage.log")
        puts, lists = puts - puts0, lists - lists0
    finally:
        for proc in (broker, store):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    n = max(len(acks), 1)
    return {
        "setting": setting,
        "url": url,
        "acked": len(acks),
        "failed": errors,
        "consumed": reader.got,
        "intact": len(reader.seen),
        "corrupt": reader.corrupt,
        "duplicates": reader.duplicates,
        "read_error": reader.error,
        "ack_p50_ms": 1000 * _pct(acks, 0.5),
        "ack_p99_ms": 1000 * _pct(acks, 0.99),
        "lag_p50_ms": 1000 * _pct(reader.lags, 0.5),
        "lag_p99_ms": 1000 * _pct(reader.lags, 0.99),
        "puts_per_1k": 1000 * puts / n,
        "lists_per_1k": 1000 * lists / n,
        "storage_cpu_s": cpu,
    }


def _table(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    out = [
        f"{args.producers} producers waiting for each acknowledgement, {args.rate:g} records/s of {args.record_bytes} "
        f"bytes in all, {args.partitions} partitions, {args.seconds:g} s per setting; batch_min_size {args.min_size}",
        f"command: {command}",
        "",
        "| batcher | acked (failed) | consumed: intact, other bytes, twice | ack p50 / p99 ms | produce->consume "
        "p50 / p99 ms | PUTs per 1k records | listings per 1k records | broker + store CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        read = f"{r['intact']:,}, {r['corrupt']}, {r['duplicates']}"
        if r["read_error"]:
            read += f"; then unreadable ({r['read_error']})"
        out.append(
            f"| {r['setting']} | {r['acked']:,} ({r['failed']}) | {read} | {r['ack_p50_ms']:.1f} / "
            f"{r['ack_p99_ms']:.1f} | {r['lag_p50_ms']:.1f} / {r['lag_p99_ms']:.1f} | {r['puts_per_1k']:,.0f} | "
            f"{r['lists_per_1k']:,.0f} | {r['storage_cpu_s']:.1f} |"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> list[dict]:
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in settings:
        storage_url("b", s, args.min_size)  # a bad setting fails before any broker starts
    small = HEADER.size + DIGEST
    if args.rate <= 0 or args.producers < 1 or args.partitions < 1 or args.seconds <= 0 or args.record_bytes < small:
        raise ValueError(f"--rate and --seconds > 0, --producers and --partitions >= 1, --record-bytes >= {small}")
    command = "liverl bench broker " + " ".join(
        f"--{k.replace('_', '-')} {getattr(args, k)}" for k in DEFAULTS if getattr(args, k) != DEFAULTS[k]
    )
    rows = []
    for s in settings:
        print(f"[bench broker] batcher {s}: {args.seconds:g} s ...", flush=True)
        rows.append(run_setting(s, args))
    print(_table(rows, args, command.strip()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    lost = [r["setting"] for r in rows if r["intact"] < r["acked"] or r["corrupt"] or r["read_error"]]
    if lost:
        print(f"records acknowledged and not read back intact with: {', '.join(lost)}")
    return rows


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``broker`` under ``liverl bench``."""
    s = add_bench_parser(
        subparsers, "broker", "embedded broker's produce batcher: objects, listings, ack wait, tail lag", __doc__
    )
    d = DEFAULTS
    s.add_argument(
        "--settings",
        default=d["settings"],
        help=f"batcher settings to compare, comma-separated: off, or a max delay like 20ms (default {d['settings']})",
    )
    s.add_argument("--min-size", type=int, default=d["min_size"], help="batch_min_size in bytes (default 1 MiB)")
    s.add_argument("--seconds", type=float, default=d["seconds"], help="seconds of load per setting (default 30)")
    s.add_argument("--rate", type=float, default=d["rate"], help="records/s from all producers (default 200)")
    s.add_argument("--producers", type=int, default=d["producers"], help="producer threads (default 16)")
    s.add_argument("--partitions", type=int, default=d["partitions"], help="partitions of the topic (default 4)")
    s.add_argument("--record-bytes", type=int, default=d["record_bytes"], help="bytes per record (default 800)")
    s.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    s.set_defaults(fn=lambda a: 0 if run(a) else 1)
    return s
