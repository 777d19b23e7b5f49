"""Fixtures for the drill's fault-injection tests: an echo server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socketserver
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

# ``postgres_server`` (skip, or fail in CI, without a server) lives in tests/conftest.py.


class EchoServer:
    """A TCP server on loopback that sends every byte back, counting what it got."""

    def __init__(self) -> None:
        self.received = 0
        self.connections = 0
        #: Where to connect, once started.
        self.address = ("127.0.0.1", 0)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[object]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._echo, "127.0.0.1", 0)
        self.address = ("127.0.0.1", int(self._server.sockets[0].getsockname()[1]))

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while data := await reader.read(65536):
                self.received += len(data)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            self._tasks.discard(task)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    """A running echo server on loopback."""
    server = EchoServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(OSError):
            while data := self.request.recv(65536):
                self.request.sendall(data)


@pytest.fixture
def echo_thread() -> Iterator[tuple[str, int]]:
    """A blocking echo server in threads, for tests without an event loop."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, name="echo")
    thread.start()
    try:
        yield "127.0.0.1", int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()  # joins the handler threads: their clients are gone by now
        thread.join()
