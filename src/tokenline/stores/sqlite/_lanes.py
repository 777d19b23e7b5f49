"""The SQLite store's threads: a lane per file, and the calls that run on them.

Every call on a file that may have to wait runs on that file's own thread (a
:class:`Lane`), so the event loop never blocks on SQLite and a renewal (coordination
file) never queues behind a claim (main file). A short call may instead run on the
event loop's own thread, with connections of its own that never wait for a lock
(:class:`Here`): a round trip to a thread and back costs more than a claim itself.
:class:`Writers` counts this process's fenced transactions holding the main file's
write lock, so that the store's own calls wait for them instead of reporting the store
unavailable.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..._errors import StoreUnavailableError

__all__ = ["Begun", "Here", "Lane", "Writers"]

T = TypeVar("T")


class Writers:
    """This process's fenced transactions that hold the main file's write lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._last_closed = -math.inf

    def opened(self) -> None:
        with self._lock:
            self._open += 1

    def closed(self) -> None:
        with self._lock:
            self._open -= 1
            self._last_closed = time.monotonic()

    def held_since(self, since: float) -> bool:
        """Whether one of them held the lock at any time since ``since`` (monotonic)."""
        with self._lock:
            return self._open > 0 or self._last_closed >= since


class _Call:
    """One call's progress on its lane, shared by the waiting task and the thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = self.finished = self.abandoned = False


class _Abandoned(StoreUnavailableError):
    """The caller stopped waiting before the call could start: it never ran."""


class Begun(StoreUnavailableError):
    """The caller stopped waiting for a call that had begun on its lane: holding the
    write lock already, it may still commit."""


class Lane:
    """One thread and the connections it owns; calls run there one at a time.

    A call is bounded twice. Its own wait for another connection's lock ends after the
    store timeout, cleanly, having changed nothing. The caller's deadline, longer, is
    the last resort against a thread that stops answering (a hung disk) or a queue of
    calls that wait in turn: past it the call is abandoned — skipped if it has not
    started, and, if it has, it stops waiting for the lock at its next try — so that no
    claim lands for a caller that has given up on it, leaving jobs running that nobody
    runs. ``fn`` gets a function that says whether it has been abandoned.
    """

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.conns: tuple[sqlite3.Connection, ...] = ()

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def call(
        self,
        fn: Callable[[Callable[[], bool]], T],
        *,
        deadline: float,
        path: Path,
        keep_waiting: Callable[[float], bool] | None = None,
    ) -> T:
        """Run ``fn`` on the lane's thread, abandoning it past ``deadline`` seconds
        (while ``keep_waiting(since)`` holds, the wait goes on)."""
        state = _Call()
        # The executor's own future, waited for directly: wrapping it in a task cost
        # two more turns of the event loop per call, a third of a call's overhead.
        future = asyncio.get_running_loop().run_in_executor(
            self.executor, self._guarded(fn, state, path)
        )
        try:
            while True:
                began = time.monotonic()
                done, _ = await asyncio.wait({future}, timeout=deadline)
                if done:
                    return future.result()
                if keep_waiting is None or not keep_waiting(began):
                    with state.lock:
                        begun = state.started and not state.finished
                    raise (Begun if begun else StoreUnavailableError)(
                        f"SQLite store {str(path)!r} did not answer within {deadline:g}s"
                    )
        except BaseException:
            self._abandon(state)
            future.cancel()
            raise

    @staticmethod
    def _guarded(
        fn: Callable[[Callable[[], bool]], T], state: _Call, path: Path
    ) -> Callable[[], T]:
        def run() -> T:
            with state.lock:
                if state.abandoned:
                    raise _Abandoned(f"SQLite store {str(path)!r}: call abandoned")
                state.started = True
            try:
                return fn(lambda: state.abandoned)
            finally:
                with state.lock:
                    state.finished = True

        return run

    @staticmethod
    def _abandon(state: _Call) -> None:
        with state.lock:
            state.abandoned = True

    def close(self) -> None:
        conns, self.conns = self.conns, ()

        def close_all() -> None:
            for conn in conns:
                conn.close()

        self.executor.submit(close_all).result()
        self.executor.shutdown(wait=True)


class Here:
    """Connections for calls on the caller's own thread (the event loop's), one call at
    a time. Their busy timeout is 0: a lock another connection holds — this process's
    lane included — makes SQLite answer "busy" at once, and the call goes to the lane.
    """

    def __init__(self, conns: tuple[sqlite3.Connection, ...]) -> None:
        self.conns = conns
        self._lock = threading.Lock()

    def run(self, fn: Callable[[tuple[sqlite3.Connection, ...]], T]) -> tuple[bool, T | None]:
        """``(True, fn(conns))``, or ``(False, None)`` at once if another thread is
        using the connections (a store shared by two event loops) or they are closed."""
        if not self.conns or not self._lock.acquire(blocking=False):
            return False, None
        try:
            return True, fn(self.conns)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the connections (waiting for a call in progress on another thread)."""
        with self._lock:
            conns, self.conns = self.conns, ()
            for conn in conns:
                conn.close()
