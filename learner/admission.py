"""Admission: which fetched sample records may train, in what batches, and how far the trained watermark moves.

Records arrive in offset order per partition (``Admission.queue``, filled by the loop's fetch). ``classify`` takes
each one and either accepts it into ``pending`` (waiting for a full batch) or refuses it with a counted reason, a
ledger line and no exception, so the loop never crashes on input:

- ``wire_*``: not a TrainingSample (``core.schemas``); ``internal_error``: a check itself raised;
- ``duplicate``: the sample id was trained already or waits in ``pending``: the recent window
  (``LearnerState.trained_ids``, the last ``dedupe_window`` ids) first, then every id ever trained (``learner.seen``,
  durable, cut back with the ledger). Ingest is at-least-once; this makes the learner exactly-once;
- ``shed``: ingest joined it more than ``max_backlog_s`` ago (``joined_at``, by ingest's clock, not the product's
  feedback time, which a product that forwards late sets hours back): the learner is behind and trains the newest
  first;
- ``stale``: its ``policy_version`` is more than ``max_lag`` of the learner's own updates (``max_staleness``
  candidates' worth) behind the weights it would train. Lag is counted in updates since the learner's weights were
  that version (``LearnerState.version_steps``), not in version numbers: the registry numbers every candidate,
  refused ones included, so a learner ahead of a slow canary would otherwise throw its weights away;
- the trainer's own checks (``PolicyTrainer.refusal``: token/log-prob length mismatch, out-of-vocab ids, non-finite
  values, too long).

The sample's behaviour log-probs go with it: the update's importance ratios against them are the off-policy
correction (``learner.loss``); staleness bounds how far off-policy a batch may be.

Invariant: ``LearnerState.offsets`` is an exact watermark. A partition's next offset moves past a record only once
that record was trained or refused and no accepted record below it still waits, so everything below the watermark
was trained on or refused. The watermark reaches Kafka only through a checkpoint (``learner.checkpoint``): after a
kill -9 the restart seeks to the checkpoint's offsets and classifies the records past them again, with the ledger's
refusals past that checkpoint cut off, so each record is trained or refused exactly once in the lineage that goes on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import time

from core.config import LearnerConfig
from core.schemas import TrainingSample, WireError
from core.shred import SealError, open_sample
from learner.checkpoint import LearnerState
from learner.ledger import Ledger
from learner.seen import SeenIds

log = logging.getLogger("liverl.learner")

_UNIT = re.compile(rb'"unit":"([A-Za-z0-9_.:\-]{1,64})"')
Entry = tuple[int, int, TrainingSample]  # (partition, offset, sample): an accepted record


def joined_at(s: TrainingSample) -> float:
    """When ingest joined ``s``'s feedback with its generation (``ts_joined``, ingest's clock); a sample written
    without it: its feedback's time."""
    return s.ts_joined if s.ts_joined is not None else s.ts_feedback


