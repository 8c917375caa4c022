"""The audit log's keyed chain (HMAC with a key the database never holds) and its head anchored in Redis: what
``Registry.verify_audit`` detects and what it cannot, on SQLite and PostgreSQL with the real Redis."""

from __future__ import annotations

import os
import stat

import pytest
import redis
import sqlalchemy as sa

from deploy.registry.auditchain import AuditHead, audit_head_key, audit_mac, ensure_audit_key, load_audit_key
from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.registry import Registry, RegistryError
from deploy.registry.tables import AuditEntry, audit_hash
from tests.deploy.conftest import perturb, tiny_model

KEY = b"0123456789abcdef0123456789abcdef-audit"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'registry.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture
def head(cfg, rds):
    """The audit head anchor in the test's Redis namespace (cleaned up by ``rds``)."""
    h = AuditHead(lambda: redis.Redis.from_url(cfg.redis.url), cfg.topics.prefix)
    yield h
    h.close()


@pytest.fixture
def open_reg(db_url, tmp_path, head):
    """Opens registries on the test's database: keyed with KEY and anchored by default."""
    opened = []

    def make(key: bytes | None = KEY, anchor: AuditHead | None | str = "default") -> Registry:
        reg = Registry(
            db_url,
            LocalBlobStore(tmp_path / "blobs"),
            snapshot_every=3,
            audit_key=key,
            audit_head=(head if key is not None else None) if anchor == "default" else anchor,
        )
        opened.append(reg)
        return reg

    yield make
    for reg in opened:
        reg.close()


def history(reg: Registry, n: int = 3) -> None:
    """Base, n candidates, a promotion, a rejection, an operator note: a log of n + 4 entries."""
    base = tiny_model()
    reg.init_base(base, "/m")
    for i in range(n):
        reg.add_candidate(perturb(base, 0.05, seed=i + 1), parent=0)
    reg.promote(1, actor="gate", reason="passed")
    reg.set_status(2, "rejected", actor="gate", reason="failed drift")
    reg.log_action("alice", "hold", "looking at the reverts")


def entries(reg: Registry) -> list[AuditEntry]:
    with reg.engine.connect() as c:
        return list(c.execute(sa.select(AuditEntry).order_by(AuditEntry.id)).all())


def recompute(reg: Registry, forge_key: bytes) -> None:
    """What a database writer without the audit key can do: recompute every link after an edit, the plain hashes
    exactly and the MACs with a key of their own."""
    prev, link = "", ""
    with reg.engine.begin() as c:
        for pos, e in enumerate(c.execute(sa.select(AuditEntry).order_by(AuditEntry.id)).all(), 1):
            h = audit_hash(prev, e.actor, e.action, e.version, e.reason, e.at)
            mac = (
                None if e.mac is None else audit_mac(forge_key, link, pos, e.actor, e.action, e.version, e.reason, e.at)
            )
            c.execute(
                sa.update(AuditEntry)
                .where(AuditEntry.id == e.id)
                .values(prev_hash=prev, entry_hash=h, mac=mac, seq=pos)
            )
            prev, link = h, mac or h


def test_a_keyed_log_verifies_and_its_head_is_anchored(open_reg, head):
    reg = open_reg()
    history(reg)
    check = reg.verify_audit()
    rows = entries(reg)
    assert check.ok and check.warnings is None, check.problem
    assert (check.entries, check.keyed, check.unkeyed, check.head_seq) == (len(rows), len(rows), 0, len(rows))
    assert [e.seq for e in rows] == list(range(1, len(rows) + 1)) and all(e.mac for e in rows)
    anchored = head.read()
    assert (anchored.seq, anchored.mac) == (rows[-1].seq, rows[-1].mac)
    assert not any(KEY.decode() in str(v) for e in rows for v in e)  # the key is not in the database


def test_an_entry_rewritten_with_the_chain_recomputed_is_detected(open_reg):
    reg = open_reg()
    history(reg)
    target = next(e for e in entries(reg) if e.action == "promote")
    with reg.engine.begin() as c:  # someone with database access rewrites who promoted v1, and covers it up
        c.execute(sa.update(AuditEntry).where(AuditEntry.id == target.id).values(actor="gate-impostor"))
    recompute(reg, forge_key=b"an attacker's own key, not the audit key")
    check = reg.verify_audit()
    assert not check.ok and check.kind == "tampered" and check.bad_id == entries(reg)[0].id  # the first forged MAC
    assert "MAC does not verify" in check.problem


