"""The learner on a host of its own, cut off from the broker and Redis mid-stream: no sample trained twice.

Two hosts on one bridge (``tests.netns``): ``broker`` runs the broker ``liverl up`` embeds, at its own address;
``learner`` runs ``liverl learn``, configured by address only (``LIVERL__BROKER__BOOTSTRAP``, ``LIVERL__REDIS__URL``,
the machine's Redis forwarded to its bridge address). The test, on the machine, publishes the samples.

The learner's link is cut for ``LIVERL_CUT_S`` seconds (default 35) after its first update, while more samples are
published: longer than its lease's TTL in Redis (``learner.lease_ttl_s``, 10 s), so the learner must stop before its
next checkpoint or commit (``learner.lease``: a learner that may have been replaced writes neither), and longer than
its Kafka clients' timeouts. A learner that exits is restarted, as ``liverl up``'s supervisor does. Once the link is
back, the ledger (``liverl audit``'s source for "trained") must list every sample trained exactly once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from core.config import load_config
from core.services import port_open
from tests.conftest import free_port
from tests.netns import Hosts, unavailable

pytestmark = pytest.mark.slow

CUT_S = float(os.environ.get("LIVERL_CUT_S", "35"))
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture
def hosts(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    if not port_open("127.0.0.1", 6379):
        pytest.skip("Redis is not listening on 127.0.0.1:6379 (set up by scripts/services.sh)")
    with Hosts(["broker", "learner"], tmp_path) as h:
        yield h


def test_a_learner_cut_off_mid_stream_trains_every_sample_once_after_the_link_returns(hosts, tmp_path):
    import redis

    from learner.ledger import Ledger, checkpoint_path_for, ledger_path
    from learner.model import load_model
    from liverl.demo.base_policy import ensure_base_policy

    from .test_trainer import make_samples, model_cache, produce_samples

    bootstrap = hosts.start_broker("broker")
    redis_url = f"redis://{hosts.forward(6379, free_port())}/0"
    prefix = f"t{os.urandom(5).hex()}"
    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        broker__bootstrap=bootstrap,
        redis__url=redis_url,
        topics__prefix=prefix,
        model__cache_dir=str(model_cache()),
    )
    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    samples = make_samples(load_model(model_dir), 96, seed=17)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        LIVERL__STATE_DIR=str(cfg.state_path),
        LIVERL__BROKER__BOOTSTRAP=bootstrap,
        LIVERL__REDIS__URL=redis_url,
        LIVERL__TOPICS__PREFIX=prefix,
        LIVERL__SERVING__HOST=hosts.addr("learner"),
        LIVERL__MODEL__CACHE_DIR=str(model_cache()),
        LIVERL__LEARNER__BATCH_SIZE="16",
        LIVERL__LEARNER__CANDIDATE_EVERY_STEPS="100",
        LIVERL__LEARNER__LR="1e-3",
        LIVERL__LEARNER__MAX_BATCH_WAIT_S="2",
        LIVERL__LEARNER__MAX_BACKLOG_S="0",
    )
    ledger = ledger_path(checkpoint_path_for(cfg))
    runs: list = []

    def learn():
        p = hosts.spawn("learner", [sys.executable, "-m", "liverl.cli", "learn"], f"learn-{len(runs)}.log", env, REPO)
        runs.append(p)
        return p

    def trained() -> list[str]:
        return [sid for line in Ledger.read(ledger) for _, _, sid in line.get("trained", [])]

    exits: list[int] = []

    def supervise() -> None:
        """What ``liverl up``'s supervisor does: a learner that exits is restarted (up to 5 times)."""
        code = runs[-1].poll()
        if code is not None:
            exits.append(code)
            log = (tmp_path / f"learn-{len(runs) - 1}.log").read_text()[-3000:]
            assert len(exits) <= 5, f"learner exits {exits}:\n{log}"
            learn()

    def until(pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            supervise()
            assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}; exits {exits}"
            time.sleep(0.5)

    r = redis.Redis.from_url(redis_url)
    try:
        produce_samples(cfg, samples[:48])
        learn()
        until(lambda: len(trained()) >= 16, 180, "the learner's first update")
        with hosts.cut_for("learner"):
            t0 = time.monotonic()
            produce_samples(cfg, samples[48:])  # (the broker is on its own host: the machine still reaches it)
            while time.monotonic() - t0 < CUT_S:
                supervise()
                time.sleep(0.5)
            during = len(trained())
        restored = time.monotonic()
        until(lambda: len(trained()) >= len(samples), 180, "every sample trained")
        drained_s = time.monotonic() - restored
        time.sleep(3)  # (a sample trained twice would show by now: the learner idles on an empty topic)
        got = trained()
        runs[-1].send_signal(signal.SIGTERM)
        assert runs[-1].wait(timeout=60) == 0, (tmp_path / f"learn-{len(runs) - 1}.log").read_text()[-3000:]
        assert sorted(got) == sorted(s.sample_id for s in samples), "a sample lost or trained twice"
        print(
            f"\nlearner cut {CUT_S:.0f} s: {len(samples)} samples trained once each ({during} by the end of the cut); "
            f"learner exits {exits}; all trained {drained_s:.1f} s after the link came back"
        )
    finally:
        for k in r.scan_iter(f"{prefix}:*", count=1000):
            r.delete(k)
        r.close()
