"""Only the gate and audited operators decide what is served: a registry row written around them is never signed.

Whoever holds the registry database's credentials can set any version's status with one SQL ``UPDATE``. The gate
signs only what the audit log's verified entries vouch for (``deploy.registry.attest``), so such an edit leaves the
announcements on what the gate or an operator last decided, and the gate says so.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from core.schemas import VersionAnnouncement
from deploy.gate.gate import Gate
from deploy.registry.attest import Attestor
from deploy.registry.tables import Rollout
from liverl.stack.supervisor import ensure_keys
from tests.deploy.test_gate import ProbeEval, weights


def desired(rds, cfg) -> VersionAnnouncement:
    return VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))


def keyed_gate(cfg, rds):
    from deploy.registry.registry import open_registry

    ensure_keys(cfg)  # the audit key `liverl up` makes, outside the database
    registry = open_registry(cfg)
    registry.init_base(weights(0.50, 1.0), "/nonexistent/model")
    return Gate(cfg, registry, rds, ProbeEval()), registry


def sql(registry, statement: str, **params) -> None:
    with registry.db.tx() as s:
        s.execute(sa.text(statement), params)


def unattested(gate, channel: str) -> float:
    return gate.metrics.get_sample_value("liverl_gate_unattested_total", {"channel": channel}) or 0.0


def test_a_rejected_version_set_stable_in_the_database_is_never_signed(cfg, rds):
    gate, registry = keyed_gate(cfg, rds)
    try:
        good = registry.add_candidate(weights(0.49, 0.8, seed=1), parent=0)
        assert [v.verdict for v in gate.step()] == ["promoted"]
        bad = registry.add_candidate(weights(0.10, 0.8, seed=2), parent=good.version)  # suite far below: refused
        assert [v.verdict for v in gate.step()] == ["rejected"]
        rds.delete(f"{cfg.topics.prefix}:desired")  # and the announcement lost, so the gate would announce afresh
        sql(registry, "UPDATE versions SET status = 'retired' WHERE version = :v", v=good.version)
        sql(registry, "UPDATE versions SET status = 'stable' WHERE version = :v", v=bad.version)
        assert registry.stable().version == bad.version  # the database now says so
        gate.step()
        assert rds.get(f"{cfg.topics.prefix}:desired") is None  # nothing signed for the edited row
        assert unattested(gate, "desired") >= 1
        # an operator's audited action is vouched for, and signed at the next step
        sql(registry, "UPDATE versions SET status = 'rejected' WHERE version = :v", v=bad.version)
        sql(registry, "UPDATE versions SET status = 'stable' WHERE version = :v", v=good.version)
        gate.step()
        assert desired(rds, cfg).version == good.version
        registry.rollback(actor="alice", reason="back to base for a test", to=0)
        gate.step()
        assert desired(rds, cfg).version == 0
    finally:
        registry.close()


def test_an_audit_entry_forged_without_the_key_makes_the_gate_sign_nothing(cfg, rds):
    gate, registry = keyed_gate(cfg, rds)
    try:
        gate.step()
        assert desired(rds, cfg).version == 0
        bad = registry.add_candidate(weights(0.10, 0.8, seed=2), parent=0)
        sql(registry, "UPDATE versions SET status = 'retired' WHERE version = 0")
        sql(registry, "UPDATE versions SET status = 'stable' WHERE version = :v", v=bad.version)
        with registry.db.tx() as s:  # a promotion entry with a made-up MAC, next in the chain
            seq = s.execute(sa.text("SELECT max(seq) FROM audit_log")).scalar_one() + 1
            s.execute(
                sa.text(
                    "INSERT INTO audit_log (actor, action, version, reason, at, seq, mac) "
                    "VALUES ('gate', 'promote', :v, 'forged', 0, :seq, :mac)"
                ),
                {"v": bad.version, "seq": seq, "mac": "0" * 64},
            )
        rds.delete(f"{cfg.topics.prefix}:desired")
        gate.step()
        assert rds.get(f"{cfg.topics.prefix}:desired") is None and unattested(gate, "desired") >= 1
        assert "MAC does not verify" in Attestor(registry.db).refresh().problem
    finally:
        registry.close()


def test_a_log_stripped_of_its_macs_and_recomputed_vouches_for_nothing(cfg, rds):
    """Someone who writes the database and Redis, without the key, strips every MAC, writes a promotion of a rejected
    version into the plain hash chain, recomputes it and deletes the anchor: a gate holding the key signs nothing."""
    from tests.deploy.test_auditchain import recompute

    gate, registry = keyed_gate(cfg, rds)
    try:
        gate.step()
        bad = registry.add_candidate(weights(0.10, 0.8, seed=2), parent=0)
        assert [v.verdict for v in gate.step()] == ["rejected"]
        sql(registry, "UPDATE versions SET status = 'retired' WHERE version = 0")
        sql(registry, "UPDATE versions SET status = 'stable' WHERE version = :v", v=bad.version)
        with registry.db.tx() as s:
            s.execute(sa.text("UPDATE audit_log SET mac = NULL"))
            s.execute(
                sa.text(
                    "INSERT INTO audit_log (actor, action, version, reason, at, prev_hash, entry_hash, seq) "
                    "VALUES ('gate', 'promote', :v, 'forged', 0, '', '', 0)"
                ),
                {"v": bad.version},
            )
        recompute(registry, forge_key=b"unused")
        rds.delete(f"{cfg.topics.prefix}:audit:head", f"{cfg.topics.prefix}:desired")
        fresh = Gate(cfg, registry, rds, ProbeEval())  # a gate started after the forgery reads the log afresh
        fresh.step()
        assert rds.get(f"{cfg.topics.prefix}:desired") is None and unattested(fresh, "desired") >= 1
        assert "ends without a MAC" in Attestor(registry.db).refresh().problem
    finally:
        registry.close()


def test_a_rollout_row_no_audited_canary_start_made_is_neither_watched_nor_signed(cfg, rds):
    gate, registry = keyed_gate(cfg, rds)
    try:
        gate.step()
        cand = registry.add_candidate(weights(0.49, 0.8, seed=1), parent=0)
        with registry.db.tx() as s:  # what begin_rollout writes, minus its audit entry
            s.add(
                Rollout(
                    version=cand.version,
                    checksum=cand.checksum,
                    stable_version=0,
                    share=0.5,
                    nodes=["node-0"],
                    unit="user",
                    state="running",
                    started_at=time.time(),
                    deadline_at=time.time() + 600,
                    settings={},
                    test_state={},
                    looks=[],
                    revision=1,
                )
            )
            s.execute(sa.text("UPDATE versions SET status = 'canary' WHERE version = :v"), {"v": cand.version})
        [v] = gate.step()
        assert v.verdict == "canary" and "not the canary the audit log vouches for" in v.reason
        assert rds.get(f"{cfg.topics.prefix}:canary") is None and unattested(gate, "canary") == 1
        assert registry.get(cand.version).status == "canary"  # the gate decided nothing on it either
    finally:
        registry.close()
