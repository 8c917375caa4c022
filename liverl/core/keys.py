"""The Redis key space: every key liverl keeps in Redis, with a model for every record kept there.

Redis is the pipeline's second contract after the Kafka topics (``liverl.core.schemas``): the gate tells the
fleet what to serve, agents report what they serve, ingest keeps live counters, the learner publishes its
state. Every process builds its keys here and parses what it reads with these models, so a key or a field
is renamed in one place. Every key starts with the topic prefix (``cfg.topics.prefix``).

| key                              | type   | written by      | record                                    |
|----------------------------------|--------|-----------------|-------------------------------------------|
| ``<p>:desired``                  | string | gate, admin     | ``VersionAnnouncement`` (schemas)         |
| ``<p>:served:<node>``            | string | serving agent   | ``ServedHeartbeat`` (TTL: stale = gone)   |
| ``<p>:swaps``                    | list   | serving agent   | ``SwapRecord`` (capped, newest last)      |
| ``<p>:swap_errors``              | list   | serving agent   | ``SwapError`` (capped)                    |
| ``<p>:live:<version>``           | hash   | ingest          | kind -> count, ``events`` (live acceptance)|
| ``<p>:ingest:counters``          | hash   | ingest          | counter -> count (``dlq:<reason>`` etc.)  |
| ``<p>:counted:<feedback_id>``    | string | ingest          | guard: counted once (TTL)                 |
| ``<p>:learner``                  | hash   | learner         | field -> value (step, samples_trained...) |
| ``<p>:learner:hold``             | string | operator, demo  | "1": the learner trains but emits no candidates |
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

LIST_CAP = 1000
"""Lists (swaps, swap errors) keep at most this many entries, newest last."""


def desired(prefix: str) -> str:
    return f"{prefix}:desired"


def served(prefix: str, node: str) -> str:
    return f"{prefix}:served:{node}"


def served_pattern(prefix: str) -> str:
    return f"{prefix}:served:*"


def node_of_served(prefix: str, key: str | bytes) -> str:
    key = key.decode() if isinstance(key, bytes) else key
    return key.removeprefix(f"{prefix}:served:")


def swaps(prefix: str) -> str:
    return f"{prefix}:swaps"


def swap_errors(prefix: str) -> str:
    return f"{prefix}:swap_errors"


def live(prefix: str, version: int) -> str:
    return f"{prefix}:live:{version}"


def live_pattern(prefix: str) -> str:
    return f"{prefix}:live:*"


def version_of_live(key: str | bytes) -> int | None:
    key = key.decode() if isinstance(key, bytes) else key
    tail = key.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def ingest_counters(prefix: str) -> str:
    return f"{prefix}:ingest:counters"


def counted(prefix: str, feedback_id: str) -> str:
    return f"{prefix}:counted:{feedback_id}"


def learner(prefix: str) -> str:
    return f"{prefix}:learner"


def learner_hold(prefix: str) -> str:
    return f"{prefix}:learner:hold"


def learner_lease(prefix: str) -> str:
    """Who is this deployment's learner (a token with a TTL, renewed while it runs; see ``learner.lease``)."""
    return f"{prefix}:learner:lease"


def everything(prefix: str) -> str:
    """The pattern of every key of this prefix (a demo's reset)."""
    return f"{prefix}:*"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: str | bytes):
        return cls.model_validate_json(raw)


class ServedHeartbeat(_Record):
    """What a serving node serves, refreshed every agent poll; the key expires when the node stops."""

    version: int | None
    checksum: str | None
    ts: float = Field(default_factory=time.time)
    last_swap_pause_ms: float | None = None
    healthy: bool = True


class SwapRecord(_Record):
    """One hot-swap attempt on one node, with where its pause went."""

    node: str
    from_: int | None = Field(alias="from")
    to: int
    how: str
    deltas: int
    verify_ok: bool = False
    drain_ms: float | None = None
    vllm_pause_ms: float | None = None
    apply_ms: float | None = None
    pause_ms: float | None = None
    ts: float = Field(default_factory=time.time)

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)


class SwapErrorRecord(_Record):
    node: str
    from_: int | None = Field(alias="from")
    to: int
    error: str
    restored: bool
    ts: float = Field(default_factory=time.time)

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)
