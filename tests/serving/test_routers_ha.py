"""Two routers behind HAProxy (liverl's configuration, packaging/haproxy): a kill -9 of one under load fails only what
it had in flight."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.serving.routing import front_door

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("haproxy") is None,
        reason="haproxy is not installed (Debian package haproxy: apt-get install haproxy)",
    ),
]


def test_a_router_killed_behind_haproxy_fails_only_requests_it_had_in_flight(srv, tmp_path):
    """8 clients, streamed and plain chat completions for 64 sticky users, through HAProxy to two `liverl route`
    processes and the package's real node. Router 1 is killed with SIGKILL while a stream it relays is mid-body.
    Every failed request was sent before the kill (in flight), and any that got a response head got it from the
    killed router; every request sent after HAProxy marked it down succeeds, on the other router."""
    from liverl.bench.routers_load import Front, kill_under_load

    cfg, _ = front_door(srv.cfg, {srv.cfg.serving.node_name: srv.url})
    front = Front(cfg, tmp_path / "front", n=2, balancer=True).start()
    try:
        res = asyncio.run(
            kill_under_load(front, before_s=3.0, after_s=5.0, restart=False, when_streaming=20.0, clients=8, users=64)
        )
    finally:
        front.stop()
    out, t_kill, t_down = res["outcomes"], res["t_kill"], res["t_down"]
    before = [o for o in out if o.end < t_kill]
    assert before and all(o.ok for o in before), {o.error for o in before if not o.ok}
    assert {o.router for o in before} == {"router-1", "router-2"}, "both routers served before the kill"

    failed = [o for o in out if not o.ok]
    assert all(o.start < t_kill for o in failed), [(o.start - t_kill, o.error) for o in failed]
    assert all(o.router in (None, "router-1") for o in failed), [(o.router, o.error) for o in failed]

    assert t_down is not None, f"HAProxy never marked router-1 down: {front.states()}"
    later = [o for o in out if o.start >= t_down]
    assert later and all(o.ok for o in later), {o.error for o in later if not o.ok}
    assert {o.router for o in later} == {"router-2"}
