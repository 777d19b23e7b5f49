"""The PostgreSQL store's notifier, with a stand-in for the notifying transaction.

What it promises: an enqueue with few others under way notifies in its own
transaction; a crowded one is handed the notifier instead; queues given while a
notification is being sent go out together in the next one; a failed notification is
logged and the notifier carries on; closing sends what is pending, then takes nothing
more.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest

from tokenline.stores.postgres._notifier import CROWDED, Notifier

WAIT = 10.0  # seconds: a bound for a slow machine, never a measured figure


class Sends:
    """The stand-in transaction: records each call; ``hold`` blocks the next one."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.changed = threading.Condition()
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.fail_next = False

    def __call__(self, queues: list[str]) -> None:
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(WAIT)
        if self.fail_next:
            self.fail_next = False
            raise OSError("server gone")
        with self.changed:
            self.calls.append(queues)
            self.changed.notify_all()

    def wait_for(self, n: int) -> list[list[str]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= n, WAIT), self.calls
            return list(self.calls)


def test_few_enqueues_notify_themselves_and_a_crowded_one_is_handed_the_notifier() -> None:
    notifier = Notifier(Sends(), name="t")
    with contextlib.ExitStack() as under_way:
        for _ in range(CROWDED - 1):
            assert under_way.enter_context(notifier.enqueue()) is None
        with notifier.enqueue() as crowded:
            assert crowded is notifier
        # From another thread, while the others are still under way.
        seen: list[Notifier | None] = []

        def other() -> None:
            with notifier.enqueue() as got:
                seen.append(got)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == [notifier]
    with notifier.enqueue() as alone_again:
        assert alone_again is None


def test_queues_given_while_one_is_sent_go_out_together_in_the_next() -> None:
    sends = Sends()
    sends.hold = threading.Event()
    notifier = Notifier(sends, name="t")
    notifier.add(["a"])
    assert sends.entered.wait(WAIT)  # the first is being sent, and held there
    notifier.add(["c", "b"])
    notifier.add(["b"])
    notifier.add([])
    sends.hold.set()
    assert sends.wait_for(2) == [["a"], ["b", "c"]]
    notifier.close(WAIT)
    assert sends.calls == [["a"], ["b", "c"]]


def test_a_failed_notification_is_logged_and_the_next_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sends = Sends()
    sends.fail_next = True
    notifier = Notifier(sends, name="t")
    with caplog.at_level(logging.WARNING, logger="tokenline.store.postgres"):
        notifier.add(["a"])
        notifier.close(WAIT)
    (record,) = caplog.records
    assert "could not notify workers of new jobs in a (server gone)" in record.getMessage()
    assert "next poll" in record.getMessage()
    notifier = Notifier(sends, name="t")
    notifier.add(["b"])
    assert sends.wait_for(1) == [["b"]]
    notifier.close(WAIT)


def test_close_sends_what_is_pending_then_takes_nothing_more() -> None:
    sends = Sends()
    sends.hold = threading.Event()
    notifier = Notifier(sends, name="t")
    notifier.add(["a"])
    assert sends.entered.wait(WAIT)
    notifier.add(["b"])  # pending behind the held one
    closing = threading.Thread(target=notifier.close, args=(WAIT,))
    closing.start()
    sends.hold.set()
    closing.join(WAIT)
    assert not closing.is_alive()
    assert sends.calls == [["a"], ["b"]]
    notifier.add(["c"])
    with contextlib.ExitStack() as under_way:
        got = [under_way.enter_context(notifier.enqueue()) for _ in range(CROWDED + 1)]
        assert got == [None] * (CROWDED + 1)  # closed: enqueues notify themselves
    notifier.close(WAIT)
    assert sends.calls == [["a"], ["b"]]
