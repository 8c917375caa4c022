"""The canary's tests at one look: each arm's evidence read from ingest's per-user buckets (``Evidence``), the
always-valid tests restored from the rollout's saved state and fed that evidence (``build_tests``: the user or the
judged event as the unit, heavy users' weight capped, latency's mean and quantile on batch means at equal answer
length), and what a look saves back (``look_record``,
with the family's error levels and the success metric's raw and bias-corrected effect and always-valid interval;
``saved_state``).

``deploy.gate.canary`` runs the rollout around them; ``deploy.gate.sequential`` holds the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.config import GateConfig
from deploy.gate import sequential as seq
from deploy.gate import sequential_quantile as sq
from deploy.gate.sequential_batches import look_batches
from deploy.gate.sequential_units import UnitSums
from deploy.gate.srm import SrmTest
from deploy.registry.tables import Rollout

MIN_USERS = 10
"""Users each arm needs before a user-unit test decides anything."""
LATENCY_MIN_BATCHES = 5
"""Buckets both arms served before the latency guardrail decides (its variance has this many less one degrees of
freedom, and the test reads its statistic as a Student t)."""
FIELDS = "eadrtmn"
"""Per-user sums ingest keeps (``keys.units``): events, accepts, edits, reverts, tokens, latency ms, timed events."""


@dataclass
class ArmSums:
    """One arm's evidence over the buckets read so far: per-user sums, and per-bucket totals (batch means).

    A bucket read before it is final (``final=False``: ingest may still be counting judgements into it) is read again
    at the next look, its earlier reading replaced: judgements count in the bucket of the user's judgement time, so a
    worker that lags behind writes into buckets a cursor has already passed."""

    users: dict[str, np.ndarray] = field(default_factory=dict)  # unit -> sums in FIELDS order
    buckets: dict[int, dict[str, int]] = field(default_factory=dict)  # bucket -> the '*' totals
    provisional: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # bucket -> unit -> its reading

    def add(self, bucket: int, data: dict[str, dict[str, int]], final: bool = True) -> None:
        for unit, row in self.provisional.pop(bucket, {}).items():  # the earlier reading of this bucket, replaced
            left = self.users[unit] - row
            if left.any():
                self.users[unit] = left
            else:
                del self.users[unit]
        rows: dict[str, np.ndarray] = {}
        for unit, sums in data.items():
            if unit == "*":
                self.buckets[bucket] = dict(sums)
                continue
            row = rows[unit] = np.array([sums.get(f, 0) for f in FIELDS], dtype=np.float64)
            if unit in self.users:
                self.users[unit] = self.users[unit] + row
            else:
                self.users[unit] = row.copy()
        if not final:
            self.provisional[bucket] = rows

    def total(self, f: str) -> int:
        return sum(b.get(f, 0) for b in self.buckets.values())

    def matrix(self) -> tuple[list[str], np.ndarray]:
        names = sorted(self.users)
        return names, (np.stack([self.users[u] for u in names]) if names else np.zeros((0, len(FIELDS))))


@dataclass
class Evidence:
    """What the gate has read of one rollout (rebuilt from Redis after a gate restart)."""

    rollout_id: int
    canary: ArmSums = field(default_factory=ArmSums)  # buckets whose revert horizon has closed: kept, reverts
    stable: ArmSums = field(default_factory=ArmSums)
    fast_canary: ArmSums = field(default_factory=ArmSums)  # buckets ingest has settled: what reverts do not touch
    fast_stable: ArmSums = field(default_factory=ArmSums)  # (edits, length, latency)
    covariate: dict[str, np.ndarray] = field(default_factory=dict)  # unit -> its sums in FIELDS order over the
    # look-back before the rollout (CUPED's covariates: each metric's own rate then)
    start: int | None = None  # the first bucket of evidence (``evidence_start``); None until the canary serves
    next_bucket: int = 0  # each cursor's first bucket not final yet (read again at each look until it is)
    next_fast: int = 0
    through: int = -1  # the newest bucket each cursor has read
    fast_through: int = -1
    looked_at: tuple[int, int] = (-1, -1)  # (through, fast_through) at the last look


def finite(d: dict) -> dict:
    """A look for the registry's JSON: no NaN or infinities (PostgreSQL's JSON has none)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def pending(tests: seq.Canary, info: dict) -> str:
    """Why a look decided nothing: what each test still waits for."""
    waiting = []
    s = tests.success
    if s.p_pass > tests.pass_alphas(s)[0]:
        ready = info.get(s.name, {}).get("ready", True)
        waiting.append(f"{s.name} (p better {s.p_pass:.3g}" + ("" if ready else ", too few users or events") + ")")
    for g in tests.guardrails:
        if g.required and g.p_pass > tests.pass_alphas(g)[0]:
            extra = ""
            if g.name.startswith("latency"):
                extra = f", {info.get(g.name, {}).get('batches', 0)} of {LATENCY_MIN_BATCHES} batches"
            elif not info.get(g.name, {}).get("ready", True):
                extra = ", too few users or events"
            waiting.append(f"guardrail {g.name} not yet shown non-inferior (p {g.p_pass:.3g}{extra})")
    return "collecting evidence" + (": waiting on " + "; ".join(waiting) if waiting else "")


