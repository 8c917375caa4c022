"""A PostgreSQL role per process (``deploy.registry.roles``), on the machine's real server: each process connects as
its role and does what it does through the real ``Registry`` API, and the writes its code never makes fail with
PostgreSQL's permission error (SQLSTATE 42501), whether a missing grant or a row-level security policy refuses them.
Roles are server-wide: each test names its own (a unique prefix) and drops them afterwards."""

from __future__ import annotations

import re
import secrets
import time
import uuid
from base64 import b64decode
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from core.config import load_config
from core.roles import Role, roles
from core.schemas import VersionAnnouncement
from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.delta import checksum
from deploy.registry.registry import Registry, RegistryError
from deploy.registry.roles import apply_roles, drop_roles, role_sql, role_url, scram_verifier
from tests.deploy.conftest import perturb, tiny_model

NODES = ("node-a", "node-b")
GATE, LEARNER, ADMIN, VIEWER, INGEST = (Role(p) for p in ("gate", "learner", "admin", "viewer", "ingest"))
NODE_A, NODE_B = (Role("node", n) for n in NODES)


def denied(call, *args, **kw) -> None:
    """``call`` fails with PostgreSQL's permission error (a missing privilege or a row-level security policy)."""
    with pytest.raises(sa.exc.ProgrammingError) as err:
        call(*args, **kw)
    assert err.value.orig.sqlstate == "42501", err.value


@pytest.fixture
def db(pg_url, tmp_path):
    """A registry with its base, owned by the test's superuser, and the roles of a unique prefix applied to it."""
    prefix = f"t{uuid.uuid4().hex[:8]}_"
    blobs = LocalBlobStore(tmp_path / "blobs")
    owner = Registry(pg_url, blobs, snapshot_every=3)
    base = tiny_model()
    owner.init_base(base, "/m")
    passwords = {r: secrets.token_urlsafe(16) for r in roles(NODES, prefix)}
    apply_roles(pg_url, prefix, passwords)
    opened: list[Registry] = []
    engines: list[sa.Engine] = []

    def registry(role: Role) -> Registry:
        reg = Registry(role_url(pg_url, role, prefix), blobs, snapshot_every=3)
        opened.append(reg)
        return reg

    def sql(role: Role, statement: str) -> int:
        engine = sa.create_engine(role_url(pg_url, role, prefix))
        engines.append(engine)
        with engine.begin() as c:
            return c.exec_driver_sql(statement).rowcount

    yield SimpleNamespace(owner=owner, registry=registry, sql=sql, base=base, url=pg_url, prefix=prefix)
    for reg in opened:
        reg.close()
    for engine in engines:
        engine.dispose()
    owner.close()
    drop_roles(pg_url, prefix)


def test_a_node_reads_versions_and_writes_only_its_own_fleet_row(db):
    a, b = db.registry(NODE_A), db.registry(NODE_B)
    csum = a.get(0).checksum
    assert checksum(a.materialize(0)) == checksum(db.base)  # the agent's swap planning reads versions and blobs
    a.update_fleet("node-a", 0, csum, at=1.0)  # its first row (INSERT), then its next swap (UPDATE)
    a.update_fleet("node-a", 0, csum, at=2.0)
    b.update_fleet("node-b", 0, csum, at=3.0)
    assert [(f.node, f.updated_at) for f in a.fleet()] == [("node-a", 2.0), ("node-b", 3.0)]
    assert [(s.node, s.first_at) for s in a.served(0)] == [("node-a", 1.0), ("node-b", 3.0)]

    denied(a.update_fleet, "node-b", 0, csum, at=9.0)  # another node's row, through the registry's own path
    denied(a.update_fleet, "node-c", 0, csum)  # a row for a name that is not its own
    denied(db.sql, NODE_A, "UPDATE fleet SET node = 'node-a' WHERE node = 'node-b'")
    denied(db.sql, NODE_A, "INSERT INTO served (version, node, first_at) VALUES (0, 'node-c', 0)")
    denied(db.sql, NODE_A, "DELETE FROM fleet WHERE node = 'node-b'")
    denied(db.sql, NODE_A, "UPDATE versions SET status = 'rejected' WHERE version = 0")
    denied(a.add_candidate, perturb(db.base, 0.05), parent=0)
    denied(db.sql, NODE_A, "INSERT INTO versions SELECT 7, 0, 'candidate' FROM versions WHERE version = 0")
    denied(db.sql, NODE_A, "INSERT INTO audit_log (actor, action, at) VALUES ('node-a', 'promote', 0)")
    denied(db.sql, NODE_A, "SELECT * FROM operators")
    denied(a.add_mismatch, {0: {"own_tokens": 1, "own_abs": 9.0}})  # only the learner measures it
    assert [(f.node, f.updated_at) for f in db.owner.fleet()] == [("node-a", 2.0), ("node-b", 3.0)]
    assert db.owner.get(0).status == "stable"


