"""``serve`` on a background thread, for tests that need the serving stack in their own process."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from core.config import LiverlConfig
from serving.agent.agent import Agent
from serving.agent.main import serve
from serving.node.gateway import Gateway

log = logging.getLogger("tests.serving")


class ServingThread:
    """``serve`` on a daemon thread with its own event loop (tests, demo). ``start()`` blocks until ready."""

    def __init__(
        self,
        cfg: LiverlConfig,
        model_dir: str | os.PathLike,
        bootstrap: str,
        redis_url: str,
        registry_url: str | None,
        base_version: int = 0,
    ):
        self.args = (cfg, model_dir, bootstrap, redis_url, registry_url)
        self.base_version = base_version
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gateway: Gateway | None = None
        self.agent: Agent | None = None
        self.node = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="liverl-serving", daemon=True)

    @property
    def url(self) -> str:
        cfg = self.args[0]
        return f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"

    def _main(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(gw, agent, node) -> None:
                self.gateway, self.agent, self.node = gw, agent, node
                self._ready.set()

            await serve(*self.args, self._stop, on_ready=ready, base_version=self.base_version)

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
            log.exception("serving thread failed")
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 300.0) -> ServingThread:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"serving not ready after {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"serving failed to start: {self._error}") from self._error
        return self

    def call(self, coro_fn, *args, timeout_s: float = 120.0):
        """Run ``coro_fn(*args)`` on the serving loop and return its result (e.g. ``agent.apply_blobs``)."""
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("serving thread did not stop")
