"""The canary, driven by the real gate on the real registry and Redis: a candidate that passed the offline checks
goes to the canary nodes, the live counters ingest keeps decide it with the always-valid test, and a promotion or an
abort leaves the registry, the announcements and the rollout plan consistent. (The serving side of a rollout, the
canary node swapping and the router's split, is in tests/serving.)"""

from __future__ import annotations

import time

import pytest

from deploy.canary import read_plan
from deploy.gate import Gate
from deploy.registry import open_registry
from liverl.core import keys
from liverl.core.schemas import VersionAnnouncement
from tests.deploy.test_gate import ProbeEval, desired, weights


@pytest.fixture
def fleet(cfg, rds):
    """Two serving nodes in rotation, stable v0 with 1,000 judged events at 40% before any canary."""
    for n in ("node-a", "node-b"):
        rds.set(keys.served(cfg.topics.prefix, n),
                keys.ServedHeartbeat(version=0, checksum="x", url=f"http://127.0.0.1/{n}").to_json(),
                ex=3600)  # long: the first delta encoding in a process may compile kernels for a minute
    cfg.gate.canary_min_events = 50
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    gate = Gate(cfg, registry, rds, ProbeEval())
    gate.step()
    live(rds, cfg, 0, 1000, 400)
    yield gate, registry
    registry.close()


def live(rds, cfg, version: int, events: int, accept: int, edit: int = 0, revert: int = 0,
         judged_at: float | None = None) -> None:
    """What ingest does per judged event, in bulk: the version's live counters grow (reverts also per bucket of
    when the generation they undo was judged: now, unless ``judged_at``)."""
    rds.hincrby(keys.live(cfg.topics.prefix, version), "revert", revert)
    rds.hincrby(keys.live(cfg.topics.prefix, version), keys.revert_field(judged_at or time.time() + 60), revert)
    rds.hincrby(keys.live(cfg.topics.prefix, version), "events", events)
    rds.hincrby(keys.live(cfg.topics.prefix, version), "accept", accept)
    rds.hincrby(keys.live(cfg.topics.prefix, version), "edit", edit)
    rds.hincrby(keys.live(cfg.topics.prefix, version), "reject", events - accept - edit)


def timed(rds, cfg, version: int, n: int, latency_ms: float, sd_ms: float, tokens: float = 4.0) -> None:
    """The guardrail sums ingest adds for ``n`` judged generations (keys.judged_fields): latency with mean
    ``latency_ms`` and standard deviation ``sd_ms``, ``tokens`` completion tokens each."""
    key = keys.live(cfg.topics.prefix, version)
    rds.hincrby(key, "timed", n)
    rds.hincrby(key, "latency_ms", round(n * latency_ms))
    rds.hincrby(key, "latency_ms_sq", round(n * (latency_ms ** 2 + sd_ms ** 2)))
    rds.hincrby(key, "tokens", round(n * tokens))
    rds.hincrby(key, "tokens_sq", round(n * (tokens ** 2 + 1.0)))


def start(gate, registry, rds, cfg, seed: int = 1):
    row = registry.add_candidate(weights(0.9, 1.0, seed=seed), parent=registry.stable().version)
    [v] = gate.step()
    assert v.verdict == "canary" and "canary on node-b" in v.reason
    assert registry.get(row.version).status == "canary" and registry.stable().version == 0
    plan = read_plan(rds, cfg.topics.prefix)
    assert plan.version == row.version and plan.nodes == ["node-b"] and plan.share == pytest.approx(0.2)
    assert plan.stable_baseline["events"] == 1000  # stable's history before the canary does not count
    ann = VersionAnnouncement.from_bytes(rds.get(keys.canary(cfg.topics.prefix)))
    assert (ann.version, ann.checksum) == (row.version, row.checksum) and desired(rds, cfg).version == 0
    return row


