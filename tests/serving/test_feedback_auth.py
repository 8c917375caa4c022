"""``POST /v1/feedback`` takes the product key: feedback trains the model and decides canaries,
so a caller without the key gets 401 and nothing reaches the feedback topic; with it, 202 and the event is on the
topic. The same through the router, which keeps ``Authorization`` to itself but passes the product key's own header.

The real gateway (its feedback route and Kafka producer on the session's broker), the real Router and Redis; no vLLM:
feedback never touches the node, so the node is a stand-in that only tells the context length."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid

import aiohttp
import pytest
import redis.asyncio as aioredis

from core.credentials import (
    PRODUCT_KEY_HEADER,
    ensure_secrets,
    load_assignment_key,
    load_feedback_keys,
)
from serving.node.gateway import Gateway
from serving.router.router import Router
from tests.conftest import free_port
from tests.ingest.conftest import TopicTail
from tests.serving.routing import beat, front_door, start


class _NoNode:
    """The vLLM node stand-in: the gateway asks it the context length at start, and nothing else here."""

    async def max_model_len(self) -> int:
        return 64


def _event(gid: str) -> dict:
    return {"feedback_id": f"fb-{gid}", "generation_id": gid, "kind": "accept"}


def test_feedback_needs_the_product_key_at_the_gateway_and_through_the_router(cfg, rds):
    gw_port = free_port()
    rcfg, _ = front_door(cfg, {"node-0": f"http://127.0.0.1:{gw_port}"})
    key = load_feedback_keys(rcfg)[0].decode()
    accepted, refused = [], []

    async def main() -> None:
        gw = Gateway(rcfg, _NoNode(), "node-0", cfg.broker.bootstrap)
        await gw.start()
        ardis = aioredis.from_url(cfg.redis.url)
        runners = [await start(gw.app, gw_port)]
        try:
            await beat(ardis, cfg.topics.prefix, "node-0", f"http://127.0.0.1:{gw_port}")
            router = Router(rcfg, ardis, refresh_s=0.1)
            rport = free_port()
            runners.insert(0, await start(router.app, rport))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                for base in (f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{rport}"):
                    for headers, status in [
                        ({}, 401),
                        ({PRODUCT_KEY_HEADER: "x" * 43}, 401),
                        ({PRODUCT_KEY_HEADER: key[:-1]}, 401),
                        ({"Authorization": f"Bearer {key}"}, 401),  # not where the key goes
                        ({PRODUCT_KEY_HEADER: key}, 202),
                    ]:
                        gid = f"gen-{uuid.uuid4().hex}"
                        async with http.post(f"{base}/v1/feedback", json=_event(gid), headers=headers) as r:
                            out = await r.json()
                            assert r.status == status, (base, headers, out)
                        if status == 401:
                            assert PRODUCT_KEY_HEADER in out["error"]["message"], out
                            refused.append(gid)
                        else:
                            assert out["generation_id"] == gid
                            accepted.append(gid)
                async with http.get(f"http://127.0.0.1:{gw_port}/metrics") as r:
                    text = await r.text()
                assert 'liverl_gateway_feedback_total{status="401"} 8.0' in text
                assert 'liverl_gateway_feedback_total{status="202"} 2.0' in text
        finally:
            for r in runners:
                await r.cleanup()
            await gw.close()
            await ardis.aclose()

    asyncio.run(main())
    with TopicTail(cfg.broker.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        tail.wait_for(tail.keys(set(accepted)), n=len(accepted))
        assert not tail.matching(tail.keys(set(refused)))


def test_a_gateway_with_no_product_key_refuses_feedback_over_http(cfg):
    async def main() -> None:
        gw = Gateway(cfg, _NoNode(), "node-0", cfg.broker.bootstrap)  # no key configured, none made
        port = free_port()
        runner = await start(gw.app, port)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/feedback",
                    json=_event("g1"),
                    headers={PRODUCT_KEY_HEADER: "anything-at-all-long-enough"},
                ) as r:
                    assert r.status == 403
                    assert "security.feedback_key" in (await r.json())["error"]["message"]
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_product_keys_one_a_line_and_the_files_liverl_up_makes(cfg, tmp_path):
    ensure_secrets(cfg)
    for name in ("assignment.key", "feedback.key"):
        path = cfg.state_path / "keys" / name
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    before = (load_assignment_key(cfg), load_feedback_keys(cfg))
    ensure_secrets(cfg)  # made once: a restart keeps them
    assert (load_assignment_key(cfg), load_feedback_keys(cfg)) == before
    assert len(before[0]) >= 32 and len(before[1]) == 1 and before[0] != before[1][0]

    keys = tmp_path / "product.keys"
    keys.write_text("old-key-0123456789abcdef\n\nnew-key-0123456789abcdef\n")  # a rotation: both valid
    rotated = cfg.model_copy(deep=True)
    rotated.security.feedback_key = str(keys)
    assert load_feedback_keys(rotated) == [b"old-key-0123456789abcdef", b"new-key-0123456789abcdef"]
    keys.write_text("short\n")
    with pytest.raises(ValueError, match="shorter than 16"):
        Gateway(rotated, _NoNode(), "node-0", cfg.broker.bootstrap)
    rotated.security.feedback_key = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot read"):
        load_feedback_keys(rotated)
    rotated.security.assignment_key = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot read the assignment key"):
        load_assignment_key(rotated)
