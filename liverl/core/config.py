"""Configuration: one class per component, composed into one root ``LiverlConfig``.

Loaded from one TOML file (``--config PATH`` or ``$LIVERL_CONFIG``) plus environment overrides of the
form ``LIVERL__SECTION__FIELD=value`` (for example ``LIVERL__LEARNER__LR=1e-4``,
``LIVERL__BROKER__BOOTSTRAP=kafka:9092``). Values from the environment are parsed as JSON when they
parse, else kept as strings. This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BrokerConfig(_Section):
    bootstrap: str | None = Field(
        default=None, description="Kafka bootstrap servers (host:port[,host:port]). None: start the embedded Tansu broker."
    )
    embedded_port: int = Field(default=19092, description="Port of the embedded broker on 127.0.0.1.")
    partitions: int = Field(default=2, ge=1, description="Partitions of each liverl topic when liverl creates it.")
    rebalance_timeout_s: float = Field(
        default=3.0, description="Consumer-group rebalance timeout; Tansu completes a join only after it (keep small)."
    )


class RedisConfig(_Section):
    url: str | None = Field(
        default=None,
        description="redis:// URL. None: use 127.0.0.1:6379 when it answers, else start a private redis-server.",
    )
    embedded_port: int = Field(default=16379, description="Port for a private redis-server when one is started.")


class RegistryConfig(_Section):
    url: str | None = Field(
        default=None, description="SQLAlchemy URL of the version registry. None: SQLite in <state_dir>/registry.db."
    )
    blob_dir: str | None = Field(
        default=None, description="Where snapshots and deltas live: a folder, or an S3-compatible store as "
        "s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL or ?endpoint_url=...). None: <state_dir>/blobs.")


class TopicsConfig(_Section):
    prefix: str = Field(default="liverl", description="Every topic and consumer group name starts with this.")

    @property
    def feedback(self) -> str:
        return f"{self.prefix}.feedback"

    @property
    def generations(self) -> str:
        return f"{self.prefix}.generations"

    @property
    def samples(self) -> str:
        return f"{self.prefix}.samples"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}.dead-letters"


class ModelConfig(_Section):
    path: str | None = Field(
        default=None, description="A Hugging Face causal-LM directory (config.json, safetensors, tokenizer with a chat "
        "template) that transformers and vLLM both load. None: the built-in demo policy (built from model.seed).")
    seed: int = Field(default=0, description="Seed of the base policy (weights, tokenizer, warm start).")
    cache_dir: str | None = Field(default=None, description="Where built base policies are cached. None: <state_dir>/models.")


class ServingConfig(_Section):
    host: str = Field(default="127.0.0.1", description="Interface the gateway and the vLLM node bind to.")
    gateway_port: int = Field(default=8000, description="Port of the OpenAI-compatible gateway.")
    vllm_port: int = Field(default=8100, description="Port of the vLLM node's own OpenAI server.")
    node_name: str = Field(default="node-0", description="Name of this serving node in logs and records.")
    max_num_seqs: int = Field(default=64, description="vLLM's concurrent sequence limit.")
    device: str = Field(default="auto", description="auto | cpu | cuda: which vLLM build serves.")
    swap_poll_s: float = Field(default=0.5, description="How often the agent checks the desired version.")
    log_wait_s: float = Field(
        default=0.0, ge=0.0, description="How long a response may wait for the broker to acknowledge its generation "
        "records. 0: it does not wait (records are queued before the response and delivered within milliseconds; "
        "a record Kafka refuses is counted in liverl_gateway_generation_log_failures).")


class RewardConfig(_Section):
    accept: float = Field(default=0.75, description="Reward of an accepted generation (Cursor Tab uses +0.75).")
    reject: float = Field(default=-0.25, description="Reward of a rejected generation (Cursor Tab uses -0.25).")
    edit: float = Field(default=0.0, description="Reward of a generation the user had to edit.")


class IngestConfig(_Section):
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    pending_ttl_s: float = Field(
        default=60.0, description="How long feedback waits for its generation record before it is dead-lettered."
    )
    web_port: int = Field(default=6066, description="Port of the faust worker's web server (metrics).")


class LearnerConfig(_Section):
    lr: float = Field(default=3e-4, description="AdamW learning rate.")
    batch_size: int = Field(default=64, description="Samples per policy-gradient update.")
    micro_epochs: int = Field(default=1, description="Passes over each batch.")
    tis_cap: float = Field(default=2.0, description="Truncated importance sampling cap C on pi/mu per token.")
    kl_coef: float = Field(default=0.05, description="Weight of the KL penalty to the base policy.")
    candidate_every_steps: int = Field(default=10, description="Emit a candidate version every this many updates.")
    max_staleness: int = Field(default=8, description="Drop samples whose policy version lags the learner by more.")
    kl_reference: str = Field(
        default="stable", pattern="^(stable|base)$",
        description="KL anchor: 'stable' (the version being served, moved on each promotion) or 'base' (version 0).",
    )
    kl_estimator: str = Field(
        default="full", pattern="^(full|k3)$",
        description="KL to the base policy: 'full' (exact over the vocabulary, per position) or 'k3' (sampled tokens).",
    )


class GateConfig(_Section):
    eval_prompts: int = Field(default=256, description="Held-out prompts per evaluation.")
    max_regression: float = Field(default=0.02, description="Refuse a candidate whose eval score drops more than this.")
    poll_s: float = Field(default=1.0, description="How often the gate looks for new candidates.")
    min_entropy: float = Field(
        default=0.05, description="Refuse a candidate whose mean first-token entropy (nats) is below this: a collapsed policy."
    )


class DemoConfig(_Section):
    duration_s: float = Field(default=600.0, description="How long the demo runs (the loop stops then).")
    users: int = Field(default=48, description="Concurrent simulated users.")
    final_window_s: float = Field(
        default=120.0, description="No new candidates in the last this many seconds, so the last promoted version is measured."
    )


class LiverlConfig(_Section):
    state_dir: str = Field(default=".liverl", description="Where logs, the registry, blobs and checkpoints live.")
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).resolve()

    @property
    def registry_url(self) -> str:
        return self.registry.url or f"sqlite:///{self.state_path / 'registry.db'}"

    @property
    def blob_location(self) -> str:
        """Where the blobs live: ``registry.blob_dir`` as written (a folder, ``file://`` or ``s3://`` URL), else
        ``<state_dir>/blobs``."""
        return self.registry.blob_dir or str(self.state_path / "blobs")

    @property
    def model_cache_path(self) -> Path:
        return Path(self.model.cache_dir) if self.model.cache_dir else self.state_path / "models"


ENV_PREFIX = "LIVERL__"


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def load_config(path: str | os.PathLike | None = None, env: dict[str, str] | None = None, **overrides: Any) -> LiverlConfig:
    """Build the root config from a TOML file, then ``LIVERL__A__B`` environment variables, then overrides."""
    env = os.environ if env is None else env
    path = path or env.get("LIVERL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        with p.open("rb") as f:
            data = tomllib.load(f)
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        parts = [s.lower() for s in key[len(ENV_PREFIX):].split("__")]
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        _set_path(data, parts, value)
    for dotted, value in overrides.items():
        _set_path(data, dotted.split("__"), value)
    return LiverlConfig.model_validate(data)
