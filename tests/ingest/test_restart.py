"""Restarts of the real ``liverl ingest`` process: state recovered, nothing lost under kill -9, and fast.

- SIGTERM then restart: waiting generations, pending feedback and judgements come back from the join table.
- SIGKILL mid-stream, several times, while feedback keeps coming: every published feedback ends in exactly one
  sample (one ``sample_id``, whatever the re-sends) or one dead letter; none lost, none judged twice.
- A loop of restarts (``LIVERL_RESTART_LOOPS``, default 3; 20 for the long run), alternating SIGKILL and SIGTERM:
  each restarted worker joins again and judges what waited for it; the time each took is printed.

Speed is a benchmark's bound, not a test's: the resume and stop times are asserted only when ``LIVERL_RESUME_LIMIT_S``
is set (BENCHMARKS.md's restart rows: ``LIVERL_RESTART_LOOPS=20 LIVERL_RESUME_LIMIT_S=10 pytest
tests/ingest/test_restart.py -k loop -s``). On a loaded machine (a fresh-clone CI run beside a 60-minute demo) the
loop's median resume was over the 10-s target while every restart recovered its state: the property held, the timing
did not.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from core import keys
from core.bus import feedback_client as from_config
from core.schemas import DeadLetter, FeedbackEvent, TrainingSample
from tests.ingest.conftest import IngestHarness, ingest_config, make_generation, new_gid, wait_until

# From a restarted process's start to its first joined sample, on the embedded broker: the target is 10 s (the median
# of the restarts; a single one may take twice that). Checked only when LIVERL_RESUME_LIMIT_S is set: see the doc.
RESUME_LIMIT_S = float(os.environ.get("LIVERL_RESUME_LIMIT_S", "0")) or None


def _samples_by_id(records) -> dict[str, TrainingSample]:
    """One sample per sample_id; re-sent copies (after a replay) must be identical but for ``ts_joined``, ingest's
    clock at the join, which a replay joins again."""
    out: dict[str, TrainingSample] = {}
    for r in records:
        s = TrainingSample.from_bytes(r.value)
        prev = out.setdefault(r.key.decode(), s)
        assert prev.model_copy(update={"ts_joined": s.ts_joined}) == s, f"two different samples for {r.key.decode()}"
    return out


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
        wait_until(
            lambda: (
                h.counters().get("joined", 0) - before.get("joined", 0) == 1
                and h.counters().get("feedback_in", 0) - before.get("feedback_in", 0) == 2
            ),
            20,
            what="the first worker to join one and hold one",
        )

        t0 = time.monotonic()
        assert h.worker.stop(signal.SIGTERM) == 0, h.worker.log_tail()
        stop_s = time.monotonic() - t0

        t0 = time.monotonic()
        h.start_worker()  # same consumer group: resumes from committed offsets, table from disk + changelog tail
        resume_s = time.monotonic() - t0
        with from_config(h.cfg) as sdk:
            waiting_fid = sdk.reject(waiting)  # needs the recovered generation record
            sdk.accept(judged, feedback_id=judged_fid)  # needs the recovered judgement to be a duplicate
        h.send_generation(make_generation(early, v))  # needs the recovered pending feedback

        with h.tail("samples") as tail:
            ids = {waiting, judged, early}
            try:
                wait_until(
                    lambda: (tail.poll(), {r.key.decode() for r in tail.matching(tail.keys(ids))} == ids)[1],
                    30,
                    what="all three samples",
                )
            except AssertionError as e:
                raise AssertionError(
                    f"{e}; counters {h.counters()}; samples {[(r.key, r.partition) for r in tail.records]}"
                    f"; ids {waiting, judged, early}"
                ) from None
            time.sleep(0.5)
            tail.poll()
            samples = _samples_by_id(tail.matching(tail.keys(ids)))
        assert sorted((s.generation_id, s.feedback_id, s.kind) for s in samples.values()) == sorted(
            [(waiting, waiting_fid, "reject"), (judged, judged_fid, "accept"), (early, early_fid, "edit")]
        )
        assert wait_until(
            lambda: keys.live_totals(h.live(v)) == {"accept": 1, "reject": 1, "edit": 1, "events": 3},
            10,
            what=f"live counters, have {h.live(v)}",
        )
        assert h.counters().get("duplicates", 0) - before.get("duplicates", 0) >= 1
        assert h.worker.stop(signal.SIGINT) == 0, h.worker.log_tail()
        print(f"\nSIGTERM took {stop_s:.1f} s; the restarted worker joined again after {resume_s:.1f} s")
        if RESUME_LIMIT_S is not None:
            assert stop_s < 20, f"SIGTERM took {stop_s:.1f} s"
            assert resume_s < 2 * RESUME_LIMIT_S, f"the restarted worker joined again only after {resume_s:.1f} s"
    finally:
        h.close()


class _Traffic:
    """Publishes generation + feedback pairs (some feedback first, some for generations never logged) in a thread."""

    def __init__(self, h: IngestHarness, version: int, seed: int = 0):
        self.h, self.v = h, version
        self.rng = random.Random(seed)
        self.fids: dict[str, str] = {}  # feedback_id -> generation_id, every feedback acknowledged by the broker
        self.unknown: set[str] = set()  # feedback ids whose generation is never published
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        with from_config(self.h.cfg) as sdk:
            while not self._stop.is_set():
                for _ in range(10):
                    gid = new_gid()
                    r = self.rng.random()
                    if r < 0.05:
                        fid = sdk.accept(gid)
                        self.unknown.add(fid)
                    elif r < 0.25:  # feedback first
                        fid = sdk.reject(gid)
                        self.h.send_generation(make_generation(gid, self.v), flush=False)
                    else:
                        self.h.send_generation(make_generation(gid, self.v), flush=False)
                        fid = sdk.accept(gid)
                    self.fids[fid] = gid
                self.h.producer.flush()
                sdk.flush()
                time.sleep(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)


def test_kill_9_mid_stream_loses_nothing_and_judges_nothing_twice(stack, tmp_path):
    kills = int(os.environ.get("LIVERL_KILL9_ROUNDS", "3"))
    h = IngestHarness(ingest_config(stack, tmp_path / "state", ingest__pending_ttl_s=4.0), tmp_path)
    rng = random.Random(7)
    v = 777_001
    try:
        h.start_worker()
        with _Traffic(h, v) as traffic:
            for _ in range(kills):
                time.sleep(rng.uniform(1.0, 3.0))  # a random moment in the stream
                h.worker.assert_alive()
                h.worker.stop(signal.SIGKILL)
                h.start_worker()
            time.sleep(1.0)
        fids = dict(traffic.fids)
        assert len(fids) > 100, "too little traffic to mean anything"

        # Drain: every feedback is either a sample or (its generation never came) a dead letter.
        with h.tail("samples") as st, h.tail("dead_letters") as dt:

            def accounted():
                st.poll()
                dt.poll()
                judged = {TrainingSample.from_bytes(r.value).feedback_id for r in st.records}
                dead = {
                    FeedbackEvent.from_bytes(DeadLetter.from_bytes(r.value).value).feedback_id
                    for r in dt.records
                    if DeadLetter.from_bytes(r.value).reason == "unknown_generation"
                }
                return (judged | dead) >= set(fids)

            try:
                wait_until(accounted, 60, interval=0.5, what="every feedback to end in a sample or a dead letter")
            finally:
                st.poll()
                dt.poll()
            ours = [r for r in st.records if TrainingSample.from_bytes(r.value).policy_version == v]
            samples = _samples_by_id(ours)
            letters = [DeadLetter.from_bytes(r.value) for r in dt.records]
        assert not [d for d in letters if d.reason not in ("unknown_generation",)], [
            (d.reason, d.detail) for d in letters if d.reason != "unknown_generation"
        ]
        dead = {FeedbackEvent.from_bytes(d.value).feedback_id for d in letters}
        judged = {s.feedback_id: s.generation_id for s in samples.values()}
        assert set(judged) | dead == set(fids), "lost feedback"
        assert not set(judged) & dead, "feedback both trained and dead-lettered"
        assert dead == traffic.unknown, "dead-lettered feedback whose generation was published"
        assert all(fids[f] == g for f, g in judged.items())
        assert len(samples) == len(fids) - len(traffic.unknown)  # one sample per judged generation
        live = wait_until(
            lambda: (d := h.live(v)).get("events") == len(judged) and d,
            20,
            what=f"live events == {len(judged)}, have {h.live(v)}",
        )
        assert live["events"] == len(judged)
        print(
            f"\nkill -9 x{kills}: {len(fids)} feedback -> {len(samples)} samples, {len(dead)} dead letters, "
            f"{len(ours) - len(samples)} samples re-sent after a replay"
        )
    finally:
        h.close()


def test_restart_loop_resumes_fast(stack, tmp_path):
    """``LIVERL_RESTART_LOOPS=20 pytest tests/ingest/test_restart.py -k loop`` is the long run."""
    loops = int(os.environ.get("LIVERL_RESTART_LOOPS", "3"))
    h = IngestHarness(ingest_config(stack, tmp_path / "state"), tmp_path)
    times = []
    try:
        h.start_worker()
        for i in range(loops):
            # Some state for the next worker to recover: a waiting generation, judged by feedback after the restart.
            gid = new_gid()
            h.send_generation(make_generation(gid, 5000 + i))
            time.sleep(0.2)
            h.worker.stop(signal.SIGKILL if i % 2 == 0 else signal.SIGTERM)
            t0 = time.monotonic()
            h.start_worker()  # returns once the new worker has joined a probe generation with its feedback
            times.append(time.monotonic() - t0)
            with from_config(h.cfg) as sdk:
                sdk.accept(gid)
            with h.tail("samples") as tail:
                tail.wait_for(tail.keys({gid}), timeout=20)
        print(
            f"\n{loops} restarts: resumed joining in {min(times):.1f}-{max(times):.1f} s "
            f"(median {sorted(times)[len(times) // 2]:.1f} s): {' '.join(f'{t:.1f}' for t in times)}"
        )
        assert len(times) == loops  # every restart joined again and judged the generation that waited for it
        if RESUME_LIMIT_S is not None:
            assert sorted(times)[len(times) // 2] < RESUME_LIMIT_S and max(times) < 2 * RESUME_LIMIT_S, times
    finally:
        h.close()


def test_redis_down_stops_the_worker_unacknowledged_and_the_restart_replays(stack, tmp_path):
    """An infrastructure failure mid-batch ends the process (exit 75) before it commits the batch's offsets; the
    next worker replays it, so its live counters are not lost."""
    from ingest.commit import EXIT_INFRA
    from tests.conftest import free_port
    from tests.ingest.conftest import WorkerProc

    good = ingest_config(stack, tmp_path / "state", ingest__redis_retry_s=1.0)
    h = IngestHarness(good, tmp_path)
    try:
        h.start_worker()
        h.worker.stop(signal.SIGTERM)
        v, gid = 313_131, new_gid()
        h.send_generation(make_generation(gid, v))
        with from_config(h.cfg) as sdk:
            sdk.reject(gid)
        bad = good.model_copy(
            update={"redis": good.redis.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"})}
        )
        w = WorkerProc(bad, free_port(), tmp_path / "worker-no-redis.log")
        try:
            code = w.proc.wait(timeout=90)
        finally:
            w.stop(signal.SIGKILL)
        assert code == EXIT_INFRA, w.log_tail()
        assert "without acknowledging" in w.log_tail()
        assert h.live(v) == {}
        h.start_worker()
        assert wait_until(
            lambda: keys.live_totals(h.live(v)) == {"reject": 1, "events": 1},
            30,
            what=f"replayed counters, have {h.live(v)}",
        )
    finally:
        h.close()


def test_local_state_from_another_broker_history_is_dropped(stack, tmp_path):
    """The RocksDB files outlive a broker reset (the demo's embedded broker keeps its log in memory): a database
    ahead of its changelog is emptied rather than trusted."""
    from kafka import KafkaAdminClient

    h = IngestHarness(ingest_config(stack, tmp_path / "state"), tmp_path)
    try:
        h.start_worker()
        for _ in range(20):  # table history the new changelog will not have
            h.send_generation(make_generation(new_gid(), 1), flush=False)
        h.producer.flush()
        wait_until(lambda: h.counters().get("generations_in", 0) >= 21, 20, what="generations consumed")
        assert h.worker.stop(signal.SIGTERM) == 0
        changelog = f"{h.cfg.topics.prefix}-ingest-join-changelog"
        admin = KafkaAdminClient(bootstrap_servers=h.cfg.broker.bootstrap)
        try:
            admin.delete_topics([changelog])
        finally:
            admin.close()
        h.start_worker()
        assert "from another broker history" in h.worker.log_tail(200_000)
    finally:
        h.close()


def test_a_backlog_is_read_in_step_so_feedback_finds_its_generation(stack, tmp_path):
    """A worker that starts on a backlog (after an outage) reads feedback no further ahead of the generations it
    judges than ``FEEDBACK_LEAD_S`` (Kafka timestamps). Feedback records are a fifth of a generation's size, so a fetch
    brings them far ahead: without pacing nearly every event waited as pending (written, read back, parsed again), and
    a backlog longer than ``ingest.max_pending`` would be dead-lettered ``pending_full``. Here max_pending is a tenth
    of the backlog: every pair must still join, none wait, nothing is dead-lettered. The feedback held back stays in
    the worker's memory until its generations are read: the consumer returns every record once (going back to the
    held offset instead had the broker send a sixth of the backlog twice)."""
    from liverl.bench.ingest import _produce, _records

    n = 20_000
    h = IngestHarness(ingest_config(stack, tmp_path / "state", ingest__max_pending=n // 10), tmp_path)
    try:
        gens, fbs = _records(n, seed=11)  # a product's timestamps: each judged 2-30 s after it was served
        _produce(stack.bootstrap, h.cfg.topics.generations, gens)
        _produce(stack.bootstrap, h.cfg.topics.feedback, fbs)
        h.start_worker(ready_timeout=120)
        wait_until(lambda: h.live(0).get("events") == n, 120, what=f"{n} joins")
        got = h.counters()
        assert got.get("joined") == got.get("feedback_in") == n + 1  # (+ the start-up probe)
        assert got.get("pended", 0) <= 1, got  # (the probe's feedback may beat its generation)
        assert not {k: v for k, v in got.items() if k.startswith("dlq:")}, got
        # the backlog made the worker hold feedback back (how much depends on how the broker interleaves the two
        # topics' fetches, so on the machine's load: that it did, and that nothing pended, is the property) ...
        assert got.get("held", 0) > 0, got
        assert got["fetched"] == got["generations_in"] + got["feedback_in"], got  # ... and nothing was fetched twice
    finally:
        h.close()


def _wait_progress(value, done, alive, what: str, stall_s: float = 300.0, interval: float = 0.02) -> None:
    """Wait until ``done(value())``, for as long as the worker is alive and ``value()`` keeps changing: a property, not
    a clock. A loaded machine only makes it wait longer; it fails when the worker died, or when nothing changed for
    ``stall_s`` (a hang, not slowness: the backlog moves every second on any machine this runs on)."""
    last, since = value(), time.monotonic()
    while not done(last):
        alive()  # raises when the worker died
        assert time.monotonic() - since < stall_s, f"no progress for {stall_s:.0f} s waiting for {what} (at {last})"
        time.sleep(interval)
        now = value()
        if now != last:
            last, since = now, time.monotonic()


def _committed(cfg, topic: str) -> dict[int, int]:
    """The ingest group's committed offsets of ``topic``, per partition (those with one)."""
    from kafka import KafkaAdminClient, TopicPartition

    group = f"{cfg.topics.prefix}-ingest"
    admin = KafkaAdminClient(bootstrap_servers=cfg.broker.bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in range(cfg.broker.partitions)]
        offsets = admin.list_group_offsets({group: tps}).get(group, {})
    finally:
        admin.close()
    return {tp.partition: m.offset for tp, m in offsets.items() if m is not None and m.offset >= 0}


