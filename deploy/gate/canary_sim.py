"""The canary's calibration in the world it is deployed in: simulated canaries judged by the gate's own code.

A population of sticky users with heterogeneous acceptance and activity, assigned to the arms by the router's own
rule (``core.fleet.bucket``, a fresh rollout id per canary), looked at once per closed bucket of judgements as
the gate looks, and judged by ``deploy.gate.sequential.look_units`` (the function the gate calls) and its sample-ratio
check; beside it, the per-event test on the same events (the variance that is wrong under sticky users) and with
each request drawn into an arm afresh (``gate.canary_unit = "request"``). ``liverl bench canary`` prints its tables;
``tests/deploy/test_sequential.py`` holds the bar in CI.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from core.fleet import bucket
from deploy.gate.sequential import (
    ABORT,
    FUTILITY_Z,
    PROMOTE,
    MetricTest,
    bernoulli_estimate,
    futile,
    look_units,
)
from deploy.gate.sequential_units import UnitSums
from deploy.gate.srm import MISMATCH, SrmTest

POPULATIONS = {
    "segments": "two segments, half the users accept 0.70, half 0.25 (the demo's shape)",
    "beta(2,2)": "acceptance ~ Beta(2, 2): mean 0.5, spread 0.22",
    "beta(0.5,1.5)": "acceptance ~ Beta(0.5, 1.5): mean 0.25, skewed, many users near 0",
    "beta(5,1)": "acceptance ~ Beta(5, 1): mean 0.83, many users near 1 (the demo's plateau)",
    "segments3": "three segments of a third of the users each, accepting 0.75, 0.40 and 0.10 on average, each user's "
    "rate ~ Beta with concentration 20 about its segment's (spread 0.07-0.11)",
}
ACTIVITIES = {
    "lognormal": "each user's share of traffic log-normal with sigma ``activity_sigma`` (the demo's is 1.0)",
    "zipf(s)": "each user's share of traffic proportional to 1 / rank^s, the ranks shuffled: at s 1.1 the top user "
    "sends 18% of all traffic among 1,000 users, 15% among 10,000",
}
SCHEMES = ("user", "user+cuped", "event, sticky users", "event, per request")
"""The tests the simulation runs on each canary: the user-unit test without and with CUPED, and the per-event test
on the same sticky users (the wrong variance) and on requests each drawn into an arm afresh."""


def user_rates(population: str, n_users: int, rng: np.random.Generator) -> np.ndarray:
    """Each user's acceptance rate, drawn from one of ``POPULATIONS``."""
    if population == "segments":
        return np.where(rng.random(n_users) < 0.5, 0.70, 0.25)
    if population == "segments3":
        mean = rng.choice(np.array([0.75, 0.40, 0.10]), n_users)
        return rng.beta(20.0 * mean, 20.0 * (1.0 - mean))
    if population.startswith("beta(") and population.endswith(")"):
        a, b = (float(v) for v in population[5:-1].split(","))
        return rng.beta(a, b, n_users)
    raise ValueError(f"unknown population {population!r}; one of {', '.join(POPULATIONS)} or beta(a,b)")


