"""Whole canaries played through the gate's own decision: every test, both cursors, ``Canary.verdict``.

``deploy.gate.canary_sim`` calibrates one test, the success metric's. A canary's outcome is more than that: a
promotion waits for every required guardrail to be shown non-inferior, any metric shown worse aborts, the metrics a
revert can change are read a revert horizon later than the others, reverts arrive late and are censored at that read,
and an evidence budget, a futility stop and a deadline end what is undecided. ``simulate_decisions`` plays whole
canaries through the code the gate runs at each look:

- the tests are built by ``deploy.gate.canary_tests.restored_tests`` from a ``GateConfig`` and a ``Rollout`` whose
  settings hold the bands ``CanaryController._fixed_nulls`` fixes at the start (stable's response length and latency
  before the rollout, times ``gate.guardrail_tolerance`` and ``gate.latency_tolerance``) and the evidence budget;
- each look feeds them through ``canary_tests.look_user_tests`` (the user as the unit, CUPED on kept acceptance and,
  with ``gate.cuped_guardrails``, on the edit rate, the revert rate and the response length, each on the user's own
  rate of it over ``gate.cuped_lookback_s`` before the rollout) and the latency guardrail through
  ``canary_tests._look_latency`` (batch means of the buckets);
- the looks come at the gate's cadence (``gate.poll_s``) with its two cursors (``canary.last_final_bucket``'s
  arithmetic, ``_last_final``): kept
  acceptance, the revert rate and the sample-ratio check read a bucket once its revert horizon has closed, the edit
  rate, the response length and latency as soon as it has settled. A revert counts in its generation's bucket only
  if it arrived before the gate read that bucket: the censoring the gate's reads make;
- each look decides with ``canary.look_verdict`` (``Canary.verdict`` with the budget, the futility stop and the
  deadline), then the sample-ratio check, as ``CanaryController.watch`` does.

The stacked looks: each test is fed every bucket position of its cursor at once (``look_units`` on a stack of looks
leaves the same state as one look after another), and each look of the gate then reads the state at its cursors'
positions. ``gate.canary_min_s`` (settling) and the request unit are not played: ``ValueError``.

The world (``_World``; ``canary_sim._world`` draws one outcome per answer, this one an edit, a kept or reverted accept
or a reject, a length and a latency): ``n_users`` users of one ``canary_sim.POPULATIONS`` acceptance (``segments3`` by
default) with heterogeneous activity (``canary_sim.ACTIVITIES``), each with its own edit propensity (an edit among the
answers not accepted, Beta with mean ``EDIT_MEAN``), revert propensity (a revert among the accepts, Beta with mean
``REVERT_MEAN``) and mean response length; assigned by the router's ``core.fleet.bucket`` (``canary_sim.assign``) at
``gate.canary_share``; judged at ``events_per_s`` (all traffic, Poisson per bucket); reverts come an exponential delay
after the accept (mean ``revert_delay_s``, 30 s: the demo's trap, 92% within its 75-s horizon). Latency is each answer's
tokens times a per-bucket load of each node (log-normal, ``LOAD_SIGMA``) and a per-request spread; no candidate changes
it, nor the edit rate or the length. Each run plays every candidate (``CANDIDATES``) on the same users, assignment,
event times and draws: an answer's judgement is one uniform draw against the user's edit, kept, reverted and rejected
shares, so a candidate moves answers between those only where its shares differ.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import keys
from core.config import GateConfig
from deploy.gate import sequential as seq
from deploy.gate.canary import SETTLE_S, evidence_start, look_verdict
from deploy.gate.canary_sim import assign, user_activity, user_rates
from deploy.gate.canary_tests import FIELDS, Evidence, _look_latency, look_user_tests, restored_tests
from deploy.registry.tables import Rollout

CANDIDATES: dict[str, tuple[float, float]] = {
    "A/A": (0.0, 0.0),
    "+3 points": (0.03, 0.0),
    "bait": (-0.02, 0.08),
    "exploit": (0.0, 0.047),
}
"""Each candidate's change to every canary user's shares of its answers, (kept accepts, reverted accepts), taken from
or given to the rejected ones: A/A changes nothing; "+3 points" turns 3 points of rejects into kept accepts (kept
acceptance +3, the guardrails unchanged); the "bait" turns 6 points of rejects into accepts and 2 points of kept
accepts into reverted ones (accepts +6 points, reverts +8, kept acceptance -2); the "exploit" is the demo's smallest
exploiting version (``liverl.demo.report``: 15 points more bait answers to the trap segment, half the traffic, of
whose users 70% accept the bait and revert 90% of it: reverts +0.5 x 0.15 x 0.7 x 0.9 = +4.7 points) with kept
acceptance unchanged, as if it were better elsewhere: the hardest such version for the gate, which must never
promote it. Where a user's shares cannot give that much, the change is scaled down for that user (``realized``
reports the mean change over the canary's events)."""
DEFAULT_CANDIDATES = ("A/A", "+3 points", "bait")
"""The candidates a run plays unless told (``exploit`` belongs to the demo's world)."""
EDIT_MEAN, EDIT_CONCENTRATION = 0.15, 10.0
"""Each user's share of edits among the answers it does not accept: Beta with this mean and concentration."""
REVERT_MEAN, REVERT_CONCENTRATION = 0.05, 10.0
"""Each user's share of reverts among its accepts: Beta with this mean and concentration (the ``bench`` world)."""


