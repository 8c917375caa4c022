"""A restarted worker recovers its join state from the changelog topics, and signals stop it cleanly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ingest.sdk import from_config
from liverl.core.schemas import TrainingSample
from tests.ingest.conftest import IngestHarness, ingest_config, make_generation, new_gid, wait_until


@pytest.mark.skipif(
    os.environ.get("LIVERL_TEST_INGEST_RESTART") != "1",
    reason="known intermittent hang: a faust worker restarted on the embedded Tansu broker sometimes reports "
    "'Worker ready' and then consumes nothing (cause not yet found; see the closing note of issue #2). "
    "Run it with LIVERL_TEST_INGEST_RESTART=1.",
)
def test_restart_recovers_waiting_generations_pending_feedback_and_judgements(stack, tmp_path):
    h = IngestHarness(ingest_config(stack, tmp_path / "state", ingest__pending_ttl_s=120.0), tmp_path)
    try:
        h.start_worker()
        v = 424_242
        waiting, judged, early = new_gid(), new_gid(), new_gid()
        before = h.counters()
        h.send_generation(make_generation(waiting, v), flush=False)
        h.send_generation(make_generation(judged, v))
        with from_config(h.cfg) as sdk:
            judged_fid = sdk.accept(judged)
            early_fid = sdk.edit(early, "fixed")
        wait_until(lambda: h.counters().get("joined", 0) - before.get("joined", 0) == 1
                   and h.counters().get("feedback_in", 0) - before.get("feedback_in", 0) == 2, 20,
                   what="the first worker to join one and hold one")

        t0 = time.monotonic()
        assert h.worker.stop(signal.SIGTERM) == 0, h.worker.log_tail()
        stop_s = time.monotonic() - t0

        h.start_worker()  # same consumer group: resumes from committed offsets, tables from changelogs
        with from_config(h.cfg) as sdk:
            waiting_fid = sdk.reject(waiting)  # needs the recovered generation record
            sdk.accept(judged, feedback_id=judged_fid)  # needs the recovered judgement to be a duplicate
        h.send_generation(make_generation(early, v))  # needs the recovered pending feedback

        with h.tail("samples") as tail:
            try:
                tail.wait_for(tail.keys({waiting, early}), n=2)
            except AssertionError as e:
                raise AssertionError(f"{e}; counters {h.counters()}; pending "
                                     f"{h.worker.metric('liverl_ingest_pending_feedback ')}; tracked "
                                     f"{h.worker.metric('liverl_ingest_tracked_generations ')}; "
                                     f"samples {[(r.key, r.partition) for r in tail.records]}; "
                                     f"ids {waiting, judged, early}") from None
            time.sleep(0.5)
            tail.poll()
            samples = [TrainingSample.from_bytes(r.value) for r in tail.matching(tail.keys({waiting, judged, early}))]
        assert sorted((s.generation_id, s.feedback_id, s.kind) for s in samples) == sorted(
            [(waiting, waiting_fid, "reject"), (judged, judged_fid, "accept"), (early, early_fid, "edit")])
        assert wait_until(lambda: h.live(v) == {"accept": 1, "reject": 1, "edit": 1, "events": 3}, 10,
                          what=f"live counters, have {h.live(v)}")
        assert h.counters().get("duplicates", 0) - before.get("duplicates", 0) >= 1
        assert h.worker.stop(signal.SIGINT) == 0, h.worker.log_tail()
        assert stop_s < 20, f"SIGTERM took {stop_s:.1f} s"
    finally:
        h.close()