class Admission:
    """The fetched records (``queue``), the accepted ones (``pending``) and the refusal rules (see the module doc)."""

    def __init__(self, lcfg: LearnerConfig, topic: str, state: LearnerState, trainer, ledger: Ledger, seen: SeenIds):
        self.lcfg, self.topic, self.state = lcfg, topic, state
        self.trainer, self.ledger, self.seen = trainer, ledger, seen
        self.queue: collections.deque = collections.deque()  # (partition, offset, raw value, hop times), as fetched
        self.pending: list[Entry] = []  # accepted, waiting for a full batch
        self.arrival: dict[tuple[int, int], tuple[float, float]] = {}  # (partition, offset) of a pending sample ->
        # (its record's timestamp: when ingest produced it, when this learner fetched it), wall clock: ``hops``
        self.read_pos: dict[int, int] = {}  # next offset to classify per partition
        self.pending_since = 0.0  # when the oldest pending sample was accepted
        self.fresh_at = time.monotonic()  # when a sample last passed the staleness check
        self._shed_said_at = float("-inf")  # when the log last said the learner sheds load
        # users' data keys (core.shred.UserKeys; None: no key-encryption key), to open sealed samples
        self.user_keys = None
        self.opened: set[tuple[int, int]] = set()  # (partition, offset) of pending samples that came sealed

    # -- accept or refuse ---------------------------------------------------------------------------
    def classify(self) -> None:
        """Move fetched records into ``pending`` (accepted) or refuse them, until a batch is full."""
        found = self._prefetch_keys()
        while self.queue and not self.batch_ready():
            part, off, raw, arrived = self.queue.popleft()
            self.read_pos[part] = off + 1
            s = None
            try:
                s = TrainingSample.from_bytes(raw if raw is not None else b"")
                reason = None
                if s.sealed is not None:
                    s, reason = self._open(s, found)
                    if reason is None:
                        self.opened.add((part, off))
                reason = reason or self.refusal(s)
            except WireError as e:
                reason = f"wire_{e.reason}"
            except Exception as e:  # noqa: BLE001 - one record must never stop the learner (it would crash-loop on it)
                reason = "internal_error"
                log.exception(
                    "learner: refusing the record at %s[%d]@%d: %s: %s", self.topic, part, off, type(e).__name__, e
                )
            if reason is None:
                self.fresh_at = time.monotonic()
                if not self.pending:
                    self.pending_since = self.fresh_at
                self.pending.append((part, off, s))
                self.arrival[(part, off)] = arrived
                continue
            self.state.counters[f"dropped:{reason}"] += 1
            self.ledger.refused(part, off, s.sample_id if s is not None else None, reason)
            if reason == "shed":
                self._shed_note()
            elif reason not in ("duplicate", "stale"):
                log.warning("learner: refused sample at %s[%d]@%d: %s", self.topic, part, off, reason)
            if not any(p[0] == part for p in self.pending):
                self.state.offsets[part] = off + 1  # nothing waiting below it in this partition

    def _prefetch_keys(self) -> dict[str, bytes | None]:
        """The data keys of the sealed samples ``classify`` is about to read, in one query (``core.shred``): unit ->
        key, None for a unit whose key is gone. Read afresh at each call, never kept."""
        if self.user_keys is None or not self.queue:
            return {}
        units = set()
        for _, _, raw, _ in itertools.islice(self.queue, 4 * self.lcfg.batch_size):
            if raw and b'"sealed":"' in raw and (m := _UNIT.search(raw)):
                units.add(m.group(1).decode())
        if not units:
            return {}
        keys = self.user_keys.keys_for(units)
        return {u: keys.get(u) for u in units}

    def _open(self, s: TrainingSample, found: dict[str, bytes | None]) -> tuple[TrainingSample, str | None]:
        """A sealed sample opened, or why not: ``forgotten`` (its user's key is destroyed), ``no_shred_key`` (this
        learner has no key-encryption key), ``unsealable`` (it does not open)."""
        if self.user_keys is None:
            return s, "no_shred_key"
        assert s.unit is not None  # a sealed sample names its unit (core.schemas)
        if s.unit not in found:
            found[s.unit] = self.user_keys.keys_for([s.unit]).get(s.unit)
        key = found[s.unit]
        if key is None:
            return s, "forgotten"
        try:
            return open_sample(key, s), None
        except SealError:
            return s, "unsealable"

    def still_known(self, batch: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        """``batch`` split right before it trains, by a fresh look-up of its sealed samples' keys: (those whose user
        still has a key, or that were never sealed; those whose user was forgotten since they were admitted, refused
        ``forgotten`` here, counted and in the ledger)."""
        sealed = [e for e in batch if (e[0], e[1]) in self.opened]
        for part, off, _ in batch:
            self.opened.discard((part, off))
        if not sealed or self.user_keys is None:
            return batch, []
        known = self.user_keys.keys_for({s.unit for _, _, s in sealed})
        gone = [e for e in sealed if e[2].unit not in known]
        for part, off, s in gone:
            self.state.counters["dropped:forgotten"] += 1
            self.ledger.refused(part, off, s.sample_id, "forgotten")
        if gone:
            log.info("learner: %d sample(s) of forgotten users refused before their step", len(gone))
        out = {(part, off) for part, off, _ in gone}
        return [e for e in batch if (e[0], e[1]) not in out], gone

    def refusal(self, s: TrainingSample) -> str | None:
        """Why ``s`` may not train (see the module doc), or None."""
        if (
            s.sample_id in self.state.trained_ids
            or any(p[2].sample_id == s.sample_id for p in self.pending)
            or s.sample_id in self.seen
        ):  # the recent window first, then every id ever trained (durable)
            return "duplicate"
        if self.lcfg.max_backlog_s and time.time() - joined_at(s) > self.lcfg.max_backlog_s:
            return "shed"  # the learner is behind: the newest feedback first (``learner.max_backlog_s``)
        if self.lag(s.policy_version) > self.max_lag:
            return "stale"
        return self.trainer.refusal(s)

    def _shed_note(self) -> None:
        """Say that the learner sheds load, at most every 30 s, with how much so far."""
        now = time.monotonic()
        if now - self._shed_said_at >= 30.0:
            self._shed_said_at = now
            log.warning(
                "learner: cannot keep up: skipping samples whose feedback is more than learner.max_backlog_s "
                "%.0f s old, training the newest (%d shed so far, counted as dropped:shed)",
                self.lcfg.max_backlog_s,
                self.state.counters["dropped:shed"],
            )

    @property
    def max_lag(self) -> int:
        """The most learner updates a sample's policy may be behind the weights it trains (``max_staleness``
        candidates' worth)."""
        return self.lcfg.max_staleness * self.lcfg.candidate_every_steps

    def lag(self, version: int) -> int:
        """Learner updates since these weights were ``version``; for a version this learner never held (an
        operator's, or one older than the checkpoint's ``version_steps``), an estimate from the version numbers."""
        at = self.state.version_steps.get(version)
        if at is not None:
            return self.state.step - at
        return max(0, self.state.last_emitted - version) * self.lcfg.candidate_every_steps

    # -- batches ------------------------------------------------------------------------------------
    def batch_size(self) -> int:
        """How many of the pending samples make the next batch: ``batch_size``, or fewer when their padded size
        would pass ``max_batch_tokens`` (at least one: a single sample longer than the cap is refused as too_long
        by the trainer only past the model's context, so it trains alone)."""
        n, longest = 0, 0
        for _, _, s in self.pending[: self.lcfg.batch_size]:
            longest = max(longest, len(s.prompt_token_ids) + len(s.completion_token_ids))
            if n and (n + 1) * longest > self.lcfg.max_batch_tokens:
                break
            n += 1
        return n

    def batch_ready(self) -> bool:
        if not self.pending:
            return False
        if len(self.pending) >= self.lcfg.batch_size or self.batch_size() < len(self.pending):
            return True
        return not self.queue and time.monotonic() - self.pending_since > self.lcfg.max_batch_wait_s

    def take_batch(self) -> list[Entry]:
        """The oldest full batch, out of ``pending``."""
        n = self.batch_size()
        batch, self.pending = self.pending[:n], self.pending[n:]
        self.pending_since = time.monotonic()  # the rest waits anew (an approximation of its oldest sample's age)
        return batch

    def trained(self, batch: list[Entry]) -> None:
        """``batch`` was trained: its ids join the durable seen ids and the recent window."""
        self.seen.add([(s.sample_id, time.time()) for _, _, s in batch])
        ids = self.state.trained_ids
        for _, _, s in batch:
            ids[s.sample_id] = None
        while len(ids) > self.lcfg.dedupe_window:
            del ids[next(iter(ids))]

    def advance(self, batch: list[Entry]) -> None:
        """Move the watermark past ``batch`` (trained or refused), up to the oldest record still waiting."""
        waiting: dict[int, int] = {}
        for part, off, _ in self.pending:
            waiting.setdefault(part, off)
        for part, off, _ in batch:
            self.state.offsets[part] = waiting.get(part, self.read_pos.get(part, off + 1))

    def hops(self, batch: list[Entry]) -> dict[str, float]:
        """Where a batch's oldest sample spent its time before this update, in seconds (wall clocks): ``ingest_s`` from
        its feedback to ingest's sample record (the record's timestamp: ingest waiting for the generation, or behind
        its input), ``fetch_s`` from that record to this learner's fetch (the broker, or this learner's reads behind),
        ``queue_s`` from the fetch to now (waiting here for a batch, or for earlier updates). They add up to the
        backlog's seconds for that sample, so ``liverl status`` and the log say which hop a lag is in."""
        now, worst = time.time(), None
        for part, off, s in batch:
            emitted, fetched = self.arrival.pop((part, off), (now, now))
            if worst is None or s.ts_feedback < worst[0]:
                worst = (s.ts_feedback, emitted, fetched)
        if worst is None:
            return {}
        fb, emitted, fetched = worst
        return {
            "ingest_s": max(0.0, emitted - fb),
            "fetch_s": max(0.0, fetched - emitted),
            "queue_s": max(0.0, now - fetched),
        }

    # -- partitions and the backlog -------------------------------------------------------------------
    def keep_partitions(self, parts: set[int]) -> None:
        """Assigned ``parts``: drop what is held of any other partition; the fetched records are fetched again from
        ``position``."""
        self.queue.clear()
        self.pending = [e for e in self.pending if e[0] in parts]
        self.arrival = {k: v for k, v in self.arrival.items() if k[0] in parts}
        self.read_pos = {p: o for p, o in self.read_pos.items() if p in parts}

    def position(self, part: int) -> int | None:
        """Where to read ``part`` from: the next record to classify, else the checkpoint's watermark."""
        return self.read_pos.get(part, self.state.offsets.get(part))

    def waiting(self) -> int:
        """Records fetched or accepted, not trained yet."""
        return len(self.queue) + len(self.pending)

    def backlog(self, consumer) -> tuple[int, float]:
        """What ingest judged that this learner has not trained yet: (samples, seconds). Samples: the samples topic's
        high watermarks (as of the last fetch) less this learner's trained watermarks, over its partitions. Seconds:
        the age of the oldest of them since ingest joined it (``joined_at``), 0 when none waits. This is the lag
        the on-call page, ``liverl status`` and the ``LiverlLearnerBehind`` alert show."""
        events = 0
        for tp in consumer.assignment() if consumer is not None else ():
            high = consumer.highwater(tp)
            at = self.state.offsets.get(tp.partition)
            if at is None:  # nothing trained from it yet: from the first record still held, else the read position
                held = [e[1] for e in self.pending if e[0] == tp.partition] + [
                    e[1] for e in self.queue if e[0] == tp.partition
                ]
                at = min(held) if held else self.read_pos.get(tp.partition)
            if high is not None and at is not None:
                events += max(0, high - at)
        oldest = None
        if self.pending:
            oldest = joined_at(self.pending[0][2])
        if self.queue:
            try:
                head = joined_at(TrainingSample.from_bytes(self.queue[0][2] or b""))
                oldest = head if oldest is None else min(oldest, head)
            except Exception:  # noqa: BLE001 - a record the classifier will refuse: its age is not known
                pass
        seconds = 0.0 if oldest is None or (events == 0 and not self.pending) else max(0.0, time.time() - oldest)
        return events, seconds