def _col(m: np.ndarray, f: str) -> np.ndarray:
    return m[..., FIELDS.index(f)] if m.size else np.zeros(m.shape[:-1])


def build_tests(g: GateConfig, rollout: Rollout, ev: Evidence, settling: bool) -> tuple[seq.Canary, SrmTest, dict]:
    """The rollout's tests at this look, their always-valid state restored from the registry and updated with the
    evidence read so far; with the sample-ratio check and what each look estimated."""
    success, edit, revert, length, latency, latency_q, srm = restored_tests(g, rollout)
    guardrails = [t for t in (edit, revert, length, latency, latency_q) if t is not None]
    info: dict = {"events": (ev.canary.total("e"), ev.stable.total("e"))}
    if rollout.unit == "user":
        cap = (rollout.settings or {}).get("user_cap")  # fixed at the start (none: a rollout without one)
        _look_users(g, ev, (success, edit, revert, length), srm, info, cap)
    else:
        _look_requests(ev, (success, edit, revert, length), srm, info)
    equal_length = bool((rollout.settings or {}).get("latency_at_equal_length", False))  # fixed at the start
    if latency is not None:  # batch means: the buckets pair by time, so load both arms share cancels
        _look_latency(ev, latency, info, equal_length)
    if latency_q is not None:
        q = (rollout.settings or {})["latency_quantile"]
        qc, qs, gap = sq.paired_quantiles(ev.fast_canary.buckets, ev.fast_stable.buckets, q)
        info[latency_q.name] = sq.look_quantiles(
            latency_q, qc, qs, LATENCY_MIN_BATCHES, gap if equal_length and np.isfinite(gap).any() else None
        )
    if settling:  # a node that has just swapped runs hot for a few seconds: latency and length not judged worse
        for t in guardrails:
            if t.name.startswith("latency") or t.name == "response_length":
                t.max_log_lr_harm = float("-inf")
    share = (rollout.settings or {}).get("readout_share", 0.0)  # fixed at the start (none: a rollout without one)
    return seq.Canary(success, guardrails, readout_share=share), srm, info


def restored_tests(g: GateConfig, rollout: Rollout) -> tuple:
    """(success, edit, revert, length, latency, latency quantile, srm): the rollout's tests with the state saved at
    its last look; length and latency's are None without the band fixed at the start."""
    st = rollout.settings or {}
    state = rollout.test_state or {}
    common: dict[str, Any] = {"alpha": g.canary_alpha, "min_events": g.canary_min_events, "min_units": MIN_USERS}
    success = seq.MetricTest("acceptance", tau=g.canary_tau, direction=1, margin=g.canary_margin, **common)
    edit = seq.MetricTest("edit_rate", tau=g.canary_tau, direction=-1, margin=g.guardrail_margin, **common)
    revert = seq.MetricTest("revert_rate", tau=g.canary_tau, direction=-1, margin=g.guardrail_margin, **common)
    guardrails = [edit, revert]
    length = latency = None
    if st.get("length_band"):  # bands fixed at the start from stable's own figures (``CanaryController._fixed_nulls``)
        band = st["length_band"]
        length = seq.MetricTest(
            "response_length", tau=band, direction=-1, margin=band, harm_margin=band, bernoulli=False, **common
        )
        guardrails.append(length)
    if st.get("latency_band"):
        latency = _latency_test(g, "latency", st["latency_band"], g.latency_guardrail)
        guardrails.append(latency)
    latency_q = None
    if st.get("latency_q_band"):  # the quantile and its band, fixed at the start like the others
        latency_q = _latency_test(
            g, quantile_name(st["latency_quantile"]), st["latency_q_band"], g.latency_quantile_guardrail
        )
        guardrails.append(latency_q)
    for t in (success, *guardrails):
        t.max_log_lr_pass = state.get(f"{t.name}:pass", float("-inf"))
        t.max_log_lr_harm = state.get(f"{t.name}:harm", float("-inf"))
    srm = SrmTest(
        rollout.share,
        alpha=g.srm_alpha,
        max_log_bf_users=state.get("srm:users", float("-inf")),
        max_log_bf_events=state.get("srm:events", float("-inf")),
    )
    return success, edit, revert, length, latency, latency_q, srm


