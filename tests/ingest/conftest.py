"""Helpers for the ingest tests: a real faust worker in a subprocess, topic tails, Redis counters.

The worker runs as ``liverl ingest`` (``python -m liverl.cli ingest``: its own process and event loop), configured
through ``LIVERL__*`` environment variables, and is stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import pytest
import redis
from kafka import KafkaConsumer, TopicPartition

from core import keys
from core.bus import all_topics, ensure_topics, make_producer
from core.config import LiverlConfig, load_config
from core.schemas import GenerationRecord, SamplingParams
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
PROBE_VERSION = 999_999  # policy version of the readiness probe's generations


def wait_until(fn: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def make_generation(gid: str, version: int, n_tokens: int = 4, rng: random.Random | None = None) -> GenerationRecord:
    rng = rng or random.Random(gid)
    return GenerationRecord(
        generation_id=gid,
        policy_version=version,
        node="node-test",
        prompt="12+30=",
        completion="42",
        prompt_token_ids=[rng.randrange(100) for _ in range(6)],
        completion_token_ids=[rng.randrange(100) for _ in range(n_tokens)],
        completion_logprobs=[-rng.random() * 3 for _ in range(n_tokens)],
        sampling=SamplingParams(temperature=1.0, max_tokens=8),
        finish_reason="stop",
    )


def new_gid() -> str:
    return f"gen-{uuid.uuid4().hex}"


class TopicTail:
    """Reads a topic from the beginning (all partitions, no consumer group, so no rebalance wait)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int):
        self.consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
        )
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.records: list = []

    def poll(self) -> None:
        for recs in self.consumer.poll(timeout_ms=100).values():
            self.records.extend(recs)

    def matching(self, pred: Callable[[Any], bool]) -> list:
        return [r for r in self.records if pred(r)]

    def wait_for(self, pred: Callable[[Any], bool], n: int = 1, timeout: float = 30.0) -> list:
        def enough():
            self.poll()
            found = self.matching(pred)
            return found if len(found) >= n else None

        return wait_until(enough, timeout, interval=0.0, what=f"{n} matching records")

    def keys(self, keys: set[str]) -> Callable[[Any], bool]:
        return lambda r: r.key is not None and r.key.decode() in keys

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerProc:
    """``liverl ingest`` for one config; ``stop()`` sends SIGTERM and returns the exit code.

    ``launch`` runs it elsewhere (``["ip", "netns", "exec", NS]``: on another host, ``tests.netns``; it must exec the
    worker, so that signals reach it), with its /metrics and /healthz on ``bind`` (``serving.host``)."""

    def __init__(
        self, cfg: LiverlConfig, web_port: int, log_path: Path, launch: list[str] | None = None, bind: str = "127.0.0.1"
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
        env.update(
            {
                "LIVERL__BROKER__BOOTSTRAP": cfg.broker.bootstrap,
                "LIVERL__BROKER__PARTITIONS": str(cfg.broker.partitions),
                "LIVERL__BROKER__REBALANCE_TIMEOUT_S": str(cfg.broker.rebalance_timeout_s),
                "LIVERL__BROKER__DELIVERY_TIMEOUT_S": str(cfg.broker.delivery_timeout_s),  # (below pending_ttl_s)
                "LIVERL__REDIS__URL": cfg.redis.url,
                "LIVERL__TOPICS__PREFIX": cfg.topics.prefix,
                "LIVERL__STATE_DIR": cfg.state_dir,
                "LIVERL__INGEST__PENDING_TTL_S": str(cfg.ingest.pending_ttl_s),
                "LIVERL__INGEST__REWARDS": json.dumps(cfg.ingest.rewards.model_dump()),
                "LIVERL__INGEST__WEB_PORT": str(web_port),
                "LIVERL__SERVING__HOST": bind,
                "LIVERL__INGEST__REDIS_RETRY_S": str(cfg.ingest.redis_retry_s),
                "LIVERL__INGEST__HELDOUT_SHARE": str(cfg.ingest.heldout_share),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.web_port = web_port
        self.bind = bind
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - the worker writes to it until stop()
        self.proc = subprocess.Popen(
            [*(launch or []), sys.executable, "-m", "liverl.cli", "ingest"],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def url(self, path: str) -> str:
        return f"http://{self.bind}:{self.web_port}{path}"

    def get(self, path: str) -> tuple[int, str, str]:
        with urllib.request.urlopen(self.url(path), timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()

    def metric(self, line_prefix: str) -> float | None:
        """Value of the first exposition line starting with ``line_prefix`` (e.g. 'liverl_ingest_pending_feedback ')."""
        _, _, body = self.get("/metrics")
        for line in body.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        return None

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def assert_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"ingest worker exited with {self.proc.returncode}:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                raise AssertionError(
                    f"ingest worker ignored {signal.Signals(sig).name} for {timeout:.0f} s:\n{self.log_tail()}"
                ) from None
        self._log.close()
        return self.proc.returncode


class IngestHarness:
    """One config + its worker + a generation producer + Redis, for a test module or a single test."""

    def __init__(self, cfg: LiverlConfig, log_dir: Path, launch: list[str] | None = None, bind: str = "127.0.0.1"):
        self.cfg = cfg
        self.log_dir = log_dir
        self.launch, self.bind = launch, bind  # where its workers run (WorkerProc)
        ensure_topics(cfg.broker.bootstrap, all_topics(cfg), cfg.broker.partitions)
        self.producer = make_producer(cfg.broker.bootstrap, broker=cfg.broker)
        self.redis = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
        self.worker: WorkerProc | None = None
        self._n = 0

    def start_worker(self, ready_timeout: float = 90.0) -> WorkerProc:
        """Start a worker and return once it has joined one probe generation with its feedback."""
        from core.bus import feedback_client as from_config

        self._n += 1
        self.worker = self.new_worker(f"worker-{self._n}.log")
        gid = new_gid()
        probes = self.live(PROBE_VERSION).get("events", 0)
        self.send_generation(make_generation(gid, version=PROBE_VERSION))
        with from_config(self.cfg) as sdk:
            sdk.accept(gid)
        try:
            with self.tail("samples") as tail:

                def probe():
                    self.worker.assert_alive()
                    tail.poll()
                    return tail.matching(tail.keys({gid}))

                try:
                    wait_until(probe, ready_timeout, interval=0.05, what="the worker's first sample")
                except AssertionError as e:
                    raise AssertionError(f"{e}; probe {gid}; {self.consumer_state()}") from None
            # The counters are written just after the sample is acknowledged: wait for them too, so that
            # a test's "before" snapshot never misses the probe's increments.
            wait_until(lambda: self.live(PROBE_VERSION).get("events", 0) > probes, 10, what="the probe's counters")
        except BaseException:
            self.worker.stop(signal.SIGKILL)
            raise
        return self.worker

    def new_worker(self, log_name: str) -> WorkerProc:
        """A worker for this config, where this harness runs its workers (not waited for)."""
        return WorkerProc(self.cfg, free_port(), self.log_dir / log_name, self.launch, self.bind)

    def consumer_state(self) -> str:
        """Committed offsets of the ingest group against the log ends of its inputs (for failure messages)."""
        from kafka import KafkaAdminClient

        try:
            topics = [self.cfg.topics.generations, self.cfg.topics.feedback]
            tps = [TopicPartition(t, p) for t in topics for p in range(self.cfg.broker.partitions)]
            admin = KafkaAdminClient(bootstrap_servers=self.cfg.broker.bootstrap)
            try:
                group = f"{self.cfg.topics.prefix}-ingest"
                committed = admin.list_group_offsets({group: tps}).get(group, {})
            finally:
                admin.close()
            c = KafkaConsumer(bootstrap_servers=self.cfg.broker.bootstrap, enable_auto_commit=False)
            try:
                ends = c.end_offsets(tps)
            finally:
                c.close()
            return "; ".join(
                f"{tp.topic}[{tp.partition}] committed {getattr(committed.get(tp), 'offset', None)} end {ends.get(tp)}"
                for tp in tps
            )
        except Exception as e:  # noqa: BLE001 diagnostics for a failure message: never fails the test itself
            return f"(consumer state unavailable: {e!r})"

    def send_generation(self, rec: GenerationRecord, flush: bool = True) -> None:
        self.producer.send(self.cfg.topics.generations, key=rec.generation_id, value=rec.to_bytes())
        if flush:
            self.producer.flush()

    def send_generation_raw(self, value: bytes, key: str | None) -> None:
        self.producer.send(self.cfg.topics.generations, key=key, value=value)
        self.producer.flush()

    def tail(self, which: str) -> TopicTail:
        topic = {
            "samples": self.cfg.topics.samples,
            "dead_letters": self.cfg.topics.dead_letters,
            "feedback": self.cfg.topics.feedback,
        }[which]
        return TopicTail(self.cfg.broker.bootstrap, topic, self.cfg.broker.partitions)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(f"{self.cfg.topics.prefix}:ingest:counters").items()}

    def live(self, version: int) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(keys.live(self.cfg.topics.prefix, version)).items()}

    def close(self) -> None:
        try:
            if self.worker is not None:
                self.worker.stop(signal.SIGKILL)
        finally:
            self.producer.close()
            keys = list(self.redis.scan_iter(f"{self.cfg.topics.prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                self.redis.delete(*keys[i : i + 500])
            self.redis.close()


def ingest_config(stack, state_dir: Path, **overrides: Any) -> LiverlConfig:
    """A config with its own topic prefix and Redis namespace, a short rebalance timeout, and producers that give up
    well before feedback stops waiting for its generation (``pending_ttl_s``)."""
    opts: dict[str, Any] = {
        "state_dir": str(state_dir),
        "broker__bootstrap": stack.bootstrap,
        "redis__url": stack.redis_url,
        "topics__prefix": f"t{uuid.uuid4().hex[:10]}",
        # Feedback waits this long for its generation: long enough that the producers' delivery timeout below (half
        # of it, 10 s) holds on a loaded machine (1 s did not: "1000 ms has passed since batch creation").
        "ingest__pending_ttl_s": 20.0,
        "broker__rebalance_timeout_s": 1.0,  # Tansu completes a group join after this: the worker starts faster
        "ingest__heldout_share": 0.0,  # every joined sample on <prefix>.samples (held-out routing: test_bounds.py)
    }
    opts.update(overrides)
    # the config requires every producer's delivery timeout well below pending_ttl_s (the SDK's and the harness's)
    opts.setdefault("broker__delivery_timeout_s", min(60.0, opts["ingest__pending_ttl_s"] / 2))
    return load_config(env={}, **opts)


@pytest.fixture(scope="module")
def harness(stack, tmp_path_factory) -> IngestHarness:
    """One worker shared by a module's tests (startup is the slow part); tests use their own ids."""
    d = tmp_path_factory.mktemp("ingest")
    h = IngestHarness(ingest_config(stack, d / "state"), d)
    try:
        h.start_worker()
        yield h
        code = h.worker.stop()
        assert code == 0, f"worker exited {code} on SIGTERM:\n{h.worker.log_tail()}"
    finally:
        h.close()
