"""``liverl bench canary``: the canary's sequential test, calibrated (A/A) and its power, by simulation.

Each simulated canary splits Bernoulli traffic (accept or not) between the canary (``--share``) and stable, and the
always-valid test of ``deploy.sequential`` looks after **every** event, as the gate does, until it promotes,
aborts, or reaches ``--max-events`` (all traffic, both arms: the deadline). Scenarios:

- **A/A**: both arms accept at the same rate. Every promotion is false; the bar is at most alpha.
- **+N points / -N points**: the canary is better / worse by ``--effect``. The table gives how often it is
  promoted / aborted by the deadline, and the events (all traffic) it took: median, and the 80th percentile of the
  canaries that were decided (the events needed to detect the change in 4 of 5 rollouts, when at least 80% were).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULTS = {"runs": 1000, "share": 0.2, "effect": 0.03, "base_rate": 0.5, "max_events": 100_000, "alpha": 0.05,
            "tau": 0.03, "min_events": 100}


def run(runs: int = DEFAULTS["runs"], share: float = DEFAULTS["share"], effect: float = DEFAULTS["effect"],
        base_rate: float = DEFAULTS["base_rate"], max_events: int = DEFAULTS["max_events"],
        alpha: float = DEFAULTS["alpha"], tau: float = DEFAULTS["tau"], min_events: int = DEFAULTS["min_events"],
        json_path: str | None = None, command: str = "liverl bench canary") -> dict:
    from deploy.sequential import simulate

    rows = []
    for name, p_canary in (("A/A", base_rate), (f"+{effect * 100:g} points", base_rate + effect),
                           (f"-{effect * 100:g} points", base_rate - effect)):
        t0 = time.perf_counter()
        res = simulate(base_rate, p_canary, share, max_events, runs, alpha=alpha, tau=tau, min_events=min_events,
                       seed=len(rows))
        res["scenario"], res["seconds"] = name, time.perf_counter() - t0
        rows.append(res)
        print(f"  {name}: promoted {res['promoted']:.1%}, aborted {res['aborted']:.1%}, undecided "
              f"{res['undecided']:.1%} ({res['seconds']:.0f} s)", flush=True)
    summary = {"rows": rows, "command": command}
    print(_table(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _table(summary: dict) -> str:
    r0 = summary["rows"][0]
    lines = ["", "| scenario | canaries | promoted | aborted | undecided at the deadline | median events to the decision "
             "| events for 80% |", "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        p80 = r.get("p80_events")
        lines.append(f"| {r['scenario']} | {r['runs']:,} | {r['promoted']:.1%} | {r['aborted']:.1%} | "
                     f"{r['undecided']:.1%} | {r['median_events'] or '-'} | "
                     f"{p80 if p80 is not None else '-'} |")
    lines += ["", f"stable accepts {r0['p_stable']:.0%}; canary share {r0['share']:.0%}; a look after every event; "
              f"alpha {r0['alpha']}, tau {r0['tau']}, at least {r0['min_events']} events per arm before a decision; "
              f"deadline {r0['max_events']:,} events",
              f"A/A false promotions: **{r0['promoted']:.1%}** (bar: at most {r0['alpha']:.0%})",
              f"reproduce: `{summary['command']}`"]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("canary", help="the canary's sequential test: A/A false promotions and power",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--runs", type=int, default=DEFAULTS["runs"], help="canaries per scenario (default 1000)")
    s.add_argument("--share", type=float, default=DEFAULTS["share"], help="canary's share of traffic (default 0.2)")
    s.add_argument("--effect", type=float, default=DEFAULTS["effect"], help="change to detect (default 0.03)")
    s.add_argument("--base-rate", type=float, default=DEFAULTS["base_rate"], help="stable's acceptance (default 0.5)")
    s.add_argument("--max-events", type=int, default=DEFAULTS["max_events"], help="deadline in events (default 100000)")
    s.add_argument("--alpha", type=float, default=DEFAULTS["alpha"], help="error rate (default 0.05)")
    s.add_argument("--tau", type=float, default=DEFAULTS["tau"], help="mixture scale (default 0.03)")
    s.add_argument("--min-events", type=int, default=DEFAULTS["min_events"], help="per arm before a decision (100)")
    s.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    names = ("runs", "share", "effect", "base_rate", "max_events", "alpha", "tau", "min_events")
    command = "liverl bench canary" + "".join(f" --{n.replace('_', '-')} {getattr(args, n)}" for n in names
                                               if getattr(args, n) != DEFAULTS[n])
    run(**{n: getattr(args, n) for n in names}, json_path=args.json, command=command)
    return 0
