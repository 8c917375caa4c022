"""The wire contract: every message that crosses a process boundary in liverl.

Every stage imports these models; a change here is a change to a public API. The feedback event and the base of
every message live in the product's client package (``liverl_sdk.wire``), so that a product validates what it sends
with the very models ingest reads; they are re-exported here. Messages travel as
UTF-8 JSON (one object per Kafka record), keyed by ``generation_id`` on every topic that takes
part in the feedback/generation join, so that the join is co-partitioned. Non-Python producers use
the JSON Schemas that ``liverl schema`` prints (generated from these models).

Versioning: every message carries ``schema_version``. A consumer accepts the versions it knows
and dead-letters the rest with reason ``unsupported_schema_version``; additive, optional fields do
not bump the version.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

# re-exported: every stage imports the whole wire contract from this module
from liverl_sdk.wire import (  # noqa: F401
    SCHEMA_VERSION,
    FeedbackEvent,
    FeedbackKind,
    Id,
    Time,
    Wire,
    WireError,
    new_id,
)

_Wire = Wire
_Id = Id
_Time = Time
_Unit = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]  # (no '|', no '*')
_Finite = Annotated[float, Field(allow_inf_nan=False)]
_TokenId = Annotated[int, Field(ge=0, lt=2**31)]
_Version = Annotated[int, Field(ge=0, lt=2**63)]


class SamplingParams(_Wire):
    """The decoding a generation used: which distribution the behaviour log-probs belong to.

    Additive fields default to vLLM's neutral values, so older records still parse.
    """

    temperature: _Finite
    top_p: _Finite = 1.0
    top_k: int = Field(default=-1, description="-1 (or 0): no top-k truncation.")
    min_p: _Finite = 0.0
    presence_penalty: _Finite = 0.0
    frequency_penalty: _Finite = 0.0
    repetition_penalty: _Finite = 1.0
    seed: int | None = None
    max_tokens: int


class GenerationRecord(_Wire):
    """What the serving tier logs for every generation it returns.

    Topic ``<prefix>.generations``, key = ``generation_id``.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    generation_id: _Id
    policy_version: _Version = Field(description="The registry version whose weights produced every token.")
    node: str = Field(description="Which serving node produced it.")
    prompt: str
    completion: str
    prompt_token_ids: list[_TokenId]
    completion_token_ids: list[_TokenId]
    completion_logprobs: list[_Finite] = Field(
        description="Sampling log-prob of each completion token (behaviour policy)."
    )
    sampling: SamplingParams
    finish_reason: str | None = None
    trainable: bool = Field(
        default=True,
        description="False when the learner cannot treat this generation as a sample of the policy "
        "(greedy decoding, for one); it is served and logged, but never trained on.",
    )
    untrainable_reason: str | None = Field(default=None, max_length=64, description="Why not trainable, e.g. greedy.")
    latency_s: _Finite | None = Field(
        default=None,
        ge=0,
        le=86400,
        description="Seconds the version took to serve it: from the gateway admitting "
        "the request (after any wait behind a hot-swap, a deployment's cost) to this completion being done (the "
        "canary's latency guardrail). None: not timed.",
    )
    unit: _Unit | None = Field(
        default=None,
        description="Pseudonymous id of the user the generation was served to (the gateway's "
        "core.fleet.unit_id of the request's user key: 16 hex digits; never a user id itself): ingest keeps "
        "per-user sums by it, so the canary's test takes the user as its unit. None: no user key.",
    )
    sealed: str | None = Field(
        default=None,
        description="The record's text sealed under its user's data key (core.shred: prompt, completion, "
        "prompt_token_ids, completion_token_ids and routed_experts, AES-GCM, the unit as associated data): set on "
        "every record with a unit that the gateway logs with a key-encryption key (security.shred_key). Those plain "
        "fields are then empty (routed_experts None), and the checks that compare them (log-probs per completion "
        "token, version_spans) apply to the opened record (core.shred.open_record). Destroying the user's key makes "
        "it unreadable. None: the fields are plain.",
    )
    version_spans: list[tuple[_Version, int, int]] | None = Field(
        default=None,
        description="Set when a hot-swap happened while this generation was in flight: (version, start, "
        "end) for each run of completion tokens [start, end) one version sampled, in order, as vLLM recorded them "
        "(policy_version is then the first span's). An empty list: the spans could not be read, so no version may "
        "claim it. None: policy_version sampled every token. See mixed_versions.",
    )
    completion_tokens: int | None = Field(
        default=None,
        ge=0,
        description="The completion's length in tokens, set only on a record logged without its text, token ids and "
        "log-probs (untrainable_reason 'too_large': the whole record was over ingest.max_event_bytes), so its "
        "judgement still counts, at its true length, in the live counters. None: len(completion_token_ids).",
    )
    routed_experts: str | None = Field(
        default=None,
        description="The experts the server's router chose for each position of the sequence and each MoE layer "
        "(core.routing: a base64 blob; prompt and completion positions but the last token's), for the learner's "
        "routing replay (learner.routing_replay). Ingest dead-letters a record whose routing does not decode "
        "(bad_routing). None: not recorded (a dense model, or a server that does not capture it).",
    )
    ts: _Time = Field(default_factory=time.time)

    @property
    def mixed_versions(self) -> bool:
        """True unless one version sampled every token: such a generation must not count for any one version (live
        counters, a canary's arms); its per-token behaviour log-probs stay exact for the learner."""
        return self.version_spans is not None and len({v for v, _, _ in self.version_spans}) != 1

    @model_validator(mode="after")
    def _aligned(self):
        if self.sealed is not None:
            _check_sealed(self, ("prompt", "completion", "prompt_token_ids", "completion_token_ids", "routed_experts"))
            return self
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"{len(self.completion_logprobs)} logprobs for {len(self.completion_token_ids)} completion tokens"
            )
        if self.version_spans:
            ends = [0] + [e for _, _, e in self.version_spans]
            if (
                [s for _, s, _ in self.version_spans] != ends[:-1]
                or ends[-1] != len(self.completion_token_ids)
                or any(s >= e for _, s, e in self.version_spans)
            ):
                raise ValueError(
                    f"version_spans {self.version_spans} do not tile the "
                    f"{len(self.completion_token_ids)} completion tokens"
                )
        return self


