"""Liveness and readiness for the processes whose main loop is not an event loop (the learner, the gate): a small
HTTP server on their metrics port with ``/metrics``, ``/livez`` and ``/readyz``.

Such a process serves HTTP from a thread of its own, so an answer proves nothing about its main loop; the loop ticks
a ``LoopWatch`` each time it goes round, and ``/livez`` is 200 only while the last tick is recent (a loop stuck longer
than ``stall_s`` is wedged: restart the process). ``/readyz`` is 200 while the process's own check finds it connected
to what it needs; each answers JSON with the reason when it is not. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("liverl.probes")

DRAINING_HEADER = "X-Liverl-Draining"
"""On the 503 a stopping serving node answers a generation request with: nothing was done with it, so a router sends
it to its next node."""

STALL_S = 900.0
"""A main loop that has not gone round for this long is wedged: longer than a learner's update with its checkpoint and
candidate, or a gate's step with its evaluation, take on the machines the project measures (minutes at most)."""

Check = Callable[[], str | None]
"""A probe's check: None when it passes, else why not (said in the answer)."""


class LoopWatch:
    """When a main loop last went round. ``live()`` is None while that was at most ``stall_s`` ago."""

    def __init__(self, stall_s: float, what: str = "main loop"):
        self.stall_s, self.what = stall_s, what
        self.at = time.monotonic()

    def tick(self) -> None:
        self.at = time.monotonic()

    def live(self) -> str | None:
        age = time.monotonic() - self.at
        if age <= self.stall_s:
            return None
        return f"the {self.what} has not gone round for {age:.0f} s (more than {self.stall_s:.0f} s: wedged)"


def _answer(check: Check, key: str) -> tuple[int, dict[str, Any]]:
    try:
        reason = check()
    except Exception as e:  # noqa: BLE001 - a check that fails says so in the answer, it does not kill the server
        reason = f"the check failed: {type(e).__name__}: {e}"
    return (200 if reason is None else 503), {key: reason is None, "reason": reason}


def start_probe_server(
    host: str, port: int, registry, live: Check, ready: Check, name: str = "liverl-probes"
) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` (``registry``, Prometheus text; ``/`` too), ``/livez`` and ``/readyz`` on ``host:port``
    from a daemon thread; ``shutdown()`` then ``server_close()`` stop it. A port in use raises ``OSError``."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("probes: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path in ("/metrics", "/"):
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/livez", "/readyz"):
                code, body = _answer(live, "ok") if path == "/livez" else _answer(ready, "ready")
                self._send(code, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"not found: /metrics, /livez, /readyz", "text/plain")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
