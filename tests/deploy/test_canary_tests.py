"""The canary's tests at one look (``deploy.gate.canary_tests``), built from evidence held in memory."""

from __future__ import annotations

import numpy as np
import pytest

from core.config import GateConfig
from deploy.gate.canary_tests import FIELDS, ArmSums, Evidence, build_tests
from deploy.registry.tables import Rollout


def heavy_users_evidence(seed: int = 0, n: int = 400) -> Evidence:
    """Users of Zipf activity whose edit, revert and accept rates differ and persist: the look-back before the
    rollout predicts each user's rates in it."""
    rng = np.random.default_rng(seed)
    w = rng.permutation(1.0 / np.arange(1, n + 1) ** 1.1)
    rates = {f: rng.beta(2, 5, n) for f in "adr"}
    ev = Evidence(rollout_id=1, start=0)

    def sums(events: int) -> list[dict[str, int]]:
        e = rng.multinomial(events, w / w.sum())
        rows = [{"e": int(x)} for x in e]
        for f, p in rates.items():
            for row, x in zip(rows, rng.binomial(e, p), strict=True):
                row[f] = int(x)
        for row in rows:
            row["r"] = min(row["r"], row["a"])
        return rows

    on = rng.random(n) < 0.5
    for cursor in ((ev.canary, ev.stable), (ev.fast_canary, ev.fast_stable)):
        rows = sums(20_000)
        for arm, side in zip(cursor, (on, ~on), strict=True):
            arm.add(0, {f"u{i}": rows[i] for i in range(n) if side[i] and rows[i]["e"]})
    pre = ArmSums()
    pre.add(0, {f"u{i}": row for i, row in enumerate(sums(20_000)) if row["e"]})
    ev.covariate = {u: s for u, s in pre.users.items() if s[FIELDS.index("e")] > 0}
    return ev


@pytest.mark.parametrize("guardrails", [True, False])
def test_cuped_reduces_the_guardrails_variance_on_each_users_own_history(guardrails):
    """With gate.cuped_guardrails, the edit and revert rates are CUPED-adjusted on each user's own pre-rollout rate
    of them, and under heavy users most of their variance goes; without it they keep the plain delta method."""
    g = GateConfig(cuped_guardrails=guardrails)
    rollout = Rollout(id=1, unit="user", share=0.5, settings={}, test_state={})
    _, _, info = build_tests(g, rollout, heavy_users_evidence(), settling=False)
    assert info["acceptance"]["cuped"] and info["acceptance"]["cuped_removed"] > 0.5
    for name in ("edit_rate", "revert_rate"):
        look = info[name]
        assert look["cuped"] is guardrails
        if guardrails:
            assert look["cuped_removed"] > 0.5 and look["variance"] < 0.5 * look["variance_raw"], (name, look)
        else:
            assert look["cuped_removed"] == 0.0 and look["variance"] == look["variance_raw"]
