"""Signed announcements: the gate signs, agents verify; Redis write access alone cannot choose what is served."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from deploy.gate import Gate
from deploy.registry import open_registry
from deploy.signing import SignatureError, Signer, Verifier, announce, generate_keypair
from liverl.core.schemas import VersionAnnouncement
from tests.deploy.test_gate import ProbeEval, weights


@pytest.fixture
def keys(tmp_path):
    return generate_keypair(tmp_path / "keys")


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


def test_agent_refuses_unsigned_and_forged_announcements(cfg, keys, tmp_path):
    """The agent's reading of ``<prefix>:desired``, against the real Redis; no vLLM needed for this part."""
    from serving.agent import Agent

    private, public = keys
    cfg.security.verify_key = str(public)

    class _Gateway:  # the agent reads only these two attributes at construction
        node = None
        node_name = "node-t"

    async def run():
        r = aioredis.Redis.from_url(cfg.redis.url)
        try:
            agent = Agent(cfg, _Gateway(), r)
            key = f"{cfg.topics.prefix}:desired"
            good = Signer(private).sign(VersionAnnouncement(version=2, checksum="cd" * 32))
            await r.set(key, good.to_bytes())
            assert (await agent.desired()).version == 2
            await r.set(key, VersionAnnouncement(version=13, checksum="ef" * 32).to_bytes())  # unsigned
            assert await agent.desired() is None
            forged = good.model_copy(update={"version": 13})
            await r.set(key, forged.to_bytes())
            assert await agent.desired() is None
            await r.set(key, b"\xff garbage")
            assert await agent.desired() is None
            assert agent.refused_announcements == 3
            await r.delete(key)
        finally:
            await r.aclose()

    asyncio.run(run())
