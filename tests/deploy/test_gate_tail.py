"""The gate's tails of logged traffic, without a broker: what a record's content can and cannot do to them."""

from __future__ import annotations

import pytest

from core.schemas import (
    DeadLetter,
    FeedbackEvent,
    GenerationRecord,
    SamplingParams,
    TrainingSample,
    VersionAnnouncement,
    WireError,
)
from deploy.gate.tail import PROBE_UNIT_SHARE, GenerationTail, parse_generation, parse_heldout


def generation(gid: str, unit: str | None = None) -> bytes:
    return GenerationRecord(
        unit=unit,
        generation_id=gid,
        policy_version=0,
        node="node-0",
        prompt="p",
        completion="c",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
        sampling=SamplingParams(temperature=1.0, max_tokens=4),
    ).to_bytes()


MODELS = [GenerationRecord, TrainingSample, FeedbackEvent, DeadLetter, VersionAnnouncement]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("raw", [None, 5, [b"{}"], object()], ids=["none", "int", "list", "object"])
def test_every_wire_model_refuses_a_value_that_is_not_bytes_with_a_wire_error(model, raw):
    """Whatever a reader hands ``from_bytes`` (a record without a value, a client's odd type), the answer is a
    ``WireError`` with a countable reason, the one refusal every reader catches."""
    with pytest.raises(WireError) as e:
        model.from_bytes(raw)
    assert e.value.reason == ("empty" if raw is None else "malformed_json")


def test_a_record_without_a_value_is_refused_and_the_tail_keeps_what_it_holds():
    """A tombstone on the generations or held-out topic is counted as refused; the tail keeps its records and its
    thread (a parse error of another kind would reopen the tail and drop every probe it held)."""
    tail = GenerationTail("unused:9092", "t", size=3)
    tail._add(generation("g1"))
    tail._add(None)
    tail._add(generation("g2"))
    assert tail.refused == 1 and len(tail()) == 2
    with pytest.raises(WireError):
        parse_generation(None)
    with pytest.raises(WireError):
        parse_heldout(None)


def test_the_heaviest_user_holds_at_most_its_share_of_the_probes():
    """One user sends twenty times the requests of everyone else together: the probes still come from every user,
    that user's newest ones making at most ``PROBE_UNIT_SHARE`` of them. Generations without a unit are not capped."""
    capped = GenerationTail("unused:9092", "t", size=64, unit_share=PROBE_UNIT_SHARE)
    plain = GenerationTail("unused:9092", "t", size=64)
    for i in range(100):
        for tail in (capped, plain):
            tail._add(generation(f"light-{i}", unit=f"{i:016x}"))
            for j in range(20):
                tail._add(generation(f"heavy-{i}-{j}", unit="f" * 16))
    heavy = [g for g in capped() if g.unit == "f" * 16]
    assert len(capped()) == 64 and len(heavy) == 64 // 16
    assert sum(g.unit == "f" * 16 for g in plain()) > 60  # the newest 64: nearly all the heavy user's
    assert len({g.unit for g in capped()}) == 61  # the newest 60 light users, and the heavy one
    anonymous = GenerationTail("unused:9092", "t", size=8, unit_share=PROBE_UNIT_SHARE)
    for i in range(20):
        anonymous._add(generation(f"a-{i}"))
    assert len(anonymous()) == 8