def test_a_better_canary_is_promoted_on_live_evidence(cfg, rds, fleet):
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 20, 14)
    live(rds, cfg, 0, 80, 32)
    [v] = gate.step()
    assert v.verdict == "canary" and v.reason.startswith("collecting evidence: canary v")  # too few events yet
    assert registry.get(row.version).status == "canary"
    live(rds, cfg, row.version, 300, 210)  # 70% against 40%
    live(rds, cfg, 0, 1200, 480)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
    assert registry.stable().version == row.version and desired(rds, cfg).version == row.version
    assert rds.get(keys.rollout(cfg.topics.prefix)) is None and rds.get(keys.canary(cfg.topics.prefix)) is None
    [g] = [g for g in registry.gate_results(row.version) if g.check == "canary"]
    assert g.passed and "acceptance better than stable" in g.detail and "on 320 vs stable v0" in g.detail
    assert registry.audit(version=row.version)[-1].reason.startswith("canary passed")
    text = gate.metrics_text().decode()
    assert 'liverl_gate_rollouts_total{outcome="promoted"} 1.0' in text and "liverl_gate_canary_share 0.0" in text


def test_a_canary_is_not_promoted_before_canary_min_s_and_early_evidence_does_not_count(cfg, rds, fleet):
    """Reverts arrive late: a canary that looks fine in its first minutes (no revert has come in yet, on either side)
    must not pass on that. Before gate.canary_min_s it only continues (or aborts), and passing evidence from then
    is not kept; after it, the evidence gathered from then on decides."""
    gate, registry = fleet
    cfg.gate.canary_min_s = 600.0
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 320, 224)  # 70% against 40%: enough to promote at once without the rule
    live(rds, cfg, 0, 1280, 512)
    [v] = gate.step()
    assert v.verdict == "canary" and "settling: no promotion in the first gate.canary_min_s 600 s" in v.reason
    plan = read_plan(rds, cfg.topics.prefix)
    assert not any(k.endswith(":pass") for k in plan.max_log_lr)  # what passed early is not carried
    rds.set(keys.rollout(cfg.topics.prefix), plan.model_copy(update={"started_at": plan.started_at - 601}).to_json())
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason


def test_a_worse_canary_is_aborted_and_its_nodes_return_to_stable(cfg, rds, fleet):
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 300, 60)  # 20% against 40%
    live(rds, cfg, 0, 1200, 480)
    [v] = gate.step()
    assert v.verdict == "aborted" and "acceptance is worse than stable" in v.reason
    assert registry.get(row.version).status == "rejected" and registry.stable().version == 0
    assert desired(rds, cfg).version == 0
    assert rds.get(keys.rollout(cfg.topics.prefix)) is None and rds.get(keys.canary(cfg.topics.prefix)) is None
    assert 'liverl_gate_rollouts_total{outcome="aborted"} 1.0' in gate.metrics_text().decode()
    assert "liverl_gate_refused_in_a_row 1.0" in gate.metrics_text().decode()
    row2 = registry.add_candidate(weights(0.9, 1.0, seed=2), parent=0)  # the next candidate gets its own canary
    assert gate.step()[0].verdict == "canary" and read_plan(rds, cfg.topics.prefix).version == row2.version


def test_a_guardrail_shown_worse_aborts_even_when_acceptance_is_better(cfg, rds, fleet):
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 400, 240, edit=120)  # accepted more, but users had to edit 30% of answers
    live(rds, cfg, 0, 1600, 640, edit=32)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail edit_rate is worse" in v.reason
    assert registry.get(row.version).status == "rejected"


def test_reward_hacking_shows_as_reverts_and_the_canary_is_aborted(cfg, rds, fleet):
    """A candidate that learned what users accept but later undo (the trap): more accepts, many reverted."""
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 400, 280, revert=120)  # 70% accepted, but 30% of all answers reverted later
    live(rds, cfg, 0, 1600, 640, revert=32)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail revert_rate is worse" in v.reason
    assert registry.get(row.version).status == "rejected"


def test_reverts_that_arrive_during_a_canary_for_answers_judged_before_it_do_not_count_against_stable(cfg, rds, fleet):
    """Reverts come late. The stable arm's reverts that arrive during the canary include reverts of answers judged
    before it began; the canary's cannot. Counting those would make stable look worse and pass a canary that reverts
    more: each arm counts the reverts of answers judged during the canary (keys.revert_field buckets)."""
    gate, registry = fleet
    cfg.gate.canary_min_events = 50
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, 0, 0, 0, revert=300, judged_at=time.time() - 120)  # old answers of stable, reverted now
    live(rds, cfg, row.version, 2000, 800, revert=200)  # 10% of the canary's answers reverted
    live(rds, cfg, 0, 2000, 800, revert=40)  # 2% of stable's answers judged during the canary
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail revert_rate is worse" in v.reason, v.reason
    assert "revert rate 0.100 vs 0.020" in v.reason


