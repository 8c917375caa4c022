"""Signed announcements: the gate signs, agents verify; Redis write access alone cannot choose what is served.

A signature binds the announcement's channel, its deployment (prefix), its expiry and a canary's terms; the one reader
(``core.fleet``) refuses one read from another channel, another deployment's, an expired one and a replay.
"""

from __future__ import annotations

import time

import pytest

from core import fleet
from core.schemas import RolloutTerms, VersionAnnouncement
from deploy.gate.gate import Gate
from deploy.registry.registry import open_registry
from deploy.registry.signing import (
    SignatureError,
    Signer,
    Verifier,
    announce,
    generate_keypair,
    keep_announced,
    needs_refresh,
)
from tests.deploy.test_gate import ProbeEval, weights


@pytest.fixture
def keys(tmp_path):
    return generate_keypair(tmp_path / "keys")


def bound(cfg, **fields) -> VersionAnnouncement:
    """An announcement bound to the test's deployment, valid for 10 minutes (unsigned)."""
    now = time.time()
    return VersionAnnouncement(
        **{
            "version": 3,
            "checksum": "ab" * 32,
            "prefix": cfg.topics.prefix,
            "ts": now,
            "expires_at": now + 600,
            **fields,
        }
    )


def terms(*nodes: str, rollout_id: int = 7) -> RolloutTerms:
    return RolloutTerms(rollout_id=rollout_id, share=0.2, nodes=list(nodes), unit="user")


def test_sign_and_verify(keys, tmp_path):
    private, public = keys
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    ann = Signer(private).sign(VersionAnnouncement(version=3, checksum="ab" * 32, reason="gate passed"))
    Verifier(public).verify(ann)
    with pytest.raises(SignatureError, match="not signed"):
        Verifier(public).verify(ann.model_copy(update={"signature": None}))
    with pytest.raises(SignatureError, match="does not verify"):  # the version changed after signing
        Verifier(public).verify(ann.model_copy(update={"version": 4}))
    _, other = generate_keypair(tmp_path / "other")
    with pytest.raises(SignatureError, match="does not verify"):
        Verifier(other).verify(ann)
    with pytest.raises(SignatureError):
        Verifier(public).verify(ann.model_copy(update={"signature": "!!not base64!!"}))
    Signer(private).verifier().verify(ann)  # the gate checks Redis against its own key


def test_the_signature_covers_channel_prefix_expiry_and_terms(keys):
    private, public = keys
    now = time.time()
    ann = Signer(private).sign(
        VersionAnnouncement(
            version=3, checksum="ab" * 32, channel="canary", prefix="p", expires_at=now + 60, rollout=terms("node-b")
        )
    )
    Verifier(public).verify(ann)
    for change in (
        {"channel": "desired", "rollout": None},
        {"prefix": "q"},
        {"expires_at": now + 6000},
        {"rollout": terms("node-a", "node-b")},
        {"rollout": terms("node-b", rollout_id=8)},
        {"rollout": ann.rollout.model_copy(update={"share": 0.9})},
    ):
        with pytest.raises(SignatureError, match="does not verify"):
            Verifier(public).verify(ann.model_copy(update=change))


def test_announce_binds_its_channel_prefix_and_expiry(cfg, rds, keys):
    private, public = keys
    p = cfg.topics.prefix
    before = time.time()
    d = announce(rds, p, 3, "ab" * 32, "gate passed", Signer(private), ttl_s=120)
    c = announce(rds, p, 4, "cd" * 32, "canary of v4", Signer(private), channel="canary", rollout=terms("node-b"))
    assert fleet.check_announcement(rds.get(f"{p}:desired"), "desired", p, Verifier(public)) == d
    assert fleet.check_announcement(rds.get(f"{p}:canary"), "canary", p, Verifier(public)) == c
    assert (d.channel, d.prefix, d.rollout) == (
        "desired",
        p,
        None,
    ) and before + 120 <= d.expires_at <= time.time() + 120
    assert (c.channel, c.rollout.nodes, c.expires_at - c.ts) == ("canary", ["node-b"], 600.0)
    with pytest.raises(ValueError, match="rollout"):  # a canary announcement without terms cannot even be made
        announce(rds, p, 4, "cd" * 32, "canary", Signer(private), channel="canary")


