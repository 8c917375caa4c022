"""Configuration: one class per component, composed into one root ``LiverlConfig``.

Loaded (with pydantic-settings) from one TOML file (``--config PATH`` or ``$LIVERL_CONFIG``) plus environment
overrides of the form ``LIVERL__SECTION__FIELD=value`` (for example ``LIVERL__LEARNER__LR=1e-4``,
``LIVERL__BROKER__BOOTSTRAP=kafka:9092``; sections and lists as JSON, ``null`` for None). Every field is
documented where it is declared; ``configs/`` holds example files, and ``liverl config`` prints the effective
values. This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, TomlConfigSettingsSource


def redact_url(url: str | None) -> str | None:
    """``scheme://user:password@host/...`` with the password replaced by ``***`` (for logs and `liverl config`)."""
    if not url or "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, at, host = rest.rpartition("@")
    if ":" in creds:
        creds = creds.split(":", 1)[0] + ":***"
    elif creds:
        creds = "***"  # redis://:password@host puts the password alone
    return f"{scheme}://{creds}{at}{host}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BrokerConfig(_Section):
    bootstrap: str | None = Field(
        default=None,
        description="Kafka bootstrap servers (host:port[,host:port]). None: start the embedded Tansu broker.",
    )
    embedded_port: int = Field(default=19092, description="Port of the embedded broker on 127.0.0.1.")
    embedded_storage: Literal["folder", "memory"] = Field(
        default="folder",
        description="Where the embedded broker keeps its topics, records and committed offsets. "
        "'folder': files under <state_dir>/broker (served to Tansu's object-store engine by liverl.stack.objstore), so a "
        "restart of `liverl up` finds the feedback, generations and samples it had not consumed yet. 'memory': lost "
        "at every stop (faster; for throwaway tests). Ignored with broker.bootstrap.",
    )
    embedded_fsync: bool = Field(
        default=False,
        description="With embedded_storage 'folder': fsync every write before the broker acknowledges "
        "it. False (Apache Kafka's own default, no fsync per message): an acknowledged record survives a kill -9 of "
        "any process, not a power loss. True: survives a power loss too; produce was ~4x slower here.",
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
        "generation records, the feedback SDK's events. ingest.pending_ttl_s must exceed it by DELIVERY_MARGIN_S (or by "
        "itself, when it is shorter than that; checked when the config loads), or feedback is dead-lettered unknown_generation while "
        "its generation record is still being retried (librdkafka's own default is 300 s).",
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


class RedisConfig(_Section):
    url: str | None = Field(
        default=None,
        description="redis:// (rediss:// with TLS) URL of one Redis, or redis+cluster://host:port of any node of a "
        "Redis Cluster. None: use 127.0.0.1:6379 when it answers, else start a private redis-server.",
    )
    embedded_port: int = Field(default=16379, description="Port for a private redis-server when one is started.")


class RegistryConfig(_Section):
    url: str | None = Field(
        default=None, description="SQLAlchemy URL of the version registry. None: SQLite in <state_dir>/registry.db."
    )
    blob_dir: str | None = Field(
        default=None,
        description="Where snapshots and deltas live: a folder, or an S3-compatible store as "
        "s3://bucket/prefix (endpoint from AWS_ENDPOINT_URL or ?endpoint_url=...). None: <state_dir>/blobs.",
    )


class TopicsConfig(_Section):
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


class ModelConfig(_Section):
    path: str | None = Field(
        default=None,
        description="A Hugging Face causal-LM directory (config.json, safetensors, tokenizer with a chat "
        "template) that transformers and vLLM both load. None: the built-in demo policy (built from model.seed).",
    )
    seed: int = Field(default=0, description="Seed of the base policy (weights, tokenizer, warm start).")
    cache_dir: str | None = Field(
        default=None, description="Where built base policies are cached. None: <state_dir>/models."
    )


class ServingConfig(_Section):
    host: str = Field(default="127.0.0.1", description="Interface the gateway binds to (0.0.0.0 to expose it).")
    node_host: str = Field(
        default="127.0.0.1",
        description="Interface the vLLM node binds to. Keep it on loopback: only the serving "
        "process talks to its node, and every route but /health needs the key that process generates at each start.",
    )
    gateway_port: int = Field(default=8000, description="Port of the OpenAI-compatible gateway.")
    vllm_port: int = Field(default=8100, description="Port of the vLLM node's own OpenAI server.")
    node_name: str = Field(default="node-0", description="Name of this serving node in logs and records.")
    advertise_url: str | None = Field(
        default=None,
        description="Where the router reaches this node's gateway (its heartbeat carries it). "
        "Default: http://<serving.host>:<serving.gateway_port> (0.0.0.0 advertised as 127.0.0.1).",
    )
    router_port: int = Field(default=8080, description="Port of the router (``liverl route``), the fleet's front door.")
    fleet: dict[str, str] = Field(
        default_factory=dict,
        description="The serving nodes the router may send requests to, by name: each node's "
        'gateway URL (``{"node-0" = "http://10.0.0.5:8000"}``). A heartbeat of a node not named here is ignored, '
        "and the URL used is this one, never the heartbeat's; the gate's canary and `liverl status` count only these "
        "nodes. `liverl up` and `liverl demo` fill it with the nodes they start; `liverl route` refuses to start "
        "without it.",
    )
    router_read_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="The most the router waits for a node's next bytes (the response head of a "
        "non-streamed request, which comes only when the whole generation is done, or the next chunk of a stream). A "
        "node that sends nothing by then is marked down for a few seconds and, if nothing has reached the client yet, "
        "the request goes to the next node.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=16,
        description="How many serving nodes `liverl up` and `liverl demo` run on this machine "
        "(node-0, node-1, ...; gateway and vLLM ports counted up from gateway_port and vllm_port). More than one: "
        "`liverl route` runs in front on router_port and the gate can canary.",
    )
    max_num_seqs: int = Field(default=64, description="vLLM's concurrent sequence limit.")
    device: str = Field(default="auto", description="auto | cpu | cuda: which vLLM build serves.")
    swap_poll_s: float = Field(default=0.5, description="How often the agent checks the desired version.")
    reverify_s: float = Field(
        default=300.0,
        ge=0,
        description="How often the agent reads the served weights back and checks their checksum "
        "between swaps (a change behind its back marks the node unhealthy). 0: only after each swap.",
    )
    swap_drain_s: float = Field(
        default=10.0,
        gt=0,
        description="IGNORED: a hot-swap does not drain (requests in flight are frozen at a "
        "scheduler step and resume after it, serving.node.swap). Kept only so config files that set it still load.",
    )
    log_wait_s: float = Field(
        default=2.0,
        ge=0.0,
        description="How long a response waits for the broker to acknowledge its generation "
        "records before it is sent (bounded; an expired wait is counted in liverl_gateway_generation_log_slow). A "
        "client then never holds a generation id whose record a crash lost (feedback on it would be dead-lettered "
        "unknown_generation: 48 of 29,495 events in a chaos run with 0). 0: answer at once.",
    )

    @model_validator(mode="after")
    def _fleet_urls(self):
        for name, url in self.fleet.items():
            parts = urlsplit(url)
            if (
                not name.strip()
                or parts.scheme not in ("http", "https")
                or not parts.hostname
                or parts.query
                or parts.fragment
            ):
                raise ValueError(
                    f"serving.fleet: {name!r} = {url!r} is not a node name and its gateway's base URL "
                    '(like "node-0" = "http://10.0.0.5:8000")'
                )
        return self


