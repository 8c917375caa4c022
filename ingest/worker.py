"""Run the ingest worker as a process: the body of ``liverl ingest`` and of the demo's subprocess.

    liverl ingest [--config liverl.toml]

Configuration comes from ``load_config`` (the TOML file, then ``LIVERL__SECTION__FIELD`` environment
variables); ``broker.bootstrap`` and ``redis.url`` must name running services (``liverl`` starts the
embedded stack and passes them on). SIGTERM and SIGINT stop the worker cleanly: the batch in hand is finished,
its offsets committed, the worker leaves its consumer group, and the process exits 0. When the broker or Redis
fails mid-batch, or does not answer while the worker starts, the process exits 75 (``ingest.commit.EXIT_INFRA``)
without committing: restart it (the demo's supervisor does), and the batch is replayed.
"""

from __future__ import annotations

import asyncio
import gc

import aiokafka.errors
import kafka.errors
import redis.exceptions
import sqlalchemy.exc

from core.bus import BrokerUnavailable, all_topics, ensure_topics, topic_configs
from core.config import LiverlConfig
from ingest.app import IngestWorker, leave_previous_member
from ingest.commit import die
from ingest.table import changelog_topic

# The worker allocates a few dozen short-lived objects per event, nearly all freed by reference counting; Python's
# default cycle-collection threshold (700 allocations) then runs the collector several times per batch, about a tenth
# of the join's time. Collect 30x less often, and leave the objects of the start-up (modules, clients) out of it.
GC_THRESHOLD = (20_000, 10, 10)

# what the broker, Redis or the registry's database raise when they do not answer while the worker starts: the same
# restart as mid-batch
UNAVAILABLE = (
    BrokerUnavailable,
    aiokafka.errors.KafkaError,
    kafka.errors.KafkaError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    sqlalchemy.exc.OperationalError,  # the registry's database (the users' keys)
    ConnectionError,
)


def run_worker(
    cfg: LiverlConfig, bootstrap: str, redis_url: str, *, web_port: int | None = None, web_bind: str = "127.0.0.1"
) -> int:
    """Create the topics, then run the worker in this thread until SIGTERM/SIGINT; returns the exit code.

    Blocks, owns the (main) thread's event loop, and installs the signal handlers, so call it from the
    main thread of a process dedicated to ingest. ``web_port`` (default ``cfg.ingest.web_port``; 0 = off)
    and ``web_bind`` place the ``/metrics`` + ``/healthz`` server (bind 0.0.0.0 for a remote Prometheus).
    """
    try:
        ensure_topics(bootstrap, all_topics(cfg), cfg.broker.partitions, broker=cfg.broker, configs=topic_configs(cfg))
        # the join table's changelog: compacted (the latest entry per generation id; evictions are tombstones)
        ensure_topics(
            bootstrap,
            [changelog_topic(cfg.topics.prefix)],
            cfg.broker.partitions,
            broker=cfg.broker,
            configs={"cleanup.policy": "compact"},
        )
    except UNAVAILABLE as e:
        die(f"starting: {e}")

    async def main() -> int:
        await leave_previous_member(cfg, bootstrap)
        worker = IngestWorker(cfg, bootstrap, redis_url, web_port=web_port, web_bind=web_bind)
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLD)
        return await worker.run()

    try:
        return asyncio.run(main())
    except UNAVAILABLE as e:  # a failure once batches run has already exited through die()
        die(f"starting: {type(e).__name__}: {e}")
        raise  # (die does not return)
