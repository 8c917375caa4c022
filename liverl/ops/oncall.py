"""The on-call page: ``liverl oncall`` serves one page that shows, refreshed every few seconds, what on-call needs
to see at a glance: the stable version and whether every node serves it, the versions and their lineage, live
acceptance by version, every gate check with its value, threshold and reason, and the audit log.

Read-only: it reads the registry (``cfg.registry_url``) and Redis (``core.keys``) and changes nothing, so
it needs no operator token; it binds ``serving.host`` (loopback by default). Routes:

- ``GET /``           the page (plain HTML and JavaScript, no build step, no outside resources);
- ``GET /api/state``  everything the page shows, as JSON (for scripts and dashboards);
- ``GET /healthz``    ``ok``;
- ``GET /livez``      200 whenever it answers (the server's threads are not wedged);
- ``GET /readyz``     200 while the page can be drawn: the registry has a stable version and Redis answers under the
  deployment's prefix; else 503 with the reason.

SIGTERM or SIGINT stops it at once (requests being answered finish; it holds no state).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

from core import fleet, keys
from core.config import LiverlConfig
from liverl.ops.admin import _live, open_redis, open_registry

log = logging.getLogger("liverl.oncall")


def collect_state(cfg: LiverlConfig, limit: int = 40) -> dict[str, Any]:
    """The page's data: versions (newest first) with their gate checks and live counts, the fleet, the audit tail."""
    reg = open_registry(cfg)
    p = cfg.topics.prefix
    live: dict[int, dict[str, int]] = {}
    desired = learner = view = None
    redis_error = None
    try:
        rows = reg.list(limit=limit)
        stable = reg.stable()
        checks = _gate_checks(reg)
        mismatch = reg.mismatch()
        audit = [
            {"at": a.at, "actor": a.actor, "action": a.action, "version": a.version, "reason": a.reason}
            for a in reg.audit(limit=25)
        ][::-1]
        rollout = _rollout(reg.active_rollout())
        r = open_redis(cfg)
        try:
            live = _live(r, p, [v.version for v in rows])
            view = fleet.fleet_view(reg, r, p, cfg.serving.fleet)
            desired = view.desired.model_dump() if view.desired is not None else None
            learner = r.hgetall(keys.learner(p)) or None
        except (redis.RedisError, ValueError) as e:
            redis_error = str(e)
        finally:
            r.close()
    finally:
        reg.close()
    versions = [_version_row(v, checks, live, mismatch.get(v.version)) for v in rows]
    nodes = _nodes(view)
    return {
        "now": time.time(),
        "prefix": p,
        "stable": {"version": stable.version, "checksum": stable.checksum, "promoted_at": stable.promoted_at},
        "desired": desired,
        "nodes": nodes,
        "converged": view is not None and view.converged,
        "versions": versions,
        "audit": audit,
        "learner": learner,
        "redis_error": redis_error,
        "rollout": rollout,
    }


def _gate_checks(reg) -> dict[int, list[dict]]:
    """Every gate check the registry holds, by version."""
    checks: dict[int, list[dict]] = {}
    for g in reg.gate_results():
        checks.setdefault(g.version, []).append(
            {
                "check": g.check,
                "value": g.value,
                "threshold": g.threshold,
                "passed": g.passed,
                "detail": g.detail,
                "at": g.at,
            }
        )
    return checks


def _rollout(ro) -> dict[str, Any] | None:
    """The active canary rollout, if any."""
    return (
        None
        if ro is None
        else {
            "id": ro.id,
            "version": ro.version,
            "checksum": ro.checksum,
            "stable_version": ro.stable_version,
            "share": ro.share,
            "nodes": list(ro.nodes),
            "unit": ro.unit,
            "state": ro.state,
            "started_at": ro.started_at,
            "deadline_at": ro.deadline_at,
            "looks": list(ro.looks or []),
            "verdict": ro.verdict,
            "reason": ro.reason,
        }
    )


