"""The join's decisions: one per input event, against the table entry of its generation id (``ingest.join`` says what
each kind of entry means).

Plain calls, no waiting: a generation record is written waiting, or joins the feedback pending for it; feedback joins
its waiting generation, is written pending, or is a duplicate or dead-lettered; a revert trains the correction of an
accepted sample. Every decision goes into the ``Batch`` (table writes, output queued on the ``Emitter``, counters);
later events read the batch's own writes and those of batches decided before it and not settled yet (``ahead``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from core import keys, routing
from core.config import IngestConfig, TopicsConfig
from core.product import Product
from core.schemas import FeedbackEvent, GenerationRecord, TrainingSample, WireError
from core.shred import SealError, UserKeys
from ingest.batch import Batch, Emitter, InfraError, KeyMissing
from ingest.entry import JUDGED, PENDING, WAITING, pack, unpack
from ingest.partitioner import partition_of
from ingest.pending import PendingIndex
from ingest.records import (
    MAX_RECORD_BYTES,
    REVERT_SUFFIX,
    Source,
    _counted_again,
    _guardrails,
    is_heldout,
    judged_bucket,
    key_text,
    record_parts,
    sample_json,
    unit_bucket_of,
)
from ingest.sealing import BatchKeys, sealed_sample, units_needed

log = logging.getLogger("liverl.ingest")


class Decider:
    """Decides each event of a batch; reads the table, the batches decided ahead of their settling, and the pending
    index, and writes only into the batch."""

    def __init__(
        self,
        ic: IngestConfig,
        topics: TopicsConfig,
        product: Product,
        table: Any,
        index: PendingIndex,
        emitter: Emitter,
        partitions: int | None,
        user_keys: UserKeys | None = None,
    ):
        self.ic = ic
        # users' data keys, to open sealed generations (None: no key-encryption key; a sealed one is then an error)
        self.keys = BatchKeys(user_keys) if user_keys is not None else None
        self.product = product  # reward shaping is the product's (default: [ingest.rewards])
        # (the topic names are properties that format a string: read once, not per event)
        self._topic_generations, self._topic_samples = topics.generations, topics.samples
        self._topic_heldout = topics.heldout
        self.table = table
        self.index = index
        self.emitter = emitter
        self._partitions = partitions
        # Table writes of batches decided but not settled, newest value per generation id (None: a deletion), and
        # how many of them are new pending feedback; empty whenever no batch is in flight.
        self.ahead: dict[str, bytes | None] = {}
        self.ahead_pending = 0

    def reset(self) -> None:
        """Nothing is ahead (the worker settles every batch before a rebalance)."""
        self.ahead.clear()
        self.ahead_pending = 0

    def units_for(self, out: Batch, events: Sequence[tuple[Source, bytes | None]]) -> set[str] | None:
        """The users whose keys deciding ``events`` will need (``ingest.sealing.units_needed``); None: no keys."""
        gen_topic = self._topic_generations
        return None if self.keys is None else units_needed(events, lambda gid: self._get(gid, out), gen_topic)

    def decide_some(self, out: Batch, events: Sequence[tuple[Source, bytes | None]], prefetched: bool = False) -> None:
        """Decide ``events`` into ``out``; an event that fails on its own is dead-lettered ``internal_error``.
        ``prefetched``: the caller read the users' keys the events need (``BatchKeys.prefetch`` of ``units_for``)."""
        now = out.now
        gen_topic = self._topic_generations
        gens = 0
        if self.keys is not None and not prefetched:  # one query for the users' keys this slice needs
            self.keys.prefetch(self.units_for(out, events) or ())
        for src, value in events:
            try:
                if src.topic == gen_topic:
                    gens += 1
                    self._on_generation(src, value, out, now)
                else:
                    self._on_feedback(src, value, out, now)
            except InfraError:
                raise
            except Exception as e:
                log.exception("internal error on %s[%s]@%s; dead-lettered", src.topic, src.partition, src.offset)
                self.emitter.dead(out, "internal_error", f"{type(e).__name__}: {e}", src, value)
        out.generations_in += gens
        out.feedback_in += len(events) - gens

    def end(self, out: Batch) -> Batch:
        """The batch is decided: later batches read its table writes until it is settled."""
        self.ahead.update(out.writes)
        self.ahead_pending += out.new_pending
        for name, n in (
            ("generations_in", out.generations_in),
            ("feedback_in", out.feedback_in),
            ("joined", sum(out.tally.joined_kinds.values())),
        ):
            if n:
                out.tally.inc(name, n)
        return out

    def _parse(self, model, value: bytes | None):
        if value is None:
            return WireError("empty", "a record without a value (tombstone)")
        if len(value) > self.ic.max_event_bytes:
            return WireError("too_large", f"{len(value)} bytes > ingest.max_event_bytes {self.ic.max_event_bytes}")
        try:
            return model.from_bytes(value)
        except WireError as e:
            return e

    def _on_generation(self, src: Source, value: bytes | None, out: Batch, now: float) -> None:
        if src.partition is not None:
            self.index.read_generation(src.partition, src.ts or now, src.offset)
        rec = self._parse(GenerationRecord, value)
        if isinstance(rec, WireError):
            self.emitter.dead(out, rec.reason, rec.detail, src, value)
            return
        gid = rec.generation_id
        if _misplaced(self._partitions, self.emitter, gid, src, value, out):
            return
        if (
            rec.trainable and rec.routed_experts is not None
        ):  # the learner would replay it: refused here, never a sample
            try:
                routing.check_text(rec.routed_experts, len(rec.prompt_token_ids) + len(rec.completion_token_ids) - 1)
            except routing.RoutingError as e:
                self.emitter.dead(out, "bad_routing", str(e), src, value)
                return
        entry = self._get(gid, out)
        kind = entry[:1] if entry else None
        if kind in (WAITING, JUDGED):  # a redelivery (or a reused id: never trained on twice)
            out.tally.inc("generation_duplicates")
            if kind == JUDGED:  # the replay of a join whose counters a crash may have lost: idempotent
                assert entry is not None  # a kind is read from an entry
                _, t, meta, _ = unpack(entry)
                self._count_again(out, meta, t)
            return
        parts = record_parts(rec)
        if kind == PENDING:
            assert entry is not None  # a kind is read from an entry
            _, _, meta, payload = unpack(entry)
            fb_src = Source(*meta["src"])  # (where the feedback came from: a dead letter about it names it)
            self._join(gid, *parts, FeedbackEvent.model_validate_json(payload), out, now, src, fb_src)
            return
        new = pack(WAITING, now, *parts)
        if len(new) > MAX_RECORD_BYTES:
            self.emitter.dead(out, "too_large", f"the record's waiting entry is {len(new)} bytes", src, value)
            return
        out.writes[gid] = new

    def _on_feedback(self, src: Source, value: bytes | None, out: Batch, now: float) -> None:
        fb = self._parse(FeedbackEvent, value)
        dead = self.emitter.dead
        if isinstance(fb, WireError):
            dead(out, fb.reason, fb.detail, src, value)
            return
        gid, fid = fb.generation_id, fb.feedback_id
        if _misplaced(self._partitions, self.emitter, gid, src, value, out):
            return
        entry = self._get(gid, out)
        kind = entry[:1] if entry else None
        if fb.kind == "revert":
            self._on_revert(fb, entry, kind, src, value, out)
            return
        if kind == JUDGED:
            assert entry is not None  # a kind is read from an entry
            _, t, meta, _ = unpack(entry)
            if meta["f"] == fid:
                out.tally.inc("duplicates")
                self._count_again(out, meta, t)  # idempotent; heals a crash
            else:
                why = f"generation {gid} was already judged by feedback {meta['f']}"
                if meta.get("u") is not None and fb.edited_text is not None:
                    # a user's edit is not copied into the dead letters, where a forget could not reach it
                    value = fb.model_copy(update={"edited_text": None}).model_dump_json().encode()
                dead(out, "already_judged", why, src, value)
        elif kind == WAITING:
            assert entry is not None  # a kind is read from an entry
            _, _, meta, body = unpack(entry)
            self._join(gid, meta, body, fb, out, now, src)
        elif kind == PENDING:
            assert entry is not None  # a kind is read from an entry
            _, _, meta, _ = unpack(entry)
            if meta["f"] == fid:
                out.tally.inc("duplicates")
            else:
                dead(
                    out,
                    "already_judged",
                    f"generation {gid} already has feedback {meta['f']} waiting for it",
                    src,
                    value,
                )
        elif len(self.index) + self.ahead_pending + out.new_pending >= self.ic.max_pending:
            dead(
                out,
                "pending_full",
                f"{len(self.index)} feedback events already wait for their generation (ingest.max_pending)",
                src,
                value,
            )
        else:
            kts = src.ts or now
            meta = {"f": fid, "kts": kts, "src": [src.topic, src.partition, src.offset, key_text(src.key)]}
            out.writes[gid] = pack(PENDING, now, meta, fb.model_dump_json().encode())
            out.new_pending += 1
            out.tally.inc("pended")

    def _on_revert(
        self, fb: FeedbackEvent, entry: bytes | None, kind: bytes | None, src: Source, value: bytes | None, out: Batch
    ) -> None:
        """A follow-up on an accepted generation: counted once per generation in its version's live counters
        (``revert``), so the gate sees how many accepted answers were kept, and, when the accept trained, trains the
        correction: the accepted sample again (sample id ``<generation>:revert``) with reward ``rewards.revert``. An
        acceptance a user later undid is what a policy that games acceptance earns; the learner must see it too, unless
        ``ingest.train_reverts`` is off (the demo's learner that chases raw acceptance, for the gate to catch). When
        the accept was held out, that record goes to the held-out stream instead: the gate's off-policy check scores
        the generation with the revert's reward (``deploy.gate.offpolicy.merge_heldout``), not as the accept it was."""
        gid = fb.generation_id
        if kind != JUDGED:
            self.emitter.dead(
                out,
                "revert_unjudged",
                f"generation {gid} has no judgement to revert (a revert follows "
                f"an accept; judgements are kept ingest.judged_ttl_s)",
                src,
                value,
            )
            return
        assert entry is not None  # a kind is read from an entry
        _, t, meta, accepted = unpack(entry)  # accepted: the sample its accept trained, kept for this correction
        # counted by when, and for whom, the reverted generation was judged (an entry without a unit: in '*' only)
        counted = (fb.feedback_id, meta["v"], keys.revert_field(t), unit_bucket_of(meta, t), meta.get("u"))
        mixed = bool(meta.get("m"))  # sampled by several versions: counted for none (see _join)
        if meta.get("r") == fb.feedback_id:
            out.tally.inc("duplicates")
            if not mixed:
                out.tally.live.append(counted)  # idempotent; heals a crash before Redis
        elif meta.get("r") is not None:
            self.emitter.dead(
                out, "already_reverted", f"generation {gid} was already reverted by {meta['r']}", src, value
            )
        elif meta["k"] != "accept":
            self.emitter.dead(
                out,
                "revert_unaccepted",
                f"generation {gid} was judged {meta['k']}, not accept: only an accepted generation can be reverted",
                src,
                value,
            )
        else:
            out.writes[gid] = pack(JUDGED, t, {**meta, "r": fb.feedback_id})
            out.tally.inc("reverted")
            if mixed:
                out.tally.inc("mixed_versions_reverted")
            else:
                out.tally.live.append(counted)
            if not accepted:  # not trainable, or judged more than ingest.revert_sample_ttl_s ago: counted only
                out.tally.inc("drop:revert_no_sample")
            elif len(gid) + len(REVERT_SUFFIX) <= 128:  # (ids are at most 128 characters) the correction
                self._correction(gid, fb, meta, accepted, out)

    def _correction(self, gid: str, fb: FeedbackEvent, meta: dict[str, Any], accepted: bytes, out: Batch) -> None:
        """A revert's correction: the accepted sample again with the revert's reward; with ``ingest.train_reverts``
        off, only a held-out accept's (the gate's evidence), never the learner's."""
        held = meta.get("h") == 1  # held out: the gate's stream gets the revert's reward, never the learner
        if not held and not self.ic.train_reverts:  # the learner chases raw acceptance; the gate still counts it
            out.tally.inc("drop:revert_not_trained")
            return
        s = TrainingSample.model_validate_json(accepted)
        fix = s.model_copy(
            update={
                "sample_id": f"{gid}{REVERT_SUFFIX}",
                "feedback_id": fb.feedback_id,
                "kind": "revert",
                "reward": float(self.product.reward("revert", s.segment)),
                "ts_feedback": fb.ts,
                "ts_joined": out.now,
            }
        )
        self.emitter.emit(
            out, self._topic_heldout if held else self._topic_samples, gid, fix.model_dump_json().encode()
        )
        if held:
            out.tally.inc("heldout_out")
        else:
            out.samples += 1
            out.tally.inc("revert_samples_out")

    def _join(
        self,
        gid: str,
        rec: dict[str, Any],
        body: bytes,
        fb: FeedbackEvent,
        out: Batch,
        now: float,
        src: Source,
        fb_src: Source | None = None,
    ) -> None:
        """Judge a generation: ``rec`` and ``body`` are its validated record's ``record_parts``. ``fb_src``: where the
        feedback came from, when ``src`` is the generation's (feedback that waited for it)."""
        version = rec["v"]
        meta = {"f": fb.feedback_id, "v": version, "k": fb.kind, "n": rec["n"], "b": judged_bucket(fb.ts, now)}
        if "ms" in rec:
            meta["ms"] = rec["ms"]
        unit = rec.get("u")
        if unit is not None:  # the user, so a later revert counts in their sums too
            meta["u"] = unit
        mixed = "m" in rec  # a hot-swap mid-generation: two versions (or unknown ones) sampled its tokens
        if mixed:  # (kept in the judgement, so a redelivery or a revert is not counted for a version either)
            meta["m"] = 1
        guardrails = _guardrails(meta)
        sample, sealed = b"", None
        if "x" not in rec and "s" in rec:  # sealed: opened here, in memory, and the sample sealed (ingest.sealing)
            rec, body, sealed = _open_sealed(self.keys, self.emitter, gid, unit, rec, body, fb, out, fb_src or src)
        elif "x" not in rec and fb.edited_sealed is not None:  # no sealed record holds an edit key to open it
            rec = _edit_without_key(self.emitter, gid, rec, out, fb_src or src)
        if "x" not in rec:
            sample = sample_json(gid, rec, body, fb, float(self.product.reward(fb.kind, fb.segment)), now, sealed)
            if len(sample) > MAX_RECORD_BYTES:
                self.emitter.dead(
                    out,
                    "sample_too_large",
                    f"the joined sample of {gid} would be {len(sample)} bytes",
                    src,
                    fb.model_dump_json().encode(),
                )
                sample = b""
        elif rec["x"] == "forgotten":  # the user's key is destroyed: their text is gone, no sample, said so
            self.emitter.dead(
                out, "forgotten", f"generation {gid}: its user's data key is destroyed (forgotten)", fb_src or src, None
            )
        elif rec["x"] in ("too_large", 1):  # (a record logged without its token lists: the gateway's too_large)
            out.tally.inc("drop:too_large" if rec["x"] == "too_large" else "drop:not_trainable")
        heldout = is_heldout(gid, self.ic.heldout_share)
        if heldout:  # (marked: a later revert's record goes where the accept's went, whatever the share is then)
            meta["h"] = 1
        # an accepted sample is kept beside its judgement, so a later revert can train the correction (or, held
        # out, send the gate the revert's reward for it)
        keep = sample if fb.kind == "accept" else b""
        out.writes[gid] = pack(JUDGED, now, meta, keep)
        if sample:
            self.emitter.emit(out, self._topic_heldout if heldout else self._topic_samples, gid, sample)
            if heldout:
                out.tally.inc("heldout_out")
            else:
                out.samples += 1
        out.tally.joined_kinds[fb.kind] += 1  # ("joined" is their sum, counted once per batch)
        if mixed:
            # No version may claim it: not in any version's live counters, per-user sums (keys.units) or anything
            # else the gate and the canary read. Its sample still trains (behaviour log-probs are per token).
            out.tally.inc("mixed_versions")
        else:
            out.tally.live.append((fb.feedback_id, version, fb.kind + guardrails, meta["b"], unit))
        out.tally.feedback_delays_s.append(now - fb.ts)

    @staticmethod
    def _count_again(out: Batch, meta: dict, t: float) -> None:
        """Count a redelivered judgement again in the live counters (idempotent: guarded by its feedback id)."""
        again = _counted_again(meta, t)
        if again is not None:  # (None: a generation of mixed versions, counted for no version)
            out.tally.live.append(again)

    def _get(self, gid: str, out: Batch) -> bytes | None:
        if gid in out.writes:
            return out.writes[gid]
        if gid in self.ahead:  # decided in an earlier batch that is not settled yet (None: deleted there)
            return self.ahead[gid]
        return self.table.get(gid)


