"""A hard deadline for one database operation, even against a peer that went silent.

``statement_timeout`` only helps while the server answers, and TCP keepalives only
when the network drops packets; a server (or pooler) that hangs with its sockets open
defeats both. So each operation runs as a task with a deadline. Past it, the task is
cancelled; psycopg then asks the server to cancel the statement and waits for that,
up to ~10 s. A second cancellation after a short grace makes psycopg close the
connection at once instead, so an operation never outlives ``deadline + grace`` by
much. The pool discards the closed connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["CANCEL_GRACE", "run_bounded"]

T = TypeVar("T")

#: How long a cancelled statement may take to end politely before its connection is
#: closed instead: a live server answers a cancel request in milliseconds.
CANCEL_GRACE = 1.0


async def run_bounded(
    coro: Coroutine[Any, Any, T],
    seconds: float,
    *,
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """Await ``coro``, or raise :class:`TimeoutError` once ``seconds`` have passed.

    ``discard`` receives a result that arrived while the operation was being given
    up (a connection checked out at the last moment, say), so nothing leaks.
    """
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        # Our caller is being cancelled: so is the operation, but it may still complete
        # (a connection arriving as we leave), and that result must not leak.
        task.cancel()
        if discard is not None:
            task.add_done_callback(lambda t: _discard_later(t, discard))
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=CANCEL_GRACE)
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if discard is not None and not task.cancelled() and task.exception() is None:
        await discard(task.result())
    raise TimeoutError(f"no answer within {seconds:g}s")


_BACKGROUND: set[asyncio.Task[None]] = set()


def _discard_later(task: asyncio.Task[T], discard: Callable[[T], Awaitable[None]]) -> None:
    if task.cancelled() or task.exception() is not None:
        return

    async def run() -> None:
        await discard(task.result())

    cleanup = asyncio.ensure_future(run())
    # Keep a reference until it is done: the event loop only holds weak ones.
    _BACKGROUND.add(cleanup)
    cleanup.add_done_callback(_BACKGROUND.discard)