def test_the_reader_refuses_another_channel_another_prefix_an_expired_one_and_a_replay(cfg, keys):
    """Each refusal the agents and the router rely on, on signed (genuine) announcements."""
    private, public = keys
    sign, p = Signer(private).sign, cfg.topics.prefix
    reader = fleet.AnnouncementReader(p, Verifier(public))

    def refused(channel, ann, reason):
        with pytest.raises(fleet.AnnouncementRefused) as e:
            reader.accept(channel, ann.to_bytes())
        assert e.value.reason == reason, e.value
        return str(e.value)

    canary = sign(bound(cfg, channel="canary", rollout=terms("node-b")))
    assert "announced on 'canary'" in refused("desired", canary, "wrong_channel")  # copied into <p>:desired
    refused("canary", sign(bound(cfg)), "wrong_channel")  # a desired one copied into <p>:canary
    refused("desired", sign(bound(cfg, prefix="another-deployment")), "wrong_prefix")
    now = time.time()
    refused("desired", sign(bound(cfg, ts=now - 700, expires_at=now - 100)), "expired")
    refused("desired", sign(VersionAnnouncement(version=3, checksum="ab" * 32)), "unbound")  # an old-style one
    refused("desired", bound(cfg), "unsigned")
    refused("desired", sign(bound(cfg)).model_copy(update={"version": 4}), "bad_signature")
    old, new = sign(bound(cfg, version=3, ts=now - 30)), sign(bound(cfg, version=4, ts=now))
    assert reader.accept("desired", old.to_bytes()) == old
    assert reader.accept("desired", new.to_bytes()) == new
    assert reader.accept("desired", new.to_bytes()) == new  # the same one, read again at the next poll
    assert "before the announcement accepted" in refused("desired", old, "replayed")
    assert reader.accept("canary", canary.to_bytes()) == canary  # the guard is per channel
    assert reader.accept("desired", None) is None  # nothing announced is not a refusal


def test_a_withdrawn_canary_written_back_is_refused_and_a_fresh_signature_is_taken(cfg, keys):
    """A canary announcement read, then withdrawn (its channel read empty: the canary was aborted), then written back
    unchanged by whoever can write Redis, is a replay; the signer's own announcement signed afresh (after Redis lost
    its data) is taken, at the same audit sequence or a later one."""
    private, public = keys
    sign = Signer(private).sign
    reader = fleet.AnnouncementReader(cfg.topics.prefix, Verifier(public))
    now = time.time()
    for seq in (12, None):  # ordered by audit sequence, and by the signer's clock for one without
        canary = sign(bound(cfg, channel="canary", rollout=terms("node-b"), ts=now - 60 + (seq or 0), seq=seq))
        assert reader.accept("canary", canary.to_bytes()) == canary
        assert reader.accept("canary", canary.to_bytes()) == canary  # read again at the next poll
        assert reader.accept("canary", None) is None  # withdrawn
        with pytest.raises(fleet.AnnouncementRefused, match="withdrawn announcement written back") as e:
            reader.accept("canary", canary.to_bytes())
        assert e.value.reason == "replayed"
        again = sign(canary.model_copy(update={"ts": canary.ts + 1, "signature": None}))
        assert reader.accept("canary", again.to_bytes()) == again
        assert reader.accept("canary", again.to_bytes()) == again
        reader = fleet.AnnouncementReader(cfg.topics.prefix, Verifier(public))
    later = sign(bound(cfg, channel="canary", rollout=terms("node-b"), ts=now - 30, seq=13))
    reader.accept("canary", sign(bound(cfg, channel="canary", rollout=terms("node-b"), ts=now, seq=12)).to_bytes())
    reader.accept("canary", None)
    assert reader.accept("canary", later.to_bytes()) == later  # a later decision, whatever the signers' clocks


def test_without_a_verifier_the_bindings_still_hold(cfg):
    """security.allow_unsigned drops the signature check, not the channel, prefix, expiry and replay checks."""
    reader = fleet.AnnouncementReader(cfg.topics.prefix, None)
    assert reader.accept("desired", bound(cfg).to_bytes()).version == 3
    with pytest.raises(fleet.AnnouncementRefused, match="wrong_prefix"):
        reader.accept("desired", bound(cfg, prefix="other").to_bytes())
    with pytest.raises(fleet.AnnouncementRefused, match="wrong_channel"):
        reader.accept("desired", bound(cfg, channel="canary", rollout=terms("n")).to_bytes())