def _check_sealed(msg, plain: tuple[str, ...]) -> None:
    if msg.unit is None:
        raise ValueError("a sealed message names its unit (the sealed text opens only under that unit's key)")
    if set_ := [f for f in plain if getattr(msg, f)]:
        raise ValueError(f"a sealed message carries its text only sealed: {', '.join(set_)} must be empty")


class TrainingSample(_Wire):
    """One generation joined with its (first) feedback and shaped into a reward.

    Topic ``<prefix>.samples``, key = ``generation_id``. ``sample_id`` equals the generation id: a
    generation is trained on at most once, whatever the number of feedback events about it.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    sample_id: _Id
    generation_id: _Id
    feedback_id: _Id
    policy_version: _Version
    kind: FeedbackKind
    reward: _Finite
    segment: str | None = None
    prompt_token_ids: list[_TokenId]
    completion_token_ids: list[_TokenId]
    behaviour_logprobs: list[_Finite]
    sampling: SamplingParams | None = Field(default=None, description="The decoding that produced the completion.")
    routed_experts: str | None = Field(
        default=None,
        description="The generation's routing as the server recorded it (GenerationRecord.routed_experts): the "
        "learner replays it with learner.routing_replay = 'rollout'. None: trained on the learner's own routing.",
    )
    edited_text: str | None = None
    ts_generation: _Time
    ts_feedback: _Time = Field(description="When the user gave the feedback, by the product's clock (its event's ts).")
    ts_joined: _Time | None = Field(
        default=None,
        description="When ingest joined the feedback with its generation, by ingest's clock: the learner measures its "
        "backlog from it (learner.max_backlog_s), never from the product's ts_feedback, which may be minutes or "
        "days old when the product forwards late. None: a sample written without it (ts_feedback is used).",
    )
    unit: _Unit | None = Field(
        default=None,
        description="The user the generation was served to (GenerationRecord.unit). None: no user key, or a sample "
        "written without it.",
    )
    sealed: str | None = Field(
        default=None,
        description="The sample's text sealed under its user's data key (core.shred: prompt_token_ids, "
        "completion_token_ids, routed_experts and edited_text), as ingest seals every sample of a sealed generation; "
        "those plain fields are then empty. The learner and the gate open it right before they use it "
        "(core.shred.open_sample) and skip it, counted as forgotten, once the key is destroyed. None: plain.",
    )

    @model_validator(mode="after")
    def _sealed_alone(self):
        if self.sealed is not None:
            _check_sealed(self, ("prompt_token_ids", "completion_token_ids", "routed_experts", "edited_text"))
        return self


class DeadLetter(_Wire):
    """An input that was refused, with why. Topic ``<prefix>.dead-letters``, key = the input's key."""

    schema_version: Literal[1] = SCHEMA_VERSION
    reason: str = Field(description="Short countable code, e.g. malformed_json, unknown_generation.")
    detail: str
    source_topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    value: str = Field(
        description="The refused value, decoded as UTF-8 with replacement characters "
        "(cut to its first characters when value_truncated)."
    )
    value_truncated: bool = Field(default=False, description="value holds only the start of the refused value.")
    value_size: int | None = Field(default=None, description="Size of the refused value in bytes.")
    value_sha256: str | None = Field(default=None, description="sha256 of the refused value's bytes (hex).")
    ts: float = Field(default_factory=time.time)


