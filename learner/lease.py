"""One learner per deployment: a lease in Redis that a second learner cannot take while the first one lives.

Why: the learner's guarantees (checkpoint, then commit; dedupe by sample id) hold for one learner. Two (a rolling
deploy, a second host started by mistake) would split the samples' partitions between them, train two lineages and
commit offsets for partitions they no longer own. The consumer group does not prevent that; this lease does.

- ``acquire`` sets ``<prefix>:learner:lease`` to a token naming this process, with a TTL (``learner.lease_ttl_s``),
  only if nobody holds it. A learner restarted from the same state folder (its token is kept beside the
  checkpoint) takes its killed predecessor's lease over at once, so a kill -9 costs no TTL wait. Anyone else waits
  up to ``learner.lease_wait_s`` for the holder to go (a rolling deploy), then gives up with the holder's name.
- A thread renews the lease every third of its TTL, only if it still holds this process's token. When the lease
  is gone, taken, or cannot be renewed for a whole TTL (Redis down), ``lost`` is set: the learner stops before its
  next checkpoint or commit, so a learner that may have been replaced never writes either.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import redis

from core import keys

log = logging.getLogger("liverl.learner")

_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_TAKE_OVER = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v == false or v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end "
    "return 0"
)


class LeaseHeld(RuntimeError):
    """Another learner holds this deployment's lease."""


class LearnerLease:
    def __init__(self, r: redis.Redis, prefix: str, token_file: Path, ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError("the lease TTL must be positive")
        self.r = r
        self.key = keys.learner_lease(prefix)
        self.token_file = token_file
        self.ttl_ms = int(ttl_s * 1000)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> str | None:
        v = self.r.get(self.key)
        return v.decode() if isinstance(v, bytes) else v

    def acquire(self, wait_s: float = 60.0) -> None:
        """Take the lease (waiting up to ``wait_s`` for another holder to go), then renew it in a thread."""
        try:
            previous = self.token_file.read_text().strip()
        except OSError:
            previous = ""
        deadline = time.monotonic() + wait_s
        announced = False
        while True:
            if previous:
                got = self.r.eval(_TAKE_OVER, 1, self.key, previous, self.token, self.ttl_ms)
                if got:
                    log.info(
                        "learner lease %s taken over from this state folder's previous learner %s", self.key, previous
                    )
            else:
                got = self.r.set(self.key, self.token, nx=True, px=self.ttl_ms)
            if got:
                break
            holder = self.holder()
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"another learner holds this deployment's lease ({self.key} = {holder!r}); only one "
                    f"learner may run per topic prefix. Stop it, or wait {self.ttl_ms / 1000:g} s after it "
                    "died"
                )
            if not announced:
                log.warning(
                    "learner lease %s is held by %s; waiting up to %.0f s for it to go", self.key, holder, wait_s
                )
                announced = True
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0.01)))
        self.token_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.token_file.with_suffix(".tmp")
        tmp.write_text(self.token)
        os.replace(tmp, self.token_file)
        self._thread = threading.Thread(target=self._renew_loop, name="learner-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                held = self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms)
            except redis.RedisError as e:
                if time.monotonic() - last_ok > self.ttl_ms / 1000:
                    self._lose(f"not renewed for a whole TTL ({type(e).__name__}: {e})")
                    return
                continue
            if not held:
                self._lose(f"taken by {self.holder()!r}")
                return
            last_ok = time.monotonic()

    def _lose(self, why: str) -> None:
        log.critical("learner lease %s lost: %s; this learner stops before its next checkpoint", self.key, why)
        self.lost.set()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            self.r.eval(_RELEASE, 1, self.key, self.token)
        except redis.RedisError as e:
            log.warning("learner lease %s not released (%s); it expires in %g s", self.key, e, self.ttl_ms / 1000)