def test_both_arms_count_reverts_from_the_same_first_whole_bucket(cfg, rds, fleet):
    """The stable arm cannot tell which of its reverts in the canary's first (partial) 10 s bucket undo answers judged
    before the canary, so it skips that bucket; the canary's reverts there are skipped too. Counting them made honest
    canaries look worse early on (measured in the demo: revert rate 0.030 vs 0.000 fifteen seconds in, aborted)."""
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    started = read_plan(rds, cfg.topics.prefix).started_at  # inside the first bucket: it is partial
    live(rds, cfg, row.version, 400, 160, revert=30, judged_at=started)
    live(rds, cfg, 0, 1600, 640)
    [v] = gate.step()
    assert v.verdict == "canary" and "revert rate 0.000 vs 0.000" in v.reason, v.reason


def test_success_is_acceptance_users_kept_not_accepts_they_later_reverted(cfg, rds, fleet):
    """More accepts, but a quarter of all answers undone later: kept 35% against stable's 45%. The success metric
    itself says worse, not only the revert guardrail."""
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 2000, 1200, revert=500)
    live(rds, cfg, 0, 2000, 900)
    [v] = gate.step()
    assert v.verdict == "aborted", v.reason
    assert f"canary v{row.version} acceptance 0.350 on 2000 vs stable v0 0.450 on 2000 (p better 1, p worse 1.28e-07)" \
        in v.reason  # the success test alone shows it worse


def test_an_undecided_canary_is_aborted_at_its_deadline(cfg, rds, fleet):
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 100, 40)
    live(rds, cfg, 0, 400, 160)
    assert gate.step()[0].verdict == "canary"
    plan = read_plan(rds, cfg.topics.prefix)
    assert len(plan.looks) == 1 and plan.looks[0].canary_events == 100
    rds.set(keys.rollout(cfg.topics.prefix), plan.model_copy(update={"deadline_at": time.time() - 1}).to_json())
    [v] = gate.step()
    assert v.verdict == "aborted" and "deadline passed" in v.reason and registry.get(row.version).status == "rejected"


def test_peeking_state_survives_a_gate_restart_and_a_rollback_aborts_the_canary(cfg, rds, fleet):
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 200, 110)
    live(rds, cfg, 0, 800, 320)
    gate.step()
    state = read_plan(rds, cfg.topics.prefix).max_log_lr
    assert state  # the tests' running maxima are in Redis, not in the gate's memory
    gate2 = Gate(cfg, registry, rds, ProbeEval())  # a restarted gate goes on where the first one was
    gate2.step()
    assert read_plan(rds, cfg.topics.prefix).max_log_lr["acceptance:pass"] >= state["acceptance:pass"]
    other = registry.add_candidate(weights(0.8, 1.0, seed=4), parent=0)
    registry.promote(other.version, actor="alice", reason="operator's choice", force=True)
    [v] = gate2.step()
    assert v.verdict == "aborted" and "stable version changed" in v.reason
    assert registry.get(row.version).status == "rejected" and registry.stable().version == other.version