def advertised_url(s: ServingConfig) -> str:
    if s.advertise_url:
        return s.advertise_url.rstrip("/")
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
    return f"http://{host}:{s.gateway_port}"


class RewardConfig(_Section):
    accept: float = Field(default=0.75, description="Reward of an accepted generation (Cursor Tab uses +0.75).")
    reject: float = Field(default=-0.25, description="Reward of a rejected generation (Cursor Tab uses -0.25).")
    edit: float = Field(default=0.0, description="Reward of a generation the user had to edit.")
    revert: float = Field(
        default=-1.0,
        description="Reward of the correction a revert trains: an accepted generation the user later "
        "undid is trained again with this reward (the default cancels the accept's +0.75 and scores it as a reject).",
    )


class IngestConfig(_Section):
    rewards: RewardConfig = Field(default_factory=RewardConfig)
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
        "unparsed, with their first bytes and a sha256. Bounds every table entry and sample below the 1 MB record limit.",
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
    unit_ttl_s: float = Field(
        default=2 * 24 * 3600.0,
        gt=0,
        description="How long Redis keeps a version's per-user sums of one 10 s bucket "
        "of judgements (<prefix>:units:{<version>}:<bucket>, the canary's per-user evidence) after the bucket's last "
        "write. Longer than any canary plus its revert horizon.",
    )


