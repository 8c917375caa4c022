"""``liverl lineage``: one feedback event's path to a served model, and the feedback -> served latency summary.

The first tests assemble lineages from a hand-written ledger (the real ``learner.ledger.Ledger``) and a real registry
(SQLite and PostgreSQL), where each feedback event has a known fate: trained into a refused candidate and served only
once a later version of the same learner lineage is promoted; thrown away by a rebase; served first on a canary node.
The last runs the real learner on the real broker, so the ledger and the registry are what the pipeline writes; the
serving agent's part is the one registry call it makes after a verified swap (``update_fleet``), made here directly:
a vLLM node's swap is covered by the serving tests.
"""

from __future__ import annotations

import time

import pytest

from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.registry import Registry
from learner.ledger import Ledger
from liverl.cli import main
from liverl.ops.lineage import latency_summary, trace
from tests.deploy.conftest import perturb, tiny_model

T0 = time.time() - 100.0  # feedback times, set in the ledger; the registry's own times are when the test runs


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    reg = Registry(url, LocalBlobStore(tmp_path / "blobs"))
    reg.init_base(tiny_model(), "m")
    yield reg
    reg.close()


def _candidate(reg: Registry, step: int, seed: int) -> int:
    return int(
        reg.add_candidate(
            perturb(tiny_model(), 0.05, seed=seed), parent=int(reg.stable().version), learner_step=step
        ).version
    )


def _train(ledger: Ledger, step: int, fids: list[str]) -> None:
    ledger.trained(
        step,
        [(0, step * 10 + i, f"g-{fid}") for i, fid in enumerate(fids)],
        feedback=[(fid, T0 + step) for fid in fids],
    )


def test_a_refused_candidates_feedback_is_served_only_through_a_promoted_descendant(registry, tmp_path):
    led_path = tmp_path / "learner.ledger.jsonl"
    ledger = Ledger(led_path, max_bytes=1 << 20)
    ledger.rebased(0, 0)  # a fresh learner starts from stable v0
    _train(ledger, 1, ["f-a"])
    _train(ledger, 2, ["f-b"])
    ledger.flush(seq=1)
    v1 = _candidate(registry, 2, seed=1)  # holds f-a, f-b: refused offline
    registry.record_gate(v1, "offpolicy", -0.2, -0.05, False, "below stable")
    registry.set_status(v1, "rejected", actor="gate", reason="offpolicy")
    _train(ledger, 3, ["f-c"])
    ledger.flush(seq=2)
    v2 = _candidate(registry, 3, seed=2)  # the same weights trained on: holds f-a, f-b, f-c
    registry.record_gate(v2, "offpolicy", 0.01, -0.05, True, "ok")
    registry.promote(v2, actor="gate", reason="passed")
    registry.update_fleet("node-0", v2, registry.get(v2).checksum)  # the agent, after its verified swap
    _train(ledger, 4, ["f-d"])
    ledger.flush(seq=3)
    v3 = _candidate(registry, 4, seed=3)  # holds f-d (and the rest): refused; the learner starves and rebases
    registry.set_status(v3, "rejected", actor="gate", reason="drift")
    ledger.rebased(4, v2)
    _train(ledger, 5, ["f-e"])
    ledger.flush(seq=4)
    v4 = _candidate(registry, 5, seed=4)  # v2's weights plus step 5: f-a..f-c and f-e, not f-d
    registry.begin_rollout(
        v4,
        stable_version=v2,
        share=0.5,
        nodes=["node-1"],
        unit="user",
        deadline_at=T0 + 10**6,
        settings={},
        actor="gate",
        reason="canary",
    )
    registry.update_fleet("node-1", v4, registry.get(v4).checksum)  # the canary node serves it before promotion
    registry.promote(v4, actor="gate", reason="canary passed")
    registry.update_fleet("node-0", v4, registry.get(v4).checksum)
    served = {s.version: s.first_at for s in registry.served()}

    a = trace("f-a", led_path, registry)
    assert a["candidate"] == v1 and a["versions"] == [v1, v2, v3, v4]
    assert a["promoted"]["version"] == v2 and a["served"] == {"version": v2, "node": "node-0", "at": served[v2]}
    assert a["feedback_to_served_s"] == pytest.approx(served[v2] - (T0 + 1))
    stages = [r["stage"] for r in a["rows"]]
    assert stages[:4] == ["feedback", "sample", "learner step", "candidate"] and "descendant" in stages
    assert any("offpolicy FAIL" in r["what"] for r in a["rows"])  # the refused candidate's verdict is shown

    d = trace("f-d", led_path, registry)  # trained only into v3, which was refused, and then thrown away
    assert d["versions"] == [v3] and d["promoted"] is None and d["served"] is None
    assert any(f"restarted from v{v2} at step 4" in r["what"] for r in d["rows"])

    e = trace("f-e", led_path, registry)  # first served on the canary node, then promoted
    assert e["versions"] == [v4] and e["served"]["node"] == "node-1" and e["promoted"]["version"] == v4
    assert e["served"]["at"] <= e["promoted"]["at"]

    with pytest.raises(ValueError, match="'f-nope' is not in the learner's ledger"):
        trace("f-nope", led_path, registry)

    s = latency_summary(led_path, registry)
    assert {k: s[k] for k in ("trained", "in_a_candidate", "served", "promoted", "dropped_by_rebase")} == {
        "trained": 5,
        "in_a_candidate": 5,
        "served": 4,
        "promoted": 4,
        "dropped_by_rebase": 1,
    }
    assert s["feedback_to_served_s"]["n"] == 4 and s["feedback_to_served_s"]["p50"] > 0


