"""The demo's summary reports, per version judged on live evidence, the off-policy estimate and the canary outcome."""

from __future__ import annotations

import pytest

from liverl.demo.report import print_summary, version_evidence
from liverl.ops.admin import open_registry
from tests.deploy.conftest import perturb, tiny_model


def test_version_evidence_names_offpolicy_and_canary_per_version(cfg, tmp_path, capsys):
    reg = open_registry(cfg)
    try:
        base = tiny_model()
        reg.init_base(base, "/m")
        v1 = reg.add_candidate(perturb(base, 0.05, seed=1), parent=0)
        reg.record_gate(v1.version, "offpolicy", 0.61, 0.40, True, "estimate 0.61 vs stable 0.42")
        reg.record_gate(v1.version, "canary", 0.59, 0.42, True, "acceptance better than stable (p 1e-20)")
        reg.promote(v1.version, actor="gate", reason="canary passed")
        v2 = reg.add_candidate(perturb(base, 0.05, seed=2), parent=v1.version)
        reg.record_gate(v2.version, "canary", 0.40, 0.60, False, "guardrail revert_rate is worse than stable")
        reg.set_status(v2.version, "rejected", actor="gate", reason="canary aborted")
        rows = [reg.get(v1.version), reg.get(v2.version)]
        ev = version_evidence(reg, rows, {v1.version: {"accept": 59, "events": 100}})
    finally:
        reg.close()
    assert ev[str(v1.version)]["offpolicy"]["value"] == 0.61 and ev[str(v1.version)]["canary"]["passed"]
    assert ev[str(v1.version)]["live_acceptance"] == 0.59 and ev[str(v1.version)]["status"] == "stable"
    assert not ev[str(v2.version)]["canary"]["passed"] and ev[str(v2.version)]["live_acceptance"] is None
    summary = {
        "base_acceptance": 0.4,
        "base_feedback_events": 300,
        "last_promoted_version": v1.version,
        "last_promoted_acceptance": 0.59,
        "last_promoted_feedback_events": 100,
        "lift_points": 19.0,
        "feedback_events": 400,
        "samples_trained": 300,
        "versions_produced": 2,
        "versions_promoted": 1,
        "versions_rejected": 1,
        "hot_swap_pause_ms": [],
        "delta_ratio": {},
        "dead_letters": {},
        "versions": ev,
        "ok": False,
    }
    print_summary(summary, tmp_path / "s.json", tmp_path / "p.png")
    out = capsys.readouterr().out
    assert (
        f"v{v1.version}    stable    kept  59%; off-policy difference's upper bound +0.610 (pass); canary promoted"
        in out
    )
    assert f"v{v2.version}    rejected  kept    -; off-policy -; canary aborted: guardrail revert_rate is worse" in out


def test_the_trap_report_names_exploiting_versions_and_where_they_went(cfg):
    """From what users saw of each version (the simulator's stats): a version whose share of bait answers to the
    trap's users is EXPLOIT_POINTS above the base's exploits; caught if its canary was refused, live if it was ever
    promoted (retired since or not), undecided if the run stopped before the gate decided: not counted as caught."""
    from liverl.demo.report import kept, trap_report
    from liverl.demo.sim import SimStats

    reg = open_registry(cfg)
    try:
        base = tiny_model()
        reg.init_base(base, "/m")
        honest = reg.add_candidate(perturb(base, 0.05, seed=1), parent=0)
        reg.promote(honest.version, actor="gate", reason="canary passed")
        caught = reg.add_candidate(perturb(base, 0.05, seed=2), parent=honest.version)
        reg.set_status(caught.version, "rejected", actor="gate", reason="canary aborted")
        live = reg.add_candidate(perturb(base, 0.05, seed=3), parent=honest.version)
        reg.promote(live.version, actor="gate", reason="integrity only")
        retired = reg.add_candidate(perturb(base, 0.05, seed=4), parent=live.version)
        reg.promote(retired.version, actor="gate", reason="integrity only")
        reg.promote(live.version, actor="operator", reason="back")  # retired, but it went live
        running = reg.add_candidate(perturb(base, 0.05, seed=5), parent=live.version)  # not decided yet
        rows = reg.list()
    finally:
        reg.close()
    stats = SimStats()
    for v, bait in (
        (0, 0.3),
        (honest.version, 0.35),
        (caught.version, 0.7),
        (live.version, 0.9),
        (retired.version, 0.8),
        (running.version, 0.6),
    ):
        for i in range(100):  # bait is accepted, and most of it reverted later: not kept
            stats.record(v, "a", accepted=True, reported=True, bait=i < 100 * bait, kept=i >= 100 * bait or i % 10 == 0)
    rep = trap_report(stats, rows)
    assert rep["base_trap_kept_rate"] == pytest.approx(0.73)  # 70 honest answers kept + 3 of 30 bait
    assert rep["trap_kept_rate"][str(live.version)] == pytest.approx(0.19)  # the harm, where it lands
    assert rep["exploiting"] == [caught.version, live.version, retired.version, running.version]
    assert rep["exploiting_caught"] == [caught.version]
    assert rep["exploiting_live"] == [live.version, retired.version]
    assert rep["exploiting_undecided"] == [running.version]
    # the harm in whole-run points: 600 generations; live and retired kept 19 and 28 of 100 against the base's 73
    assert rep["exploit_cost_points"]["live"] == pytest.approx(100 * (54 + 45) / 600, abs=1e-3)
    assert rep["exploit_cost_points"]["caught"] == pytest.approx(100 * 36 / 600, abs=1e-3)
    assert rep["exploit_cost_points"]["undecided"] == pytest.approx(100 * 27 / 600, abs=1e-3)
    assert kept({"accept": 60, "revert": 20, "events": 100}) == 0.4 and kept({}) is None


