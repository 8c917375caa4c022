"""The release gate against a real Redis and a real (SQLite) registry.

The evaluator is a stand-in that reads a "probe" tensor planted in the weights, so each test chooses a
candidate's drift, entropy and suite score; the real ``learner.evaluate.PolicyEvaluator`` on the real demo
policy and its product's suite is exercised by the slow test at the end.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from core.schemas import VersionAnnouncement
from deploy.gate.gate import Gate
from deploy.gate.tail import GenerationTail
from deploy.registry.registry import open_registry
from tests.deploy.conftest import perturb, tiny_model


def weights(suite: float, entropy: float, kl: float = 0.01, seed: int = 0) -> dict[str, torch.Tensor]:
    state = perturb(tiny_model(), 0.05, seed=seed) if seed else tiny_model()
    return {**state, "probe": torch.tensor([suite, entropy, kl], dtype=torch.float32)}


class ProbeEval:
    """Stand-in evaluator: the figures are whatever the weights' probe tensor says."""

    def __init__(self, with_suite: bool = True, with_probes: bool = True):
        self.suite_calls = self.drift_calls = 0
        self.with_suite, self.with_probes = with_suite, with_probes

    def drift(self, candidate, stable):
        self.drift_calls += 1
        if not self.with_probes:
            return None
        _, ent, kl = candidate["probe"].tolist()
        return {"kl": kl, "entropy": ent, "stable_entropy": stable["probe"].tolist()[1], "tokens": 100, "probes": 20}

    def suite_score(self, weights):
        if not self.with_suite:
            return None
        self.suite_calls += 1
        return {"name": "probe", "score": weights["probe"].tolist()[0], "cases": 10, "completions": 10}


@pytest.fixture
def setup(cfg, rds):
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    ev = ProbeEval()
    gate = Gate(cfg, registry, rds, ev)
    yield gate, registry, rds, ev
    registry.close()


def desired(rds, cfg) -> VersionAnnouncement:
    return VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))


ALL = {"integrity": True, "drift": True, "collapse": True, "mismatch": True, "suite": True}


def test_good_candidate_is_promoted_and_announced(cfg, setup):
    gate, registry, rds, ev = setup
    assert gate.step() == []
    assert desired(rds, cfg).version == 0  # the gate announces the stable version when nothing is announced yet
    row = registry.add_candidate(weights(0.49, 0.8, seed=1), parent=0)  # within max_regression (0.02)
    [v] = gate.step()
    assert (v.version, v.verdict, v.checks) == (row.version, "promoted", ALL)
    assert registry.stable().version == row.version and registry.get(0).status == "retired"
    ann = desired(rds, cfg)
    assert (ann.version, ann.checksum) == (row.version, row.checksum)
    results = {(g.version, g.check): g for g in registry.gate_results()}
    assert results[(0, "suite")].value == pytest.approx(0.50)  # the stable's reference score, recorded once
    assert results[(row.version, "suite")].threshold == pytest.approx(0.48)
    assert results[(row.version, "collapse")].value == pytest.approx(0.8)
    assert results[(row.version, "drift")].threshold == pytest.approx(cfg.gate.max_kl)
    assert registry.audit(version=row.version)[-1].actor == "gate"

    row2 = registry.add_candidate(weights(0.70, 0.8, seed=2), parent=row.version)
    assert gate.step()[0].verdict == "promoted"
    assert ev.suite_calls == 4  # v0 reference, v1, v1 as the new stable's reference, v2
    assert gate.step() == [] and desired(rds, cfg).version == row2.version
    text = gate.metrics_text().decode()
    assert 'liverl_gate_verdicts_total{verdict="promoted"} 2.0' in text
    assert 'liverl_gate_checks_total{check="integrity",result="pass"} 2.0' in text
    assert "liverl_gate_refused_in_a_row 0.0" in text and "liverl_gate_last_rollback_timestamp_seconds 0.0" in text
    promoted_at = float(re.search(r"^liverl_gate_stable_promoted_timestamp_seconds (\S+)$", text, re.M).group(1))
    assert promoted_at == pytest.approx(registry.stable().promoted_at, abs=5)


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
    assert "liverl_gate_refused_in_a_row 1.0" in gate.metrics_text().decode()  # the alert rules' input