class LearnerConfig(_Section):
    lr: float = Field(
        default=1e-6,
        gt=0,
        description="AdamW learning rate. The default is for a real LLM fine-tuned by policy "
        "gradient (1e-6, as configs/production.example.toml); the demo's 0.25M-parameter policy trains at 3e-4 "
        "(liverl.demo.run.DEMO_PROFILE), a rate that moves a real model off its distribution within a few updates.",
    )
    batch_size: int = Field(default=64, ge=1, description="Samples per policy-gradient update.")
    micro_epochs: int = Field(default=1, ge=1, description="Passes over each batch.")
    tis_cap: float = Field(default=2.0, description="Truncated importance sampling cap C on pi/mu per token.")
    kl_coef: float = Field(default=0.05, description="Weight of the KL penalty to the anchor (learner.kl_reference).")
    entropy_floor: float = Field(
        default=0.1,
        ge=0,
        description="The learner's entropy floor (mean nats per completion token of its batch): under it, the loss "
        "pushes the entropy back up (learner.loss, weight entropy_coef); above it, nothing. It must be above "
        "gate.min_entropy (0.05 by default; the config refuses it otherwise), the floor under which the gate refuses "
        "a candidate as collapsed: in hour-long demo runs, lineages past ~85% kept acceptance fell under the gate's "
        "floor within minutes and every candidate was refused for minutes on end. 0: off.",
    )
    entropy_coef: float = Field(
        default=0.1,
        ge=0,
        description="Weight of the entropy floor's hinge in the loss (learner.entropy_floor). 0: off.",
    )
    floor_for_candidate: bool = Field(
        default=False,
        description="With learner.candidate_ema: hold the entropy floor for the averaged candidate, not for the "
        "weights of the last update. An average is sharper than the weights it averages (the demo's seventh hour: "
        "batches at the floor, 0.09-0.10 nats a token; candidates 0.058-0.073 on the same generations, the gate "
        "refusing under 0.05). At each candidate the learner measures both on its last batch (it always does and logs "
        "it) and, with this on, raises the floor of its next updates by their ratio (1-4x). Off by default: in the "
        "demo's loop (scripts/plateau_sim.py, 4 seeds) no candidate fell under the gate's floor either way, and it "
        "changed nothing beyond the seeds' spread (70 promotions against 71, final acceptance 0.915 against 0.924).",
    )
    fast_forward: bool = Field(
        default=True,
        description="Run Qwen3-MoE models through the learner's own forward (learner/fastpath.py) in one process: "
        "transformers' maths with fewer operator calls (the attention mask and rotary tables once per batch, no "
        "module machinery, the last layer only where the loss reads it). liverl bench learn, demo model: 1.71x the "
        "plain loop at batch 64 against 1.29x through transformers' forward. Other families and FSDP2-sharded "
        "weights always use transformers' forward. false: transformers' forward everywhere.",
    )
    compile: bool = Field(
        default=False,
        description="With learner.fast_forward: run that forward (and so its backward) under torch.compile, which "
        "fuses its elementwise chains into generated kernels. The first update compiles (measured: 1-2 minutes on a 2-core "
        "machine; inductor caches the result on disk: later starts load it in 10-20 s); liverl bench learn "
        "--compile, demo model at batch 16: 1.55x the plain loop against 1.48x eager. Off by default: "
        "that stall falls on a learner that has just started, and every process that trains compiles once.",
    )
    candidate_every_steps: int = Field(
        default=10, ge=1, description="Emit a candidate version every this many updates."
    )
    candidate_ema: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Emit as each candidate the exponential moving average of the learner's weights over its recent "
        "updates, with this decay per update (0.97: about the last 33 updates), not the weights of its last update; "
        "the learner itself trains on unaveraged. One iterate of a noisy policy gradient is a random draw around where "
        "the lineage stands: in the demo's learning loop (scripts/plateau_sim.py, 3 seeds of 2,900 updates) the "
        "suite refused 30 unaveraged candidates, 6.2 points of acceptance under stable on average, 21 of them within "
        "20 updates of a promotion, and runs of refusals of 500-625 s came at the plateau; averaged (0.9 or 0.97), no "
        "run passed 300 s and the last stable version was 3-6 points better. Costs one more fp32 copy of the weights "
        "(sharded like them) and is checkpointed with them. 0: off (the production default: a real model's rate, "
        "1e-6, moves an iterate far less; the demo sets 0.97).",
    )
    max_staleness: int = Field(
        default=8,
        ge=0,
        description="Drop samples whose policy is more than this many candidates' worth of updates "
        "(max_staleness x candidate_every_steps learner steps) behind the learner's weights.",
    )
    rebase_after_refusals: int = Field(
        default=5,
        ge=0,
        description="Rebase onto the stable version when the gate refused this many of the learner's "
        "newest candidates in a row on their evidence (drift, collapse, suite, off-policy, canary; supersessions do "
        "not count): a lineage the gate keeps refusing does not recover by training further. 0: never.",
    )
    lr_backoff: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="At each rebase after refused candidates (rebase_after_refusals), the learning rate is "
        "multiplied by this, down to min_lr_scale x lr; each promotion of a candidate divides it back, up to lr. "
        "The rebased lineage then moves in smaller steps, the ones the gate can accept (a 60-minute demo run: every "
        "rebased lineage at the full rate was refused again within minutes, on the product's suite or the entropy "
        "floor). 1: never back off.",
    )
    min_lr_scale: float = Field(
        default=0.125,
        gt=0,
        le=1,
        description="The lowest learning rate the back-off (lr_backoff) goes to, as a fraction of lr.",
    )
    max_backlog_s: float = Field(
        default=600.0,
        ge=0,
        description="Load shedding: a sample whose feedback is older than this when the learner "
        "reaches it is skipped (refused as 'shed': counted, in the ledger and `liverl audit`) so a learner that cannot "
        "keep up trains the newest feedback instead of falling further behind; it says so in its log. 0: never shed.",
    )
    max_batch_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="Train on a partial batch once its oldest sample has waited this long, so a "
        "lull in traffic does not hold samples back (and `liverl audit` sees them trained).",
    )
    max_batch_tokens: int = Field(
        default=65536,
        ge=1,
        description="Cap on a batch's padded size (samples x longest sequence): a batch is cut "
        "short rather than run out of memory on long contexts.",
    )
    checkpoint_every_steps: int = Field(
        default=1,
        ge=1,
        description="Checkpoint (weights, optimizer, offsets, ledger) every this many updates, or "
        "sooner (checkpoint_every_s, a candidate, a rebase, idle, a clean stop). Offsets are committed only with a "
        "checkpoint: a crash retrains the updates since the last one from the same weights. 1: after every update "
        "(the demo's model); raise it where a checkpoint costs more than an update (sharded models under torchrun).",
    )
    checkpoint_every_s: float = Field(
        default=60.0, gt=0, description="Checkpoint at least this often while training (see checkpoint_every_steps)."
    )
    dedupe_window: int = Field(
        default=100_000,
        ge=1,
        description="How many recently trained sample ids the learner keeps in memory (and "
        "checkpoints): a fast first check. Older ids are still refused as duplicates through the durable store "
        "(learner.dedupe_horizon_h), however late a replay comes.",
    )
    dedupe_horizon_h: float = Field(
        default=168.0,
        gt=0,
        description="How long the learner's durable store of trained sample ids "
        "(<prefix>.trained-ids.sqlite beside the checkpoint) keeps an id. Must exceed how long ingest can re-emit a "
        "sample (its judged entries live 24 h).",
    )
    ledger_max_mb: int = Field(
        default=256,
        ge=1,
        description="Size at which the learner's ledger (every sample's fate, for liverl audit) "
        "rolls over; one previous file is kept.",
    )
    lease_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="TTL of the learner's lease in Redis (one learner per deployment): a learner "
        "that stops renewing it (killed, cut off) is replaced after this; a restart from the same state folder takes "
        "it over at once.",
    )
    lease_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a starting learner waits for another holder of the lease to go "
        "before it gives up, naming the holder.",
    )
    kl_reference: Literal["stable", "base"] = Field(
        default="stable",
        description="KL anchor: 'stable' (the version being served, moved on each promotion) or 'base' (version 0).",
    )
    kl_estimator: Literal["full", "k3"] = Field(
        default="full",
        description="KL to the anchor (learner.kl_reference): 'full' (exact over the vocabulary, per position) or "
        "'k3' (sampled tokens).",
    )


