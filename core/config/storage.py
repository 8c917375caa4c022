"""Where the pipeline's state lives: Redis, the version registry and its blobs, the base policy."""

from __future__ import annotations

from pydantic import Field

from core.config.base import Section


class RedisConfig(Section):
    url: str | None = Field(
        default=None,
        description="redis:// (rediss:// with TLS) URL of one Redis, or redis+cluster://host:port of any node of a "
        "Redis Cluster. None: use 127.0.0.1:6379 when it answers, else start a private redis-server.",
    )
    embedded_port: int = Field(default=16379, description="Port for a private redis-server when one is started.")
    password_file: str | None = Field(
        default=None,
        description="File holding the password of the Redis ACL user redis.url names "
        "(redis://liverl_gate@host:6379/0; `liverl keys` makes one per process, `liverl redis acl` makes the users). "
        "It replaces any password in the URL, so the URL in the config holds none. Needs redis.url. None: the URL "
        "as written.",
    )


class RegistryConfig(Section):
    url: str | None = Field(
        default=None, description="SQLAlchemy URL of the version registry. None: SQLite in <state_dir>/registry.db."
    )
    password_file: str | None = Field(
        default=None,
        description="File holding the password of the database role registry.url names "
        "(postgresql+psycopg://liverl_gate@db/liverl; `liverl keys` makes one per process, `liverl db roles` makes the "
        "roles and their grants). It replaces any password in the URL, so the URL in the config holds none. Needs "
        "registry.url. None: the URL as written.",
    )
    blob_dir: str | None = Field(
        default=None,
        description="Where snapshots and deltas live: a folder, or an S3-compatible store as "
        "s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL or ?endpoint_url=...). None: <state_dir>/blobs.",
    )


class ModelConfig(Section):
    path: str | None = Field(
        default=None,
        description="A Hugging Face causal-LM directory (config.json, safetensors, tokenizer with a chat "
        "template) that transformers and vLLM both load. None: the built-in demo policy (built from model.seed).",
    )
    seed: int = Field(default=0, description="Seed of the base policy (weights, tokenizer, warm start).")
    cache_dir: str | None = Field(
        default=None, description="Where built base policies are cached. None: <state_dir>/models."
    )
