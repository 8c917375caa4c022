"""The ingest worker's probes and its stop (docs/operations.md, "Probes and termination"): ``/livez`` answers while
its event loop does; ``/readyz`` is 200 only while its join table is restored and it holds a partition (of two
workers in a group over one partition, exactly one is ready) and 503 once it stops; SIGTERM commits the batch in hand
and the worker exits 0 within seconds, with every input offset committed."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from ingest.web import readiness
from tests.conftest import free_port
from tests.ingest.conftest import IngestHarness, WorkerProc, ingest_config, wait_until

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError as e:
        return 0, {"error": str(e)}


def test_readiness_reads_the_workers_state():
    assert readiness({"ready": True, "partitions": [0, 1], "stopping": False}) is None
    assert readiness({"ready": False, "partitions": [], "stopping": False}).startswith("rebalancing")
    assert readiness({"ready": True, "partitions": [], "stopping": False}) == "holds no partition of the inputs"
    assert readiness({"ready": True, "partitions": [0], "stopping": True}).startswith("stopping")


def _lag(h: IngestHarness) -> dict[str, int]:
    """Per input partition, its log end minus the group's committed offset."""
    cfg = h.cfg
    tps = [TopicPartition(t, 0) for t in (cfg.topics.generations, cfg.topics.feedback)]
    admin = KafkaAdminClient(bootstrap_servers=cfg.broker.bootstrap)
    try:
        group = f"{cfg.topics.prefix}-ingest"
        committed = admin.list_group_offsets({group: tps}).get(group, {})
    finally:
        admin.close()
    c = KafkaConsumer(bootstrap_servers=cfg.broker.bootstrap, enable_auto_commit=False)
    try:
        ends = c.end_offsets(tps)
    finally:
        c.close()
    return {tp.topic: ends[tp] - getattr(committed.get(tp), "offset", 0) for tp in tps}


def test_one_of_two_workers_on_one_partition_is_ready_and_each_stops_on_sigterm_with_its_offsets_committed(
    stack, tmp_path
):
    cfg = ingest_config(stack, tmp_path / "state-1", broker__partitions=1)
    h = IngestHarness(cfg, tmp_path)
    second = None
    try:
        first = h.start_worker()  # it joined a probe generation with its feedback: it holds the partition
        status, body = _get(first.url("/readyz"))
        assert status == 200 and body["partitions"] == [0], body
        assert _get(first.url("/livez"))[0] == 200
        other = cfg.model_copy(deep=True)
        other.state_dir = str(tmp_path / "state-2")  # its own join-table store (a worker locks its state dir)
        second = WorkerProc(other, free_port(), tmp_path / "worker-2.log")
        wait_until(lambda: _get(second.url("/livez"))[0] == 200, 60, what="the second worker's web server")

        def one_ready() -> bool:
            got = [_get(w.url("/readyz")) for w in (first, second)]
            return sorted(s for s, _ in got) == [200, 503]

        wait_until(one_ready, 60, interval=0.2, what="exactly one of the two workers ready")
        idle = next(w for w in (first, second) if _get(w.url("/readyz"))[0] == 503)
        reason = _get(idle.url("/readyz"))[1]["reason"]
        assert reason == "holds no partition of the inputs" or reason.startswith("rebalancing"), reason
        for w in (second, first):
            w.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            time.sleep(0.3)
            status, _ = _get(w.url("/readyz"))
            assert status in (503, 0), status  # stopping (or already gone): never ready again
            code = w.stop(signal.SIGTERM, timeout=30)
            assert code == 0, w.log_tail()
            assert time.monotonic() - t0 < 30
        assert _lag(h) == {cfg.topics.generations: 0, cfg.topics.feedback: 0}, "input left uncommitted"
    finally:
        for w in (h.worker, second):
            if w is not None and w.proc.poll() is None:
                w.stop(signal.SIGKILL)
        h.close()
