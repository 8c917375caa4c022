"""The canary's promotion lands only on the rollout row the gate judged: any operator write between the gate's saved
evidence and its promotion (a pause and a resume included) moves the row's revision, and the gate looks again."""

from __future__ import annotations

from tests.deploy.test_canary import after, first, fleet2, start, traffic  # noqa: F401 - fleet2 is a fixture


def test_a_pause_and_resume_between_the_saved_evidence_and_the_promotion_makes_the_gate_look_again(
    cfg,
    rds,
    fleet2,  # noqa: F811
    monkeypatch,
):
    """The rollout ends up ``running`` again, but at another revision than the evidence the gate saved: the promotion
    is refused and the next step judges the rollout as the operator left it."""
    gate, registry = fleet2
    r = start(gate, registry, rds, cfg)
    traffic(rds, cfg, r, first(r, 12), lift=0.15)
    gate.canary.clock = lambda: after(r, cfg, 12)
    real = registry.save_rollout_evidence

    def then_pause_and_resume(*a, **kw):
        saved = real(*a, **kw)
        registry.set_rollout_state(r.id, "paused", actor="alice", reason="a look at the reverts")
        registry.set_rollout_state(r.id, "running", actor="alice", reason="reverts are fine")
        return saved

    monkeypatch.setattr(registry, "save_rollout_evidence", then_pause_and_resume)
    [v] = gate.step()
    assert v.verdict == "canary" and "not promoted" in v.reason, v.reason
    assert registry.rollout(r.id).state == "running" and registry.get(r.version).status == "canary"
    monkeypatch.setattr(registry, "save_rollout_evidence", real)
    [v] = gate.step()
    assert v.verdict == "promoted", v.reason
