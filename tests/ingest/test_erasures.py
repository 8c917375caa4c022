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
        from liverl.ops.forget import Runner, user_keys

        reg, r = open_registry(cfg), open_redis(cfg)
        try:
            ran = Runner(cfg, reg, r, user_keys(cfg, reg), "gate").run_unfinished()
            assert [e.state for e in ran] == ["done", "done"]
        finally:
            r.close()
            reg.close()

    asyncio.run(scenario())


T0 = 1_750_000_003.0  # judgement times inside one 10 s bucket, shared by both users


def test_another_users_judgements_count_and_sample_exactly_once_while_a_user_is_erased(registry_cfg, rds):
    """Ingest's real join (Redis for real, the broker a recorder) takes bob's traffic, every event redelivered once,
    while alice's erasure runs on a thread and deletes her fields from the same per-user hashes. Bob's judgements are
    each counted once in his sums and each sampled once; alice's fields are gone; the bucket's aggregate keeps both."""
    import threading
    import time

    from core import keys
    from core.shred import ensure_kek
    from deploy.registry.registry import open_registry
    from ingest.join import Ingest, Source
    from ingest.metrics import IngestMetrics
    from liverl.ops.admin import open_redis
    from liverl.ops.forget import Runner, user_keys
    from tests.ingest.conftest import make_generation
    from tests.ingest.test_fuzz import Broker

    cfg = registry_cfg
    cfg.forget.scan_count = 10  # many small SCAN rounds: the pass over Redis spans bob's batches
    cfg.ingest.heldout_share = 0.0  # every joined sample on <prefix>.samples
    ensure_kek(cfg)
    p, v = cfg.topics.prefix, 7
    alice, bob = fleet.unit_id("alice"), fleet.unit_id("bob")
    for b in range(400):  # other versions' per-user hashes: keys the erasure's SCAN must walk
        rds.hset(keys.units(p, 100 + b % 4, b), mapping={f"{fleet.unit_id(f'u{b}')}|e": 1})
    metrics = IngestMetrics(p, cfg.redis.url)
    loop = asyncio.new_event_loop()
    broker = Broker()
    ing = Ingest(cfg, metrics, {}, broker)

    def batch(events: list[tuple[str, bytes]], now: float) -> None:
        topic = {"g": cfg.topics.generations, "f": cfg.topics.feedback}
        srcs = [(Source(topic[w], 0, i, None, now), value) for i, (w, value) in enumerate(events)]
        loop.run_until_complete(ing.process(srcs, now=now))

    def pair(gid: str, unit: str, kind: str) -> list[tuple[str, bytes]]:
        gen = make_generation(gid, v).model_copy(update={"unit": unit}).to_bytes()
        doc = {"feedback_id": "f" + gid, "generation_id": gid, "kind": kind, "ts": T0}
        if kind == "edit":
            doc["edited_text"] = "43"
        return [("g", gen), ("f", json.dumps(doc).encode())]

    reg = open_registry(cfg)
    try:
        user_keys(cfg, reg).key_for(alice)
        batch([e for i in range(5) for e in pair(f"ga{i}", alice, "accept")], T0)
        before = keys.read_unit_buckets(rds, p, v, [keys.unit_bucket(T0)])[keys.unit_bucket(T0)]
        assert before[alice]["e"] == 5
        r = open_redis(cfg)
        runner = Runner(cfg, reg, r, user_keys(cfg, reg), "gate")
        with reg.db.tx() as s:
            erasures.insert(s.connection(), alice, "product", "erase during load", "api")
        span: dict[str, float] = {}

        def erase() -> None:
            span["start"] = time.monotonic()
            span["done"] = runner.run_unfinished()[0].state
            span["end"] = time.monotonic()

        eraser = threading.Thread(target=erase)
        eraser.start()
        during, n = 0, 0
        kinds = ("accept", "reject", "edit")
        while eraser.is_alive() or n < 20:
            events = [e for i in range(n, n + 10) for e in pair(f"gb{i}", bob, kinds[i % 3])]
            batch(events, T0)
            batch(events, T0 + 1)  # every event delivered again (ingest is at-least-once)
            during += "start" in span and "end" not in span
            n += 10
        eraser.join()
        r.close()
        assert span["done"] == "done" and during >= 1, (span, during)
    finally:
        reg.close()
        loop.run_until_complete(metrics.close())
        loop.close()
    got = keys.read_unit_buckets(rds, p, v, [keys.unit_bucket(T0)])[keys.unit_bucket(T0)]
    assert alice not in got
    assert got[bob]["e"] == n and got[bob]["a"] == len(range(0, n, 3)) and got[bob]["d"] == len(range(2, n, 3))
    assert got["*"]["e"] == n + 5  # the aggregate keeps alice's judgements, without her name
    sampled = [k for k, _ in broker.of(cfg.topics.samples)]
    bobs = [k for k in sampled if k.startswith("gb")]
    assert sorted(bobs) == sorted(f"gb{i}" for i in range(n))  # each of bob's judged generations sampled once
