"""A Redis ACL user per process (``core.roles``), on the machine's real Redis: each process does its work through the
code it runs (ingest's counting script, the gate's signed announcement, the learner's lease, the agent's heartbeat),
and the keys it never writes are refused with NOPERM. Each test makes users of a unique prefix and deletes them."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from types import SimpleNamespace

import pytest
import redis

from core import fleet, keys
from core.config import load_config
from core.roles import Role, acl_users, apply_acl, drop_acl, redis_rules, roles
from core.services import setup_redis

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
NODE_A = Role("node", "node-a")
GATE, INGEST, LEARNER, ROUTER, ADMIN, VIEWER = (
    Role(p) for p in ("gate", "ingest", "learner", "router", "admin", "viewer")
)


def refused(call, *args, **kw) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        call(*args, **kw)


@pytest.fixture
def acl(tmp_path):
    """Every role's user for a fresh prefix, each process's client made from a config with redis.password_file."""
    admin = redis.Redis.from_url(LOCAL_REDIS)
    try:
        admin.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {LOCAL_REDIS} ({e}); scripts/services.sh starts one")
    prefix, role_prefix = f"t{uuid.uuid4().hex[:10]}", f"t{uuid.uuid4().hex[:8]}_"
    passwords = {r: secrets.token_urlsafe(16) for r in roles(["node-a", "node-b"], role_prefix)}
    apply_acl(admin, acl_users(prefix, role_prefix, passwords))
    clients: list[redis.Redis] = []

    def cfg(role: Role):
        pw = tmp_path / role.password_file("redis")
        pw.write_text(passwords[role] + "\n")
        return load_config(
            env={},
            state_dir=str(tmp_path / "state"),
            topics__prefix=prefix,
            redis__url=f"redis://{role.name(role_prefix)}@127.0.0.1:6379/0",
            redis__password_file=str(pw),
        )

    def client(role: Role) -> redis.Redis:
        r = setup_redis(cfg(role))
        clients.append(r)
        return r

    yield SimpleNamespace(p=prefix, client=client, cfg=cfg, admin=admin, role_prefix=role_prefix)
    for r in clients:
        r.close()
    assert set(drop_acl(admin, role_prefix)) == {r.name(role_prefix) for r in passwords}
    for k in admin.scan_iter(f"{prefix}:*"):
        admin.delete(k)
    admin.close()


def test_a_node_writes_its_heartbeat_and_swaps_and_no_announcement_or_counter(acl):
    p, node = acl.p, acl.client(NODE_A)
    assert node.ping()
    beat = keys.ServedHeartbeat(version=3, checksum="c" * 64, url="http://10.0.0.5:8000")
    node.set(keys.served(p, "node-a"), beat.to_json(), ex=30)
    node.rpush(keys.swaps(p), "{}")
    node.ltrim(keys.swaps(p), -keys.LIST_CAP, -1)
    node.rpush(keys.swap_errors(p), "{}")
    acl.admin.set(keys.desired(p), b"announced")
    assert node.get(keys.desired(p)) == b"announced" and node.get(keys.canary(p)) is None
    refused(node.set, keys.desired(p), b"forged")
    refused(node.set, keys.canary(p), b"forged")
    refused(node.delete, keys.desired(p))
    refused(node.set, keys.served(p, "node-b"), beat.to_json())  # another node's heartbeat (the router reads it)
    refused(node.hincrby, keys.units(p, 3, 1), "*|a", 1)
    refused(node.hincrby, keys.live(p, 3), "accept", 1)
    refused(node.set, keys.learner_hold(p), "1")
    refused(node.set, keys.deployment(p), "{}")
    refused(node.set, "elsewhere", "1")
    refused(node.keys, "*")
    assert acl.admin.get(keys.desired(p)) == b"announced"


def test_ingest_counts_the_gate_announces_and_reads_the_evidence(acl, tmp_path):
    from core.schemas import RolloutTerms
    from core.services import redis_url
    from deploy.registry.auditchain import AuditHead
    from deploy.registry.signing import Signer, announce, generate_keypair
    from ingest.metrics import IngestMetrics, Tally

    p = acl.p
    metrics = IngestMetrics(p, redis_url(acl.cfg(INGEST)))

    async def count():
        tally = Tally()
        tally.inc("joined", 2)
        tally.live += [("f1", 3, "accept", 100, "u1"), ("f2", 3, "reject", 100, "u2"), ("f1", 3, "accept", 100, "u1")]
        try:
            await metrics.apply(tally, retry_s=1)
        finally:
            await metrics.close()

    asyncio.run(count())
    ingest = acl.client(INGEST)
    refused(ingest.set, keys.desired(p), b"forged")
    refused(ingest.set, keys.served(p, "node-a"), b"{}")
    refused(ingest.hset, keys.learner(p), "step", "1")

    gate = acl.client(GATE)
    private, _ = generate_keypair(tmp_path / "keys")
    ann = announce(gate, p, 3, "c" * 64, "canary passed", Signer(private), ttl_s=600)
    assert fleet.read_desired(gate, p) == ann
    terms = RolloutTerms(rollout_id=1, share=0.2, nodes=["node-a"], unit="user")
    announce(gate, p, 4, "d" * 64, "canary", Signer(private), channel="canary", rollout=terms, ttl_s=600)
    gate.delete(keys.canary(p))
    assert keys.read_unit_buckets(gate, p, 3, [100])[100]["u1"]["a"] == 1  # the canary's per-user evidence
    assert gate.hgetall(keys.live(p, 3))[b"events"] == b"2"
    acl.admin.set(keys.served(p, "node-a"), keys.ServedHeartbeat(version=3, checksum="c" * 64).to_json())
    assert list(fleet.read_heartbeats(gate, p)) == ["node-a"]
    head = AuditHead(lambda: acl.client(GATE), p)
    assert head.advance(b"k" * 32, 1, "m" * 64) and head.read().seq == 1
    refused(gate.hincrby, keys.live(p, 3), "accept", 1)  # the evidence is ingest's to write
    refused(gate.hset, keys.units(p, 3, 100), "u1|a", 9)
    refused(gate.hdel, keys.live(p, 3), "accept")
    assert gate.hdel(keys.units(p, 3, 100), "u1|a", "u1|e") == 2  # an erasure (liverl.ops.forget): HDEL alone
    refused(gate.set, keys.served(p, "node-a"), b"{}")
    refused(gate.set, keys.learner_hold(p), "1")


def test_the_learner_holds_its_lease_and_the_router_only_reads(acl, tmp_path):
    from deploy.registry.auditchain import AuditHead
    from learner.lease import LearnerLease

    p, learner = acl.p, acl.client(LEARNER)
    lease = LearnerLease(learner, p, tmp_path / "lease.token", ttl_s=5)
    lease.acquire(wait_s=0)
    lease.release()
    learner.hset(keys.learner(p), mapping={"step": "7"})
    assert learner.get(keys.learner_hold(p)) is None
    assert AuditHead(lambda: acl.client(LEARNER), p).advance(b"k" * 32, 1, "m" * 64)
    refused(learner.set, keys.learner_hold(p), "0")  # an operator's hold is not the learner's to lift
    refused(learner.set, keys.desired(p), b"forged")

    router = acl.client(ROUTER)
    acl.admin.set(keys.served(p, "node-a"), keys.ServedHeartbeat(version=3, checksum="c" * 64).to_json())
    assert list(fleet.read_heartbeats(router, p)) == ["node-a"] and router.get(keys.canary(p)) is None
    refused(router.set, keys.served(p, "node-a"), b"{}")
    refused(router.set, keys.canary(p), b"forged")

    admin, viewer = acl.client(ADMIN), acl.client(VIEWER)
    admin.set(keys.learner_hold(p), "1")  # `liverl hold`
    assert viewer.get(keys.learner_hold(p)) == b"1" and viewer.hgetall(keys.learner(p)) == {b"step": b"7"}
    refused(viewer.delete, keys.learner_hold(p))
    refused(admin.set, "elsewhere", "1")
    refused(admin.flushall)
    refused(admin.execute_command, "ACL", "SETUSER", "someone", "on")


def test_a_process_that_may_only_read_the_claim_checks_it_and_a_gate_claims_it(acl, tmp_path):
    from deploy.registry.regdb import RegistryDB
    from liverl.stack.deployment import DeploymentError, check_process

    cfg = acl.cfg(ROUTER)
    cfg.state_dir = str(tmp_path / "state")
    db = RegistryDB(cfg.registry_url)
    with db.engine.begin() as c:
        c.exec_driver_sql("INSERT INTO deployment VALUES ('abc123', '/srv', NULL, 0)")
    db.close()
    router = acl.client(ROUTER)
    assert check_process(cfg, router, "route").id == "abc123"  # unclaimed, and not its to claim: it starts
    assert acl.admin.get(keys.deployment(acl.p)) is None
    assert check_process(cfg, acl.client(GATE), "gate").id == "abc123"  # the gate claims it
    assert check_process(cfg, router, "route").id == "abc123"
    acl.admin.set(keys.deployment(acl.p), '{"id": "other", "state_dir": "/elsewhere", "model": null}')
    with pytest.raises(DeploymentError, match="claimed by deployment other"):
        check_process(cfg, router, "route")


def test_the_rules_hold_no_password_and_escape_the_prefix():
    rules = redis_rules(NODE_A, "a*b", "hunter2-password")
    assert "hunter2-password" not in " ".join(rules) and rules[:2] == ["reset", "on"]
    assert r"~a\*b:served:node-a" in rules and r"%R~a\*b:desired" in rules
    assert not any(r.startswith("~") and r.endswith(":*") for r in rules)  # no wildcard write for a node
    with pytest.raises(ValueError, match="cannot name a role"):
        roles(["node a"])
    with pytest.raises(ValueError, match="role prefix"):
        acl_users("liverl", "Bad-Prefix", {})


def test_a_password_file_replaces_the_urls_password_and_needs_a_url(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("p@ss:word\n")
    cfg = load_config(env={}, redis__url="redis://liverl_gate:old@redis:6379/0", redis__password_file=str(pw))
    from core.services import redis_url

    assert redis_url(cfg) == "redis://liverl_gate:p%40ss%3Aword@redis:6379/0"
    cfg = load_config(env={}, redis__url="redis://redis:6379/0", redis__password_file=str(pw))
    assert redis_url(cfg) == "redis://:p%40ss%3Aword@redis:6379/0"  # no user: Redis's default user's password
    with pytest.raises(ValueError, match="registry.password_file is set but registry.url"):
        _ = load_config(env={}, registry__password_file=str(pw)).registry_url
    with pytest.raises(ValueError, match="cannot read redis.password_file"):
        redis_url(load_config(env={}, redis__url="redis://h:1/0", redis__password_file=str(tmp_path / "none")))
