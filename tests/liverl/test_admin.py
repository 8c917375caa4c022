"""The operator verbs print readable tables and keep the registry, the audit log and Redis in step."""

from __future__ import annotations

import json
import time

import pytest

from core import keys
from core.schemas import VersionAnnouncement
from liverl.ops.admin import cmd_history, cmd_promote, cmd_rollback, cmd_status, cmd_versions, open_registry
from tests.deploy.conftest import perturb, tiny_model


@pytest.fixture(autouse=True)
def audit_key(cfg):
    """Every test here runs with the keys `liverl up` makes (<state_dir>/keys: the audit key, the announcement pair)."""
    from liverl.stack.supervisor import ensure_keys

    ensure_keys(cfg)
    return cfg.state_path / "keys" / "audit.key"


@pytest.fixture
def fleet(cfg, rds):
    """Base v0, v1 promoted by the gate, v2 rejected; live counters and a node heartbeat in Redis."""
    p = cfg.topics.prefix
    reg = open_registry(cfg)
    base = tiny_model()
    reg.init_base(base, "/models/base")
    v1 = reg.add_candidate(perturb(base, 0.05, seed=1), parent=0)
    reg.record_gate(v1.version, "suite", 0.612, 0.48, True, "ok")
    reg.promote(v1.version, actor="gate", reason="gate passed")
    v2 = reg.add_candidate(perturb(base, 0.05, seed=2), parent=1)
    reg.set_status(v2.version, "rejected", actor="gate", reason="failed collapse on [a]12+34=")
    # the learner's measurement of v1's served generations (per token: 0.041 own routing, 0.023 replayed)
    reg.add_mismatch(
        {1: {"own_tokens": 1000, "own_abs": 41.0, "own_kl": 2.0, "replay_tokens": 1000, "replay_abs": 23.0}}
    )
    reg.close()
    rds.hset(keys.live(p, 0), mapping={"accept": 40, "reject": 60, "edit": 0, "events": 100})
    rds.hset(keys.live(p, 1), mapping={"accept": 60, "reject": 40, "edit": 0, "events": 100})
    rds.set(f"{p}:served:node-0", json.dumps({"version": 1, "checksum": v1.checksum, "ts": time.time()}))
    rds.set(f"{p}:desired", VersionAnnouncement(version=1, checksum=v1.checksum, reason="gate").to_bytes())
    return v1, v2


def desired(rds, cfg) -> int:
    return VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired")).version


def test_versions_and_status_tables(cfg, fleet, capsys):
    assert cmd_versions(cfg, limit=20) == 0
    out = capsys.readouterr().out
    for text in (
        "v2",
        "rejected (failed collapse on [a]12+34=)",  # a reason shown as written, never read as rich markup
        "stable",
        "retired",
        "0.612",
        "60.0% of 100",
        "40.0% of 100",
        "node-0",
        "snap",
        "0.0410",  # v1's sampler/trainer mismatch: mean |Δ logp| own routing
        "0.0230",  # and replayed
        "0.0020",  # KL, own routing
    ):
        assert text in out, text
    assert cmd_status(cfg) == 0
    out = capsys.readouterr().out
    assert "stable: v1" in out and "desired: v1" in out and "node-0" in out and "yes" in out
    assert "pending candidates: none" in out


def _operators(cfg) -> tuple[str, str, str]:
    """An admin (the bootstrap operator), an operator and a viewer; their tokens."""
    import re

    from liverl.ops.admin import cmd_operator

    tokens = []
    for name, role in (("root", "admin"), ("alice", "operator"), ("vic", "viewer")):
        reg = open_registry(cfg)
        try:
            by_token = tokens[0] if tokens else None
        finally:
            reg.close()
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            assert cmd_operator(cfg, "add", name, role, "test set-up", by_token) == 0
        tokens.append(re.search(r"(lvr_\S+)", buf.getvalue()).group(1))
    return tuple(tokens)