def test_the_learner_adds_candidates_and_changes_no_status(db):
    learner = db.registry(LEARNER)
    assert learner.init_base(db.base, "/m").version == 0  # its start on a registry with a base: nothing to write
    v = learner.add_candidate(perturb(db.base, 0.05), parent=0, metrics={"loss": 1.0}).version
    assert db.owner.get(v).status == "candidate" and db.owner.audit()[-1].action == "candidate"
    assert learner.stable().version == 0 and learner.last_rollback() == (0, 0.0)

    denied(learner.set_status, v, "rejected", actor="learner")
    denied(learner.promote, v, actor="learner", force=True)
    denied(db.sql, LEARNER, f"UPDATE versions SET status = 'stable' WHERE version = {v}")
    row = "checksum, blob_kind, snapshot_base, chain_depth, raw_bytes, created_at, metrics, sample_offsets"
    copy = f"INSERT INTO versions (version, status, {row}) SELECT 99, '{{}}', {row} FROM versions WHERE version = 0"
    denied(db.sql, LEARNER, copy.format("stable"))  # a stable version, not a candidate: the policy refuses it
    assert db.sql(LEARNER, copy.format("candidate")) == 1  # as a candidate the same row goes in
    denied(db.sql, LEARNER, "INSERT INTO audit_log (actor, action, version, at) VALUES ('gate', 'promote', 99, 0)")
    denied(db.sql, LEARNER, "UPDATE audit_log SET reason = 'x'")
    denied(db.sql, LEARNER, "DELETE FROM audit_log")
    denied(db.sql, LEARNER, "INSERT INTO gate_results (version, \"check\", passed, at) VALUES (99, 'x', true, 0)")
    # its measurements of each version's sampler/trainer mismatch: sums it adds to, nothing else
    assert learner.add_mismatch({0: {"own_tokens": 10, "own_abs": 0.5}}) == [0]
    assert learner.add_mismatch({0: {"own_tokens": 10, "own_abs": 0.3, "replay_tokens": 4, "replay_kl": 0.2}}) == [0]
    assert db.owner.mismatch()[0]["own_abs"] == pytest.approx(0.04) and db.owner.mismatch()[0]["replay_tokens"] == 4
    denied(db.sql, LEARNER, "DELETE FROM mismatch")
    denied(db.sql, LEARNER, "UPDATE mismatch SET version = 99")


def test_the_gate_changes_statuses_and_writes_rollouts_and_gate_results(db):
    learner, gate = db.registry(LEARNER), db.registry(GATE)
    v1, v2 = (learner.add_candidate(perturb(db.base, 0.05, seed=s), parent=0).version for s in (1, 2))
    gate.record_gate(v1, "kl", 0.01, 0.1, True, "fine")
    gate.set_status(v2, "rejected", actor="gate", reason="drift", expect="candidate")
    ro = gate.begin_rollout(
        v1, 0, 0.2, ["node-a"], "user", time.time() + 600, {"nulls": {}}, actor="gate", reason="offline passed"
    )
    gate.save_rollout_evidence(ro.id, ro.revision, {"n": 3}, [{"at": 1.0}], None, None)
    gate.finish_rollout_promote(ro.id, expected_stable=0, actor="gate", reason="canary passed")
    assert gate.stable().version == v1 and db.owner.get(v2).status == "rejected"
    assert [g.check for g in db.owner.gate_results(v1)] == ["kl"]
    assert [a.action for a in db.owner.audit()][-3:] == ["rejected", "canary_start", "promote"]
    assert gate.served() == [] and gate.fleet() == []

    assert gate.mismatch() == {}  # it reads the learner's measurements and writes none
    denied(gate.add_mismatch, {v1: {"own_tokens": 1, "own_abs": 0.0}})
    denied(gate.add_candidate, perturb(db.base, 0.05, seed=3), parent=0)
    denied(db.sql, GATE, f"UPDATE versions SET checksum = 'x' WHERE version = {v1}")  # weights are the learner's
    denied(db.sql, GATE, "UPDATE audit_log SET reason = 'x'")
    denied(db.sql, GATE, "DELETE FROM audit_log")
    denied(db.sql, GATE, "INSERT INTO fleet (node, version, checksum, updated_at) VALUES ('node-a', 1, 'x', 0)")
    denied(db.sql, GATE, "SELECT * FROM operators")


