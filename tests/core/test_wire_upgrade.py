"""The upgrade policy's wire half (docs/deploy.md, "Upgrades"): what the previous release wrote, this release reads;
what this release adds is optional; and a reader refuses a field it does not know, which is why readers upgrade
before writers."""

from __future__ import annotations

import json

import pytest

from core.fleet import VersionAnnouncement
from core.schemas import GenerationRecord, TrainingSample, WireError

# as the previous release wrote them: the same messages without the fields this release added
PREVIOUS = {
    GenerationRecord: (
        '{"schema_version": 1, "generation_id": "gen-1", "policy_version": 0, "node": "node-0", "prompt": "1+2=", '
        '"completion": "3", "prompt_token_ids": [1, 2], "completion_token_ids": [3], "completion_logprobs": [-0.5], '
        '"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, '
        '"frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": null, "max_tokens": 4}, "finish_reason": null, '
        '"trainable": true, "untrainable_reason": null, "latency_s": null, "unit": null, "version_spans": null, '
        '"ts": 1764000000.0}'
    ),
    TrainingSample: (
        '{"schema_version": 1, "sample_id": "gen-1", "generation_id": "gen-1", "feedback_id": "fb-1", '
        '"policy_version": 0, "kind": "accept", "reward": 1.0, "segment": null, "prompt_token_ids": [1, 2], '
        '"completion_token_ids": [3], "behaviour_logprobs": [-0.5], "sampling": null, "edited_text": null, '
        '"ts_generation": 1764000000.0, "ts_feedback": 1764000005.0}'
    ),
    VersionAnnouncement: (
        '{"schema_version":1,"version":3,"checksum":"' + "ab" * 32 + '","reason":"gate passed","ts":1764000000.0,'
        '"channel":"desired","prefix":null,"expires_at":null,"rollout":null,"signature":null}'
    ),
}
ADDED = {
    GenerationRecord: ("completion_tokens", "routed_experts", "sealed"),
    TrainingSample: ("ts_joined", "routed_experts", "unit", "sealed"),
    VersionAnnouncement: ("seq",),
}


@pytest.mark.parametrize("model", list(PREVIOUS), ids=lambda m: m.__name__)
def test_what_the_previous_release_wrote_is_read_and_its_added_fields_are_optional(model):
    msg = model.from_bytes(PREVIOUS[model])
    assert all(getattr(msg, name) is None for name in ADDED[model])
    again = json.loads(msg.to_bytes())
    assert {k: v for k, v in again.items() if k not in ADDED[model]} == json.loads(PREVIOUS[model])


@pytest.mark.parametrize("model", list(PREVIOUS), ids=lambda m: m.__name__)
def test_a_reader_refuses_a_field_it_does_not_know(model):
    newer = json.loads(PREVIOUS[model]) | {"a_field_of_a_later_release": 1}
    with pytest.raises(WireError):
        model.from_bytes(json.dumps(newer))
