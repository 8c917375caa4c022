"""Sample a running deployment's learner backlog and live kept acceptance every 10 s; plot them afterwards.

    python scripts/learner_lag.py sample OUT.csv --seconds 3900 [--prefix liverl] [--redis redis://localhost:6379/0]
    python scripts/learner_lag.py plot OUT.csv PLOT.png

The backlog is what the learner publishes (``<prefix>:learner``: judged samples not trained yet, and the age of the
oldest one's feedback: the figures of ``liverl status`` and the ``LiverlLearnerBehind`` alert). Kept acceptance is
summed over every version's live counters (``<prefix>:live:*``), accepts less reverts over the last minute's judged
events. ``plot`` prints a table per 5 minutes and writes the two curves. How BENCHMARKS.md's 60-minute run was made,
beside ``liverl demo --duration 3600``.
"""

from __future__ import annotations

import argparse
import csv
import time


def sample(out: str, seconds: float, prefix: str, url: str) -> None:
    import redis

    r = redis.Redis.from_url(url, decode_responses=True)
    end = time.time() + seconds
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        hops = ["hop_ingest_s", "hop_fetch_s", "hop_queue_s"]  # the last batch's oldest sample (Admission.hops)
        w.writerow(
            ["ts", "backlog_samples", "backlog_s", "step", "samples_trained", "events", "accepts", "reverts", *hops]
        )
        while time.time() < end:
            h = r.hgetall(f"{prefix}:learner")
            ev = acc = rev = 0
            for k in r.scan_iter(f"{prefix}:live:*", count=1000):
                if r.type(k) == "hash":
                    e, a, v = r.hmget(k, "events", "accept", "revert")
                    ev, acc, rev = ev + int(e or 0), acc + int(a or 0), rev + int(v or 0)
            w.writerow(
                [
                    f"{time.time():.1f}",
                    h.get("backlog_samples", ""),
                    h.get("backlog_s", ""),
                    h.get("step", ""),
                    h.get("samples_trained", ""),
                    ev,
                    acc,
                    rev,
                    *(h.get(k, "") for k in hops),
                ]
            )
            f.flush()
            time.sleep(10)


def plot(path: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in csv.DictReader(open(path)) if r["backlog_s"] not in ("", "-1", "-1.0")]
    t0 = float(rows[0]["ts"])
    t = [(float(r["ts"]) - t0) / 60 for r in rows]
    lag = [float(r["backlog_s"]) for r in rows]
    kept = [None] * len(rows)
    for i in range(6, len(rows)):  # the last minute's judged events
        de = int(rows[i]["events"]) - int(rows[i - 6]["events"])
        dk = (int(rows[i]["accepts"]) - int(rows[i - 6]["accepts"])) - (
            int(rows[i]["reverts"]) - int(rows[i - 6]["reverts"])
        )
        kept[i] = 100 * dk / de if de > 0 else None
    print("| minutes | learner backlog max (s) | backlog max (samples) | kept acceptance, last minute of the window |")
    print("|---|---|---|---|")
    for lo in range(0, int(t[-1]) + 1, 5):
        idx = [i for i, x in enumerate(t) if lo <= x < lo + 5]
        if not idx:
            continue
        last = next((kept[i] for i in reversed(idx) if kept[i] is not None), None)
        print(
            f"| {lo}-{lo + 5} | {max(lag[i] for i in idx):.0f} | {max(int(rows[i]['backlog_samples']) for i in idx)} "
            f"| {'-' if last is None else f'{last:.1f}%'} |"
        )
    print(
        f"\n{len(rows)} samples over {t[-1]:.0f} min; backlog max {max(lag):.0f} s, median "
        f"{sorted(lag)[len(lag) // 2]:.0f} s; over 120 s in {sum(x > 120 for x in lag)} samples"
    )
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(t, lag, label="backlog: the oldest sample not trained")
    if rows[0].get("hop_ingest_s") is not None:  # where the last batch's oldest sample waited (Admission.hops)
        hop = [(x, float(r["hop_ingest_s"])) for x, r in zip(t, rows, strict=True) if r.get("hop_ingest_s")]
        a.plot(
            [x for x, _ in hop], [h for _, h in hop], lw=0.8, label="last batch's oldest: feedback to ingest's record"
        )
    a.axhline(120, color="r", ls="--", label="2 minutes (LiverlLearnerBehind)")
    a.set_ylabel("learner backlog (s of feedback)")
    a.legend()
    b.plot([x for x, k in zip(t, kept, strict=True) if k is not None], [k for k in kept if k is not None])
    b.set_ylabel("kept acceptance, last minute (%)")
    b.set_xlabel("minutes since the learner first published")
    fig.tight_layout()
    fig.savefig(png, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out")
    s.add_argument("--seconds", type=float, default=3900)
    s.add_argument("--prefix", default="liverl")
    s.add_argument("--redis", default="redis://localhost:6379/0")
    p = sub.add_parser("plot")
    p.add_argument("csv")
    p.add_argument("png")
    args = ap.parse_args()
    if args.cmd == "sample":
        sample(args.out, args.seconds, args.prefix, args.redis)
    else:
        plot(args.csv, args.png)


if __name__ == "__main__":
    main()