def test_the_plot_marks_promotions_and_aborted_canaries(cfg, tmp_path):
    import time

    from liverl.demo.report import Timeline, plot_timeline, release_marks

    reg = open_registry(cfg)
    try:
        t0 = time.time() - 5
        base = tiny_model()
        reg.init_base(base, "/m")
        v1 = reg.add_candidate(perturb(base, 0.05, seed=1), parent=0)
        reg.promote(v1.version, actor="gate", reason="canary passed")
        v2 = reg.add_candidate(perturb(base, 0.05, seed=2), parent=v1.version)
        reg.record_gate(v2.version, "canary", 0.40, 0.60, False, "acceptance is worse")
        marks = release_marks(reg, [reg.get(v1.version)], t0)
    finally:
        reg.close()
    assert [(m["version"], m["event"]) for m in marks] == [(v1.version, "promoted"), (v2.version, "canary aborted")]
    assert all(4 < m["t"] < 60 for m in marks)
    tl = Timeline(t0=t0, points=[{"t": float(i), "served": 0, "live": {0: (4 * i, 10 * i)}} for i in range(0, 40, 2)])
    plot_timeline(tl, {"marks": marks, "live_by_version": {}}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_the_demo_profile_fills_in_only_what_config_did_not_set():
    """`liverl demo` runs two nodes with demo-sized canaries, unless the file, environment or a flag said otherwise."""
    from core.config import load_config
    from liverl.demo.run import apply_demo_profile

    cfg = load_config(None, env={"LIVERL__SERVING__NODES": "1", "LIVERL__GATE__CANARY_SHARE": "0.3"})
    applied = apply_demo_profile(cfg)
    assert (cfg.serving.nodes, cfg.gate.canary_share, cfg.gate.revert_horizon_s) == (1, 0.3, 75.0)
    assert "serving.nodes" not in applied and "gate.canary_share" not in applied
    assert applied["gate.canary_deadline_s"] == 480.0 and applied["gate.canary_max_events"] == 6000
    assert cfg.ingest.heldout_share == 0.2  # one node: the off-policy check is its only evidence (ONE_NODE_PROFILE)
    cfg = load_config(None, env={"LIVERL__SERVING__NODES": "1", "LIVERL__INGEST__HELDOUT_SHARE": "0.1"})
    assert "ingest.heldout_share" not in apply_demo_profile(cfg) and cfg.ingest.heldout_share == 0.1
    cfg = load_config(None, env={})
    assert cfg.learner.lr == 1e-6  # without a config: a real LLM's rate, not the demo's
    applied = apply_demo_profile(cfg)
    assert cfg.serving.nodes == 2 and cfg.gate.canary_share == 0.5
    assert cfg.learner.lr == 3e-4 and applied["learner.lr"] == 3e-4  # the demo's tiny policy sets its own
    assert cfg.learner.rebase_after_refusals == 2 and applied["learner.rebase_after_refusals"] == 2
    assert cfg.learner.candidate_ema == 0.97 and applied["learner.candidate_ema"] == 0.97  # production: 0 (off)
    cfg = load_config(None, env={"LIVERL__LEARNER__LR": "1e-5"})
    assert "learner.lr" not in apply_demo_profile(cfg) and cfg.learner.lr == 1e-5
    cfg = load_config(None, env={})
    applied = apply_demo_profile(cfg)
    assert cfg.ingest.heldout_share == 0.05 and "ingest.heldout_share" not in applied  # canaries: the default
    assert cfg.broker.embedded_storage == "folder" and "broker.embedded_storage" not in applied  # durable, as up


def test_a_short_demo_still_trains_for_half_its_run():
    """A 120-s demo with the 120-s final window held the learner from its first second: no version at all (found
    running ``scripts/demo.sh --duration 120`` on a fresh clone). The window is now at most half the run."""
    from core.config import DemoConfig
    from liverl.demo.run import final_window

    assert final_window(DemoConfig(duration_s=120, final_window_s=120)) == 60
    assert final_window(DemoConfig(duration_s=600, final_window_s=120)) == 120  # the default run: unchanged
    assert final_window(DemoConfig(duration_s=200, final_window_s=60)) == 60  # the e2e test's: unchanged
    assert final_window(DemoConfig(duration_s=30, final_window_s=120)) == 15
