"""The worker: state machine, job context, batch completer and the worker loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .. import events
from .._config import WorkerSettings
from .._errors import ConfigError
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


def run_worker(
    app: App,
    settings: WorkerSettings | None = None,
    *,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> WorkerCounters:
    """Run a worker in this thread until SIGTERM/SIGINT; return what it did.

    With ``metrics_port``, the worker serves ``/metrics``, ``/healthz`` and ``/readyz``
    there (needs the ``metrics`` extra); a port in use is refused before the worker
    starts.

    A sync handler cannot be interrupted; after a forced stop or a drain timeout its
    job has been released (or its lease will expire), and the process must not wait
    for the thread at exit. So if any handler thread is still running when the worker
    has stopped, the process ends here, after flushing its output.
    """
    worker = Worker(app, settings)
    with contextlib.ExitStack() as stack:
        if metrics_port is not None:
            stack.enter_context(_metrics(worker, metrics_port, metrics_host))
        _run_on_through_stops(worker)
    if worker.sync_handlers_running:
        logging.getLogger("tokenline.worker").warning(
            "worker %s: exiting with sync handlers still running (their jobs were given "
            "back, or run again once their leases expire)",
            worker.id,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return worker.counters


def _run_on_through_stops(worker: Worker) -> None:
    """Run ``worker`` on an event loop of its own until it stops, as ``asyncio.run``
    would, but not end it when a job's handler stops the loop (``loop.stop()``): the
    process exited with a traceback, its other jobs held until their leases expired and
    its maintenance lease with them. The loop runs on, and the worker says so."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        task = loop.create_task(worker.run(install_signal_handlers=True))
        while True:
            try:
                loop.run_until_complete(task)
                return
            except RuntimeError:
                if task.done():  # the worker's own error, not a stopped loop
                    raise
                logging.getLogger("tokenline.worker").error(
                    "worker %s: a job's handler stopped the event loop (loop.stop()); "
                    "the worker runs on. A handler must not stop the loop it runs on",
                    worker.id,
                )


@contextlib.contextmanager
def _metrics(worker: Worker, port: int, host: str) -> Iterator[None]:
    """Serve ``worker``'s metrics and health on ``host:port`` while the block runs."""
    try:
        import prometheus_client as prom

        from .. import metrics
    except ImportError as exc:
        raise ConfigError("metrics_port", str(exc)) from None
    # A registry of the worker's own: the process's defaults plus the worker's metrics.
    registry = prom.CollectorRegistry()
    prom.ProcessCollector(registry=registry)
    prom.PlatformCollector(registry=registry)
    prom.GCCollector(registry=registry)
    hook = metrics.WorkerMetrics(registry)
    # Where the worker starts: the events only report changes.
    hook.concurrency_limit.set(worker.concurrency_limit)
    hook.state.labels(worker.state.value).set(1)
    health, ready = metrics.worker_health(worker)
    server = metrics.serve(port, host=host, registry=registry, health=health, ready=ready)
    events.add_hook(hook)
    try:
        yield
    finally:
        events.remove_hook(hook)
        server.close()
