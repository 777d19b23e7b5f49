"""One LISTEN connection per store, waking every ``wait_for_jobs`` caller it concerns.

Enqueues (and rescues, resumes, dead-letter retries) ``pg_notify`` the channel
``tokenline_<schema>`` with the queue name as payload, in the same transaction, so a
notification means committed jobs. A single background task owns the connection and
hands each notification to the waiters whose queues it names.

Notifications only make waiting shorter; they are never needed for correctness. A
waiter always returns by its timeout, so a listener that cannot connect, or whose
connection drops or hangs, degrades to polling and never blocks a worker. A lost
connection wakes every waiter at once (a notification may have been missed while it
was down), and the next wait reconnects at once; a connection that could not be
established is retried ``retry_interval`` later, while anyone is waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql

__all__ = ["Listener"]

log = logging.getLogger("tokenline.store.postgres")


@dataclass(eq=False)
class _Waiter:
    queues: frozenset[str]
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class Listener:
    """The store's LISTEN connection and the waiters it serves."""

    def __init__(
        self,
        conninfo: str,
        channel: str,
        *,
        timeout: float,
        probe_interval: float = 30.0,
        retry_interval: float = 1.0,
    ) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._retry_interval = retry_interval
        self._waiters: set[_Waiter] = set()
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._retry_handle: asyncio.TimerHandle | None = None
        self._closed = False
        #: Backend pid of the listening connection while it is up, else ``None``.
        self.backend_pid: int | None = None

    async def wait(self, queues: Iterable[str], seconds: float) -> None:
        """Return on a notification for one of ``queues``, or after ``seconds``."""
        waiter = _Waiter(frozenset(queues))
        self._waiters.add(waiter)
        try:
            self._ensure_running()
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for can turn the
            # caller's cancellation into a TimeoutError, which this suppress would eat,
            # and a worker's fetch loop would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, seconds)):
                    await waiter.woken.wait()
        finally:
            self._waiters.discard(waiter)

    def _ensure_running(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        loop = asyncio.get_running_loop()
        delay = self._retry_at - loop.time()
        if delay > 0:
            # Do not hammer a server that just refused us, but do not wait for the next
            # caller either: a long wait should not run its course without listening.
            if self._retry_handle is None:
                self._retry_handle = loop.call_later(delay, self._retry)
            return
        self._task = loop.create_task(self._run(), name=f"tokenline-listen-{self._channel}")

    def _retry(self) -> None:
        self._retry_handle = None
        if self._waiters:
            self._ensure_running()

    async def _run(self) -> None:
        conn: AsyncConnection[Any] | None = None
        try:
            conn = await AsyncConnection.connect(self._conninfo, autocommit=True)
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            self.backend_pid = conn.info.backend_pid
            while True:
                async for notify in conn.notifies(timeout=self._probe_interval):
                    self._dispatch(notify.payload)
                # Quiet for a while: prove the connection is alive. A peer that vanished
                # without closing the socket would otherwise keep us listening to nothing.
                async with asyncio.timeout(self._timeout):
                    await conn.execute("SELECT 1")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever broke, waiters fall back to their timeouts
            log.warning(
                "LISTEN connection on %s lost, polling until it is back: %s", self._channel, exc
            )
            if self.backend_pid is None:  # never got to listen: back off before retrying
                self._retry_at = asyncio.get_running_loop().time() + self._retry_interval
        finally:
            was_listening = self.backend_pid is not None
            self.backend_pid = None
            if conn is not None:
                with contextlib.suppress(psycopg.Error, OSError):
                    await conn.close()
            if was_listening:
                self._wake_all()

    def _dispatch(self, queue: str) -> None:
        for waiter in self._waiters:
            if queue in waiter.queues:
                waiter.woken.set()

    def _wake_all(self) -> None:
        for waiter in self._waiters:
            waiter.woken.set()

    async def close(self) -> None:
        """Stop listening and close the connection. Safe to call twice."""
        self._closed = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._wake_all()
