"""Configuration: one class per component, composed into one root ``LiverlConfig``.

Loaded (with pydantic-settings) from one TOML file (``--config PATH`` or ``$LIVERL_CONFIG``) plus environment
overrides of the form ``LIVERL__SECTION__FIELD=value`` (for example ``LIVERL__LEARNER__LR=1e-4``,
``LIVERL__BROKER__BOOTSTRAP=kafka:9092``; sections and lists as JSON, ``null`` for None). Every field is
documented where it is declared, and docs/configuration.md lists them all (``python scripts/config_reference.py``
writes it from these classes); ``configs/`` holds example files, and ``liverl config`` prints the effective values.
This package imports neither torch nor vLLM.

One module per component: ``broker`` (the broker and its topics), ``storage`` (Redis, the registry and its blobs, the
base policy), ``serving`` (nodes and router), ``ingest``, ``learner``, ``gate`` (offline checks and canary),
``security`` (keys), ``stack`` (the embedded stack's supervisor and the demo); ``root`` composes them and ``load``
reads a file and the environment into the root.
"""

from core.config.base import Section, redact_url
from core.config.broker import BrokerConfig, TopicsConfig
from core.config.forget import ForgetConfig
from core.config.gate import GateConfig
from core.config.ingest import IngestConfig, RewardConfig
from core.config.learner import LearnerConfig
from core.config.load import ENV_PREFIX, load_config
from core.config.root import DELIVERY_MARGIN_S, LiverlConfig
from core.config.security import SecurityConfig
from core.config.serving import ServingConfig, advertised_url
from core.config.stack import DemoConfig, SupervisorConfig
from core.config.storage import ModelConfig, RedisConfig, RegistryConfig

__all__ = [
    "DELIVERY_MARGIN_S",
    "ENV_PREFIX",
    "BrokerConfig",
    "DemoConfig",
    "ForgetConfig",
    "GateConfig",
    "IngestConfig",
    "LearnerConfig",
    "LiverlConfig",
    "ModelConfig",
    "RedisConfig",
    "RegistryConfig",
    "RewardConfig",
    "SecurityConfig",
    "Section",
    "ServingConfig",
    "SupervisorConfig",
    "TopicsConfig",
    "advertised_url",
    "load_config",
    "redact_url",
]
