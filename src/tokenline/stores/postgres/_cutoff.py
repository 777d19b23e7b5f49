"""A deadline for what a blocking psycopg connection waits for.

``statement_timeout`` bounds a statement only while the server answers, and keepalives
notice a peer that vanished only when nothing answers for it. Behind a proxy or a load
balancer whose backend went silent, the middlebox acknowledges every packet and every
keepalive, and a blocking ``execute`` waits for ever: a sync handler's thread stuck in
``ctx.transaction()``, or a web server's thread in ``app.enqueue``. The async forms run
as tasks with a deadline (``_deadline.py``); a thread cannot be cancelled.

So :class:`Cutoffs` watches the blocking waits of a store: :meth:`Cutoffs.arm` gives a
connection a deadline before it is used, and disarming it afterwards (``with``) is
cheap. One daemon thread per store sleeps until the nearest deadline; a connection still
armed past its deadline has its socket shut down. The thread blocked on it then
returns at once with a connection error (a coordination error, which the callers treat
as an outage), and the pool discards the broken connection when it comes back.

The shutdown goes through a duplicate of the socket's descriptor, taken while the
connection is known to be in use (under the lock that disarming takes): the socket it
acts on is the connection's, even if the connection is closed a moment later and its
descriptor number reused.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from types import TracebackType
from typing import Any

__all__ = ["Armed", "Cutoffs"]

log = logging.getLogger("tokenline.store.postgres")

#: The watcher woke this much later than the deadline it slept for: the process was
#: paused (SIGSTOP, a VM stall) or starved, not the server silent (seconds).
LATE = 1.0
#: What a connection found past its deadline on such a late wake is given, to read an
#: answer that may have come while the process stood still (seconds).
GRACE = 1.0


class Armed:
    """One connection's deadline; a context manager that disarms it on exit."""

    __slots__ = ("_cutoffs", "at", "conn", "done", "postponed")

    def __init__(self, cutoffs: Cutoffs, conn: Any, at: float) -> None:
        self._cutoffs = cutoffs
        self.conn = conn
        self.at = at
        #: Disarmed, or cut: the watcher leaves it alone from then on.
        self.done = False
        #: Given :data:`GRACE` after a late wake of the watcher (once).
        self.postponed = False

    def __enter__(self) -> Armed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._cutoffs.disarm(self)


class Cutoffs:
    """Shuts down the socket of a blocking connection still in use past its deadline."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Armed]] = []
        self._order = itertools.count()
        self._disarmed = 0
        self._thread: threading.Thread | None = None
        #: Connections cut so far (for tests and logs).
        self.cut = 0

    def arm(self, conn: Any, seconds: float) -> Armed:
        """Give ``conn`` a deadline ``seconds`` from now; ``with`` the result around its
        use (or :meth:`disarm` it)."""
        armed = Armed(self, conn, time.monotonic() + seconds)
        with self._cond:
            heapq.heappush(self._heap, (armed.at, next(self._order), armed))
            if self._thread is None or not self._thread.is_alive():  # first use, or a fork
                self._thread = threading.Thread(
                    target=self._watch, name=f"{self._name}-cutoff", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is armed:
                self._cond.notify()  # an earlier deadline than the watcher sleeps for
        return armed

    def disarm(self, armed: Armed) -> None:
        """The connection's wait is over: no cut from now on."""
        with self._cond:
            if armed.done:
                return
            armed.done = True
            armed.conn = None
            self._disarmed += 1
            # Deadlines far off pile up when most waits end early: rebuilt, not kept.
            if self._disarmed > 64 and self._disarmed * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
                self._disarmed = 0

    def _watch(self) -> None:
        while True:
            with self._cond:
                due = self._next_due()
                if due is None:
                    continue
                armed, fd = due
            self._cut(armed, fd)

    def _next_due(self) -> tuple[Armed, int] | None:
        """Under the lock: the next armed connection past its deadline, with a duplicate
        of its socket's descriptor; waits for one, returns None to look again."""
        heap = self._heap
        while heap and heap[0][2].done:
            heapq.heappop(heap)
            self._disarmed = max(0, self._disarmed - 1)
        if not heap:
            self._cond.wait()
            return None
        now = time.monotonic()
        wait = heap[0][0] - now
        if wait > 0:
            self._cond.wait(wait)
            return None
        if -wait > LATE and not heap[0][2].postponed:
            # The watcher woke late: the process stood still (a pause, a stall) while
            # the deadlines passed, and the answers the connections wait for may be in
            # their sockets now. Cut at once, healthy connections of a paused process
            # failed, and the log blamed the server. They get a grace period, once.
            self._postpone(now)
            return None
        _, _, armed = heapq.heappop(heap)
        armed.done = True
        conn, armed.conn = armed.conn, None
        try:
            fd = os.dup(conn.fileno())
        except Exception:  # closed already: nothing waits on it
            return None
        return armed, fd

    def _postpone(self, now: float) -> None:
        """Under the lock: give every connection past its deadline :data:`GRACE` more."""
        heap = self._heap
        for i, (at, order, armed) in enumerate(heap):
            if at <= now and not armed.done:
                armed.postponed = True
                heap[i] = (now + GRACE, order, armed)
        heapq.heapify(heap)

    def _cut(self, armed: Armed, fd: int) -> None:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            os.close(fd)
            log.debug("could not shut down a connection past its deadline: %s", exc)
            return
        try:
            with sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            log.debug("could not shut down a connection past its deadline: %s", exc)
            return
        self.cut += 1
        log.warning(
            "%s: a connection still waited for PostgreSQL %.1fs past its deadline; "
            "it was cut (the server, or a proxy in front of it, stopped answering)",
            self._name,
            time.monotonic() - armed.at,
        )
