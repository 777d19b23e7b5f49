"""The fault proxy against a real echo server: each fault, switched on and off while
connections are open. Timings assert lower bounds only (a slow machine adds time, it
never removes it); absence of traffic is checked over short windows."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time
from collections.abc import AsyncIterator

import pytest

from tokenline._errors import ConfigError
from tokenline.drill import FaultProxy, Faults, ProxyListenError, ThreadedFaultProxy
from tokenline.drill import proxy as proxy_module

from .conftest import EchoServer

#: asyncio may wake a timer up to its clock resolution early; bounds allow for that.
SLACK = 0.02


@pytest.fixture
async def proxy(echo: EchoServer) -> AsyncIterator[FaultProxy]:
    """A fault proxy in front of the echo server."""
    async with FaultProxy(upstream=echo.address, seed=7) as p:
        yield p


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connection to the proxy, closed (whatever state it is in) on exit."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def echo_once(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> float:
    """Send ``payload``, read it back; the seconds it took."""
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
    assert got == payload
    return time.monotonic() - started


async def assert_silent(reader: asyncio.StreamReader, seconds: float = 0.3) -> None:
    """Nothing arrives on ``reader`` for ``seconds`` (and the connection stays open)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), seconds)


async def test_a_clean_proxy_forwards_both_ways_and_counts(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    """Without faults every byte crosses in order and is counted in each direction."""
    payload = bytes(range(256)) * 1000
    async with connect(proxy.port) as (reader, writer):
        await echo_once(reader, writer, payload)
    stats = proxy.stats
    assert stats.accepted == 1
    assert stats.bytes_to_server == len(payload)
    assert stats.bytes_to_client == len(payload)
    assert stats.bytes_dropped == 0
    assert echo.received == len(payload)


async def test_latency_applies_in_each_direction(proxy: FaultProxy) -> None:
    """Latency is added to every chunk each way: a round trip takes at least twice it."""
    async with connect(proxy.port) as (reader, writer):
        proxy.set_faults(Faults(latency=0.15))
        assert await echo_once(reader, writer, b"ping") >= 0.3 - SLACK


async def test_jitter_never_reorders_bytes(proxy: FaultProxy) -> None:
    """Chunks with jitter larger than their spacing still arrive in the order sent."""
    proxy.set_faults(latency=0.02, jitter=0.02)
    async with connect(proxy.port) as (reader, writer):
        sent = b""
        for i in range(60):
            piece = f"<{i}>".encode()
            sent += piece
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.002)
        got = await asyncio.wait_for(reader.readexactly(len(sent)), 20)
    assert got == sent


async def test_clearing_latency_releases_held_chunks(proxy: FaultProxy) -> None:
    """A chunk held by a long latency is delivered as soon as the latency is cleared."""
    proxy.set_faults(latency=60)
    async with connect(proxy.port) as (reader, writer):
        writer.write(b"held")
        await writer.drain()
        await assert_silent(reader, 0.2)
        proxy.clear()
        assert await asyncio.wait_for(reader.readexactly(4), 20) == b"held"