def test_stripped_macs_or_unkeyed_entries_after_keyed_ones_are_detected(open_reg):
    reg = open_reg()
    history(reg)
    last = entries(reg)[-1]
    with reg.engine.begin() as c:  # an entry appended without the key, its plain hash and seq right
        at = last.at + 1
        c.execute(
            sa.insert(AuditEntry).values(
                actor="mallory",
                action="promote",
                version=2,
                reason="x",
                at=at,
                prev_hash=last.entry_hash,
                seq=last.seq + 1,
                entry_hash=audit_hash(last.entry_hash, "mallory", "promote", 2, "x", at),
            )
        )
    check = reg.verify_audit()
    assert check.kind == "tampered" and "has no MAC but follows keyed entries" in check.problem

    with reg.engine.begin() as c:  # strip every MAC and recompute the plain chain: it looks like a legacy log
        c.execute(sa.update(AuditEntry).values(mac=None))
    recompute(reg, forge_key=b"unused")
    check = reg.verify_audit()
    assert check.kind == "tampered" and "MACs were stripped" in check.problem  # the anchor says the log was keyed


def test_a_cut_tail_is_detected_by_the_anchored_head(open_reg, head):
    reg = open_reg()
    history(reg)
    rows = entries(reg)
    with reg.engine.begin() as c:  # the newest two entries (the rejection and the hold) disappear
        c.execute(sa.delete(AuditEntry).where(AuditEntry.id.in_([rows[-1].id, rows[-2].id])))
    check = reg.verify_audit()
    assert not check.ok and check.kind == "truncated"
    assert f"head is entry number {len(rows)}" in check.problem and f"ends at number {len(rows) - 2}" in check.problem

    # cut and then new entries written on top by a keyed writer: the anchored entry is not the one now there
    reg.log_action("bob", "hold", "after the cut")
    reg.log_action("bob", "release", "after the cut")
    check = reg.verify_audit()
    assert check.kind == "truncated" and "not the one anchored" in check.problem


def test_what_the_anchor_cannot_show_a_head_rolled_back_with_the_tail(open_reg, head):
    """The stated limit: someone who can write the database AND Redis, without the key, cuts the tail and puts back
    an older anchor (one they saw earlier). Not detected. Deleting the anchor is reported as unverifiable."""
    reg = open_reg()
    history(reg)
    n = len(entries(reg))
    seen = head.redis.hgetall(head.key)  # the anchor as it was, read by the attacker
    reg.log_action("alice", "release", "two more entries")
    reg.log_action("alice", "hold", "two more entries")
    with reg.engine.begin() as c:
        c.execute(sa.delete(AuditEntry).where(AuditEntry.seq > n))
    assert reg.verify_audit().kind == "truncated"
    head.redis.delete(head.key)
    head.redis.hset(head.key, mapping=seen)
    assert reg.verify_audit().ok  # NOT detected: docs/security.md says so

    head.redis.delete(head.key)
    check = reg.verify_audit()
    assert not check.ok and check.kind == "unverifiable" and "no audit head" in check.problem
    reg.log_action("alice", "release", "the next change")  # re-anchors the head: from here the cut is invisible
    assert reg.verify_audit().ok


def test_macs_stripped_and_the_anchor_deleted_fail_the_check_and_no_write_seals_them(open_reg, head):
    """Someone who writes the database and Redis, without the key, strips every MAC, recomputes the plain chain and
    deletes the anchor: the log then reads like one from before the key. The check does not pass, and the next keyed
    write does not vouch for the forged log: only an admin's explicit seal would."""
    reg = open_reg()
    history(reg)
    with reg.engine.begin() as c:
        c.execute(sa.update(AuditEntry).values(mac=None, actor="mallory"))
    recompute(reg, forge_key=b"unused")
    head.redis.delete(head.key)
    check = reg.verify_audit()
    assert not check.ok and check.kind == "unverifiable" and "no entry has a MAC" in check.problem
    with pytest.raises(RegistryError, match="no keyed entry at its end"):
        reg.log_action("gate", "hold", "an ordinary write after the forgery")
    with pytest.raises(RegistryError, match="no keyed entry at its end"):
        reg.add_candidate(perturb(tiny_model(), 0.05, seed=9), parent=0)
    assert not reg.verify_audit().ok and head.read() is None