class GateConfig(_Section):
    max_kl: float = Field(
        default=0.5,
        gt=0,
        description="Refuse a candidate whose mean per-token KL from the stable version, on recent "
        "logged generations, exceeds this (nats/token): one release moves the policy only so far.",
    )
    min_entropy: float = Field(
        default=0.05,
        ge=0,
        description="Refuse a candidate whose mean per-token entropy (nats) on recent logged "
        "generations is below this: a collapsed policy.",
    )
    max_regression: float = Field(
        default=0.02,
        ge=0,
        description="With a product evaluation suite: refuse a candidate whose mean grade drops "
        "more than this below the stable version's, when the drop is also significant (suite_alpha).",
    )
    suite_alpha: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="The suite check pairs each case's grade under the candidate with the "
        "stable version's and refuses only a drop the paired sign test (McNemar's, for pass/fail grades) shows at "
        "this level: a few cases flipping either way on a small suite is noise, not a regression. 1: refuse on the "
        "drop alone.",
    )
    probe_generations: int = Field(
        default=256, ge=1, description="How many recent logged generations the drift and collapse checks use."
    )
    poll_s: float = Field(default=1.0, gt=0, description="How often the gate looks for new candidates.")
    heldout_samples: int = Field(
        default=512, ge=0, description="How many of the newest held-out samples the off-policy check reads (0: off)."
    )
    offpolicy_margin: float = Field(
        default=0.02,
        ge=0,
        description="A candidate whose estimated reward (the product's, reverts included) the "
        "paired test on the same held-out samples shows below stable's by more than this (one-sided, alpha 0.025) is "
        "refused. In the product's reward units (default rewards: an accept is worth 1 more than a reject).",
    )
    offpolicy_min_ess: float = Field(
        default=50.0,
        ge=1,
        description="Below this effective sample size (the candidate's or stable's, clipped or "
        "unclipped) the off-policy check defers: recorded, and the candidate may be promoted only through a canary "
        "(it moved too far from the logged behaviour to be judged off-policy).",
    )
    offpolicy_clip: float = Field(default=10.0, gt=1, description="Cap on each importance weight.")
    canary_share: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="Share of users (a fixed hash bucket each, sticky) a candidate that "
        "passed the offline checks is shown on the canary nodes before it is promoted. 0, or fewer than 2 serving "
        "nodes in rotation: no canary, the gate promotes at once.",
    )
    canary_nodes: int = Field(
        default=1,
        ge=1,
        description="How many serving nodes serve the canary (at least one node always stays on the stable version).",
    )
    canary_deadline_s: float = Field(
        default=1800.0,
        gt=0,
        description="A canary still undecided after this is aborted (with canary_max_events set: the cap in time).",
    )
    canary_max_events: int | None = Field(
        default=None,
        ge=1,
        description="The canary's evidence budget: a canary still undecided once its own arm has this "
        "many judged events (whose revert horizon has closed) is aborted, as at canary_deadline_s, which stays the cap "
        "in time. A deadline in seconds alone gives a canary on a quiet day a fraction of the evidence it gets on a "
        "busy one, so its power follows the traffic; a budget in events does not. Fixed at the rollout's start. None: "
        "the deadline in seconds only.",
    )
    canary_futility_z: float | None = Field(
        default=1.5,
        ge=0,
        description="With an evidence budget (canary_max_events): a canary whose success metric or a required "
        "guardrail could not be shown within the budget even this many standard errors better than estimated "
        "is aborted as futile once a quarter of the budget is spent (deploy.gate.sequential.futile), instead of spending "
        "the rest. It never promotes, so the false-promotion rate cannot rise; at 1.5, in `liverl bench canary "
        "--budget 6000` (2,000 and 5,000 users), it cost 1.0-1.3 points of promotions of a candidate as good as "
        "stable and cut the events spent on one 3 points worse by 29-31%. Fixed at the rollout's start. None: no "
        "futility stop.",
    )
    canary_alpha: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="Error rate of the canary's always-valid "
        "sequential test (mSPRT; deploy.gate.sequential), however often it is peeked at.",
    )
    canary_tau: float = Field(default=0.03, gt=0, description="Effect size the test is tuned for (acceptance points).")
    canary_min_events: int = Field(default=100, ge=1, description="Judged events each arm needs before any decision.")
    canary_warmup_s: float = Field(
        default=3.0,
        ge=0.0,
        description="A canary's evidence counts from the first whole 10 s bucket that starts this long "
        "after every canary node first served the candidate (the registry's served times). Answers the stable version "
        "served the canary's users just before (the router learns of a rollout within a second) are judged in the "
        "next seconds and would count for stable: raise it to the time your users take to judge an answer.",
    )
    canary_min_s: float = Field(
        default=0.0,
        ge=0,
        description="Shortest canary: no promotion before it has run this long, and evidence that "
        "it passes counts only from then on (a harm shown earlier still aborts). Set it above the time your "
        "follow-up feedback (reverts) takes to arrive, or the revert-rate guardrail passes on reverts not yet sent.",
    )
    canary_margin: float = Field(
        default=0.0,
        ge=0.0,
        description="0: promote only when live acceptance is shown better than stable's; > 0: "
        "when shown not worse by more than this (non-inferiority).",
    )
    guardrail_margin: float = Field(
        default=0.02,
        ge=0.0,
        description="Guardrails (the edit rate, the revert rate) must be shown not worse than stable's "
        "by more than this before a promotion; a guardrail shown worse aborts the canary.",
    )
    guardrail_tolerance: float = Field(
        default=0.10,
        ge=0.0,
        description="Response length guardrail: the canary's mean completion length must be "
        "shown no more than this share above stable's (0.10: 10% longer) before a promotion; it aborts only when shown "
        "more than this above it.",
    )
    latency_tolerance: float = Field(
        default=0.25,
        ge=0.0,
        description="Latency guardrail, as guardrail_tolerance for the mean serving latency "
        "(timed by the gateway). Wider: the canary and stable arms run on different nodes, so node load shows in it "
        "as much as the version does.",
    )
    latency_guardrail: Literal["non_inferior", "harm"] = Field(
        default="non_inferior",
        description="'non_inferior': a promotion waits until the canary's latency is shown no more "
        "than latency_tolerance above stable's; 'harm': latency only stops a canary it shows slower by more than that, "
        "and a promotion does not wait for it. A weight delta cannot change the compute per token, only how many "
        "tokens an answer takes (the response length guardrail, non-inferior either way), so the arms' latency "
        "differs by node more than by version; where nodes share their hardware (the demo: two vLLM engines on "
        "the same cores, whose load they trade), its batch means are too noisy to show non-inferiority in a canary's "
        "life.",
    )
    canary_unit: Literal["user", "request"] = Field(
        default="user",
        description="The canary's unit of randomisation and of analysis. 'user': each user (the "
        "request's stickiness key, deploy.gate.sequential) stays on one arm for the whole rollout and the test treats the "
        "user as the unit (delta-method variance of per-user sums, CUPED); 'request': each request is drawn into an "
        "arm afresh and the test treats each judged event as the unit.",
    )
    revert_horizon_s: float = Field(
        default=60.0,
        ge=0.0,
        description="How long after its judgement a generation can still be reverted (the "
        "product's follow-up window). The canary counts a generation only once this much time has passed since its "
        "judgement, so every metric that involves reverts (kept acceptance, the revert rate) is censored fairly.",
    )
    cuped: bool = Field(
        default=True,
        description="Variance reduction (CUPED, Deng et al. 2013) with each user's kept acceptance "
        "under stable in the cuped_lookback_s before the rollout as the covariate.",
    )
    cuped_lookback_s: float = Field(
        default=1800.0, ge=0.0, description="The pre-rollout window CUPED reads each user's covariate from."
    )
    srm_alpha: float = Field(
        default=0.001,
        gt=0,
        lt=1,
        description="Sample-ratio mismatch: a canary whose arms' user or event counts are "
        "shown (always-valid test at this level) not to match the configured share stops with reason 'srm': the "
        "assignment or the logging is broken, and no metric of it can be trusted.",
    )
    integrity_only: bool = Field(
        default=False,
        description="Judge candidates on integrity alone (the delta yields its checksum) and promote "
        "every one that passes at once: no drift, collapse, suite or off-policy check, no canary. For comparison runs "
        "that show what the evidence is worth (liverl demo --integrity-only); never in production.",
    )
    metrics_port: int = Field(
        default=6067,
        ge=0,
        description="Port of the gate's Prometheus /metrics (liverl_gate_*) on serving.host; 0: off.",
    )


