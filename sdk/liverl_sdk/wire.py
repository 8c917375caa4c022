"""The feedback event's wire contract: what a product publishes to ``<prefix>.feedback``, and the base every liverl
wire message shares (strict JSON, an exact ``schema_version``, countable ``WireError`` reasons).

The server's wire module (``core.schemas``) builds its other messages on ``Wire`` and re-exports ``FeedbackEvent``:
one definition, which the product's client and the ingest worker both validate against.

Versioning: every message carries ``schema_version``. A consumer accepts the versions it knows and dead-letters the
rest with reason ``unsupported_schema_version``; additive, optional fields do not bump the version.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMA_VERSION: Literal[1] = 1

FeedbackKind = Literal["accept", "reject", "edit", "revert"]
"""accept, reject, edit judge a generation (its first judgement trains); revert is a follow-up on an accepted one (the
user undid or rewrote it later): counted per version as the gate's kept rate, and, when the accept trained, trained
again as a correction (sample id ``<generation>:revert``, reward ``ingest.rewards.revert``)."""

Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]
# Unix seconds in 2000..2100: no NaN, no infinities, nothing a clock could not have said.
Time = Annotated[float, Field(allow_inf_nan=False, ge=946_684_800.0, le=4_102_444_800.0)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("schema_version", mode="before", check_fields=False)
    @classmethod
    def _exact_version(cls, v):
        # pydantic's Literal[1] takes true and 1.0 too (strict mode included):
        # the version is the integer 1, nothing else
        if type(v) is not int or v != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be the integer {SCHEMA_VERSION}")
        return v

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str | None):
        """Parse one wire message; raises ``WireError`` with a machine-readable reason, for any input (``None``,
        a record without a value, is ``empty``).

        Only UTF-8 without a byte order mark is JSON here (RFC 8259): other encodings, nesting too deep for
        the parser and integers too long to convert are ``malformed_json``, never an exception of another kind.

        Fast path: pydantic's own JSON parser in strict mode (a third of the time of ``json.loads`` plus validation;
        the ingest join parses every record). Whatever it refuses goes through the lax path below, which accepts what
        it always did and names the reason; what strict mode accepts, the lax path would accept with the same value.
        """
        if raw is None:  # a Kafka record without a value (a tombstone): a refusal its reader counts, not a crash
            raise WireError("empty", "a record without a value (tombstone)")
        if not isinstance(raw, (bytes, bytearray, str)):
            raise WireError("malformed_json", f"expected bytes or text, got {type(raw).__name__}")
        try:  # (the validator itself: what model_validate_json calls, without its Python frame)
            return cls.__pydantic_validator__.validate_json(raw, strict=True)
        except (ValidationError, ValueError, RecursionError):
            pass
        try:
            text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
            if text.startswith("\ufeff"):
                raise WireError("malformed_json", "a byte order mark before the JSON (send UTF-8 without one)")
            data = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            if isinstance(e, WireError):
                raise
            raise WireError("malformed_json", f"{type(e).__name__}: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise WireError("not_an_object", f"expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version", SCHEMA_VERSION)
        if type(version) is not int or version != SCHEMA_VERSION:  # strict: true and 1.0 are not 1
            shown = repr(version) if isinstance(version, (int, float, bool)) else type(version).__name__
            raise WireError(
                "unsupported_schema_version", f"schema_version {shown[:40]} (this build reads {SCHEMA_VERSION})"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise WireError("invalid_field", f"{where[:200]}: {first['msg'][:300]}") from None


class WireError(ValueError):
    """A message that does not match the wire contract. ``reason`` is a short, countable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


EDIT_MAX_CHARS = 65536
"""The longest edit an event carries, in characters."""
SEALED_EDIT_MAX = len("lve1.") + 4 * -(-(4 * EDIT_MAX_CHARS + 28) // 3)
"""The longest sealed edit: such an edit's UTF-8 (4 bytes a character at most), nonce and tag, in base64."""


def new_id() -> str:
    return uuid.uuid4().hex


class FeedbackEvent(Wire):
    """A user's judgement of one generation, published by the product backend (SDK or any Kafka client).

    Topic ``<prefix>.feedback``, key = ``generation_id``.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    feedback_id: Id = Field(description="Idempotency key: the same feedback_id is counted and trained on once.")
    generation_id: Id = Field(description="The id the gateway returned with the generation being judged.")
    kind: FeedbackKind = Field(
        description="accept | reject | edit, or revert: a later follow-up on an accepted "
        "generation (the user undid it); its own feedback_id, the same generation_id"
    )
    edited_text: str | None = Field(
        default=None,
        max_length=EDIT_MAX_CHARS,
        description="The user's corrected completion; with kind edit, this or edited_sealed.",
    )
    edited_sealed: str | None = Field(
        default=None,
        max_length=SEALED_EDIT_MAX,
        pattern=r"^lve1\.[A-Za-z0-9+/=]+$",
        description="The user's corrected completion sealed under the generation's edit key (liverl_sdk.edits: "
        "the gateway returns one with each generation of a user it can forget); with kind edit, this or edited_text.",
    )
    segment: str | None = Field(
        default=None, max_length=64, description="Optional coarse user segment (never a user id)."
    )
    ts: Time = Field(default_factory=time.time, description="Unix seconds when the user gave the feedback.")

    @model_validator(mode="after")
    def _edit_needs_text(self):
        given = [f for f in ("edited_text", "edited_sealed") if getattr(self, f) is not None]
        if self.kind == "edit" and len(given) != 1:
            raise ValueError("kind 'edit' needs edited_text or edited_sealed (exactly one)")
        if self.kind != "edit" and given:
            raise ValueError(f"{given[0]} is only allowed with kind 'edit', not {self.kind!r}")
        return self
