"""The release gate against a real Redis and a real (SQLite) registry.

The held-out evaluation is a stand-in that reads a "probe" tensor planted in the weights, so each test
chooses what a candidate scores; the real ``liverl.demo.score.heldout_score`` is exercised by the slow test.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from liverl.admin import open_registry
from deploy.gate import Gate
from liverl.core.schemas import VersionAnnouncement
from tests.deploy.conftest import perturb, tiny_model


def weights(acceptance: float, entropy: float, seed: int = 0) -> dict[str, torch.Tensor]:
    state = perturb(tiny_model(), 0.05, seed=seed) if seed else tiny_model()
    return {**state, "probe": torch.tensor([acceptance, entropy], dtype=torch.float32)}


class ProbeEval:
    """Stand-in for heldout_score: the scores are whatever the weights' probe tensor says."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model_dir, state_dict, n_prompts):
        self.calls += 1
        ea, ent = state_dict["probe"].tolist()
        return {"expected_acceptance": ea, "greedy_acceptance": ea, "entropy": ent, "n_prompts": n_prompts}


@pytest.fixture
def setup(cfg, rds):
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    ev = ProbeEval()
    gate = Gate(cfg, registry, rds, evaluate=ev)
    yield gate, registry, rds, ev
    registry.close()


def desired(rds, cfg) -> VersionAnnouncement:
    return VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))


def test_good_candidate_is_promoted_and_announced(cfg, setup):
    gate, registry, rds, ev = setup
    assert gate.step() == []
    assert desired(rds, cfg).version == 0  # the gate announces the stable version when nothing is announced yet
    row = registry.add_candidate(weights(0.49, 0.8, seed=1), parent=0)  # within max_regression (0.02)
    [v] = gate.step()
    assert (v.version, v.verdict, v.checks) == (row.version, "promoted", {"integrity": True, "heldout": True, "collapse": True})
    assert registry.stable().version == row.version and registry.get(0).status == "retired"
    ann = desired(rds, cfg)
    assert (ann.version, ann.checksum) == (row.version, row.checksum)
    results = {(g.version, g.check): g for g in registry.gate_results()}
    assert results[(0, "heldout")].value == pytest.approx(0.50)  # the stable's reference score, recorded once
    assert results[(row.version, "heldout")].threshold == pytest.approx(0.48)
    assert results[(row.version, "collapse")].value == pytest.approx(0.8)
    assert registry.audit(version=row.version)[-1].actor == "gate"

    row2 = registry.add_candidate(weights(0.70, 0.8, seed=2), parent=row.version)
    assert gate.step()[0].verdict == "promoted"
    assert ev.calls == 4  # v0 reference, v1, v1 as the new stable's reference, v2
    assert gate.step() == [] and desired(rds, cfg).version == row2.version
    text = gate.metrics_text().decode()
    assert 'liverl_gate_verdicts_total{verdict="promoted"} 2.0' in text
    assert 'liverl_gate_checks_total{check="integrity",result="pass"} 2.0' in text


def test_corrupted_candidate_is_refused(cfg, setup):
    gate, registry, rds, _ev = setup
    gate.step()
    row = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    path = registry.blobs._path(row.blob_key)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    [v] = gate.step()
    assert v.verdict == "rejected" and v.checks == {"integrity": False} and "integrity" in v.reason
    assert registry.get(row.version).status == "rejected" and registry.stable().version == 0
    [g] = registry.gate_results(row.version)
    assert g.check == "integrity" and not g.passed and "corrupted" in g.detail
    assert desired(rds, cfg).version == 0
    assert 'liverl_gate_verdicts_total{verdict="rejected"} 1.0' in gate.metrics_text().decode()


def test_delta_that_leads_elsewhere_is_refused(cfg, setup):
    """A well-formed delta whose result does not match the row's checksum (e.g. a mixed-up blob key)."""
    import sqlalchemy as sa

    from deploy.registry import Version

    gate, registry, _rds, _ev = setup
    a = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    b = registry.add_candidate(weights(0.9, 1.0, seed=2), parent=0)
    with registry.engine.begin() as c:
        c.execute(sa.update(Version).where(Version.version == b.version).values(blob_key=a.blob_key))
    verdicts = gate.step()
    assert [(v.version, v.verdict) for v in verdicts] == [(a.version, "superseded"), (b.version, "rejected")]
    [g] = registry.gate_results(b.version)
    assert not g.passed and f"rebuilds version {a.version}" in g.detail


def test_collapsed_and_regressed_candidates_are_refused(cfg, setup):
    gate, registry, rds, _ev = setup
    collapsed = registry.add_candidate(weights(0.95, 0.01, seed=1), parent=0)
    [v] = gate.step()
    assert (v.verdict, v.checks) == ("rejected", {"integrity": True, "heldout": True, "collapse": False})
    assert registry.get(collapsed.version).status_reason == "failed collapse"
    worse = registry.add_candidate(weights(0.40, 1.0, seed=2), parent=0)
    [v] = gate.step()
    assert (v.verdict, v.checks["heldout"]) == ("rejected", False)
    assert registry.get(worse.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0


def test_only_newest_pending_is_evaluated(cfg, setup):
    gate, registry, _rds, ev = setup
    old = [registry.add_candidate(weights(0.6, 1.0, seed=s), parent=0) for s in (1, 2)]
    new = registry.add_candidate(weights(0.6, 1.0, seed=3), parent=0)
    verdicts = gate.step()
    assert [(v.version, v.verdict) for v in verdicts] == [(old[0].version, "superseded"), (old[1].version, "superseded"),
                                                          (new.version, "promoted")]
    assert registry.get(old[0].version).status_reason == f"superseded by {new.version}"
    assert [(a.actor, a.action) for a in registry.audit(version=old[1].version)][-1] == ("gate", "rejected")
    assert ev.calls == 2


def test_run_loop_promotes_then_stops(cfg, setup):
    gate, registry, _rds, _ev = setup
    cfg.gate.poll_s = 0.05
    stop = threading.Event()
    t = threading.Thread(target=gate.run, args=(stop,), name="gate-loop")
    t.start()
    try:
        row = registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
        deadline = time.monotonic() + 10
        while registry.get(row.version).status == "candidate" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive() and registry.stable().version == row.version


@pytest.mark.slow
def test_gate_with_the_real_heldout_eval(cfg, rds):
    """The real evaluator on the real base policy: a lightly perturbed candidate gets all three checks recorded."""
    from liverl.demo.base_policy import ensure_base_policy, load_state_dict

    cfg.gate.eval_prompts = 32
    model_dir = ensure_base_policy(cfg.model_cache_path, seed=0, progress=False)
    registry = open_registry(cfg)
    try:
        base = load_state_dict(model_dir)
        registry.init_base(base, str(model_dir))
        row = registry.add_candidate(perturb(base, 0.02, seed=1), parent=0)
        [v] = Gate(cfg, registry, rds).step()
        assert v.version == row.version and set(v.checks) == {"integrity", "heldout", "collapse"}
        assert {g.check for g in registry.gate_results(row.version)} == {"integrity", "heldout", "collapse"}
    finally:
        registry.close()