def test_a_torn_last_line_and_a_ledger_without_lineage_are_read(registry, tmp_path):
    """The demo summary reads the ledger while the learner appends to it; a ledger written before lineage was
    recorded (no feedback ids) has nothing to trace, and says so."""
    led_path = tmp_path / "l.jsonl"
    ledger = Ledger(led_path, max_bytes=1 << 20)
    ledger.trained(1, [(0, 0, "g-old")])  # no feedback ids
    _train(ledger, 2, ["f-x"])
    ledger.flush(seq=1)
    with open(led_path, "a") as f:
        f.write('{"seq": 2, "step": 3, "trai')
    with pytest.raises(ValueError, match="not in the learner's ledger"):
        trace("g-old", led_path, registry)
    x = trace("f-x", led_path, registry)
    assert x["versions"] == [] and x["served"] is None
    s = latency_summary(led_path, registry)
    assert s["trained"] == 1 and s["in_a_candidate"] == 0 and s["ledger_unreadable_lines"] == 1
    assert s["feedback_to_served_s"] == {"n": 0, "p50": None, "p90": None, "p99": None}


def test_the_cli_prints_the_path_and_refuses_an_unknown_id(registry, tmp_path, capsys):
    led_path = tmp_path / "l.jsonl"
    ledger = Ledger(led_path, max_bytes=1 << 20)
    ledger.rebased(0, 0)
    _train(ledger, 1, ["f-1"])
    ledger.flush(seq=1)
    v1 = _candidate(registry, 1, seed=1)
    registry.promote(v1, actor="gate", reason="passed")
    registry.update_fleet("node-0", v1, registry.get(v1).checksum)
    if not registry.url.startswith("sqlite"):
        return  # the CLI finds the registry through its state folder (SQLite); the assembly is the same
    args = ["lineage", "--state-dir", str(tmp_path), "--ledger", str(led_path)]
    assert main(args + ["f-1"]) == 0
    out = capsys.readouterr().out
    for stage in ("feedback", "learner step", "candidate", "promoted", "served", "feedback -> served"):
        assert stage in out
    assert f"v{v1} on node-0" in out
    assert main(args + ["f-unknown"]) == 2
    assert "is not in the learner's ledger" in capsys.readouterr().err


