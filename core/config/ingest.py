"""The ingest worker: how feedback joins its generation into samples, and the reward of each judgement."""

from __future__ import annotations

from pydantic import Field

from core.config.base import Section


class RewardConfig(Section):
    accept: float = Field(default=0.75, description="Reward of an accepted generation (Cursor Tab uses +0.75).")
    reject: float = Field(default=-0.25, description="Reward of a rejected generation (Cursor Tab uses -0.25).")
    edit: float = Field(default=0.0, description="Reward of a generation the user had to edit.")
    revert: float = Field(
        default=-1.0,
        description="Reward of the correction a revert trains: an accepted generation the user later "
        "undid is trained again with this reward (the default cancels the accept's +0.75 and scores it as a reject).",
    )


class IngestConfig(Section):
    rewards: RewardConfig = Field(
        default_factory=RewardConfig,
        description="The reward of each judgement, for a product without its own reward shaping (product).",
    )
    pending_ttl_s: float = Field(
        default=150.0,
        gt=0,
        description="How long feedback waits for its generation record before it is "
        "dead-lettered (unknown_generation). Must exceed broker.delivery_timeout_s (every liverl producer's, set "
        "explicitly) by DELIVERY_MARGIN_S, checked when the config loads, or a record still being retried is given up "
        "on.",
    )
    web_port: int = Field(
        default=6066, description="Port of the ingest worker's web server (/metrics, /healthz; 0: off)."
    )
    store: str = Field(
        default="rocksdb",
        pattern="^(rocksdb|memory)$",
        description="Where the join table lives: 'rocksdb' (on disk "
        "under <state_dir>/ingest; a restart reads only the changelog's tail) or 'memory' (rebuilt from the whole "
        "changelog on every start).",
    )
    max_event_bytes: int = Field(
        default=512 * 1024,
        ge=1024,
        le=900_000,
        description="Inputs larger than this are dead-lettered (too_large) "
        "unparsed, with their first bytes and a sha256. Bounds every table entry and sample below the 1 MB record "
        "limit. The serving gateway reads it too: a generation record over it is logged without its token lists, "
        "untrainable (too_large), so its feedback is still joined and counted; give both the same value.",
    )
    max_pending: int = Field(
        default=100_000,
        ge=1,
        description="Most feedback events waiting for their generation at once (per worker); "
        "more are dead-lettered (pending_full), so a flood of feedback for unknown generations cannot exhaust memory.",
    )
    generation_ttl_s: float = Field(
        default=6 * 3600.0, gt=0, description="A generation record nobody judged within this is dropped (counted)."
    )
    redis_retry_s: float = Field(
        default=20.0,
        gt=0,
        description="How long a batch retries Redis before the ingest worker stops (exit code 75) "
        "without acknowledging it, to replay it after a restart.",
    )
    heldout_share: float = Field(
        default=0.05,
        ge=0.0,
        le=0.5,
        description="Share of joined samples (by a hash of the generation id, so a "
        "replay decides the same) sent to <prefix>.heldout instead of <prefix>.samples: the gate estimates each "
        "candidate's acceptance on them off-policy; the learner never trains on them. 0: none.",
    )
    judged_ttl_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="How long a judgement is remembered, so redelivered feedback is a "
        "duplicate and a second judgement is dead-lettered (already_judged).",
    )
    revert_sample_ttl_s: float = Field(
        default=900.0,
        ge=0,
        description="How long a judged accept keeps its sample in the join table, so that a "
        "revert within this time trains the correction (the sample again with rewards.revert); a later revert is "
        "counted but trains nothing (liverl_ingest_dropped{reason=revert_no_sample}). Bounds the table's disk: the "
        "judgement itself is kept judged_ttl_s, a few dozen bytes.",
    )
    train_reverts: bool = Field(
        default=True,
        description="Send the learner the correction a revert carries (the accepted sample again with "
        "rewards.revert). false: the learner's reward is the first judgement alone, so it chases raw acceptance and "
        "learns whatever users accept and later undo (reward hacking, as a product whose reverts never reach "
        "training); the revert is still counted (live counters, the canary's kept acceptance and revert-rate "
        "guardrail) and a held-out accept's revert still reaches the gate's off-policy check, so the gate's evidence "
        "is unchanged (liverl_ingest_dropped{reason=revert_not_trained}). The demo's learner runs so "
        "(liverl demo --chase-accepts), to give the gate exploiting candidates to catch.",
    )
    unit_ttl_s: float = Field(
        default=2 * 24 * 3600.0,
        gt=0,
        description="How long Redis keeps a version's per-user sums of one 10 s bucket "
        "of judgements (<prefix>:units:{<version>}:<bucket>, the canary's per-user evidence) after the bucket's last "
        "write. Longer than any canary plus its revert horizon.",
    )
