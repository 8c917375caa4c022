"""``liverl bench canary --decisions``: whole canaries through the gate's own decision, each candidate's outcome.

``liverl bench canary`` calibrates the success metric's test alone. This plays whole canaries
(``deploy.gate.canary_sim_decisions.simulate_decisions``): the tests the gate builds from its config (kept acceptance
with the user as the unit and CUPED; the edit rate, the revert rate and the response length non-inferior with CUPED;
latency on batch means), fed at the gate's look cadence on its two cursors (what a revert can change read a revert
horizon later, each revert counted only if it arrived before the gate read its bucket), decided by
``Canary.verdict`` with the evidence budget, the futility stop, the deadline and the sample-ratio check.

Scenarios: each gate profile of ``--profiles`` (``defaults``: the gate's own defaults, 20% of users for 30 minutes;
``demo``: ``liverl demo``'s ``DEMO_PROFILE``, half the users, non-inferiority within 3 points, a 6,000-event budget
within 8 minutes), each activity of ``--activity`` (log-normal of sigma ``--activity-sigma``, the demo's, or Zipf:
``zipf(1.1)``, the top user 13-18% of all traffic), each size of ``--users``; ``--runs`` canaries each (``--large-runs``
at 100,000 users and more). Candidates: an A/A, one 3 points better on kept acceptance with its guardrails unchanged,
and a bait (6 points more accepts, 8 more reverted later: kept acceptance 2 points lower).

Bars, marked pass or FAIL in each scenario (rates with their exact binomial 95% bounds):

- A/A: false decisions (promoted where the success metric must be shown better, aborted on a metric shown worse or a
  sample-ratio mismatch) at most ``gate.canary_alpha``; with a margin (the demo's) promoting an A/A is right.
- +3 points: promoted in at least 80% of canaries by the deadline.
- bait: aborted on a metric shown worse in at least 80%, and never promoted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from liverl.bench.rates import binomial_upper, split_list

DEFAULTS = {
    "runs": 300,
    "large_runs": 100,
    "users": "1000,10000,100000",
    "profiles": "defaults,demo",
    "activity": "lognormal,zipf(1.1)",
    "populations": "segments3",
    "world": "bench",
    "candidates": "A/A,+3 points,bait",
    "events_per_s": 50.0,
    "activity_sigma": 1.0,
    "seed": 0,
}
LARGE = 100_000
"""From this many users, ``--large-runs`` canaries per scenario (each costs ~10 times one at 10,000)."""
POWER_BAR = 0.8
"""The share of "+3 points" canaries to promote, and of bait canaries to abort on a metric shown worse."""


def gate_for(profile: str, overrides: dict | None = None):
    """The gate's config of a profile, ``defaults`` (``GateConfig()``) or ``demo`` (``DEMO_PROFILE``'s gate), with
    ``overrides`` (field: value, validated as the config file's would be) on top."""
    from core.config import GateConfig

    if profile == "defaults":
        base: dict = {}
    elif profile == "demo":
        from liverl.demo.run import DEMO_PROFILE

        base = dict(DEMO_PROFILE["gate"])
    else:
        raise ValueError(f"unknown gate profile {profile!r}; defaults or demo")
    return GateConfig.model_validate(base | (overrides or {}))


def parse_overrides(items: list[str] | None) -> dict:
    """``["canary_max_events=8000", "latency_guardrail=harm"]`` -> a dict of gate fields (JSON values, else strings);
    ValueError on an unknown field or a malformed item."""
    from core.config import GateConfig

    out: dict = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("gate.")
        if not sep or key not in GateConfig.model_fields:
            raise ValueError(
                f"--gate takes FIELD=VALUE with a field of [gate] (e.g. canary_max_events=8000), got {item!r}"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(
    runs: int = DEFAULTS["runs"],
    large_runs: int = DEFAULTS["large_runs"],
    users: str = DEFAULTS["users"],
    profiles: str = DEFAULTS["profiles"],
    activity: str = DEFAULTS["activity"],
    populations: str = DEFAULTS["populations"],
    world: str = DEFAULTS["world"],
    candidates: str = DEFAULTS["candidates"],
    events_per_s: float = DEFAULTS["events_per_s"],
    activity_sigma: float = DEFAULTS["activity_sigma"],
    seed: int = DEFAULTS["seed"],
    overrides: dict | None = None,
    json_path: str | None = None,
    command: str = "liverl bench canary --decisions",
) -> dict:
    from deploy.gate.canary_sim_decisions import simulate_decisions

    rows, t_all = [], time.process_time()
    for profile in [p.strip() for p in profiles.split(",") if p.strip()]:
        gate = gate_for(profile, overrides)
        for act in split_list(activity):
            for pop in split_list(populations):
                for k in [int(u) for u in str(users).split(",") if u.strip()]:
                    t0 = time.process_time()
                    n = large_runs if k >= LARGE else runs
                    res = simulate_decisions(
                        gate,
                        k,
                        tuple(c.strip() for c in candidates.split(",") if c.strip()),
                        runs=n,
                        world=world,
                        population=pop,
                        activity=act,
                        activity_sigma=activity_sigma,
                        events_per_s=events_per_s,
                        seed=seed,
                    )
                    res |= {"profile": profile, "gate": _gate_text(gate), "cpu_s": time.process_time() - t0}
                    res["bars"] = bars(res, gate)
                    rows.append(res)
                    print(_scenario(res), flush=True)
    summary = {"rows": rows, "command": command, "cpu_s": time.process_time() - t_all}
    print(_summary(summary))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return summary


def bars(res: dict, gate) -> dict[str, dict]:
    """Each candidate's bar in one scenario: what is counted, of how many, the threshold, and whether it holds."""
    from deploy.gate.canary_sim_decisions import false_decisions

    out, n = {}, res["runs"]
    cands = res["candidates"]
    if "A/A" in cands:
        k = false_decisions(cands["A/A"], gate)
        out["A/A"] = {"count": k, "runs": n, "upper": binomial_upper(k, n), "at_most": gate.canary_alpha}
        out["A/A"]["ok"] = k / n <= gate.canary_alpha
    if "+3 points" in cands:
        k = cands["+3 points"]["ends"]["promoted"]
        out["+3 points"] = {"count": k, "runs": n, "lower": 1 - binomial_upper(n - k, n), "at_least": POWER_BAR}
        out["+3 points"]["ok"] = k / n >= POWER_BAR
    for bad in ("bait", "exploit"):
        if bad in cands:
            e = cands[bad]["ends"]
            k = e["worse"]
            out[bad] = {"count": k, "runs": n, "lower": 1 - binomial_upper(n - k, n), "at_least": POWER_BAR}
            out[bad] |= {"promoted": e["promoted"], "promoted_upper": binomial_upper(e["promoted"], n)}
            out[bad]["ok"] = k / n >= POWER_BAR and e["promoted"] == 0
    return out


def _gate_text(g) -> str:
    budget = ", no budget"
    if g.canary_max_events:
        stop = "off" if g.canary_futility_z is None else f"z {g.canary_futility_z:g}"
        budget = f", budget {g.canary_max_events:,} canary events (futility stop {stop})"
    return (
        f"share {g.canary_share:g}, deadline {g.canary_deadline_s:g} s, revert horizon {g.revert_horizon_s:g} s"
        + budget
        + (f", non-inferiority within {g.canary_margin:g}" if g.canary_margin else ", shown better")
        + f", guardrails within {g.guardrail_margin:g}, latency {g.latency_guardrail} within "
        f"{g.latency_tolerance:.0%}, alpha {g.canary_alpha:g}, min {g.canary_min_events} events"
    )


def _pct(k: int, n: int) -> str:
    return f"{k / n:.1%}"


def _counts(c: dict) -> str:
    return ", ".join(f"{name} {v}" for name, v in sorted(c.items(), key=lambda kv: -kv[1])[:3])


def _bar_text(name: str, b: dict) -> str:
    ok = "pass" if b["ok"] else "FAIL"
    n = b["runs"]
    if name == "A/A":
        return f"false decisions {_pct(b['count'], n)} (≤{b['upper']:.1%}) ≤ {b['at_most']:.0%}: {ok}"
    text = f"{'promoted' if name == '+3 points' else 'shown worse'} {_pct(b['count'], n)} (≥{b['lower']:.1%})"
    text += f" ≥ {b['at_least']:.0%}"
    if name in ("bait", "exploit"):
        text += f", promoted {b['promoted']} (≤{b['promoted_upper']:.1%})"
    return f"{text}: {ok}"


def _scenario(res: dict) -> str:
    n = res["runs"]
    lines = [
        "",
        f"{res['profile']} gate ({res['gate']}); {res['world']} world, {res['population']} users, "
        f"{res['activity']} activity, "
        f"{res['users']:,} users, {res['events_per_s']:g} judged events/s, {n:,} canaries ({res['cpu_s']:.0f} CPU s)",
        "",
        "| candidate | promoted | aborted: shown worse (on) | futile | undecided at deadline / budget (waiting on) "
        "| srm | median to decision: s, canary events | bar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in res["candidates"].items():
        e = c["ends"]
        worse = _pct(e["worse"], n) + (f" ({_counts(c['worse_by'])})" if c["worse_by"] else "")
        undecided = f"{_pct(e['deadline'], n)} / {_pct(e['budget'], n)}"
        if c["waiting_on"]:
            undecided += f" ({_counts(c['waiting_on'])})"
        to = "-" if c["median_seconds"] is None else f"{c['median_seconds']:.0f}; {c['median_canary_events']:,.0f}"
        bar = _bar_text(name, res["bars"][name]) if name in res["bars"] else "-"
        lines.append(
            f"| {name} | {_pct(e['promoted'], n)} | {worse} | {_pct(e['futile'], n)} | {undecided} | "
            f"{_pct(e['srm'], n)} | {to} | {bar} |"
        )
    return "\n".join(lines)


def _summary_cell(name: str, b: dict | None) -> str:
    if b is None:
        return "-"
    if name == "A/A":
        return f"{_pct(b['count'], b['runs'])} (≤{b['upper']:.1%})"
    cell = f"{_pct(b['count'], b['runs'])} (≥{b['lower']:.1%})"
    return cell + (f", {b['promoted']}" if name in ("bait", "exploit") else "")


def _summary(summary: dict) -> str:
    rows = summary["rows"]
    names = ("A/A", "+3 points", "bait") + (("exploit",) if any("exploit" in r["bars"] for r in rows) else ())
    lines = [
        "",
        "Every scenario's bars (exact binomial 95% bounds in brackets)",
        "",
        "| gate | activity | users | canaries | A/A false decisions (≤ alpha) | +3 points promoted (≥ 80%) | "
        "bait shown worse (≥ 80%), promoted (none) | "
        + ("exploit shown worse (≥ 80%), promoted (none) | " if "exploit" in names else "")
        + "median s to decision: +3 / bait | bars |",
        "|---" * (len(names) + 6) + "|",
    ]
    failed = 0
    for r in rows:
        b, c = r["bars"], r["candidates"]
        to = " / ".join(
            "-" if name not in c or c[name]["median_seconds"] is None else f"{c[name]['median_seconds']:.0f}"
            for name in ("+3 points", "bait")
        )
        ok = all(x["ok"] for x in b.values())
        failed += not ok
        lines.append(
            f"| {r['profile']} | {r['activity']} | {r['users']:,} | {r['runs']:,} | "
            + " | ".join(_summary_cell(name, b.get(name)) for name in names)
            + f" | {to} | {'pass' if ok else 'FAIL'} |"
        )
    gates = {r["profile"]: r["gate"] for r in rows}
    lines += [""] + [f"{p}: {text}" for p, text in gates.items()]
    lines += [
        f"bars: {len(rows) - failed} of {len(rows)} scenarios pass",
        f"reproduce: `{summary['command']}` ({summary['cpu_s'] / 60:.0f} CPU min here)",
    ]
    return "\n".join(lines)


def cmd(args) -> int:
    """``liverl bench canary --decisions``: the canary bench's options (those left out take this bench's
    ``DEFAULTS``)."""
    chosen = {k: v if (v := getattr(args, k, None)) is not None else default for k, default in DEFAULTS.items()}
    overrides = parse_overrides(args.gate)
    command = "liverl bench canary --decisions" + "".join(
        f" --{k.replace('_', '-')} " + (f"'{v}'" if any(c in str(v) for c in "( ") else str(v))
        for k, v in chosen.items()
        if v != DEFAULTS[k]
    )
    command += "".join(f" --gate {item}" for item in args.gate or [])
    run(**chosen, overrides=overrides, json_path=args.json, command=command)
    return 0
