"""The root config of every liverl process, composed of one section per component."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.config.base import url_with_password_file
from core.config.broker import BrokerConfig, TopicsConfig
from core.config.forget import ForgetConfig
from core.config.gate import GateConfig
from core.config.ingest import IngestConfig
from core.config.learner import LearnerConfig
from core.config.security import SecurityConfig
from core.config.serving import ServingConfig
from core.config.stack import DemoConfig, SupervisorConfig
from core.config.storage import ModelConfig, RedisConfig, RegistryConfig

DELIVERY_MARGIN_S = 30.0
"""How far ``ingest.pending_ttl_s`` must exceed ``broker.delivery_timeout_s`` (at most; a delivery timeout shorter than
this is its own margin, for tests with short TTLs): a record a producer still retries at its deadline reaches the
broker, then ingest, within this."""


class LiverlConfig(BaseSettings):
    """The root config of every liverl process (see ``load_config`` for where values come from)."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True)

    product: str | None = Field(
        default=None,
        description="Your product's liverl interface as 'module:attr' (a core.product.Product): "
        "reward shaping, an optional evaluation suite for the gate. None: rewards from [ingest.rewards], no suite.",
    )
    state_dir: str = Field(default=".liverl", description="Where logs, the registry, blobs and checkpoints live.")
    broker: BrokerConfig = Field(
        default_factory=BrokerConfig,
        description="The Kafka broker every process connects to: external (bootstrap) or the embedded Tansu, and how "
        "clients authenticate.",
    )
    redis: RedisConfig = Field(
        default_factory=RedisConfig,
        description="The Redis that holds the desired version and its announcements, node heartbeats, the "
        "learner's lease and the canary's per-user evidence.",
    )
    registry: RegistryConfig = Field(
        default_factory=RegistryConfig,
        description="The version registry (a SQL database) and the store of its snapshots and deltas.",
    )
    topics: TopicsConfig = Field(
        default_factory=TopicsConfig,
        description="The names and retention of the Kafka topics liverl creates.",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="The base policy every version descends from.",
    )
    serving: ServingConfig = Field(
        default_factory=ServingConfig,
        description="The serving nodes (gateway, vLLM node, swap agent) and the router in front of them.",
    )
    ingest: IngestConfig = Field(
        default_factory=IngestConfig,
        description="The ingest worker, which joins feedback to its generation into training samples.",
    )
    learner: LearnerConfig = Field(
        default_factory=LearnerConfig,
        description="The learner: the policy-gradient update, its candidates, checkpoints and load shedding.",
    )
    gate: GateConfig = Field(
        default_factory=GateConfig,
        description="The gate: the offline checks a candidate passes, and the canary that decides its promotion.",
    )
    forget: ForgetConfig = Field(
        default_factory=ForgetConfig,
        description="Forgetting a user (`liverl forget`, POST /v1/erasures): the policy for the versions that "
        "trained on them.",
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="Keys: announcement signing and verification, the router's assignment secret, the product's "
        "feedback key, the audit chain.",
    )
    supervisor: SupervisorConfig = Field(
        default_factory=SupervisorConfig,
        description="How `liverl up` and `liverl demo` restart a process that exits.",
    )
    demo: DemoConfig = Field(
        default_factory=DemoConfig,
        description="What `liverl demo` runs: its length, simulated users and their traffic.",
    )

    @model_validator(mode="after")
    def _timeouts_agree(self):
        delivery = self.broker.delivery_timeout_s
        margin = min(DELIVERY_MARGIN_S, delivery)
        if self.ingest.pending_ttl_s < delivery + margin:
            raise ValueError(
                f"ingest.pending_ttl_s ({self.ingest.pending_ttl_s:g} s) must exceed broker.delivery_timeout_s "
                f"({delivery:g} s) by at least {margin:g} s: feedback waits that long "
                "for its generation record, which a producer may still be retrying until its delivery timeout. Raise "
                "ingest.pending_ttl_s or lower broker.delivery_timeout_s"
            )
        lr, g = self.learner, self.gate
        if lr.entropy_floor > 0 and lr.entropy_coef > 0 and lr.entropy_floor <= g.min_entropy:
            raise ValueError(
                f"learner.entropy_floor ({lr.entropy_floor:g}) must be above gate.min_entropy ({g.min_entropy:g}): "
                "the learner's floor keeps its lineage out of the gate's collapse refusals only from above it. Raise "
                "learner.entropy_floor, lower gate.min_entropy, or set learner.entropy_floor = 0 to turn the floor off"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return (init_settings,)  # load_config composes TOML, environment and overrides, in that order

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).resolve()

    @property
    def registry_url(self) -> str:
        """``registry.url`` with the password of ``registry.password_file``, else SQLite in the state dir."""
        url = url_with_password_file(self.registry.url, self.registry.password_file, "registry")
        return url or f"sqlite:///{self.state_path / 'registry.db'}"

    @property
    def blob_location(self) -> str:
        """Where the blobs live: ``registry.blob_dir`` as written (a folder, ``file://`` or ``s3://`` URL), else
        ``<state_dir>/blobs``."""
        return self.registry.blob_dir or str(self.state_path / "blobs")

    @property
    def model_cache_path(self) -> Path:
        return Path(self.model.cache_dir) if self.model.cache_dir else self.state_path / "models"
