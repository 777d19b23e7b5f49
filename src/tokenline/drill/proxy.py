"""A TCP proxy on loopback that injects network faults between workers and a store.

::

    client ──► 127.0.0.1:port ──[ to_server pipe ]──► upstream (PostgreSQL, Redis…)
           ◄──                ◄─[ to_client pipe ]───

Each accepted connection gets its own upstream connection and two pipes. A pipe is a
reader task and a writer task joined by a bounded queue, so latency is *pipelined* (a
chunk read at ``t`` leaves at ``t + latency``, whatever is queued behind it) and a full
queue stops reading, which pushes back on the sender like a real link. Faults are one
immutable :class:`Faults` value that the writers consult when each chunk is due, so a
change applies at once to every existing and new connection:

* ``latency`` ± ``jitter`` (uniform, never below zero) is added to every chunk in each
  direction, so a request/response round trip gains about twice ``latency``. Chunks
  leave in the order they arrived, whatever their jitter. Chunks already waiting follow
  a new latency (clearing it releases them at once).
* ``blackhole``: connections and bytes are accepted and discarded both ways; the server
  answers nothing. New connections are still opened upstream (the server sees an idle
  client). Bytes discarded are gone, not delayed: a connection that lost bytes is out of
  step with its peer, as after a real partition that outlived TCP's retransmissions; a
  client recovers by timing out and reconnecting. An end of stream (FIN) still crosses,
  so closed connections do not linger.
* ``drop_to_server`` / ``drop_to_client``: the same, one way only (one-way loss).
* ``bandwidth``: bytes per second, per connection and direction, paced in small slices.
* ``refuse``: a new connection is reset (RST) as soon as it is accepted. The port keeps
  listening, so the client's connect succeeds and its first read fails with a reset:
  re-binding the port later could lose it to another socket, which a true
  ``ECONNREFUSED`` would need.
* :meth:`FaultProxy.reset` aborts every current connection with an RST on both sides
  (``SO_LINGER`` 0), once; it is an action, not a state.

Jitter comes from a ``random.Random(seed)``, so a drill's seed fixes the sequence of
draws (interleaving between connections still depends on scheduling).

:class:`FaultProxy` is an async context manager; :class:`ThreadedFaultProxy` runs one on
its own event loop in a background thread, for synchronous callers such as a drill
controller whose workers are other processes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import random
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from .._errors import TokenlineError
from ._spec import check_flag, check_number, from_mapping, to_mapping

__all__ = ["FaultProxy", "Faults", "ProxyListenError", "ProxyStats", "ThreadedFaultProxy"]

log = logging.getLogger("tokenline.drill.proxy")

T = TypeVar("T")

_CHUNK = 65536
#: Chunks a pipe holds before it stops reading (backpressure on the sender).
_QUEUE_CHUNKS = 64
#: A throttled chunk leaves in slices of about this many seconds, so a changed or
#: cleared cap applies quickly even to a large chunk.
_PACE_SLICE = 0.05
#: SO_LINGER on, timeout 0: close() sends RST instead of FIN.
_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass(frozen=True, slots=True)
class Faults:
    """The faults a :class:`FaultProxy` applies; the default value is a clean link."""

    #: Seconds added to every chunk, in each direction.
    latency: float = 0.0
    #: Each chunk's latency varies uniformly by up to ± this many seconds.
    jitter: float = 0.0
    #: Bytes per second per connection and direction; ``None``: no cap.
    bandwidth: float | None = None
    #: Accept and discard everything, both ways.
    blackhole: bool = False
    #: Reset new connections as soon as they are accepted.
    refuse: bool = False
    #: Discard client → server bytes (the connection stays open).
    drop_to_server: bool = False
    #: Discard server → client bytes (the connection stays open).
    drop_to_client: bool = False

    def __post_init__(self) -> None:
        check_number("faults.latency", self.latency)
        check_number("faults.jitter", self.jitter)
        if self.bandwidth is not None:
            check_number("faults.bandwidth", self.bandwidth, allow_zero=False)
        for name in ("blackhole", "refuse", "drop_to_server", "drop_to_client"):
            check_flag(f"faults.{name}", getattr(self, name))

    def drops(self, *, to_server: bool) -> bool:
        """Whether bytes travelling in this direction are discarded."""
        return self.blackhole or (self.drop_to_server if to_server else self.drop_to_client)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Faults:
        """Faults from a JSON object; unknown keys are a :class:`ConfigError`."""
        return from_mapping(cls, data, "faults")

    def to_mapping(self) -> dict[str, Any]:
        """The fields that differ from a clean link, as a JSON-ready dict."""
        return to_mapping(self)


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """Counters of a proxy since it started (a snapshot)."""

    #: TCP connections accepted, including refused ones and failed upstream connects.
    accepted: int = 0
    #: Connections reset on accept because ``refuse`` was on.
    refused: int = 0
    #: Connections closed because the upstream could not be reached.
    upstream_failures: int = 0
    #: Connections aborted by :meth:`FaultProxy.reset`.
    resets: int = 0
    #: Connections open now.
    active: int = 0
    #: Bytes delivered to the server.
    bytes_to_server: int = 0
    #: Bytes delivered to clients.
    bytes_to_client: int = 0
    #: Bytes discarded by ``blackhole`` or one-way loss, both directions.
    bytes_dropped: int = 0


class ProxyListenError(TokenlineError, OSError):
    """The proxy cannot listen on its address (most often: the port is in use)."""


def _abort(writer: asyncio.StreamWriter, *, rst: bool) -> None:
    """Close at once, discarding unsent bytes; with ``rst`` the peer sees a reset."""
    if rst:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


class _Pipe:
    """One direction of a link: read chunks, hold each until due, then deliver it."""

    def __init__(
        self,
        link: _Link,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        *,
        to_server: bool,
    ) -> None:
        self.link = link
        self.proxy = link.proxy
        self.src = src
        self.dst = dst
        self.to_server = to_server
        # (read at, jitter draw in [-1, 1], bytes); b"" marks the end of the stream.
        self.queue: asyncio.Queue[tuple[float, float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
        self.next_free = 0.0  # when the bandwidth cap lets the next byte leave

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await self.src.read(_CHUNK):
                await self.queue.put((loop.time(), self.proxy.draw(), data))
        except OSError:  # ConnectionResetError and kin: pass the reset on
            self.link.abort(rst=True)
            return
        await self.queue.put((loop.time(), 0.0, b""))

    async def write_loop(self) -> None:
        try:
            while True:
                read_at, draw, data = await self.queue.get()
                deliver = await self.proxy.hold(read_at, draw, to_server=self.to_server)
                if not data:
                    if self.dst.can_write_eof():
                        self.dst.write_eof()
                    return
                if deliver:
                    await self._send(data)
                else:
                    self.proxy.count("bytes_dropped", len(data))
        except OSError:
            self.link.abort(rst=True)

    async def _send(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        counter = "bytes_to_server" if self.to_server else "bytes_to_client"
        view = memoryview(data)
        while view:
            rate = self.proxy.faults.bandwidth
            if rate is None:
                piece, view = view, view[len(view) :]
            else:
                size = max(1, int(rate * _PACE_SLICE))
                piece, view = view[:size], view[size:]
                # The slice may leave only once the cap has paid for it, so N bytes
                # take at least N / rate seconds.
                self.next_free = max(loop.time(), self.next_free) + len(piece) / rate
                await asyncio.sleep(self.next_free - loop.time())
            self.dst.write(piece)
            await self.dst.drain()
            self.proxy.count(counter, len(piece))


class _Link:
    """A client connection, its upstream connection and the two pipes between them."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.writers = (client[1], upstream[1])
        self.pipes = (
            _Pipe(self, client[0], upstream[1], to_server=True),
            _Pipe(self, upstream[0], client[1], to_server=False),
        )
        self.tasks: list[asyncio.Task[None]] = []
        self.aborted = False

    async def run(self) -> None:
        self.tasks = [
            asyncio.create_task(coro)
            for pipe in self.pipes
            for coro in (pipe.read_loop(), pipe.write_loop())
        ]
        # The pipes catch their own I/O errors, so this returns once both directions
        # have ended or the link was aborted; cancelling run() cancels them too.
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def abort(self, *, rst: bool) -> None:
        if self.aborted:
            return
        self.aborted = True
        for writer in self.writers:
            _abort(writer, rst=rst)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        for writer in self.writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class FaultProxy:
    """An asyncio TCP proxy from ``host:port`` to ``upstream`` with switchable faults.

    Use as ``async with FaultProxy(upstream=("127.0.0.1", 5432)) as proxy:``, then
    connect to ``proxy.port``; every socket and task is closed on exit. The setters are
    plain methods for callers on the proxy's event loop; other threads use
    :class:`ThreadedFaultProxy`.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.upstream = upstream
        self.host = host
        self.connect_timeout = check_number("connect_timeout", connect_timeout, allow_zero=False)
        self._requested_port = port
        self._rng = random.Random(seed)
        self._faults = Faults()
        self._changed = asyncio.Event()
        self._counts: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False

    # -- life cycle -----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Listen; raise :class:`ProxyListenError` naming the address if that fails."""
        if self._server is not None:
            raise RuntimeError("this FaultProxy is already started")
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, self._requested_port, reuse_address=True
            )
        except OSError as exc:
            reason = "port already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ProxyListenError(
                exc.errno or errno.EADDRNOTAVAIL,
                f"fault proxy cannot listen on {self.host}:{self._requested_port}: {reason}",
            ) from exc
        log.debug("fault proxy %s:%d -> %s:%d", self.host, self.port, *self.upstream)

    async def aclose(self) -> None:
        """Stop listening, abort every connection and wait for every task. Idempotent."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        # Connections accepted just before the close still get their handler; let them
        # run into the closing check instead of outliving the proxy.
        for _ in range(3):
            await asyncio.sleep(0)
        while handlers := [t for t in self._handlers if not t.done()]:
            for link in list(self._links):
                link.abort(rst=False)
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
        self._handlers.clear()
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def port(self) -> int:
        """The port the proxy listens on (chosen by the system when 0 was asked)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the FaultProxy is not listening; use it with `async with`")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for clients to connect to."""
        return self.host, self.port

    # -- faults ---------------------------------------------------------------------------
    @property
    def faults(self) -> Faults:
        """The faults in effect now."""
        return self._faults

    def set_faults(self, faults: Faults | None = None, /, **changes: Any) -> Faults:
        """Switch to ``faults`` (or change some fields of the current ones); returns the
        faults now in effect. Chunks already in flight follow the new faults."""
        new = faults if faults is not None else self._faults
        new = dataclasses.replace(new, **changes) if changes else new
        self._faults = new
        # Wake every writer holding a chunk so it re-reads the faults, then arm anew.
        self._changed.set()
        self._changed = asyncio.Event()
        return new

    def clear(self) -> None:
        """Remove every fault: a clean link again."""
        self.set_faults(Faults())

    def reset(self) -> int:
        """Abort every current connection with an RST on both sides; returns how many."""
        links = [link for link in self._links if not link.aborted]
        for link in links:
            link.abort(rst=True)
        self.count("resets", len(links))
        return len(links)

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        return ProxyStats(**self._counts, active=len(self._links))

    # -- internals used by the pipes ------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (a :class:`ProxyStats` field)."""
        self._counts[name] += n

    def draw(self) -> float:
        """The next jitter draw, uniform in [-1, 1]."""
        return self._rng.uniform(-1.0, 1.0)

    async def hold(self, read_at: float, draw: float, *, to_server: bool) -> bool:
        """Wait until a chunk read at ``read_at`` is due; False if it must be dropped.

        Re-evaluated whenever the faults change, so clearing latency releases held
        chunks and a blackhole also swallows chunks that were already in flight.
        """
        loop = asyncio.get_running_loop()
        while True:
            faults = self._faults
            if faults.drops(to_server=to_server):
                return False
            due = read_at + max(0.0, faults.latency + draw * faults.jitter)
            delay = due - loop.time()
            if delay <= 0:
                return True
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await changed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        link: _Link | None = None
        try:
            self.count("accepted")
            if self._closing:
                return
            if self._faults.refuse:
                self.count("refused")
                _abort(writer, rst=True)
                return
            upstream = await self._connect_upstream()
            if upstream is None:
                _abort(writer, rst=True)
                return
            link = _Link(self, (reader, writer), upstream)
            self._links.add(link)
            await link.run()
        except asyncio.CancelledError:
            # Only aclose() cancels handlers. End quietly then: asyncio 3.11's stream
            # callback calls exception() on a cancelled handler and logs an error.
            if not self._closing:
                raise
        finally:
            try:
                if link is not None:
                    self._links.discard(link)
                    await link.close()
                else:
                    writer.transport.abort()
            except asyncio.CancelledError:
                # aclose() cancels again while the link closes: that is the end anyway.
                if not self._closing:
                    raise
            finally:
                # Always: aclose() waits until no handler is left.
                self._handlers.discard(task)

    async def _connect_upstream(
        self,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        host, port = self.upstream
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            self.count("upstream_failures")
            log.warning(
                "fault proxy: upstream %s:%d unreachable (%s); closing the client",
                host,
                port,
                exc or type(exc).__name__,
            )
            return None


class ThreadedFaultProxy:
    """A :class:`FaultProxy` on its own event loop in a daemon thread.

    For synchronous callers: ``with ThreadedFaultProxy(upstream=…) as proxy:`` (or
    :meth:`start` / :meth:`stop`). The setters are thread-safe and return once the new
    faults are in effect.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        connect_timeout: float = 5.0,
        call_timeout: float = 10.0,
    ) -> None:
        self._make: Callable[[], FaultProxy] = lambda: FaultProxy(
            upstream, host=host, port=port, seed=seed, connect_timeout=connect_timeout
        )
        self._call_timeout = call_timeout
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proxy: FaultProxy | None = None
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> Self:
        """Start the thread and listen; raises :class:`ProxyListenError` like the proxy."""
        if self._thread is not None:
            raise RuntimeError("this ThreadedFaultProxy is already started")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(ready),), name="tokenline-fault-proxy"
        )
        self._thread.daemon = True  # a forgotten stop() must not hang interpreter exit
        self._thread.start()
        try:
            ready.result(self._call_timeout)
        except BaseException:
            self._thread.join(self._call_timeout)
            self._thread = None
            raise
        return self

    async def _main(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            proxy = self._make()
            await proxy.start()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        try:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._proxy = proxy
            ready.set_result(None)
            await self._stop.wait()
        finally:
            await proxy.aclose()

    def stop(self) -> None:
        """Close every connection and the listener, and join the thread. Idempotent."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        thread.join(self._call_timeout)
        if thread.is_alive():
            raise RuntimeError("the fault proxy thread did not stop")
        self._thread = None

    def _call(self, fn: Callable[[FaultProxy], T]) -> T:
        loop, proxy = self._loop, self._proxy
        if loop is None or proxy is None or self._thread is None:
            raise RuntimeError("the ThreadedFaultProxy is not running; call start() first")
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(proxy))
            except BaseException as exc:
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result(self._call_timeout)

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self._call(lambda p: p.port)

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for clients to connect to."""
        return self._call(lambda p: p.address)

    @property
    def faults(self) -> Faults:
        """The faults in effect now."""
        return self._call(lambda p: p.faults)

    def set_faults(self, faults: Faults | None = None, /, **changes: Any) -> Faults:
        """Thread-safe :meth:`FaultProxy.set_faults`."""
        return self._call(lambda p: p.set_faults(faults, **changes))

    def clear(self) -> None:
        """Thread-safe :meth:`FaultProxy.clear`."""
        self._call(lambda p: p.clear())

    def switch_upstream(self, upstream: tuple[str, int]) -> int:
        """Send new connections to ``upstream`` (a promoted replica) and reset the open
        ones, as a failover behind a virtual address does; how many were reset."""

        def switch(p: FaultProxy) -> int:
            p.upstream = upstream
            return p.reset()

        return self._call(switch)

    def reset(self) -> int:
        """Thread-safe :meth:`FaultProxy.reset`."""
        return self._call(lambda p: p.reset())

    @property
    def stats(self) -> ProxyStats:
        """Thread-safe :attr:`FaultProxy.stats`."""
        return self._call(lambda p: p.stats)