class SecurityConfig(_Section):
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
        "With the gate down longer than this, every announcement expires: nodes keep what they serve (a canary node "
        "too), and a node that restarts serves its model directory until the gate announces again.",
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
        "X-Liverl-Product-Key header (one key a line, each at least 16 characters; several lines let a key be rotated). "
        "None: <state_dir>/keys/feedback.key (liverl up makes one, mode 0600); with neither, the gateway refuses "
        "feedback over HTTP (publish it to Kafka instead).",
    )
    audit_key: str | None = Field(
        default=None,
        description="File holding the secret (at least 32 bytes) that keys the audit log's chain "
        "(HMAC-SHA256) and its head anchored in Redis; never stored in the database. Every process that writes the "
        "registry, and `liverl history --verify`, reads the same one. None: <state_dir>/keys/audit.key when it exists "
        "(liverl up makes one, mode 0600). Without a key the log is chained by plain hash only, and a registry whose "
        "log is keyed refuses writes from a process without it.",
    )


class SupervisorConfig(_Section):
    """How `liverl up` and `liverl demo` restart a process that exits (ingest exits on purpose on a broker or Redis
    outage, to resume from its durable state). A budget per window, not a lifetime cap: a deployment that lives for
    months restarts a child now and then and stays up; one that crash-loops gives up soon, with a clear message."""

    restarts: int = Field(
        default=5,
        ge=0,
        description="Restarts allowed per process (role) within restart_window_s; one more exit in "
        "the window stops the pipeline (`liverl up` exits 1, naming the process and its last log lines).",
    )
    restart_window_s: float = Field(
        default=600.0, gt=0, description="The sliding window the restart budget counts exits in, in seconds."
    )
    healthy_after_s: float = Field(
        default=30.0,
        ge=0,
        description="A process that ran at least this long before it exited is restarted at once; "
        "one that exited sooner is restarted after a back-off that doubles with each such exit in a row (1 s, 2 s, "
        "4 s, ... up to backoff_max_s).",
    )
    backoff_max_s: float = Field(default=30.0, ge=0, description="The longest back-off before a restart.")