def test_delta_that_leads_elsewhere_is_refused(cfg, setup):
    """A well-formed delta whose result does not match the row's checksum (e.g. a mixed-up blob key)."""
    import sqlalchemy as sa

    from deploy.registry.registry import Version

    gate, registry, _rds, _ev = setup
    a = registry.add_candidate(weights(0.9, 1.0, seed=1), parent=0)
    b = registry.add_candidate(weights(0.9, 1.0, seed=2), parent=0)
    with registry.engine.begin() as c:
        c.execute(sa.update(Version).where(Version.version == b.version).values(blob_key=a.blob_key))
    verdicts = gate.step()
    assert [(v.version, v.verdict) for v in verdicts] == [(a.version, "superseded"), (b.version, "rejected")]
    [g] = registry.gate_results(b.version)
    assert not g.passed and f"rebuilds version {a.version}" in g.detail


def test_collapsed_drifted_and_regressed_candidates_are_refused(cfg, setup):
    gate, registry, rds, _ev = setup
    collapsed = registry.add_candidate(weights(0.95, 0.01, seed=1), parent=0)
    [v] = gate.step()
    assert (v.verdict, v.checks) == ("rejected", {**ALL, "collapse": False})
    assert registry.get(collapsed.version).status_reason == "failed collapse"
    drifted = registry.add_candidate(weights(0.95, 1.0, kl=cfg.gate.max_kl * 2, seed=2), parent=0)
    [v] = gate.step()
    assert (v.verdict, v.checks) == ("rejected", {**ALL, "drift": False})
    assert "nats/token" in registry.gate_results(drifted.version)[1].detail
    worse = registry.add_candidate(weights(0.40, 1.0, seed=3), parent=0)
    [v] = gate.step()
    assert (v.verdict, v.checks["suite"]) == ("rejected", False)
    assert registry.get(worse.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0


def test_paired_sign_test_counts_flipped_cases():
    from deploy.gate.evidence import paired_sign_test

    stable = [1.0] * 200 + [0.0] * 56
    cand = stable.copy()
    for i in range(10):  # 10 cases the candidate gets wrong, 4 it gets right that stable did not
        cand[i] = 0.0
    for i in range(4):
        cand[200 + i] = 1.0
    worse, better, p = paired_sign_test(cand, stable)
    assert (worse, better) == (10, 4)
    assert p == pytest.approx(1471 / 16384)  # P(Binomial(14, 1/2) >= 10), exact
    assert paired_sign_test(stable, stable) == (0, 0, 1.0)
    with pytest.raises(ValueError):
        paired_sign_test(cand, stable[:-1])


class GradedEval(ProbeEval):
    """The probe's suite value names a list of per-case grades (pass/fail), so the paired test has cases to pair."""

    def __init__(self, grades: dict[float, list[float]]):
        super().__init__()
        self.grades = grades

    def suite_score(self, weights):
        out = super().suite_score(weights)
        g = self.grades[round(out["score"], 2)]
        return {**out, "score": sum(g) / len(g), "grades": g, "completions": len(g)}


def test_suite_refuses_a_significant_drop_not_a_few_flipped_cases(cfg, rds):
    """Both candidates drop more than max_regression (0.02) on a 256-case suite; only the one whose drop the flipped
    cases show (sign test p < suite_alpha) is refused."""
    base = [1.0] * 200 + [0.0] * 56

    def flipped(worse: int, better: int) -> list[float]:
        g = base.copy()
        g[:worse] = [0.0] * worse
        g[200 : 200 + better] = [1.0] * better
        return g

    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.10, 1.0), "/nonexistent/model")
        gate = Gate(
            cfg,
            registry,
            rds,
            GradedEval({0.10: base, 0.20: flipped(10, 4), 0.30: flipped(30, 7), 0.40: flipped(20, 8)}),
        )
        noisy = registry.add_candidate(weights(0.20, 1.0, seed=1), parent=0)  # -6 cases: -0.023, p 0.09
        [v] = gate.step()
        assert v.checks["suite"] and v.verdict == "promoted"
        [g] = [g for g in registry.gate_results(noisy.version) if g.check == "suite"]
        assert "10 cases worse, 4 better" in g.detail and "sign test p 0.0898" in g.detail
        worse = registry.add_candidate(weights(0.30, 1.0, seed=2), parent=noisy.version)  # 20 worse, 3 better
        [v] = gate.step()
        assert v.verdict == "rejected" and not v.checks["suite"]
        [g] = [g for g in registry.gate_results(worse.version) if g.check == "suite"]
        assert "sign test p" in g.detail and "< suite_alpha 0.05" in g.detail
        cfg.gate.suite_alpha = 1.0  # the drop alone decides, as before the paired test
        registry.add_candidate(weights(0.40, 1.0, seed=3), parent=noisy.version)  # 10 worse, 4 better, as noisy was
        [v] = gate.step()
        assert v.verdict == "rejected" and not v.checks["suite"]
    finally:
        registry.close()


