"""The gateway's Prometheus metrics, declared once in a registry of their own (the gateway's ``GET /metrics``).

The hot-swap agent's own counters (swaps, their pause, re-verifications, its errors) are not here: the agent serves
them from the serving process (``serving.agent.metrics``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class GatewayMetrics:
    """Every metric the gateway exposes; ``count`` is the per-request counter, its children cached."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "liverl_gateway_requests",
            "Requests by route and HTTP status (499: the client left mid-stream)",
            ["route", "status"],
            registry=r,
        )
        self.m_seconds = Histogram(
            "liverl_gateway_request_seconds",
            "Generation latency, any swap pause included",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.m_version = Gauge("liverl_gateway_policy_version", "Policy version being served", registry=r)
        self.m_inflight = Gauge("liverl_gateway_inflight_requests", "Requests being generated", registry=r)
        self.m_logged = Counter(
            "liverl_gateway_generations_logged", "Generation records acknowledged by Kafka", registry=r
        )
        self.m_untrainable = Counter(
            "liverl_gateway_untrainable_generations",
            "Generations logged as not trainable, by reason",
            ["reason"],
            registry=r,
        )
        self.m_mixed = Counter(
            "liverl_gateway_mixed_version_generations",
            "Generations a hot-swap split between "
            "versions (spans read: exact), or whose spans could not be read (unknown)",
            ["spans"],
            registry=r,
        )
        self.m_routing = Counter(
            "liverl_gateway_routing",
            "Generations whose router choices went on the record (recorded), or were not held whole by the worker "
            "(missing) (serving.record_routing)",
            ["routing"],
            registry=r,
        )
        self.m_log_fail = Counter(
            "liverl_gateway_generation_log_failures",
            "Generation records not logged: Kafka did not take them, their user's key could not be read, or the node "
            "never finished the choice",
            registry=r,
        )
        self.m_log_held = Gauge(
            "liverl_gateway_generation_log_held",
            "Generation records waiting for their user's key (the registry's database did not answer yet)",
            registry=r,
        )
        self.m_log_slow = Counter(
            "liverl_gateway_generation_log_slow",
            "Responses sent before Kafka acknowledged the record (bounded wait expired)",
            registry=r,
        )
        self._request_counters: dict[tuple[str, int], Any] = {}
        self.m_feedback = Counter("liverl_gateway_feedback", "POST /v1/feedback by HTTP status", ["status"], registry=r)

    def count(self, route: str, status: int) -> None:
        """One request on ``route`` answered ``status``."""
        counter = self._request_counters.get((route, status))
        if counter is None:
            counter = self._request_counters[route, status] = self.m_requests.labels(route=route, status=str(status))
        counter.inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (``content_type``)."""
        return generate_latest(self.registry)