def test_an_entry_removed_or_inserted_in_the_middle_is_detected(open_reg):
    reg = open_reg()
    history(reg)
    rows = entries(reg)
    with reg.engine.begin() as c:
        c.execute(sa.delete(AuditEntry).where(AuditEntry.id == rows[3].id))
    check = reg.verify_audit()
    assert check.kind == "tampered" and check.bad_id == rows[4].id and "removed or inserted" in check.problem
    recompute(reg, forge_key=b"not the key")  # numbers and links made consistent again, without the key
    check = reg.verify_audit()
    assert check.kind == "tampered" and "MAC does not verify" in check.problem


def test_an_entry_added_with_a_mac_of_another_key_is_detected(open_reg):
    reg = open_reg()
    history(reg)
    last = entries(reg)[-1]
    at, seq = last.at + 1, last.seq + 1
    forged = audit_mac(b"another key entirely, 32+ bytes long", last.mac, seq, "mallory", "promote", 2, "x", at)
    with reg.engine.begin() as c:
        c.execute(
            sa.insert(AuditEntry).values(
                actor="mallory",
                action="promote",
                version=2,
                reason="x",
                at=at,
                seq=seq,
                mac=forged,
                prev_hash=last.entry_hash,
                entry_hash=audit_hash(last.entry_hash, "mallory", "promote", 2, "x", at),
            )
        )
    check = reg.verify_audit()
    assert check.kind == "tampered" and check.bad_id == entries(reg)[-1].id


def test_a_forged_or_garbage_head_is_not_taken_for_a_cut(open_reg, head):
    reg = open_reg()
    history(reg)
    head.redis.hset(head.key, mapping={"seq": 999, "mac": "ab" * 32, "tag": "cd" * 32})
    check = reg.verify_audit()
    assert check.kind == "tampered" and "forged" in check.problem


def test_a_head_key_of_another_redis_type_reads_as_forged_and_the_next_append_replaces_it(open_reg, head):
    """``SET <p>:audit:head x``: verifying reports a forged head instead of raising WRONGTYPE (which would stop the
    gate's every step), and the next audited change anchors a real head over it."""
    reg = open_reg()
    history(reg)
    head.redis.delete(head.key)
    head.redis.set(head.key, "x")
    check = reg.verify_audit()
    assert check.kind == "tampered" and "forged" in check.problem
    reg.log_action("alice", "hold", "after the head was overwritten")
    check = reg.verify_audit()
    assert check.ok and check.head_seq == len(entries(reg))


def test_the_anchor_only_moves_forward_and_a_lag_is_reported(open_reg, head, cfg):
    reg = open_reg()
    history(reg, n=2)
    n = len(entries(reg))
    assert head.advance(KEY, n - 2, entries(reg)[n - 3].mac) is False  # a slower writer's older head: ignored
    assert head.read().seq == n

    down = AuditHead(lambda: redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5), cfg.topics.prefix)
    cut_off = open_reg(anchor=down)  # Redis unreachable during the append: the entry is committed all the same
    cut_off.log_action("alice", "hold", "redis is down")
    assert cut_off.anchor_failures == 1 and len(entries(reg)) == n + 1
    check = reg.verify_audit()
    assert check.ok and check.head_seq == n and "lags the log by 1" in check.warnings[0]
    reg.log_action("alice", "release", "redis is back")  # the next append anchors the head again
    check = reg.verify_audit()
    assert check.ok and check.head_seq == n + 2 and check.warnings is None
    down.close()


