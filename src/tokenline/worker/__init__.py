"""The worker: state machine, job context, batch completer and the worker loop."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING

from .._config import WorkerSettings
from .context import JobContext
from .state import InvalidTransitionError, WorkerEvent, WorkerState, next_state
from .worker import Worker, WorkerCounters

if TYPE_CHECKING:
    from .._app import App

__all__ = [
    "InvalidTransitionError",
    "JobContext",
    "Worker",
    "WorkerCounters",
    "WorkerEvent",
    "WorkerState",
    "next_state",
    "run_worker",
]


def run_worker(app: App, settings: WorkerSettings | None = None) -> WorkerCounters:
    """Run a worker in this thread until SIGTERM/SIGINT; return what it did.

    A sync handler cannot be interrupted; after a forced stop or a drain timeout its
    job has been released (or its lease will expire), and the process must not wait
    for the thread at exit. So if any handler thread is still running when the worker
    has stopped, the process ends here, after flushing its output.
    """
    worker = Worker(app, settings)
    asyncio.run(worker.run(install_signal_handlers=True))
    if worker.sync_handlers_running:
        logging.getLogger("tokenline.worker").warning(
            "worker %s: exiting with sync handlers still running (their jobs were released)",
            worker.id,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return worker.counters
