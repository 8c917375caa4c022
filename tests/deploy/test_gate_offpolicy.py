"""The gate's off-policy check (e) against a real Redis and a real (SQLite) registry: the
product's reward with reverts merged in, judgements censored at the revert horizon, and a deferral to the canary
when the effective sample size is too small. The estimator and its decision rule: test_offpolicy.py."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from core.product import Product
from core.schemas import SamplingParams, TrainingSample
from deploy.gate.gate import Gate
from deploy.gate.tail import parse_heldout
from deploy.registry.registry import open_registry
from tests.deploy.test_gate import ProbeEval, weights

HONEST, BAIT, REJECTED = 5, 7, 6  # the completion token of each kind of held-out sample below


class BaitEval(ProbeEval):
    """Log-probs of the held-out completions: the logged behaviour's, moved by the weights' ``bait`` towards the
    bait completions and as far away from the honest accepted ones; ``spread`` adds a fixed per-prompt shift (a
    candidate that moved far from the logged behaviour)."""

    def __init__(self):
        super().__init__(with_suite=False)

    def sequence_logprobs(self, weights, probes):
        bait, spread = weights["bait"].tolist()
        move = {BAIT: bait, HONEST: -bait}
        noise = np.random.default_rng(0).normal(0, 1, 100_000)
        return [
            p.behaviour_logprob + move.get(p.completion_ids[0], 0.0) + spread * noise[p.prompt_ids[0]] for p in probes
        ]


def state(bait: float, seed: int, spread: float = 0.0) -> dict:
    return {**weights(0.5, 0.8, seed=seed), "bait": torch.tensor([bait, spread])}


def record(cfg, i: int, completion: int, kind: str, judged_at: float) -> bytes:
    """The held-out stream's record of generation ``g<i>`` as ingest writes it: the product's reward for ``kind``."""
    gid = f"g{i}"
    return TrainingSample(
        sample_id=gid if kind != "revert" else f"{gid}:revert",
        generation_id=gid,
        feedback_id=f"f-{kind}-{i}",
        policy_version=0,
        kind=kind,
        reward=Product(cfg.ingest.rewards).reward(kind, None),
        prompt_token_ids=[i, 1],
        completion_token_ids=[completion],
        behaviour_logprobs=[-1.0, -1.0],
        sampling=SamplingParams(max_tokens=4, temperature=1.0),
        ts_generation=judged_at - 1.0,
        ts_feedback=judged_at,
    ).to_bytes()


def stream(cfg, *, bait_judged_at: float, reverted: bool) -> list:
    """100 honest accepts, 100 bait accepts (reverted later when ``reverted``), 100 rejects, parsed as the gate's
    held-out tail parses them (the revert records last, as they arrive)."""
    old = time.time() - 3600
    recs = [record(cfg, i, HONEST, "accept", old) for i in range(100)]
    recs += [record(cfg, i, BAIT, "accept", bait_judged_at) for i in range(100, 200)]
    recs += [record(cfg, i, REJECTED, "reject", old) for i in range(200, 300)]
    if reverted:
        recs += [record(cfg, i, BAIT, "revert", old + 600) for i in range(100, 200)]
    return [parse_heldout(r) for r in recs]


def judge(cfg, rds, heldout: list, candidate: dict):
    """The gate's verdict on ``candidate`` against a fresh registry with the base as stable, and its offpolicy row."""
    cfg = cfg.model_copy(update={"state_dir": str(Path(cfg.state_dir) / uuid.uuid4().hex[:8])})
    registry = open_registry(cfg)
    registry.init_base(state(0.0, 0), "/nonexistent/model")
    gate = Gate(cfg, registry, rds, BaitEval(), heldout=lambda: heldout)
    try:
        gate.step()
        row = registry.add_candidate(candidate, parent=0)
        [v] = gate.step()
        [g] = [g for g in registry.gate_results(row.version) if g.check == "offpolicy"]
        return v, g
    finally:
        registry.close()


