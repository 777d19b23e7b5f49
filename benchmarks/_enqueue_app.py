"""The enqueue benchmarks' store: a fresh one, with the app that enqueues into it.

A SQLite file in a temporary directory (``url`` ``None``) or a fresh schema on the
PostgreSQL server ``url`` names, removed when the block ends; the app has one task,
``bench.noop``, that never runs, and its store is open before the block starts, so
that opening it is never timed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tokenline import App
from tokenline.drill._scratch import scratch_for

#: The task every job of these benchmarks names.
TASK = "bench.noop"


@contextlib.contextmanager
def enqueue_app(url: str | None, prefix: str) -> Iterator[App]:
    """An open app on a fresh store named after ``prefix``, removed afterwards."""
    scratch = scratch_for(url, keep=False, prefix=prefix)
    try:
        scratch.prepare({})
        app = App(scratch.url)

        @app.task(name=TASK)
        def noop(ctx: Any, i: int) -> None:
            """Never runs here."""

        app.enqueue(TASK, -1)  # opens the store: not timed
        try:
            yield app
        finally:
            app.close()
    finally:
        scratch.cleanup()
