"""The serving agent follows only the gate's verified announcements, against the real Redis and a real (SQLite)
registry; no vLLM (``Agent.desired`` and ``Agent._plan`` are all of the decision, the swap itself is
tests/serving/test_serving.py's)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis

from core.schemas import RolloutTerms, VersionAnnouncement
from deploy.registry.registry import open_registry
from deploy.registry.signing import Signer, announce, generate_keypair
from tests.deploy.conftest import perturb, tiny_model


class _Gateway:  # the agent reads only these two attributes at construction
    node = None
    node_name = "node-a"


@pytest.fixture
def signer(cfg):
    """The pair ``liverl up`` makes: the agent finds the public key in <state_dir>/keys."""
    private, _ = generate_keypair(cfg.state_path / "keys")
    return Signer(private)


def desired_of(cfg, fn):
    """``fn(agent)`` on a fresh agent (an async Redis client of its own) and its result."""
    from serving.agent.agent import Agent

    async def run():
        r = aioredis.Redis.from_url(cfg.redis.url)
        try:
            return await fn(Agent(cfg, _Gateway(), r))
        finally:
            await r.aclose()

    return asyncio.run(run())


def terms(*nodes: str) -> RolloutTerms:
    return RolloutTerms(rollout_id=1, share=0.2, nodes=list(nodes), unit="user")


def test_a_signed_canary_announcement_copied_into_desired_is_refused(cfg, rds, signer):
    """A signed canary announcement copied into <p>:desired does not swap every node to the canary."""
    p = cfg.topics.prefix
    announce(rds, p, 1, "aa" * 32, "stable", signer)
    announce(rds, p, 2, "bb" * 32, "canary of v2", signer, channel="canary", rollout=terms("node-b"))
    rds.set(f"{p}:desired", rds.get(f"{p}:canary"))

    async def read(agent):
        return await agent.desired(), agent

    got, agent = desired_of(cfg, read)
    assert got is None  # node-a is no canary node, and what is in desired was not announced there
    assert dict(agent.refused_by_reason) == {"wrong_channel": 1}


def test_an_announcement_for_another_deployment_or_expired_is_refused(cfg, rds, signer):
    p = cfg.topics.prefix
    announce(rds, "another-deployment", 5, "ee" * 32, "theirs", signer)  # same key pair, another prefix
    rds.set(f"{p}:desired", rds.get("another-deployment:desired"))
    rds.delete("another-deployment:desired")
    now = time.time()
    expired = signer.sign(
        VersionAnnouncement(version=6, checksum="ff" * 32, prefix=p, ts=now - 700, expires_at=now - 100)
    )

    async def read(agent):
        first = await agent.desired()
        await agent.redis.set(f"{p}:desired", expired.to_bytes())
        return first, await agent.desired(), agent

    first, second, agent = desired_of(cfg, read)
    assert first is None and second is None
    assert dict(agent.refused_by_reason) == {"wrong_prefix": 1, "expired": 1}


def test_a_replayed_older_announcement_is_refused_after_a_newer_one(cfg, rds, signer):
    p = cfg.topics.prefix
    old = announce(rds, p, 1, "aa" * 32, "promoted v1", signer)
    old_raw = rds.get(f"{p}:desired")
    time.sleep(0.01)  # announcements are ordered by their signed ts

    async def read(agent):
        seen = [(await agent.desired()).version]
        announce(rds, p, 2, "bb" * 32, "promoted v2", signer)
        seen.append((await agent.desired()).version)
        await agent.redis.set(f"{p}:desired", old_raw)  # an attacker writes the old, validly signed one back
        seen.append((await agent.desired()).version)  # refused: the last one verified (kept) stands
        return seen, agent

    seen, agent = desired_of(cfg, read)
    assert seen == [old.version, 2, 2]
    assert dict(agent.refused_by_reason) == {"replayed": 1}


def test_the_canary_serves_only_the_nodes_its_signed_terms_name(cfg, rds, signer):
    """A canary announcement not naming this node is ignored; a forged one naming it leaves the node on desired; the
    unsigned <p>:rollout plan moves nothing."""
    from core import keys

    p = cfg.topics.prefix
    announce(rds, p, 1, "aa" * 32, "stable", signer)
    announce(rds, p, 2, "bb" * 32, "canary of v2", signer, channel="canary", rollout=terms("node-b"))
    plan = {
        "version": 2,
        "checksum": "bb" * 32,
        "stable_version": 1,
        "share": 1.0,
        "nodes": ["node-a", "node-b"],
        "deadline_at": time.time() + 600,
    }
    rds.set(keys.rollout(p), json.dumps(plan))  # forged plan naming every node (main's agent followed it)

    async def read(agent):
        return await agent.desired()

    assert desired_of(cfg, read).version == 1
    canary = announce(rds, p, 2, "bb" * 32, "canary of v2", signer, channel="canary", rollout=terms("node-a", "node-b"))
    got = desired_of(cfg, read)
    assert (got.version, got.channel) == (2, "canary")
    forged = canary.model_copy(update={"signature": None, "ts": time.time()})
    rds.set(f"{p}:canary", forged.to_bytes())
    assert desired_of(cfg, read).version == 1  # refused (unsigned): the node serves desired


def test_the_registry_must_confirm_the_status_the_channel_needs(cfg, signer):
    """The agent accepts registry status 'canary' only on the canary channel, so a canary version announced (even
    validly) as desired is not served fleet-wide."""
    from serving.agent.agent import Agent

    registry = open_registry(cfg)
    try:
        base = registry.init_base(tiny_model(), "/nonexistent/model")
        row = registry.add_candidate(perturb(tiny_model(), 0.05, seed=1), parent=0)
        registry.begin_rollout(
            row.version,
            stable_version=0,
            share=0.2,
            nodes=["node-a"],
            unit="user",
            deadline_at=time.time() + 600,
            settings=None,
            actor="gate",
            reason="test",
        )
        agent = Agent(cfg, _Gateway(), redis=None, registry=registry)
        on_desired = VersionAnnouncement(
            version=row.version, checksum=row.checksum, prefix=cfg.topics.prefix, expires_at=time.time() + 60
        )
        with pytest.raises(RuntimeError, match="is canary in the registry, not stable"):
            agent._plan(base.version, base.checksum, on_desired)
        on_canary = on_desired.model_copy(update={"channel": "canary", "rollout": terms("node-a")})
        blobs, how = agent._plan(base.version, base.checksum, on_canary)
        assert len(blobs) == 1 and how == "stored x1"
        with pytest.raises(RuntimeError, match="is stable in the registry, not canary"):  # desired's, on canary
            agent._plan(
                row.version, row.checksum, on_canary.model_copy(update={"version": 0, "checksum": base.checksum})
            )
    finally:
        registry.close()


def test_serve_refuses_to_start_without_a_verify_key(cfg):
    """The agent refuses to start without a verify key unless ``security.allow_unsigned`` says so: without one it
    would follow any announcement, signed or not."""
    from serving.agent.agent import Agent
    from serving.agent.main import serve

    async def start():
        await serve(cfg, "/nonexistent/model", "127.0.0.1:1", cfg.redis.url, None, asyncio.Event())

    for attempt in (lambda: asyncio.run(start()), lambda: Agent(cfg, _Gateway(), None)):
        with pytest.raises(ValueError) as e:
            attempt()
        assert "security.verify_key" in str(e.value) and "security.allow_unsigned = true" in str(e.value)
    cfg.security.allow_unsigned = True  # unsafe, and said so in the log
    assert Agent(cfg, _Gateway(), None).verifier is None
    cfg.security.verify_key = str(cfg.state_path / "nowhere.pub")
    with pytest.raises(ValueError, match="not a file"):  # a configured key that is not there is never "unsigned"
        Agent(cfg, _Gateway(), None)
    cfg.security.verify_key = None
    generate_keypair(cfg.state_path / "keys")
    assert Agent(cfg, _Gateway(), None).verifier is not None  # a key present is used, allow_unsigned or not


def test_the_gate_refuses_to_announce_unsigned_unless_allowed(cfg):
    from core.services import required_signing_key

    with pytest.raises(ValueError, match="security.signing_key.*security.allow_unsigned = true"):
        required_signing_key(cfg)
    cfg.security.allow_unsigned = True
    assert required_signing_key(cfg) is None
    private, _ = generate_keypair(cfg.state_path / "keys")
    assert required_signing_key(cfg) == private
