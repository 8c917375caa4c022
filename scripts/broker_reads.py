"""How fast the embedded durable broker (Tansu on ``liverl.stack.objstore``) reads a partition of small record batches,
and how many listings a consumer at the tail costs it. In hour-long demo runs ingest and the learner can fall minutes
behind on this broker; this separates the broker's read path from the rest of the demo's load.

    python scripts/broker_reads.py [--batches 3000] [--max-records 100000]

It starts its own object store (merging off, so every batch stays one object, as at a partition's unmerged tail) and
Tansu on a free port, produces ``--batches`` batches of 2 records (~150 bytes each, one send and flush per batch, as
the gateway sends generations), reads them back from offset 0, from the middle and from an odd offset (inside a
batch), then tails the partition for 10 s while a producer trickles, and prints a table. The listings column counts
the object store's ListObjectsV2 requests for the partition: Tansu 0.6 lists every batch of a partition at each
fetch that finds new records (``tansu-storage/src/dynostore.rs``, ``fetch``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from core.services import free_port
from liverl.stack import stack


def listings(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if "GET /liverl?list-type=2&prefix=" in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--max-records", type=int, default=100_000, help="the consumer's max_records per poll")
    args = ap.parse_args()
    os.environ["LIVERL_OBJSTORE_ACCESS_LOG"] = "1"
    root = Path(tempfile.mkdtemp(prefix="liverl-broker-reads-"))
    logs = root / "logs"
    logs.mkdir()
    access = logs / "broker-storage.log"
    sp, sport = stack.start_object_store(root / "broker", logs, extra_args=["--merge-batches", "0"])
    port = free_port()
    bp = stack.start_broker(port, logs, f"s3://{stack.BROKER_BUCKET}/", stack.broker_env(sport))
    boot = f"127.0.0.1:{port}"
    rows = []
    try:
        KafkaAdminClient(bootstrap_servers=boot).create_topics([NewTopic("t", 1, 1)])
        p = KafkaProducer(bootstrap_servers=boot, linger_ms=0)
        n = args.batches
        t0 = time.time()
        for _ in range(n):
            p.send("t", value=os.urandom(150))
            p.send("t", value=os.urandom(150))
            p.flush()
        rows.append(("produce", 2 * n, time.time() - t0, None))
        tp = TopicPartition("t", 0)
        for label, start in (("read from 0", 0), ("read from the middle", n), ("read from an odd offset", n + 1)):
            c = KafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False)
            c.assign([tp])
            c.seek(tp, start)
            before, t0, got = listings(access), time.time(), 0
            while got < 2 * n - start and time.time() - t0 < 300:
                got += sum(len(v) for v in c.poll(timeout_ms=2000, max_records=args.max_records).values())
            rows.append((label, got, time.time() - t0, listings(access) - before))
            c.close()
        c = KafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False)
        c.assign([tp])
        c.seek(tp, 2 * n)
        before, t0, got, sent = listings(access), time.time(), 0, 0
        while time.time() - t0 < 10:
            p.send("t", value=os.urandom(150))
            p.send("t", value=os.urandom(150))
            p.flush()
            sent += 2
            got += sum(len(v) for v in c.poll(timeout_ms=50).values())
        rows.append((f"tail for 10 s ({sent} produced)", got, time.time() - t0, listings(access) - before))
    finally:
        bp.terminate()
        sp.terminate()
        bp.wait()
        sp.wait()
    print(f"| {args.batches} batches of 2 records, merging off | records | s | records/s | partition listings |")
    print("|---|---|---|---|---|")
    for label, count, secs, lists in rows:
        print(f"| {label} | {count} | {secs:.1f} | {count / secs:,.0f} | {'' if lists is None else lists} |")


if __name__ == "__main__":
    main()