def test_a_node_serves_the_canary_only_when_the_signed_terms_name_it(cfg):
    desired, canary = bound(cfg, version=1), bound(cfg, version=2, channel="canary", rollout=terms("node-b"))
    assert fleet.serving_target("node-b", desired, canary) == canary
    assert fleet.serving_target("node-a", desired, canary) == desired
    assert fleet.serving_target("node-b", desired, None) == desired  # no (valid) canary: desired, the safe default
    assert fleet.serving_target("node-b", None, None) is None


def test_gate_signs_and_re_signs_an_unsigned_announcement(cfg, rds, keys):
    private, public = keys
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        gate = Gate(cfg, registry, rds, ProbeEval(), signer=Signer(private))
        announce(rds, cfg.topics.prefix, 0, registry.get(0).checksum, "written by hand", None)  # unsigned
        gate.step()
        ann = VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))
        Verifier(public).verify(ann)
        row = registry.add_candidate(weights(0.6, 1.0, seed=1), parent=0)
        gate.step()
        ann = VersionAnnouncement.from_bytes(rds.get(f"{cfg.topics.prefix}:desired"))
        assert ann.version == row.version
        Verifier(public).verify(ann)
    finally:
        registry.close()


def test_the_gate_keeps_the_announcement_valid_and_fresh(cfg, rds, keys):
    """reconcile re-announces desired when it is wrong for the agents (a canary copied into it, another deployment's,
    expired) or past half its lifetime, and leaves a fresh one alone."""
    private, public = keys
    sign, p = Signer(private).sign, cfg.topics.prefix
    registry = open_registry(cfg)
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        stable = registry.stable()
        gate = Gate(cfg, registry, rds, ProbeEval(), signer=Signer(private))
        now = time.time()
        for planted in (
            sign(bound(cfg, version=0, checksum=stable.checksum, channel="canary", rollout=terms("n"))),
            sign(bound(cfg, version=0, checksum=stable.checksum, prefix="other")),
            sign(bound(cfg, version=0, checksum=stable.checksum, ts=now - 700, expires_at=now - 100)),
        ):
            rds.set(f"{p}:desired", planted.to_bytes())
            gate.reconcile(stable)
            ann = fleet.check_announcement(rds.get(f"{p}:desired"), "desired", p, Verifier(public))
            assert (ann.version, ann.checksum) == (0, stable.checksum) and "reconciled" in ann.reason
        ttl = cfg.security.announce_ttl_s
        aging = sign(
            bound(
                cfg,
                version=0,
                checksum=stable.checksum,
                reason="promoted",
                ts=now - 0.6 * ttl,
                expires_at=now + 0.4 * ttl,
            )
        )
        assert needs_refresh(aging, now) and not needs_refresh(aging, now - 0.2 * ttl)
        rds.set(f"{p}:desired", aging.to_bytes())
        gate.reconcile(stable)
        fresh = fleet.check_announcement(rds.get(f"{p}:desired"), "desired", p, Verifier(public))
        assert fresh.ts > aging.ts and fresh.expires_at >= now + ttl and fresh.reason == "promoted"  # its reason kept
        raw = rds.get(f"{p}:desired")
        gate.reconcile(stable)
        assert rds.get(f"{p}:desired") == raw  # fresh and right: left alone
    finally:
        registry.close()


def test_keep_announced_keeps_a_canary_and_its_terms(cfg, rds, keys):
    """What the canary calls while a rollout runs: the canary announcement with the rollout's terms stays valid."""
    private, public = keys
    p = cfg.topics.prefix
    args = (rds, p, "canary", 5, "cd" * 32, "canary of v5", Signer(private))
    assert keep_announced(*args, rollout=terms("node-b")) == "was nothing"
    assert keep_announced(*args, rollout=terms("node-b")) is None
    assert keep_announced(*args, rollout=terms("node-a", "node-b")) == "was v5 with other terms"
    ann = fleet.check_announcement(rds.get(f"{p}:canary"), "canary", p, Verifier(public))
    assert ann.rollout.nodes == ["node-a", "node-b"]
    assert (
        keep_announced(*args, rollout=terms("node-a", "node-b"), now=ann.ts + 0.6 * (ann.expires_at - ann.ts))
        == "refreshed"
    )


