"""The gateway writes each request's user, pseudonymised, into its generation records (``GenerationRecord.unit``):
the real gateway and the real broker, in front of a stand-in for the vLLM node (a few canned lines of its OpenAI
API; the real node is test_openai.py's, a slow test). The unit is ``fleet.unit_id`` of ``fleet.user_key``: the
``X-Liverl-User`` header, else the body's OpenAI ``user``, else ``X-Session-Id``; none without any."""

from __future__ import annotations

import asyncio
import contextlib
import json
import types
import uuid

import aiohttp
from aiohttp import web

from core import fleet
from core.config import load_config
from serving.node.client import NodeClient
from serving.node.gateway import Gateway
from tests.conftest import free_port
from tests.serving.conftest import records

COMPLETION = {
    "id": "c",
    "object": "text_completion",
    "model": "liverl",
    "choices": [
        {
            "index": 0,
            "text": "42",
            "token_ids": [7, 8],
            "prompt_token_ids": [1, 2, 3],
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "finish_reason": "stop",
        }
    ],
}


async def _node(port: int) -> web.AppRunner:
    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "liverl", "max_model_len": 64}]})

    async def completions(_):
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _config(stack, tmp_path):
    """A deployment of this test's own on the session's broker and Redis (its own topic prefix)."""
    return load_config(
        env={},
        state_dir=str(tmp_path),
        broker__bootstrap=stack.bootstrap,
        redis__url=stack.redis_url,
        topics__prefix=f"t{uuid.uuid4().hex[:10]}",
    )


@contextlib.asynccontextmanager
async def _gateway(cfg, stack):
    """The real gateway (serving v3) in front of the stand-in node, on the session's broker: its base URL."""
    node_port, gw_port = free_port(), free_port()
    node = await _node(node_port)
    client = NodeClient(f"http://127.0.0.1:{node_port}")
    await client.start()
    gw = Gateway(cfg, client, "node-t", stack.bootstrap)
    await gw.start()
    gw.set_served(3, "c" * 64)
    runner = web.AppRunner(gw.app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", gw_port).start()
    try:
        yield f"http://127.0.0.1:{gw_port}"
    finally:
        await runner.cleanup()
        await gw.close()
        await client.close()
        await node.cleanup()


def test_each_record_carries_its_requests_user_pseudonymised(stack, tmp_path):
    cfg = _config(stack, tmp_path)
    asks = [
        ({"X-Liverl-User": "alice"}, {"user": "mallory"}, "alice"),  # the header first
        ({}, {"user": "bob"}, "bob"),
        ({"X-Session-Id": "s-1"}, {}, "s-1"),
        ({}, {}, None),
    ]

    async def run() -> list[str]:
        ids = []
        async with _gateway(cfg, stack) as base:
            async with aiohttp.ClientSession() as http:
                for headers, extra, _ in asks:
                    body = {"prompt": "[a]40+2=", "max_tokens": 4, **extra}
                    async with http.post(
                        f"{base}/v1/completions",
                        data=json.dumps(body),
                        headers={"Content-Type": "application/json", **headers},
                    ) as r:
                        assert r.status == 200, await r.text()
                        ids.append(r.headers["X-Liverl-Generation-Id"])
        return ids

    ids = asyncio.run(run())
    got = records(types.SimpleNamespace(cfg=cfg, bootstrap=stack.bootstrap), set(ids))
    assert [got[g].unit for g in ids] == [fleet.unit_id(who) for _, _, who in asks]
    assert [got[g].unit for g in ids][:3] == [fleet.unit_id("alice"), fleet.unit_id("bob"), fleet.unit_id("s-1")]
    assert len(got[ids[0]].unit) == 16 and got[ids[3]].unit is None and "alice" not in got[ids[0]].to_bytes().decode()


def test_a_users_generation_comes_with_an_edit_key_kept_only_in_its_sealed_record(stack, tmp_path):
    """With the deployment's key-encryption key, each choice for a named user gets an edit key (header and body); the
    sealed record holds it and nothing else in the clear does. An edit posted with it to ``POST /v1/feedback`` reaches
    the feedback topic sealed under it (the text nowhere in the record); a request without a user gets no key; a bad
    key is refused 400."""
    from core.credentials import PRODUCT_KEY_HEADER, load_feedback_keys, write_secret
    from core.schemas import FeedbackEvent
    from core.shred import EDIT_KEY, UserKeys, load_kek, open_sealed
    from deploy.registry.regdb import RegistryDB
    from liverl_sdk.edits import EDIT_KEY_HEADER, open_edit
    from tests.ingest.conftest import TopicTail

    cfg = _config(stack, tmp_path)
    write_secret(tmp_path / "keys" / "shred.key")
    write_secret(tmp_path / "keys" / "feedback.key")
    RegistryDB(cfg.registry_url).close()  # the registry's schema: the users' keys table
    product_key = load_feedback_keys(cfg)[0].decode()
    edit = "AARDVARK-EDIT-6620"

    async def run() -> dict:
        out: dict = {}
        async with _gateway(cfg, stack) as base:
            async with aiohttp.ClientSession() as http:
                for who in ("alice", None):
                    body = {"prompt": "[a]40+2=", "max_tokens": 4, **({"user": who} if who else {})}
                    async with http.post(f"{base}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        out[who] = (r.headers["X-Liverl-Generation-Id"], r.headers.get(EDIT_KEY_HEADER), await r.json())
                gid, key, _ = out["alice"]
                posted = {"feedback_id": "fb-1", "generation_id": gid, "kind": "edit", "edited_text": edit}
                headers = {PRODUCT_KEY_HEADER: product_key}
                async with http.post(f"{base}/v1/feedback", json={**posted, "edit_key": key}, headers=headers) as r:
                    assert r.status == 202, await r.text()
                bad = {**posted, "feedback_id": "fb-2", "edit_key": "not-a-key"}
                async with http.post(f"{base}/v1/feedback", json=bad, headers=headers) as r:
                    out["bad"] = (r.status, await r.json())
        return out

    out = asyncio.run(run())
    gid, key, body = out["alice"]
    assert key and body["liverl"]["edit_key"] == key and body["choices"][0]["edit_key"] == key
    none_gid, none_key, none_body = out[None]
    assert none_key is None and "edit_key" not in none_body["liverl"]  # no user: nothing to forget, nothing sealed
    assert out["bad"][0] == 400 and out["bad"][1]["error"]["param"] == "edit_key"
    got = records(types.SimpleNamespace(cfg=cfg, bootstrap=stack.bootstrap), {gid, none_gid})
    assert key.encode() not in got[gid].to_bytes() and got[none_gid].sealed is None
    keys = UserKeys(cfg.registry_url, load_kek(cfg))
    try:
        payload = open_sealed(keys.key_for(got[gid].unit, create=False), got[gid].unit, got[gid].sealed)
    finally:
        keys.close()
    assert payload[EDIT_KEY] == key
    with TopicTail(stack.bootstrap, cfg.topics.feedback, cfg.broker.partitions) as tail:
        (rec,) = tail.wait_for(tail.keys({gid}))
    event = FeedbackEvent.from_bytes(rec.value)
    assert event.edited_text is None and edit.encode() not in rec.value and b"edit_key" not in rec.value
    assert open_edit(key, gid, event.edited_sealed) == edit
