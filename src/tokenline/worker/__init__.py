"""The worker: state machine, job context, batch completer and the worker loop."""

from __future__ import annotations

import asyncio
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
    """Run a worker in this thread until SIGTERM/SIGINT; return what it did."""
    worker = Worker(app, settings)
    asyncio.run(worker.run(install_signal_handlers=True))
    return worker.counters
