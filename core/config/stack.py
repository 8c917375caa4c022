"""The embedded stack: how `liverl up` and `liverl demo` restart their processes, and what the demo runs."""

from __future__ import annotations

from pydantic import Field

from core.config.base import Section


class SupervisorConfig(Section):
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


class DemoConfig(Section):
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