def test_reverted_held_out_accepts_are_scored_with_the_products_revert_reward(cfg, rds):
    """A candidate that moves towards answers users accept and then undo: scored with the accepts alone it looks
    better than stable; with the product's revert reward merged in, it is refused before any user sees it."""
    r = cfg.ingest.rewards
    v, g = judge(cfg, rds, stream(cfg, bait_judged_at=time.time() - 3600, reverted=True), state(1.0, 1))
    want_stable = (
        100 * r.accept + 100 * (r.accept + r.revert) + 100 * r.reject
    ) / 300  # the plain mean: stable logged them
    assert f"stable v0 {want_stable:.3f}" in g.detail and "300 held-out samples (100 reverted" in g.detail, g.detail
    assert v.verdict == "rejected" and v.checks["offpolicy"] is False and "refuse" in g.detail
    assert g.value < g.threshold == -cfg.gate.offpolicy_margin
    # the same candidate before any revert arrived (all judged long ago): no evidence against it here
    v, g = judge(cfg, rds, stream(cfg, bait_judged_at=time.time() - 3600, reverted=False), state(1.0, 2))
    assert v.checks["offpolicy"] is True and "pass" in g.detail, g.detail


def test_judgements_younger_than_the_revert_horizon_do_not_count(cfg, rds):
    """The bait accepts were judged just now: they may still be reverted, so they are left out, not counted as
    successes; without them the bait-favouring candidate is shown worse (it moved away from the honest accepts)."""
    v, g = judge(cfg, rds, stream(cfg, bait_judged_at=time.time() - 5, reverted=False), state(1.0, 1))
    r = cfg.ingest.rewards
    assert f"stable v0 {(r.accept + r.reject) / 2:.3f}" in g.detail and "100 judged less than" in g.detail, g.detail
    assert v.checks["offpolicy"] is False and "refuse" in g.detail
    # nothing old enough at all: the candidate is not judged yet (the gate's cold start, tests/deploy/test_gate.py)
    young = [h._replace(judged_at=time.time()) for h in stream(cfg, bait_judged_at=time.time(), reverted=False)]
    cfg = cfg.model_copy(update={"state_dir": str(Path(cfg.state_dir) / uuid.uuid4().hex[:8])})
    registry = open_registry(cfg)
    registry.init_base(state(0.0, 0), "/nonexistent/model")
    try:
        gate = Gate(cfg, registry, rds, BaitEval(), heldout=lambda: young)
        gate.step()
        row = registry.add_candidate(state(1.0, 3), parent=0)
        [v] = gate.step()
        assert v.verdict == "deferred" and "too early" in v.reason and "300 held-out judgements" in v.reason, v
        assert registry.get(row.version).status == "candidate" and registry.gate_results(row.version) == []
    finally:
        registry.close()


def test_an_effective_sample_size_below_the_minimum_defers_to_the_canary(cfg, rds):
    """A candidate far from the logged behaviour is neither passed nor refused off-policy: the check is recorded as
    deferred and the gate is told the candidate needs a canary (``checks["needs_canary"]``)."""
    v, g = judge(cfg, rds, stream(cfg, bait_judged_at=time.time() - 3600, reverted=True), state(0.0, 1, spread=3.0))
    assert v.checks["offpolicy"] is True and v.checks["needs_canary"] is True, v
    assert g.passed and g.threshold == cfg.gate.offpolicy_min_ess and g.value < g.threshold
    assert "defer" in g.detail and "deferred to the canary" in g.detail and "unclipped" in g.detail, g.detail
    # a near one is judged, and needs no canary on this account
    v, g = judge(cfg, rds, stream(cfg, bait_judged_at=time.time() - 3600, reverted=True), state(0.0, 2, spread=0.1))
    assert "needs_canary" not in v.checks and v.checks["offpolicy"] is True and "pass" in g.detail, g.detail


@pytest.mark.parametrize("kind,reward", [("accept", 0.75), ("reject", -0.25), ("edit", 0.0), ("revert", -1.0)])
def test_held_out_records_carry_the_products_reward(cfg, kind, reward):
    h = parse_heldout(record(cfg, 3, HONEST, kind, 1.8e9))
    assert (h.reward, h.kind, h.generation_id, h.judged_at) == (reward, kind, "g3", 1.8e9)
