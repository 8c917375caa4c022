"""The serving nodes (gateway, vLLM node, swap agent) and the router in front of them."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from core.config.base import Section


class ServingConfig(Section):
    host: str = Field(
        default="127.0.0.1",
        description="Interface the gateway and the serving agent's /metrics (agent_port) bind to, and the router's, "
        "the gate's, the learner's and ingest's servers (0.0.0.0 to expose them).",
    )
    node_host: str = Field(
        default="127.0.0.1",
        description="Interface the vLLM node binds to. Keep it on loopback: only the serving "
        "process talks to its node, and every route but /health needs the key that process generates at each start.",
    )
    gateway_port: int = Field(default=8000, description="Port of the OpenAI-compatible gateway.")
    vllm_port: int = Field(default=8100, description="Port of the vLLM node's own OpenAI server.")
    agent_port: int = Field(
        default=8300,
        ge=0,
        le=65535,
        description="Port of the serving process's own /metrics (the hot-swap agent's swaps, swap pauses, "
        "re-verifications, poll errors, refused announcements) and /healthz, on serving.host; 0: off.",
    )
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
    router_hold_s: float = Field(
        default=25.0,
        ge=0.0,
        description="How long the router holds a request that no node may serve right now (none in rotation for "
        "its arm, or every one of them just failed it) before it answers 503: it tries again as the rotation changes. "
        "A fault then costs the product's users a wait, not an error: a node coming back, the heartbeats rewritten "
        "after a Redis outage, or the gate ending a canary whose stable arm lost its last node "
        "(gate.stable_arm_grace_s) all take seconds. Keep it under the product's client timeout. 0: answer 503 at "
        "once.",
    )
    router_hold_max: int = Field(
        default=1000,
        ge=0,
        description="At most this many requests are held at once (serving.router_hold_s); the next ones get 503 at "
        "once, so a fleet that is gone cannot pile up the router's memory.",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=16,
        description="How many serving nodes `liverl up` and `liverl demo` run on this machine "
        "(node-0, node-1, ...; gateway, vLLM and agent ports counted up from gateway_port, vllm_port and "
        "agent_port). More than one: `liverl route` runs in front on router_port and the gate can canary.",
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
    swap_via: Literal["vllm", "liverl", "alternate"] = Field(
        default="vllm",
        description="How the node commits and labels a hot-swap inside the engine's pause (serving.node.swap). "
        "vllm: vLLM's own weight-update calls (pause keep, start_weight_update, update_weights through the "
        "liverl_delta backend, finish_weight_update with the version, resume). liverl: the engine core's pause "
        "and liverl's worker RPC (liverl_commit), then update_weight_version. alternate: each swap the other "
        "way, to compare them in one run (liverl bench swap --via alternate). Either way the deltas are decoded "
        "before the pause and the whole served state is read back after it.",
    )
    swap_drain_s: float = Field(
        default=10.0,
        gt=0,
        description="Ignored: a hot-swap does not drain (requests in flight are frozen at a scheduler step and "
        "resume after it, serving.node.swap). Accepted so that config files that set it load.",
    )
    engine_ready_timeout_s: float = Field(
        default=900.0,
        gt=0.0,
        description="The longest a serving process waits for its vLLM engine to load the model and answer before it "
        "gives up (the start fails, and the process's supervisor starts it again). A 2-core host starting two engines "
        "at once under load needs minutes; a large model on a cold disk longer.",
    )
    drain_timeout_s: float = Field(
        default=60.0,
        ge=0.0,
        description="On SIGTERM, the longest a serving process waits for the generations in flight to finish: its "
        "/readyz goes 503, it leaves the routers' rotation and admits no new generation at once, then stops the node "
        "once nothing is in flight or after this (what is still in flight then is cut). Keep the helm chart's "
        "serve.terminationGracePeriodSeconds above it plus the node's stop (about 20 s).",
    )
    record_routing: bool = Field(
        default=False,
        description="Put the experts the node's MoE router chose for every position on each generation record "
        "(GenerationRecord.routed_experts, a core.routing blob), for the learner's routing replay "
        "(learner.routing_replay). The node then runs with prefix caching off (a cached prompt block is not routed "
        "again, so its positions would have no routing): every request prefills its whole prompt, even one that "
        "shares a prefix with another. Each response also waits for one engine RPC that reads its choices' routing, "
        "and each record grows by the routing's size (1 byte a position on the tiny MoE test models, 336 on "
        "Qwen3-30B-A3B: see ingest.max_event_bytes). CPU nodes capture it in the worker "
        "(serving/node/worker/routing.py). Ignored, with a warning in the node's log, for a dense model.",
    )
    log_hold_max: int = Field(
        default=10000,
        ge=0,
        description="At most this many generation records wait at once for their user's data key while the "
        "registry's database does not answer (each waits what ingest.pending_ttl_s leaves beyond "
        "broker.delivery_timeout_s); the next ones are not logged, and their feedback is dead-lettered "
        "unknown_generation (liverl_gateway_generation_log_held).",
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