class DemoConfig(_Section):
    duration_s: float = Field(default=600.0, description="How long the demo runs (the loop stops then).")
    users: int = Field(
        default=5000,
        ge=1,
        description="Distinct simulated users (the population), each with a fixed "
        "segment and activity; the summary reports it as users.",
    )
    concurrency: int = Field(
        default=48,
        ge=1,
        description="Simulated users' requests in flight at once (the loops "
        "that play the population; the demo's total traffic).",
    )
    trap: bool = Field(
        default=True,
        description="The reward-hacking trap in the simulated product: some users accept a tempting wrong "
        "answer and revert it later (liverl.demo.sim); liverl demo --trap on|off.",
    )
    final_window_s: float = Field(
        default=120.0,
        description="No new candidates in the last this many seconds, so the last promoted version is measured.",
    )


ENV_PREFIX = "LIVERL__"
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
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)

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
        return self.registry.url or f"sqlite:///{self.state_path / 'registry.db'}"

    @property
    def blob_location(self) -> str:
        """Where the blobs live: ``registry.blob_dir`` as written (a folder, ``file://`` or ``s3://`` URL), else
        ``<state_dir>/blobs``."""
        return self.registry.blob_dir or str(self.state_path / "blobs")

    @property
    def model_cache_path(self) -> Path:
        return Path(self.model.cache_dir) if self.model.cache_dir else self.state_path / "models"


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _nulls(tree: dict[str, Any]) -> dict[str, Any]:
    """``null`` from the environment means None (pydantic-settings leaves nested ones as the string)."""
    return {k: _nulls(v) if isinstance(v, dict) else (None if v == "null" else v) for k, v in tree.items()}


def load_config(
    path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> LiverlConfig:
    """The root config: the TOML file (``path``, else ``$LIVERL_CONFIG``), then ``LIVERL__A__B`` environment
    variables (``env``, default ``os.environ``), then keyword ``overrides`` (``learner__lr=1e-4``).

    Parsing is pydantic-settings': TOML through ``TomlConfigSettingsSource``, the environment through
    ``EnvSettingsSource`` (nested by ``__``, case-insensitive, JSON for sections and lists, ``null`` for None).
    """
    env = os.environ if env is None else env
    path = path or env.get("LIVERL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        try:
            data = TomlConfigSettingsSource(LiverlConfig, toml_file=p)()
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {p} is not valid TOML: {e}") from None
    source = EnvSettingsSource(LiverlConfig, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
    source.env_vars = {k.lower(): v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}
    data = _merge(data, _nulls(source()))
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return LiverlConfig(**_merge(data, tree))
