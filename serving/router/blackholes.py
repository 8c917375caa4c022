"""The router's view of nodes cut off mid-request: requests waiting for a node's answer on connections opened before
its host left the network are released as soon as another request finds it unreachable (``serving.router.router``
fails them over, as nothing has reached the client)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Coroutine
from typing import Any

import aiohttp


def unreachable(e: BaseException) -> bool:
    """Whether a failed connection says the node's host is gone from the network (cut off, blackholed): no connection
    accepted within connect_s, or no route to it. A refused one is not: the process is gone or stopping, and the
    connections it held were reset or are being finished."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return True
    return isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)


class NodeBlackholed(aiohttp.ServerTimeoutError):
    """A request waited for a node's answer on a connection opened before the node was found blackholed."""


class Blackholes:
    """Requests waiting for a node's answer, released when the node is found blackholed: one sent on a keep-alive
    connection opened before its host was cut off would otherwise wait out the whole read timeout for an answer that
    cannot come. Another request finding the node blackholed (its connection not accepted within connect_s) is the
    sign."""

    def __init__(self) -> None:
        self._gone: dict[str, asyncio.Event] = {}  # node -> set when it is found blackholed

    async def send(self, node: str, request: Coroutine[Any, Any, aiohttp.ClientResponse]) -> aiohttp.ClientResponse:
        """``request``'s response head, or its failover error: its own, or ``NodeBlackholed`` when ``node`` was found
        blackholed while it waited."""
        gone = self._gone.setdefault(node, asyncio.Event())
        send, watch = asyncio.ensure_future(request), asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait((send, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not send.done():
                send.cancel()
        if send.cancelled() or not send.done():
            raise NodeBlackholed(f"{node} was found blackholed while this request waited for its answer")
        return send.result()

    def found(self, node: str) -> None:
        """``node`` did not accept a connection within connect_s: what waits for its answer fails over now."""
        gone = self._gone.pop(node, None)
        if gone is not None:
            gone.set()
