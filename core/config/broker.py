"""The Kafka broker every process connects to, and the topics liverl creates on it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from core.config.base import Section


class BrokerConfig(Section):
    bootstrap: str | None = Field(
        default=None,
        description="Kafka bootstrap servers (host:port[,host:port]). None: start the embedded Tansu broker.",
    )
    embedded_port: int = Field(default=19092, description="Port of the embedded broker on 127.0.0.1.")
    embedded_storage: Literal["folder", "memory"] = Field(
        default="folder",
        description="Where the embedded broker keeps its topics, records and committed offsets. "
        "'folder': files under <state_dir>/broker (served to Tansu's object-store engine by liverl.stack.objstore), so "
        "a restart of `liverl up` finds the feedback, generations and samples it had not consumed yet. 'memory': lost "
        "at every stop (faster; for throwaway tests). Ignored with broker.bootstrap.",
    )
    embedded_fsync: bool = Field(
        default=False,
        description="With embedded_storage 'folder': fsync every write before the broker acknowledges "
        "it. False (Apache Kafka's own default, no fsync per message): an acknowledged record survives a kill -9 of "
        "any process, not a power loss. True: survives a power loss too; produce was ~4x slower here.",
    )
    embedded_batch_delay_ms: float = Field(
        default=0.0,
        ge=0,
        description="With embedded_storage 'folder': the broker's produce batcher holds produce requests up to this "
        "long and writes them together (Tansu's batch_max_delay; 0: off). Off, because the Tansu build liverl runs "
        "corrupts records with it: at 5 ms, a demo run's ingest worker (aiokafka) read 'Invalid record size: expected "
        "to read 707 bytes in record payload, but instead read 708' within 45 s, six times in a row. Where it held, "
        "it halved the object writes (`liverl bench broker`, BENCHMARKS.md).",
    )
    embedded_merge_batches: int = Field(
        default=1000,
        ge=0,
        description="With embedded_storage 'folder': merge a partition's small record batches once it holds this "
        "many settled ones (liverl.stack.batchmerge; 0: never). Tansu lists every batch of a partition at each fetch, "
        "so a consumer's fetch costs more the more batches a partition holds between merges.",
    )
    partitions: int = Field(default=2, ge=1, description="Partitions of each liverl topic when liverl creates it.")
    rebalance_timeout_s: float = Field(
        default=3.0, description="Consumer-group rebalance timeout; Tansu completes a join only after it (keep small)."
    )
    delivery_timeout_s: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="How long every producer liverl builds retries a record before it "
        "reports it failed (kafka-python delivery_timeout_ms, librdkafka message.timeout.ms): the gateway's "
        "generation records, the feedback SDK's events. ingest.pending_ttl_s must exceed it by DELIVERY_MARGIN_S (or "
        "by itself, when it is shorter than that; checked when the config loads), or feedback is dead-lettered "
        "unknown_generation while its generation record is still being retried (librdkafka's own default is 300 s).",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="How every liverl Kafka client connects (Kafka's security.protocol)."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="SCRAM-SHA-512", description="SASL mechanism, with SASL_PLAINTEXT or SASL_SSL."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(
        default=None, description="SASL password (shown masked by `liverl config`; LIVERL__BROKER__SASL_PASSWORD)."
    )
    ssl_cafile: str | None = Field(
        default=None,
        description="CA bundle (PEM) the broker's certificate is checked "
        "against, with SSL or SASL_SSL (None: the system's).",
    )
    ssl_certfile: str | None = Field(default=None, description="Client certificate (PEM), for mutual TLS.")
    ssl_keyfile: str | None = Field(default=None, description="The client certificate's private key (PEM).")

    @model_validator(mode="after")
    def _credentials_complete(self):
        if self.security_protocol.startswith("SASL") and not (self.sasl_username and self.sasl_password):
            raise ValueError(
                f"broker.security_protocol {self.security_protocol} needs broker.sasl_username and broker.sasl_password"
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("broker.ssl_certfile and broker.ssl_keyfile go together (mutual TLS)")
        return self


class TopicsConfig(Section):
    prefix: str = Field(default="liverl", description="Every topic and consumer group name starts with this.")
    retention_s: float | None = Field(
        default=7 * 24 * 3600.0,
        gt=0,
        description="How long the broker keeps the records of the topics liverl "
        "creates (feedback, generations with users' prompts and completions, samples, held-out samples, dead letters "
        "with the refused input): user content is deleted after this (Kafka's retention.ms, set when liverl creates a "
        "topic; an existing topic keeps its own). It must exceed the longest a consumer may stay down. None: the "
        "broker's default.",
    )

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

    @property
    def heldout(self) -> str:
        """Joined samples set aside for the gate's off-policy estimate; the learner never reads them."""
        return f"{self.prefix}.heldout"
