"""``liverl bench canary``: the canary's sequential test, calibrated (A/A) and its power, in the deployed world.

Each simulated canary replays what the gate sees: a population of **sticky users** (``--users``, each population of
``--populations``: the demo's two segments accepting 0.70 and 0.25, Beta(2,2), a skewed Beta(0.5,1.5), or
``segments3``: three segments accepting 0.75, 0.40 and 0.10 with per-user spread) with log-normal activity
(``--activity-sigma``; the demo's is 1.0) or Zipf activity (``--activity 'zipf(1.1)'``: the top user sends 15-18%
of all traffic), assigned to the canary by the router's own function
(``core.fleet.bucket(secret, rollout_id, user) < share``, a fresh rollout id per canary), judging
``--events-per-s`` answers (all traffic), and the gate's look once per closed 10 s bucket until
``--deadline-s``. CUPED's covariate is each user's acceptance under stable in the ``--pre-s`` before the rollout.
The user-unit test is ``deploy.gate.sequential.look_units``, the function the gate calls, on every look.

Tables (one row per population and size; rates over ``--runs`` canaries, each with its exact binomial 95% upper
bound in brackets):

- **A/A** (both arms alike): every decision (promote or abort) is false. Columns: the user-unit test without and
  with CUPED (the bar: at most alpha, upper bound included, in every row); for contrast the per-event test on the
  same sticky users (the old variance: wrong here) and with each request drawn into an arm afresh
  (``gate.canary_unit = "request"``, where it is right); how often the sample-ratio-mismatch check fired (at
  ``--srm-alpha``); the share of the user-unit variance CUPED removed (median, at the deadline).
- **+N / -N points** (``--effect`` added to every canary user's rate): power, the share of canaries promoted
  (+N) or aborted (-N) by the deadline, and the median events (all traffic) to that decision among those decided,
  for the user-unit test without and with CUPED, and for the per-event test with per-request randomisation.

``--budget N`` measures something else: canaries as the demo runs them (a non-inferiority test within ``--margin``,
the user unit with CUPED, an evidence budget of N judged events on the canary arm, ``gate.canary_max_events``),
with and without the futility stop (``--futility-z``, ``gate.canary_futility_z``; ``deploy.gate.sequential.futile``),
for candidates as good as stable and 1.5, 3 and 6 points worse (``deploy.gate.canary_sim.simulate_budget``; default
population Beta(5,1), mean 0.83: the demo's plateau). A promotion at 3 points worse or more is a false one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from liverl.bench.rates import binomial_upper
from liverl.bench.rates import split_list as _split_populations
from liverl.bench.subcommand import add_bench_parser

DEFAULTS = {
    "runs": 1000,
    "users": "48,1000,10000",
    "populations": "segments,beta(2,2),beta(0.5,1.5)",
    "share": 0.5,
    "effect": 0.03,
    "events_per_s": 50.0,
    "deadline_s": 1800.0,
    "pre_s": 1800.0,
    "activity_sigma": 1.0,
    "activity": "lognormal",
    "alpha": 0.05,
    "tau": 0.03,
    "min_events": 100,
    "min_units": 10,
    "srm_alpha": 0.001,
    "seed": 0,
}
USER_SCHEMES = ("user", "user+cuped")


def run(
    runs: int = DEFAULTS["runs"],
    users: str = DEFAULTS["users"],
    populations: str = DEFAULTS["populations"],
    share: float = DEFAULTS["share"],
    effect: float = DEFAULTS["effect"],
    events_per_s: float = DEFAULTS["events_per_s"],
    deadline_s: float = DEFAULTS["deadline_s"],
    pre_s: float = DEFAULTS["pre_s"],
    activity_sigma: float = DEFAULTS["activity_sigma"],
    activity: str = DEFAULTS["activity"],
    alpha: float = DEFAULTS["alpha"],
    tau: float = DEFAULTS["tau"],
    min_events: int = DEFAULTS["min_events"],
    min_units: int = DEFAULTS["min_units"],
    srm_alpha: float = DEFAULTS["srm_alpha"],
    seed: int = DEFAULTS["seed"],
    json_path: str | None = None,
    command: str = "liverl bench canary",
) -> dict:
    from deploy.gate.canary_sim import simulate_sticky

    sizes = [int(u) for u in str(users).split(",") if u.strip()]
    pops = _split_populations(populations)
    rows = []
    t_all = time.perf_counter()
    for k in sizes:
        for pop in pops:
            t0 = time.perf_counter()
            res = simulate_sticky(
                pop,
                k,
                effects=(0.0, effect, -effect),
                runs=runs,
                share=share,
                events_per_s=events_per_s,
                deadline_s=deadline_s,
                pre_s=pre_s,
                activity_sigma=activity_sigma,
                activity=activity,
                alpha=alpha,
                tau=tau,
                min_events=min_events,
                min_units=min_units,
                srm_alpha=srm_alpha,
                seed=seed,
            )
            res["seconds"] = time.perf_counter() - t0
            res["effects"] = {str(e): v for e, v in res["effects"].items()}
            rows.append(res)
            aa = res["effects"]["0.0"]
            print(
                f"  {pop}, {k:,} users: A/A false decisions user {_false(aa['user']):.1%}, user+CUPED "
                f"{_false(aa['user+cuped']):.1%}, per event on sticky users {_false(aa['event, sticky users']):.1%} "
                f"({res['seconds']:.0f} s)",
                flush=True,
            )
    summary = {"rows": rows, "command": command, "effect": effect, "seconds": time.perf_counter() - t_all}
    print(_tables(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _false(r: dict) -> float:
    return r["promoted"] + r["aborted"]


BUDGET_EFFECTS = (0.0, -0.015, -0.03, -0.06)


def run_budget(
    budget: int,
    margin: float,
    futility_z: float,
    runs: int,
    users: str,
    populations: str,
    events_per_s: float,
    seed: int,
    json_path: str | None = None,
    command: str = "liverl bench canary --budget",
) -> dict:
    """The ``--budget`` table: each population and size, each effect, without and with the futility stop."""
    from deploy.gate.canary_sim import simulate_budget

    rows, t_all = [], time.perf_counter()
    for k in [int(u) for u in str(users).split(",") if u.strip()]:
        for pop in _split_populations(populations):
            t0 = time.perf_counter()
            res = simulate_budget(
                pop,
                k,
                effects=BUDGET_EFFECTS,
                runs=runs,
                budget=budget,
                margin=margin,
                futility_z=(None, futility_z),
                events_per_s=events_per_s,
                seed=seed,
            )
            for r in res["rows"]:
                rows.append({"population": pop, "users": k} | r)
            print(f"  {pop}, {k:,} users ({time.perf_counter() - t0:.0f} s)", flush=True)
    lines = [
        "",
        f"Canaries with an evidence budget of {budget:,} canary events, non-inferiority within {margin:g}: how each "
        "ended, and the canary events spent until then",
        "",
        "| population | users | candidate vs stable | futility stop | promoted | shown worse | futile | budget spent "
        "undecided | canary events (median) | (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stop = "off" if r["futility_z"] is None else f"z {r['futility_z']:g}"
        lines.append(
            f"| {r['population']} | {r['users']:,} | {r['effect'] * 100:+g} points | {stop} | "
            + " | ".join(f"{r[e]:.1%}" for e in ("promoted", "worse", "futile", "budget"))
            + f" | {r['median_events']:,} | {r['mean_events']:,.0f} |"
        )
    lines += [
        "",
        f"{runs:,} canaries per row; {events_per_s:g} judged events/s (all traffic), half the users on the canary, "
        f"a look per closed 10 s bucket; a promotion at {-margin * 100:g} points or worse is a false one",
        f"reproduce: `{command}` ({(time.perf_counter() - t_all) / 60:.0f} min here)",
    ]
    print("\n".join(lines))
    summary = {"rows": rows, "command": command, "budget": budget, "margin": margin}
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def _activity(row: dict) -> str:
    a = row.get("activity", "lognormal")
    return f"log-normal sigma {row['activity_sigma']:g}" if a == "lognormal" else a


def _rate(rate: float, runs: int) -> str:
    return f"{rate:.1%} (≤{binomial_upper(round(rate * runs), runs):.1%})"


def _tables(summary: dict) -> str:
    rows, eff = summary["rows"], summary["effect"]
    r0 = rows[0]
    alpha = r0["alpha"]
    lines = [
        "",
        "A/A: false decisions (promoted + aborted), exact 95% upper bound in brackets",
        "",
        "| population | users | user unit | user unit + CUPED | per event, sticky users (wrong) | "
        "per event, per-request arms | SRM alarms | CUPED removed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = worst_upper = 0.0
    for r in rows:
        aa, n = r["effects"]["0.0"], r["runs"]
        worst = max(worst, *(_false(aa[s]) for s in USER_SCHEMES))
        worst_upper = max(worst_upper, *(binomial_upper(round(_false(aa[s]) * n), n) for s in USER_SCHEMES))
        removed = aa["cuped_removed"]
        lines.append(
            f"| {r['population']} | {r['users']:,} | {_rate(_false(aa['user']), n)} | "
            f"{_rate(_false(aa['user+cuped']), n)} | {_rate(_false(aa['event, sticky users']), n)} | "
            f"{_rate(_false(aa['event, per request']), n)} | {_rate(aa['srm'], n)} | "
            f"{'-' if removed is None else f'{removed:.1%}'} |"
        )
    up, down = str(eff), str(-eff)
    pts = f"{eff * 100:g} points"
    lines += [
        "",
        f"+{pts} / -{pts}: power (promoted / aborted by the deadline) and median events to that decision",
        "",
        f"| population | users | +{pts}: user | user + CUPED | per request | -{pts}: user | user + CUPED "
        "| per request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for key, side in ((up, "promoted"), (down, "aborted")):
            for s in ("user", "user+cuped", "event, per request"):
                x = r["effects"][key][s]
                cells.append(f"{x[side]:.1%}, {x['median_events']:,}" if x["median_events"] else f"{x[side]:.1%}, -")
        lines.append(f"| {r['population']} | {r['users']:,} | " + " | ".join(cells) + " |")
    verdict = "PASS" if worst <= alpha else "FAIL"
    bound = "below" if worst_upper <= alpha else "above"
    lines += [
        "",
        f"{r0['runs']:,} canaries per row; canary share {r0['share']:.0%} of users; {r0['events_per_s']:g} "
        f"judged events/s (all traffic), a look per closed {r0['bucket_s']:g} s bucket, deadline "
        f"{r0['deadline_s']:g} s ({r0['events_at_deadline']:,} events); CUPED covariate from {r0['pre_s']:g} s "
        f"before the rollout; {_activity(r0)} activity; alpha {alpha}, tau "
        f"{r0['tau']}, at least {r0['min_events']} events and {r0['min_units']} users per arm before a "
        f"decision; SRM at {r0['srm_alpha']}",
        f"user-unit A/A false decisions (bar: at most alpha {alpha:.0%} in every row): largest {worst:.1%}, "
        f"{verdict}; largest 95% upper bound {worst_upper:.1%}, {bound} alpha",
        f"reproduce: `{summary['command']}` ({summary['seconds'] / 60:.0f} min here)",
    ]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    s = add_bench_parser(
        subparsers,
        "canary",
        "the canary's sequential test on sticky users: A/A false decisions "
        "and power, user unit and CUPED against per-event",
        __doc__,
    )
    d = DEFAULTS
    s.add_argument("--runs", type=int, help="canaries per row (default 1000; with --decisions 300)")
    s.add_argument(
        "--users", help=f"population sizes, comma-separated (default {d['users']}; with --decisions 1000,10000,100000)"
    )
    s.add_argument(
        "--populations",
        help=f"users' acceptance rates: segments, segments3, beta(a,b) (default {d['populations']}; with --decisions "
        "segments3)",
    )
    s.add_argument("--share", type=float, default=d["share"], help="canary's share of users (default 0.5, the demo's)")
    s.add_argument("--effect", type=float, default=d["effect"], help="change to detect (default 0.03)")
    s.add_argument(
        "--events-per-s",
        type=float,
        default=d["events_per_s"],
        help="judged events per second, all traffic (default 50, the demo's)",
    )
    s.add_argument("--deadline-s", type=float, default=d["deadline_s"], help="canary deadline (default 1800)")
    s.add_argument("--pre-s", type=float, default=d["pre_s"], help="pre-rollout window for CUPED (default 1800)")
    s.add_argument(
        "--activity-sigma",
        type=float,
        default=d["activity_sigma"],
        help="spread of user activity, log-normal sigma (default 1.0, the demo's)",
    )
    s.add_argument(
        "--activity",
        help="users' shares of traffic: lognormal (of --activity-sigma) or zipf(s), e.g. zipf(1.1): the top user "
        "sends 15-18%% of all traffic (default lognormal; with --decisions a list, default 'lognormal,zipf(1.1)')",
    )
    s.add_argument("--alpha", type=float, default=d["alpha"], help="error rate (default 0.05)")
    s.add_argument("--tau", type=float, default=d["tau"], help="mixture scale (default 0.03)")
    s.add_argument("--min-events", type=int, default=d["min_events"], help="events per arm before a decision (100)")
    s.add_argument("--min-units", type=int, default=d["min_units"], help="users per arm before a decision (10)")
    s.add_argument("--srm-alpha", type=float, default=d["srm_alpha"], help="sample-ratio check's level (0.001)")
    s.add_argument("--seed", type=int, default=d["seed"], help="seed (default 0)")
    s.add_argument(
        "--budget",
        type=int,
        metavar="N",
        help="instead: canaries with an evidence budget of N canary events (the demo's is 6000), with and without the "
        "futility stop (defaults then: --users 2000,5000 --populations 'beta(5,1)' --events-per-s 60)",
    )
    s.add_argument("--margin", type=float, default=0.03, help="with --budget: non-inferiority margin (default 0.03)")
    s.add_argument(
        "--futility-z",
        type=float,
        default=None,
        help="with --budget: the futility stop's optimism (default: gate.canary_futility_z's default)",
    )
    s.add_argument(
        "--stats",
        action="store_true",
        help="instead: the verdict's statistics (liverl.bench.canary_stats): the family's false promotions and aborts, "
        "the deadline readout's power, the bias-corrected estimate, the latency quantile guardrail (defaults then: "
        "--users 1000 --populations 'segments,beta(2,2)')",
    )
    s.add_argument(
        "--decisions",
        action="store_true",
        help="instead: whole canaries through the gate's decision (every test, both cursors, Canary.verdict) for an "
        "A/A, a candidate 3 points better and a bait, with the bars (liverl.bench.canary_decisions)",
    )
    s.add_argument(
        "--profiles", default="defaults,demo", help="with --decisions: gate profiles, defaults and/or demo (both)"
    )
    s.add_argument(
        "--large-runs", type=int, help="with --decisions: canaries per scenario at 100,000 users and more (100)"
    )
    s.add_argument(
        "--world",
        choices=("bench", "demo"),
        help="with --decisions: who reverts: bench (every user a few of its accepts, the whole look-back behind the "
        "rollout) or demo (the demo's trap: a third of the users revert, about 10%% of all events, two minutes of "
        "history before the first canary; default bench)",
    )
    s.add_argument(
        "--candidates",
        help="with --decisions: which to play, of A/A, '+3 points', bait and exploit (the demo's smallest exploiting "
        "version: reverts +4.7 points, kept acceptance unchanged); default 'A/A,+3 points,bait'",
    )
    s.add_argument(
        "--gate",
        action="append",
        metavar="FIELD=VALUE",
        help="with --decisions: a [gate] setting over every profile's, e.g. canary_max_events=8000 (repeatable)",
    )
    s.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    s.set_defaults(fn=_cmd)
    return s


def _cmd(args: argparse.Namespace) -> int:
    if args.stats:
        from liverl.bench import canary_stats

        for name in ("runs", "users", "populations"):  # None: the stats bench's own defaults
            if getattr(args, name) is None:
                setattr(args, name, DEFAULTS[name])
        return canary_stats.cmd(args, DEFAULTS["users"], DEFAULTS["populations"], (_split_populations, binomial_upper))
    if args.decisions:
        from liverl.bench.canary_decisions import cmd

        return cmd(args)
    for name in ("runs", "users", "populations", "activity"):  # left out: this bench's defaults
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[name])
    if args.budget is not None:
        from core.config import GateConfig

        z = GateConfig().canary_futility_z if args.futility_z is None else args.futility_z
        users = "2000,5000" if args.users == DEFAULTS["users"] else args.users
        pops = "beta(5,1)" if args.populations == DEFAULTS["populations"] else args.populations
        eps = 60.0 if args.events_per_s == DEFAULTS["events_per_s"] else args.events_per_s
        command = f"liverl bench canary --budget {args.budget} --runs {args.runs}" + "".join(
            f" {flag} {value}"
            for flag, value, default in (
                ("--users", users, "2000,5000"),
                ("--populations", f"'{pops}'", "'beta(5,1)'"),
                ("--events-per-s", eps, 60.0),
                ("--margin", args.margin, 0.03),
                ("--futility-z", z, GateConfig().canary_futility_z),
                ("--seed", args.seed, 0),
            )
            if value != default
        )
        run_budget(args.budget, args.margin, z, args.runs, users, pops, eps, args.seed, args.json, command)
        return 0
    names = [n for n in DEFAULTS]
    command = "liverl bench canary" + "".join(
        f" --{n.replace('_', '-')} '{getattr(args, n)}'"
        if "(" in str(getattr(args, n))
        else f" --{n.replace('_', '-')} {getattr(args, n)}"
        for n in names
        if getattr(args, n) != DEFAULTS[n]
    )
    run(**{n: getattr(args, n) for n in names}, json_path=args.json, command=command)
    return 0