def _padded(gens: list[tuple[bytes, bytes, int]], size: int) -> list[tuple[bytes, bytes, int]]:
    """The generation records with their prompt padded to about ``size`` bytes: a product's records (the issue's 5 KB),
    not the bench's 600 B ones."""
    out = []
    for key, value, ts in gens:
        rec = json.loads(value)
        rec["prompt"] += " " + "x" * max(0, size - len(value))
        out.append((key, json.dumps(rec).encode(), ts))
    return out


BACKLOGS_PER_KILL = 4


def test_kill_9_while_feedback_is_held_back_loses_none_of_it(stack, tmp_path):
    """The feedback a worker holds back on a backlog (``_hold_back``) lives only in its memory, past the consumer's
    position: a kill -9 then must lose none of it. Its offsets are never committed before it is processed, so the
    restarted worker reads it again. Two kills -9 while the worker is catching up and holding feedback back; then
    every feedback event is judged exactly once (live counters) and has its sample.

    The backlog makes the hold certain on any machine, and long: its generation records are 5 KB (a product's), so a
    generations partition is several fetches (``max_partition_fetch_bytes`` 4 MB) while its feedback is one. The first
    batch then brings feedback far ahead of the generations read, and it stays held until they catch up, several
    fetches later. (With the bench's 600 B records a partition's generations were nearly one fetch: a fast machine
    held little, for one batch, and had joined the whole backlog when the test first saw the hold; CI failed so.)
    The kill comes when the worker's gauge says a partition is held now; a backlog joined between two looks at the
    gauge (the first run on a cold machine did that once) is followed by another, up to ``BACKLOGS_PER_KILL``. Every
    wait is on a property, never on a fixed time: it waits as long as the worker makes progress."""
    from liverl.bench.ingest import _produce, _records
    from tests.conftest import free_port
    from tests.ingest.conftest import WorkerProc

    half = 5_000
    # pending_ttl_s at its default, not the harness's 2 s: on a loaded machine feedback may wait longer than 2 s for
    # its generation, and this test is about kills, not expiry (a 2 s TTL made it depend on the machine's speed)
    from ingest.commit import EXIT_INFRA

    h = IngestHarness(ingest_config(stack, tmp_path / "state", ingest__pending_ttl_s=150.0), tmp_path)
    assert h.cfg.broker.partitions == 2  # (5,000 records of 5 KB: 12 MB, three fetches, per generations partition)
    restarts: list[str] = []

    def alive() -> None:
        """What ``liverl up``'s supervisor does: a worker that stopped on a broker or Redis error (EXIT_INFRA, seen
        here when the machine was so loaded that the broker missed a request timeout) is restarted; anything else
        fails the test. A restart is one more replay: the exactly-once checks below hold across it too."""
        if h.worker.proc.poll() == EXIT_INFRA and len(restarts) < 5:
            restarts.append(h.worker.log_tail())
            h.worker = WorkerProc(h.cfg, free_port(), tmp_path / f"worker-restart-{len(restarts)}.log")
            return
        h.worker.assert_alive()

    def held_now() -> float:
        try:
            return h.worker.metric("liverl_ingest_feedback_partitions_paused ") or 0.0
        except OSError:  # (not serving yet)
            return 0.0

    try:
        # Each kill gets a backlog of its own, written while no worker runs, then a worker starts on it: a backlog on
        # any machine (a worker running while the records are written keeps up with them and holds nothing back).
        h.start_worker()  # the topics, the group and the worker's state exist; then no worker until a backlog waits
        h.worker.stop(signal.SIGTERM)
        gens, fbs = [], []
        seeds = iter(range(13, 13 + 2 * BACKLOGS_PER_KILL))
        for k in (1, 2):
            for attempt in range(1, BACKLOGS_PER_KILL + 1):
                g, f = _records(half, seed=next(seeds))
                g = _padded(g, 5_000)
                gens, fbs = gens + g, fbs + f
                _produce(stack.bootstrap, h.cfg.topics.generations, g)
                _produce(stack.bootstrap, h.cfg.topics.feedback, f)
                before = _committed(h.cfg, h.cfg.topics.generations)
                h.worker = WorkerProc(h.cfg, free_port(), tmp_path / f"worker-on-backlog-{k}-{attempt}.log")
                # the kill comes while a partition is held and after the worker committed offsets on this backlog:
                # a commit that covered the held records (past the batches' own) would lose them here
                _wait_progress(
                    lambda before=before: (
                        _committed(h.cfg, h.cfg.topics.generations) != before and held_now() > 0,
                        h.live(0).get("events", 0),
                    ),
                    lambda v, fbs=fbs: v[0] or v[1] >= len(fbs),
                    alive,
                    f"the worker to commit while it holds feedback back (kill {k})",
                    interval=0.05,
                )
                if h.live(0).get("events", 0) < len(fbs):
                    h.worker.stop(signal.SIGKILL)  # (the gauge said held a moment ago: this kills in the hold)
                    break
                # the whole backlog joined between two looks at the gauge: another backlog, then kill in its hold
                h.worker.stop(signal.SIGTERM)
            else:
                raise AssertionError(f"{BACKLOGS_PER_KILL} backlogs were joined before a hold was seen (kill {k})")
        h.worker = WorkerProc(h.cfg, free_port(), tmp_path / "worker-after-kill-2.log")
        n = len(fbs)
        _wait_progress(
            lambda: h.live(0).get("events", 0), lambda v: v >= n, alive, f"{n} joins after two kills", interval=0.5
        )
        assert h.live(0).get("events") == n  # each exactly once
        got = h.counters()
        assert got.get("held", 0) > 0, got  # (the hold that the kills interrupted: counted when its batch settled)
        with h.tail("samples") as st:
            want = {key.decode() for key, _, _ in fbs}  # (keyed by generation id, as the samples are)

            def sampled() -> int:
                st.poll()
                return len({r.key.decode() for r in st.records} & want)

            _wait_progress(
                sampled, lambda v: v >= len(want), alive, "a sample for every generation of the backlog", interval=0.2
            )
            samples = _samples_by_id([r for r in st.records if r.key.decode() in want])
        assert len(samples) == n
        assert not {k: v for k, v in h.counters().items() if k.startswith("dlq:")}, got
    finally:
        h.close()