def _latency_test(g: GateConfig, name: str, band: float, mode: str) -> seq.MetricTest:
    """A latency guardrail (the mean or a quantile, ms, lower is better) within ``band``, fixed at the start;
    required for a promotion when its setting is ``non_inferior``."""
    return seq.MetricTest(
        name,
        tau=band,
        direction=-1,
        margin=band,
        harm_margin=band,
        bernoulli=False,
        alpha=g.canary_alpha,
        required=mode == "non_inferior",
    )


def quantile_name(q: float) -> str:
    """The latency quantile guardrail's name: ``latency_p90`` for 0.9."""
    return f"latency_p{100 * q:g}"


def _look_users(
    g: GateConfig, ev: Evidence, tests: tuple, srm: SrmTest, info: dict, user_cap: float | None = None
) -> None:
    """One look of each test with the user as the unit, on the evidence read so far (``look_user_tests``)."""
    names_c, m_c = ev.canary.matrix()
    names_s, m_s = ev.stable.matrix()
    fast_c, f_c = ev.fast_canary.matrix()
    fast_s, f_s = ev.fast_stable.matrix()
    pre = None
    if g.cuped and ev.covariate:
        pre = tuple(pre_rollout_sums(ev, names) for names in (names_c, names_s, fast_c, fast_s))
    look_user_tests(g, tests, srm, (m_c, m_s), (f_c, f_s), pre, info, user_cap)


def look_user_tests(
    g: GateConfig,
    tests: tuple,
    srm: SrmTest,
    slow: tuple,
    fast: tuple,
    pre: tuple | None,
    info: dict,
    user_cap: float | None = None,
) -> None:
    """One look of each test with the user as the unit: CUPED on acceptance when there is a covariate (``pre``), and
    on the edit rate, the revert rate and the response length too with ``gate.cuped_guardrails``; each metric's
    covariate is the user's own rate of it before the rollout (``pre_rollout_rate``).

    ``slow``: the (canary, stable) per-user sums in ``FIELDS`` order on the horizon's cursor (kept acceptance, the
    revert rate, the sample-ratio check), ``fast``: on the settled cursor (the edit rate, the response length); each a
    users x fields matrix, or looks x users x fields (a stack of looks, as ``deploy.gate.canary_sim_decisions`` hands
    it). ``pre``: each of those four arms' users' sums before the rollout (users x fields), or None (no CUPED)."""
    success, edit, revert, length = tests
    cuped = g.cuped and pre is not None
    cuped_guards = cuped and g.cuped_guardrails
    m_c, m_s = slow

    def arms(f: str, on_fast: bool = False, cov: bool = False) -> tuple[UnitSums, UnitSums]:
        out = []
        for i, m in enumerate(fast if on_fast else slow):
            num = _col(m, "a") - _col(m, "r") if f == "kept" else _col(m, f)
            covariate = pre_rollout_rate(pre[i + 2 * on_fast], f) if cov and pre is not None else ()
            out.append(UnitSums(num, _col(m, "e"), *covariate))
        return out[0], out[1]

    kept = arms("kept", cov=cuped)
    info["acceptance"] = seq.look_units(success, *kept, cuped=cuped, user_cap=user_cap)
    info["edit_rate"] = seq.look_units(
        edit, *arms("d", on_fast=True, cov=cuped_guards), cuped=cuped_guards, user_cap=user_cap
    )
    info["revert_rate"] = seq.look_units(revert, *arms("r", cov=cuped_guards), cuped=cuped_guards, user_cap=user_cap)
    if length is not None:
        info["response_length"] = seq.look_units(
            length, *arms("t", on_fast=True, cov=cuped_guards), cuped=cuped_guards, user_cap=user_cap
        )
    info["users"] = (m_c.shape[-2], m_s.shape[-2])
    info["srm"] = srm.look_units(*kept)  # on the horizon's cursor: see deploy.gate.canary's module doc


def pre_rollout_sums(ev: Evidence, names: list[str]) -> np.ndarray:
    """The users' sums (users x ``FIELDS``) in the look-back before the rollout; zeros for a user with none."""
    return np.array([ev.covariate.get(u, np.zeros(len(FIELDS))) for u in names], dtype=float).reshape(-1, len(FIELDS))


