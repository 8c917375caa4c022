"""A product's traffic as its own process: generation records and the users' feedback on them, for tests that run it
on another host (``tests/netns.py``).

    python -m tests.ingest.traffic --out FILE --version V [--seconds S] [--seed N]

Configured as every liverl process is (``LIVERL__BROKER__BOOTSTRAP``, ``LIVERL__TOPICS__PREFIX``, ...). Each round
publishes 10 pairs as ``tests.ingest.test_restart``'s traffic does: most generations judged after they are logged, a
fifth judged first, one in twenty feedback events for a generation never logged. After the broker has acknowledged a
round (``flush``), one JSON line per feedback event is appended to ``--out``: ``{"fid", "gid", "unknown"}``, so the
file holds exactly the acknowledged events. Stops after ``--seconds`` or on SIGTERM, after the round in hand.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

from core.bus import feedback_client, make_producer
from core.config import load_config
from tests.ingest.conftest import make_generation, new_gid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause", type=float, default=0.2, help="seconds between rounds")
    args = p.parse_args(argv)
    cfg = load_config()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = random.Random(args.seed)
    end = time.monotonic() + args.seconds
    producer = make_producer(cfg.broker.bootstrap, broker=cfg.broker)
    rounds = 0
    try:
        with feedback_client(cfg) as sdk, args.out.open("a") as out:
            while not stop.is_set() and time.monotonic() < end:
                lines = []
                for _ in range(10):
                    gid, r = new_gid(), rng.random()
                    gen = make_generation(gid, args.version).to_bytes()
                    if r < 0.05:
                        fid = sdk.accept(gid)
                    elif r < 0.25:  # feedback first
                        fid = sdk.reject(gid)
                        producer.send(cfg.topics.generations, key=gid, value=gen)
                    else:
                        producer.send(cfg.topics.generations, key=gid, value=gen)
                        fid = sdk.accept(gid)
                    lines.append({"fid": fid, "gid": gid, "unknown": r < 0.05})
                producer.flush()
                sdk.flush()  # raises for an event the broker did not acknowledge: it is not written below
                out.write("".join(json.dumps(x) + "\n" for x in lines))
                out.flush()
                rounds += 1
                stop.wait(args.pause)
    finally:
        producer.close()
    print(f"{rounds} rounds, {rounds * 10} feedback events acknowledged", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
