"""Sealed generations in the join: their users' keys, a batch at a time, and the sealed sample.

A generation the gateway sealed (``GenerationRecord.sealed``, ``core.shred``) stays sealed in its waiting entry, so
the join table and its changelog hold no text. When feedback joins it, the join opens it in memory with the user's key
and seals the sample (its token ids, routing and the user's edit) under the same key. An edit the product sealed
(``FeedbackEvent.edited_sealed``, ``liverl_sdk.edits``) opens with the edit key the generation's sealed record holds.
The keys of a batch are read in one query before it is decided (``BatchKeys.prefetch``: the users of the waiting
generations its feedback names, and of the generations it brings for feedback already waiting), on a thread of the
worker's own (``Ingest.prefetch_keys``), so a registry database slow to answer or cut off holds up that batch but not
the event loop that heartbeats to the consumer group; a user met only while deciding is read on its own.

A user whose key is gone was forgotten: the join still records the judgement (a redelivery stays a duplicate, the
live counters count it), makes no sample and dead-letters the feedback ``forgotten`` with none of its value, so
``liverl audit`` gives it that fate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from pydantic_core import from_json, to_json

from core import routing
from core.schemas import FeedbackEvent
from core.shred import EDIT_KEY, SealError, UserKeys, open_sealed, seal
from ingest.entry import PENDING, WAITING, unpack
from ingest.records import Source, key_text
from liverl_sdk.edits import EditSealError, open_edit

_UNIT = re.compile(rb'"unit":"([A-Za-z0-9_.:\-]{1,64})"')


class BatchKeys:
    """The users' data keys a batch needs: one query per batch, and one per user it did not foresee."""

    def __init__(self, keys: UserKeys):
        self.keys = keys
        self._batch: dict[str, bytes] = {}
        self._asked: set[str] = set()
        self.queries = 0

    def prefetch(self, units: Iterable[str]) -> None:
        self._asked = set(units)
        self._batch = self.keys.keys_for(self._asked) if self._asked else {}
        self.queries += bool(self._asked)

    def get(self, unit: str) -> bytes | None:
        """``unit``'s key, None when it has none (forgotten)."""
        if unit not in self._asked:
            self._asked.add(unit)
            self.queries += 1
            self._batch.update(self.keys.keys_for([unit]))
        return self._batch.get(unit)


def units_needed(events: Sequence[tuple[Source, bytes | None]], get, gen_topic: str) -> set[str]:
    """The users whose keys deciding ``events`` will need, as far as it can be told before deciding: the unit of each
    sealed waiting generation a feedback event names, and of each sealed generation that feedback in this batch or in
    the table waits for. ``get``: the join's read of an entry (the batch's own writes, those ahead, the table)."""
    units: set[str] = set()
    feedback_for: set[str] = set()
    for src, _ in events:
        if src.topic == gen_topic:
            continue
        gid = key_text(src.key)
        if gid is None:
            continue
        feedback_for.add(gid)
        entry = get(gid)
        if entry and entry[:1] == WAITING:
            meta = unpack(entry)[2]
            if meta.get("s") and meta.get("u"):
                units.add(meta["u"])
    for src, value in events:
        if src.topic != gen_topic or not value or b'"sealed":"' not in value:
            continue
        gid = key_text(src.key)
        if gid is None:
            continue
        if gid in feedback_for or ((entry := get(gid)) and entry[:1] == PENDING):
            m = _UNIT.search(value)
            if m:
                units.add(m.group(1).decode())
    return units


def sealed_sample(key: bytes, unit: str, body: bytes, fb: FeedbackEvent, trainable: bool) -> tuple[bytes, str]:
    """A sealed waiting entry's ``body`` opened with ``key``, and the sample's sealed text: (the sample's middle
    fields with its text empty, the sealed text with the user's edit, opened with the generation's edit key when the
    product sealed it). Raises ``core.shred.SealError`` when the record or the edit does not open,
    ``core.routing.RoutingError`` when a trainable generation's routing does not decode."""
    fields = from_json(b"{" + body + b"}")
    text = open_sealed(key, unit, fields.pop("sealed"))
    edited_text = fb.edited_text
    if fb.edited_sealed is not None:
        edit_key = text.get(EDIT_KEY)
        if not isinstance(edit_key, str):
            raise SealError(f"an edit sealed for generation {fb.generation_id}, which was logged without an edit key")
        try:
            edited_text = open_edit(edit_key, fb.generation_id, fb.edited_sealed)
        except EditSealError as e:
            raise SealError(str(e)) from None
    prompt, completion = text.get("prompt_token_ids", []), text.get("completion_token_ids", [])
    routed = text.get("routed_experts")
    if trainable and routed is not None:  # the learner would replay it: refused here, never a sample
        routing.check_text(routed, len(prompt) + len(completion) - 1)
    sealed = seal(
        key,
        unit,
        {
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "routed_experts": routed,
            "edited_text": edited_text,
        },
    )
    return to_json(fields)[1:-1], sealed