def test_the_admin_role_acts_through_the_registry_api_and_still_cannot_rewrite_the_log(db):
    learner, admin = db.registry(LEARNER), db.registry(ADMIN)
    v1, v2 = (learner.add_candidate(perturb(db.base, 0.05, seed=s), parent=0).version for s in (1, 2))
    token = admin.add_operator("alice", "operator", by="root", reason="on call")
    alice = admin.authenticate(token).name
    admin.promote(v1, actor=alice, reason="looks good")
    admin.rollback(actor=alice, reason="reverts up")
    admin.set_status(v2, "rejected", actor=alice, reason="no")
    admin.log_action(alice, "hold", "looking")
    admin.gc(grace_s=0, prune_rejected_s=0, actor=alice)  # unreferences the rejected leaf's delta (an UPDATE)
    admin.disable_operator("alice", by="root", reason="left")
    assert db.owner.stable().version == 0 and db.owner.get(v2).blob_key is None
    assert db.owner.get(v1).status == "rolled_back" and db.owner.verify_audit().ok

    denied(db.sql, ADMIN, "UPDATE audit_log SET reason = 'x'")
    denied(db.sql, ADMIN, "DELETE FROM audit_log")
    denied(db.sql, ADMIN, "DELETE FROM versions")
    denied(admin.add_candidate, perturb(db.base, 0.05, seed=3), parent=0)


def test_the_viewer_reads_and_ingest_reads_only_the_deployment_row(db):
    viewer = db.registry(VIEWER)
    assert [v.version for v in viewer.list()] == [0] and viewer.audit()[0].action == "init"
    assert viewer.verify_audit().ok
    denied(viewer.log_action, "viewer", "hold", "x")
    denied(db.sql, VIEWER, "SELECT * FROM operators")
    with sa.create_engine(db.url).begin() as c:
        c.exec_driver_sql("INSERT INTO deployment VALUES ('abc123', '/srv', NULL, 0)")
    from liverl.stack.deployment import registry_deployment

    cfg = load_config(env={}, registry__url=role_url(db.url, INGEST, db.prefix))
    assert registry_deployment(cfg).id == "abc123"  # the check every standalone process makes before it starts
    denied(db.sql, INGEST, "SELECT * FROM versions")


def test_roles_apply_again_and_passwords_are_sent_as_postgres_own_scram_verifiers(db):
    passwords = {r: "pw-" + r.key for r in roles(NODES, db.prefix)}
    statements = apply_roles(db.url, db.prefix, passwords)  # again: the same roles, the same grants
    assert not any(pw in st for st in statements for pw in passwords.values())
    assert db.registry(NODE_A).get(0).version == 0
    with sa.create_engine(db.url).begin() as c:
        c.exec_driver_sql("SET password_encryption = 'scram-sha-256'")
        c.exec_driver_sql(f"ALTER ROLE \"{GATE.name(db.prefix)}\" PASSWORD 'pw-gate'")
        query = sa.text("SELECT rolpassword FROM pg_authid WHERE rolname = :n")
        stored = c.execute(query, {"n": GATE.name(db.prefix)}).scalar_one()
    iterations, salt = re.match(r"SCRAM-SHA-256\$(\d+):([^$]+)\$", stored).groups()
    assert scram_verifier("pw-gate", b64decode(salt), int(iterations)) == stored
    with pytest.raises(ValueError, match="printable ASCII"):
        role_sql("db", db.prefix, {GATE: "bad\npassword"})


def test_a_process_takes_its_role_and_password_from_its_config(db, tmp_path, capsys):
    pw = tmp_path / "db-gate.password"
    pw.write_text("s3cret/with:odd@chars\n")
    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        registry__url=role_url(db.url, GATE, db.prefix),
        registry__password_file=str(pw),
        registry__blob_dir=str(tmp_path / "blobs"),
    )
    assert f"{GATE.name(db.prefix)}:s3cret%2Fwith%3Aodd%40chars@" in cfg.registry_url
    from deploy.registry.registry import open_registry

    reg = open_registry(cfg)
    try:
        assert reg.stable().version == 0 and "s3cret" not in reg.url  # messages and logs show no password
        denied(reg.add_candidate, perturb(db.base, 0.05), parent=0)
    finally:
        reg.close()
    from liverl.ops.admin import cmd_versions

    assert cmd_versions(cfg, limit=5) == 0
    out = capsys.readouterr().out
    assert f"{GATE.name(db.prefix)}:***@" in out and "s3cret" not in out


