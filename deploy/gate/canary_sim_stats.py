"""The calibration of what a canary's verdict claims beyond one metric's test (``liverl bench canary --stats``).

- ``simulate_readout``: canaries with the success metric and two required guardrails (edit and revert rates,
  non-inferior within a margin), the user as the unit with CUPED, in ``deploy.gate.canary_sim``'s world of sticky
  users (the router's assignment, a look per closed bucket, the function the gate calls). Each run is decided as
  ``deploy.gate.sequential.Canary.verdict`` decides it, at each readout share of ``readout_shares``: the family's
  levels (``deploy.gate.sequential_readout``: pass sides at ``alpha (1 - s)``, harm sides at ``alpha / m``), the
  fixed-horizon readout at the deadline at ``alpha s``. Returns per share and effect how canaries ended, the events to
  a decision, and for the promoted ones the raw estimate, the bias-corrected one (``shrunk``) and whether the
  always-valid interval (``confidence_sequence``) covered the effect, at the look that decided.
- ``simulate_latency_quantile``: latency on two nodes whose load is autocorrelated (an AR(1) process per node, and a
  slower load both share), the canary on one, each request's latency log-normal about its node's load; per bucket
  the gate's histogram (``core.keys.latency_bin``), each arm's quantile (``hist_quantile``) and the batch-means test
  (``look_quantiles``' arithmetic on every look), beside the mean latency's test on the same requests.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core import keys
from deploy.gate import sequential_readout as ro
from deploy.gate.canary_sim import _cumulative, _world, assign
from deploy.gate.sequential import MetricTest, look_units
from deploy.gate.sequential_quantile import MIN_EVENTS, hist_quantile
from deploy.gate.sequential_units import UnitSums

ENDS = ("promoted", "readout", "worse", "deadline")
"""How a canary of ``simulate_readout`` ends: promoted by the sequential tests, promoted by the readout at the
deadline, aborted shown worse (any harm side), or aborted at the deadline undecided."""
GUARDRAIL_RATES = {"edit_rate": (2.0, 18.0), "revert_rate": (1.0, 19.0)}
"""Each simulated user's guardrail rates ~ Beta(a, b): edits 10% on average, reverts 5%; alike on both arms."""


