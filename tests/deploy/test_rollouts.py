"""Rollouts in the registry: a canary and its rollout begin together, evidence is written by compare-and-set, an
operator's pause or abort wins over a gate step that read before it, and no canary row is left without its rollout.
On SQLite and PostgreSQL (the ``registry`` fixture)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from deploy.registry.registry import MAX_LOOKS, Registry, RegistryConflict, RegistryError
from deploy.registry.tables import Rollout, Version
from tests.deploy.conftest import perturb, tiny_model


def candidates(registry: Registry, n: int = 2) -> list[int]:
    base = tiny_model()
    registry.init_base(base, "/m")
    return [registry.add_candidate(perturb(base, 0.05, seed=i + 1), parent=0).version for i in range(n)]


def begin(registry: Registry, version: int, **kw):
    terms = dict(
        stable_version=0,
        share=0.2,
        nodes=["node-1"],
        unit="user",
        deadline_at=time.time() + 600,
        settings={"nulls": {"latency": 0.25}},
        actor="gate",
        reason="offline checks passed",
    )
    return registry.begin_rollout(version, **{**terms, **kw})


def test_a_rollout_begins_with_its_canary_in_one_transaction(registry):
    v1, v2 = candidates(registry)
    ro = begin(registry, v1)
    assert registry.get(v1).status == "canary"
    got = registry.active_rollout()
    assert (
        got.id,
        got.version,
        got.checksum,
        got.stable_version,
        got.share,
        got.nodes,
        got.unit,
        got.state,
        got.revision,
        got.test_state,
        got.looks,
        got.settings,
        got.ended_at,
    ) == (
        ro.id,
        v1,
        registry.get(v1).checksum,
        0,
        0.2,
        ["node-1"],
        "user",
        "running",
        1,
        {},
        [],
        {"nulls": {"latency": 0.25}},
        None,
    )
    assert registry.rollout(ro.id).id == ro.id and [r.id for r in registry.rollouts()] == [ro.id]
    assert [(a.actor, a.action, a.version) for a in registry.audit()][-1] == ("gate", "canary_start", v1)

    with pytest.raises(RegistryConflict, match="one rollout at a time"):
        begin(registry, v2)
    assert registry.get(v2).status == "candidate"  # nothing changed
    for bad, match in (
        ({"share": 0.0}, "share"),
        ({"share": 1.5}, "share"),
        ({"nodes": []}, "canary nodes"),
        ({"unit": "session"}, "unit"),
        ({"settings": {"x": float("nan")}}, "finite"),
    ):
        with pytest.raises(ValueError, match=match):
            begin(registry, v2, **bad)
    with pytest.raises(RegistryError, match="only together with its rollout"):
        registry.set_status(v2, "canary", actor="gate")
    with pytest.raises(RegistryError, match="unknown rollout 999"):
        registry.rollout(999)


def test_begin_refuses_a_version_that_is_not_a_candidate_or_a_moved_stable(registry):
    v1, v2 = candidates(registry)
    registry.set_status(v1, "rejected", actor="gate", reason="drift")
    with pytest.raises(RegistryConflict, match="is rejected, not a candidate"):
        begin(registry, v1)
    with pytest.raises(RegistryConflict, match="stable version is 0, not 5"):
        begin(registry, v2, stable_version=5)
    assert registry.active_rollout() is None and registry.get(v2).status == "candidate"


def test_evidence_is_written_by_compare_and_set_and_never_changes_the_state(registry):
    (v1, _) = candidates(registry)
    ro = begin(registry, v1)
    looks = [{"at": float(i), "canary_events": i} for i in range(MAX_LOOKS + 7)]
    saved = registry.save_rollout_evidence(ro.id, 1, {"acceptance:pass": 1.5}, looks, "continue", "too few events")
    assert (saved.revision, saved.state, saved.test_state, saved.verdict, saved.reason) == (
        2,
        "running",
        {"acceptance:pass": 1.5},
        "continue",
        "too few events",
    )
    assert len(saved.looks) == MAX_LOOKS and saved.looks[-1] == looks[-1]  # the newest kept

    with pytest.raises(RegistryConflict, match="at revision 2 \\(running\\), not 1"):  # a second gate's stale write
        registry.save_rollout_evidence(ro.id, 1, {"acceptance:pass": 50.0}, [], "promote", "forged")
    now = registry.rollout(ro.id)
    assert (now.revision, now.test_state, now.verdict) == (2, {"acceptance:pass": 1.5}, "continue")
    with pytest.raises(ValueError, match="finite"):
        registry.save_rollout_evidence(ro.id, 2, {"acceptance:harm": float("-inf")}, [], None, None)

    registry.set_rollout_state(ro.id, "paused", actor="alice", reason="looking")
    paused = registry.save_rollout_evidence(ro.id, 3, {"acceptance:pass": 2.0}, [], "continue", "paused")
    assert (paused.state, paused.revision) == ("paused", 4)  # a paused canary still gathers evidence
    registry.finish_rollout_abort(ro.id, actor="gate", reason="worse")
    with pytest.raises(RegistryConflict, match="aborted"):  # an ended rollout takes no evidence
        registry.save_rollout_evidence(ro.id, 5, {}, [], None, None)


def test_a_pause_holds_against_a_gate_step_that_read_before_it(registry):
    """The gate reads the rollout, an operator pauses it, the gate decides 'promote' on its stale read. Neither
    its evidence nor its promotion lands; the rollout stays paused and the version canary."""
    (v1, _) = candidates(registry)
    begin(registry, v1)
    read = registry.active_rollout()  # the gate's step starts here
    registry.set_rollout_state(read.id, "paused", actor="alice", reason="the on-call wants a look")
    with pytest.raises(RegistryConflict):
        registry.save_rollout_evidence(read.id, read.revision, {"acceptance:pass": 9.0}, [], "promote", "passed")
    with pytest.raises(RegistryConflict, match="is paused: not promoted"):
        registry.finish_rollout_promote(read.id, expected_stable=0, actor="gate", reason="canary passed")
    now = registry.rollout(read.id)
    assert now.state == "paused" and registry.get(v1).status == "canary" and registry.stable().version == 0
    assert [(a.actor, a.action) for a in registry.audit()][-1] == ("alice", "canary_pause")
    with pytest.raises(RegistryError, match="already paused"):
        registry.set_rollout_state(read.id, "paused", actor="alice", reason="again")

    resumed = registry.set_rollout_state(read.id, "running", actor="alice", reason="fine")
    with pytest.raises(RegistryConflict, match="revision"):  # a promotion decided on a read from before the resume
        registry.finish_rollout_promote(
            read.id, expected_stable=0, actor="gate", reason="x", expect_revision=read.revision
        )
    with pytest.raises(RegistryConflict, match="stable version is 0, not 7"):
        registry.finish_rollout_promote(read.id, expected_stable=7, actor="gate", reason="x")
    done = registry.finish_rollout_promote(
        read.id, expected_stable=0, actor="gate", reason="canary passed", expect_revision=resumed.revision
    )
    assert (done.state, done.verdict, done.revision) == ("promoted", "promote", resumed.revision + 1)
    assert done.ended_at is not None and registry.active_rollout() is None
    assert registry.stable().version == v1 and registry.get(0).status == "retired"
    assert [(a.actor, a.action, a.version) for a in registry.audit()][-1] == ("gate", "promote", v1)
    with pytest.raises(RegistryConflict, match="is promoted"):
        registry.set_rollout_state(read.id, "paused", actor="alice", reason="too late")


def test_an_abort_rejects_the_canary_from_running_or_paused(registry):
    v1, v2 = candidates(registry)
    ro = begin(registry, v1)
    registry.set_rollout_state(ro.id, "paused", actor="alice", reason="look")
    out = registry.finish_rollout_abort(ro.id, actor="alice", reason="aborted by alice", verdict="operator")
    assert (out.state, out.verdict, registry.get(v1).status) == ("aborted", "operator", "rejected")
    assert registry.get(v1).status_reason == "aborted by alice"
    with pytest.raises(RegistryConflict, match="aborted already"):
        registry.finish_rollout_abort(ro.id, actor="gate", reason="again")
    with pytest.raises(RegistryConflict, match="is aborted: not promoted"):
        registry.finish_rollout_promote(ro.id, expected_stable=0, actor="gate", reason="x")
    ro2 = begin(registry, v2)  # the next rollout gets a new id (it salts the users' assignment)
    assert ro2.id != ro.id and registry.active_rollout().id == ro2.id


def test_an_operator_promoting_or_rejecting_the_canary_directly_ends_its_rollout(registry):
    v1, v2 = candidates(registry)
    ro = begin(registry, v1)
    with pytest.raises(RegistryConflict, match="finish_rollout_promote"):  # the gate's CAS promotion of a candidate
        registry.promote(v1, actor="gate", reason="x", expected_stable=0, from_candidate=True)
    registry.promote(v1, actor="alice", reason="ship it")  # an operator's word
    assert registry.rollout(ro.id).state == "ended" and registry.stable().version == v1
    assert "rollout" in registry.audit()[-1].reason

    ro2 = begin(registry, v2, stable_version=v1)
    registry.set_status(v2, "rejected", actor="bob", reason="no")
    assert registry.rollout(ro2.id).state == "ended" and registry.active_rollout() is None


def test_a_crash_after_begin_leaves_no_orphan_and_old_orphans_are_reaped(registry):
    """begin_rollout is one transaction, so a gate that stops right after it (before announcing anything) leaves
    a rollout the next gate finds (``active_rollout``), not an orphan. A canary row without a rollout (left by an older
    release, or a hand edit) is rejected by ``reap_orphan_canaries``, audited; a rollout whose version is not canary any
    more is ended."""
    v1, v2, v3 = candidates(registry, 3)
    begin(registry, v1)  # ... and the gate process dies here
    assert registry.reap_orphan_canaries() == []  # nothing to reap: the rollout is there to resume
    assert registry.active_rollout().version == v1 and registry.get(v1).status == "canary"

    with registry.engine.begin() as c:  # the old code's crash: status canary, no rollout
        c.execute(sa.update(Version).where(Version.version == v2).values(status="canary"))
    assert registry.reap_orphan_canaries(actor="gate") == [v2]
    assert registry.get(v2).status == "rejected" and "orphan canary" in registry.get(v2).status_reason
    assert [(a.actor, a.action, a.version) for a in registry.audit()][-1] == ("gate", "rejected", v2)
    assert registry.get(v1).status == "canary" and registry.active_rollout().state == "running"  # untouched
    assert registry.reap_orphan_canaries() == []

    with registry.engine.begin() as c:  # a hand edit un-canaries the running one
        c.execute(sa.update(Version).where(Version.version == v1).values(status="candidate"))
    assert registry.reap_orphan_canaries() == [] and registry.active_rollout() is None
    assert registry.rollouts()[0].state == "ended"
    begin(registry, v3)
    assert registry.active_rollout().version == v3
    with registry.engine.connect() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(Rollout)).scalar_one() == 2


def test_a_pause_and_a_concurrent_promotion_never_both_land(registry, tmp_path):
    """The operator and the gate race (separate connections, released together): whichever commits first wins and the
    other is refused, so the rollout never ends promoted after a pause that succeeded."""
    import threading

    from deploy.registry.blobstore import LocalBlobStore

    versions = candidates(registry, 4)
    for v in versions:
        ro = begin(registry, v, stable_version=registry.stable().version)
        gate_read = registry.active_rollout()
        start, outcome = threading.Barrier(2), {}

        def act(name, fn, start=start, outcome=outcome):
            reg = Registry(registry.url, LocalBlobStore(tmp_path / "blobs"))
            try:
                start.wait()
                fn(reg)
                outcome[name] = "done"
            except RegistryConflict:
                outcome[name] = "refused"
            finally:
                reg.close()

        threads = [
            threading.Thread(
                target=act,
                args=("pause", lambda r, ro=ro: r.set_rollout_state(ro.id, "paused", actor="alice", reason="look")),
            ),
            threading.Thread(
                target=act,
                args=(
                    "promote",
                    lambda r, ro=ro, stable=gate_read.stable_version: r.finish_rollout_promote(
                        ro.id, expected_stable=stable, actor="gate", reason="passed"
                    ),
                ),
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        final = registry.rollout(ro.id).state
        assert sorted(outcome.values()) == ["done", "refused"], outcome
        assert final == ("paused" if outcome["pause"] == "done" else "promoted")
        if final == "paused":
            registry.finish_rollout_abort(ro.id, actor="alice", reason="clean up")
