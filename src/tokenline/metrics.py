r"""Prometheus metrics: what each worker saw, and what the store holds.

Needs the ``metrics`` extra (``pip install 'tokenline[metrics]'``); nothing else in
tokenline imports this module. Two sources, each exported once:

* :class:`WorkerMetrics`, a hook of :mod:`tokenline.events` in every worker process:
  what happened to the jobs and the coordination of *that* worker. Serve it with
  :func:`serve` (and :func:`worker_health` for ``/healthz`` and ``/readyz``).
* :class:`StoreCollector`, in *one* exporter process (``tokenline exporter``): the
  store-wide view, read once per scrape at most (cached ``max_age`` seconds) rather
  than by every worker.

The names, labels and units below are a contract: alert rules are built on them.

Worker metrics (:class:`WorkerMetrics`)
---------------------------------------

``tokenline_jobs_started_total{queue,task}``
    counter: attempts begun (a job claimed, its handler about to run).
``tokenline_jobs_finished_total{queue,task,outcome}``
    counter: attempt outcomes the store accepted; ``outcome``: ``succeeded``,
    ``retry``, ``dead`` or ``release`` (given back, no attempt spent). An outcome the
    store refused is a stale commit instead.
``tokenline_job_duration_seconds{queue,task}``
    histogram: how long the handler ran, by the worker's monotonic clock.
``tokenline_job_wait_seconds{queue}``
    histogram: from the moment a job could run to its claim (the store's clock).
``tokenline_job_latency_seconds{queue}``
    histogram: end to end, wait plus run, observed when the attempt finishes.
``tokenline_lease_renewal_failures_total{reason}``
    counter: failed renewals of a worker's job leases; ``reason``: ``refused`` (the
    jobs were rescued from it) or ``error`` (the store did not answer in time).
``tokenline_stale_commits_refused_total{operation}``
    counter: writes the store refused for a stale token (fencing at work), by the
    operation refused (``succeeded``, ``retry``, ``dead``, ``fence``, ...: names from
    the code, never free text).
``tokenline_stale_reads_total{view}``
    counter: what the worker held in memory (``view``, e.g. ``job lease``) disagreed
    with the store, and the store won.
``tokenline_event_loop_held_total{queue,task}``
    counter: steps of an async handler (code between two ``await``\ s) that held the
    worker's event loop for a watchdog period (``renew_interval`` / 2, at most 1 s) or
    longer: a blocking call in an async handler, which delays the renewals of every
    job of the worker (the log names the job).
``tokenline_duplicate_executions_total{key_prefix,kind}``
    counter: a key's effect asked for again after it completed (``kind``: ``repeat``),
    or a write under it refused as stale (``stale``).
``tokenline_resource_lease_busy_total{resource_prefix}``
    counter: ``ctx.lease`` found the resource held by someone else.
``tokenline_coordination_errors_total{channel}``
    counter: store calls that failed or timed out, by the role called (``broker``,
    ``leases`` or ``ledger``); the operation is left out, its text is unbounded.
``tokenline_jobs_rescued_total{outcome}``
    counter: jobs rescued from expired leases by this worker as maintenance leader;
    ``outcome``: ``requeued`` or ``dead``.
``tokenline_maintenance_repairs_total{service,kind}``
    counter: what each maintenance service repaired as leader, by kind (the rescuer's
    ``requeued`` and ``dead``; the reconciler's ``job_unacknowledged``,
    ``effect_pending_expired``, ``lease_orphaned``, ``attempt_open``).
``tokenline_maintenance_leader_term``
    gauge: the maintenance term this process leads, 0 when it is not the leader.
``tokenline_worker_state{state}``
    gauge: 1 for the worker's current state, 0 for the others (``ready``,
    ``processing``, ``draining``, ``fenced``, ``stopped``).
``tokenline_heartbeat_gap_seconds``
    gauge: seconds between the last two membership heartbeats the store accepted.
``tokenline_concurrency_limit``
    gauge: how many jobs the worker runs at once now, its adaptive limit between
    ``concurrency_floor`` and ``concurrency`` (falls on timeouts and overload errors).
``tokenline_clock_skew_seconds``
    gauge: the worker's wall clock minus the store's, as last measured.
``tokenline_dependency_calls_total{dependency,outcome}``
    counter: calls to a named dependency through ``ctx.dependency``; ``outcome``:
    ``ok``, ``failed``, ``slow`` (past its ``slow_call``), ``timeout``, or ``rejected``
    (held back by its circuit breaker: in the handler, or a job deferred unrun).
``tokenline_dependency_timeouts_total{dependency}``
    counter: calls that ran past the dependency's ``timeout``.
``tokenline_breaker_state{dependency,state}``
    gauge: 1 for the current state of the worker's circuit breaker of the dependency
    (``closed``, ``open``, ``half_open``), 0 for the others; from its first change.

A key or resource name is labelled by its prefix: the text before its first ``:``
(the whole name if it has none), cut to 32 characters. Label values stay bounded:
after 100 distinct prefixes, further new ones are counted under ``other``.

Store metrics (:class:`StoreCollector`)
---------------------------------------

The ages of jobs and workers are measured by the store's clock, the view's own age
by the exporter's monotonic clock. "Live" workers are those whose membership lease
has not expired and that did not stop.

``tokenline_queue_depth{queue,task,state}``
    gauge: unfinished jobs; ``state``: ``queued`` (runnable now), ``scheduled``
    (waiting for their time) or ``running``. A queue and task once seen (or registered
    with the app) keeps its series, at 0, when it empties.
``tokenline_queue_oldest_job_age_seconds{queue}``
    gauge: age of the oldest runnable job waiting in the queue (0 when none waits).
``tokenline_queue_paused{queue}``
    gauge: 1 when the queue is paused.
``tokenline_dead_jobs{queue}``
    gauge: dead-lettered jobs in the queue.
``tokenline_workers{state}``
    gauge: live workers by the state they last reported (``ready``, ``processing``,
    ``draining``, ``fenced``; each present, 0 when none).
``tokenline_worker_heartbeat_age_seconds{worker}``
    gauge: seconds since each live worker's last heartbeat.
``tokenline_worker_clock_skew_seconds{worker}``
    gauge: each live worker's wall clock minus the store's, as it last measured.
``tokenline_orphan_job_leases``
    gauge: running jobs whose lease has expired by the store's clock and that the
    maintenance leader has not rescued yet (counted among at most 10,000 running jobs).
    Above 0 for longer than a rescue period: no worker is doing maintenance.
``tokenline_orphan_resource_leases``
    gauge: resource leases still held by the store's clock whose owner is no live
    worker (the owner's worker id: the part before its first ``/``; a worker that
    crashed holding the lease). Each expires at its TTL; until then nobody else gets it.
``tokenline_stale_commits_recorded_total``
    counter: job writes the store has refused for a stale token, all workers together.
``tokenline_duplicates_recorded_total{kind}``
    counter: duplicates the ledger has recorded (``repeat`` or ``stale``; the refused
    job commits are among the ``stale`` ones). Counted by the exporter from the store's
    records: all of them (up to 100,000) at its first read, then each new one once.
``tokenline_breaker_open{dependency}``
    gauge: 1 while the dependency's shared circuit breaker is open (its resource
    lease ``tokenline:breaker:<name>`` is held): workers defer the jobs that need it.
    A dependency appears once its breaker has opened at all.
``tokenline_exporter_view_age_seconds``
    gauge: how old the store view being served is (``+Inf`` before the first read).
``tokenline_exporter_store_up``
    gauge: 1 when the exporter's last read of the store succeeded, else 0. While the
    store is unreachable the last view is still served, with its age growing: judge
    the store metrics by this pair, never as fresh on their own.
``tokenline_exporter_queues_omitted``
    gauge: queues whose series were left out of the view served (0 when every queue
    is served; see below).

Per-queue label values stay bounded too: the series of at most 100 queues are served
(``tokenline_queue_depth``, ``tokenline_queue_oldest_job_age_seconds``,
``tokenline_queue_paused``, ``tokenline_dead_jobs``). Beyond that, the largest are
kept: by unfinished jobs, then the age of the oldest runnable job, then dead jobs, ties
by name. The others are counted in ``tokenline_exporter_queues_omitted`` and logged
(a warning when queues start to be left out), never dropped unsaid.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import heapq
import logging
import math
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, TypeVar, cast

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
except ImportError as exc:  # pragma: no cover - exercised in a subprocess
    raise ImportError(
        "tokenline.metrics needs prometheus_client: pip install 'tokenline[metrics]'"
    ) from exc

from . import events
from ._app import App
from ._clock import Clock, SystemClock
from ._errors import ConfigError, NotSupportedError, StoreError, TokenlineError
from ._jobs import JobState, QueueStats, WorkerRecord
from ._records import Duplicate
from .backpressure.breaker import BreakerState
from .dependencies import SharedBreaker, read_shared
from .stores.base import Depth, Store
from .worker.state import WorkerState

if TYPE_CHECKING:
    from .worker import Worker

__all__ = [
    "MetricsServer",
    "StoreCollector",
    "WorkerMetrics",
    "label_prefix",
    "serve",
    "worker_health",
]

log = logging.getLogger("tokenline.metrics")
T = TypeVar("T")

#: A health or readiness check: whether it passes, and why (shown on failure).
Check = Callable[[], tuple[bool, str]]
#: A further path of :func:`serve`: returns (HTTP status, body, content type).
Route = Callable[[], tuple[int, str, str]]

#: Seconds, from a fast handler to an hour-long job or wait.
_TIME_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, math.inf,
)  # fmt: skip
PREFIX_LENGTH = 32
MAX_PREFIXES = 100
#: Queues whose series the exporter serves, the largest first. Each queue costs three
#: series per task and three more: 3,000 queues made a scrape of 18,000 lines, a label
#: cardinality that weighs on the Prometheus server.
MAX_QUEUES = 100
OTHER = "other"
WORKER_STATES = tuple(s.value for s in WorkerState)
_DEPTH_STATES = ("queued", "scheduled", "running")
_CHANNELS = frozenset({"broker", "leases", "ledger"})
BREAKER_STATES = tuple(s.value for s in BreakerState)


def label_prefix(name: str) -> str:
    """The label of a key or resource: the text before its first ``:``, at most 32
    characters."""
    return name.partition(":")[0][:PREFIX_LENGTH]


class _BoundedLabels:
    """Prefixes as label values, at most :data:`MAX_PREFIXES` of them, then ``other``.

    Hooks run on the loop and on handler threads at once: the set is locked.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str) -> str:
        prefix = label_prefix(name)
        with self._lock:
            if prefix in self._seen:
                return prefix
            if len(self._seen) >= MAX_PREFIXES:
                return OTHER
            self._seen.add(prefix)
            return prefix