def test_without_a_suite_the_gate_checks_integrity_drift_and_collapse(cfg, rds):
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        gate = Gate(cfg, registry, rds, ProbeEval(with_suite=False))
        registry.add_candidate(weights(0.0, 0.9, seed=1), parent=0)  # a suite score of 0 is never looked at
        [v] = gate.step()
        assert (v.verdict, v.checks) == (
            "promoted",
            {"integrity": True, "drift": True, "collapse": True, "mismatch": True},
        )
        assert {g.check for g in registry.gate_results()} == {"integrity", "drift", "collapse", "mismatch"}
    finally:
        registry.close()


def test_integrity_only_promotes_what_the_evidence_would_refuse_but_never_a_corrupt_delta(cfg, rds):
    """The comparison mode (``gate.integrity_only``, ``liverl demo --integrity-only``): evidence is not looked at,
    so a collapsed, regressed candidate goes live at once, no canary; a corrupt delta is still refused."""
    cfg = cfg.model_copy(update={"gate": cfg.gate.model_copy(update={"integrity_only": True, "canary_share": 0.5})})
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        ev = ProbeEval()
        gate = Gate(cfg, registry, rds, ev)
        bad = registry.add_candidate(weights(0.1, 0.01, kl=cfg.gate.max_kl * 3, seed=1), parent=0)
        [v] = gate.step()
        assert (v.verdict, v.checks) == ("promoted", {"integrity": True}) and "integrity_only" in v.reason
        assert registry.stable().version == bad.version and desired(rds, cfg).version == bad.version
        assert ev.suite_calls == ev.drift_calls == 0
        corrupt = registry.add_candidate(weights(0.9, 1.0, seed=2), parent=bad.version)
        path = registry.blobs._path(corrupt.blob_key)
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))
        [v] = gate.step()
        assert (v.verdict, v.checks) == ("rejected", {"integrity": False})
        assert registry.stable().version == bad.version
    finally:
        registry.close()


def test_no_logged_generations_means_no_promotion(cfg, rds):
    """Drift cannot be measured before any traffic was logged: the candidate is refused, saying why."""
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        gate = Gate(cfg, registry, rds, ProbeEval(with_probes=False))
        row = registry.add_candidate(weights(0.9, 0.9, seed=1), parent=0)
        [v] = gate.step()
        assert v.verdict == "rejected" and v.checks["drift"] is False
        assert (
            "no logged generations" in [g for g in registry.gate_results(row.version) if g.check == "drift"][0].detail
        )
    finally:
        registry.close()


def test_only_newest_pending_is_evaluated(cfg, setup):
    gate, registry, _rds, ev = setup
    old = [registry.add_candidate(weights(0.6, 1.0, seed=s), parent=0) for s in (1, 2)]
    new = registry.add_candidate(weights(0.6, 1.0, seed=3), parent=0)
    verdicts = gate.step()
    assert [(v.version, v.verdict) for v in verdicts] == [
        (old[0].version, "superseded"),
        (old[1].version, "superseded"),
        (new.version, "promoted"),
    ]
    assert registry.get(old[0].version).status_reason == f"superseded by {new.version}"
    assert [(a.actor, a.action) for a in registry.audit(version=old[1].version)][-1] == ("gate", "rejected")
    assert ev.suite_calls == 2 and ev.drift_calls == 1


def test_warm_up_scores_the_stable_version_before_any_candidate(cfg, setup):
    """The gate's first candidate pays no first-use cost: the stable suite is scored (and recorded) at start, and the
    evaluator's ``warm_up`` runs on the stable weights; candidates then score only themselves."""
    gate, registry, _rds, ev = setup
    warmed = []
    ev.warm_up = lambda weights: warmed.append(sorted(weights))
    gate.warm_up()
    assert ev.suite_calls == 1 and len(warmed) == 1 and "probe" in warmed[0]
    assert [g.check for g in registry.gate_results(0)] == ["suite"]  # the reference score, on record
    registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
    [v] = gate.step()
    assert v.verdict == "promoted" and ev.suite_calls == 2  # the candidate's; stable's was kept


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