def test_a_legacy_unkeyed_log_is_reported_unkeyed_then_keyed_from_an_admins_seal(open_reg):
    legacy = open_reg(key=None)  # an old registry: no key
    history(legacy, n=2)
    check = legacy.verify_audit()
    assert check.ok and check.keyed == 0 and "not keyed" in check.warnings[0]
    n_legacy = check.entries

    keyed = open_reg()  # the key is configured: no ordinary write extends the unkeyed log, an admin's seal does
    check = keyed.verify_audit()
    assert check.kind == "unverifiable" and "no entry has a MAC" in check.problem
    with pytest.raises(RegistryError, match="no keyed entry at its end"):
        keyed.log_action("alice", "hold", "keyed from now on")
    assert keyed.seal_audit("alice", "the log from before the key, read and kept") == n_legacy
    keyed.log_action("alice", "hold", "keyed from now on")
    check = keyed.verify_audit()
    assert check.ok and (check.unkeyed, check.keyed) == (n_legacy, 2)
    assert entries(keyed)[n_legacy].action == "audit_seal"
    with pytest.raises(RegistryError, match="nothing to seal"):
        keyed.seal_audit("alice", "again")

    with pytest.raises(RegistryError, match="audit log is keyed and this process has no audit key"):
        legacy.log_action("mallory", "hold", "no key")  # a keyed log takes no unkeyed entry
    assert keyed.verify_audit().entries == n_legacy + 2

    first = entries(keyed)[0]  # an unkeyed entry rewritten with the plain chain recomputed: the seal breaks
    with keyed.engine.begin() as c:
        c.execute(sa.update(AuditEntry).where(AuditEntry.id == first.id).values(reason="something else"))
    recompute(keyed, forge_key=b"not the key")
    check = keyed.verify_audit()
    assert check.kind == "tampered" and check.bad_id == entries(keyed)[n_legacy].id  # the seal


def test_verifying_a_keyed_log_needs_the_key(open_reg):
    reg = open_reg()
    history(reg, n=2)
    check = open_reg(key=None).verify_audit()
    assert check.kind == "unverifiable" and "no audit key" in check.problem


def test_liverl_up_makes_an_audit_key_file_0600_and_open_registry_uses_it(cfg, rds):
    from deploy.registry.registry import open_registry
    from liverl.stack.supervisor import ensure_keys

    assert load_audit_key(cfg) is None
    ensure_keys(cfg)
    path = cfg.state_path / "keys" / "audit.key"
    assert path.is_file() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_audit_key(cfg)
    assert len(key) >= 32 and ensure_audit_key(cfg) == path and load_audit_key(cfg) == key  # made once
    reg = open_registry(cfg)
    try:
        reg.init_base(tiny_model(), "/m")
        assert reg.verify_audit().head_seq == 1 and rds.hget(audit_head_key(cfg.topics.prefix), "seq") == "1"
    finally:
        reg.close()
    bad = cfg.model_copy(update={"security": cfg.security.model_copy(update={"audit_key": str(path) + ".missing"})})
    with pytest.raises(ValueError, match="not a file"):
        load_audit_key(bad)
    short = path.with_name("short.key")
    short.write_text("too short")
    with pytest.raises(ValueError, match="at least 32"):
        load_audit_key(cfg.model_copy(update={"security": cfg.security.model_copy(update={"audit_key": str(short)})}))


def test_a_registry_from_before_rollouts_and_keys_opens_and_keeps_its_log(db_url, tmp_path, head):
    """A database at revision 0003 (audit entries chained by hash, no seq or MAC, no rollouts table) is migrated on
    open: its entries are numbered and reported unkeyed, and keyed entries follow them."""
    from deploy.registry.migrations import upgrade
    from deploy.registry.tables import make_engine

    eng = make_engine(db_url)
    upgrade(eng, "0003")
    prev = ""
    with eng.begin() as c:
        for i in range(3):
            h = audit_hash(prev, "alice", "hold", None, f"old {i}", 100.0 + i)
            c.execute(
                sa.text(
                    "INSERT INTO audit_log (actor, action, version, reason, at, prev_hash, entry_hash) "
                    "VALUES ('alice', 'hold', NULL, :r, :at, :p, :h)"
                ),
                {"r": f"old {i}", "at": 100.0 + i, "p": prev, "h": h},
            )
            prev = h
    eng.dispose()
    reg = Registry(db_url, LocalBlobStore(tmp_path / "blobs"), audit_key=KEY, audit_head=head)
    try:
        assert [(e.seq, e.mac) for e in entries(reg)] == [(1, None), (2, None), (3, None)]
        check = reg.verify_audit()
        assert check.kind == "unverifiable" and (check.unkeyed, check.keyed) == (3, 0)  # no anchor yet
        reg.seal_audit("bob", "the log from before the upgrade")
        check = reg.verify_audit()
        assert check.ok and (check.entries, check.unkeyed, check.keyed, check.head_seq) == (4, 3, 1, 4)
        assert reg.active_rollout() is None and reg.rollouts() == []
    finally:
        reg.close()