AnnouncementChannel = Literal["desired", "canary"]
"""``desired``: what every node serves (``<prefix>:desired``); ``canary``: what the nodes a rollout names serve
(``<prefix>:canary``, with the rollout's terms)."""

_NodeName = Annotated[str, Field(min_length=1, max_length=128)]


class RolloutTerms(_Wire):
    """A canary rollout's terms, signed inside its announcement (``VersionAnnouncement.rollout``): the agents and the
    router act on these, never on the unsigned ``<prefix>:rollout`` plan (display only)."""

    rollout_id: int = Field(ge=0, lt=2**63, description="The rollout's id (salts the users' buckets, core.fleet).")
    share: float = Field(
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Share of users (or of requests) sent to "
        "the canary nodes, in (0, 1] as the registry's rollout has it.",
    )
    nodes: list[_NodeName] = Field(
        min_length=1,
        max_length=1024,
        description="The nodes that serve the canary, by name; every other node serves the desired version.",
    )
    unit: Literal["user", "request"] = Field(
        description="What is assigned to an arm: each user for the whole rollout, "
        "or each request afresh (gate.canary_unit)."
    )


class VersionAnnouncement(_Wire):
    """The release gate's word on which version a fleet channel should serve (kept in Redis at
    ``<prefix>:<channel>``). The signature covers every other field, so a signed announcement is bound to its channel,
    its deployment (``prefix``), its expiry and, on the canary channel, to the rollout's terms; readers
    (``core.fleet.check_announcement``) refuse one read from another key, another deployment's, an expired one,
    and one older than the newest they accepted (a replay: by ``seq``, the registry's audit sequence)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    version: int = Field(ge=0)
    checksum: str = Field(description="sha256 of the version's canonical weights (see deploy.registry.delta).")
    reason: str = Field(default="", max_length=1024)
    ts: float = Field(default_factory=time.time)
    channel: AnnouncementChannel = Field(
        default="desired", description="The channel it was announced on; valid only under <prefix>:<channel>."
    )
    prefix: str | None = Field(
        default=None,
        max_length=256,
        description="The deployment's topics prefix (topics.prefix) it was announced "
        "for. None (an announcement bound to no deployment) is refused by every reader.",
    )
    expires_at: _Time | None = Field(
        default=None,
        description="Unix seconds after which readers refuse it (security.announce_ttl_s after ts; the "
        "gate re-announces before half of it is left). None is refused by every reader.",
    )
    rollout: RolloutTerms | None = Field(
        default=None, description="The rollout's terms: required on the canary channel, absent on desired."
    )
    seq: int | None = Field(
        default=None,
        ge=0,
        description="The registry's audit sequence when it was signed (the newest audit entry's id, read before the "
        "state announced): readers refuse one with a lower seq than one they accepted on the channel (a replay), "
        "whatever the signers' clocks. None: unsequenced (ordered by ts; left out of the JSON, so announcements "
        "signed without it verify as they were signed).",
    )
    signature: str | None = Field(
        default=None,
        max_length=256,
        description="Ed25519 signature (base64) by the release tier over every other "
        "field; agents that hold the public key serve nothing unsigned (see deploy.registry.signing).",
    )

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude={"seq"} if self.seq is None else None).encode()

    @model_validator(mode="after")
    def _terms_on_the_canary_channel(self):
        if self.channel == "canary" and self.rollout is None:
            raise ValueError("a canary announcement carries the rollout's terms (rollout)")
        if self.channel == "desired" and self.rollout is not None:
            raise ValueError("a desired announcement carries no rollout terms")
        return self


WIRE_MODELS: dict[str, type[_Wire]] = {
    "feedback": FeedbackEvent,
    "generation": GenerationRecord,
    "sample": TrainingSample,
    "dead_letter": DeadLetter,
    "version": VersionAnnouncement,
}


def json_schemas() -> dict[str, Any]:
    """JSON Schema of every wire message, for producers that are not written in Python."""
    return {name: model.model_json_schema() for name, model in WIRE_MODELS.items()}
