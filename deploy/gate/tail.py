"""The gate's view of logged traffic: a thread that tails the generations topic (the drift probes) or the held-out
topic (the off-policy check's samples), and the records it keeps.

The tail reads without a consumer group and never commits, so any number of gates can tail the same topic.

Sealed records (``core.shred``) stay sealed in the tail: each call opens what it returns with a fresh look-up of the
users' keys (one query), and drops for good the records of a user whose key is gone, so a forgotten user's text
reaches no later probe or off-policy estimate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kafka import TopicPartition

from core.bus import make_reader
from core.config import BrokerConfig
from core.schemas import GenerationRecord, TrainingSample, WireError
from core.shred import SealError, UserKeys, open_sealed

log = logging.getLogger("liverl.gate")


PROBE_UNIT_SHARE = 1 / 16
"""The most of the drift and collapse probes one user may hold (the gate's generations tail): the probes are the newest
logged generations, and without a cap the heaviest users' requests would be most of them. A caller who rotates user
keys, or sends none, is not capped: generations without a unit count each as their own."""


class LoggedGeneration(NamedTuple):
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    unit: str | None = None  # the pseudonymous user it was served to (``GenerationRecord.unit``)
    sealed: str | None = None  # its token ids sealed under the user's key (the ids empty until opened)


class HeldoutSample(NamedTuple):
    """A held-out joined sample: what was sampled, its behaviour log-prob (summed), the product's reward for it
    (``TrainingSample.reward``: its judgement's, or ``Product.reward("revert", ...)`` once the user undid an
    accepted answer), which generation it is, when it was judged (the feedback's time) and the kind of its latest
    record (``revert`` after a revert)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprob: float
    reward: float
    generation_id: str
    judged_at: float
    kind: str
    unit: str | None = None
    sealed: str | None = None  # its token ids sealed under the user's key (the ids empty until opened)


def _plain_sampling(s) -> bool:
    """Sampled from the model's own distribution (temperature 1, no truncation or penalties): the only samples whose
    logged log-probs are comparable with the candidate's plain softmax."""
    return (
        s is not None
        and s.temperature == 1.0
        and s.top_p == 1.0
        and s.top_k in (-1, 0)
        and s.min_p == 0.0
        and s.presence_penalty == 0.0
        and s.frequency_penalty == 0.0
        and s.repetition_penalty == 1.0
    )


def parse_generation(raw: bytes) -> LoggedGeneration | None:
    g = GenerationRecord.from_bytes(raw)
    if g.trainable and g.sealed is not None and g.completion_logprobs:
        return LoggedGeneration((), (), g.unit, g.sealed)
    if g.trainable and g.prompt_token_ids and g.completion_token_ids:
        return LoggedGeneration(tuple(g.prompt_token_ids), tuple(g.completion_token_ids), g.unit)
    return None


def parse_heldout(raw: bytes) -> HeldoutSample | None:
    s = TrainingSample.from_bytes(raw)
    sealed = s.sealed is not None and bool(s.behaviour_logprobs)
    if not ((sealed or (s.prompt_token_ids and s.completion_token_ids)) and _plain_sampling(s.sampling)):
        return None
    return HeldoutSample(
        tuple(s.prompt_token_ids),
        tuple(s.completion_token_ids),
        float(sum(s.behaviour_logprobs)),
        float(s.reward),
        s.generation_id,
        float(s.ts_feedback),
        s.kind,
        s.unit,
        s.sealed,
    )


def open_items(keys: UserKeys | None, items: list) -> tuple[list, set[str]]:
    """``items`` (``LoggedGeneration`` or ``HeldoutSample``) with the sealed ones opened, by one look-up of their
    users' keys: (the items whose text is readable, opened; the units whose key is gone). A sealed item with no key to
    open it (this process has no key-encryption key) or that does not open is left out."""
    units = {i.unit for i in items if i.sealed is not None}
    if not units:
        return items, set()
    found = keys.keys_for(units) if keys is not None else {}
    out = []
    for i in items:
        if i.sealed is None:
            out.append(i)
            continue
        key = found.get(i.unit)
        if key is None:
            continue
        try:
            text = open_sealed(key, i.unit, i.sealed)
        except SealError:
            continue
        prompt, completion = text.get("prompt_token_ids") or (), text.get("completion_token_ids") or ()
        if prompt and completion:
            out.append(i._replace(prompt_ids=tuple(prompt), completion_ids=tuple(completion), sealed=None))
    return out, (units - set(found)) if keys is not None else set()


class GenerationTail:
    """The most recent ``size`` records of a topic, parsed by ``parse`` (None: skipped), kept by a thread that tails
    the topic without a consumer group (it starts ``size`` records back on each partition and never commits).
    On the generations topic (the default) these are the gate's probe sequences: real prompts, and completions the
    served policy sampled; on the held-out topic (``parse_heldout``), the off-policy check's samples."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        size: int,
        broker: BrokerConfig | None = None,
        parse: Callable[[bytes], Any] = parse_generation,
        young_s: float = 0.0,
        judged_at: Callable[[Any], float] | None = None,
        young_cap: int = 200_000,
        unit_share: float = 0.0,
        keys: UserKeys | None = None,
    ):
        """``young_s`` (with ``judged_at``): the tail keeps ``size`` records judged more than ``young_s`` ago PLUS every
        younger one (up to ``young_cap``), so that the off-policy check, which censors what is younger than the revert
        horizon, always has ``size`` usable samples. A plain last-``size`` tail held only young records once the
        traffic brought more than ``size`` held-out samples per revert horizon: nothing usable, every candidate
        deferred.

        ``unit_share`` (0: none): one unit (a record's ``unit``, None: no unit) holds at most this share of the
        ``size`` records kept, its newest; its older ones leave first (``PROBE_UNIT_SHARE``)."""
        self.bootstrap, self.topic, self.size, self.broker, self.parse = bootstrap, topic, size, broker, parse
        self.young_s, self.judged_at = young_s, judged_at
        self.per_unit = max(1, int(size * unit_share)) if unit_share > 0 else 0
        self._units: collections.Counter[str] = collections.Counter()  # records kept per unit (with per_unit)
        self._recent: collections.deque = collections.deque(maxlen=size)
        self._young: collections.deque = collections.deque(maxlen=young_cap)  # in arrival order, moved on when old
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-generation-tail", daemon=True)
        self.refused = 0
        self.errors = 0
        self.keys = keys  # users' data keys, to open sealed records at each call (core.shred); None: none
        self.forgotten = 0  # records dropped because their user's key is gone

    def start(self) -> GenerationTail:
        self._thread.start()
        return self

    def __call__(self) -> list[Any]:
        """The records kept, oldest first: what ``parse`` made of them (``LoggedGeneration`` by default), sealed ones
        opened (``open_items``), those of forgotten users dropped here and from the tail."""
        with self._lock:
            self._age()
            items = list(self._recent) + list(self._young)
        opened, gone = open_items(self.keys, items)
        if gone:
            self._drop(gone)
        return opened

    def _drop(self, units: set[str]) -> None:
        """Forget every record kept of ``units`` (their keys are gone)."""
        with self._lock:
            before = len(self._recent) + len(self._young)
            self._recent = collections.deque((i for i in self._recent if i.unit not in units), maxlen=self.size)
            self._young = collections.deque((i for i in self._young if i.unit not in units), maxlen=self._young.maxlen)
            for u in units:
                self._units.pop(u, None)
            self.forgotten += before - len(self._recent) - len(self._young)

    def _age(self) -> None:
        """Move the young records judged before now - ``young_s`` into the kept ``size`` (caller holds the lock)."""
        if not self._young:
            return
        assert self.judged_at is not None  # records wait among the young only with a judged_at
        cutoff = time.time() - self.young_s
        while self._young and self.judged_at(self._young[0]) <= cutoff:
            self._keep(self._young.popleft())

    def _keep(self, item: Any) -> None:
        """Keep ``item`` among the ``size`` newest; with ``per_unit``, its unit's oldest leaves when the unit holds its
        share already (caller holds the lock)."""
        unit = getattr(item, "unit", None) if self.per_unit else None
        if unit is not None:
            if self._units[unit] >= self.per_unit:
                for i, old in enumerate(self._recent):
                    if getattr(old, "unit", None) == unit:
                        del self._recent[i]
                        self._units[unit] -= 1
                        break
            self._units[unit] += 1
        if len(self._recent) == self.size:  # the oldest leaves
            gone = getattr(self._recent.popleft(), "unit", None) if self.per_unit else None
            if gone is not None:
                self._units[gone] -= 1
                if not self._units[gone]:
                    del self._units[gone]
        self._recent.append(item)

    def _run(self) -> None:
        """Tails until closed; a broker error (a timeout on a loaded machine, a restart) is logged and the tail
        reopened from ``size`` records back, never left dead with the gate judging on what it held."""
        while not self._stop.is_set():
            try:
                self._tail()
            except Exception as e:  # noqa: BLE001 - any client error: reopen, do not die silently
                self.errors += 1
                log.warning("gate: tail of %s failed (%s: %s); reopening in 2 s", self.topic, type(e).__name__, e)
                self._stop.wait(2.0)

    def _tail(self) -> None:
        consumer = make_reader(self.bootstrap, self.broker)
        try:
            while not self._stop.is_set():
                parts = consumer.partitions_for_topic(self.topic)
                if parts:
                    break
                self._stop.wait(1.0)
            else:
                return
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            ends, begins = consumer.end_offsets(tps), consumer.beginning_offsets(tps)
            if self.young_s > 0:  # `size` back from where the young records start (record time ~ judgement time)
                at = consumer.offsets_for_times({tp: int((time.time() - self.young_s) * 1000) for tp in tps})
                ends = {tp: (at[tp].offset if at.get(tp) is not None else ends[tp]) for tp in tps}
            for tp in tps:
                consumer.seek(tp, max(begins[tp], ends[tp] - self.size))
            with self._lock:  # read again from `size` back: what it held would come twice
                self._recent.clear()
                self._young.clear()
                self._units.clear()
            while not self._stop.is_set():
                for records in consumer.poll(timeout_ms=500, max_records=1000).values():
                    for rec in records:
                        self._add(rec.value)
        finally:
            consumer.close()

    def _add(self, raw: bytes) -> None:
        try:
            item = self.parse(raw)
        except WireError:
            self.refused += 1
            return
        if item is not None:
            with self._lock:
                if self.judged_at is None or self.young_s <= 0:
                    self._keep(item)
                else:
                    self._young.append(item)
                    self._age()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