def test_a_role_that_may_not_migrate_says_who_must(db):
    from deploy.registry.migrations import downgrade

    engine = sa.create_engine(db.url)
    try:
        downgrade(engine, "0005")
    finally:
        engine.dispose()
    with pytest.raises(RegistryError, match="may not migrate it.*liverl db roles"):
        db.registry(GATE)


def test_the_gate_learner_and_a_node_run_their_own_code_as_their_roles_and_redis_users(cfg, pg_url, tmp_path):
    """The real gate step (offline checks, promotion, the signed announcement, the audit chain anchored in Redis) as
    the gate's database role and Redis user, fed by the learner's base and candidates as the learner's; a node then
    finds the promoted version and records itself. Only the set-up (migrating, making the roles) and the final audit
    check run as the owner and Redis's default user."""
    from core.roles import acl_users, apply_acl, drop_acl
    from core.services import setup_redis, signing_key_path
    from deploy.gate.gate import Gate
    from deploy.registry.registry import open_registry
    from deploy.registry.signing import Signer
    from liverl.stack.supervisor import ensure_keys
    from tests.deploy.test_gate import ProbeEval, weights

    ensure_keys(cfg)  # the signing pair and the audit key, as `liverl keys` makes them
    cfg.registry.url, cfg.registry.blob_dir = pg_url, str(tmp_path / "blobs")
    prefix = f"t{uuid.uuid4().hex[:8]}_"
    passwords = {r: secrets.token_urlsafe(16) for r in roles(["node-a"], prefix)}
    apply_roles(pg_url, prefix, passwords)
    admin_redis = setup_redis(cfg)
    apply_acl(admin_redis, acl_users(cfg.topics.prefix, prefix, passwords))
    opened = []

    def as_role(role: Role):
        c = cfg.model_copy(deep=True)
        for service, section in (("db", c.registry), ("redis", c.redis)):
            pw = tmp_path / role.password_file(service)
            pw.write_text(passwords[role])
            section.password_file = str(pw)
        c.registry.url = role_url(pg_url, role, prefix)
        c.redis.url = f"redis://{role.name(prefix)}@{cfg.redis.url.split('://', 1)[1]}"
        reg, rds = open_registry(c), setup_redis(c, decode_responses=True)
        opened.append((reg, rds))
        return c, reg, rds

    try:
        _, learner, _ = as_role(LEARNER)
        learner.init_base(weights(0.50, 1.0), "/nonexistent/model")  # an empty registry: its first start registers it
        gate_cfg, gate_reg, gate_rds = as_role(GATE)
        gate = Gate(gate_cfg, gate_reg, gate_rds, ProbeEval(), signer=Signer(signing_key_path(cfg)))
        good = learner.add_candidate(weights(0.49, 0.8, seed=1), parent=0)
        assert [v.verdict for v in gate.step()] == ["promoted"]
        bad = learner.add_candidate(weights(0.10, 0.8, seed=2), parent=good.version)
        assert [v.verdict for v in gate.step()] == ["rejected"]
        announced = VersionAnnouncement.from_bytes(admin_redis.get(f"{cfg.topics.prefix}:desired"))
        assert announced.version == good.version and announced.signature
        _, node, node_rds = as_role(NODE_A)
        assert node.get(announced.version).status == "stable"
        node.update_fleet("node-a", announced.version, announced.checksum)
        node_rds.set(f"{cfg.topics.prefix}:served:node-a", "{}")
        denied(node.update_fleet, "node-b", announced.version, announced.checksum)
        check = open_registry(cfg)
        try:
            assert check.verify_audit().ok and check.get(bad.version).status == "rejected"
        finally:
            check.close()
    finally:
        for reg, rds in opened:
            reg.close()
            rds.close()
        drop_acl(admin_redis, prefix)
        for k in admin_redis.scan_iter(f"{cfg.topics.prefix}:*"):
            admin_redis.delete(k)
        admin_redis.close()
        drop_roles(pg_url, prefix)
