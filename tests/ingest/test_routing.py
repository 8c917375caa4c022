"""A generation's routing (``GenerationRecord.routed_experts``) through the join: carried into its sample whole, or,
when it does not decode for the record's tokens, the record is dead-lettered ``bad_routing`` and never trained."""

from __future__ import annotations

import numpy as np

from core import routing
from core.schemas import DeadLetter, FeedbackEvent, GenerationRecord, TrainingSample
from ingest.join import Source
from tests.ingest.conftest import make_generation
from tests.ingest.test_fuzz import _ingest, world  # noqa: F401 world: the fixture


def _record(gid: str, blob: bytes | None) -> GenerationRecord:
    rec = make_generation(gid, 1)
    return rec.model_copy(update={"routed_experts": None if blob is None else routing.to_text(blob)})


def _blob(positions: int) -> bytes:
    return routing.encode(np.tile([2, 0], (positions, 2, 1)), 4)


def test_routing_reaches_the_sample_and_bad_routing_is_dead_lettered(world):  # noqa: F811 the fixture
    cfg, _, loop = world
    ing, broker = _ingest(world)
    n = len(make_generation("x", 1).prompt_token_ids) + len(make_generation("x", 1).completion_token_ids) - 1
    good = _blob(n)
    records = {
        "g-good": _record("g-good", good),
        "g-none": _record("g-none", None),
        "g-truncated": _record("g-truncated", good[:-1]),
        "g-short": _record("g-short", _blob(n - 1)),
        "g-flipped": _record("g-flipped", good[:-1] + bytes([good[-1] ^ 4])),
    }
    bad = records["g-good"].model_dump()
    bad.update(generation_id="g-text", routed_experts="%%%")
    records["g-text"] = GenerationRecord.model_validate(bad)
    gens = [(Source(cfg.topics.generations, 0, i, gid), rec.to_bytes()) for i, (gid, rec) in enumerate(records.items())]
    loop.run_until_complete(ing.process(gens))
    fbs = [
        (
            Source(cfg.topics.feedback, 0, i, gid),
            FeedbackEvent(feedback_id=f"f-{gid}", generation_id=gid, kind="accept").to_bytes(),
        )
        for i, gid in enumerate(records)
    ]
    loop.run_until_complete(ing.process(fbs))
    samples = {k: TrainingSample.from_bytes(v) for k, v in broker.of(cfg.topics.samples)}
    assert sorted(samples) == ["g-good", "g-none"]
    assert samples["g-good"].routed_experts == routing.to_text(good)
    assert samples["g-none"].routed_experts is None
    dead = [DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters)]
    by_key = {d.key: d for d in dead if d.reason == "bad_routing"}
    assert sorted(by_key) == ["g-flipped", "g-short", "g-text", "g-truncated"]
    assert "truncated" in by_key["g-truncated"].detail
    assert f"holds {n - 1} positions, expected {n}" in by_key["g-short"].detail
    assert "CRC-32" in by_key["g-flipped"].detail
    assert "not base64" in by_key["g-text"].detail