class WorkerMetrics:
    """An events hook that keeps the worker metrics (see the module docstring)::

        metrics = WorkerMetrics()
        tokenline.events.add_hook(metrics)
        server = serve(9100, health=..., ready=...)

    Its metrics are registered in ``registry`` (default: prometheus_client's global
    one, where a second instance collides). One per process: every worker of the
    process reports into it, and ``tokenline_worker_state`` follows the last change.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.registry = reg

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_TIME_BUCKETS, registry=reg)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        p = "tokenline_"
        self.started = counter(p + "jobs_started_total", "Attempts begun.", "queue", "task")
        self.finished = counter(
            p + "jobs_finished_total", "Outcomes accepted.", "queue", "task", "outcome"
        )
        self.duration = histogram(p + "job_duration_seconds", "Handler run time.", "queue", "task")
        self.wait = histogram(p + "job_wait_seconds", "Runnable to claimed.", "queue")
        self.latency = histogram(p + "job_latency_seconds", "Wait plus run.", "queue")
        self.renewal_failures = counter(
            p + "lease_renewal_failures_total", "Failed job lease renewals.", "reason"
        )
        self.stale_commits = counter(
            p + "stale_commits_refused_total", "Writes refused as stale.", "operation"
        )
        self.stale_reads = counter(p + "stale_reads_total", "Views found stale.", "view")
        self.loop_held = counter(
            p + "event_loop_held_total", "Async handler steps that held the loop.", "queue", "task"
        )
        self.duplicates = counter(
            p + "duplicate_executions_total", "Repeated or stale effects.", "key_prefix", "kind"
        )
        self.resource_busy = counter(
            p + "resource_lease_busy_total", "Resource leases held by another.", "resource_prefix"
        )
        self.coordination_errors = counter(
            p + "coordination_errors_total", "Failed store calls.", "channel"
        )
        self.rescued = counter(p + "jobs_rescued_total", "Jobs rescued as leader.", "outcome")
        self.repairs = counter(
            p + "maintenance_repairs_total", "Repairs by maintenance services.", "service", "kind"
        )
        self.leader_term = gauge(
            p + "maintenance_leader_term", "Maintenance term this process leads (0: none)."
        )
        self.state = gauge(p + "worker_state", "1 for the current state.", "state")
        self.heartbeat_gap = gauge(p + "heartbeat_gap_seconds", "Gap between heartbeats.")
        self.clock_skew = gauge(p + "clock_skew_seconds", "Wall clock minus the store's.")
        self.concurrency_limit = gauge(
            p + "concurrency_limit", "Jobs the worker runs at once now (adaptive)."
        )
        self.dependency_calls = counter(
            p + "dependency_calls_total", "Calls to a dependency.", "dependency", "outcome"
        )
        self.dependency_timeouts = counter(
            p + "dependency_timeouts_total", "Dependency calls past their timeout.", "dependency"
        )
        self.breaker_state = gauge(
            p + "breaker_state", "1 for the breaker's current state.", "dependency", "state"
        )
        for state in WORKER_STATES:
            self.state.labels(state).set(0)
        self._key_prefixes = _BoundedLabels()
        self._resource_prefixes = _BoundedLabels()

    def __call__(self, event: events.Event) -> None:
        """Update the metrics for one event."""
        match event:
            case events.JobStarted():
                self.started.labels(event.queue, event.task).inc()
                self.wait.labels(event.queue).observe(max(0.0, event.waited))
            case events.JobFinished():
                self.finished.labels(event.queue, event.task, event.outcome).inc()
                self.duration.labels(event.queue, event.task).observe(max(0.0, event.duration))
                total = max(0.0, event.waited) + max(0.0, event.duration)
                self.latency.labels(event.queue).observe(total)
            case events.WorkerStateChanged():
                for state in WORKER_STATES:
                    self.state.labels(state).set(1 if state == event.new else 0)
            case events.Heartbeat():
                self.heartbeat_gap.set(event.gap)
                if event.clock_skew is not None:
                    self.clock_skew.set(event.clock_skew)
            case events.LeaseRenewalFailed():
                self.renewal_failures.labels(event.reason).inc()
            case events.StaleCommitRefused():
                self.stale_commits.labels(event.operation).inc()
            case events.StaleRead():
                self.stale_reads.labels(event.view).inc()
            case events.LoopHeld():
                self.loop_held.labels(event.queue, event.task).inc()
            case events.DuplicateExecution():
                self.duplicates.labels(self._key_prefixes(event.key), event.kind).inc()
            case events.ResourceLeaseBusy():
                self.resource_busy.labels(self._resource_prefixes(event.resource)).inc()
            case events.CoordinationFailed():
                channel = event.channel if event.channel in _CHANNELS else OTHER
                self.coordination_errors.labels(channel).inc()
            case events.ConcurrencyLimitChanged():
                self.concurrency_limit.set(event.new)
            case events.JobsRescued():
                self.rescued.labels("requeued").inc(event.requeued)
                self.rescued.labels("dead").inc(event.dead)
            case events.MaintenanceRepaired():
                self.repairs.labels(event.service, event.kind).inc(event.count)
            case events.LeaderChanged():
                self.leader_term.set(event.term or 0)
            case events.DependencyCall():
                self.dependency_calls.labels(event.dependency, event.outcome).inc()
                if event.outcome == "timeout":
                    self.dependency_timeouts.labels(event.dependency).inc()
            case events.BreakerChanged():
                for state in BREAKER_STATES:
                    value = 1 if state == event.new else 0
                    self.breaker_state.labels(event.dependency, state).set(value)


def worker_health(worker: Worker) -> tuple[Check, Check]:
    """``(health, ready)`` checks of ``worker`` for :func:`serve`.

    Health: the process runs (it answers; nothing is read from the store). Ready: the
    worker may take jobs (READY or PROCESSING, not DRAINING, FENCED or STOPPED) and its
    last membership heartbeat the store accepted is younger than its lease TTL.
    """

    return worker.liveness, worker.readiness


# -- the store view -----------------------------------------------------------------------

#: Running jobs looked at for expired leases: more than any fleet runs at once.
_RUNNING_LIMIT = 10_000
#: Duplicate records read at once: the first read takes the whole history up to this.
_DUPLICATES_LIMIT = 100_000
#: Store seconds of duplicate records read again, for rows that commit late.
_DUPLICATES_WINDOW = 120.0


@dataclass(frozen=True, slots=True)
class _Reading:
    """What one read of the store returned."""

    store_now: float
    depth: list[Depth]
    queues: list[QueueStats]
    workers: list[WorkerRecord]
    orphan_job_leases: int
    stale_commits: int
    duplicates: list[Duplicate] | None
    breakers: Mapping[str, SharedBreaker] = field(default_factory=dict)
    orphan_resource_leases: int = 0


@dataclass(slots=True)
class _DuplicateTally:
    """Counts duplicate records by kind, each once, however often it is read again.

    Each read asks for the records since a horizon a window before the newest seen
    (records carry the store time of their statement, and may commit after newer
    ones); those already counted are kept in ``seen`` until the horizon passes them.
    """

    counts: dict[str, int] = field(default_factory=dict)
    seen: collections.Counter[Duplicate] = field(default_factory=collections.Counter)
    horizon: float | None = None

    def add(self, rows: list[Duplicate]) -> None:
        fresh = collections.Counter(rows) - self.seen
        for row, n in fresh.items():
            self.counts[row.kind.value] = self.counts.get(row.kind.value, 0) + n
        if len(rows) >= _DUPLICATES_LIMIT:
            log.warning("more than %d duplicates in one read: some were not counted", len(rows))
        self.seen += fresh
        if self.seen:
            self.horizon = max(d.at for d in self.seen) - _DUPLICATES_WINDOW
            horizon = self.horizon
            self.seen = collections.Counter({d: n for d, n in self.seen.items() if d.at >= horizon})


async def _read(store: Store, since: float | None) -> _Reading:
    depth = await store.jobs_depth()
    queues = await store.queues_stats()
    workers = await store.workers_list()
    running = await store.jobs_list(state=JobState.RUNNING, limit=_RUNNING_LIMIT, args_limit=0)
    # After the rows it ages: read first, on a slow link it dated them before they
    # were read (negative ages, leases not yet expired that had).
    now = await store.store_time()
    orphans = sum(
        1 for j in running if j.lease_expires_at is not None and j.lease_expires_at <= now
    )
    stale_total, _ = await store.stale_commits(limit=1)
    try:
        duplicates: list[Duplicate] | None = await store.duplicates_list(
            since=since, limit=_DUPLICATES_LIMIT
        )
    except NotSupportedError:
        duplicates = None
    leases = await store.resource_leases_list()
    breakers = read_shared(leases, now)
    live = {w.id for w in workers if w.expires_at > now and w.state != "stopped"}
    orphan_leases = sum(
        1 for r in leases if r.expires_at > now and r.owner.split("/", 1)[0] not in live
    )
    return _Reading(
        now, depth, queues, workers, orphans, stale_total, duplicates, breakers, orphan_leases
    )


class _LoopThread:
    """An event loop on a daemon thread, owning a store the collector was given."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._opened = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tokenline-exporter", daemon=True
        )
        self._thread.start()

    def run(self, fn: Callable[[Store], Coroutine[Any, Any, T]]) -> T:
        async def call() -> T:
            if not self._opened:
                await self.store.open()
                self._opened = True
            return await fn(self.store)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def close(self) -> None:
        async def shut() -> None:
            if self._opened:
                await self.store.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()