def _version_row(
    v, checks: dict[int, list[dict]], live: dict[int, dict[str, int]], mismatch: dict | None = None
) -> dict[str, Any]:
    """One version of the page: its registry row, its gate checks in time order, its live counts and its
    sampler/trainer mismatch (``Registry.mismatch``: per-token means with the learner's own routing and replayed)."""
    c = live.get(v.version) or {}
    events = c.get("events", 0)
    return {
        "version": v.version,
        "parent": v.parent,
        "status": v.status,
        "reason": v.status_reason,
        "created_at": v.created_at,
        "promoted_at": v.promoted_at,
        "checksum": v.checksum,
        "delta_bytes": v.delta_bytes,
        "changed_fraction": v.changed_fraction,
        "checks": sorted(checks.get(v.version, []), key=lambda x: x["at"]),
        "mismatch": mismatch,
        "live": {
            "events": events,
            "accept": c.get("accept", 0),
            "reject": c.get("reject", 0),
            "edit": c.get("edit", 0),
            "acceptance": c.get("accept", 0) / events if events else None,
        },
    }


def _nodes(view) -> list[dict[str, Any]]:
    """Each serving node's last heartbeat, its age and whether it serves what it should."""
    return (
        []
        if view is None
        else [
            {
                "node": n.name,
                **n.beat.model_dump(),
                "age_s": max(0.0, time.time() - n.beat.ts),
                "known": n.known,
                "canary": n.canary,
                "converged": n.converged,
            }
            for n in view.nodes.values()
        ]
    )


PAGE = (Path(__file__).parent / "templates" / "oncall.html").read_text()
"""The page: plain HTML and JavaScript, no build step, no outside resources; ``__REFRESH_MS__`` is filled per
request."""


class _Handler(BaseHTTPRequestHandler):
    cfg: LiverlConfig
    refresh_ms: int

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("oncall: " + fmt, *args)

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, PAGE.replace("__REFRESH_MS__", str(self.refresh_ms)).encode(), "text/html; charset=utf-8")
        elif path == "/api/state":
            try:
                body = json.dumps(collect_state(self.cfg)).encode()
            except Exception as e:  # the registry unreachable: say so on the page, keep serving
                log.exception("oncall: collecting the state failed")
                self._send(503, f"cannot read the registry: {e}".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, "application/json")
        elif path == "/healthz":
            self._send(200, b"ok", "text/plain")
        elif path == "/livez":
            self._send(200, b'{"ok": true}', "application/json")
        elif path == "/readyz":
            reason = not_ready(self.cfg)
            body = json.dumps({"ready": reason is None, "reason": reason}).encode()
            self._send(200 if reason is None else 503, body, "application/json")
        else:
            self._send(404, b"not found: / (the page), /api/state (JSON), /healthz, /livez, /readyz", "text/plain")


def not_ready(cfg: LiverlConfig) -> str | None:
    """Why the page cannot be drawn now (``/readyz``), or None: the registry and Redis both answer."""
    try:
        reg = open_registry(cfg)
        try:
            reg.stable()
        finally:
            reg.close()
        r = open_redis(cfg)
        try:
            r.ping()
        finally:
            r.close()
    except Exception as e:  # noqa: BLE001 - whatever fails, the probe says what
        return f"{type(e).__name__}: {e}"
    return None


def make_server(cfg: LiverlConfig, host: str, port: int, refresh_s: float = 2.0) -> ThreadingHTTPServer:
    handler = type("OncallHandler", (_Handler,), {"cfg": cfg, "refresh_ms": int(refresh_s * 1000)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve(cfg: LiverlConfig, host: str, port: int, refresh_s: float = 2.0) -> int:
    server = make_server(cfg, host, port, refresh_s)
    print(f"on-call page: http://{host}:{server.server_address[1]}/ (JSON: /api/state; Ctrl-C stops)", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # serve_forever returns; shutdown() must come from another thread
        signal.signal(sig, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def start_in_thread(
    cfg: LiverlConfig, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 2.0
) -> ThreadingHTTPServer:
    """For tests and the demo: the server on a background thread; ``shutdown()`` stops it."""
    server = make_server(cfg, host, port, refresh_s)
    threading.Thread(target=server.serve_forever, name="oncall-page", daemon=True).start()
    return server
