"""``liverl learn``'s probes and its stop (docs/operations.md, "Probes and termination"): on its metrics port,
``/livez`` is 200 while its training loop goes round and ``/readyz`` 200 once it holds the lease and reads the samples
topic; SIGTERM ends the update in hand, checkpoints and commits, and the process exits 0 within seconds: every sample
it trained is in its checkpoint's ledger."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def test_the_learner_is_ready_once_it_reads_samples_and_stops_on_sigterm_with_its_work_checkpointed(cfg, tmp_path):
    from learner.ledger import Ledger, checkpoint_path_for, ledger_path
    from learner.model import load_model
    from liverl.demo.base_policy import ensure_base_policy

    from .test_trainer import make_samples, model_cache, produce_samples

    model_dir = ensure_base_policy(model_cache(), seed=0, progress=False)
    samples = make_samples(load_model(model_dir), 32, seed=5)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        LIVERL__STATE_DIR=str(cfg.state_path),
        LIVERL__BROKER__BOOTSTRAP=cfg.broker.bootstrap,
        LIVERL__REDIS__URL=cfg.redis.url,
        LIVERL__TOPICS__PREFIX=cfg.topics.prefix,
        LIVERL__SERVING__HOST="127.0.0.1",
        LIVERL__MODEL__CACHE_DIR=str(model_cache()),
        LIVERL__LEARNER__BATCH_SIZE="16",
        LIVERL__LEARNER__CANDIDATE_EVERY_STEPS="100",
        LIVERL__LEARNER__MAX_BATCH_WAIT_S="2",
        LIVERL__LEARNER__MAX_BACKLOG_S="0",
    )
    log = tmp_path / "learn.log"
    ledger = ledger_path(checkpoint_path_for(cfg))
    url = f"http://127.0.0.1:{port}"

    def trained() -> list[str]:
        return [sid for line in Ledger.read(ledger) for _, _, sid in line.get("trained", [])]

    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", "learn", "--metrics-port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        produce_samples(cfg, samples[:16])
        deadline = time.monotonic() + 240
        while _status(f"{url}/readyz")[0] != 200:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, (_status(f"{url}/readyz"), log.read_text()[-4000:])
            time.sleep(0.5)
        assert _status(f"{url}/livez")[0] == 200
        status, metrics = _status(f"{url}/metrics")
        assert status == 200 and "liverl_learner_" in metrics
        produce_samples(cfg, samples[16:])
        while len(trained()) < 16:  # at least one update made durable: the stop must keep what comes after it
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the learner ignored SIGTERM for 60 s:\n{log.read_text()[-4000:]}") from None
        assert code == 0, log.read_text()[-4000:]
        print(f"\nthe learner stopped {time.monotonic() - t0:.1f} s after SIGTERM with {len(trained())} trained")
        got = trained()
        assert len(got) == len(set(got)) and set(got) <= {s.sample_id for s in samples}
        assert len(got) >= 16
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