def test_promote_and_rollback_update_registry_audit_and_redis(cfg, rds, fleet, capsys):
    _v1, v2 = fleet
    admin, alice, vic = _operators(cfg)
    capsys.readouterr()
    assert cmd_promote(cfg, v2.version, reason="try it", token=None, force=True) == 1
    assert "needs an operator token" in capsys.readouterr().err
    assert cmd_promote(cfg, v2.version, reason="try it", token=vic, force=True) == 1
    assert "vic is a viewer" in capsys.readouterr().err
    assert cmd_promote(cfg, v2.version, reason="try it", token="lvr_forged", force=True) == 1
    assert "unknown or disabled" in capsys.readouterr().err
    assert cmd_promote(cfg, v2.version, reason="try it", token=alice) == 1
    assert "pass --force" in capsys.readouterr().err
    assert cmd_promote(cfg, 99, reason="x", token=alice) == 1
    assert "unknown version 99" in capsys.readouterr().err
    assert desired(rds, cfg) == 1

    assert cmd_promote(cfg, v2.version, reason="try it", token=alice, force=True) == 0
    assert "v2 is now stable" in capsys.readouterr().out
    assert desired(rds, cfg) == 2
    assert cmd_rollback(cfg, reason="acceptance dropped", token=admin) == 0
    assert desired(rds, cfg) == 1
    assert cmd_rollback(cfg, to=0, reason="back to base", token=admin) == 0
    assert desired(rds, cfg) == 0
    ann = VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))
    assert "back to base" in ann.reason
    capsys.readouterr()

    assert cmd_history(cfg, verify=True) == 0
    out = capsys.readouterr().out
    assert "audit log intact" in out and "keyed (HMAC-SHA256" in out and "head anchored in Redis" in out
    for text in ("alice", "promote", "root", "rollback", "acceptance dropped", "init", "add_operator"):
        assert text in out, text
    reg = open_registry(cfg)
    try:
        assert {r.version: r.status for r in reg.list()} == {0: "stable", 1: "rolled_back", 2: "rolled_back"}
        assert all(len(o.token_hash) == 64 and not o.token_hash.startswith("lvr_") for o in reg.operators())
    finally:
        reg.close()


def test_a_verb_on_a_host_without_the_signing_key_says_the_fleet_has_not_moved(cfg, rds, fleet, capsys):
    """The agents refuse an unsigned announcement, so a host without the signing key writes none over the gate's:
    the change is made in the registry, and the operator reads that the fleet moves only once the gate announces it."""
    _v1, v2 = fleet
    admin, alice, _ = _operators(cfg)
    (cfg.state_path / "keys" / "announce.key").unlink()
    capsys.readouterr()
    assert cmd_promote(cfg, v2.version, reason="try it", token=alice, force=True) == 0
    out = capsys.readouterr()
    assert "NOT announced" in out.err and "no announcement signing key" in out.err and "announced to" not in out.out
    assert desired(rds, cfg) == 1  # the gate's announcement stands until the gate signs the new stable
    reg = open_registry(cfg)
    try:
        assert reg.stable().version == v2.version and reg.audit()[-1].action == "promote"
    finally:
        reg.close()


def test_a_tampered_audit_log_is_detected(cfg, fleet, capsys):
    import sqlalchemy as sa

    from deploy.registry.tables import AuditEntry

    assert cmd_history(cfg, verify=True) == 0
    reg = open_registry(cfg)
    try:
        with reg.engine.begin() as c:  # someone with database access rewrites who promoted v1
            c.execute(sa.update(AuditEntry).where(AuditEntry.action == "promote").values(actor="gate-impostor"))
        assert reg.verify_audit().kind == "tampered"
    finally:
        reg.close()
    capsys.readouterr()
    assert cmd_history(cfg, verify=True) == 1
    assert "tampered with" in capsys.readouterr().err


def test_sealing_the_audit_log_needs_an_admin_and_a_log_that_ends_unkeyed(cfg, fleet, capsys):
    """`liverl history --seal` is an admin's, and a keyed log has nothing to seal: the command changes nothing."""
    admin, alice, _ = _operators(cfg)
    capsys.readouterr()
    assert cmd_history(cfg, seal="adopting the log", token=alice) == 1
    assert "this needs the admin role" in capsys.readouterr().err
    assert cmd_history(cfg, seal="adopting the log", token=admin) == 1
    assert "nothing to seal" in capsys.readouterr().err
    reg = open_registry(cfg)
    try:
        assert "audit_seal" not in {a.action for a in reg.audit()}
    finally:
        reg.close()


def test_history_verify_detects_a_recomputed_chain(cfg, fleet, capsys):
    """A database writer rewrites an entry and recomputes the whole chain (the plain hashes exactly; the MACs can only
    be made with a key of their own): `liverl history --verify` still says tampered."""
    import sqlalchemy as sa

    from deploy.registry.auditchain import audit_mac
    from deploy.registry.tables import AuditEntry, audit_hash

    reg = open_registry(cfg)
    try:
        with reg.engine.begin() as c:
            c.execute(sa.update(AuditEntry).where(AuditEntry.action == "promote").values(actor="gate-impostor"))
            prev, link = "", ""
            for pos, e in enumerate(c.execute(sa.select(AuditEntry).order_by(AuditEntry.id)).all(), 1):
                h = audit_hash(prev, e.actor, e.action, e.version, e.reason, e.at)
                mac = audit_mac(b"the attacker's key", link, pos, e.actor, e.action, e.version, e.reason, e.at)
                c.execute(
                    sa.update(AuditEntry).where(AuditEntry.id == e.id).values(prev_hash=prev, entry_hash=h, mac=mac)
                )
                prev, link = h, mac
    finally:
        reg.close()
    capsys.readouterr()
    assert cmd_history(cfg, verify=True) == 1
    err = capsys.readouterr().err
    assert "tampered with" in err and "MAC does not verify" in err


