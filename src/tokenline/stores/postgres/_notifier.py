"""The wake-up of an enqueue, sent after its commit instead of inside it.

A ``NOTIFY`` makes PostgreSQL serialize the commit of its transaction with that of
every other notifying transaction: it holds a lock on the notification queue from
before the commit until after the commit record is flushed to disk. Enqueues that each
notified their queue in their own transaction therefore committed one at a time, each
waiting for the others' disk flushes: eight processes enqueueing at once did about
half as many jobs per second as without the notification.

So while several enqueues of the same store are under way (:data:`CROWDED`), an
enqueue that is tokenline's own transaction commits without notifying, and the queues
it made ready are notified right after, by a transaction of their own that writes
nothing to disk and holds that lock only for an instant. :class:`Notifier` sends them
from a thread of its own, off the enqueuing callers' path: queues that become ready
while a notification is being sent go out together in the next one. Fewer enqueues at
once still notify in their own transaction: a notification of its own would cost more
(another transaction, and another thread woken) than the lock does when few wait for
it. An enqueue inside the caller's own transaction (``connection=``) always notifies
in it: only its commit may announce the jobs.

Enqueues from other processes are not seen: processes that each enqueue one job at a
time still commit one after another.

Notifications only make a waiting worker wake sooner; they are never needed for
correctness (see ``_listener.py``). Either way they follow the commit: a worker woken
finds the jobs. A notification that fails, or is lost with a process that dies between
the commit and the notification, costs a waiting worker at most its poll interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

__all__ = ["CROWDED", "Notifier"]

log = logging.getLogger("tokenline.store.postgres")

#: Enqueues under way, this one included, from which an enqueue leaves its notification
#: to the notifier. Measured with app.enqueue from threads sharing one App (2 cores,
#: PostgreSQL on the same machine): from 2 on, 16 threads did a quarter more enqueues a
#: second than with every notification in its transaction, and 4 threads 5-7 % fewer;
#: from 4 on, the same gain at 16 threads, and less loss at 4.
CROWDED = 4


class Notifier:
    """Sends the notifications of committed enqueues from a thread of its own (started
    on first use, and again in a forked child), those that arrive while one is being
    sent together in the next. ``send`` blocks: a transaction that notifies the queues
    it is given."""

    def __init__(self, send: Callable[[list[str]], object], *, name: str) -> None:
        self._send = send
        self._name = name
        self._ready = threading.Condition()
        self._pending: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Enqueues under way: counted on every enqueue, under a lock of its own (the
        # condition's is held while a notification is handed over).
        self._count_lock = threading.Lock()
        self._enqueues = 0

    def enqueue(self) -> _Enqueue:
        """Around an enqueue that commits on its own: ``with`` gives this notifier when
        :data:`CROWDED` enqueues are under way, this one included (commit without
        notifying, then :meth:`add` the queues made ready), else ``None`` (notify
        inside the transaction)."""
        return _Enqueue(self)

    def _begin(self) -> Notifier | None:
        with self._count_lock:
            self._enqueues += 1
            return self if self._enqueues >= CROWDED and not self._closed else None

    def _end(self) -> None:
        with self._count_lock:
            self._enqueues -= 1

    def add(self, queues: Iterable[str]) -> None:
        """Notify ``queues`` soon; from any thread, without waiting. Ignored once
        :meth:`close` began."""
        with self._ready:
            if self._closed:
                return
            self._pending.update(queues)
            if not self._pending:
                return
            if self._thread is None or not self._thread.is_alive():
                # Daemon: a wake-up pending at interpreter exit is one poll lost.
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if not self._pending:
                    return  # closed, and nothing left to send
                queues = sorted(self._pending)
                self._pending.clear()
            try:
                self._send(queues)
            except Exception as exc:  # a wake-up lost costs a waiting worker one poll
                log.warning(
                    "could not notify workers of new jobs in %s (%s); "
                    "waiting workers find them at their next poll",
                    ", ".join(queues),
                    exc,
                )

    def close(self, timeout: float | None = None) -> None:
        """Send what is pending (waiting up to ``timeout`` seconds), then accept
        nothing more. Blocks: call it off the event loop. Safe to call twice."""
        with self._ready:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class _Enqueue:
    """The ``with`` block of :meth:`Notifier.enqueue` (a class: a generator-based
    context manager costs several microseconds, on every single enqueue)."""

    __slots__ = ("_notifier",)

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    def __enter__(self) -> Notifier | None:
        return self._notifier._begin()

    def __exit__(self, *exc: object) -> None:
        self._notifier._end()
