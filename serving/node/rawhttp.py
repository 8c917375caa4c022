"""A small HTTP/1.1 client for the gateway's hot path to the vLLM node: keep-alive connections, the llhttp parser
(``httptools``, the parser uvicorn uses), raw bytes in and out.

Why not aiohttp's client here: the gateway forwards every generation request to the node, and on a small machine the
gateway's CPU per request comes straight out of vLLM's share. aiohttp's client spent about a fifth of the gateway's
CPU (measured with py-spy under ``liverl bench serve``); this client does one write per request and one parser
feed per read. It serves only what the node needs: ``POST`` with a JSON body, answered with a whole body
(``Content-Length``) or a stream of server-sent events (chunked). Anything else (the agent's dev routes, errors in
between) goes through aiohttp in ``NodeClient``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httptools


class NodeUnreachable(ConnectionError):
    """The node's connection failed or closed before the whole response came."""


class _Exchange:
    """One request's response as it arrives: status, then body bytes (whole, or SSE events for a stream)."""

    __slots__ = ("_wake", "body", "done", "error", "events", "headers_done", "status")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.status = 0
        self.body = bytearray()
        self.headers_done = loop.create_future()
        self.done = loop.create_future()
        self.events: list[bytes] | None = None  # set for streams: complete ``data:`` payloads not yet consumed
        self._wake: asyncio.Future | None = None
        self.error: BaseException | None = None

    def wake(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def fail(self, error: BaseException) -> None:
        self.error = error
        for fut in (self.headers_done, self.done):
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: a stream reader may never await ``done``
        self.wake()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: NodeHTTP):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.closed = False
        self.used = False  # has this connection carried a response already (so a close may be a keep-alive race)

    # -- asyncio
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._abort(NodeUnreachable(f"malformed HTTP from the vLLM node: {e}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.fail(NodeUnreachable(f"the vLLM node closed the connection{f': {exc}' if exc else ''}"))
            self.exchange = None

    # -- httptools
    def on_headers_complete(self) -> None:
        ex = self.exchange
        ex.status = self.parser.get_status_code()
        if not ex.headers_done.done():
            ex.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        ex.body += body
        if ex.events is not None and ex.status == 200:
            while (end := ex.body.find(b"\n\n")) >= 0:
                event = bytes(ex.body[:end])
                del ex.body[: end + 2]
                if event.startswith(b"data: "):
                    ex.events.append(event[6:])
            ex.wake()

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        self.used = True
        if not ex.done.done():
            ex.done.set_result(None)
        ex.wake()
        if self.parser.should_keep_alive():
            self.pool._release(self)
        else:
            self._abort(None)

    # -- requests
    def send(self, head: bytes, body: bytes, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.transport.write(head + body)

    def drop(self, exchange: _Exchange) -> None:
        """Close the connection if it is still busy with ``exchange`` (a response the caller gives up on)."""
        if self.exchange is exchange:
            self.exchange = None
            self._abort(None)

    def _abort(self, error: BaseException | None) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if error is not None and self.exchange is not None:
            self.exchange.fail(error)
            self.exchange = None


class NodeHTTP:
    """Keep-alive connections to one node (``host:port``), at most ``max_connections`` at a time."""

    def __init__(self, host: str, port: int, timeout_s: float, max_connections: int, key: str = ""):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._host_header = f"{host}:{port}".encode()
        self._auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""

    def _head(self, path: str, n: int) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
            path.encode(),
            self._host_header,
            self._auth,
            n,
        )

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as e:
            raise NodeUnreachable(f"cannot connect to the vLLM node at {self.host}:{self.port}: {e}") from e
        return conn

    async def _wait(self, fut: asyncio.Future) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await fut
        except TimeoutError:
            raise NodeUnreachable(f"no answer from the vLLM node within {self.timeout_s:g} s") from None

    def _release(self, conn: _Connection) -> None:
        if not conn.closed:
            self._idle.append(conn)

    async def _send(self, path: str, body: bytes, stream: bool) -> tuple[_Connection, _Exchange]:
        """Send on a pooled connection and wait for the response headers; retried once on a fresh connection when
        a pooled one turns out closed before anything came back (the node never read the request)."""
        head = self._head(path, len(body))
        for attempt in (0, 1):
            conn = await self._connect()
            ex = _Exchange(asyncio.get_running_loop())
            if stream:
                ex.events = []
            reused = conn.used
            conn.send(head, body, ex)
            try:
                await self._wait(ex.headers_done)
                return conn, ex
            except NodeUnreachable:
                if attempt or not reused:
                    raise
            except BaseException:
                conn.drop(ex)
                raise
        raise AssertionError("unreachable")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body``; returns (status, whole response body)."""
        async with self._slots:
            conn, ex = await self._send(path, body, stream=False)
            try:
                await self._wait(ex.done)
            except BaseException:
                conn.drop(ex)
                raise
            return ex.status, bytes(ex.body)

    @asynccontextmanager
    async def stream(self, path: str, body: bytes) -> AsyncIterator[NodeStream]:
        """POST ``body`` for a streamed answer; yields the open ``NodeStream`` (closed when the block is left)."""
        async with self._slots:
            conn, ex = await self._send(path, body, stream=True)
            stream = NodeStream(self, conn, ex)
            try:
                yield stream
            finally:
                stream.close()

    async def close(self) -> None:
        for conn in self._idle:
            conn._abort(None)
        self._idle.clear()


class NodeStream:
    """An open streamed response: ``status``, ``await body()`` (non-200 answers), ``async for data in events()``.
    ``close()`` (or leaving ``NodeClient.stream``'s block) drops the connection, so vLLM aborts the request."""

    def __init__(self, pool: NodeHTTP, conn: _Connection, exchange: _Exchange):
        self.pool, self.conn, self.ex = pool, conn, exchange
        self.status = exchange.status

    async def body(self) -> bytes:
        await self.pool._wait(self.ex.done)
        return bytes(self.ex.body)

    async def events(self) -> AsyncIterator[bytes]:
        ex, loop = self.ex, asyncio.get_running_loop()
        while True:
            if ex.events:
                batch, ex.events = ex.events, []
                for data in batch:
                    yield data
                continue
            if ex.error is not None:
                raise ex.error
            if ex.done.done():
                return
            ex._wake = loop.create_future()
            await self.pool._wait(ex._wake)  # the longest silence between two events

    def close(self) -> None:
        self.conn.drop(self.ex)  # mid-response, the connection cannot be reused; after it, it is back in the pool