def test_history_verify_detects_a_cut_tail(cfg, fleet, capsys):
    import sqlalchemy as sa

    from deploy.registry.tables import AuditEntry

    reg = open_registry(cfg)
    try:
        last = reg.audit()[-1]
        with reg.engine.begin() as c:  # the newest entry (v2's rejection) disappears
            c.execute(sa.delete(AuditEntry).where(AuditEntry.id == last.id))
    finally:
        reg.close()
    capsys.readouterr()
    assert cmd_history(cfg, verify=True) == 1
    err = capsys.readouterr().err
    assert "tail was cut" in err and "anchored head" in err


def test_canary_verbs_write_the_rollout_in_the_registry_and_the_audit_log(cfg, rds, fleet, capsys):
    """`liverl pause | resume | abort` and promoting the canary act on the registry's rollout (not the Redis plan),
    need an operator token and a reason, and are audited."""
    from liverl.ops.admin import cmd_rollout

    _admin, alice, vic = _operators(cfg)
    reg = open_registry(cfg)
    try:
        base = reg.materialize(1)
        v3 = reg.add_candidate(perturb(base, 0.05, seed=3), parent=1).version
        v4 = reg.add_candidate(perturb(base, 0.05, seed=4), parent=1).version
        ro = reg.begin_rollout(
            v3,
            stable_version=1,
            share=0.2,
            nodes=["node-1"],
            unit="user",
            deadline_at=time.time() + 600,
            settings={},
            actor="gate",
            reason="checks passed",
        )
    finally:
        reg.close()
    capsys.readouterr()
    assert cmd_rollout(cfg, "pause", reason="x", token=None) == 1
    assert "needs an operator token" in capsys.readouterr().err
    assert cmd_rollout(cfg, "pause", reason="x", token=vic) == 1
    assert "vic is a viewer" in capsys.readouterr().err

    def state():
        reg = open_registry(cfg)
        try:
            last = reg.audit()[-1]
            return reg.rollout(ro.id).state, reg.get(v3).status, (last.actor, last.action, last.version, last.reason)
        finally:
            reg.close()

    assert cmd_rollout(cfg, "pause", reason="reverts look high", token=alice) == 0
    assert "paused" in capsys.readouterr().out
    assert state() == ("paused", "canary", ("alice", "canary_pause", v3, "reverts look high"))
    assert rds.get(keys.rollout(cfg.topics.prefix)) is None  # the Redis plan is not where a pause lives
    assert cmd_rollout(cfg, "pause", reason="again", token=alice) == 1
    assert "already paused" in capsys.readouterr().err
    assert cmd_rollout(cfg, "resume", reason="they were fine", token=alice) == 0
    assert state() == ("running", "canary", ("alice", "canary_resume", v3, "they were fine"))
    assert cmd_rollout(cfg, "abort", reason="acceptance fell", token=alice) == 0
    assert "aborted" in capsys.readouterr().out
    st, status, (actor, action, version, why) = state()
    assert (st, status, actor, action, version) == ("aborted", "rejected", "alice", "canary_abort", v3)
    assert "acceptance fell" in why
    assert cmd_rollout(cfg, "abort", reason="again", token=alice) == 1
    assert "no canary is in progress" in capsys.readouterr().err

    reg = open_registry(cfg)
    try:
        ro4 = reg.begin_rollout(
            v4,
            stable_version=1,
            share=0.2,
            nodes=["node-1"],
            unit="request",
            deadline_at=time.time() + 600,
            settings={},
            actor="gate",
            reason="checks passed",
        )
    finally:
        reg.close()
    assert cmd_rollout(cfg, "promote", reason="clearly better", token=alice) == 0  # `promote --full`
    assert desired(rds, cfg) == v4
    reg = open_registry(cfg)
    try:
        assert reg.rollout(ro4.id).state == "ended" and reg.stable().version == v4
        assert (reg.audit()[-1].actor, reg.audit()[-1].action) == ("alice", "promote")
    finally:
        reg.close()
    capsys.readouterr()
    assert cmd_history(cfg, verify=True) == 0 and "audit log intact" in capsys.readouterr().out


def test_operator_management_needs_an_admin(cfg, fleet, capsys):
    from liverl.ops.admin import cmd_operator

    admin, alice, _vic = _operators(cfg)
    capsys.readouterr()
    assert cmd_operator(cfg, "add", "mallory", "admin", "me", alice) == 1
    assert "needs the admin role" in capsys.readouterr().err
    assert cmd_operator(cfg, "disable", "alice", "operator", "left the team", admin) == 0
    assert cmd_operator(cfg, "list", None, "operator", None, None) == 0
    assert "disabled" in capsys.readouterr().out
    assert cmd_promote(cfg, 0, reason="x", token=alice) == 1
    assert "unknown or disabled" in capsys.readouterr().err