def test_generation_tail_keeps_the_latest_trainable_records(cfg, stack):
    """The probe source: the last N trainable records of the generations topic, on the real broker."""
    from core.bus import ensure_topics, make_producer
    from core.schemas import GenerationRecord, SamplingParams

    topic = cfg.topics.generations
    ensure_topics(stack.bootstrap, [topic], 2)
    prod = make_producer(stack.bootstrap)

    def rec(i, trainable=True):
        return GenerationRecord(
            generation_id=f"g{i}",
            policy_version=0,
            node="n",
            prompt="p",
            completion="c",
            prompt_token_ids=[3, 4],
            completion_token_ids=[5, i % 7 + 1],
            completion_logprobs=[-1.0, -1.0],
            sampling=SamplingParams(temperature=1.0 if trainable else 0.0, max_tokens=4),
            trainable=trainable,
            untrainable_reason=None if trainable else "greedy",
        ).to_bytes()

    for i in range(30):
        prod.send(topic, key=f"g{i}", value=rec(i, trainable=i % 5 != 0))
    prod.send(topic, key="bad", value=b"{not json")
    prod.flush()
    tail = GenerationTail(stack.bootstrap, topic, size=10).start()
    try:
        deadline = time.monotonic() + 20
        while tail.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        got = tail()
        assert 0 < len(got) <= 10 and all(g.prompt_ids == (3, 4) for g in got)
        assert tail.refused == 1
    finally:
        tail.close()
        prod.close()

    class Flaky(GenerationTail):  # the client fails once (a broker timeout on a loaded machine): the tail reopens
        calls = 0

        def _tail(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("request timed out")
            return super()._tail()

    tail = Flaky(stack.bootstrap, topic, size=10).start()
    try:
        deadline = time.monotonic() + 30
        while tail.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tail.errors == 1 and tail.refused == 1
        got = tail()
        assert 0 < len(got) <= 10 and all(g.prompt_ids == (3, 4) for g in got)
    finally:
        tail.close()

    # the held-out form: it starts `size` back from the first record younger than `young_s` (ListOffsets by time,
    # on the real broker), and keeps every younger one: here all 30 were written within the hour
    tail = GenerationTail(stack.bootstrap, topic, size=10, young_s=3600.0, judged_at=lambda g: time.time()).start()
    try:
        deadline = time.monotonic() + 30
        while tail.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tail.errors == 0 and tail.refused == 1
        assert len(tail()) == 24  # 30 records, every 5th untrainable, the malformed one refused
    finally:
        tail.close()


@pytest.mark.slow
def test_gate_with_the_real_evaluator_and_the_demo_suite(cfg, rds):
    """The real evaluator on the real demo policy and the demo product's suite (sums right, nothing else)."""
    from learner.evaluate import PolicyEvaluator, Probe
    from learner.model import load_state_dict
    from liverl.demo import task
    from liverl.demo.base_policy import encode_text, ensure_base_policy
    from liverl.demo.product import ArithmeticProduct

    model_dir = ensure_base_policy(cfg.model_cache_path, seed=0, progress=False)
    rng = __import__("random").Random(0)
    probes = [
        Probe(tuple(encode_text(p.text)), tuple(encode_text(task.preferred_completion(p)) + [1]))
        for p in (task.sample_prompt(rng) for _ in range(64))
    ]
    suite = ArithmeticProduct(suite_size=64).eval_suite()
    ev = PolicyEvaluator(model_dir, suite, lambda: probes)
    registry = open_registry(cfg)
    try:
        base = load_state_dict(model_dir)
        ev.warm_up(base)  # what the gate runs at start: the real model builds and runs one forward
        assert ev.drift(base, base)["kl"] == pytest.approx(0.0, abs=1e-6)
        assert 0.0 <= ev.suite_score(base)["score"] <= 1.0
        # batched, right-padded sequence log-probs equal each sequence scored alone
        from learner.model import load_model

        seq = ev.sequence_logprobs(base, probes[:5])
        model = load_model(model_dir, dict(base), dtype=torch.float32)
        for p, got in zip(probes[:5], seq, strict=True):
            ids = torch.tensor([list(p.prompt_ids) + list(p.completion_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
            want = sum(float(logp[len(p.prompt_ids) - 1 + i, t]) for i, t in enumerate(p.completion_ids))
            assert got == pytest.approx(want, abs=1e-4)
        registry.init_base(base, str(model_dir))
        row = registry.add_candidate(perturb(base, 0.02, seed=1), parent=0)
        from deploy.gate.tail import HeldoutSample

        heldout = [
            HeldoutSample(p.prompt_ids, p.completion_ids, lp, float(i % 2), f"g{i}", 0.0, "accept")
            for i, (p, lp) in enumerate(zip(probes, ev.sequence_logprobs(base, probes), strict=True))
        ]
        [v] = Gate(cfg, registry, rds, ev, heldout=lambda: heldout).step()
        assert v.version == row.version and set(v.checks) == set(ALL) | {"offpolicy"}
        assert {g.check for g in registry.gate_results(row.version)} == set(ALL) | {"offpolicy"}
    finally:
        registry.close()


class MeddlingEval(ProbeEval):
    """Evaluates like ProbeEval, but runs ``meddle`` (an operator's action) in the middle of the evaluation."""

    def __init__(self, meddle):
        super().__init__()
        self.meddle = meddle

    def drift(self, candidate, stable):
        if self.meddle is not None:
            self.meddle()
            self.meddle = None
        return super().drift(candidate, stable)


def test_operator_promote_during_a_failing_evaluation_keeps_a_stable_version(cfg, rds):
    """Finding: the gate rejected a version an operator had just promoted, leaving no stable version."""
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        row = registry.add_candidate(weights(0.1, 1.0, seed=1), parent=0)  # fails the suite
        gate = Gate(
            cfg,
            registry,
            rds,
            MeddlingEval(lambda: registry.promote(row.version, actor="alice", reason="hand-checked")),
        )
        [v] = gate.step()
        assert v.verdict == "rejected" and v.checks["suite"] is False
        assert registry.get(row.version).status == "stable" and registry.stable().version == row.version
        gate.step()  # and the gate keeps working, announcing the operator's choice
        assert desired(rds, cfg).version == row.version
    finally:
        registry.close()


def test_operator_rollback_during_a_passing_evaluation_is_not_overridden(cfg, rds):
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        v1 = registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
        registry.promote(v1.version, actor="gate", reason="passed")
        v2 = registry.add_candidate(weights(0.7, 1.0, seed=2), parent=v1.version)
        gate = Gate(cfg, registry, rds, MeddlingEval(lambda: registry.rollback(actor="bob", reason="complaints")))
        [v] = gate.step()
        assert v.verdict == "deferred" and registry.stable().version == 0
        [v] = gate.step()  # v2 was emitted before the rollback: it may carry the rolled-back change
        assert v.verdict == "rejected" and v.reason == "emitted before the last rollback"
        assert registry.get(v2.version).status == "rejected" and registry.stable().version == 0
        assert desired(rds, cfg).version == 0
        time.sleep(0.01)
        v3 = registry.add_candidate(weights(0.7, 1.0, seed=3), parent=0)  # after the rollback: judged as usual
        assert gate.step()[0].verdict == "promoted" and registry.stable().version == v3.version
    finally:
        registry.close()


def test_a_candidate_registered_across_a_rollback_is_rejected_by_audit_order(cfg, setup, monkeypatch):
    """A rollback that lands while a candidate is stored (its delta encoded, which takes minutes on a large model) or
    trained (the learner's weights still carry the rolled-back lineage, whatever parent it registers against) gets the
    candidate rejected: ordered by the audit log's ids, not by the learner's and the operator's clocks."""
    import deploy.registry.versions as versions

    gate, registry, rds, _ev = setup
    v1 = registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
    registry.promote(v1.version, actor="gate", reason="passed")
    before = registry.last_rollback()[0]
    encode = versions.encode_delta
    calls = []

    def rollback_midway(*args, **kw):
        if not calls:
            registry.rollback(actor="bob", reason="complaints")  # v1 -> v0 while v2's delta is encoded
        calls.append(1)
        return encode(*args, **kw)

    monkeypatch.setattr(versions, "encode_delta", rollback_midway)
    v2 = registry.add_candidate(weights(0.7, 1.0, seed=2), parent=v1.version)
    assert registry.get(v2.version).created_at > registry.last_rollback()[1]  # stamped after the rollback
    [v] = gate.step()
    assert (v.version, v.verdict, v.reason) == (v2.version, "rejected", "emitted before the last rollback")
    # trained from v1 before the rollback, registered against the new stable v0 after it
    v3 = registry.add_candidate(weights(0.7, 1.0, seed=3), parent=0, rollback_seen=before)
    [v] = gate.step()
    assert (v.version, v.verdict, v.reason) == (v3.version, "rejected", "emitted before the last rollback")
    v4 = registry.add_candidate(weights(0.7, 1.0, seed=4), parent=0, rollback_seen=registry.last_rollback()[0])
    assert gate.step()[0].verdict == "promoted" and registry.stable().version == v4.version


def test_gate_reconciles_the_announcement_with_the_registry(cfg, setup):
    """Finding: a crash between promote and announce left the fleet on the old version indefinitely."""
    gate, registry, rds, _ev = setup
    row = registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
    registry.promote(row.version, actor="gate", reason="promoted, then the gate died before announcing")
    rds.set(
        f"{cfg.topics.prefix}:desired", VersionAnnouncement(version=0, checksum=registry.get(0).checksum).to_bytes()
    )
    gate.step()
    assert desired(rds, cfg).version == row.version
    rds.set(f"{cfg.topics.prefix}:desired", b"garbage")
    gate.step()
    assert desired(rds, cfg).version == row.version


class OffPolicyEval(ProbeEval):
    """Log-probs of the held-out completions: the logged behaviour's, moved by the weights' ``op_shift`` towards
    accepted completions (positive) or away from them (negative)."""

    def __init__(self):
        super().__init__(with_suite=False)
        self.logprob_calls = 0

    def sequence_logprobs(self, weights, probes):
        self.logprob_calls += 1
        s = float(weights["op_shift"][0])
        return [p.behaviour_logprob + (s if p.reward else -s) for p in probes]


def test_a_candidate_estimated_worse_on_held_out_feedback_is_refused_before_exposure(cfg, rds):
    """Evidence before exposure: the off-policy estimate on held-out samples, against stable's."""
    from deploy.gate.tail import HeldoutSample

    def state(shift: float, seed: int) -> dict:
        return {**weights(0.5, 0.8, seed=seed), "op_shift": torch.tensor([shift])}

    registry = open_registry(cfg)
    registry.init_base(state(0.0, 0), "/nonexistent/model")
    heldout = [HeldoutSample((1, 2, 3), (4, 5), -2.0, float(i % 2), f"g{i}", 0.0, "accept") for i in range(400)]
    ev = OffPolicyEval()
    gate = Gate(cfg, registry, rds, ev, heldout=lambda: heldout)
    try:
        gate.step()
        worse = registry.add_candidate(state(-0.5, 1), parent=0)
        [v] = gate.step()
        assert v.verdict == "rejected" and v.checks["offpolicy"] is False, v
        [g] = [g for g in registry.gate_results(worse.version) if g.check == "offpolicy"]
        assert "refuse" in g.detail and "stable v0 0.500" in g.detail and g.value < g.threshold
        better = registry.add_candidate(state(0.5, 2), parent=0)
        [v] = gate.step()
        assert v.verdict == "promoted" and v.checks["offpolicy"] is True, v
        [g] = [g for g in registry.gate_results(better.version) if g.check == "offpolicy"]
        assert "0.731" in g.detail and "ESS" in g.detail
        assert ev.logprob_calls == 4  # candidate and stable, per candidate
    finally:
        registry.close()


def test_held_out_records_are_parsed_only_when_their_log_probs_are_comparable():
    from core.schemas import SamplingParams, TrainingSample
    from deploy.gate.tail import parse_heldout

    def sample(kind: str, reward: float = 1.0, **sampling) -> bytes:
        return TrainingSample(
            sample_id="g1",
            generation_id="g1",
            feedback_id="f1",
            policy_version=0,
            kind=kind,
            reward=reward,
            prompt_token_ids=[1, 2],
            completion_token_ids=[3, 4],
            behaviour_logprobs=[-0.5, -1.0],
            sampling=SamplingParams(max_tokens=4, **sampling),
            ts_generation=1.8e9,
            ts_feedback=1.8e9,
        ).to_bytes()

    h = parse_heldout(sample("accept", temperature=1.0))
    assert h is not None and h.behaviour_logprob == -1.5 and h.reward == 1.0 and h.completion_ids == (3, 4)
    assert parse_heldout(sample("edit", 0.25, temperature=1.0)).reward == 0.25  # the product's reward, as logged
    assert parse_heldout(sample("accept", temperature=0.7)) is None  # logged log-probs of a sharpened distribution
    assert parse_heldout(sample("accept", temperature=1.0, top_p=0.9)) is None


def test_the_heldout_tail_keeps_its_size_in_samples_old_enough_to_judge():
    """The held-out tail keeps `size` samples past the revert horizon plus every younger one: at any traffic the
    off-policy check has `size` usable samples. A last-`size` tail held only young ones once the traffic brought more
    than `size` per horizon (a one-node CI demo deferred every candidate with "no usable held-out samples")."""
    from deploy.gate.offpolicy import merge_heldout
    from deploy.gate.tail import HeldoutSample

    now = time.time()

    def parse(raw: bytes) -> HeldoutSample:
        gid, age = raw.decode().split(":")
        return HeldoutSample((1,), (2,), -1.0, 1.0, gid, now - float(age), "accept")

    tail = GenerationTail("unused:9092", "t", size=3, parse=parse, young_s=60.0, judged_at=lambda h: h.judged_at)
    plain = GenerationTail("unused:9092", "t", size=3, parse=parse)
    for i in range(5):
        for t in (tail, plain):
            t._add(f"old{i}:100".encode())
    for i in range(10):
        for t in (tail, plain):
            t._add(f"young{i}:1".encode())
    usable, young = merge_heldout(tail(), now - 60.0)
    assert [h.generation_id for h in usable] == ["old2", "old3", "old4"] and young == 10
    assert merge_heldout(plain(), now - 60.0) == ([], 3)  # what the gate had before
    # time passes: the young ones age into the kept `size`, the oldest leave
    tail.young_s = 0.5  # judged 1 s ago: now old enough
    usable, young = merge_heldout(tail(), time.time() - 0.5)
    assert [h.generation_id for h in usable] == ["young7", "young8", "young9"] and young == 0


def test_no_candidate_is_judged_before_any_held_out_feedback_has_had_its_revert_horizon(cfg, rds):
    """A deployment's first minute: every held-out judgement is younger than gate.revert_horizon_s, so nothing the
    gate could read (off-policy or live) includes a revert, and the learner has trained on accepts its users may still
    undo (in the demo those first candidates were the trap's bait, each canaried for 100-200 s). The candidate waits,
    untouched and unjudged; once a judgement is old enough the newest candidate is judged as before."""
    from deploy.gate.tail import HeldoutSample

    cfg.gate.revert_horizon_s = 60.0
    registry = open_registry(cfg)
    registry.init_base({**weights(0.5, 0.8), "op_shift": torch.tensor([0.0])}, "/nonexistent/model")
    now = time.time()
    heldout = [HeldoutSample((1, 2, 3), (4, 5), -2.0, float(i % 2), f"g{i}", now - 5.0, "accept") for i in range(400)]
    ev = OffPolicyEval()
    gate = Gate(cfg, registry, rds, ev, heldout=lambda: heldout)
    try:
        gate.step()
        row = registry.add_candidate({**weights(0.5, 0.8, seed=1), "op_shift": torch.tensor([0.5])}, parent=0)
        for _ in range(3):
            [v] = gate.step()
            assert v.verdict == "deferred" and "too early" in v.reason and "gate.revert_horizon_s" in v.reason, v
        assert registry.get(row.version).status == "candidate" and registry.gate_results(row.version) == []
        assert ev.drift_calls == 0 and ev.logprob_calls == 0  # nothing evaluated while it waits
        assert 'liverl_gate_verdicts_total{verdict="deferred"} 1.0' in gate.metrics_text().decode()  # once a version
        heldout[:200] = [h._replace(judged_at=now - 120.0) for h in heldout[:200]]  # the first ones' horizon has passed
        [v] = gate.step()
        assert v.verdict == "promoted", v  # judged as before (one node: no canary), the off-policy check included
        assert "offpolicy" in v.checks
    finally:
        registry.close()
