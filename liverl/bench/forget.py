"""Forgetting one user of many: what ``liverl forget`` reads and writes, beside the naive way.

It fills a throwaway deployment (an SQLite registry in a temporary folder, a Redis prefix of its own on the configured
Redis) with ``--users`` units: a data key each (rows of ``user_keys``), per-user sums (each unit judged in
``--buckets-per-user`` 10-second buckets of one of ``--versions`` versions: fields ``<unit>|e``, ``|a``, ``|t`` of
``<p>:units:{<v>}:<bucket>`` hashes) and a learner ledger of one trained sample per unit. Then, in the same run:

- ``forget``: the erasure of one known user (``liverl.ops.forget.Runner``, policy ``report``), every step;
- ``unknown``: the same for a user of whom nothing is held (its cost is the floor of the pass over the keys);
- ``naive``: deleting the user's sums by reading every per-user hash whole (``HGETALL``) to find their fields.

Columns: seconds; user_keys rows deleted; erasure rows written (insert and updates); Redis keys scanned (SCAN over
``<p>:units:*`` only), keys changed (a hash that held the user's fields), fields deleted, bytes sent to Redis in
commands (keys and field names), bytes read back from Redis (the naive way: every field and value of every hash);
the user's samples found in the ledger.

    liverl bench forget --users 100000
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

from liverl.bench.subcommand import add_bench_parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_bench_parser(subparsers, "forget", "forget one user of N: time, rows, Redis keys and bytes", __doc__)
    p.add_argument("--users", type=int, default=100_000, help="units filled (default 100,000)")
    p.add_argument("--versions", type=int, default=4, help="versions the sums are spread over (default 4)")
    p.add_argument("--buckets", type=int, default=500, help="10 s buckets per version holding sums (default 500)")
    p.add_argument("--buckets-per-user", type=int, default=2, help="buckets each user was judged in (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=run)
    return p


def _fill(cfg, reg, r, units: list[str], args, rng: random.Random) -> None:
    import sqlalchemy as sa

    from core import keys
    from core.shred import _TABLE as USER_KEYS  # the table UserKeys keeps its rows in
    from learner.ledger import Ledger, checkpoint_path_for, ledger_path

    now = time.time()
    with reg.engine.begin() as c:
        for i in range(0, len(units), 5000):
            c.execute(
                sa.insert(USER_KEYS),
                [{"unit": u, "wrapped": os.urandom(60), "created_at": now} for u in units[i : i + 5000]],
            )
    per_key: dict[str, dict[str, int]] = {}
    for u in units:
        v = rng.randrange(args.versions)
        for b in rng.sample(range(args.buckets), args.buckets_per_user):
            h = per_key.setdefault(keys.units(cfg.topics.prefix, v, b), {})
            h.update({f"{u}|e": 1, f"{u}|a": 1, f"{u}|t": rng.randrange(1, 40)})
    pipe = r.pipeline(transaction=False)
    for k, h in per_key.items():
        pipe.hset(k, mapping={**h, "*|e": len(h) // 3})
        if len(pipe) >= 50:
            pipe.execute()
    pipe.execute()
    led = Ledger(ledger_path(checkpoint_path_for(cfg)), max_bytes=1 << 40)
    led.rebased(0, 0)
    per_step = 1000
    for step, i in enumerate(range(0, len(units), per_step), start=1):
        chunk = units[i : i + per_step]
        led.trained(step, [(0, i + j, f"g{i + j}") for j in range(len(chunk))], units=chunk)
    led.flush(seq=1)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from core import fleet, keys
    from core.config import load_config
    from deploy.registry.blobstore import LocalBlobStore
    from deploy.registry.registry import Registry
    from liverl.ops.admin import open_redis
    from liverl.ops.forget import Runner, user_keys

    rng = random.Random(args.seed)
    units = sorted({fleet.unit_id(f"user-{args.seed}-{i}") for i in range(args.users)})
    target, unknown = units[len(units) // 2], fleet.unit_id(f"nobody-{uuid.uuid4().hex}")
    with tempfile.TemporaryDirectory(prefix="liverl-bench-forget-") as tmp:
        cfg = load_config(getattr(args, "config", None))
        cfg.state_dir = tmp
        cfg.topics.prefix = f"benchforget{uuid.uuid4().hex[:8]}"
        reg = Registry(cfg.registry_url, LocalBlobStore(Path(tmp) / "blobs"))
        reg.init_base({"w": torch.zeros(8)}, "bench")
        r = open_redis(cfg)
        try:
            t0 = time.perf_counter()
            _fill(cfg, reg, r, units, args, rng)
            fill_s = time.perf_counter() - t0
            n_keys = sum(1 for _ in r.scan_iter(match=keys.units_pattern(cfg.topics.prefix), count=1000))
            rows = []
            for name, unit in (("forget", target), ("forget an unknown user", unknown)):
                run_ = Runner(cfg, reg, r, user_keys(cfg, reg), "bench")
                t0 = time.perf_counter()
                e = run_.run(run_.request(unit, "bench", name))
                secs = time.perf_counter() - t0
                s = e.report["sums"]
                rows.append(
                    (
                        name,
                        secs,
                        int(e.report["key"]["destroyed"]),
                        1 + 5,
                        s["keys_scanned"],
                        s["keys_changed"],
                        s["fields"],
                        s["bytes_sent"],
                        s["bytes_read"],
                        e.report["lineage"]["samples"],
                    )
                )
            rows.append(_naive(r, cfg.topics.prefix, units[len(units) // 3]))
        finally:
            for k in list(r.scan_iter(match=f"{cfg.topics.prefix}:*", count=1000)):
                r.delete(k)
            r.close()
            reg.close()
    t = Table(title=f"forget one user of {len(units):,} ({n_keys:,} per-user hashes, filled in {fill_s:.1f} s)")
    for col in (
        "run",
        "seconds",
        "key rows deleted",
        "erasure rows written",
        "keys scanned",
        "keys changed",
        "fields deleted",
        "bytes sent",
        "bytes read",
        "user's ledger samples",
    ):
        t.add_column(col, justify="left" if col == "run" else "right")
    for row in rows:
        t.add_row(row[0], f"{row[1]:.3f}", *(f"{x:,}" for x in row[2:]))
    t.caption = f"liverl bench forget --users {args.users} --versions {args.versions} --buckets {args.buckets}"
    Console(width=200).print(t)
    return 0


def _naive(r, prefix: str, unit: str) -> tuple:
    """The user's sums deleted by reading every per-user hash whole to find their fields."""
    from core import keys

    t0 = time.perf_counter()
    scanned = changed = fields = written = read = 0
    for k in r.scan_iter(match=keys.units_pattern(prefix), count=1000):
        scanned += 1
        written += len(str(k))  # the HGETALL
        h = r.hgetall(k)
        read += sum(len(str(f)) + len(str(v)) for f, v in h.items())
        mine = [f for f in h if str(f).startswith(f"{unit}|")]
        if mine:
            changed += 1
            fields += r.hdel(k, *mine)
            written += len(str(k)) + sum(len(f) for f in mine)
    return ("naive (HGETALL every hash)", time.perf_counter() - t0, 0, 0, scanned, changed, fields, written, read, 0)