class _InProcess:
    """An in-process ingest worker's surroundings on the real broker: its topics (the changelog compacted), a producer
    for its inputs, the group's committed offsets, and a clean-up of the test's Redis keys."""

    def __init__(self, cfg):
        from core.bus import all_topics, ensure_topics, make_producer
        from ingest.table import changelog_topic

        self.cfg = cfg
        self.parts = cfg.broker.partitions
        self.changelog_topic = changelog_topic(cfg.topics.prefix)
        ensure_topics(cfg.broker.bootstrap, all_topics(cfg), self.parts)
        ensure_topics(cfg.broker.bootstrap, [self.changelog_topic], self.parts, configs={"cleanup.policy": "compact"})
        self.producer = make_producer(cfg.broker.bootstrap)

    def send(self, topic: str, gid: str, value: bytes) -> None:
        self.producer.send(topic, key=gid, value=value)
        self.producer.flush()

    def committed(self, topic: str) -> dict[int, int]:
        return _committed(self.cfg, topic)

    @staticmethod
    async def until(pred, what: str, timeout: float = 60.0) -> None:
        import asyncio

        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def until_committed(self, topic: str, pred, what: str, timeout: float = 20.0) -> None:
        import asyncio

        deadline = time.monotonic() + timeout
        while not pred(await asyncio.to_thread(self.committed, topic)):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.2)

    def run(self, worker, body) -> None:
        """Run ``worker`` while ``await body()`` runs, then stop it; clean up the producer and the Redis keys."""
        import asyncio

        async def main() -> None:
            task = asyncio.ensure_future(worker.run())
            try:
                await body()
            finally:
                worker.stop()
                await asyncio.wait_for(task, 60)

        try:
            asyncio.run(main())
        finally:
            self.producer.close()
            r = __import__("redis").Redis.from_url(self.cfg.redis.url)
            for k in r.scan_iter(f"{self.cfg.topics.prefix}:*", count=1000):
                r.delete(k)
            r.close()


