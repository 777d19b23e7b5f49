"""The worker: state machine, job context, batch completer and the worker loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .. import events
from .._config import WorkerSettings
from .._errors import ConfigError
from .context import JobContext
from .state import InvalidTransitionError, WorkerEvent, WorkerState, next_state
from .worker import Worker, WorkerCounters

if TYPE_CHECKING:
    from .._app import App

T = TypeVar("T")

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
    report: Callable[[WorkerCounters], object] | None = None,
) -> WorkerCounters:
    """Run a worker in this thread until SIGTERM/SIGINT; return what it did.

    With ``metrics_port``, the worker serves ``/metrics``, ``/healthz`` and ``/readyz``
    there (needs the ``metrics`` extra); a port in use is refused before the worker
    starts. ``report`` is given what the worker did once it has stopped, also when the
    process ends here (below), where nothing after this call would run.

    A sync handler cannot be interrupted; after a forced stop or a drain timeout its
    job has been released (or its lease will expire), and the process must not wait
    for the thread at exit. So if any handler thread is still running when the worker
    has stopped, the process ends here, after flushing its output.
    """
    worker = Worker(app, settings)
    with contextlib.ExitStack() as stack:
        if metrics_port is not None:
            stack.enter_context(_metrics(worker, metrics_port, metrics_host))
        _run_on_through_stops(worker, report)
    if worker.sync_handlers_running:
        _exit_leaving_threads(worker, "sync handlers", report)
    if report is not None:
        report(worker.counters)
    return worker.counters


def _exit_leaving_threads(
    worker: Worker, what: str, report: Callable[[WorkerCounters], object] | None
) -> None:
    """End the process now, its output flushed, without waiting for the threads of
    ``what`` that still run: they cannot be stopped, and waiting for them kept a
    stopped worker's process alive for as long as they ran, for ever for one that hangs
    (a second SIGTERM did nothing). Their jobs were given back, or run again once their
    leases expire."""
    logging.getLogger("tokenline.worker").warning(
        "worker %s: exiting with %s still running (their jobs were given back, or run "
        "again once their leases expire)",
        *(worker.id, what),
    )
    if report is not None:
        report(worker.counters)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _CountedExecutor(concurrent.futures.ThreadPoolExecutor):
    """The worker loop's default executor (``asyncio.to_thread``, ``run_in_executor``),
    counting the calls under way. An async handler cancelled while one of its calls
    runs there leaves that thread running; the loop's runner waits for every such
    thread as it closes, so a stopped worker whose handler had handed a hanging call to
    a thread never exited."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="tokenline-to-thread")
        self._count_lock = threading.Lock()
        #: Calls submitted and not yet over.
        self.running = 0

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Submit ``fn`` as the pool does, counted until it is over."""
        with self._count_lock:
            self.running += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._over(None)
            raise
        future.add_done_callback(self._over)
        return future

    def _over(self, _: object) -> None:
        with self._count_lock:
            self.running -= 1


def _run_on_through_stops(
    worker: Worker, report: Callable[[WorkerCounters], object] | None = None
) -> None:
    """Run ``worker`` on an event loop of its own until it stops, as ``asyncio.run``
    would, but not end it when a job's handler stops the loop (``loop.stop()``): the
    process exited with a traceback, its other jobs held until their leases expired and
    its maintenance lease with them. The loop runs on, and the worker says so. A call
    of a handler still running in the loop's default executor once the worker has
    stopped ends the process there (see :class:`_CountedExecutor`)."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        executor = _CountedExecutor()
        loop.set_default_executor(executor)
        task = loop.create_task(worker.run(install_signal_handlers=True))
        while True:
            try:
                loop.run_until_complete(task)
                if executor.running:
                    # Before the runner closes: it would wait for those threads.
                    _exit_leaving_threads(worker, "calls of handlers in threads", report)
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