def test_status_without_a_registered_base_says_so(cfg, rds, capsys):
    assert cmd_status(cfg) == 1
    assert "no stable version" in capsys.readouterr().err


def test_diff_lists_changed_tensors_and_the_gate_evidence_side_by_side(cfg, fleet, capsys):
    from liverl.ops.admin import cmd_diff

    v1, v2 = fleet
    assert cmd_diff(cfg, v1.version, v2.version) == 0
    out = capsys.readouterr().out
    assert f"v{v1.version} -> v{v2.version}" in out and "tensors changed" in out
    assert "gate evidence, side by side" in out and "pass 0.612 (vs 0.48)" in out
    assert "rejected (failed collapse on [a]12+34=)" in out and "60.0% of 100" in out
    assert cmd_diff(cfg, 0, 0) == 0 and "0 of" in capsys.readouterr().out  # nothing differs from itself
    assert cmd_diff(cfg, 0, 99) == 1 and "99" in capsys.readouterr().err


def test_a_rollback_signed_on_a_clock_behind_the_gate_s_is_followed_not_refused_as_a_replay(
    cfg, rds, fleet, monkeypatch
):
    """The operator's laptop runs a minute behind the gate's host: its rollback is signed with an older ``ts`` than the
    gate's last announcement, and agents must still follow it. Announcements are ordered by the registry's audit
    sequence they carry; the gate's earlier one, written back, is then the replay."""
    import types

    import deploy.registry.signing as signing
    from core import fleet as fl
    from deploy.gate.gate import Gate
    from deploy.registry.signing import Signer, Verifier, generate_keypair
    from tests.deploy.test_gate import ProbeEval

    admin, _alice, _vic = _operators(cfg)
    private, public = generate_keypair(cfg.state_path / "keys")  # where the CLI and the gate find the pair
    p = cfg.topics.prefix
    reader = fl.AnnouncementReader(p, Verifier(public))
    reg = open_registry(cfg)
    try:
        Gate(cfg, reg, rds, ProbeEval(), signer=Signer(private)).reconcile(reg.stable())
    finally:
        reg.close()
    gates = rds.get(f"{p}:desired")
    assert reader.accept("desired", gates).version == 1
    behind = time.time() - 60.0
    monkeypatch.setattr(signing, "time", types.SimpleNamespace(time=lambda: behind))
    assert cmd_rollback(cfg, reason="acceptance dropped", token=admin) == 0
    rolled = reader.accept("desired", rds.get(f"{p}:desired"))
    assert rolled.version == 0 and rolled.ts < VersionAnnouncement.from_bytes(gates).ts
    with pytest.raises(fl.AnnouncementRefused, match="replayed"):
        reader.accept("desired", gates)


def test_abort_withdraws_the_canary_announcement_without_the_gate(cfg, rds, fleet, capsys):
    """`liverl abort` deletes ``<p>:canary`` itself: with the gate down, the canary nodes return to stable at their
    next poll instead of serving the aborted version until its announcement expires."""
    from deploy.registry.signing import announce
    from liverl.ops.admin import cmd_rollout
    from tests.serving.routing import front_door

    _admin, alice, _vic = _operators(cfg)
    _, signer = front_door(cfg, {"node-0": "http://127.0.0.1:1", "node-1": "http://127.0.0.1:2"})
    reg = open_registry(cfg)
    try:
        v3 = reg.add_candidate(perturb(reg.materialize(1), 0.05, seed=3), parent=1)
        ro = reg.begin_rollout(
            v3.version,
            stable_version=1,
            share=0.2,
            nodes=["node-1"],
            unit="user",
            deadline_at=time.time() + 600,
            settings={},
            actor="gate",
            reason="checks passed",
        )
    finally:
        reg.close()
    from deploy.gate.canary import CanaryController

    announce(
        rds,
        cfg.topics.prefix,
        v3.version,
        v3.checksum,
        "canary",
        signer,
        channel="canary",
        rollout=CanaryController.terms(ro),
    )
    assert cmd_rollout(cfg, "abort", reason="acceptance fell", token=alice) == 0
    assert "announcement withdrawn" in capsys.readouterr().out
    assert rds.get(keys.canary(cfg.topics.prefix)) is None


def test_status_shows_a_live_counter_key_of_another_type_as_no_counts(cfg, rds, fleet, capsys):
    rds.delete(keys.live(cfg.topics.prefix, 1))
    rds.set(keys.live(cfg.topics.prefix, 1), "x")
    assert cmd_status(cfg) == 0
    assert "stable: v1" in capsys.readouterr().out