def test_held_feedback_is_not_committed_until_it_is_processed(stack, tmp_path, monkeypatch):
    """The invariant the kill -9 test above relies on, pinned: while a feedback record is held back, batches go on
    and their offsets are committed, but the held record's partition is committed only up to it; once released, it
    is joined and committed past. In-process worker on the real broker; the generations are made to look behind
    (``Pacer.generations_progress``) for as long as the test wants the feedback held."""
    import asyncio

    from ingest import app
    from ingest.pacing import Pacer
    from ingest.table import partition_of

    cfg = ingest_config(stack, tmp_path / "state")
    env = _InProcess(cfg)
    w = app.IngestWorker(cfg, stack.bootstrap, cfg.redis.url, web_port=0)
    real_progress = Pacer.generations_progress
    behind = {"on": False}

    async def progress(self, gen_tp, read=None):
        if behind["on"]:
            return 0.0, 0, 1  # read up to the epoch, a record not read yet: every feedback is far ahead
        return await real_progress(self, gen_tp, read)

    monkeypatch.setattr(Pacer, "generations_progress", progress)  # (the worker's pacer is built in ``run``)

    async def body() -> None:
        gid = new_gid()
        p = partition_of(gid.encode(), env.parts)
        env.send(cfg.topics.generations, gid, make_generation(gid, version=7).to_bytes())
        await env.until(lambda: w.ingest.ready and w.table.get(gid) is not None, "the generation")
        behind["on"] = True
        env.send(
            cfg.topics.feedback,
            gid,
            FeedbackEvent(feedback_id=f"fb-{gid}", generation_id=gid, kind="accept").to_bytes(),
        )
        await env.until(lambda: any(tp.partition == p for tp in w.pacer.held_records), "the feedback held back")
        # batches go on while it is held: more generations, written and committed (the buffer's second goes by)
        others = [new_gid() for _ in range(3)]
        for other in others:
            env.send(cfg.topics.generations, other, make_generation(other, version=7).to_bytes())
        await env.until(
            lambda: all(w.table.get(o) is not None and o not in w.table.buffered for o in others),
            "the other generations written",
        )
        await env.until_committed(
            cfg.topics.generations,
            lambda c: sum(c.values()) >= 4,
            "the generations committed while the feedback was held",
        )
        assert (await asyncio.to_thread(env.committed, cfg.topics.feedback)).get(p, 0) == 0, (
            "the held feedback's offset was committed before it was processed"
        )
        assert (w.table.get(gid) or b"")[:1] == b"W", "the held feedback was joined"
        behind["on"] = False  # the generations caught up: _pace releases it
        await env.until(lambda: (w.table.get(gid) or b"")[:1] == b"J", "the released feedback joined")
        await env.until_committed(
            cfg.topics.feedback, lambda c: c.get(p, 0) == 1, "the released feedback's offset committed"
        )

    env.run(w, body)


