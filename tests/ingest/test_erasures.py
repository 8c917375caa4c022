"""The product's erasure requests on ingest's web server: ``POST /v1/erasures`` takes the product key (401 without
it), records the request (202, pending) and ``GET /v1/erasures/ID`` follows it to ``done`` once a runner with the
rights (here the gate's, ``liverl.ops.forget.Runner``) has run it. Through the SDK's ``ErasureClient`` (stdlib HTTP).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from core import erasures, fleet
from core.credentials import PRODUCT_KEY_HEADER, ensure_secrets, load_feedback_keys
from ingest.erasures import ErasureRoutes
from ingest.web import start_web
from liverl_sdk import ErasureClient, ErasureError
from tests.conftest import free_port


def _post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header(PRODUCT_KEY_HEADER, key)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def registry_cfg(cfg):
    from deploy.registry.registry import open_registry
    from tests.deploy.conftest import tiny_model

    ensure_secrets(cfg)  # the product key, as `liverl up` makes it
    reg = open_registry(cfg)  # migrated, as every process that opens it
    reg.init_base(tiny_model(), "m")
    reg.close()
    from learner.ledger import checkpoint_path_for, ledger_path

    led = ledger_path(checkpoint_path_for(cfg))  # a learner that has trained nothing yet
    led.parent.mkdir(parents=True, exist_ok=True)
    led.touch()
    return cfg


def test_erasures_need_the_product_key_and_follow_to_done(registry_cfg, rds):
    cfg = registry_cfg
    key = load_feedback_keys(cfg)[0].decode()
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        routes = ErasureRoutes(cfg)
        runner = await start_web(lambda: b"", lambda: {"ready": True}, "127.0.0.1", port, routes=routes)
        try:
            await asyncio.to_thread(check)
        finally:
            await runner.cleanup()
            routes.close()

    def check() -> None:
        body = {"user": "alice@example.com", "reason": "account deleted"}
        assert _post(f"{base}/v1/erasures", body, None)[0] == 401
        assert _post(f"{base}/v1/erasures", body, "wrong-key-0123456789")[0] == 401
        assert _post(f"{base}/v1/erasures", {"user": "", "reason": "x"}, key)[0] == 400
        assert _post(f"{base}/v1/erasures", {"user": "a", "reason": " "}, key)[0] == 400
        status, out = _post(f"{base}/v1/erasures", body, key)
        assert status == 202 and out["state"] == "pending" and erasures.valid_id(out["id"])
        with pytest.raises(ErasureError) as e:
            ErasureClient(base, "wrong-key-0123456789").status(out["id"])
        assert e.value.status == 401
        sdk = ErasureClient(base, key)
        assert sdk.status(out["id"])["state"] == "pending"
        with pytest.raises(ErasureError) as e:
            sdk.status("er-0000000000000000")
        assert e.value.status == 404
        eid = sdk.forget("bob@example.com", "asked by the user")
        got = sdk.status(eid)
        assert got["unit"] == fleet.unit_id("bob@example.com") and got["source"] == "api"
        assert got["requested_by"] == "product" and "bob@example.com" not in json.dumps(got)
        run_as_gate()
        for i in (out["id"], eid):
            done = sdk.wait(i, timeout_s=10)
            assert done["state"] == "done" and done["report"]["offer"]["policy"] == "report"

    def run_as_gate() -> None:
        from deploy.registry.registry import open_registry
        from liverl.ops.admin import open_redis
        from liverl.ops.forget import Runner
        from liverl.ops.forget_cmd import user_keys

        reg, r = open_registry(cfg), open_redis(cfg)
        try:
            ran = Runner(cfg, reg, r, user_keys(cfg, reg), "gate").run_unfinished()
            assert [e.state for e in ran] == ["done", "done"]
        finally:
            r.close()
            reg.close()

    asyncio.run(scenario())
