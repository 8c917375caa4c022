"""The operator verbs print readable tables and keep the registry, the audit log and Redis in step."""

from __future__ import annotations

import json
import time

import pytest

from liverl.admin import cmd_history, cmd_promote, cmd_rollback, cmd_status, cmd_versions, open_registry
from liverl.core.schemas import VersionAnnouncement
from tests.deploy.conftest import perturb, tiny_model


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
    reg.set_status(v2.version, "rejected", actor="gate", reason="failed collapse")
    reg.close()
    rds.hset(f"{p}:live:0", mapping={"accept": 40, "reject": 60, "edit": 0, "events": 100})
    rds.hset(f"{p}:live:1", mapping={"accept": 60, "reject": 40, "edit": 0, "events": 100})
    rds.set(f"{p}:served:node-0", json.dumps({"version": 1, "checksum": v1.checksum, "ts": time.time()}))
    rds.set(f"{p}:desired", VersionAnnouncement(version=1, checksum=v1.checksum, reason="gate").to_bytes())
    return v1, v2


def desired(rds, cfg) -> int:
    return VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired")).version


def test_versions_and_status_tables(cfg, fleet, capsys):
    assert cmd_versions(cfg, limit=20) == 0
    out = capsys.readouterr().out
    for text in ("v2", "rejected (failed collapse)", "stable", "retired", "0.612", "60.0% of 100", "40.0% of 100",
                 "node-0", "snap"):
        assert text in out, text
    assert cmd_status(cfg) == 0
    out = capsys.readouterr().out
    assert "stable: v1" in out and "desired: v1" in out and "node-0" in out and "yes" in out
    assert "pending candidates: none" in out


def test_promote_and_rollback_update_registry_audit_and_redis(cfg, rds, fleet, capsys):
    _v1, v2 = fleet
    assert cmd_promote(cfg, v2.version, reason="try it", actor="alice") == 1
    assert "pass --force" in capsys.readouterr().err
    assert cmd_promote(cfg, 99, reason="x", actor="alice") == 1
    assert "unknown version 99" in capsys.readouterr().err
    assert desired(rds, cfg) == 1

    assert cmd_promote(cfg, v2.version, reason="try it", actor="alice", force=True) == 0
    assert "v2 is now stable" in capsys.readouterr().out
    assert desired(rds, cfg) == 2
    assert cmd_rollback(cfg, reason="acceptance dropped", actor="bob") == 0
    assert desired(rds, cfg) == 1
    assert cmd_rollback(cfg, to=0, reason="back to base", actor="bob") == 0
    assert desired(rds, cfg) == 0
    ann = VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))
    assert "back to base" in ann.reason
    capsys.readouterr()

    assert cmd_history(cfg) == 0
    out = capsys.readouterr().out
    for text in ("alice", "promote", "bob", "rollback", "acceptance dropped", "init"):
        assert text in out, text
    reg = open_registry(cfg)
    try:
        assert {r.version: r.status for r in reg.list()} == {0: "stable", 1: "rolled_back", 2: "rolled_back"}
    finally:
        reg.close()


def test_status_without_a_registered_base_says_so(cfg, rds, capsys):
    assert cmd_status(cfg) == 1
    assert "no stable version" in capsys.readouterr().err
