"""Sabotaged drill apps for the control experiments: each puts back a bug that tokenline
fixed, so a test can show the drill catches it. Worker processes import them from the
test tree (``--app sabotage:…`` with this directory on ``PYTHONPATH``); nothing under
``src/`` can reach them.
"""

from __future__ import annotations

from tokenline import App
from tokenline.drill import app as drill
from tokenline.stores import Store, store_from_url


class WorkerClockApp(App):
    """Hands the worker's own wall clock to its store, as tokenline once did: lease
    expiry, claim eligibility and rescue then follow each worker's clock, so a worker
    whose clock runs ahead rescues live leases and one behind never claims a job."""

    def open_store(self, *, timeout: float | None = None) -> Store:
        return store_from_url(
            self.url,
            clock=self.clock,
            timeout=timeout or self.settings.store_timeout,
            migrate=self.settings.migrate,
        )


def _with_drill_tasks(app: App) -> App:
    for task in drill.app.tasks.values():
        app.task(name=task.name, queue=task.queue, max_attempts=task.max_attempts)(task.fn)
    return app


#: The drill's app with the worker's clock in the store (the clock_skew control).
worker_clock = _with_drill_tasks(WorkerClockApp(clock=drill.app.clock))
