"""``liverl bench canary --stats``: what a canary's verdict claims beyond one metric's test, calibrated.

Four tables (``deploy.gate.canary_sim_stats``; rates over ``--runs`` canaries, each with its exact binomial 95% upper
bound in brackets):

- **A/A, the family and the readout**: canaries with the success metric and two required guardrails (edit and revert
  rates, non-inferior within 2 points), the user unit with CUPED, sticky users of each population (``--users``,
  ``--populations``), a look per closed 10 s bucket until the 1,800 s deadline; decided as
  ``deploy.gate.sequential.Canary.verdict`` decides, at each share of alpha given to the readout at the deadline
  (``gate.canary_readout_share``). False promotions (sequential or readout; the bar: at most alpha) and false aborts
  shown worse (the bar: at most alpha; beside it the split the gate had before, the success metric's harm side at
  alpha and each guardrail's at alpha / 2).
- **Power**: the share of canaries promoted (of them, by the readout) with kept acceptance 1 to 3 points better, and
  the mean events (all traffic) to a promotion: what the readout's share costs the sequential test's early stops.
- **Bias of promoted canaries' estimates**: at the configured readout share, the mean raw estimate at the look that
  promoted, the bias-corrected one (``deploy.gate.sequential_readout.shrunk``), the truth, and how often the
  always-valid interval covered the truth at that look.
- **Latency quantile**: the p90 guardrail (``deploy.gate.sequential_quantile``) and the mean latency's test on the
  same requests, two nodes whose load is autocorrelated; how often each showed the canary worse by more than the 25%
  band (its harm side at alpha) or within it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

EFFECTS = (0.0, 0.01, 0.015, 0.02, 0.03)
SHARES = (0.0, 0.1, 0.2, 0.3, 0.5)
LATENCY_WORLDS = (
    {"load_corr_s": 5.0, "share": 0.5},
    {"load_corr_s": 30.0, "share": 0.5},
    {"load_corr_s": 5.0, "share": 0.2},
)
"""Node load correlated over 5 s (half a bucket) and over 30 s (three buckets: the batch means' buckets are then
correlated too), and a canary with a fifth of the traffic (fewer events behind its per-bucket quantile)."""


def run_stats(
    runs: int, users: str, populations: str, seed: int, helpers: tuple, json_path: str | None = None, command: str = ""
) -> dict:
    """The four tables; ``helpers``: ``liverl.bench.canary``'s population splitter and binomial bound (handed in:
    that module registers this one)."""
    from core.config import GateConfig
    from deploy.gate.canary_sim_stats import simulate_latency_quantile, simulate_readout

    split, bound = helpers

    t_all = time.perf_counter()
    chosen = GateConfig().canary_readout_share
    readout = []
    for k in [int(u) for u in str(users).split(",") if u.strip()]:
        for pop in split(populations):
            t0 = time.perf_counter()
            readout.append(simulate_readout(pop, k, EFFECTS, runs, readout_shares=SHARES, seed=seed))
            print(f"  readout: {pop}, {k:,} users ({time.perf_counter() - t0:.0f} s)", flush=True)
    latency = []
    for world in LATENCY_WORLDS:
        t0 = time.perf_counter()
        latency.append(simulate_latency_quantile(runs=runs, seed=seed, **world))
        print(f"  latency: {world} ({time.perf_counter() - t0:.0f} s)", flush=True)
    summary = {
        "readout": readout,
        "latency": latency,
        "chosen_share": chosen,
        "command": command,
        "seconds": time.perf_counter() - t_all,
    }
    print(tables(summary, bound))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _rate(rate: float, runs: int, bound) -> str:
    return f"{rate:.1%} (≤{bound(round(rate * runs), runs):.1%})"


def _f(x: float | None, fmt: str = "+.4f") -> str:
    return "-" if x is None else format(x, fmt)


def tables(summary: dict, bound) -> str:
    """The tables of ``run_stats``' summary; ``bound(k, n)``: a binomial rate's 95% upper bound."""
    res, chosen = summary["readout"], summary["chosen_share"]
    alpha = res[0]["alpha"]
    lines = [
        "",
        f"A/A: false decisions of a canary with {res[0]['tests']} tests (kept acceptance, edit and revert rates), by "
        "the readout's share of alpha; exact 95% upper bound in brackets",
        "",
        "| population | users | readout share | false promotions (sequential + readout) | of them by the readout "
        "| false aborts, shown worse | (before: success at alpha, guardrails at alpha / 2) |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for r in res:
        for row in (x for x in r["rows"] if x["effect"] == 0.0):
            n = row["runs"]
            false_promote = row["promoted"] + row["readout"]
            worst = max(worst, false_promote, row["worse"])
            old = row["old_split_worse"]
            lines.append(
                f"| {r['population']} | {r['users']:,} | {row['readout_share']:g} | {_rate(false_promote, n, bound)} "
                f"| {row['readout']:.1%} | {_rate(row['worse'], n, bound)} | "
                f"{'' if old is None else _rate(old, n, bound)} |"
            )
    effects = [e for e in EFFECTS if e > 0]
    lines += [
        "",
        "Power: promoted by the deadline (of them by the readout) and the mean events (all traffic) to a promotion, by "
        "the readout's share",
        "",
        "| population | users | readout share | " + " | ".join(f"+{e * 100:g} points" for e in effects) + " |",
        "|---|---|---|" + "---|" * len(effects),
    ]
    for r in res:
        for s in sorted({x["readout_share"] for x in r["rows"]}):
            cells = []
            for e in effects:
                row = next(x for x in r["rows"] if x["readout_share"] == s and x["effect"] == e)
                cells.append(
                    f"{row['promoted'] + row['readout']:.1%} ({row['readout']:.1%}), "
                    + _f(row["mean_events_promoted"], ",.0f")
                )
            mark = " (configured)" if s == chosen else ""
            lines.append(f"| {r['population']} | {r['users']:,} | {s:g}{mark} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Bias of promoted canaries' estimates at readout share {chosen:g}: raw, bias-corrected (posterior mean under "
        "the mixture's N(0, tau^2)), the truth; the always-valid interval's coverage at the deciding look",
        "",
        "| population | users | truth | promoted | mean raw | mean corrected | stopped early: raw / corrected "
        "| interval covered the truth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res:
        for row in (x for x in r["rows"] if x["readout_share"] == chosen and x["effect"] != 0.0):
            truth = (
                f"N(0, {r['tau']:g}^2): {_f(row['truth'])} among the promoted"
                if row["effect"] == "prior"
                else f"{row['effect']:+.3f}"
            )
            lines.append(
                f"| {r['population']} | {r['users']:,} | {truth} | {row['promoted_n']:,} | "
                f"{_f(row['raw'])} | {_f(row['corrected'])} | {_f(row['early_raw'])} / {_f(row['early_corrected'])} | "
                f"{_f(row['covered'], '.1%')} |"
            )
    lat = summary["latency"]
    lines += [
        "",
        f"Latency: p{lat[0]['quantile'] * 100:g} guardrail and the mean's test, {lat[0]['tolerance']:.0%} band, harm "
        f"side at alpha {lat[0]['alpha']:g}: shown worse by more than the band / shown within it",
        "",
        "| node load correlation | canary share | candidate | true change of mean / p90 | p90 test: worse | within "
        "| mean test: worse | within |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst_latency = off_bar = 0.0
    for world in lat:
        n = world["runs"]
        for eff in dict.fromkeys(row["effect"] for row in world["rows"]):
            q = next(x for x in world["rows"] if x["effect"] == eff and x["test"] == "quantile")
            m = next(x for x in world["rows"] if x["effect"] == eff and x["test"] == "mean")
            if eff == "none":
                worst_latency = max(worst_latency, q["worse"])
            elif eff != "tail: 12% of requests 3x slower":  # within the band or on it: any decision is false
                off_bar = max(off_bar, q["worse"], q["within"] if eff == "at the band" else 0.0)
            lines.append(
                f"| {world['load_corr_s']:g} s | {world['share']:.0%} | {eff} | {m['true_change']:+.0%} / "
                f"{q['true_change']:+.0%} | {_rate(q['worse'], n, bound)} | {q['within']:.1%} | "
                f"{_rate(m['worse'], n, bound)} | {m['within']:.1%} |"
            )
    r0, l0 = res[0], lat[0]
    verdict = "PASS" if max(worst, worst_latency) <= alpha else "FAIL"
    lines += [
        "",
        f"{r0['runs']:,} canaries per row; {r0['events_per_s']:g} judged events/s (all traffic), canary share "
        f"{r0['share']:.0%}, deadline {r0['deadline_s']:g} s, alpha {alpha}, tau {r0['tau']}, guardrail margin "
        f"{r0['guardrail_margin']:g}; latency: {l0['events_per_s']:g} requests/s, log-normal sigma {l0['sigma']:g} "
        f"about each node's load (AR(1), sd {l0['load_sd']:g}; shared load sd {l0['common_sd']:g}), at least "
        f"{l0['min_events']} timed events per arm in a bucket",
        f"A/A false promotions, false aborts and latency false harms (bar: at most alpha {alpha:.0%}): largest "
        f"{max(worst, worst_latency):.1%}, {verdict}",
        f"latency within the band or on it (no bar: batch means of 10 s buckets hold only where a node's load "
        f"decorrelates within a bucket): largest false decision of the p{lat[0]['quantile'] * 100:g} test "
        f"{off_bar:.1%}",
        f"reproduce: `{summary['command']}` ({summary['seconds'] / 60:.0f} min here)",
    ]
    return "\n".join(lines)


def command_of(args: argparse.Namespace, users: str, populations: str) -> str:
    parts = [f"liverl bench canary --stats --runs {args.runs}"]
    if users != "1000":
        parts.append(f"--users {users}")
    if populations != "segments,beta(2,2)":
        parts.append(f"--populations '{populations}'")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    return " ".join(parts)


def cmd(args: argparse.Namespace, default_users: str, default_populations: str, helpers: tuple) -> int:
    """``--stats``: its own defaults for --users (1000) and --populations (segments, Beta(2,2))."""
    users = "1000" if args.users == default_users else args.users
    pops = "segments,beta(2,2)" if args.populations == default_populations else args.populations
    run_stats(args.runs, users, pops, args.seed, helpers, args.json, command_of(args, users, pops))
    return 0