def _edit_without_key(emitter, gid: str, rec: dict[str, Any], out: Batch, src) -> dict[str, Any]:
    """An edit sealed for a generation logged unsealed: no record holds a key to open it. Dead-lettered
    ``unsealable``; the generation is marked so (judged, no sample)."""
    emitter.dead(
        out, "unsealable", f"generation {gid}: its edit is sealed and the generation was logged unsealed", src, None
    )
    return {**rec, "x": "unsealable"}


def _open_sealed(keys, emitter, gid: str, unit, rec: dict[str, Any], body: bytes, fb: FeedbackEvent, out: Batch, src):
    """A sealed generation's record opened with its user's key and the sample sealed again (``ingest.sealing``):
    ``(rec, body, sealed)``; ``rec`` marked (``x``) forgotten when the key is destroyed, or dead-lettered with its
    reason when it cannot be opened."""
    if keys is None:
        raise KeyMissing(
            f"generation {gid} is sealed and this worker has no key-encryption key to open it: set "
            "security.shred_key to the deployment's shred.key (`liverl keys` made it; the gateways seal with it)"
        )
    if not isinstance(unit, str):  # (the gateway seals only what names its user)
        emitter.dead(out, "unsealable", f"generation {gid}: sealed without its unit", src, None)
        return {**rec, "x": "unsealable"}, body, None
    key = keys.get(unit)
    if key is None:
        return {**rec, "x": "forgotten"}, body, None
    try:
        body, sealed = sealed_sample(key, unit, body, fb, trainable=True)
    except (SealError, routing.RoutingError) as e:
        reason = "bad_routing" if isinstance(e, routing.RoutingError) else "unsealable"
        emitter.dead(out, reason, f"generation {gid}: {e}", src, None)
        return {**rec, "x": reason}, body, None
    return rec, body, sealed


def _misplaced(partitions: int | None, emitter, gid: str, src: Source, value: bytes | None, out: Batch) -> bool:
    """Dead-letter (``wrong_partition``) an input that is not on the partition its generation id hashes to.

    The join needs a generation and its feedback on the same partition (so one worker sees both): producers must
    key records by ``generation_id`` with Kafka's default partitioner (murmur2; librdkafka clients need
    ``partitioner=murmur2_random``). Misplaced input would join only while one worker owns every partition, and
    expire as ``unknown_generation`` once there are several; refusing it at once names the producer's mistake.
    """
    if partitions is None or src.partition is None:
        return False
    want = partition_of(gid.encode(), partitions)
    if want == src.partition:
        return False
    emitter.dead(
        out,
        "wrong_partition",
        f"generation {gid} belongs on partition {want} (murmur2 of the "
        f"generation id), not {src.partition}: key records by generation_id with Kafka's default "
        "partitioner (librdkafka: partitioner=murmur2_random)",
        src,
        value,
    )
    return True
