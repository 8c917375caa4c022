"""A running ``liverl up`` driven as a product without Kafka drives it: completions and feedback over HTTP.

Used by the test of the one-node path (tests/test_up_onenode.py) and its measurement (scripts/onenode_wait.py):

- ``start_up``: ``python -m liverl.cli up ...`` as a user starts it, returned once it printed its usage;
- ``HttpFeedback``: the feedback SDK's judging methods (what ``liverl.demo.sim`` calls) as POSTs to the gateway's
  ``/v1/feedback`` with the product key ``up`` wrote, each on a thread pool so the users' event loop never waits;
- ``Users``: the demo product's simulated users (``liverl.demo.sim.run_users``) on a thread, against that gateway.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from liverl.demo.sim import SimStats, run_users

READY = "Ctrl-C stops everything"


def start_up(args: list[str], env: dict[str, str], log_path: Path, timeout_s: float = 600.0) -> subprocess.Popen:
    """``liverl up`` with ``args``, its output in ``log_path``; returns once it printed its usage (the pipeline is
    serving). Raises RuntimeError, with the log's tail, when it exits or is not ready by ``timeout_s``."""
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "liverl.cli", "up", *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout_s
    while READY not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_up(proc)
            raise RuntimeError(f"liverl up not ready:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(1.0)
    return proc


def stop_up(proc: subprocess.Popen, timeout_s: float = 90.0) -> int:
    """Ctrl-C, as a user stops it; killed if it has not exited by ``timeout_s``. Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class HttpFeedback:
    """Feedback over HTTP (``POST /v1/feedback`` with ``X-Liverl-Product-Key``), with the SDK's judging methods."""

    def __init__(self, gateway_url: str, product_key: str, workers: int = 4):
        self.url = gateway_url.rstrip("/") + "/v1/feedback"
        self.key = product_key
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="http-feedback")
        self.lock = threading.Lock()
        self.sent = self.failed = 0
        self.last_error = ""

    def _post(self, body: bytes) -> None:
        req = urllib.request.Request(
            self.url, data=body, headers={"content-type": "application/json", "X-Liverl-Product-Key": self.key}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                ok = r.status == 202
        except (urllib.error.URLError, OSError) as e:
            ok, self.last_error = False, repr(e)[:300]
        with self.lock:
            self.sent += ok
            self.failed += not ok

    def _judge(
        self, generation_id: str, kind: str, segment=None, feedback_id=None, edited_text=None, edit_key=None
    ) -> str:
        fid = feedback_id or uuid.uuid4().hex
        event = {"feedback_id": fid, "generation_id": generation_id, "kind": kind, "segment": segment}
        if edited_text is not None:
            event["edited_text"] = edited_text
        if edit_key is not None:  # the gateway seals the edit under it (liverl_sdk.edits)
            event["edit_key"] = edit_key
        self.pool.submit(self._post, json.dumps(event).encode())
        return fid

    def accept(self, generation_id: str, segment: str | None = None, feedback_id: str | None = None) -> str:
        return self._judge(generation_id, "accept", segment, feedback_id)

    def reject(self, generation_id: str, segment: str | None = None, feedback_id: str | None = None) -> str:
        return self._judge(generation_id, "reject", segment, feedback_id)

    def revert(self, generation_id: str, segment: str | None = None, feedback_id: str | None = None) -> str:
        return self._judge(generation_id, "revert", segment, feedback_id)

    def edit(
        self,
        generation_id: str,
        edited_text: str,
        segment: str | None = None,
        feedback_id: str | None = None,
        edit_key: str | None = None,
    ) -> str:
        return self._judge(generation_id, "edit", segment, feedback_id, edited_text, edit_key)

    def send_raw(self, value: bytes, key: str | None = None) -> None:
        self.pool.submit(self._post, bytes(value))  # the gateway answers 4xx: counted as failed, nothing stored

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class Users:
    """``liverl.demo.sim.run_users`` on a thread until ``stop``: ``stats`` fill as they go."""

    def __init__(self, gateway_url: str, sdk, n_users: int = 200, concurrency: int = 8, seed: int = 1, **kwargs):
        self.stats = SimStats()
        self._stop = threading.Event()
        self._args = (gateway_url, sdk, n_users, self._stop, self.stats, seed)
        self._kwargs = {"concurrency": concurrency, "bad_event_rate": 0.0, **kwargs}
        self._thread = threading.Thread(target=self._run, name="users", daemon=True)

    def _run(self) -> None:
        asyncio.run(run_users(*self._args, **self._kwargs))

    def start(self) -> Users:
        self._thread.start()
        return self

    def judged(self) -> int:
        f = self.stats.feedback
        return f["accept"] + f["reject"] + f["edit"]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
