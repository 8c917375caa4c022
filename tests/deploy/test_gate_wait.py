"""The one-node path (``deploy.gate.waiting``) against a real Redis and a real (SQLite) registry: with no canary to
run, a candidate whose off-policy evidence is too thin is kept pending and judged again as held-out feedback
accumulates, says what it waits for, is promoted only on a look whose check passed, and is refused at the bound.

The evaluator moves each held-out completion's log-prob by a fixed per-sample amount times the candidate's
``spread`` (how far it moved from the logged behaviour: its efficiency, ESS / n, is about exp(-spread^2) before
clipping) and by ``shift`` towards accepted completions (positive: better) or away from them (negative: worse)."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from deploy.gate.gate import Gate
from deploy.gate.tail import HeldoutSample
from deploy.registry.registry import open_registry
from learner.candidates import evidence_against
from tests.deploy.test_canary import NODES, beat
from tests.deploy.test_gate import ProbeEval, weights

NOISE = np.random.default_rng(0).normal(0, 1, 100_000)


class SpreadEval(ProbeEval):
    def __init__(self):
        super().__init__(with_suite=False)
        self.logprob_calls = 0

    def sequence_logprobs(self, w, probes):
        self.logprob_calls += 1
        shift, spread = w["op"].tolist()
        return [
            p.behaviour_logprob + (shift if p.reward > 0 else -shift) + spread * NOISE[p.prompt_ids[0]] for p in probes
        ]


def state(shift: float, spread: float, seed: int) -> dict:
    return {**weights(0.5, 0.8, seed=seed), "op": torch.tensor([shift, spread])}


def samples(start: int, stop: int, age_s: float = 3600.0) -> list[HeldoutSample]:
    """Held-out samples ``g<start>..g<stop-1>``, judged ``age_s`` ago (past the revert horizon), half accepted."""
    at = time.time() - age_s
    return [
        HeldoutSample(
            (i, 1), (5,), -1.0, 0.75 if i % 2 else -0.25, f"g{i}", at + i * 1e-3, "accept" if i % 2 else "reject"
        )
        for i in range(start, stop)
    ]


@pytest.fixture
def one_node(cfg, rds):
    """One configured node (the default: no canary), stable v0 at the logged behaviour; ``held`` is the held-out
    stream the gate reads (grow it in place)."""
    held: list[HeldoutSample] = samples(0, 40)
    registry = open_registry(cfg)
    registry.init_base(state(0.0, 0.0, 0), "/nonexistent/model")
    ev = SpreadEval()
    gate = Gate(cfg, registry, rds, ev, heldout=lambda: held)
    gate.step()
    yield gate, registry, ev, held
    registry.close()


def gauge(gate, figure: str) -> float:
    m = re.search(rf'^liverl_gate_offpolicy_wait\{{figure="{figure}"\}} (\S+)$', gate.metrics_text().decode(), re.M)
    assert m, figure
    return float(m.group(1))


def test_thin_evidence_waits_says_for_what_and_promotes_once_it_grows(cfg, one_node):
    gate, registry, ev, held = one_node
    row = registry.add_candidate(state(0.3, 0.8, 1), parent=0)  # better, and far enough to need ~100 samples
    [v] = gate.step()
    assert v.verdict == "deferred" and registry.get(row.version).status == "candidate", v
    # what it waits for, with numbers: ESS now and needed, samples and judged events to go, and the bound
    m = re.search(r"ESS (\d+) of the 50 needed \(gate.offpolicy_min_ess\) on 40 held-out samples", v.reason)
    assert m and int(m.group(1)) < 50, v.reason
    needed = int(re.search(r"\) (\d+) are needed, (\d+) more \(about (\d+) judged events", v.reason).group(1))
    assert 50 < needed < 400 and "ingest.heldout_share 0.05" in v.reason and "gate.offpolicy_wait_s" in v.reason
    [w] = [g for g in registry.gate_results(row.version) if g.check == "offpolicy_wait"]
    assert w.passed and w.value < w.threshold == 50 and w.detail == v.reason  # on-call reads it
    assert gauge(gate, "version") == row.version and gauge(gate, "samples") == 40
    assert gauge(gate, "samples_needed") == needed and gauge(gate, "left_seconds") > 3500
    assert 'liverl_gate_verdicts_total{verdict="deferred"} 1.0' in gate.metrics_text().decode()

    calls = ev.logprob_calls
    newer = registry.add_candidate(state(0.3, 1.5, 2), parent=0)
    held.extend(samples(40, 42))  # too little growth for another look
    for _ in range(3):
        [v] = gate.step()  # the waited-on one, not the newest; nothing evaluated
        assert (v.version, v.verdict) == (row.version, "deferred")
    assert ev.logprob_calls == calls and registry.get(newer.version).status == "candidate"

    held.extend(samples(42, 60))  # a look, still too thin: judged again, still waiting
    [v] = gate.step()
    assert (v.version, v.verdict) == (row.version, "deferred") and "on 60 held-out samples" in v.reason, v.reason
    assert ev.logprob_calls == calls + 2

    held.extend(samples(60, 400))
    [v] = gate.step()
    assert (v.version, v.verdict) == (row.version, "promoted"), v.reason
    assert "off-policy evidence after waiting" in v.reason and "needs_canary" not in v.checks
    assert v.checks == {"integrity": True, "drift": True, "collapse": True, "mismatch": True, "offpolicy": True}
    [last] = [g for g in registry.gate_results(row.version) if g.check == "offpolicy"][-1:]
    assert last.passed and ": pass:" in last.detail
    assert registry.stable().version == row.version and gauge(gate, "version") == 0
    assert registry.get(newer.version).status == "candidate"  # judged next, against the new stable
    [v] = gate.step()
    assert v.version == newer.version and v.verdict in ("deferred", "promoted", "rejected")


def test_no_promotion_while_the_evidence_stays_thin_and_a_refusal_with_its_numbers_at_the_bound(cfg, one_node):
    gate, registry, ev, held = one_node
    cfg.gate.offpolicy_wait_s = 2.0
    row = registry.add_candidate(state(0.3, 1.5, 1), parent=0)
    t0 = time.time()
    while time.time() - t0 < 1.5:
        [v] = gate.step()
        assert v.verdict == "deferred" and registry.stable().version == 0
        held.extend(samples(len(held), len(held) + 6))  # evidence grows, not enough
        time.sleep(0.1)
    time.sleep(max(0.0, gate.wait.state.since + cfg.gate.offpolicy_wait_s - time.time()) + 0.05)  # the bound
    [v] = gate.step()
    assert v.verdict == "rejected" and registry.get(row.version).status == "rejected", v
    assert v.reason.startswith("failed offpolicy_wait: off-policy evidence still too thin after waiting 2 s")
    assert re.search(r"ESS \d+ of the 50 needed on \d+ held-out samples", v.reason), v.reason
    assert "gate.offpolicy_wait_s 2" in v.reason and "no canary can run" in v.reason
    assert registry.get(row.version).status_reason == v.reason and evidence_against(v.reason)
    assert registry.stable().version == 0 and gauge(gate, "version") == 0
    assert "liverl_gate_refused_in_a_row 1.0" in gate.metrics_text().decode()
    [w] = [g for g in registry.gate_results(row.version) if g.check == "offpolicy_wait" and not g.passed]
    assert w.value < w.threshold


def test_a_full_held_out_window_too_thin_is_refused_at_once(cfg, one_node):
    """More samples of the same behaviour cannot raise the ESS once the window is full: no point waiting."""
    gate, registry, _ev, held = one_node
    cfg.gate.heldout_samples = 100
    held.extend(samples(40, 100))
    row = registry.add_candidate(state(0.3, 3.0, 1), parent=0)
    [v] = gate.step()
    assert v.verdict == "rejected" and "held-out window full" in v.reason and "gate.heldout_samples 100" in v.reason
    assert registry.get(row.version).status == "rejected" and registry.stable().version == 0


def test_a_candidate_shown_worse_as_evidence_grows_is_refused(cfg, one_node):
    gate, registry, _ev, held = one_node
    row = registry.add_candidate(state(-0.5, 0.9, 1), parent=0)
    assert gate.step()[0].verdict == "deferred"
    held.extend(samples(40, 500))
    [v] = gate.step()
    assert (v.version, v.verdict, v.reason) == (row.version, "rejected", "failed offpolicy"), v
    assert v.checks["offpolicy"] is False and registry.stable().version == 0


def test_an_empty_held_out_stream_is_no_evidence(cfg, rds):
    """With a held-out stream (ingest.heldout_share > 0) that has nothing usable yet, a one-node gate waits: it does
    not promote on the offline checks alone."""
    held: list[HeldoutSample] = []
    registry = open_registry(cfg)
    try:
        registry.init_base(state(0.0, 0.0, 0), "/nonexistent/model")
        gate = Gate(cfg, registry, rds, SpreadEval(), heldout=lambda: held)
        row = registry.add_candidate(state(0.3, 0.1, 1), parent=0)
        [v] = gate.step()
        assert v.verdict == "deferred" and "no usable held-out sample yet" in v.reason, v.reason
        held.extend(samples(0, 300))
        [v] = gate.step()
        assert (v.version, v.verdict) == (row.version, "promoted"), v.reason
    finally:
        registry.close()


def test_a_restarted_gate_waits_on_the_same_candidate_and_keeps_its_bound(cfg, rds, one_node):
    gate, registry, ev, held = one_node
    row = registry.add_candidate(state(0.3, 1.0, 1), parent=0)
    assert gate.step()[0].verdict == "deferred"
    first = [g for g in registry.gate_results(row.version) if g.check == "offpolicy_wait"][0].at
    newer = registry.add_candidate(state(0.3, 0.1, 2), parent=0)  # would pass at once: not judged while it waits
    again = Gate(cfg, registry, rds, ev, heldout=lambda: held)
    [v] = again.step()
    assert (v.version, v.verdict) == (row.version, "deferred"), v
    assert again.wait.state.since == pytest.approx(first) and registry.get(newer.version).status == "candidate"


def test_with_a_fleet_of_two_a_thin_candidate_goes_to_the_canary_as_before(cfg, rds):
    """Two configured nodes: the thin candidate goes through a canary, and a wait a one-node gate recorded for it
    (the deployment grew a node) is not resumed."""
    registry = open_registry(cfg)
    try:
        registry.init_base(state(0.0, 0.0, 0), "/nonexistent/model")
        held = samples(0, 40)
        row = registry.add_candidate(state(0.3, 0.8, 1), parent=0)
        assert Gate(cfg, registry, rds, SpreadEval(), heldout=lambda: held).step()[-1].verdict == "deferred"
        cfg.serving.fleet = {n: f"http://127.0.0.1/{n}" for n in NODES}
        for n in NODES:
            beat(rds, cfg, n)
        gate = Gate(cfg, registry, rds, SpreadEval(), heldout=lambda: held)
        [v] = gate.step()
        assert (v.version, v.verdict) == (row.version, "canary") and v.checks["needs_canary"], v
        assert gate.wait.state is None
    finally:
        registry.close()


def test_with_no_wait_a_thin_candidate_is_refused_at_once(cfg, one_node):
    gate, registry, _ev, _held = one_node
    cfg.gate.offpolicy_wait_s = 0.0
    row = registry.add_candidate(state(0.3, 0.8, 1), parent=0)
    [v] = gate.step()
    assert v.verdict == "rejected" and "no canary can run" in v.reason and "offpolicy_wait_s 0" in v.reason
    assert registry.get(row.version).status == "rejected" and not evidence_against(v.reason)


def test_the_reason_says_when_at_the_recent_rate(cfg, one_node):
    """Samples spread over the last 10 minutes: the reason gives the arrival rate and the time to go."""
    gate, registry, _ev, held = one_node
    now = time.time()
    held[:] = [h._replace(judged_at=now - 600 + 10 * i) for i, h in enumerate(samples(0, 55))]  # 6 a minute
    registry.add_candidate(state(0.3, 0.9, 1), parent=0)
    [v] = gate.step()
    m = re.search(r", ([\d.]+) (s|min) at the recent ([\d.]+) held-out samples a minute", v.reason)
    assert m and 5.0 <= float(m.group(3)) <= 6.5, v.reason
    assert gauge(gate, "eta_seconds") > 0
