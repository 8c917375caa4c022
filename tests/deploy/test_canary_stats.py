"""The verdict's statistics through the real gate, registry and Redis: the latency quantile guardrail read from the
histograms ingest keeps, the readout at the deadline, and what a look records (the family's levels, the raw and
bias-corrected effect with its always-valid interval). The statistics themselves are in
tests/deploy/test_sequential_readout.py."""

from __future__ import annotations

import time

import pytest

from core import keys
from core.config import GateConfig
from deploy.gate.canary import first_bucket
from tests.deploy.test_canary import after, feed, first, fleet2, population, start, traffic  # noqa: F401

FAST, SLOW = 200, 500  # ms


def _histograms(rds, cfg, rollout, buckets: range, slow_share: float) -> None:
    """Latency of each bucket's judged events, as ingest's script writes it (sums and histogram): stable's all at
    FAST ms; the canary's ``slow_share`` of them at SLOW ms, the rest at FAST."""
    for b in buckets:
        for v, share in ((rollout.version, slow_share), (rollout.stable_version, 0.0)):
            key = keys.units(cfg.topics.prefix, v, b)
            n = int(rds.hget(key, "*|e") or 0)
            slow = round(share * n)
            rds.hincrby(key, "*|m", FAST * (n - slow) + SLOW * slow)
            rds.hincrby(key, "*|n", n)
            rds.hincrby(key, f"*|h{keys.latency_bin(FAST)}", n - slow)
            if slow:
                rds.hincrby(key, f"*|h{keys.latency_bin(SLOW)}", slow)


def _stable_before(rds, cfg) -> None:
    ids, _ = population(50)
    for b in range(first_bucket(time.time()) - 30, first_bucket(time.time()) - 1):  # stable's figures before it
        feed(rds, cfg, 0, b, {u: (2, 1, 0, 0) for u in ids}, latency_ms=FAST)
        rds.hincrby(keys.units(cfg.topics.prefix, 0, b), f"*|h{keys.latency_bin(FAST)}", 2 * len(ids))


@pytest.mark.parametrize("mode", ["harm", "non_inferior"])
def test_a_slow_tail_is_aborted_on_the_latency_quantile_while_the_mean_stays_in_its_band(cfg, rds, fleet2, mode):  # noqa: F811
    """15% of the canary's requests at 500 ms, the rest at 200 ms like stable's: mean latency 22% up, within its 25%
    band; the p90 more than doubles. The p90 guardrail (fixed at the start from stable's histograms) aborts it,
    whether a promotion waits for it or not."""
    gate, registry = fleet2
    cfg.gate.latency_quantile_guardrail = mode
    _stable_before(rds, cfg)
    r = start(gate, registry, rds, cfg)
    p90 = r.settings["stable_latency_q_ms"]
    assert 181 < p90 < 215 and r.settings["latency_quantile"] == 0.9  # FAST's bin: [181, 215) ms
    assert r.settings["latency_q_band"] == pytest.approx(0.25 * p90)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    _histograms(rds, cfg, r, first(r, 12), slow_share=0.15)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail latency_p90 is worse than stable" in v.reason, v.reason
    assert "latency 245.1 vs 200" in v.reason, v.reason  # the mean: not shown worse beyond its band


def test_without_a_slow_tail_the_quantile_guardrail_does_not_hold_a_promotion_by_default(cfg, rds, fleet2):  # noqa: F811
    gate, registry = fleet2
    _stable_before(rds, cfg)
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    _histograms(rds, cfg, r, first(r, 12), slow_share=0.0)
    gate.canary.clock = lambda: after(r, cfg, 12)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
    assert "(latency_p90: not shown worse)" in v.reason and "false promotion <= 0.05" in v.reason, v.reason


def test_a_look_records_the_family_and_the_effect_and_the_verdict_says_them(cfg, rds, fleet2):  # noqa: F811
    """Every look saves the levels the verdict was taken at, and the success metric's raw and bias-corrected effect
    and its always-valid interval; the verdict's text carries them too."""
    gate, registry = fleet2
    cfg.gate.canary_readout_share = GateConfig().canary_readout_share
    r = start(gate, registry, rds, cfg)
    assert r.settings["readout_share"] == 0.3
    traffic(rds, cfg, r, first(r, 4), lift=0.05, seed=2)
    gate.canary.clock = lambda: after(r, cfg, 4)
    [v] = gate.step()
    [look] = registry.rollout(r.id).looks
    assert look["family_alpha"] == 0.05 and look["family_tests"] == 3  # acceptance, edit rate, revert rate
    assert look["family_pass_alpha"] == pytest.approx(0.035) and look["family_readout_alpha"] == pytest.approx(0.015)
    assert look["family_harm_alpha"] == pytest.approx(0.05 / 3)
    assert look["effect_lo"] < look["effect"] < look["effect_hi"]
    assert 0 < look["effect_corrected"] < look["effect"]  # shrunk towards no effect
    assert f"bias-corrected {look['effect_corrected']:+.4f}" in v.reason and "always-valid 95% interval" in v.reason


@pytest.mark.parametrize("share", [0.2, 0.0])
def test_at_the_deadline_the_readout_decides_what_the_sequential_test_left_open(cfg, rds, fleet2, share):  # noqa: F811
    """A canary 8 points better over nine buckets of 200 users without history (no CUPED): too little for the
    mixture, tuned for 3 points, enough for the fixed-horizon test. At the deadline the readout promotes it; without
    one it aborts, as an undecided canary did (the share is the one the rollout started with)."""
    gate, registry = fleet2
    cfg.gate.canary_deadline_s = 300.0
    cfg.gate.canary_readout_share = share
    r = start(gate, registry, rds, cfg)
    cfg.gate.canary_readout_share = 0.5  # the rollout keeps the share it started with
    traffic(rds, cfg, r, first(r, 9), lift=0.08, seed=8)
    gate.canary.clock = lambda: after(r, cfg, 9)
    assert gate.canary.clock() < r.deadline_at
    [v] = gate.step()
    assert v.verdict == "canary" and "waiting on acceptance" in v.reason, v.reason  # before the deadline: no readout
    gate.canary.clock = lambda: r.deadline_at + 1
    [v] = gate.step()
    if share:
        assert v.verdict == "promoted", v.reason
        assert "deadline passed: the readout at the fixed horizon passes: acceptance better than stable" in v.reason
    else:
        assert v.verdict == "aborted" and "acceptance undecided (p " in v.reason and "readout" not in v.reason