def test_the_table_write_buffer_coalesces_and_commits_inputs_only_once_written(stack, tmp_path, monkeypatch):
    """The join table's changes wait in a write buffer (Kafka Streams' record cache) and reach the changelog once a
    second or when the buffer is full: a generation written waiting and judged before then reaches the changelog
    once, as judged. The input offsets of the batches in the buffer are committed only after it is written, so a
    kill -9 before that replays them (``test_kill_9_mid_stream_loses_nothing_and_judges_nothing_twice``). In-process
    worker on the real broker; the interval is made an hour so only a full buffer or a stop writes it."""
    import asyncio

    from kafka import KafkaConsumer, TopicPartition

    from ingest import app, commit

    monkeypatch.setattr(commit, "TABLE_FLUSH_S", 3600.0)
    monkeypatch.setattr(commit, "TABLE_BUFFER_WRITES", 10)
    cfg = ingest_config(stack, tmp_path / "state")
    env = _InProcess(cfg)
    w = app.IngestWorker(cfg, stack.bootstrap, cfg.redis.url, web_port=0)

    def changelog(gid: str) -> list[bytes]:
        c = KafkaConsumer(bootstrap_servers=stack.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
        try:
            tps = [TopicPartition(env.changelog_topic, p) for p in range(env.parts)]
            c.assign(tps)
            c.seek_to_beginning(*tps)
            got, quiet = [], 0
            while quiet < 3:
                recs = [r for rs in c.poll(timeout_ms=200).values() for r in rs]
                quiet = 0 if recs else quiet + 1
                got += [r.value for r in recs if r.key == gid.encode()]
            return got
        finally:
            c.close()

    def committed_feedback() -> int:
        return sum(env.committed(cfg.topics.feedback).values())

    async def body() -> None:
        first = new_gid()  # the first batch is written at once (nothing was buffered for a second)
        env.send(cfg.topics.generations, first, make_generation(first, version=7).to_bytes())
        await env.until(lambda: w.ingest.ready and not w.table.dirty and w.table.get(first), "the first generation")
        gid = new_gid()
        env.send(cfg.topics.generations, gid, make_generation(gid, version=7).to_bytes())
        await env.until(lambda: (w.table.buffered.get(gid) or b"")[:1] == b"W", "the generation in the buffer")
        env.send(
            cfg.topics.feedback,
            gid,
            FeedbackEvent(feedback_id=f"fb-{gid}", generation_id=gid, kind="accept").to_bytes(),
        )
        await env.until(lambda: (w.table.buffered.get(gid) or b"")[:1] == b"J", "its judgement in the buffer")
        assert await asyncio.to_thread(changelog, gid) == [], "the buffer reached the changelog before it was due"
        assert await asyncio.to_thread(committed_feedback) == 0, "feedback committed before its table write"
        for _ in range(commit.TABLE_BUFFER_WRITES):  # fill the buffer: it is written, then the inputs committed
            other = new_gid()
            env.send(cfg.topics.generations, other, make_generation(other, version=7).to_bytes())
        await env.until(lambda: w.table.get(gid) is not None and gid not in w.table.buffered, "the buffer written")
        got = await asyncio.to_thread(changelog, gid)
        assert len(got) == 1 and got[0][:1] == b"J", got  # once, judged: the waiting entry never went out
        await env.until_committed(
            cfg.topics.feedback, lambda c: sum(c.values()) == 1, "the feedback's offset committed after the buffer"
        )

    env.run(w, body)


def test_a_crash_loses_table_writes_only_with_their_changelog_offset(tmp_path):
    """The partition databases run without a write-ahead log (the changelog is the log): a process killed before
    RocksDB flushed its memtable loses those writes, and with them the changelog offset written in the same batch, so
    the database reopens consistent at an earlier offset and recovery reads the changelog from there. A clean close
    keeps everything."""
    import subprocess
    import sys

    from ingest.table import _Part

    path = tmp_path / "join-0"
    part = _Part(path)
    part.apply([(b"gen-a", b"W|1.0|\n")], 5)
    part.close()
    part = _Part(path)
    assert (part.get(b"gen-a"), part.offset) == (b"W|1.0|\n", 5)
    part.close()
    code = (
        "import os, sys; from pathlib import Path; from ingest.table import _Part; "
        f"p = _Part(Path({str(path)!r})); p.apply([(b'gen-b', b'J|2.0|\\n'), (b'gen-a', None)], 9); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2], timeout=60)
    part = _Part(path)
    try:
        assert part.offset in (5, 9)
        if part.offset == 5:  # the crash lost the batch: all of it, offset included
            assert part.get(b"gen-a") == b"W|1.0|\n" and part.get(b"gen-b") is None
        else:  # (RocksDB flushed it before the exit)
            assert part.get(b"gen-a") is None and part.get(b"gen-b") == b"J|2.0|\n"
    finally:
        part.close()


def test_a_worker_started_while_the_broker_does_not_answer_exits_for_a_restart(stack, tmp_path):
    """A broker that does not answer at start is the same infrastructure failure as one lost mid-batch: exit 75, with
    the reason on one line, for the supervisor to restart it; not a traceback."""
    from ingest.commit import EXIT_INFRA
    from tests.conftest import free_port
    from tests.ingest.conftest import WorkerProc

    good = ingest_config(stack, tmp_path / "state")
    cut = good.model_copy(update={"broker": good.broker.model_copy(update={"bootstrap": f"127.0.0.1:{free_port()}"})})
    w = WorkerProc(cut, free_port(), tmp_path / "worker-no-broker.log")
    try:
        code = w.proc.wait(timeout=120)
    finally:
        w.stop(signal.SIGKILL)
    assert code == EXIT_INFRA, w.log_tail()
    assert "does not answer" in w.log_tail() and "Traceback" not in w.log_tail(), w.log_tail()