def test_operators_pause_resume_and_abort_a_canary_with_identity_and_reason(cfg, rds, fleet, capsys):
    from liverl.admin import cmd_rollout, cmd_status
    from tests.liverl.test_admin import _operators

    gate, registry = fleet
    _admin, alice, vic = _operators(cfg)
    assert cmd_rollout(cfg, "pause", "no rollout yet", alice) == 1 and "no canary" in capsys.readouterr().err
    row = start(gate, registry, rds, cfg)
    assert cmd_status(cfg) == 0
    out = capsys.readouterr().out
    assert f"canary v{row.version}" in out and "node-b" in out and "20%" in out
    assert cmd_rollout(cfg, "pause", "looking at complaints", vic) == 1  # a viewer may not
    assert cmd_rollout(cfg, "pause", "looking at complaints", alice) == 0
    assert read_plan(rds, cfg.topics.prefix).state == "paused"
    live(rds, cfg, row.version, 300, 210)
    live(rds, cfg, 0, 1200, 480)
    [v] = gate.step()
    assert v.verdict == "canary" and "paused" in v.reason and registry.get(row.version).status == "canary"
    assert cmd_rollout(cfg, "resume", "complaints unrelated", alice) == 0
    assert gate.step()[0].verdict == "promoted"

    row2 = registry.add_candidate(weights(0.9, 1.0, seed=5), parent=row.version)
    assert gate.step()[0].verdict == "canary"
    assert cmd_rollout(cfg, "abort", "incident 7", alice) == 0
    assert registry.get(row2.version).status == "rejected" and rds.get(keys.rollout(cfg.topics.prefix)) is None
    actions = [(a.actor, a.action, a.reason) for a in registry.audit()]
    assert ("alice", "canary_pause", "looking at complaints") in actions
    assert ("alice", "rejected", "canary aborted: aborted by alice: incident 7") in actions
    assert gate.step() == [] and registry.stable().version == row.version


def test_a_slower_canary_is_aborted_on_the_latency_guardrail(cfg, rds, fleet):
    """Better acceptance does not buy a canary twice the latency: the guardrail is shown worse than stable's by more
    than gate.guardrail_tolerance (10%) and the rollout aborts."""
    gate, registry = fleet
    timed(rds, cfg, 0, 1000, 200, 80)
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 400, 280)  # 70% against 40%: the success metric alone would promote
    timed(rds, cfg, row.version, 400, 400, 80)
    live(rds, cfg, 0, 1600, 640)
    timed(rds, cfg, 0, 1600, 200, 80)
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail latency is worse than stable" in v.reason, v.reason
    assert "latency 400 vs 200" in v.reason and registry.get(row.version).status == "rejected"


def test_length_and_latency_within_tolerance_do_not_hold_a_better_canary(cfg, rds, fleet):
    """5% slower and slightly longer, inside the 10% tolerance: promoted once every guardrail is shown non-inferior."""
    gate, registry = fleet
    timed(rds, cfg, 0, 1000, 200, 60, tokens=4.0)
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 600, 420)
    timed(rds, cfg, row.version, 600, 210, 60, tokens=4.1)
    live(rds, cfg, 0, 2400, 960)
    timed(rds, cfg, 0, 2400, 200, 60, tokens=4.0)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
    [g] = [g for g in registry.gate_results(row.version) if g.check == "canary"]
    assert "response_length 4.1 vs 4" in g.detail and "latency 210 vs 200" in g.detail


def test_without_timed_generations_the_latency_guardrail_is_not_required(cfg, rds, fleet):
    """Records from a gateway that does not time them carry no latency: the canary is decided without that guardrail
    (it cannot wait for evidence that never comes)."""
    gate, registry = fleet
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 300, 210)
    live(rds, cfg, 0, 1200, 480)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
    assert "latency" not in v.reason


def test_a_latency_spike_while_the_canary_settles_does_not_abort_it(cfg, rds, fleet):
    """A node that has just swapped runs hot for a few seconds (measured in the demo: 421 vs 142 ms in the canary's
    first 104 requests, aborted 5 s in). Latency and length are not judged worse before gate.canary_min_s; the same
    evidence after it aborts."""
    gate, registry = fleet
    cfg.gate.canary_min_s = 600.0
    timed(rds, cfg, 0, 1000, 140, 40)
    row = start(gate, registry, rds, cfg)
    live(rds, cfg, row.version, 104, 60)
    timed(rds, cfg, row.version, 104, 420, 80)
    live(rds, cfg, 0, 630, 300)
    timed(rds, cfg, 0, 630, 140, 40)
    [v] = gate.step()
    assert v.verdict == "canary" and v.reason.startswith("settling"), v.reason
    assert "latency:harm" not in read_plan(rds, cfg.topics.prefix).max_log_lr
    cfg.gate.canary_min_s = 0.0
    [v] = gate.step()
    assert v.verdict == "aborted" and "guardrail latency is worse" in v.reason, v.reason
