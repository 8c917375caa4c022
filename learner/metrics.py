"""The learner's Prometheus metrics (``liverl_learner_*``), read from a live ``Learner`` at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from learner.checkpoint import LearnerState


class LiveLearner(Protocol):
    """What the collector reads of a live learner (``learner.trainer.Learner`` has it; this module does not import
    the trainer, which imports this module)."""

    state: LearnerState
    last_backlog: tuple[int, float]
    last_metrics: dict[str, float]
    last_hops: dict[str, float]


class PrometheusCollector:
    """Exposes a learner's live state at scrape time (``liverl_learner_*``; counters end in ``_total``)."""

    def __init__(self, learner: LiveLearner):
        self.learner = learner

    def collect(self):
        lr, st = self.learner, self.learner.state
        yield CounterMetricFamily("liverl_learner_steps", "Policy updates made.", value=st.step)
        yield CounterMetricFamily(
            "liverl_learner_samples_trained", "Samples trained on.", value=st.counters["samples_trained"]
        )
        dropped = CounterMetricFamily(
            "liverl_learner_samples_dropped", "Samples refused, by reason.", labels=["reason"]
        )
        for k, v in sorted(st.counters.items()):
            if k.startswith("dropped:"):
                dropped.add_metric([k.split(":", 1)[1]], v)
        yield dropped
        routed = CounterMetricFamily(
            "liverl_learner_routing_samples",
            "MoE samples trained with learner.routing_replay = 'rollout', by routing: 'replayed' (the server's "
            "experts), 'missing' (no routing in the sample: the learner's own).",
            labels=["routing"],
        )
        for label in ("replayed", "missing"):
            routed.add_metric([label], st.counters.get(f"routing_{label}", 0))
        yield routed
        yield CounterMetricFamily(
            "liverl_learner_rebases", "Restarts from the stable weights.", value=st.counters["rebases"]
        )
        yield GaugeMetricFamily(
            "liverl_learner_last_candidate_version",
            "Last candidate version emitted (-1: none).",
            value=-1 if st.last_candidate is None else st.last_candidate,
        )
        events, seconds = lr.last_backlog
        yield GaugeMetricFamily(
            "liverl_learner_backlog_samples",
            "Samples ingest judged that the learner has not trained "
            "yet (the samples topic's high watermark less the trained watermark; -1: unknown).",
            value=events,
        )
        yield GaugeMetricFamily(
            "liverl_learner_backlog_seconds",
            "Age of the oldest judged feedback the learner has not "
            "trained yet, by its feedback time (0: none waits; -1: unknown).",
            value=seconds,
        )
        hops = GaugeMetricFamily(
            "liverl_learner_sample_hop_seconds",
            "Where the last batch's oldest sample waited before its update: hop 'ingest' (feedback to ingest's "
            "sample record), 'fetch' (record to this learner's fetch), 'queue' (fetch to the update).",
            labels=["hop"],
        )
        for k, v in sorted(lr.last_hops.items()):
            hops.add_metric([k.removesuffix("_s")], v)
        yield hops
        for k in (
            "reward_mean",
            "kl",
            "entropy",
            "entropy_floor_gap",  # how far the last batch was under the floor (0: above it)
            "entropy_floor",  # the floor the last batch was held to, when raised for averaged candidates
            "ratio_mean",
            "clipped_frac",
            "masked_frac",
            "loss",
            "lr",
        ):
            if k in lr.last_metrics:
                yield GaugeMetricFamily(f"liverl_learner_{k}", f"Last update's {k}.", value=lr.last_metrics[k])