def simulate_readout(
    population: str = "segments",
    n_users: int = 1000,
    effects: tuple[float, ...] = (0.0, 0.01, 0.02, 0.03),
    runs: int = 500,
    *,
    readout_shares: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.5),
    prior: bool = True,
    share: float = 0.5,
    events_per_s: float = 50.0,
    bucket_s: float = 10.0,
    deadline_s: float = 1800.0,
    pre_s: float = 1800.0,
    activity_sigma: float = 1.0,
    activity: str = "lognormal",
    alpha: float = 0.05,
    tau: float = 0.03,
    guardrail_margin: float = 0.02,
    min_events: int = 100,
    min_units: int = 10,
    seed: int = 0,
) -> dict:
    """Canaries of the success metric (kept acceptance, ``effect`` added to every canary user's rate) and the two
    guardrails of ``GUARDRAIL_RATES`` (no effect: their harm sides are at their nulls, their pass sides true), decided
    at each readout share (module docstring). A promotion at effect 0 is a false one; so is every abort shown worse
    (no metric is worse). Rows per (share, effect): the share of runs ending each way (``ENDS``), the median events
    (all traffic) to the decision and the mean events to a promotion, and for promoted runs the mean raw and bias-
    corrected estimates and the interval's coverage; ``old_split_worse``: the false aborts of the split the gate had
    before (the success metric's harm side at ``alpha``, each guardrail's at ``alpha / 2``). With ``prior``, one more
    row (effect ``"prior"``) whose effect is drawn afresh for each canary from the mixture's own prior ``N(0,
    tau^2)``: there the corrected estimate is unbiased among the promoted whatever the stopping rule
    (``deploy.gate.sequential_readout``), which checks it."""
    if not (0 < share < 1 and runs >= 1 and n_users >= 2 and events_per_s > 0 and deadline_s >= bucket_s > 0):
        raise ValueError("share in (0, 1), runs >= 1, n_users >= 2, events_per_s > 0, deadline_s >= bucket_s > 0")
    for s in readout_shares:
        ro.pass_alphas(alpha, s)
    per_bucket = max(1, round(events_per_s * bucket_s))
    looks = int(deadline_s // bucket_s)
    m = 1 + len(GUARDRAIL_RATES)
    secret = f"liverl-bench-canary-stats-{seed}".encode()
    draws: dict[str, Any] = {"events_per_s": events_per_s, "pre_s": pre_s, "activity_sigma": activity_sigma}
    draws |= {"activity": activity, "looks": looks, "per_bucket": per_bucket}
    plays: tuple[float | str, ...] = (*effects, "prior") if prior else tuple(effects)
    keep: dict[tuple[float, float | str], list[dict]] = {(s, e): [] for s in readout_shares for e in plays}
    old_worse = dict.fromkeys(plays, 0)

    def test(name: str, direction: int, margin: float) -> MetricTest:
        return MetricTest(
            name, alpha=alpha, tau=tau, direction=direction, margin=margin, min_events=min_events, min_units=min_units
        )

    for run in range(runs):
        rng = np.random.default_rng([seed, 11, run])
        world = _world(rng, population, assign(secret, 3_000_003 * seed + run + 1, n_users, share), **draws)
        if world is None:
            continue
        p, on, k, cov, pre_n, user, slot, u01 = world
        den = _cumulative(np.bincount(slot, minlength=looks * n_users), looks)
        guards = []
        for name, (a, b) in GUARDRAIL_RATES.items():
            rate = rng.beta(a, b, n_users)
            with np.errstate(invalid="ignore", divide="ignore"):
                g_cov = np.where(pre_n > 0, rng.binomial(pre_n, rate) / np.maximum(pre_n, 1), np.nan)
            hit = rng.random(user.size) < rate[user]
            num = _cumulative(np.bincount(slot, weights=hit, minlength=looks * n_users), looks)
            arms = (
                UnitSums(num[:, :k], den[:, :k], g_cov[:k], pre_n[:k]),
                UnitSums(num[:, k:], den[:, k:], g_cov[k:], pre_n[k:]),
            )
            guards.append(
                (guardrail_margin, look_units(test(name, -1, guardrail_margin), *arms, cuped=True)["per_look"])
            )
        drawn = rng.normal(0.0, tau)  # the "prior" row's effect for this canary
        for play in plays:
            eff: float = drawn if play == "prior" else float(play)
            accept = u01 < np.clip(p[user] + eff * on[user], 0.0, 1.0)
            num = _cumulative(np.bincount(slot, weights=accept, minlength=looks * n_users), looks)
            c = UnitSums(num[:, :k], den[:, :k], cov[:k], pre_n[:k])
            st = UnitSums(num[:, k:], den[:, k:], cov[k:], pre_n[k:])
            success = (0.0, look_units(test("acceptance", 1, 0.0), c, st, cuped=True)["per_look"])
            family = [success, *guards]
            old = [math.log(1 / alpha)] + [math.log(2 / alpha)] * len(guards)
            old_worse[play] += any(
                bool((pl["max_log_lr_harm"] >= t).any()) for (_, pl), t in zip(family, old, strict=True)
            )
            for s in readout_shares:
                keep[(s, play)].append(_decide(family, alpha, s, m, tau, eff, per_bucket))
    rows = []
    for (s, played), outs in keep.items():
        n = max(len(outs), 1)
        won = [o for o in outs if o["end"] in ("promoted", "readout")]
        early = [o for o in won if o["end"] == "promoted"]
        events = sorted(o["events"] for o in outs if o["end"] != "deadline")
        rows.append(
            {"readout_share": s, "effect": played}
            | {e: sum(o["end"] == e for o in outs) / n for e in ENDS}
            | {
                "runs": len(outs),
                "median_events": events[len(events) // 2] if events else None,
                "mean_events_promoted": _mean([o["events"] for o in won]),
                "promoted_n": len(won),
                "truth": _mean([o["truth"] for o in won]),
                "raw": _mean([o["raw"] for o in won]),
                "corrected": _mean([o["corrected"] for o in won]),
                "covered": _mean([o["covered"] for o in won]),
                "early_n": len(early),
                "early_raw": _mean([o["raw"] for o in early]),
                "early_corrected": _mean([o["corrected"] for o in early]),
                "old_split_worse": old_worse[played] / n if s == readout_shares[0] else None,
            }
        )
    return {
        "population": population,
        "users": n_users,
        "runs": runs,
        "share": share,
        "events_per_s": events_per_s,
        "deadline_s": deadline_s,
        "alpha": alpha,
        "tau": tau,
        "guardrail_margin": guardrail_margin,
        "tests": m,
        "seed": seed,
        "rows": rows,
    }


def _mean(xs: list) -> float | None:
    return float(np.mean(xs)) if xs else None


def _decide(family: list, alpha: float, s: float, m: int, tau: float, truth: float, per_bucket: int) -> dict:
    """One canary's end, as ``Canary.verdict`` takes it, from each test's per-look arrays (``family``: (margin,
    per_look) with the success metric first): a harm side at ``alpha / m`` wins a tie; a promotion needs every pass
    side at ``alpha (1 - s)``; undecided at the last look, the readout at ``alpha s`` on the tests still open."""
    seq_a, ro_a = ro.pass_alphas(alpha, s)
    harm = np.any([pl["max_log_lr_harm"] >= math.log(m / alpha) for _, pl in family], axis=0)
    passed = np.all([pl["max_log_lr_pass"] >= math.log(1 / seq_a) for _, pl in family], axis=0)
    first = np.nonzero(harm | passed)[0]
    success = family[0][1]
    if first.size:
        i = int(first[0])
        end = "worse" if harm[i] else "promoted"
    else:
        i = success["d"].shape[0] - 1
        still = [(mg, pl) for mg, pl in family if pl["max_log_lr_pass"][i] < math.log(1 / seq_a)]
        ok = ro_a > 0 and all(
            bool(pl["ready"][i])
            and ro.readout_p(float(pl["d"][i]), float(pl["var"][i]), float(pl["df"][i]), -mg) <= ro_a
            for mg, pl in still
        )
        end = "readout" if ok else "deadline"
    d, var, df = (float(success[key][i]) for key in ("d", "var", "df"))
    lo, hi = ro.confidence_sequence(d, var, df, tau, alpha)
    return {
        "end": end,
        "truth": truth,
        "events": (i + 1) * per_bucket,
        "raw": d,
        "corrected": ro.shrunk(d, var, tau),
        "covered": float(lo <= truth <= hi),
    }


# ----------------------------------------------------------------------------------------------------- latency

LATENCY_EFFECTS = {
    "none": (0.0, 1.0),
    "all 10% slower": (1.0, 1.1),
    "at the band": (0.0, 1.0),
    "tail: 12% of requests 3x slower": (0.12, 3.0),
}
"""The candidate's latency against stable's: (share of its requests slowed, by how much). Within the 25% tolerance,
any abort of the first two is false. ``at the band`` adds to every request of the candidate the very band each test
was fixed with (in ms, as the gate fixes it): the difference sits on both sides' null, where a harm shown beyond the
band is false and so is a non-inferiority shown within it (the strict check of the calibration). The last moves the
p90 past the tolerance and the mean not (``simulate_latency_quantile`` reports each one's true change)."""


def simulate_latency_quantile(
    effects: tuple[str, ...] = tuple(LATENCY_EFFECTS),
    runs: int = 500,
    *,
    quantile: float = 0.9,
    tolerance: float = 0.25,
    share: float = 0.5,
    events_per_s: float = 50.0,
    bucket_s: float = 10.0,
    deadline_s: float = 1800.0,
    pre_s: float = 1800.0,
    base_ms: float = 400.0,
    sigma: float = 0.5,
    load_sd: float = 0.2,
    load_corr_s: float = 5.0,
    common_sd: float = 0.2,
    common_corr_s: float = 120.0,
    alpha: float = 0.05,
    min_events: int = MIN_EVENTS,
    min_batches: int = 5,
    seed: int = 0,
) -> dict:
    """Canaries judged on latency alone (module docstring). Each second each node's log-load moves as an AR(1) of
    standard deviation ``load_sd`` and correlation time ``load_corr_s`` (the canary's node and stable's apart), plus a
    load both share (``common_sd``, ``common_corr_s``); a request's latency is ``base_ms * exp(loads + sigma Z)``,
    and a candidate's (``LATENCY_EFFECTS``) is multiplied for a share of its requests. The bands are fixed from
    stable's node over ``pre_s`` before the rollout (its quantile and mean, times ``tolerance``), as the gate fixes
    them. Per effect: the share of runs in which each test showed the canary worse by more than the band (its harm
    side at ``alpha``: its own calibration, where the gate's family level ``alpha / m`` is lower) and within it (its
    pass side, which a ``non_inferior`` guardrail waits for), and the median seconds to each."""
    unknown = [e for e in effects if e not in LATENCY_EFFECTS]
    if unknown or not (0 < share < 1 and 0 < quantile < 1 and runs >= 1 and deadline_s >= bucket_s > 0):
        raise ValueError(f"effects among {', '.join(LATENCY_EFFECTS)}; share and quantile in (0, 1), runs >= 1")
    per_s = int(round(bucket_s))
    looks, pre = int(deadline_s // bucket_s), int(pre_s // bucket_s)
    seconds = (pre + looks) * per_s
    threshold = math.log(1 / alpha)
    out: dict[str, dict[str, dict[str, Any]]] = {
        e: {t: {"worse": 0, "within": 0, "s_worse": [], "s_within": []} for t in ("quantile", "mean")} for e in effects
    }
    truth = {e: _true_change(*LATENCY_EFFECTS[e], sigma, quantile) for e in effects}
    if "at the band" in truth:
        truth["at the band"] = {"mean": tolerance, "quantile": tolerance}  # stable's, before the rollout
    for run in range(runs):
        rng = np.random.default_rng([seed, 13, run])
        common = _ar1(rng, seconds, common_sd, common_corr_s)
        load = {arm: common + _ar1(rng, seconds, load_sd, load_corr_s) for arm in ("canary", "stable")}
        n_s = rng.poisson(events_per_s * (1 - share), seconds)
        n_s[: pre * per_s] = rng.poisson(events_per_s, pre * per_s)  # before the rollout stable's node had it all
        n_c = rng.poisson(events_per_s * share, seconds)
        n_c[: pre * per_s] = 0
        sec_s, sec_c = np.repeat(np.arange(seconds), n_s), np.repeat(np.arange(seconds), n_c)
        lat_s = base_ms * np.exp(load["stable"][sec_s] + sigma * rng.standard_normal(sec_s.size))
        z_c, u_c = rng.standard_normal(sec_c.size), rng.random(sec_c.size)
        hist_s, mean_s = _buckets(lat_s, sec_s // per_s, pre + looks)
        band_q = tolerance * float(hist_quantile(hist_s[:pre].sum(0), quantile))
        band_m = tolerance * float(np.nanmean(lat_s[sec_s < pre * per_s]))
        hs = hist_s[pre:]
        for eff in effects:
            slowed, factor = LATENCY_EFFECTS[eff]
            lat_c = base_ms * np.exp(load["canary"][sec_c] + sigma * z_c) * np.where(u_c < slowed, factor, 1.0)
            for name, band in (("quantile", band_q), ("mean", band_m)):
                hist_c, mean_c = _buckets(lat_c + (band if eff == "at the band" else 0.0), sec_c // per_s, pre + looks)
                hc = hist_c[pre:]
                ok = (hc.sum(-1) >= min_events) & (hs.sum(-1) >= min_events)
                if name == "quantile":
                    diff = np.where(ok, hist_quantile(hc, quantile) - hist_quantile(hs, quantile), np.nan)
                else:
                    diff = np.where(ok, mean_c[pre:] - mean_s[pre:], np.nan)
                pass_, harm = _batch_means_looks(diff, band, min_batches)
                o = out[eff][name]
                for side, lr in (("worse", harm), ("within", pass_)):
                    hit = np.nonzero(lr >= threshold)[0]
                    if hit.size:
                        o[side] += 1
                        o[f"s_{side}"].append(float((hit[0] + 1) * bucket_s))
    rows = []
    for eff in effects:
        for name in ("quantile", "mean"):
            o = out[eff][name]
            rows.append(
                {"effect": eff, "test": name, "true_change": truth[eff][name]}
                | {side: o[side] / runs for side in ("worse", "within")}
                | {f"median_s_{side}": _median(o[f"s_{side}"]) for side in ("worse", "within")}
            )
    return {
        "runs": runs,
        "quantile": quantile,
        "tolerance": tolerance,
        "share": share,
        "events_per_s": events_per_s,
        "deadline_s": deadline_s,
        "load_corr_s": load_corr_s,
        "load_sd": load_sd,
        "common_sd": common_sd,
        "sigma": sigma,
        "alpha": alpha,
        "min_events": min_events,
        "seed": seed,
        "rows": rows,
    }


def _median(xs: list) -> float | None:
    return float(np.median(xs)) if xs else None


def _ar1(rng, n: int, sd: float, corr_s: float) -> np.ndarray:
    """An AR(1) series of ``n`` seconds, stationary standard deviation ``sd``, correlation time ``corr_s`` seconds."""
    phi = math.exp(-1.0 / corr_s) if corr_s > 0 else 0.0
    e = rng.normal(0.0, sd * math.sqrt(1 - phi * phi), n)
    out = np.empty(n)
    x = rng.normal(0.0, sd)
    for i in range(n):
        x = phi * x + e[i]
        out[i] = x
    return out


def _buckets(lat_ms: np.ndarray, bucket: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per bucket: the histogram ingest keeps (whole ms, ``keys.latency_bin``) and the mean latency."""
    bins = np.searchsorted(np.asarray(keys.LATENCY_HIST_EDGES_MS), np.round(lat_ms), side="right")
    hist = np.bincount(bucket * keys.LATENCY_HIST_BINS + bins, minlength=n * keys.LATENCY_HIST_BINS)
    count = np.bincount(bucket, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(bucket, weights=np.round(lat_ms), minlength=n) / count
    return hist.reshape(n, keys.LATENCY_HIST_BINS).astype(float), mean


def _batch_means_looks(diff: np.ndarray, band: float, min_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """The running maxima (pass, harm) of the latency test (``direction`` -1, margin and harm margin ``band``) after
    each look, one look per bucket, on the batch means of the buckets so far (``batch_means``' arithmetic, for every
    prefix at once)."""
    x = -np.nan_to_num(diff)  # lower is better
    valid = np.isfinite(diff)
    n = np.cumsum(valid)
    s1, s2 = np.cumsum(x), np.cumsum(x * x)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = s1 / n
        var = np.maximum((s2 - n * d * d) / (n - 1), 0.0) / n
    test = MetricTest("latency", tau=band, direction=-1, margin=band, harm_margin=band, bernoulli=False)
    return test.look(d, np.maximum(var, 1e-12), n >= min_batches, np.maximum(n - 1, 1))


def _true_change(slowed: float, factor: float, sigma: float, q: float) -> dict:
    """The candidate's true relative change of mean latency and of its ``q`` quantile (log-normal latency at one
    load; the quantile by bisection on the mixture's distribution function)."""
    nd = __import__("statistics").NormalDist()

    def cdf(x: float) -> float:  # latency / base, at load 0
        return (1 - slowed) * nd.cdf(math.log(x) / sigma) + slowed * nd.cdf(math.log(x / factor) / sigma)

    lo, hi = 1e-3, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    base_q = math.exp(sigma * nd.inv_cdf(q))
    return {"mean": slowed * (factor - 1), "quantile": lo / base_q - 1}
