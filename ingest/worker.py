"""Run the ingest stream processor as a process: the body of ``liverl ingest`` and of the demo's subprocess.

    liverl ingest [--config liverl.toml]

Configuration comes from ``load_config`` (the TOML file, then ``LIVERL__SECTION__FIELD`` environment
variables); ``broker.bootstrap`` and ``redis.url`` must name running services (``liverl`` starts the
embedded stack and passes them on). SIGTERM and SIGINT stop the worker cleanly: the consumer stops, the
producer is flushed, offsets of finished batches are committed, and the process exits 0. When the broker or
Redis fails mid-batch the process exits 75 (``ingest.app.EXIT_INFRA``) without acknowledging the batch: restart it
(the demo's supervisor does), and the batch is replayed.
"""

from __future__ import annotations

import asyncio

from liverl.core.config import LiverlConfig


def run_worker(cfg: LiverlConfig, bootstrap: str, redis_url: str, *, loglevel: str = "info",
               web_port: int | None = None, web_bind: str = "127.0.0.1") -> int:
    """Create the topics, then run the faust worker in this thread until SIGTERM/SIGINT; returns the exit code.

    Blocks, owns the (main) thread's event loop, and installs the signal handlers, so call it from the
    main thread of a process dedicated to ingest. ``web_port`` (default ``cfg.ingest.web_port``; 0 = off)
    and ``web_bind`` place the ``/metrics`` + ``/healthz`` server (bind 0.0.0.0 for a remote Prometheus).
    """
    import faust

    from ingest.app import build_app, leave_previous_member
    from liverl.core.bus import all_topics, ensure_topics, topic_configs

    ensure_topics(bootstrap, all_topics(cfg), cfg.broker.partitions, broker=cfg.broker, configs=topic_configs(cfg))
    asyncio.run(leave_previous_member(cfg, bootstrap))
    app = build_app(cfg, bootstrap, redis_url, web_port=web_port, web_bind=web_bind)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    # faust's terminal spinner sets the root logger to DEBUG (to spin on every record), which makes
    # aiokafka build a debug LogRecord for every message: ~4 per event, a large share of the CPU.
    worker.spinner = None
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0