def test_the_gate_replaces_an_announcement_key_of_another_redis_type(cfg, rds, keys):
    """``<p>:desired`` or ``<p>:canary`` made a hash (``DEL``, then ``HSET``): every reader gets WRONGTYPE, so the gate,
    which owns the key, writes its announcement over it."""
    private, public = keys
    p = cfg.topics.prefix
    for channel, rollout in (("desired", None), ("canary", terms("node-b"))):
        key = fleet.announcement_key(p, channel)
        rds.hset(key, "x", "1")
        got = keep_announced(rds, p, channel, 5, "cd" * 32, "reconciled", Signer(private), rollout=rollout)
        assert got == "was a key of another type"
        ann = fleet.check_announcement(rds.get(key), channel, p, Verifier(public))
        assert (ann.version, ann.rollout) == (5, rollout)
    registry = open_registry(cfg)  # the gate's own step: the same repair, counted
    try:
        registry.init_base(weights(0.5, 1.0), "/nonexistent/model")
        gate = Gate(cfg, registry, rds, ProbeEval(), signer=Signer(private))
        rds.delete(fleet.announcement_key(p, "desired"))
        rds.hset(fleet.announcement_key(p, "desired"), "x", "1")
        gate.reconcile(registry.stable())
        assert fleet.check_announcement(rds.get(f"{p}:desired"), "desired", p, Verifier(public)).version == 0
        assert gate._wrong_type.labels("desired")._value.get() == 1
    finally:
        registry.close()


def test_a_heartbeat_key_of_another_redis_type_is_skipped_not_fatal(cfg, rds):
    """The canary's and ``liverl status``'s view of the routable nodes reads past a heartbeat key that holds a hash."""
    from core import keys as rkeys

    p = cfg.topics.prefix
    beat = rkeys.ServedHeartbeat(version=3, checksum="c" * 64, healthy=True)
    for name in ("node-a", "node-b"):
        rds.set(rkeys.served(p, name), beat.to_json(), ex=60)
    rds.hset(rkeys.served(p, "node-c"), "x", "1")
    allowed = {n: f"http://{n}" for n in ("node-a", "node-b", "node-c")}
    unreadable: list[str] = []
    assert sorted(fleet.read_heartbeats(rds, p, unreadable)) == ["node-a", "node-b"]
    assert unreadable == [rkeys.served(p, "node-c")]
    assert fleet.routable_nodes(rds, p, allowed) == ["node-a", "node-b"]
    rds.hset(fleet.announcement_key(p, "desired"), "x", "1")
    assert fleet.read_desired(rds, p) is None


def test_an_announcement_signed_without_a_sequence_still_verifies_and_is_ordered_by_time(cfg, keys):
    """Announcements signed before ``seq`` existed (no such field in their JSON) verify as they were signed, and a
    reader orders them by ``ts``; one with ``seq`` is ordered by it."""
    import base64
    import json

    from cryptography.hazmat.primitives import serialization

    private, public = keys
    p, now = cfg.topics.prefix, time.time()
    fields = {  # the JSON a signer without the field wrote, in its field order, signed over with signature null
        "schema_version": 1,
        "version": 3,
        "checksum": "ab" * 32,
        "reason": "promoted",
        "ts": now,
        "channel": "desired",
        "prefix": p,
        "expires_at": now + 600,
        "rollout": None,
        "signature": None,
    }
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    fields["signature"] = base64.b64encode(key.sign(json.dumps(fields, separators=(",", ":")).encode())).decode()
    old = json.dumps(fields, separators=(",", ":")).encode()
    reader = fleet.AnnouncementReader(p, Verifier(public))
    assert reader.accept("desired", old).seq is None
    earlier = Signer(private).sign(bound(cfg, ts=now - 1))
    with pytest.raises(fleet.AnnouncementRefused, match="replayed"):
        reader.accept("desired", earlier.to_bytes())
    sequenced = Signer(private).sign(bound(cfg, ts=now - 1, seq=5))
    assert reader.accept("desired", sequenced.to_bytes()).seq == 5
    with pytest.raises(fleet.AnnouncementRefused, match="replayed"):
        reader.accept("desired", Signer(private).sign(bound(cfg, ts=now + 1, seq=4)).to_bytes())
