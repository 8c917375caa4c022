"""The router's view of nodes cut off mid-request: requests waiting for a node's answer on connections opened before
its host left the network are released as soon as another request, or a probe that a long wait starts, finds it
unreachable (``serving.router.router`` fails them over, as nothing has reached the client)."""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Coroutine
from typing import Any

import aiohttp

log = logging.getLogger("liverl.serving.router")


def unreachable(e: BaseException) -> bool:
    """Whether a failed connection says the node's host is gone from the network (cut off, blackholed): no connection
    accepted within connect_s, or no route to it. A refused one is not: the process is gone or stopping, and the
    connections it held were reset or are being finished."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return True
    return isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)


class NodeBlackholed(aiohttp.ServerTimeoutError):
    """A request waited for a node's answer on a connection opened before the node was found blackholed."""


PROBE_ANSWER_S = 5.0
"""How long a probe, once its connection is accepted, waits for the node's answer (any answer: the node is there)."""
PROBE_AFTER_S = 2.0
"""A request that has waited this long for its node's response head has the node probed, and again each as long."""


class Blackholes:
    """Requests waiting for a node's answer, released when the node is found blackholed: one sent on a keep-alive
    connection opened before its host was cut off would otherwise wait out the whole read timeout for an answer that
    cannot come. The sign is a connection to the node not accepted within connect_s, or no route to it: another
    request's, or the probe's (``probe``, a fresh connection, at most one a node at a time) that a request waiting
    longer than ``PROBE_AFTER_S`` starts. A node that answers the probe, in any way, is reachable: its requests wait
    on (a long generation sends its head only when it is done)."""

    def __init__(self, connect_s: float, probe_after_s: float = PROBE_AFTER_S) -> None:
        self.connect_s, self.probe_after_s = connect_s, probe_after_s
        self._session: aiohttp.ClientSession | None = None  # the probes': a fresh connection each (force_close)
        self._gone: dict[str, asyncio.Event] = {}  # node -> set when it is found blackholed
        self._probes: dict[str, asyncio.Task] = {}  # node -> its probe in flight
        self.probes = 0  # probes started

    async def send(
        self,
        node: str,
        request: Coroutine[Any, Any, aiohttp.ClientResponse],
        probe_url: str | None = None,
    ) -> aiohttp.ClientResponse:
        """``request``'s response head, or its failover error: its own, or ``NodeBlackholed`` when ``node`` was found
        blackholed while it waited (``probe_url``: where the probe asks the node, on a fresh connection)."""
        gone = self._gone.setdefault(node, asyncio.Event())
        send, watch = asyncio.ensure_future(request), asyncio.ensure_future(gone.wait())
        try:
            while True:
                wait_s = self.probe_after_s if probe_url else None
                done, _ = await asyncio.wait((send, watch), timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
                if probe_url is not None and node not in self._probes:
                    self._start_probe(node, probe_url)
        finally:
            watch.cancel()
            if not send.done():
                send.cancel()
        if send.cancelled() or not send.done():
            raise NodeBlackholed(f"{node} was found blackholed while this request waited for its answer")
        return send.result()

    def start(self) -> None:
        """Make the probes' session (on the running loop)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=self.connect_s + PROBE_ANSWER_S, sock_connect=self.connect_s),
        )

    def _start_probe(self, node: str, url: str) -> None:
        async def run() -> None:
            try:
                if self._session is None:
                    return
                async with self._session.get(url) as r:
                    await r.read()
            except Exception as e:  # noqa: BLE001 - only a blackhole matters; any answer says the node is there
                if unreachable(e):
                    log.warning("router: %s did not accept a probe's connection (%s): blackholed", node, e)
                    self.found(node)
            finally:
                self._probes.pop(node, None)

        self.probes += 1
        self._probes[node] = asyncio.create_task(run(), name=f"liverl-probe-{node}")

    async def close(self) -> None:
        probes = list(self._probes.values())
        for t in probes:
            t.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def found(self, node: str) -> None:
        """``node`` did not accept a connection within connect_s: what waits for its answer fails over now."""
        gone = self._gone.pop(node, None)
        if gone is not None:
            gone.set()