def user_activity(activity: str, n_users: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Each user's share of all traffic (summing to 1), drawn as one of ``ACTIVITIES`` says."""
    if activity == "lognormal":
        w = rng.lognormal(0.0, sigma, n_users)
    elif activity.startswith("zipf(") and activity.endswith(")"):
        w = rng.permutation(np.arange(1, n_users + 1, dtype=float) ** -float(activity[5:-1]))
    else:
        raise ValueError(f"unknown activity {activity!r}; lognormal or zipf(s)")
    return w / w.sum()


@lru_cache(maxsize=2048)
def assign(secret: bytes, rollout_id: int, n_users: int, share: float) -> np.ndarray:
    """Which of users ``sim-user-0 .. n_users-1`` are on the canary: the router's own rule (``fleet.bucket``).
    Cached (read-only), so the bench's populations of one size replay the same rollouts without hashing again."""
    on = np.fromiter((bucket(secret, rollout_id, f"sim-user-{u}") < share for u in range(n_users)), bool, n_users)
    on.flags.writeable = False
    return on


def simulate_sticky(
    population: str = "segments",
    n_users: int = 48,
    effects: tuple[float, ...] = (0.0, 0.03, -0.03),
    runs: int = 1000,
    *,
    share: float = 0.5,
    events_per_s: float = 50.0,
    bucket_s: float = 10.0,
    deadline_s: float = 1800.0,
    pre_s: float = 1800.0,
    activity_sigma: float = 1.0,
    activity: str = "lognormal",
    alpha: float = 0.05,
    tau: float = 0.03,
    min_events: int = 100,
    min_units: int = 10,
    srm_alpha: float = 0.001,
    seed: int = 0,
) -> dict:
    """Canaries in the deployed world: ``n_users`` sticky users of one ``population`` with heterogeneous activity
    (``activity``, one of ``ACTIVITIES``: log-normal weights of ``activity_sigma``, the demo's 1.0, or Zipf), assigned
    by the router's ``fleet.bucket`` with a fresh rollout id per run, judged ``events_per_s`` (all traffic) in buckets
    of ``bucket_s``; the gate looks once per closed bucket, until ``deadline_s``. Each user's events under stable in the
    ``pre_s`` before the start are CUPED's covariate. Each run plays every effect in ``effects`` (added to every canary
    user's rate, clipped to [0, 1]) on the same users, assignment and event times.

    Each run is judged by ``SCHEMES``: the user-unit test (``look_units``, as the gate calls it, on the whole
    stack of looks at once) without and with CUPED, the per-event test on the same events, and the per-event test on
    the same users with each request drawn into an arm afresh. Returns, per effect and scheme: the share of runs
    promoted, aborted and undecided at the deadline, the events (all traffic) to each decision, and for the user
    unit the share of variance CUPED removed at the last look and how often the SRM check fired."""
    if not (0 < share < 1 and runs >= 1 and n_users >= 2 and events_per_s > 0 and deadline_s >= bucket_s > 0):
        raise ValueError("share in (0, 1), runs >= 1, n_users >= 2, events_per_s > 0, deadline_s >= bucket_s > 0")
    per_bucket = max(1, round(events_per_s * bucket_s))
    looks = int(deadline_s // bucket_s)
    threshold = math.log(1.0 / alpha)
    secret = f"liverl-bench-canary-{seed}".encode()
    draws: dict[str, Any] = {
        "events_per_s": events_per_s,
        "pre_s": pre_s,
        "activity_sigma": activity_sigma,
        "activity": activity,
        "looks": looks,
        "per_bucket": per_bucket,
    }
    # per effect: per scheme {PROMOTE: runs, ABORT: runs, "events": [to each decision]}, "cuped_removed", "srm"
    res: dict[float, dict[str, Any]] = {
        eff: {s: {PROMOTE: 0, ABORT: 0, "events": []} for s in SCHEMES} | {"cuped_removed": [], "srm": 0}
        for eff in effects
    }
    for run in range(runs):
        rng = np.random.default_rng([seed, run])
        world = _world(rng, population, assign(secret, 1_000_003 * seed + run + 1, n_users, share), **draws)
        if world is None:
            continue  # every user on one arm: no canary to judge (counted undecided)
        p, on, k, cov, pre_n, user, slot, u01 = world
        p_e, on_e = p[user], on[user]
        to_canary = rng.random(user.size) < share  # the per-request world's draw
        den = _cumulative(np.bincount(slot, minlength=looks * n_users), looks)
        look_of = np.repeat(np.arange(looks), per_bucket)
        srm = SrmTest(share, alpha=srm_alpha)  # the arms' counts do not depend on the effect
        mismatch = srm.look_units(
            UnitSums(np.zeros_like(den[:, :k]), den[:, :k]), UnitSums(np.zeros_like(den[:, k:]), den[:, k:])
        )
        for eff in effects:
            accept = u01 < np.clip(p_e + eff * on_e, 0.0, 1.0)
            num = _cumulative(np.bincount(slot, weights=accept, minlength=looks * n_users), looks)
            c = UnitSums(num[:, :k], den[:, :k], cov[:k], pre_n[:k])
            s = UnitSums(num[:, k:], den[:, k:], cov[k:], pre_n[k:])
            out = res[eff]
            out["srm"] += mismatch["verdict"] == MISMATCH
            for scheme, cuped in (("user", False), ("user+cuped", True)):
                test = MetricTest("acceptance", alpha=alpha, tau=tau, min_events=min_events, min_units=min_units)
                pl = look_units(test, c, s, cuped)["per_look"]
                _decide(out[scheme], pl["max_log_lr_pass"], pl["max_log_lr_harm"], threshold, per_bucket)
                if cuped:
                    out["cuped_removed"].append(float(pl["cuped_removed"][-1]))
            # the per-event test: the same events and arms, then each request drawn afresh
            for scheme, arm in (("event, sticky users", on_e), ("event, per request", to_canary)):
                acc = accept if arm is on_e else u01 < np.clip(p_e + eff * to_canary, 0.0, 1.0)
                n_c, x_c, x_s = (
                    np.bincount(look_of, weights=x, minlength=looks).cumsum() for x in (arm, acc & arm, acc & ~arm)
                )
                n_s = per_bucket * np.arange(1, looks + 1) - n_c
                test = MetricTest("acceptance", alpha=alpha, tau=tau, min_events=min_events)
                d, var = bernoulli_estimate(n_c, x_c, n_s, x_s)
                pass_, harm = test.look(d, var, np.minimum(n_c, n_s) >= min_events)
                _decide(out[scheme], pass_, harm, threshold, per_bucket)
    return {
        "population": population,
        "users": n_users,
        "runs": runs,
        "share": share,
        "events_per_s": events_per_s,
        "bucket_s": bucket_s,
        "deadline_s": deadline_s,
        "pre_s": pre_s,
        "activity_sigma": activity_sigma,
        "activity": activity,
        "alpha": alpha,
        "tau": tau,
        "min_events": min_events,
        "min_units": min_units,
        "srm_alpha": srm_alpha,
        "seed": seed,
        "events_at_deadline": looks * per_bucket,
        "effects": {eff: _rates(out, runs) for eff, out in res.items()},
    }


def _world(rng, population, on, *, events_per_s, pre_s, activity_sigma, activity, looks, per_bucket):
    """One simulated canary's world: each user's rate and activity (``user_activity``), their arm ``on`` (the router's
    rule), relabelled so that the canary's users come first; each user's events under stable in the ``pre_s`` before
    the start (CUPED's covariate); who sends each event, in time order (drawn by activity), the flat (look, user)
    slot it counts in, and a uniform draw for its judgement. None when every user is on one arm."""
    n_users = on.size
    p = user_rates(population, n_users, rng)
    w = user_activity(activity, n_users, activity_sigma, rng)
    k = int(on.sum())
    if k in (0, n_users):
        return None
    order = np.argsort(~on, kind="stable")
    p, w, on = p[order], w[order], on[order]
    pre_n = rng.poisson(events_per_s * pre_s * w)
    pre_x = rng.binomial(pre_n, p)
    with np.errstate(invalid="ignore", divide="ignore"):
        cov = np.where(pre_n > 0, pre_x / np.maximum(pre_n, 1), np.nan)
    user = np.minimum(np.searchsorted(np.cumsum(w), rng.random(looks * per_bucket) * w.sum()), n_users - 1)
    slot = np.repeat(np.arange(looks), per_bucket) * n_users + user
    return p, on, k, cov, pre_n, user, slot, rng.random(user.size)


def _cumulative(counts: np.ndarray, looks: int) -> np.ndarray:
    """Per-bucket per-user counts (flat, bucket-major) to running sums per look (a row-by-row loop: numpy's cumsum
    along the first axis is several times slower on wide arrays)."""
    out = counts.astype(float).reshape(looks, -1)
    for i in range(1, looks):
        out[i] += out[i - 1]
    return out


def _decide(out: dict, pass_: np.ndarray, harm: np.ndarray, threshold: float, per_bucket: int) -> None:
    """The first look at which ``MetricTest.verdict`` is no longer undecided (worse wins a tie, as it does there)."""
    decided = np.nonzero((harm >= threshold) | (pass_ >= threshold))[0]
    if decided.size:
        i = decided[0]
        out[ABORT if harm[i] >= threshold else PROMOTE] += 1
        out["events"].append(int((i + 1) * per_bucket))


def _rates(out: dict, runs: int) -> dict:
    rows: dict[str, Any] = {}
    for scheme in SCHEMES:
        o = out[scheme]
        ev = sorted(o["events"])
        rows[scheme] = {
            "promoted": o[PROMOTE] / runs,
            "aborted": o[ABORT] / runs,
            "undecided": 1 - (o[PROMOTE] + o[ABORT]) / runs,
            "median_events": ev[len(ev) // 2] if ev else None,
        }
    cr = out["cuped_removed"]
    rows["cuped_removed"] = float(np.median(cr)) if cr else None
    rows["srm"] = out["srm"] / runs
    return rows


BUDGET_ENDS = ("promoted", "worse", "futile", "budget")
"""How a canary with an evidence budget ends: promoted, aborted shown worse, aborted as futile, or aborted with its
budget spent undecided."""


def simulate_budget(
    population: str = "beta(5,1)",
    n_users: int = 5000,
    effects: tuple[float, ...] = (0.0, -0.015, -0.03, -0.06),
    runs: int = 500,
    *,
    budget: int = 6000,
    margin: float = 0.03,
    futility_z: tuple[float | None, ...] = (None, FUTILITY_Z),
    share: float = 0.5,
    events_per_s: float = 60.0,
    bucket_s: float = 10.0,
    pre_s: float = 1800.0,
    activity_sigma: float = 1.0,
    activity: str = "lognormal",
    alpha: float = 0.05,
    tau: float = 0.03,
    min_events: int = 50,
    min_units: int = 10,
    seed: int = 0,
) -> dict:
    """Canaries as the demo runs them at its plateau: a non-inferiority test on kept acceptance (``margin``), the
    user as the unit with CUPED, and an evidence budget of ``budget`` judged events on the canary arm
    (``gate.canary_max_events``), judged with and without the futility stop (``futility_z``: None is without;
    ``deploy.gate.sequential.futile``, as ``Canary.verdict`` applies it). Users, activity, assignment and looks as in
    ``simulate_sticky``; each run plays every effect on the same users, assignment and event times.

    Per effect and futility setting: the share of runs that ended each way (``BUDGET_ENDS``) and the canary events
    spent until the end (median and mean). A promotion at ``effect <= -margin`` is a false one: the futility stop
    can only lower that rate; at ``effect`` 0 or above a futile stop is a lost promotion."""
    if not (0 < share < 1 and runs >= 1 and n_users >= 2 and events_per_s > 0 and bucket_s > 0 and budget >= 1):
        raise ValueError("share in (0, 1), runs >= 1, n_users >= 2, events_per_s > 0, bucket_s > 0, budget >= 1")
    per_bucket = max(1, round(events_per_s * bucket_s))
    looks = int(math.ceil(budget / (share * per_bucket) * 1.5)) + 2  # past the budget in (almost) every run
    threshold = math.log(1.0 / alpha)
    secret = f"liverl-bench-canary-budget-{seed}".encode()
    # per (effect, futility z): runs per end (BUDGET_ENDS) and "events": the canary events each run spent
    ends: dict[tuple[float, float | None], dict[str, Any]] = {
        (eff, z): {e: 0 for e in BUDGET_ENDS} | {"events": []} for eff in effects for z in futility_z
    }
    draws: dict[str, Any] = {
        "events_per_s": events_per_s,
        "pre_s": pre_s,
        "activity_sigma": activity_sigma,
        "activity": activity,
        "looks": looks,
        "per_bucket": per_bucket,
    }
    for run in range(runs):
        rng = np.random.default_rng([seed, 7, run])
        world = _world(rng, population, assign(secret, 2_000_003 * seed + run + 1, n_users, share), **draws)
        if world is None:
            continue
        p, on, k, cov, pre_n, user, slot, u01 = world
        p_e, on_e = p[user], on[user]
        den = _cumulative(np.bincount(slot, minlength=looks * n_users), looks)
        c_events = den[:, :k].sum(1)
        spent = c_events / budget
        for eff in effects:
            accept = u01 < np.clip(p_e + eff * on_e, 0.0, 1.0)
            num = _cumulative(np.bincount(slot, weights=accept, minlength=looks * n_users), looks)
            c = UnitSums(num[:, :k], den[:, :k], cov[:k], pre_n[:k])
            st = UnitSums(num[:, k:], den[:, k:], cov[k:], pre_n[k:])
            test = MetricTest(
                "acceptance", alpha=alpha, tau=tau, margin=margin, min_events=min_events, min_units=min_units
            )
            pl = look_units(test, c, st, cuped=True)["per_look"]
            worse, promoted = pl["max_log_lr_harm"] >= threshold, pl["max_log_lr_pass"] >= threshold
            for z in futility_z:
                hopeless = (
                    np.zeros(looks, bool)
                    if z is None
                    else pl["ready"] & futile(pl["d"], pl["var"], spent, -margin, tau, alpha, z)
                )
                over = spent >= 1.0
                first = np.nonzero(worse | promoted | hopeless | over)[0]
                i = int(first[0]) if first.size else looks - 1
                end = "worse" if worse[i] else "promoted" if promoted[i] else "futile" if hopeless[i] else "budget"
                out = ends[(eff, z)]
                out[end] += 1
                out["events"].append(int(c_events[i]))
    rows = []
    for (eff, z), out in ends.items():
        ev = sorted(out["events"])
        n = max(len(ev), 1)
        rows.append(
            {"effect": eff, "futility_z": z}
            | {e: out[e] / n for e in BUDGET_ENDS}
            | {"median_events": ev[len(ev) // 2] if ev else None, "mean_events": float(np.mean(ev)) if ev else None}
        )
    return {
        "population": population,
        "users": n_users,
        "runs": runs,
        "budget": budget,
        "margin": margin,
        "share": share,
        "events_per_s": events_per_s,
        "bucket_s": bucket_s,
        "alpha": alpha,
        "tau": tau,
        "seed": seed,
        "rows": rows,
    }