@dataclass(frozen=True)
class Reverts:
    """Who reverts, and how much: a share ``users`` of the users revert (the rest never do), each a share of its
    accepts drawn from Beta(``mean``, ``concentration``); ``history_s``: seconds of stable's traffic before the
    rollout that CUPED's covariates see (None: ``gate.cuped_lookback_s``, a deployment long past its start)."""

    users: float = 1.0
    mean: float = REVERT_MEAN
    concentration: float = REVERT_CONCENTRATION
    history_s: float | None = None


WORLDS: dict[str, Reverts] = {
    "bench": Reverts(),
    "demo": Reverts(users=0.35, mean=0.6, concentration=10.0, history_s=120.0),
}
"""``bench``: every user reverts a few of its accepts (mean 5%), with the whole look-back behind the rollout.
``demo``: the demo's trap, measured in its runs: only the trap segment's tempted users revert (half the users are of
the segment, 70% of them tempted), about 60% of their accepts (the bait they accepted, 90% of it reverted), so the
revert rate is about 9-10% of all judged events and held by a third of the users; its first canary starts about
two minutes into the run, so CUPED sees two minutes of history."""
LENGTH_MEAN, LENGTH_SIGMA, LENGTH_SHAPE = 150.0, 0.4, 4.0
"""Response length: each user's mean tokens log-normal about ``LENGTH_MEAN`` (sigma ``LENGTH_SIGMA``), each answer's
Gamma about it with shape ``LENGTH_SHAPE`` (coefficient of variation 0.5)."""
LATENCY_BASE_MS, LATENCY_PER_TOKEN_MS, LATENCY_SIGMA, LOAD_SIGMA = 50.0, 2.0, 0.3, 0.2
"""Latency: ``LATENCY_BASE_MS`` plus ``LATENCY_PER_TOKEN_MS`` per token, times the serving node's load in that
bucket (log-normal, sigma ``LOAD_SIGMA``, each node its own) and a per-request spread (log-normal,
``LATENCY_SIGMA``)."""
ENDS = ("promoted", "worse", "futile", "deadline", "budget", "srm", "undecided")
"""How a canary ends: promoted; aborted with a metric shown worse, as futile, undecided at the deadline in time or
with its evidence budget spent, or on a sample-ratio mismatch; undecided: no canary (every user on one arm)."""
_WORK = 3_000_000
"""Matrix cells (looks x users x fields) per stack of looks handed to the tests at once: bounds the memory at
100,000 users."""


@dataclass
class _World:
    """One simulated canary, everything but the candidate: times and cursors of the gate's looks, the users, their
    events in the buckets the gate reads, and latency per bucket and arm."""

    rollout: Rollout
    look_t: np.ndarray  # when each look happens
    look_fast: np.ndarray  # the settled cursor's bucket position at each look (-1: nothing read yet)
    look_slow: np.ndarray  # the horizon's cursor's
    on: np.ndarray  # per user: on the canary arm
    shares: np.ndarray  # per user: (edit, kept, reverted) shares of its answers under stable
    ev_pos: np.ndarray  # per event, in time order: its bucket position, user, uniform draw, tokens, and whether a
    ev_user: np.ndarray  # revert of it (if it is a reverted accept) arrives before the gate reads its bucket
    ev_u: np.ndarray
    ev_tokens: np.ndarray
    ev_counted: np.ndarray
    pre: np.ndarray  # per user: sums before the rollout in FIELDS order
    t0: float  # the rollout's start
    b0: int  # its first bucket of evidence (position 0)
    buckets: int  # the buckets the settled cursor reads by the deadline
    latency_states: list | None = None  # the latency guardrail's state at each settled position (_latency_states)