def _run_here(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``fn()``'s coroutine run to its end from synchronous code: on a thread of its own
    when this thread already runs an event loop (an async web app that serves the
    metrics from its loop), where ``asyncio.run`` would refuse."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fn())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(fn())).result()


class StoreCollector:
    """A Prometheus collector of the store-wide metrics (see the module docstring).

    ``store_or_app``: an :class:`~tokenline.App` (read through its own store and event
    loop; its registered tasks keep their depth series from the start), or an unopened
    :class:`~tokenline.stores.Store`, which the collector opens on a thread of its own
    and closes in :meth:`close`. The store is read at most once per ``max_age``
    seconds, however many scrapes ask, each read bounded by ``timeout`` seconds; a
    failed read is not tried again before ``max_age`` either. Ages are measured by
    ``clock``'s monotonic reading. Register it with ``registry.register(collector)``.
    The per-queue series of at most :data:`MAX_QUEUES` queues are served, the largest;
    ``tokenline_exporter_queues_omitted`` counts the others.
    """

    def __init__(
        self,
        store_or_app: App | Store,
        *,
        max_age: float = 5.0,
        timeout: float = 4.0,
        clock: Clock | None = None,
    ) -> None:
        if not max_age >= 0:
            raise ConfigError("max_age", f"must be a number of seconds >= 0, got {max_age!r}")
        if not timeout > 0:
            raise ConfigError("timeout", f"must be a number of seconds > 0, got {timeout!r}")
        self.max_age = max_age
        self.timeout = timeout
        self.clock: Clock = clock or SystemClock()
        self._own: _LoopThread | None = None
        self._pairs: set[tuple[str, str]] = set()
        self._run: Callable[[Callable[[Store], Coroutine[Any, Any, _Reading]]], _Reading]
        if isinstance(store_or_app, App):
            self._run = store_or_app.run
            # A handle of its own, never opened: asked only whether the store exists.
            self._probe: Store = store_or_app.open_store()
            self._pairs = {(t.queue, t.name) for t in store_or_app.tasks.values()}
        else:
            self._own = _LoopThread(store_or_app)
            self._run = self._own.run
            self._probe = store_or_app
        self._found = False  # the store was seen to exist (a SQLite file, a schema)
        self._lock = threading.Lock()
        self._view: _Reading | None = None
        self._view_at: float | None = None  # monotonic: when the served view was read
        self._tried_at: float | None = None  # monotonic: the last read, good or not
        self._up = False
        self._error = "the store has not been read yet"
        self._duplicates = _DuplicateTally()
        self._omitted = 0  # queues left out of the last view served, for the log

    # -- reading -------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read the store unless the last read is younger than ``max_age``; return
        whether the last read succeeded."""
        with self._lock:
            now = self.clock.monotonic()
            if self._tried_at is not None and now - self._tried_at < self.max_age:
                return self._up
            self._tried_at = now
            since = self._duplicates.horizon
            timeout = self.timeout

            async def read(store: Store) -> _Reading:
                async with asyncio.timeout(timeout):
                    return await _read(store, since)

            try:
                self._require_store()
                reading = self._run(read)
            except Exception as exc:  # whatever it was, the store could not be read
                self._up = False
                self._error = (
                    f"store read timed out after {timeout:g}s"
                    if isinstance(exc, TimeoutError)
                    else f"store read failed: {str(exc) or type(exc).__name__}"
                )
                expected = isinstance(exc, TokenlineError | TimeoutError | OSError)
                log.warning("tokenline exporter: %s", self._error, exc_info=not expected)
                return False
            self._view, self._view_at, self._up, self._error = reading, now, True, ""
            if reading.duplicates is not None:
                self._duplicates.add(reading.duplicates)
            self._pairs.update((d.queue, d.task) for d in reading.depth)
            return True

    def _require_store(self) -> None:
        """Raise :class:`StoreError` while the store does not exist. Reading it would
        open it, and opening creates a missing SQLite file or PostgreSQL schema: a
        mistyped URL would then look like a healthy, empty store. Asked until the store
        is first seen, then never again."""
        if self._found:
            return
        inner = getattr(self._probe, "inner", self._probe)  # a store wrapped for faults
        missing = getattr(inner, "missing", None)
        what = _run_here(missing) if missing is not None else None
        if what is not None:
            raise StoreError(
                f"{what}; nothing is read, nor created, until a worker, "
                "an enqueue or `tokenline migrate` creates it"
            )
        self._found = True

    def ready(self) -> tuple[bool, str]:
        """Readiness for ``/readyz``: the store could be read (within ``max_age``)."""
        if self.refresh():
            return True, "store reachable"
        return False, self._error

    def close(self) -> None:
        """Close the store the collector opened itself (an app is left to its owner)."""
        if self._own is not None:
            self._own.close()
            self._own = None

    # -- the prometheus collector interface ----------------------------------------------
    def describe(self) -> Iterable[Metric]:
        """The metric families, without samples: registering reads nothing."""
        return [family for _, family in self._families()]

    def collect(self) -> Iterable[Metric]:
        """Read the store if the view is older than ``max_age``, then export the view."""
        self.refresh()
        with self._lock:
            view, view_at, up = self._view, self._view_at, self._up
            tally = dict(self._duplicates.counts)
            pairs = sorted(self._pairs)
        families = dict(self._families())
        age = math.inf if view_at is None else self.clock.monotonic() - view_at
        families["view_age"].add_metric([], age)
        families["store_up"].add_metric([], 1 if up else 0)
        if view is not None:
            served, omitted = _largest_queues(view, pairs)
            self._note_omitted(len(served) + omitted, omitted)
            _fill(families, view, pairs, tally, served, omitted)
        return list(families.values())

    def _note_omitted(self, queues: int, omitted: int) -> None:
        """Log when queues start (a warning) or stop being left out, not at every
        scrape: the gauge says how many at each one."""
        with self._lock:
            before, self._omitted = self._omitted, omitted
        if omitted and not before:
            log.warning(
                "tokenline exporter: %d queues, more than %d: the series of the %d largest "
                "are served, %d left out (tokenline_exporter_queues_omitted)",
                queues,
                MAX_QUEUES,
                queues - omitted,
                omitted,
            )
        elif before and not omitted:
            log.info("tokenline exporter: %d queues, the series of every one are served", queues)

    @staticmethod
    def _families() -> Iterator[tuple[str, _Family]]:
        for key, kind, name, doc, labels in _STORE_FAMILIES:
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield key, cls(f"tokenline_{name}", doc, labels=list(labels))


_Family = GaugeMetricFamily | CounterMetricFamily

#: The store metrics: key, type, name (after ``tokenline_``), help, labels.
_STORE_FAMILIES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("depth", "gauge", "queue_depth", "Unfinished jobs.", ("queue", "task", "state")),
    ("oldest", "gauge", "queue_oldest_job_age_seconds", "Oldest runnable job.", ("queue",)),
    ("paused", "gauge", "queue_paused", "1 when paused.", ("queue",)),
    ("dead", "gauge", "dead_jobs", "Dead-lettered jobs.", ("queue",)),
    ("workers", "gauge", "workers", "Live workers by state.", ("state",)),
    ("beat_age", "gauge", "worker_heartbeat_age_seconds", "Since last heartbeat.", ("worker",)),
    ("skew", "gauge", "worker_clock_skew_seconds", "Wall clock minus store's.", ("worker",)),
    ("orphans", "gauge", "orphan_job_leases", "Expired job leases not rescued.", ()),
    ("orphan_res", "gauge", "orphan_resource_leases", "Held leases of no live worker.", ()),
    ("stale", "counter", "stale_commits_recorded", "Stale job writes refused.", ()),
    ("dups", "counter", "duplicates_recorded", "Duplicates recorded.", ("kind",)),
    ("breakers", "gauge", "breaker_open", "1 while the shared breaker is open.", ("dependency",)),
    ("view_age", "gauge", "exporter_view_age_seconds", "Age of the view served.", ()),
    ("store_up", "gauge", "exporter_store_up", "1 when the last read succeeded.", ()),
    ("omitted", "gauge", "exporter_queues_omitted", "Queues whose series were left out.", ()),
)


def _largest_queues(view: _Reading, pairs: Iterable[tuple[str, str]]) -> tuple[set[str], int]:
    """The queues whose series are served, at most :data:`MAX_QUEUES`, and how many
    others there are.

    The largest are kept: by unfinished jobs, then the oldest runnable job's age, then
    dead jobs (the queues an alert would be about). Ties go by name, so that queues of
    equal size do not trade places, and series, from one scrape to the next.
    """
    unfinished: collections.Counter[str] = collections.Counter()
    for d in view.depth:
        unfinished[d.queue] += d.count
    stats = {q.queue: q for q in view.queues}
    names = {queue for queue, _ in pairs} | set(stats) | set(unfinished)
    if len(names) <= MAX_QUEUES:
        return names, 0

    def rank(queue: str) -> tuple[int, float, int, str]:
        q = stats.get(queue)
        age = (q.oldest_ready_age or 0.0) if q is not None else 0.0
        dead = q.count(JobState.DEAD) if q is not None else 0
        return -unfinished[queue], -age, -dead, queue

    served = set(heapq.nsmallest(MAX_QUEUES, names, key=rank))
    return served, len(names) - len(served)


def _fill(
    families: Mapping[str, _Family],
    view: _Reading,
    pairs: list[tuple[str, str]],
    duplicates: Mapping[str, int],
    served: set[str],
    omitted: int,
) -> None:
    """Add the samples of one store view to ``families`` (built by ``_families``), the
    per-queue ones of the ``served`` queues only (see :func:`_largest_queues`)."""
    depth = {(d.queue, d.task, d.state): d.count for d in view.depth}
    for queue, task in pairs:
        if queue not in served:
            continue
        for state in _DEPTH_STATES:
            families["depth"].add_metric([queue, task, state], depth.get((queue, task, state), 0))
    families["omitted"].add_metric([], omitted)
    for q in view.queues:
        if q.queue not in served:
            continue
        families["oldest"].add_metric([q.queue], q.oldest_ready_age or 0.0)
        families["paused"].add_metric([q.queue], 1 if q.paused else 0)
        families["dead"].add_metric([q.queue], q.count(JobState.DEAD))
    live = [w for w in view.workers if w.expires_at > view.store_now and w.state != "stopped"]
    by_state = collections.Counter(w.state for w in live)
    for state in sorted({s for s in WORKER_STATES if s != "stopped"} | set(by_state)):
        families["workers"].add_metric([state], by_state.get(state, 0))
    for w in live:
        families["beat_age"].add_metric([w.id], max(0.0, view.store_now - w.heartbeat_at))
        if w.clock_skew is not None:
            families["skew"].add_metric([w.id], w.clock_skew)
    families["orphans"].add_metric([], view.orphan_job_leases)
    families["orphan_res"].add_metric([], view.orphan_resource_leases)
    families["stale"].add_metric([], view.stale_commits)
    if view.duplicates is not None:
        for kind in sorted({"repeat", "stale"} | set(duplicates)):
            families["dups"].add_metric([kind], duplicates.get(kind, 0))
    for name, breaker in sorted(view.breakers.items()):
        families["breakers"].add_metric([name], 1 if breaker.state is BreakerState.OPEN else 0)


# -- the HTTP server ------------------------------------------------------------------------


#: Connections the metrics server serves at once; more are closed at once. A scraper
#: needs one; clients that open connections and send nothing (slowloris) took the
#: process to hundreds of threads.
MAX_CONNECTIONS = 64
#: Seconds a connection may stay silent (a request not sent, a response not read).
IDLE_TIMEOUT = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    health: Check
    ready: Check
    routes: dict[str, Route]

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: this one is closed unread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            # A client gone (a scrape timed out, a connection reset) or silent too long:
            # its business, not a traceback in the worker's log.
            log.debug("metrics client %s: %s", client_address, exc)
            return
        log.exception("metrics request from %s failed", client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server_version = "tokenline-metrics"
    timeout = IDLE_TIMEOUT

    def do_GET(self) -> None:
        server = cast(_Server, self.server)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = generate_latest(server.registry)
            except Exception as exc:  # a collector's failure is the scrape's answer
                log.exception("metrics collection failed")
                self._send(500, f"collection failed: {exc}\n".encode(), "text/plain")
                return
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif path in server.routes:
            try:
                status, text, content_type = server.routes[path]()
            except Exception as exc:
                log.exception("%s failed", path)
                status, text, content_type = 500, f"{path} failed: {exc}\n", "text/plain"
            self._send(status, text.encode(), content_type)
        elif path in ("/healthz", "/readyz"):
            check = server.health if path == "/healthz" else server.ready
            try:
                ok, reason = check()
            except Exception as exc:
                ok, reason = False, f"check failed: {exc!r}"
            text = reason or ("ok" if ok else "failed")
            self._send(200 if ok else 503, f"{text}\n".encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class MetricsServer:
    """A running metrics server: ``port`` is the one bound (useful with port 0)."""

    def __init__(self, server: _Server, host: str) -> None:
        self._server = server
        self.host = host
        self.port: int = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, name="tokenline-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The server's base URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port. Safe to call twice."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def _ok() -> tuple[bool, str]:
    return True, "ok"


def _bind_error(exc: OSError, host: str, port: int) -> ConfigError:
    """Why the metrics server could not listen on ``host:port``, blaming the setting
    at fault: an unknown host is no reason to change the port."""
    if isinstance(exc, socket.gaierror):
        return ConfigError("host", f"cannot resolve metrics host {host!r}: {exc.strerror}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError("host", f"metrics host {host!r} is not an address of this machine")
    if exc.errno == errno.EADDRINUSE:
        return ConfigError("port", f"metrics port {port} is in use (host {host})")
    if exc.errno == errno.EACCES:
        reason = f"metrics port {port} may not be bound by this user (host {host})"
        return ConfigError("port", f"{reason}: ports below 1024 usually need privileges")
    return ConfigError("port", f"{exc} (host {host})")


def serve(
    port: int,
    *,
    host: str = "127.0.0.1",
    registry: CollectorRegistry = REGISTRY,
    health: Check | None = None,
    ready: Check | None = None,
    routes: Mapping[str, Route] | None = None,
) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` from a daemon thread until ``close()``.

    ``/metrics``: the Prometheus text format. ``/healthz``: 200 ``ok`` while
    ``health()`` passes (liveness: keep it free of store calls), else 503.
    ``/readyz``: 200 while ``ready()`` passes, else 503 with its reason. Anything
    else: 404. Without a check, it passes. A host that cannot be listened on (not
    resolved, not this machine's) or a port that cannot be bound (in use, privileged)
    is a :class:`ConfigError` naming which, and nothing is started. ``routes``: more
    paths, each answered by a function returning (status, body, content type).
    """
    try:
        server = (_Server6 if ":" in host else _Server)((host, port), _Handler)
    except OSError as exc:
        raise _bind_error(exc, host, port) from None
    server.registry = registry
    server.health = health or _ok
    server.ready = ready or _ok
    server.routes = dict(routes or {})
    return MetricsServer(server, host)