async def test_blackhole_swallows_everything_until_cleared(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    """A blackhole accepts connections and bytes but nothing reaches the server or comes
    back; the connection stays open and carries traffic again once cleared."""
    async with connect(proxy.port) as (reader, writer):
        await echo_once(reader, writer, b"before")
        proxy.set_faults(Faults(blackhole=True))
        writer.write(b"lost")
        await writer.drain()
        await assert_silent(reader)
        async with connect(proxy.port) as (new_reader, new_writer):
            new_writer.write(b"also lost")
            await new_writer.drain()
            await assert_silent(new_reader)
        proxy.clear()
        await echo_once(reader, writer, b"after")
    assert echo.received == len(b"beforeafter")
    assert proxy.stats.bytes_dropped == len(b"lost") + len(b"also lost")


async def test_loss_to_server_keeps_the_connection_open(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    """With client→server loss the server never sees the bytes, yet the connection
    stays up and works again when the loss stops."""
    async with connect(proxy.port) as (reader, writer):
        proxy.set_faults(drop_to_server=True)
        writer.write(b"request")
        await writer.drain()
        await assert_silent(reader)
        assert echo.received == 0
        proxy.clear()
        await echo_once(reader, writer, b"again")
    assert proxy.stats.bytes_dropped == len(b"request")


async def test_loss_to_client_delivers_the_request_but_not_the_answer(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    """With server→client loss the server gets the request and answers, and the answer
    is dropped: the lost ack at the network level."""
    async with connect(proxy.port) as (reader, writer):
        proxy.set_faults(drop_to_client=True)
        writer.write(b"commit")
        await writer.drain()
        await assert_silent(reader)
        assert echo.received == len(b"commit")
        assert proxy.stats.bytes_dropped == len(b"commit")
        proxy.clear()
        await echo_once(reader, writer, b"next")


async def test_bandwidth_cap_sets_a_lower_bound_on_transfer_time(proxy: FaultProxy) -> None:
    """N bytes through a cap of R bytes per second take at least N / R seconds."""
    proxy.set_faults(bandwidth=40_000)
    async with connect(proxy.port) as (reader, writer):
        elapsed = await echo_once(reader, writer, b"x" * 20_000)
    assert elapsed >= 0.5 - SLACK


async def test_reset_aborts_current_connections_only(proxy: FaultProxy) -> None:
    """reset() ends every open connection with an RST; new connections work."""
    async with connect(proxy.port) as (reader, writer):
        await echo_once(reader, writer, b"up")
        assert proxy.reset() == 1
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 5)
    assert proxy.stats.resets == 1
    async with connect(proxy.port) as (reader, writer):
        await echo_once(reader, writer, b"fresh")


async def test_refuse_resets_new_connections_until_cleared(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    """While refusing, a new connection is reset at once and never reaches the server;
    connections opened before keep working."""
    async with connect(proxy.port) as (old_reader, old_writer):
        await echo_once(old_reader, old_writer, b"old")
        proxy.set_faults(refuse=True)
        async with connect(proxy.port) as (reader, _writer):
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(1), 5)
        await echo_once(old_reader, old_writer, b"still")
        proxy.clear()
        async with connect(proxy.port) as (reader, writer):
            await echo_once(reader, writer, b"new")
    assert proxy.stats.refused == 1
    assert echo.connections == 2


async def test_unreachable_upstream_closes_the_client_and_is_counted() -> None:
    """A client of a proxy whose upstream refuses is cut off, and the failure counted."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # nothing listens here once closed
    async with FaultProxy(upstream=("127.0.0.1", dead_port)) as proxy:
        async with connect(proxy.port) as (reader, _writer):
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(1), 5) == b""
        assert proxy.stats.upstream_failures == 1


async def test_a_port_in_use_is_a_clear_oserror(proxy: FaultProxy, echo: EchoServer) -> None:
    """Listening on a taken port fails with an OSError naming that port."""
    other = FaultProxy(upstream=echo.address, port=proxy.port)
    with pytest.raises(ProxyListenError, match=f":{proxy.port}: port already in use") as info:
        await other.start()
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.EADDRINUSE
    await other.aclose()


async def test_exit_closes_every_connection_and_task(echo: EchoServer) -> None:
    """Leaving the context with connections open and chunks held ends every task (and,
    with warnings as errors, leaks no socket)."""
    async with FaultProxy(upstream=echo.address) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        await echo_once(reader, writer, b"open")
        proxy.set_faults(latency=60)
        writer.write(b"held")
        await writer.drain()
        await asyncio.sleep(0.05)
        assert proxy.stats.active == 1
    assert [t for t in asyncio.all_tasks() if is_proxy_task(t)] == []
    assert proxy.stats.active == 0
    # Closed, not left hanging: an end of stream, or a reset if bytes were still unread.
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with contextlib.suppress(ConnectionResetError):
        await writer.wait_closed()


def is_proxy_task(task: asyncio.Task[object]) -> bool:
    """Whether ``task`` runs code of the proxy module."""
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None)
    return code is not None and code.co_filename == proxy_module.__file__


def test_faults_are_validated() -> None:
    """Bad fault values and unknown keys are refused with the field's name."""
    with pytest.raises(ConfigError, match=r"faults\.latency"):
        Faults(latency=-1)
    with pytest.raises(ConfigError, match=r"faults\.bandwidth"):
        Faults(bandwidth=0)
    with pytest.raises(ConfigError, match=r"faults\.blackhole"):
        Faults(blackhole=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="latncy"):
        Faults.from_mapping({"latncy": 0.1})
    faults = Faults.from_mapping({"latency": 0.1, "drop_to_client": True})
    assert faults.to_mapping() == {"latency": 0.1, "drop_to_client": True}


async def test_the_seed_fixes_the_jitter_draws(echo: EchoServer) -> None:
    """Two proxies with the same seed draw the same jitter sequence."""
    async with (
        FaultProxy(upstream=echo.address, seed=42) as a,
        FaultProxy(upstream=echo.address, seed=42) as b,
    ):
        assert [a.draw() for _ in range(5)] == [b.draw() for _ in range(5)]


def test_threaded_proxy_serves_synchronous_callers(echo_thread: tuple[str, int]) -> None:
    """The threaded proxy forwards for blocking sockets, and its setters take effect
    from the calling thread at once."""
    with ThreadedFaultProxy(upstream=echo_thread, seed=1) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"sync")
            assert sock.recv(4) == b"sync"
            proxy.set_faults(Faults(blackhole=True))
            assert proxy.faults.blackhole
            sock.sendall(b"gone")
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(4)
            proxy.clear()
            sock.settimeout(10)
            sock.sendall(b"back")
            assert sock.recv(4) == b"back"
            assert proxy.reset() == 1
        assert proxy.stats.resets == 1
        with pytest.raises(ProxyListenError, match=str(proxy.port)):
            ThreadedFaultProxy(upstream=echo_thread, port=proxy.port).start()
    with pytest.raises(RuntimeError, match="not running"):
        proxy.set_faults(latency=1)


async def test_closing_ends_even_when_a_link_close_is_cancelled(
    echo: EchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() cancels each handler; if the handler's closing of its link is cancelled
    in turn, the handler still leaves the set aclose() waits on: closing ends instead of
    spinning forever (which hung a test run for its whole timeout)."""

    async def cancelled_close(self: object) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(proxy_module._Link, "close", cancelled_close)
    proxy = FaultProxy(upstream=echo.address)
    await proxy.start()
    async with connect(proxy.port) as (reader, writer):
        await echo_once(reader, writer, b"ping")
        async with asyncio.timeout(10):
            await proxy.aclose()
