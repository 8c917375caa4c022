"""Keys: announcement signing, the router's assignment secret, the product's feedback key, the audit chain."""

from __future__ import annotations

from pydantic import Field

from core.config.base import Section


class SecurityConfig(Section):
    signing_key: str | None = Field(
        default=None,
        description="Ed25519 private key (PEM) that signs version announcements; only the gate and "
        "operators need it. None: <state_dir>/keys/announce.key when it exists (liverl up makes one).",
    )
    verify_key: str | None = Field(
        default=None,
        description="Ed25519 public key (PEM) serving agents verify announcements with; when set (or "
        "<state_dir>/keys/announce.pub exists) an unsigned or wrongly signed announcement is refused. `liverl serve` "
        "refuses to start without one unless allow_unsigned is set.",
    )
    allow_unsigned: bool = Field(
        default=False,
        description="UNSAFE: let `liverl serve` run without a verify key (its agent then follows any "
        "announcement written to Redis, signed or not) and the gate announce without a signing key. Only for a "
        "closed test setup where every Redis writer is trusted; with a key present it is still used.",
    )
    announce_ttl_s: float = Field(
        default=600.0,
        ge=10.0,
        allow_inf_nan=False,
        description="How long a version announcement is valid after it "
        "was signed (its expires_at); readers refuse an expired one, and the gate re-announces when less than half is "
        "left, so keep it well above 2 x gate.poll_s. Nodes' and the gate's clocks must agree to a small part of it. "
        "With the gate down longer than this, every announcement expires: each agent then follows the last desired "
        "announcement it verified (kept on disk across restarts, its version still checked against the registry), "
        "so a node that restarts returns to the stable version; `liverl abort` withdraws a canary itself.",
    )
    assignment_key: str | None = Field(
        default=None,
        description="File holding the router's secret for assigning users to a rollout's arms (at least "
        "16 bytes, random; every router of a fleet reads the same one, and nothing else needs it). None: "
        "<state_dir>/keys/assignment.key (liverl up makes one, mode 0600). `liverl route` refuses to start without it.",
    )
    feedback_key: str | None = Field(
        default=None,
        description="File holding the product key(s) POST /v1/feedback requires in its "
        "X-Liverl-Product-Key header (one key a line, each at least 16 characters; several lines let a key be "
        "rotated). None: <state_dir>/keys/feedback.key (liverl up makes one, mode 0600); with neither, the gateway "
        "refuses feedback over HTTP (publish it to Kafka instead).",
    )
    shred_key: str | None = Field(
        default=None,
        description="File holding the key-encryption key (at least 32 random bytes) that wraps each user's data key "
        "in the registry's user_keys table (core.shred): the serving nodes seal users' text under those keys, ingest, "
        "the learner and the gate open it, the admin role destroys a key to forget a user. Never stored in the "
        "database, never rotated in place (a new one forgets every user). None: <state_dir>/keys/shred.key when it "
        "exists (liverl up and liverl keys make one, mode 0600); with neither, nothing is sealed and no user can be "
        "forgotten (each process says so at start).",
    )
    audit_key: str | None = Field(
        default=None,
        description="File holding the secret (at least 32 bytes) that keys the audit log's chain "
        "(HMAC-SHA256) and its head anchored in Redis; never stored in the database. Every process that writes the "
        "registry, and `liverl history --verify`, reads the same one. None: <state_dir>/keys/audit.key when it exists "
        "(liverl up makes one, mode 0600). Without a key the log is chained by plain hash only, and a registry whose "
        "log is keyed refuses writes from a process without it.",
    )
