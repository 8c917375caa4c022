"""An acknowledged record survives a kill -9 of the embedded broker in the middle of its write.

Found by ``pytest -m chaos``: one run counted 5,673 feedback records acknowledged and 5,672 in the topic. The cause,
reproduced here: Tansu's object-store engine writes an idempotent producer's new sequence number (``meta.json``) and
the partition's watermark *before* the record batch. Killed between the two, it restarts with the sequence counted and
the batch missing. The producer, which outlived the broker, retries the same batch with the same sequence; Tansu
answers DUPLICATE_SEQUENCE_NUMBER, which Kafka clients take as "already written" (kafka-python's sender says so), so
the record is acknowledged and lost.

The window between the two writes is a few milliseconds, so the test widens it on purpose: the broker's storage is
reached through a proxy (here, in the test) that forwards every request to the real ``liverl.stack.objstore`` but holds
the chosen record batch's PUT. The test kills the broker while that PUT is held, starts it again on the same storage,
and asks: is every record the producer saw acknowledged in the topic?
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from core import procs
from core.bus import ensure_topics, make_consumer
from core.config import BrokerConfig
from liverl.stack.stack import broker_env, folder_storage_url, start_broker, start_object_store
from tests.conftest import free_port

STORAGE_URL = folder_storage_url(delay_ms=BrokerConfig().embedded_batch_delay_ms)
"""The embedded broker as `liverl up` runs it: on the object store, its produce batcher as configured."""


class HoldingProxy:
    """Forwards S3 requests to the object store; while ``hold`` is set, a PUT of a record batch never completes."""

    def __init__(self, upstream: int):
        self.upstream = f"http://127.0.0.1:{upstream}"
        self.port = free_port()
        self.hold = threading.Event()
        self.held = threading.Event()  # a batch PUT arrived while holding
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "PUT" and request.path.endswith(".batch") and self.hold.is_set():
            self.held.set()
            while self.hold.is_set():  # the broker is killed meanwhile
                await asyncio.sleep(0.05)
            return web.Response(status=503, text="released after the broker was killed")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as resp:
            data = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}
            return web.Response(status=resp.status, body=data, headers=out)

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _values(bootstrap: str, topic: str, want: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every record of ``topic`` (read until ``want`` came, or 5 quiet seconds after the deadline's half)."""
    c = make_consumer(bootstrap, f"check-{time.monotonic_ns()}", [topic])
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and len(got) < want:
            for msgs in c.poll(timeout_ms=500).values():
                got += [m.value for m in msgs]
    finally:
        c.close()
    return got


class Librdkafka:
    """The gateway's producer settings (``serving.node.producer.AsyncProducer``), driven synchronously."""

    def __init__(self, bootstrap: str):
        from confluent_kafka import Producer

        from serving.node.producer import AsyncProducer

        settings = AsyncProducer(bootstrap, "crash-test", delivery_timeout_s=60.0).settings
        self._p = Producer(settings)

    def send(self, topic: str, key: str, value: bytes):
        from concurrent.futures import Future

        fut: Future = Future()

        def report(err, _msg):
            fut.set_exception(RuntimeError(str(err))) if err is not None else fut.set_result(True)

        self._p.produce(topic, key=key, value=value, on_delivery=report)
        threading.Thread(target=self._p.flush, args=(60,), daemon=True).start()  # serves the delivery reports
        return type("Pending", (), {"get": lambda _self, timeout: fut.result(timeout)})()

    def close(self) -> None:
        self._p.flush(10)


@pytest.mark.parametrize("client", ["sdk", "gateway"])
def test_a_record_acknowledged_across_a_broker_kill_mid_write_is_in_the_topic(tmp_path, client):
    """``sdk``: the feedback SDK's kafka-python producer (every kafka-python producer liverl builds); ``gateway``:
    the gateway's librdkafka producer, with its settings."""
    from liverl_sdk import FeedbackClient

    logs = tmp_path / "logs"
    storage, storage_port = start_object_store(tmp_path / "broker", logs)
    proxy = HoldingProxy(storage_port)
    port = free_port()
    running: list[tuple[str, object]] = [("broker storage", storage)]
    broker = start_broker(port, logs, STORAGE_URL, broker_env(proxy.port))
    running.append(("broker", broker))
    bootstrap = f"127.0.0.1:{port}"
    topic = "crash.feedback"
    acked: list[bytes] = []
    try:
        ensure_topics(bootstrap, [topic], 1)
        client = FeedbackClient(bootstrap, topic) if client == "sdk" else Librdkafka(bootstrap)
        producer = client._producer if isinstance(client, FeedbackClient) else client
        producer.send(topic, key="g0", value=b"before").get(30)
        acked.append(b"before")

        proxy.hold.set()
        future = producer.send(topic, key="g1", value=b"across the kill")
        assert proxy.held.wait(30), "the record batch never reached the broker's storage"
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        proxy.hold.clear()
        broker = start_broker(port, logs, STORAGE_URL, broker_env(proxy.port))
        running[-1] = ("broker", broker)
        try:
            future.get(60)  # the producer retries against the restarted broker
            acked.append(b"across the kill")
        except Exception as e:  # noqa: BLE001 - refused is allowed (the caller is told); acknowledged-and-lost is not
            print(f"the record was refused, and the caller told: {e!r}")
        producer.send(topic, key="g2", value=b"after").get(30)
        acked.append(b"after")

        values = _values(bootstrap, topic, len(acked))
        missing = [v for v in acked if v not in values]
        assert not missing, f"acknowledged by the broker, not in the topic: {missing} (the topic holds {values})"
        assert b"across the kill" in acked, "the retried record was refused: the test proved nothing"
    finally:
        if not isinstance(client, str):
            client.close()
        proxy.close()
        procs.stop(list(reversed(running)), timeout=10)
