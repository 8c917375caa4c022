"""Runs of refusals in a deployment's registry: how long the gate refused every candidate on its evidence in a row.

    python scripts/refusal_runs.py STATE_DIR [--start TS]

The learner's bar for a 60-minute demo run: no run of refusals lasts more than 5 minutes. A run starts at the first
refusal after a promotion: a failed gate check (``rejected`` in the audit log, on the candidate's own evidence:
``learner.candidates.evidence_against``; not a supersession) or any aborted canary (``canary_abort``: shown worse,
futile, its deadline or evidence budget spent, a sample-ratio mismatch: the candidate was not shipped whatever the
reason). It ends at the next promotion, or at the end of the registry's history (then it is marked open). Aborted
canaries count as refusals: counting only the ``rejected`` entries would miss a run of aborted canaries with no failed
check in it. Times come from the audit log
(the gate's ``rejected`` and ``promote`` entries). Also prints the learner's rebases and learning-rate changes that its
log recorded (``<state_dir>/logs/learn.log``), so a run can be read beside what the learner did about it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from core.config import load_config
from deploy.registry.registry import open_registry
from learner.candidates import evidence_against


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("state_dir", type=Path)
    ap.add_argument("--start", type=float, help="the run's start (unix time; default: the first audit entry)")
    args = ap.parse_args()
    cfg = load_config(state_dir=str(args.state_dir))
    reg = open_registry(cfg)
    try:
        entries = sorted(reg.audit(), key=lambda e: e.at)
    finally:
        reg.close()
    start = args.start if args.start is not None else (entries[0].at if entries else 0.0)
    runs: list[dict] = []
    cur: dict | None = None
    for e in entries:
        if e.action == "promote":
            if cur is not None:
                cur["end"], cur["ended_by"] = e.at, f"promotion of v{e.version}"
                runs.append(cur)
                cur = None
        elif (e.action == "rejected" and evidence_against(e.reason or "")) or e.action == "canary_abort":
            if cur is None:
                cur = {"start": e.at, "refusals": 0, "reasons": {}}
            cur["refusals"] += 1
            reason = (e.reason or "").removeprefix("canary aborted: ")
            key = ("canary: " if e.action == "canary_abort" else "") + re.sub(r"[\d.]+", "N", reason[:32])
            cur["reasons"][key] = cur["reasons"].get(key, 0) + 1
    if cur is not None:
        cur["end"], cur["ended_by"] = entries[-1].at, "open at the end"
        runs.append(cur)

    print("| from (min) | length (s) | refusals | ended by | reasons |")
    print("|---|---|---|---|---|")
    for r in runs:
        reasons = ", ".join(f"{k.strip()} x{n}" for k, n in sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:3])
        print(
            f"| {(r['start'] - start) / 60:.1f} | {r['end'] - r['start']:.0f} | {r['refusals']} | {r['ended_by']} "
            f"| {reasons} |"
        )
    longest = max((r["end"] - r["start"] for r in runs), default=0.0)
    print(f"\n{len(runs)} runs of refusals; longest {longest:.0f} s (bar: 300 s)")

    log = args.state_dir / "logs" / "learn.log"
    if log.exists():
        print("\nthe learner's rebases after refusals and learning-rate changes:")
        for line in log.read_text(errors="replace").splitlines():
            if "rebasing onto stable" in line or "learning rate" in line:
                print(" ", line[:220])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