def pre_rollout_rate(pre: np.ndarray, f: str) -> tuple[np.ndarray, np.ndarray]:
    """Each user's rate of metric ``f`` (a field of ``FIELDS`` over events, or ``kept``: accepts less reverts) in
    the look-back before the rollout (``pre``: the users' sums then, ``pre_rollout_sums``), and the events behind it;
    NaN and 0 for a user with no history (CUPED imputes the arm's mean). A covariate fixed before the rollout leaves
    the estimate unbiased whatever it predicts."""
    events = _col(pre, "e")
    value = _col(pre, "a") - _col(pre, "r") if f == "kept" else _col(pre, f)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(events > 0, value / events, np.nan), events


def _look_requests(ev: Evidence, tests: tuple, srm: SrmTest, info: dict) -> None:
    """One look of each test with the judged event as the unit."""
    success, edit, revert, length = tests
    for test, f, (canary, stable) in (
        (success, None, (ev.canary, ev.stable)),
        (edit, "d", (ev.fast_canary, ev.fast_stable)),
        (revert, "r", (ev.canary, ev.stable)),
    ):
        for arm, sums in ((test.canary, canary), (test.stable, stable)):
            n = sums.total("e")
            hits = min(n, max(0, sums.total("a") - sums.total("r") if f is None else sums.total(f)))
            arm.add(1.0, hits)
            arm.add(0.0, n - hits)
        test._look()
    if length is not None:
        for arm, sums in ((length.canary, ev.fast_canary), (length.stable, ev.fast_stable)):
            arm.n, arm.total, arm.total_sq = sums.total("e"), float(sums.total("t")), float(sums.total("t2"))
        length._look()
    info["srm"] = srm.look_requests(*info["events"])


def _look_latency(ev: Evidence, latency: seq.MetricTest, info: dict, equal_length: bool = False) -> None:
    """One look of the latency guardrail on the batch means of the buckets both arms served (at equal answer
    length with ``equal_length``: ``deploy.gate.sequential_batches.batch_means``)."""
    cb, sb = ev.fast_canary.buckets, ev.fast_stable.buckets
    both = [b for b in sorted(set(cb) & set(sb)) if cb[b].get("n") and sb[b].get("n")]
    means = [(cb[b]["m"] / cb[b]["n"], sb[b]["m"] / sb[b]["n"]) for b in both]
    gap = [sq.length_gap(cb[b], sb[b]) for b in both] if equal_length else None
    if gap is not None and not np.isfinite(gap).any():  # no lengths recorded: the plain batch means
        gap = None
    info["latency"] = look_batches(
        latency, [c for c, _ in means], [s for _, s in means], min_batches=LATENCY_MIN_BATCHES, covariate=gap
    )
    if means:  # the mean of the buckets' means, each arm (what the batch-means test compares)
        info["latency_means"] = (float(np.mean([c for c, _ in means])), float(np.mean([s for _, s in means])))


def look_record(now: float, tests: seq.Canary, srm: SrmTest, info: dict, ev: Evidence) -> dict:
    """What a look saves with the rollout (the on-call page's plot), JSON-safe."""
    summary = tests.success.summary()
    c_events, s_events = info["events"]
    users = info.get("users", (None, None))
    return finite(
        {
            "at": now,
            "canary_events": c_events,
            "stable_events": s_events,
            "canary_acceptance": summary["canary_mean"],
            "stable_acceptance": summary["stable_mean"],
            "p_better": tests.success.p_pass,
            "p_worse": tests.success.p_harm,
            "canary_users": users[0],
            "stable_users": users[1],
            "cuped_removed": info.get("acceptance", {}).get("cuped_removed"),
            "p_srm": min(srm.p_users, srm.p_events),
            "through_bucket": ev.through,
        }
        | tests.success.effect()  # raw, bias-corrected, always-valid interval (deploy.gate.sequential_readout)
        | {f"family_{k}": v for k, v in tests.guarantee().items()}  # the levels the verdict was taken at
    )


def saved_state(tests: seq.Canary, srm: SrmTest, settling: bool) -> dict:
    """The tests' always-valid state to save with the rollout (running maxima; passing evidence counts after
    settling), finite for JSON."""
    state = {
        f"{t.name}:{side}": v
        for t in (tests.success, *tests.guardrails)
        for side, v in (("pass", t.max_log_lr_pass), ("harm", t.max_log_lr_harm))
        if v > float("-inf") and not (settling and side == "pass")
    }  # passing evidence counts after settling
    state |= {
        k: v
        for k, v in (("srm:users", srm.max_log_bf_users), ("srm:events", srm.max_log_bf_events))
        if v > float("-inf")
    }
    state = {k: min(v, 1e300) for k, v in state.items()}  # finite JSON
    return state
