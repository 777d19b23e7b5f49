"""The dashboard's server closes connections that never send a complete request, head
or body."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tokenline.dashboard import serving


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":  # longer than the head timeout the tests set
        await asyncio.sleep(1.5)
    if scope["method"] == "POST":  # a form: read whole before answering
        while (await receive()).get("more_body"):
            pass
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """``_hello`` served as ``tokenline dashboard`` serves its app, on a free port."""
    import uvicorn

    monkeypatch.setattr(serving, "REQUEST_HEAD_TIMEOUT", 0.5)
    monkeypatch.setattr(serving, "REQUEST_BODY_TIMEOUT", 0.5)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = serving.server_config(_hello)
    config.lifespan = "off"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        assert time.monotonic() < deadline, "the server did not start in time"
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``conn`` within ``seconds`` (its answers read and
    dropped meanwhile)."""
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def _answer(conn: socket.socket) -> bytes:
    """One whole response read from ``conn`` (its body is 5 bytes)."""
    got = b""
    while not (b"\r\n\r\n" in got and len(got.split(b"\r\n\r\n", 1)[1]) >= 5):
        part = conn.recv(4096)
        assert part, f"closed before the whole answer: {got!r}"
        got += part
    return got


def test_a_connection_that_never_completes_its_request_is_closed(served: int) -> None:
    """A client that connected and sent part of a request head, or nothing, was kept
    for as long as it liked: enough of them took every file descriptor."""
    silent = socket.create_connection(("127.0.0.1", served), timeout=5)
    trickle = socket.create_connection(("127.0.0.1", served), timeout=5)
    trickle.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head's end never comes
    with silent, trickle:
        # Well past the timeout, however slow the machine; without it, never.
        assert _closed_within(silent, 20)
        assert _closed_within(trickle, 20)


def test_a_kept_alive_connection_must_send_its_next_head_in_time_too(served: int) -> None:
    """After a response, a partial next request does not keep the connection open."""
    with socket.create_connection(("127.0.0.1", served), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(conn).endswith(b"hello")
        conn.sendall(b"GET / HTTP/1.1\r\n")  # stops uvicorn's keep-alive timer
        assert _closed_within(conn, 20)


def test_requests_in_time_are_answered_and_a_request_under_way_is_not_cut(
    served: int,
) -> None:
    """The timeout bounds the wait for a request head, not the request itself: an
    answer that takes longer than it still arrives, on a connection kept alive."""
    with socket.create_connection(("127.0.0.1", served), timeout=30) as conn:
        for path in (b"/", b"/slow", b"/"):
            conn.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answer(conn).endswith(b"hello")


def test_a_request_whose_body_never_completes_is_closed(served: int) -> None:
    """A complete head, then a body sent a byte now and then (or never finished), kept
    the connection for as long as the client liked."""
    with socket.create_connection(("127.0.0.1", served), timeout=5) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        assert _closed_within(conn, 20)


def test_a_whole_form_is_answered_even_when_its_response_is_slow(served: int) -> None:
    """The body's timeout bounds its arrival, not the answer: a complete POST is
    answered, on a connection kept alive, however long the response takes."""
    with socket.create_connection(("127.0.0.1", served), timeout=30) as conn:
        for path in (b"/", b"/slow", b"/"):
            head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n"
            conn.sendall(head + b"a=1")
            assert _answer(conn).endswith(b"hello")