def test_the_real_learner_records_what_lineage_needs(cfg, tmp_path):
    """The learner on the real broker writes the ledger; the registry holds its candidates. A feedback event trained
    into a refused candidate is served through the promoted one after it; one trained into a candidate that an
    operator's rollback threw away is never served."""
    from learner.ledger import checkpoint_path_for, ledger_path
    from learner.model import load_model
    from learner.trainer import Learner
    from liverl.demo.base_policy import ensure_base_policy
    from tests.learner.test_trainer import learner_cfg, make_registry, make_samples, model_cache, produce_samples

    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    cfg = learner_cfg(cfg, batch_size=16, candidate_every_steps=1)
    samples = make_samples(load_model(model_dir), 64, seed=7)
    samples = [s.model_copy(update={"unit": f"{i % 5:016x}" if i % 5 else None}) for i, s in enumerate(samples)]
    fid_of = {s.sample_id: s.feedback_id for s in samples}
    unit_of = {s.sample_id: s.unit for s in samples}
    produce_samples(cfg, samples)
    reg = make_registry(cfg, model_dir)
    led = ledger_path(checkpoint_path_for(cfg))
    try:
        learner = Learner(cfg, model_dir, cfg.broker.bootstrap, reg)
        steps: list[set[str]] = []

        def step() -> int:
            before = set(learner.state.trained_ids)
            learner.run(max_steps=1)
            steps.append({fid_of[s] for s in set(learner.state.trained_ids) - before})
            assert len(steps[-1]) == 16
            return int(learner.state.last_candidate)

        v1 = step()
        reg.set_status(v1, "rejected", actor="gate", reason="offpolicy")
        v2 = step()
        reg.promote(v2, actor="gate", reason="passed")
        reg.update_fleet("node-0", v2, reg.get(v2).checksum)
        v3 = step()
        reg.set_status(v3, "rejected", actor="gate", reason="drift")
        reg.rollback(actor="bob", reason="complaints")  # back to v0: the learner rebases, v2's lineage is gone
        v4 = step()
        assert learner.state.counters["rebases"] == 1
        reg.promote(v4, actor="gate", reason="passed")
        reg.update_fleet("node-0", v4, reg.get(v4).checksum)

        first = trace(sorted(steps[0])[0], led, reg)
        assert first["candidate"] == v1 and first["versions"] == [v1, v2, v3]
        assert first["promoted"]["version"] == v2 and first["served"]["version"] == v2
        third = trace(sorted(steps[2])[0], led, reg)
        assert third["versions"] == [v3] and third["served"] is None and third["promoted"] is None
        fourth = trace(sorted(steps[3])[0], led, reg)
        assert fourth["versions"] == [v4] and fourth["served"]["version"] == v4
        s = latency_summary(led, reg)
        assert (s["trained"], s["served"], s["dropped_by_rebase"]) == (64, 48, 16)
        lines = [x for x in Ledger.read(led) if "trained" in x]
        assert all(x["units"] == [unit_of[sid] for _, _, sid in x["trained"]] for x in lines)  # whose samples
        from liverl.ops.forget import lineage

        for u in ("0000000000000001", "0000000000000003"):  # liverl forget: the union of its feedback's versions
            fids = [fid_of[sid] for sid, uu in unit_of.items() if uu == u]
            want = sorted({v for f in fids for v in trace(f, led, reg)["versions"]})
            assert [v["version"] for v in lineage(u, led, reg)["versions"]] == want
    finally:
        reg.close()


def test_the_demo_summary_reports_feedback_to_served(cfg, tmp_path, capsys):
    """The summary's figures come from the deployment's own ledger and registry, as a demo leaves them."""
    from learner.ledger import checkpoint_path_for, ledger_path
    from liverl.demo.report import feedback_to_served, print_summary
    from liverl.ops.admin import open_registry

    started = time.time()
    ledger = Ledger(ledger_path(checkpoint_path_for(cfg)), max_bytes=1 << 20)
    ledger.rebased(0, 0)
    for step in range(1, 11):
        _train(ledger, step, [f"f-{step}-{i}" for i in range(3)])
    ledger.flush(seq=1)
    cfg.serving.nodes = 1
    reg = open_registry(cfg)
    try:
        reg.init_base(tiny_model(), "m")
        v1 = _candidate(reg, 8, seed=1)  # steps 1..8 reach a version; 9 and 10 are in none yet
        reg.promote(v1, actor="gate", reason="passed")
        reg.update_fleet("node-0", v1, reg.get(v1).checksum)
        fs = feedback_to_served(cfg, reg)
    finally:
        reg.close()
    assert (fs["trained"], fs["in_a_candidate"], fs["served"], fs["promoted"]) == (30, 24, 24, 24)
    assert not fs["canaries"] and fs["nodes"] == 1
    p50 = fs["feedback_to_served_s"]["p50"]
    assert started - (T0 + 8) <= p50 <= time.time() - (T0 + 1)  # feedback at T0 + step 1..8, served during the test
    summary = {
        "base_acceptance": 0.4,
        "base_feedback_events": 300,
        "last_promoted_version": v1,
        "last_promoted_acceptance": 0.5,
        "last_promoted_feedback_events": 100,
        "lift_points": 10.0,
        "feedback_events": 400,
        "samples_trained": 30,
        "versions_produced": 1,
        "versions_promoted": 1,
        "versions_rejected": 0,
        "hot_swap_pause_ms": [],
        "delta_ratio": {},
        "dead_letters": {},
        "feedback_to_served": fs,
        "ok": False,
    }
    print_summary(summary, tmp_path / "s.json", tmp_path / "p.png")
    out = capsys.readouterr().out
    assert f"feedback -> served (s)         p50 {p50:.0f}" in out and "over 24 of 30 trained events (one node" in out
    assert "6 in no candidate yet, 0 thrown away by a rebase, 0 in candidates not served" in out