def simulate_decisions(
    gate: GateConfig,
    n_users: int = 1000,
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
    runs: int = 200,
    *,
    world: str = "bench",
    population: str = "segments3",
    activity: str = "lognormal",
    activity_sigma: float = 1.0,
    events_per_s: float = 50.0,
    revert_delay_s: float = 30.0,
    swap_s: float = 2.0,
    seed: int = 0,
) -> dict:
    """``runs`` canaries of each candidate (``CANDIDATES``) with ``gate``'s settings in a world of ``n_users`` users
    (module docstring), judged ``events_per_s`` (all traffic); the canary nodes serve the candidate ``swap_s`` after
    the rollout starts. Returns, per candidate: how many runs ended each way (``ENDS``), which metric was shown worse
    (``worse_by``), the median seconds from the start and canary-arm judged events (on the horizon's cursor, the
    budget's measure) to a promotion or an abort on a metric shown worse, and the realized change of kept acceptance
    and of the revert rate over the canary's events (the mean over runs)."""
    if unknown := [c for c in candidates if c not in CANDIDATES]:
        raise ValueError(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    if world not in WORLDS:
        raise ValueError(f"unknown world {world!r}; known: {', '.join(WORLDS)}")
    if gate.canary_unit != "user" or gate.canary_min_s > 0 or not 0 < gate.canary_share < 1:
        raise ValueError(
            "the simulation plays the user unit with no settling time and a share in (0, 1): gate.canary_unit "
            f"'user' (got {gate.canary_unit!r}), gate.canary_min_s 0 (got {gate.canary_min_s}), gate.canary_share "
            f"(got {gate.canary_share})"
        )
    if runs < 1 or n_users < 2 or events_per_s <= 0 or revert_delay_s <= 0 or swap_s < 0:
        raise ValueError("runs >= 1, n_users >= 2, events_per_s > 0, revert_delay_s > 0 and swap_s >= 0")
    secret = f"liverl-bench-canary-decisions-{seed}".encode()
    tally: dict[str, dict[str, Any]] = {
        c: {
            "ends": Counter(),
            "worse_by": Counter(),
            "waiting_on": Counter(),
            "seconds": [],
            "events": [],
            "kept": [],
            "revert": [],
        }
        for c in candidates
    }
    for run in range(runs):
        rng = np.random.default_rng([seed, 11, run])
        on = assign(secret, 3_000_003 * seed + run + 1, n_users, gate.canary_share)
        w = _world(gate, rng, on, population, activity, activity_sigma, events_per_s, revert_delay_s, swap_s, world)
        for c in candidates:
            out = tally[c]
            if w is None:
                out["ends"]["undecided"] += 1
                continue
            end, metric, seconds, events, realized = _play(gate, w, CANDIDATES[c])
            out["ends"][end] += 1
            if metric:
                out["worse_by" if end == "worse" else "waiting_on"][metric] += 1
            if end in ("promoted", "worse"):
                out["seconds"].append(seconds)
                out["events"].append(events)
            out["kept"].append(realized[0])
            out["revert"].append(realized[1])
    return {
        "users": n_users,
        "runs": runs,
        "world": world,
        "population": population,
        "activity": activity if activity != "lognormal" else f"lognormal({activity_sigma:g})",
        "events_per_s": events_per_s,
        "revert_delay_s": revert_delay_s,
        "seed": seed,
        "candidates": {c: _summary(out, runs) for c, out in tally.items()},
    }


def false_decisions(result: dict, gate: GateConfig) -> int:
    """How many of an A/A candidate's canaries (``result``: one of ``simulate_decisions``' candidates) decided
    falsely: aborted on a metric shown worse or on a sample-ratio mismatch, and promoted when the success metric must
    be shown better (``gate.canary_margin`` 0; with a margin, an A/A candidate is within it, and promoting it is
    right)."""
    ends = result["ends"]
    return ends["worse"] + ends["srm"] + (ends["promoted"] if gate.canary_margin == 0 else 0)


def _summary(out: dict, runs: int) -> dict:
    median = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    return {
        "ends": {e: out["ends"][e] for e in ENDS},
        "rates": {e: out["ends"][e] / runs for e in ENDS},
        "worse_by": dict(out["worse_by"]),
        "waiting_on": dict(out["waiting_on"]),
        "median_seconds": median(out["seconds"]),
        "median_canary_events": median(out["events"]),
        "realized": {k: float(np.mean(out[k])) for k in ("kept", "revert")} if out["kept"] else None,
    }


# ----------------------------------------------------------------------------------------------------- the world


def _last_final(now: np.ndarray, horizon_s: float) -> np.ndarray:
    """``canary.last_final_bucket`` at each of the times ``now`` (its arithmetic on an array)."""
    return (np.floor((now - horizon_s - SETTLE_S) / keys.UNIT_BUCKET_S) - 1).astype(int)


def _world(
    gate, rng, on, population, activity, sigma, events_per_s, revert_delay_s, swap_s, world="bench"
) -> _World | None:
    """One canary's world (``_World``, its reverts as ``WORLDS[world]``); None when every user is on one arm."""
    n = on.size
    if on.all() or not on.any():
        return None
    p = user_rates(population, n, rng)
    w = user_activity(activity, n, sigma, rng)
    edit = rng.beta(EDIT_MEAN * EDIT_CONCENTRATION, (1 - EDIT_MEAN) * EDIT_CONCENTRATION, n)
    r = WORLDS[world]
    rev = rng.beta(r.mean * r.concentration, (1 - r.mean) * r.concentration, n)
    if r.users < 1:  # drawn only here, so the bench world's draws stay those its tables were measured on
        rev = rev * (rng.random(n) < r.users)
    length = rng.lognormal(math.log(LENGTH_MEAN), LENGTH_SIGMA, n)
    shares = np.stack([(1 - p) * edit, p * (1 - rev), p * rev], axis=1)  # edit, kept, reverted; the rest rejected

    # the gate's looks: a poll every gate.poll_s from the start, a look where either cursor moved, and at the deadline
    bucket_s = keys.UNIT_BUCKET_S
    t0 = 1_000_000.0 * bucket_s + rng.uniform(0, bucket_s)  # the start's phase within a bucket
    deadline_at = t0 + gate.canary_deadline_s
    b0, end = evidence_start(t0 + swap_s, gate.canary_warmup_s), math.floor(deadline_at / bucket_s)
    polls = t0 + gate.poll_s * np.arange(1, math.ceil(gate.canary_deadline_s / gate.poll_s) + 1)
    fast, slow = (np.minimum(_last_final(polls, h), end) for h in (0.0, gate.revert_horizon_s))
    moved = np.ones(polls.size, bool)
    moved[1:] = (fast[1:] != fast[:-1]) | (slow[1:] != slow[:-1])
    moved[-1] = True  # the look at the deadline
    looks = np.nonzero(moved & ((fast >= b0) | (np.arange(polls.size) == polls.size - 1)))[0]
    buckets = max(int(fast[-1]) - b0 + 1, 0)

    # the events of the buckets the gate reads, in time order
    counts = rng.poisson(events_per_s * bucket_s, buckets)
    pos = np.repeat(np.arange(buckets), counts)
    at = (b0 + pos + rng.random(pos.size)) * bucket_s
    user = np.minimum(np.searchsorted(np.cumsum(w), rng.random(pos.size)), n - 1)
    tokens = rng.gamma(LENGTH_SHAPE, length[user] / LENGTH_SHAPE)
    read_at = polls[np.minimum(np.searchsorted(slow, b0 + pos), polls.size - 1)]  # when the gate reads the bucket
    read_at = np.where(np.searchsorted(slow, b0 + pos) < polls.size, read_at, np.inf)
    counted = at + rng.exponential(revert_delay_s, pos.size) < read_at

    # latency per bucket and arm: each node's load, each answer's spread
    load = rng.lognormal(0.0, LOAD_SIGMA, (2, max(buckets, 1)))
    ms = (LATENCY_BASE_MS + LATENCY_PER_TOKEN_MS * tokens) * rng.lognormal(0.0, LATENCY_SIGMA, pos.size)
    arm = (~on[user]).astype(int)  # 0: canary, 1: stable
    ms = ms * load[arm, pos]
    latency: tuple[dict, dict] = ({}, {})
    for a in (0, 1):
        sel = arm == a
        m_sum = np.bincount(pos[sel], weights=ms[sel], minlength=buckets)
        t_sum = np.bincount(pos[sel], weights=tokens[sel], minlength=buckets)
        n_sum = np.bincount(pos[sel], minlength=buckets)
        for i in np.nonzero(n_sum)[0]:  # every event timed: e = n
            n_i = int(n_sum[i])
            latency[a][b0 + int(i)] = {"m": int(m_sum[i]), "n": n_i, "t": int(t_sum[i]), "e": n_i}

    # each user's sums over the look-back before the rollout (CUPED's covariates; stable's figures for the bands)
    history_s = gate.cuped_lookback_s if r.history_s is None else min(r.history_s, gate.cuped_lookback_s)
    pre_n = rng.poisson(events_per_s * history_s * w)
    split = rng.multinomial(pre_n, np.column_stack([shares, 1 - shares.sum(1)]))
    pre = np.zeros((n, len(FIELDS)))
    for f, v in (("e", pre_n), ("a", split[:, 1] + split[:, 2]), ("d", split[:, 0]), ("r", split[:, 2])):
        pre[:, FIELDS.index(f)] = v
    pre[:, FIELDS.index("t")] = np.where(
        pre_n > 0, rng.gamma(np.maximum(pre_n, 1) * LENGTH_SHAPE, length / LENGTH_SHAPE), 0
    )
    stable_length = pre[:, FIELDS.index("t")].sum() / max(pre_n.sum(), 1)
    stable_latency = (LATENCY_BASE_MS + LATENCY_PER_TOKEN_MS * stable_length) * math.exp(
        (LATENCY_SIGMA**2 + LOAD_SIGMA**2) / 2
    )
    settings = {  # as CanaryController._fixed_nulls fixes them at the start
        "length_band": gate.guardrail_tolerance * stable_length,
        "latency_band": gate.latency_tolerance * stable_latency,
        "max_events": gate.canary_max_events,
        "futility_z": gate.canary_futility_z,
        "readout_share": gate.canary_readout_share,
        "latency_at_equal_length": gate.latency_at_equal_length,
        "user_cap": gate.canary_user_cap,
    }
    rollout = Rollout(
        id=1,
        version=2,
        stable_version=1,
        share=gate.canary_share,
        nodes=["canary-node"],
        unit="user",
        state="running",
        started_at=t0,
        deadline_at=deadline_at,
        settings=settings,
        test_state={},
    )
    world = _World(
        rollout=rollout,
        look_t=polls[looks],
        look_fast=np.where(fast[looks] >= b0, fast[looks] - b0, -1),
        look_slow=np.where(slow[looks] >= b0, slow[looks] - b0, -1),
        on=on,
        shares=shares,
        ev_pos=pos,
        ev_user=user,
        ev_u=rng.random(pos.size),
        ev_tokens=tokens,
        ev_counted=counted,
        pre=pre,
        t0=t0,
        b0=b0,
        buckets=buckets,
    )
    world.latency_states = _latency_states(gate, world, latency)
    return world


def _latency_states(gate: GateConfig, w: _World, latency: tuple[dict, dict]) -> list | None:
    """The latency guardrail's state (running maxima, latest estimate) after each bucket position of the settled
    cursor, fed as the gate feeds it (``canary_tests._look_latency`` on every bucket read so far); None without one.
    No candidate changes latency, so every candidate's canary reads the same states."""
    test = restored_tests(gate, w.rollout)[4]
    if test is None:
        return None
    ev, states = Evidence(w.rollout.id), []
    for pos in range(w.buckets):
        for arm, sums in ((ev.fast_canary, latency[0]), (ev.fast_stable, latency[1])):
            if w.b0 + pos in sums:
                arm.buckets[w.b0 + pos] = sums[w.b0 + pos]
        _look_latency(ev, test, {}, bool(w.rollout.settings["latency_at_equal_length"]))
        states.append((test.max_log_lr_pass, test.max_log_lr_harm, test.last, test.last_df, test.last_ready))
    return states


# ------------------------------------------------------------------------------------------------ one canary


def _shifted(w: _World, effect: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Each user's change of its kept and reverted shares under the candidate: ``effect`` on the canary's users,
    scaled down for a user whose shares cannot give that much (none below 0, the rejects' included); 0 on stable's."""
    dk, dv = effect
    d, k, v = w.shares.T
    scale = np.ones(d.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        for have, need in ((k, -dk), (v, -dv), (1 - d - k - v, dk + dv)):
            if need > 0:
                scale = np.minimum(scale, have / need)
    scale = np.clip(scale, 0.0, 1.0) * w.on
    return dk * scale, dv * scale


class _Stacks:
    """The user-unit tests fed every bucket position of the evidence, in stacks of positions as the looks need them:
    per position, each test's running maxima and estimate, the sample-ratio check, the canary's judged events."""

    def __init__(self, gate: GateConfig, w: _World, values: np.ndarray):
        self.gate, self.w = gate, w
        success, edit, revert, length, _, _, self.srm = restored_tests(gate, w.rollout)  # the feeder's own tests
        self.tests = (success, edit, revert, length)
        self.per: dict[str, dict[str, list]] = {}
        self.mismatch: list = []
        self.done = 0
        self.positions = w.buckets
        self.arms = []
        for arm in (w.on, ~w.on):
            sel = arm[w.ev_user]
            pos, user = w.ev_pos[sel], w.ev_user[sel]
            first = np.full(w.on.size, np.iinfo(np.int64).max)
            seen_users, at = np.unique(user, return_index=True)  # events are in time order: the first is the first
            first[seen_users] = pos[at]
            order = np.argsort(np.where(arm, first, np.iinfo(np.int64).max), kind="stable")  # by first event
            col = np.empty(w.on.size, int)
            col[order] = np.arange(w.on.size)
            seen = np.searchsorted(np.sort(first[arm]), np.arange(max(self.positions, 1)), side="right")
            self.arms.append({"pos": pos, "col": col[user], "values": values[sel], "order": order, "seen": seen})
            self.arms[-1]["base"] = np.zeros((0, len(FIELDS)))
        self.canary_events = np.cumsum(np.bincount(self.arms[0]["pos"], minlength=self.positions))
        users = max(int(self.arms[0]["seen"][-1] + self.arms[1]["seen"][-1]), 1)
        self.chunk = int(max(4, min(64, _WORK // (users * len(FIELDS)))))

    def upto(self, position: int) -> None:
        """Feed the tests the positions up to ``position``."""
        while self.done <= min(position, self.positions - 1):
            self._feed(self.done, min(self.done + self.chunk, self.positions))

    def _feed(self, p0: int, p1: int) -> None:
        mats, pre = [], []
        for a in self.arms:
            cols = int(a["seen"][p1 - 1])
            lo, hi = np.searchsorted(a["pos"], (p0, p1))
            flat = (a["pos"][lo:hi] - p0) * cols + a["col"][lo:hi]
            sums = np.zeros(((p1 - p0) * cols, len(FIELDS)))
            for j, f in enumerate("eadrt"):
                sums[:, FIELDS.index(f)] = np.bincount(flat, weights=a["values"][lo:hi, j], minlength=sums.shape[0])
            block = sums.reshape(p1 - p0, cols, len(FIELDS))
            block[0, : a["base"].shape[0]] += a["base"]
            for i in range(1, p1 - p0):
                block[i] += block[i - 1]
            a["base"] = block[-1]
            mats.append(block)
            pre.append(self.w.pre[a["order"][:cols]])
        info: dict = {}
        cap = self.gate.canary_user_cap
        look_user_tests(self.gate, self.tests, self.srm, tuple(mats), tuple(mats), (*pre, *pre), info, cap)
        for t in self.tests:
            if t is None:
                continue
            pl = info[t.name]["per_look"]
            per = self.per.setdefault(t.name, {k: [] for k in PER_LOOK})
            for k, v in per.items():
                v.extend(np.broadcast_to(pl[k], (p1 - p0,)).tolist())
        self.mismatch.extend(np.broadcast_to(info["srm"]["per_look"]["mismatch"], (p1 - p0,)).tolist())
        self.done = p1

    def restore(self, test: seq.MetricTest, position: int) -> None:
        """Set ``test`` (of the same name) to the feeder's state at ``position`` (-1: nothing read yet)."""
        if position < 0:
            _restore_state(test, _NOTHING)
            return
        per = self.per[test.name]
        _restore_state(
            test,
            (
                per["max_log_lr_pass"][position],
                per["max_log_lr_harm"][position],
                (per["d"][position], per["var"][position]),
                per["df"][position],  # the last look's degrees of freedom, and whether it could count:
                bool(per["ready"][position]),  # what the deadline's readout reads
            ),
        )


PER_LOOK = ("max_log_lr_pass", "max_log_lr_harm", "d", "var", "df", "ready")
"""What the feeder keeps of each test at each bucket position."""
_NOTHING = (float("-inf"), float("-inf"), None, math.inf, False)
"""A test's state before any look."""


def _restore_state(test: seq.MetricTest, state: tuple) -> None:
    """Set ``test``'s running maxima and latest look (``_NOTHING``'s fields) as a look of the gate leaves them."""
    test.max_log_lr_pass, test.max_log_lr_harm, test.last, test.last_df, test.last_ready = state


def _play(gate: GateConfig, w: _World, effect: tuple[float, float]) -> tuple[str, str | None, float, int, tuple]:
    """One canary of one candidate, look by look as the gate takes them. Returns (end, the metric shown worse or
    None, seconds from the start, canary judged events on the horizon's cursor, (kept, revert) change realized)."""
    dk, dv = _shifted(w, effect)
    d, k, v = w.shares.T
    u, user = w.ev_u, w.ev_user
    lo_k = d[user]
    hi_k = lo_k + k[user] + dk[user]
    hi_v = hi_k + v[user] + dv[user]
    accept = (u >= lo_k) & (u < hi_v)
    reverted = (u >= hi_k) & (u < hi_v)
    values = np.column_stack([np.ones(u.size), accept, u < lo_k, reverted & w.ev_counted, w.ev_tokens])  # e a d r t
    on_e = w.on[user]
    realized = (float(dk[user][on_e].mean()), float(dv[user][on_e].mean())) if on_e.any() else (0.0, 0.0)

    stacks = _Stacks(gate, w, values)
    success, edit, revert, length, latency, _, _ = restored_tests(gate, w.rollout)  # the tests each look decides with
    canary = seq.Canary(
        success,
        [t for t in (edit, revert, length, latency) if t is not None],
        readout_share=w.rollout.settings["readout_share"],
    )
    for now, f, s in zip(w.look_t, w.look_fast, w.look_slow, strict=True):
        stacks.upto(max(f, s))
        for t, at in ((success, s), (edit, f), (revert, s), (length, f)):
            if t is not None:
                stacks.restore(t, at)
        if latency is not None and w.latency_states is not None:
            _restore_state(latency, w.latency_states[f] if f >= 0 else _NOTHING)
        events = int(stacks.canary_events[s]) if s >= 0 else 0
        verdict, why = look_verdict(canary, w.rollout, float(now), events)
        if s >= 0 and stacks.mismatch[s]:
            return "srm", None, float(now - w.t0), events, realized
        if verdict != seq.CONTINUE:
            end, metric = _end(canary, verdict, why)
            return end, metric, float(now - w.t0), events, realized
    return "undecided", None, float(w.look_t[-1] - w.t0) if w.look_t.size else 0.0, 0, realized


def _end(canary: seq.Canary, verdict: str, why: str) -> tuple[str, str | None]:
    """How a decided look ended (``ENDS``), and the metric shown worse, or for an undecided end the tests that had
    not passed (joined by '+')."""
    if verdict == seq.PROMOTE:
        return "promoted", None
    worse = [t.name for t in (*canary.guardrails, canary.success) if t.p_harm <= canary.harm_alpha(t)]
    if worse:
        return "worse", worse[0]
    named = re.search(r"(\w+) is worse", why)  # a readout that decided without the always-valid tests' state
    if named and not why.startswith("futile"):
        return "worse", named.group(1)
    waiting = [t.name for t in (canary.success, *canary.guardrails) if t.required and t.p_pass > t.alpha]
    end = "futile" if why.startswith("futile") else "budget" if "evidence budget spent" in why else "deadline"
    return end, "+".join(waiting) or None
