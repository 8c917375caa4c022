"""A product's traffic as its own process: generation records and the users' feedback on them, for tests that run it
on another host (``tests/netns.py``).

    python -m tests.ingest.traffic --out FILE --version V [--seconds S] [--seed N]

Configured as every liverl process is (``LIVERL__BROKER__BOOTSTRAP``, ``LIVERL__TOPICS__PREFIX``, ...). Each round
publishes 10 pairs as ``tests.ingest.test_restart``'s traffic does: most generations judged after they are logged, a
fifth judged first, one in twenty feedback events for a generation never logged. Feedback the broker did not
acknowledge (``DeliveryError``) is sent again in the next round, the same event (its ``feedback_id`` and its
``ts``), until it is; a generation record that failed is not (the gateway logs it once).

After the broker has acknowledged an event, one JSON line is appended to ``--out``: ``{"fid", "gid", "unknown",
"gen_acked", "tries", "ts"}`` (``unknown``: its generation was never sent; ``gen_acked``: the broker acknowledged its
generation record), so the file holds exactly the acknowledged events. Stops after ``--seconds`` or on SIGTERM, once
every event it made is acknowledged (or 120 s after, and then exits 1).
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
from liverl_sdk.client import DeliveryError
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
    rounds, retried = 0, 0
    unacked: list[tuple[str, str, str, dict]] = []  # (kind, gid, fid, line) to send again
    give_up = None
    try:
        with feedback_client(cfg) as sdk, args.out.open("a") as out:
            while True:
                more = not stop.is_set() and time.monotonic() < end
                if not more:
                    give_up = give_up or time.monotonic() + 120
                    if not unacked or time.monotonic() > give_up:
                        break
                sent, gens = [], []
                for kind, gid, fid, line in unacked:  # the same event: its feedback_id and its time
                    getattr(sdk, kind)(gid, feedback_id=fid, ts=line["ts"])
                    line["tries"] += 1
                    sent.append((kind, gid, fid, line))
                retried += len(unacked)
                for _ in range(10 if more else 0):
                    gid, r, ts = new_gid(), rng.random(), time.time()
                    gen = make_generation(gid, args.version).to_bytes()
                    kind = "reject" if 0.05 <= r < 0.25 else "accept"
                    if r < 0.05:
                        fid = sdk.accept(gid, ts=ts)
                    elif r < 0.25:  # feedback first
                        fid = sdk.reject(gid, ts=ts)
                        gens.append((gid, producer.send(cfg.topics.generations, key=gid, value=gen)))
                    else:
                        gens.append((gid, producer.send(cfg.topics.generations, key=gid, value=gen)))
                        fid = sdk.accept(gid, ts=ts)
                    line = {"fid": fid, "gid": gid, "unknown": r < 0.05, "tries": 1, "ts": ts}
                    sent.append((kind, gid, fid, line))
                producer.flush()
                gen_acked = {gid for gid, fut in gens if fut.succeeded()}
                try:
                    sdk.flush()
                    failed = set()
                except DeliveryError as e:  # not acknowledged: sent again next round
                    failed = {fid for fid, _ in e.failed}
                unacked = []
                for kind, gid, fid, line in sent:
                    line.setdefault("gen_acked", gid in gen_acked)
                    if fid in failed:
                        unacked.append((kind, gid, fid, line))
                    else:
                        out.write(json.dumps(line) + "\n")
                out.flush()
                rounds += 1
                stop.wait(args.pause)
    finally:
        producer.close()
    print(f"{rounds} rounds, {retried} events sent again, {len(unacked)} never acknowledged", file=sys.stderr)
    return 1 if unacked else 0


if __name__ == "__main__":
    sys.exit(main())
