"""The worker: one asyncio process running jobs under leases.

Control plane (own tasks, never behind handlers): the membership heartbeat, one batched
renewal of every in-flight lease per ``renew_interval``, a watchdog that fences the
worker as soon as its monotonic clock says a lease can no longer be trusted (a resumed
``SIGSTOP``, a long GC or VM stall), and maintenance: the worker stands for election
and, while leader, runs the maintenance services (``tokenline.maintenance``).

Data plane: claim jobs while the state allows it, run them (async handlers on the loop,
sync ones in a thread pool), classify failures and commit each outcome through the
:class:`BatchCompleter`, conditional on the job's token in the store.

Why a stale worker cannot commit: every commit carries ``(job id, owner, token)`` and
the store applies it only if that token is still the newest for a running job. A claim
or rescue bumps the token, so once anyone else may hold the job, the old holder's
commit matches nothing. The local checks (watchdog, the guard around async handlers in
``guard.py``, ``ctx.check``) only stop pointless work earlier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from .. import events
from .._config import AUTO, WorkerSettings
from .._errors import (
    DependencyOpenError,
    EffectPendingError,
    FencedError,
    JobNotFoundError,
    LeaseBusyError,
    SchemaVersionError,
    StaleTokenError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
    TokenlineError,
    UnknownTaskError,
)
from .._inflight import InFlight
from .._jobs import ClaimedJob, Finish, Job, Outcome, WorkerRecord, exception_text
from .._logging import SUCCESS_LOGGER
from .._records import validate_key
from ..backpressure import ErrorRateWindow, FailureKind, RetryBudget, make_limiter
from ..classify import Classifier, Decision, ErrorClass, classify
from ..dependencies import BreakerBoard
from ..maintenance import (
    MAINTENANCE_LEASE,
    Leadership,
    MaintenanceRunner,
    Service,
    ServiceReport,
    standard_services,
)
from ..maintenance.schedule_watch import ScheduleWatch
from ..retry import RetryPolicy, policy_delay
from .completer import BatchCompleter, ClaimArgs
from .context import JobContext, decode_args
from .deadlines import Deadlines
from .guard import ABANDONED, UNTRUSTED, Guarded, LeaseCheck, StepWatch
from .prefetch import AUTO_PATIENCE, RunTimes, auto_prefetch
from .resources import HeldLease, renew_resource_leases
from .skew import ClockSkew
from .slot import Slot
from .state import WorkerEvent, WorkerState, next_state

if TYPE_CHECKING:
    from .._app import App
    from .._tasks import Task
    from ..stores.base import Store

__all__ = ["MAINTENANCE_LEASE", "Worker", "WorkerCounters"]

log = logging.getLogger("tokenline.worker")

T = TypeVar("T")

#: First pause (seconds) between two tries to open the store at start-up; each pause
#: doubles, up to STARTUP_MAX_PAUSE (see ``WorkerSettings.startup_wait``).
STARTUP_FIRST_PAUSE = 0.25
STARTUP_MAX_PAUSE = 5.0

#: One line per succeeded job: for machine-read logs (``--log-format json``).
success_log = logging.getLogger(SUCCESS_LOGGER)

_BUSY_STATES = frozenset({WorkerState.READY, WorkerState.PROCESSING})
#: Seconds between two looks at an effect a timed-out sync handler's thread still runs.
_EFFECT_POLL = 0.05
#: Name prefix of the threads that run sync handlers.
HANDLER_THREAD_PREFIX = "tokenline-job"


class SignalLatch:
    """A signal handler for a process that runs a worker: before :meth:`Worker.run` takes
    SIGTERM and SIGINT over, the signals it receives are kept, and the worker acts on
    them as soon as it starts (a supervisor's stop sent while the process still starts
    is not lost); once the worker has given the signals back, on its way out, they are
    ignored, so a late one cannot kill a process that stopped cleanly."""

    def __init__(self) -> None:
        self._received = 0

    def __call__(self, signum: int, frame: object) -> None:
        """Keep the signal for the worker (a signal handler: quick, no I/O)."""
        self._received += 1

    def take(self) -> int:
        """How many signals came since the last call (read on the main thread, where
        the handler runs too)."""
        received, self._received = self._received, 0
        return received


@dataclass
class WorkerCounters:
    """What this worker did, for logs and tests."""

    started: int = 0
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    stale_refused: int = 0
    self_fenced: int = 0
    fenced: int = 0
    rescued: int = 0
    coordination_errors: int = 0
    #: Jobs given back unrun because a dependency they need had its breaker open.
    deferred: int = 0
    #: Prefetched jobs given back before their handler started (a drain, a fence):
    #: not among ``started``, nor its ``released``.
    unrun: int = 0
    #: Steps of async handlers that held the event loop a watchdog period or longer.
    loop_held: int = 0
    #: Jobs given back by a call whose answer never came (the store did not answer in
    #: time): the store may have taken them back, or refused them as stale writes, which
    #: only ``tokenline audit`` then lists.
    unanswered: int = 0
    #: Started jobs a fencing or a stop cancelled and could not give back (their lease
    #: lost, past the worker's trust, or held by an effect that runs on): the rescue
    #: runs them again once their leases expire.
    lapsed: int = 0
    #: Job leases whose renewal the store refused: those another attempt holds by now
    #: (its job was rescued) it records as stale writes, the ones merely expired not.
    renewals_refused: int = 0

    def summary(self) -> str:
        """The counters as one line of prose, for logs and the command line."""

        def n(count: int, one: str, many: str | None = None) -> str:
            return f"{count:,} {one if count == 1 else (many or one + 's')}"

        parts = [
            f"started {n(self.started, 'job')}: {self.succeeded:,} succeeded, "
            f"{self.retried:,} retried, {self.dead:,} dead, {self.released:,} given back"
            + (f", {self.lapsed:,} left to their leases" if self.lapsed else ""),
            *([f"{n(self.unrun, 'prefetched job')} given back unrun"] if self.unrun else []),
            f"{n(self.stale_refused, 'stale write')} refused by the store",
            f"fenced {n(self.fenced, 'time')} ({self.self_fenced:,} by its own clock)",
            # As maintenance leader: its own jobs too, when their leases expired.
            f"rescued {n(self.rescued, 'job')} whose lease had expired",
            f"{n(self.coordination_errors, 'coordination error')}",
        ]
        if self.deferred:
            parts.append(f"deferred {n(self.deferred, 'job')} for an open circuit breaker")
        if self.loop_held:
            parts.append(f"{n(self.loop_held, 'async handler step')} held the event loop")
        if self.renewals_refused:
            parts.append(
                f"{n(self.renewals_refused, 'lease renewal')} refused (a job rescued "
                "meanwhile: a stale write too)"
            )
        if self.unanswered:
            parts.append(
                f"{n(self.unanswered, 'job')} given back unanswered (the store may have "
                "refused some as stale writes: see tokenline audit)"
            )
        return "; ".join(parts)


class Worker:
    """Runs jobs of ``app`` from ``settings.queues`` until asked to stop.

    ``services``: the maintenance services this worker runs while it leads maintenance
    (default: :func:`tokenline.maintenance.standard_services`, with the app's periodic
    jobs).
    """

    def __init__(
        self,
        app: App,
        settings: WorkerSettings | None = None,
        *,
        store: Store | None = None,
        worker_id: str | None = None,
        services: Sequence[Service] | None = None,
    ) -> None:
        self.app = app
        self.settings = settings or WorkerSettings()
        self.clock = app.clock
        # Identity is per process start, never a reused hostname. One given is checked
        # as keys are: listings show it, and `tokenline drain` must be able to name it.
        if worker_id is not None:
            validate_key(worker_id, "worker_id")
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.state = WorkerState.READY
        self.counters = WorkerCounters()
        self._store = store
        # Keyed by (job id, token): a job rescued from this very worker and claimed again
        # is a new attempt, and must not hide the old one from cancellation.
        self._slots: dict[tuple[int, int], Slot] = {}
        self._membership_token = 0
        self._stop_requested = False
        self._stopped: asyncio.Event | None = None
        # The handlers of SIGTERM and SIGINT that run() replaced (see _restore_signals).
        self._signals_before: dict[signal.Signals, Any] = {}
        #: Set while run() waits for its store to answer at start-up (startup_wait).
        self._opening: asyncio.Event | None = None
        self._slot_freed: asyncio.Event | None = None
        # The async handlers' hard timeouts, on the loop the worker runs on.
        self._deadlines: Deadlines | None = None
        #: The fetch loop's claim in flight, which a stop lets answer (see run).
        self._claim_call = InFlight()
        #: Jobs asked for by claims in flight (see ``reserve``).
        self._claiming = 0
        #: Prefetched jobs waiting for a handler slot, oldest first (also in ``_slots``,
        #: so the renewal keeps their leases and a fence gives them back).
        self._waiting: deque[Slot] = deque()
        #: Handlers running now: started and not yet returned.
        self._handlers = 0
        #: A job one lost lease from the dead-letter queue, running with no other job
        #: beside it on this worker; nothing is claimed meanwhile (see _isolate_suspect).
        self._alone: Slot | None = None
        #: Claim nothing until no job is here: such a job waits for a worker that has
        #: nothing else running.
        self._clearing = False
        #: _isolate_suspect is giving jobs back: a claim that lands meanwhile goes back.
        self._isolating = False
        #: Why the worker stopped on its own, unable to run its handlers: run() raises it
        #: once stopped, so that the process exits with an error and a supervisor sees it.
        self._fatal: TokenlineError | None = None
        #: Handler run times, which ``prefetch = "auto"`` follows.
        self._run_times = RunTimes()
        self._fencing = False
        self._drainer: asyncio.Task[None] | None = None
        # None: the standard services, built on the store once it is open.
        self._services = services
        self._maintenance: MaintenanceRunner | None = None
        self._completer: BatchCompleter | None = None
        self._coordination_failures = 0
        #: Monotonic time of the last membership heartbeat the store accepted.
        self._last_beat = self.clock.monotonic()
        #: Set to cut the control loop's wait short: the next heartbeat goes out now.
        self._beat_soon = asyncio.Event()
        #: Monotonic time the watchdog last ran: the event loop is turning.
        self._last_tick = self.clock.monotonic()
        self._running = False
        #: How many jobs to run at once, adapted to how they fare (see backpressure).
        self._limiter = make_limiter(self.settings, self.clock)
        self._errors = ErrorRateWindow(
            window=self.settings.pause_window,
            threshold=self.settings.pause_error_rate,
            min_calls=self.settings.pause_min_jobs,
        )
        self._budget = RetryBudget(
            ratio=self.settings.retry_budget, window=self.settings.retry_budget_window
        )
        #: A circuit breaker per dependency of the app, shared through the store.
        self._board = BreakerBoard(app.dependencies, worker_id=self.id, clock=self.clock)
        #: Attempts that failed with a failure their dependency's breaker counted.
        self._blamed: weakref.WeakSet[Slot] = weakref.WeakSet()
        #: Why the worker drains without a shutdown (``coordination``, ``error rate``):
        #: it returns to READY only once every reason has cleared.
        self._unhealthy: set[str] = set()
        # Threads beyond concurrency: a cancelled sync handler keeps its thread until it
        # returns or calls ctx, and must not starve the next jobs.
        self._sync_lock = threading.Lock()
        self._sync_running = 0
        self._pool_size = self.settings.concurrency * 2
        self._pool = ThreadPoolExecutor(
            max_workers=self._pool_size, thread_name_prefix=HANDLER_THREAD_PREFIX
        )
        #: Pool threads still held by sync handlers whose attempt ended without them
        #: (timed out, fenced, stopped): past the pool's spare threads, each one is a
        #: job fewer the worker may run at once (see _capacity).
        self._threads_kept = 0
        #: Resource leases whose attempt ended without giving them back: released by
        #: the control loop (see _release_leftovers).
        self._leftover_leases: list[HeldLease] = []
        #: This worker's wall clock against the store's, measured at each heartbeat.
        self.skew = ClockSkew(self.clock, self.id, self.settings.clock_skew_warning)
        #: Called with (old, new, reason) on every state change; for tests and metrics.
        self.on_state_change: Callable[[WorkerState, WorkerState, str], None] | None = None

    # -- state ----------------------------------------------------------------------------
    def _fire(self, event: WorkerEvent, reason: str = "") -> None:
        old = self.state
        new = next_state(old, event)
        if new is old:
            return
        self.state = new
        # Taking and finishing jobs moves READY <-> PROCESSING many times a second: that is
        # debug chatter. Draining, fencing and stopping are what an operator must see.
        level = logging.DEBUG if {old, new} <= _BUSY_STATES else logging.INFO
        why = reason or event.value
        fields = {"worker_id": self.id, "old_state": old.value, "new_state": new.value}
        log.log(level, "worker %s: %s -> %s (%s)", self.id, old.value, new.value, why, extra=fields)
        if self.on_state_change is not None:
            self.on_state_change(old, new, reason)
        if events.enabled():
            events.emit(events.WorkerStateChanged(self.id, old.value, new.value, why))
        if new is WorkerState.STOPPED and self._stopped is not None:
            self._stopped.set()

    def _is(self, state: WorkerState) -> bool:
        # A method, so that type narrowing does not survive the awaits that change state.
        return self.state is state

    @property
    def store(self) -> Store:
        """The worker's store handle (opened by :meth:`run`)."""
        if self._store is None:
            raise TokenlineError("the worker is not running")
        return self._store

    def _valid_until(self, sent_at: float) -> float:
        # Measured from when the request was *sent*: the store's expiry is at least this
        # late, whatever the round trip took.
        return sent_at + self.settings.lease_ttl - self.settings.margin

    # -- life cycle -----------------------------------------------------------------------
    async def run(self, *, install_signal_handlers: bool = False) -> None:
        """Run until stopped (``request_shutdown``, or SIGTERM/SIGINT if installed).

        A task depending on a dependency the app did not register is a
        :class:`~tokenline.ConfigError` here, before the store is opened."""
        self.app.dependencies.check_tasks(self.app.tasks.values())
        self._warn_unserved()
        self._stopped = asyncio.Event()
        self._slot_freed = asyncio.Event()
        if self._store is None:
            self._store = self.app.open_store(timeout=self.settings.call_timeout)
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            _forget_signals_in_forked_children()
            # Before the store opens: a worker waiting for its store stops when told to.
            # The handlers they replace come back after, not the defaults: a process
            # that ignores these signals while it exits keeps doing so.
            self._signals_before = {
                sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)
            }
            for sig in self._signals_before:
                loop.add_signal_handler(sig, self.request_shutdown)
            # Signals a SignalLatch took before these handlers were in place (the process
            # was still starting) count as if they had come now: one drains, two stop.
            latches = {
                id(h): h for h in self._signals_before.values() if isinstance(h, SignalLatch)
            }
            for _ in range(min(2, sum(h.take() for h in latches.values()))):
                self.request_shutdown()
        started = False
        try:
            started = await self._join(self._store)
        finally:
            if not started and install_signal_handlers:
                self._restore_signals(loop)
            if not started:
                with contextlib.suppress(TokenlineError):
                    await self._store.close()
        if not started:
            return
        self._board.bind(self._store)
        self._completer = BatchCompleter(self._store, refill=self)
        self._completer.start()
        self._last_tick = self.clock.monotonic()
        self._running = True
        if self._stop_requested:
            self._stop_requested = False
            self.request_shutdown()
        tasks = [
            asyncio.create_task(self._fetch_loop(), name="tokenline-fetch"),
            asyncio.create_task(self._control_loop(), name="tokenline-control"),
            asyncio.create_task(self._watchdog_loop(), name="tokenline-watchdog"),
            asyncio.create_task(self.maintenance.run(), name="tokenline-maintenance"),
        ]
        if self._board.active:
            tasks.append(asyncio.create_task(self._board.watch(), name="tokenline-breakers"))
        if self.app.periodics and self._services is None:
            tasks.append(asyncio.create_task(self._watch_schedules(), name="tokenline-schedules"))
        stop_wait = asyncio.create_task(self._stopped.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop_wait and not t.cancelled() and t.exception() is not None:
                    # A dead control or data loop would leave a zombie: stop loudly instead.
                    failure = t.exception()
                    log.critical("worker %s: %s crashed", self.id, t.get_name(), exc_info=failure)
                    self._fire(WorkerEvent.FORCE_STOP, f"{t.get_name()} crashed")
        finally:
            stop_wait.cancel()
            # A claim in flight may already hold jobs in the store: cut off, it would
            # leave them leased to a stopped worker until the lease ran out, an expiry
            # counted against each. Answered, take() gives them back unrun.
            await self._claim_call.settled(self.settings.call_timeout)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._cancel_all("worker stopping", release=True)
            if self._drainer is not None and not self._drainer.done():
                # A second stop while the drain gave its jobs back: that call is under
                # way (its jobs are marked given back, so the stop skipped them). Cut
                # off by the store's closing, it would leave them leased to a stopped
                # worker until their leases ran out, an expiry counted against each.
                await asyncio.wait({self._drainer}, timeout=self.settings.call_timeout)
            await self._completer.stop()
            with contextlib.suppress(TokenlineError):
                await self._store.worker_deregister(worker_id=self.id, token=self._membership_token)
            if install_signal_handlers:
                self._restore_signals(loop)
            await self._store.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            log.info("worker %s stopped: %s", self.id, self.counters.summary())
        if failure is not None:
            raise failure
        if self._fatal is not None:
            raise self._fatal

    def _restore_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give SIGTERM and SIGINT back to the handlers :meth:`run` found."""
        for sig, before in self._signals_before.items():
            loop.remove_signal_handler(sig)
            if before is not None:  # None: a handler not set from Python, left as is
                signal.signal(sig, before)
        self._signals_before = {}

    @property
    def concurrency_limit(self) -> int:
        """How many jobs the worker runs at once now: its adaptive limit, between
        ``concurrency_floor`` and ``concurrency``, or fewer while sync handlers past their
        attempt hold more pool threads than the pool has to spare."""
        return min(self._limiter.limit, self._capacity())

    def _capacity(self) -> int:
        """Jobs the worker may hold at once: ``concurrency``, less one for each pool
        thread a handler past its attempt keeps beyond the pool's spare ones. A job
        claimed beyond that would wait in the pool's queue with its hard timeout running,
        and fail, or go dead, without its handler ever starting."""
        spare = self._pool_size - self.settings.concurrency
        return max(0, self.settings.concurrency - max(0, self._threads_kept - spare))

    def liveness(self) -> tuple[bool, str]:
        """Whether the process is alive: its event loop turns (the watchdog ran within
        a lease TTL) and it has not stopped. Never asks the store: a store outage must
        not make an orchestrator restart healthy workers. Safe from any thread."""
        if self.state is WorkerState.STOPPED:
            return False, "stopped"
        stalled = self.clock.monotonic() - self._last_tick
        if self._running and stalled > max(self.settings.lease_ttl, 1.0):
            return False, f"event loop stalled for {stalled:.1f}s"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """Whether the worker takes work: READY or PROCESSING, with a membership
        heartbeat the store accepted within one lease TTL. Safe from any thread."""
        state = self.state
        if not self._running or state not in (WorkerState.READY, WorkerState.PROCESSING):
            return False, f"state {state.value}" + ("" if self._running else " (not started)")
        silent = self.clock.monotonic() - self._last_beat
        if silent > self.settings.lease_ttl:
            return False, f"no heartbeat accepted for {silent:.1f}s"
        return True, state.value

    def _warn_unserved(self) -> None:
        """Say so when none of this worker's queues is one its app's tasks are declared
        on: the Quick start's task is on ``billing``, and a worker started on the
        default queue idled while the jobs piled up, saying nothing. A warning, not an
        error: jobs enqueued with ``queue=`` may be meant for these queues."""
        declared = {t.queue for t in self.app.tasks.values()}
        served = set(self.settings.queues)
        if declared and not declared & served:
            log.warning(
                "worker %s serves queues %s, on which none of its app's tasks is declared "
                "(theirs: %s): it runs only jobs enqueued there with queue=; to run the "
                "tasks' jobs, start it with --queues %s",
                self.id,
                ", ".join(sorted(served)),
                ", ".join(sorted(declared)),
                ",".join(sorted(declared)),
            )

    def request_shutdown(self) -> None:
        """First call: drain (finish in-flight jobs within ``drain_timeout``), then stop.
        Second call: stop at once, releasing in-flight jobs. While the worker still
        waits for its store at start-up, it stops waiting and returns."""
        if self.state is WorkerState.STOPPED:
            return
        if self._opening is not None:
            self._stop_requested = True
            self._opening.set()
            return
        if self._stop_requested:
            log.warning("worker %s: second shutdown request, stopping now", self.id)
            self._fire(WorkerEvent.FORCE_STOP, "second shutdown request")
            return
        self._stop_requested = True
        self._wake_completer()
        if self._stopped is None:
            return  # not running yet: run() sees the request and stops at once
        self._fire(WorkerEvent.SHUTDOWN, "shutdown requested")
        if self.state is WorkerState.DRAINING:
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
            # The next heartbeat now: an operator watching `tokenline workers` (after a
            # `drain`, a SIGTERM) sees the drain begin, not a renew interval later.
            self._beat_soon.set()

    async def _join(self, store: Store) -> bool:
        """Open ``store`` and register this worker's membership. While the store is
        unavailable (down, refusing connections, busy, not answering in time), try
        again, pausing longer each time up to :data:`STARTUP_MAX_PAUSE`, until
        ``startup_wait`` seconds have passed; then raise the last error. Each failed try
        is logged with its reason. Any other error (a damaged store, a schema to migrate,
        a bad setting) is raised at once. False: a shutdown was requested while
        waiting."""
        deadline = self.clock.monotonic() + self.settings.startup_wait
        pause = STARTUP_FIRST_PAUSE
        self._opening = asyncio.Event()
        opened = False

        async def join() -> None:
            nonlocal opened
            if not opened:
                await store.open()
                opened = True
            await self._register()

        try:
            while True:
                try:
                    if await self._unless_stopped(join()):
                        return True
                    # Stopped during the try (an open or registration still waiting for
                    # a store that does not answer): given up at once, not waited out.
                    log.warning("worker %s: stopped while waiting for its store", self.id)
                    return False
                except StoreUnavailableError as exc:
                    left = deadline - self.clock.monotonic()
                    if left <= 0:
                        raise
                    if not self._opening.is_set():  # else stopped during that try
                        wait = min(pause, left)
                        log.warning(
                            "worker %s: store unavailable at start-up, trying again in "
                            "%.1fs (gives up in %.1fs): %s", self.id, wait, left, exc,
                        )  # fmt: skip
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(wait):
                                await self._opening.wait()
                if self._opening.is_set():
                    log.warning("worker %s: stopped while waiting for its store", self.id)
                    return False
                pause = min(pause * 2, STARTUP_MAX_PAUSE)
        finally:
            self._opening = None

    async def _unless_stopped(self, step: Coroutine[Any, Any, None]) -> bool:
        """Run ``step`` (a start-up try) unless a stop comes first: then cancel it and
        return False. True: it completed (its error, if any, is raised here)."""
        assert self._opening is not None
        trying = asyncio.ensure_future(step)
        stopping = asyncio.ensure_future(self._opening.wait())
        try:
            await asyncio.wait({trying, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the worker itself cancelled: the try goes with it
            stopping.cancel()
            trying.cancel()
            raise
        stopping.cancel()
        if not trying.done():
            trying.cancel()
            # Its own clean-up runs (a pool opened in part is closed by run()).
            await asyncio.gather(trying, return_exceptions=True)
            return False
        trying.result()
        return True

    async def _drain(self) -> None:
        deadline = self.clock.monotonic() + self.settings.drain_timeout
        assert self._slot_freed is not None
        # Prefetched jobs have not started: they go back at once, for another worker.
        await self._give_back(list(self._waiting), "worker draining: prefetched, not run")
        while self._slots and self.clock.monotonic() < deadline:
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - self.clock.monotonic())):
                    await self._slot_freed.wait()
        if self.state is not WorkerState.DRAINING:
            return
        if self._slots:
            spared = await self._cancel_all("drain timeout", release=True, spare_effects=True)
            if spared:
                await self._effects_over_at_drain(spared)
            # A second stop request, or a fencing, may have moved on while the handlers
            # were waited for: that state stands.
            if self.state is WorkerState.DRAINING:
                self._fire(
                    WorkerEvent.DRAIN_TIMEOUT, f"drain timeout {self.settings.drain_timeout:g}s"
                )
        else:
            self._fire(WorkerEvent.DRAINED, "all in-flight jobs finished")

    async def _register(self) -> None:
        record = WorkerRecord(
            id=self.id,
            host=socket.gethostname(),
            pid=os.getpid(),
            queues=self.settings.queues,
            concurrency=self.settings.concurrency,
            state=self.state.value,
            token=0,
            started_at=0.0,
            heartbeat_at=0.0,
            expires_at=0.0,
        )
        sent = self.skew.sent()
        rec = await self.store.worker_register(record=record, ttl=self.settings.lease_ttl)
        self.skew.answered(sent, rec.heartbeat_at)
        self._membership_token = rec.token
        self._last_beat = self.clock.monotonic()

    # -- data plane -----------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        settings = self.settings
        assert self._slot_freed is not None
        while True:
            probing = self._probing_claims()
            if not (self.state.may_fetch or probing) or self._stop_requested:
                await asyncio.sleep(min(settings.poll_interval, 0.2))
                continue
            limit = self.reserve(0, probe=probing)
            if limit <= 0:
                self._slot_freed.clear()
                # asyncio.timeout, never wait_for, around a suppressed TimeoutError: on
                # Python 3.11, wait_for can turn the task's cancellation into a
                # TimeoutError, and this loop would then never stop (seen under load).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.poll_interval):
                        await self._slot_freed.wait()
                continue
            sent_at = self.clock.monotonic()
            self._claim_call.started()
            claimed: list[ClaimedJob] | None = None
            try:
                try:
                    claimed = await self.store.jobs_claim(
                        owner=self.id,
                        queues=settings.queues,
                        limit=limit,
                        ttl=settings.lease_ttl,
                        priority_aging=self.app.settings.priority_aging,
                    )
                except StoreError as exc:
                    self._coordination_failed("claim", exc, reason="claims")
                else:
                    # Claims work again: only a claim that answered says so (a renewal
                    # goes to the leases, which may answer while the claim's store does
                    # not), before the jobs start, which they may only once it has.
                    self._healthy_again("claims", "claim succeeded")
                    await self.take(claimed, sent_at)
            finally:
                self.release(limit)
                self._claim_call.ended()
            if claimed is None:
                # The pause after a failed claim holds neither a reservation (the
                # completer's claims would take fewer jobs) nor the in-flight mark (a stop
                # would wait it out for nothing).
                await asyncio.sleep(settings.poll_interval)
                continue
            if not claimed:
                await self.store.wait_for_jobs(
                    queues=settings.queues, timeout=settings.poll_interval
                )

    def _probing_claims(self) -> bool:
        """The worker drains for failed claims alone: the fetch loop goes on claiming,
        at its failed-claim pace, as the probe that ends the drain once one answers."""
        return (
            self.state is WorkerState.DRAINING
            and self._unhealthy == {"claims"}
            and not self._stop_requested
            and not self._fencing
        )

    # -- claims: the fetch loop's, and those the completer makes with a batch ------------
    def reserve(self, freeing: int, *, probe: bool = False) -> int:
        """How many jobs to claim now, once ``freeing`` running jobs have finished;
        reserved until :meth:`release`, so that two claims in flight (the fetch loop's
        and one made with a batch of finishes) never take more than the limit allows.
        ``probe``: a claim of the fetch loop while it drains for failed claims alone."""
        if not (self.state.may_fetch or probe) or self._stop_requested or self._fencing:
            return 0
        if self._alone is not None or self._isolating:
            return 0  # a job runs alone, or is about to: nothing joins it
        if self._clearing:
            if self._slots:
                return 0
            self._clearing = False
        in_flight = len(self._slots) - freeing + self._claiming
        # Prefetch rides only on a batch of finishes: the fetch loop claims for free
        # slots, so a long job never has the worker claim and give back over and over.
        ahead = self._ahead() if freeing else 0
        # The adaptive limit, not only the configured concurrency, bounds the claim.
        free = self._limiter.claim_batch(
            self._capacity() + ahead - in_flight, in_flight=in_flight - ahead
        )
        limit = min(free, self.settings.claim_batch or free)
        if limit > 0:
            self._claiming += limit
        return limit

    def release(self, reserved: int) -> None:
        """Give back a reservation of :meth:`reserve`."""
        if reserved > 0:
            self._claiming -= reserved

    def claim_args(self) -> ClaimArgs:
        """This worker's claim, besides its size."""
        return ClaimArgs(
            owner=self.id,
            queues=self.settings.queues,
            ttl=self.settings.lease_ttl,
            priority_aging=self.app.settings.priority_aging,
        )

    def monotonic(self) -> float:
        """The worker's monotonic clock (when a claim was sent)."""
        return self.clock.monotonic()

    def gather(self) -> int:
        """Finishes for the completer to gather before it sends them: half the prefetch
        while prefetched jobs keep the handlers busy, so that several finishes go out
        with the claim that refills the worker; else 1 (at once)."""
        if not self._waiting or self._stop_requested or self._fencing:
            return 1
        return max(1, self._ahead() // 2) if self.state.may_fetch else 1

    def _ahead(self) -> int:
        """Jobs to claim beyond the free slots: the ``prefetch`` setting, or under
        ``"auto"`` what the handlers' recent run times allow."""
        prefetch = self.settings.prefetch
        if isinstance(prefetch, int):
            return prefetch
        return auto_prefetch(self._run_times.mean, self._run_limit())

    def _patience(self) -> float:
        """How long a prefetched job waits for a slot before it is given back."""
        if self.settings.prefetch == AUTO:
            return min(AUTO_PATIENCE, self.settings.renew_period)
        return self.settings.renew_period

    def _wake_completer(self) -> None:
        """The answer of :meth:`gather` may have fallen to 1: let the completer ask."""
        if self._completer is not None:
            self._completer.wake()

    async def take(self, claimed: list[ClaimedJob], sent_at: float) -> None:
        """Start jobs claimed by a request sent at ``sent_at`` (monotonic), unless the
        worker stopped fetching meanwhile (then they are given back unrun)."""
        if not claimed:
            return
        if self._may_start() and self.clock.monotonic() - sent_at > self.settings.renew_period:
            claimed, sent_at = await self._refreshed(claimed)
        if claimed and self._may_start() and self._board.active:
            claimed = await self._defer_held_back(claimed)
        alone: ClaimedJob | None = None
        if claimed and self._may_start():
            claimed, alone = await self._isolate_suspect(claimed)
        if claimed and not self._may_start():
            # The worker fenced or began draining while the claim, or the renewal or
            # deferral above, was in flight: asked after the last await, with no await
            # before the jobs start, so that no job starts in a state that forbids it.
            await self._release_unstarted(claimed)
            return
        for c in claimed:
            self._start(c, sent_at, alone=c is alone)

    async def _isolate_suspect(
        self, claimed: list[ClaimedJob]
    ) -> tuple[list[ClaimedJob], ClaimedJob | None]:
        """Of a claim holding a job one lost lease from the dead-letter queue (see
        :func:`runs_alone`), run that job alone. Every job in flight on a worker that a
        job stalls (an async handler that blocks the loop past the lease) or kills loses
        its lease with it, and a job that did that each time took the jobs claimed with
        it each time to the dead-letter queue, unrun. Alone, its last lease can be lost
        only by its own doing.

        On a worker with nothing else here, the rest of the claim goes back unrun and
        the job starts; nothing is claimed until it is over. On a worker still running
        other jobs (any of which might crash it), the whole claim goes back unrun, and
        the worker claims nothing until they are over: then it, or an idle worker,
        claims the job again. A claim that lands meanwhile goes back whole. Returns the
        jobs to start and the one that runs alone among them (``None``: none)."""
        if self._alone is not None or self._isolating:
            # Claimed beside the one that brought a job to run alone (two claims in
            # flight at once): none of them joins it.
            await self._release_unstarted(claimed, "given back unrun: a job runs alone here")
            return [], None
        suspect = next((c for c in claimed if runs_alone(c.job)), None)
        if suspect is None:
            return claimed, None
        self._isolating = True
        try:
            if self._slots:
                self._clearing = True
                why = (
                    f"given back unrun: job {suspect.job.id}, one lost lease from the "
                    "dead-letter queue, runs alone, on a worker with nothing else running"
                )
                await self._release_unstarted(claimed, why)
                if self._waiting:
                    await self._give_back(list(self._waiting), why)
                return [], None
            others = [c for c in claimed if c is not suspect]
            if others:
                why = (
                    f"given back unrun: job {suspect.job.id}, one lost lease from the "
                    "dead-letter queue, runs alone first"
                )
                await self._release_unstarted(others, why)
            return [suspect], suspect
        finally:
            self._isolating = False

    def _may_start(self) -> bool:
        """Jobs may start now: the worker fetches, is not stopping and not fencing."""
        return self.state.may_fetch and not self._stop_requested and not self._fencing

    async def _refreshed(self, claimed: list[ClaimedJob]) -> tuple[list[ClaimedJob], float]:
        """Renew the leases of a claim that took long to answer (it waited for a store
        lock, say): the worker trusts a lease from when its request was sent, so without
        this they would start with little or none of their trust window left."""
        sent_at = self.clock.monotonic()
        try:
            renewed = await self.store.job_leases_renew(
                owner=self.id, leases=[c.lease for c in claimed], ttl=self.settings.lease_ttl
            )
        except StoreError as exc:
            self._coordination_failed("renewal of a slow claim", exc, "leases")
            await self._release_unstarted(claimed)
            return [], sent_at
        kept = [
            ClaimedJob(c.job, lease) for c, lease in zip(claimed, renewed, strict=True) if lease
        ]
        return kept, sent_at

    async def _release_unstarted(
        self, claimed: list[ClaimedJob], why: str = "worker stopped fetching"
    ) -> None:
        finishes = [Finish(c.lease, Outcome.RELEASE, 0.0, why, "coordination") for c in claimed]
        try:
            results = await self.store.jobs_finish(finishes=finishes)
        except StoreError as exc:
            self.counters.unanswered += len(claimed)
            log.warning(
                "worker %s could not release %d claimed jobs: %s", self.id, len(claimed), exc
            )
            return
        self.counters.unrun += sum(results)
        self._count_refused(claimed, results, Outcome.RELEASE)

    async def _defer_held_back(self, claimed: list[ClaimedJob]) -> list[ClaimedJob]:
        """Give back unrun the jobs whose task needs a dependency whose breaker is open
        (or being tried by another worker), to run once it may let them through; return
        the others. A release spends no attempt, and the limiter and the error window
        never hear of these jobs: they did not run, so they say nothing of the load."""
        tasks = self.app.tasks
        if not any(t.depends_on for t in tasks.values()):
            return claimed
        await self._board.refresh_if_stale()
        run: list[ClaimedJob] = []
        held_back: list[ClaimedJob] = []
        later: list[Finish] = []
        trials: dict[str, int] = {}
        for c in claimed:
            task = tasks.get(c.job.task)
            held = self._board.hold_back(task.depends_on, trials) if task is not None else None
            if held is None:
                run.append(c)
                continue
            name, delay, state = held
            why = f"dependency {name!r} is {state.value}: deferred {delay:.1f}s, not run"
            later.append(Finish(c.lease, Outcome.RELEASE, delay, why, "coordination"))
            held_back.append(c)
            self._board.rejected(name)
        if later:
            try:
                done = await self.store.jobs_finish(finishes=later)
            except StoreError as exc:
                # Not run and not given back (or given back, its answer lost): their
                # leases expire and they are rescued.
                self.counters.unanswered += len(later)
                self._coordination_failed("deferral of held-back jobs", exc)
                return run
            self.counters.deferred += sum(done)
            self._count_refused(held_back, done, Outcome.RELEASE)
            # Debug: the breaker's change of state is what an operator must see.
            log.debug(
                "worker %s: %d jobs deferred: %s",
                self.id,
                len(later),
                later[0].error,
                extra={"worker_id": self.id},
            )
        return run

    def _start(self, claimed: ClaimedJob, sent_at: float, *, alone: bool = False) -> None:
        slot = Slot(claimed=claimed, lease=claimed.lease, valid_until=self._valid_until(sent_at))
        self._slots[(claimed.job.id, claimed.lease.token)] = slot
        if alone:
            self._alone = slot  # nothing else is here (see _isolate_suspect)
        if not self.state.may_fetch or (
            self.settings.prefetch != 0 and (self._waiting or self._handlers >= self._run_limit())
        ):
            # Prefetched: it waits, under its lease, for a handler to return. So does a
            # job whose claim was answered after the worker stopped claiming (a high
            # error rate, a store failing): it goes back unrun when its patience runs
            # out, or at the drain, unless the worker may start jobs again by then.
            slot.waiting_since = self.clock.monotonic()
            self._waiting.append(slot)
            return
        self._launch(slot)

    def _run_limit(self) -> int:
        """Handlers that may run at once: the adaptive limit, within the capacity."""
        return min(self._limiter.limit, self._capacity())

    def _promote(self) -> None:
        """Start prefetched jobs while handlers are fewer than the limit, in a state
        that may start jobs. A worker that stopped claiming (DRAINING on a high error
        rate or a store failing, FENCED) starts none: its waiting jobs go back when
        their patience runs out, or at the drain, as every prefetched job does."""
        if not self.state.may_fetch:
            return
        while self._waiting and self._handlers < self._run_limit():
            slot = self._waiting.popleft()
            slot.waiting_since = None
            if slot.cancel_reason is None:  # else it is being given back
                self._launch(slot)

    def _handler_returned(self, slot: Slot) -> None:
        """``slot``'s handler is done (its outcome may still be committing): a prefetched
        job may take its place, so the two overlap."""
        if slot.running:
            slot.running = False
            self._handlers -= 1
            self._run_times.add(self.clock.monotonic() - slot.started_at)
            if self._waiting and not self._stop_requested and not self._fencing:
                self._promote()
            if not self._waiting:
                self._wake_completer()

    async def _give_back(self, slots: Sequence[Slot], reason: str) -> None:
        """Release prefetched ``slots`` unrun (no attempt spent); if the store cannot be
        told, their leases expire and the rescue takes them."""
        slots = [s for s in slots if s.task is None and s.cancel_reason is None]
        if not slots:
            return
        for s in slots:
            s.cancel_reason = reason
            with contextlib.suppress(ValueError):
                self._waiting.remove(s)
        if not self._waiting:
            self._wake_completer()
        try:
            await self._release(slots, reason)
        finally:
            for s in slots:
                self._free(s)

    async def _release(self, slots: Sequence[Slot], reason: str) -> None:
        """Give the jobs of ``slots`` back, attempt refunded, within the call timeout;
        if the store cannot be told, their leases expire and the rescue takes them."""
        finishes = [Finish(s.lease, Outcome.RELEASE, 0.0, reason, "coordination") for s in slots]
        try:
            async with asyncio.timeout(self.settings.call_timeout):
                results = await self.store.jobs_finish(finishes=finishes)
            for s, given in zip(slots, results, strict=True):
                if given and s.task is None:
                    self.counters.unrun += 1  # never started: not one of `started`
                elif given:
                    self.counters.released += 1
            self._count_refused([s.claimed for s in slots], results, Outcome.RELEASE)
        except (StoreError, TimeoutError) as exc:
            self.counters.unanswered += len(slots)
            log.warning(
                "worker %s could not give back %d jobs: %s",
                *(self.id, len(slots), exception_text(exc)),
            )

    def _count_refused(
        self, claimed: Sequence[ClaimedJob], results: Sequence[bool], outcome: Outcome
    ) -> None:
        """Count the writes of ``claimed`` the store refused for their token: it records
        each as a stale write, so the worker's summary and ``tokenline audit`` agree."""
        for c, done in zip(claimed, results, strict=True):
            if not done:
                self.counters.stale_refused += 1
                self._stale_commit(c, outcome.value)

    def _launch(self, slot: Slot) -> None:
        claimed = slot.claimed
        # First: a state that may not start a job raises here, before the slot is
        # counted running with no task to end it (it would hold its lease for good).
        self._fire(WorkerEvent.JOB_STARTED)
        slot.running = True
        self._handlers += 1
        self.counters.started += 1
        slot.started_at = self.clock.monotonic()
        if claimed.job.attempt == 1:
            self._budget.deposit(claimed.job.queue, slot.started_at)
        if events.enabled():
            job = claimed.job
            events.emit(
                events.JobStarted(
                    worker_id=self.id,
                    job_id=job.id,
                    task=job.task,
                    queue=job.queue,
                    attempt=job.attempt,
                    token=claimed.lease.token,
                    waited=_waited(job),
                )
            )
        slot.task = asyncio.create_task(self._execute(slot), name=f"tokenline-job-{claimed.job.id}")

    def _free(self, slot: Slot) -> None:
        key = (slot.claimed.job.id, slot.claimed.lease.token)
        if self._slots.get(key) is slot:
            del self._slots[key]
        if self._alone is slot:
            self._alone = None
        if not slot.cancelled:
            # A ctx kept past its attempt (a thread the handler started, a global) must
            # refuse from now on, as it does once the worker cancelled the attempt.
            slot.cancel_reason = "the attempt is over"
            slot.cancelled = True
        if slot.waiting_since is not None:
            slot.waiting_since = None
            with contextlib.suppress(ValueError):
                self._waiting.remove(slot)
        if slot.resources:
            # A lease its handler never gave back (a `ctx.lease` block never left, a
            # thread kept past the attempt) would keep others out until its TTL: the
            # attempt is over, and so is what it held. Its check() refuses from now on.
            for held in slot.resources:
                held.released = True
            self._leftover_leases.extend(slot.resources)
            slot.resources.clear()
        self._handler_returned(slot)
        assert self._slot_freed is not None
        # The fetch loop waits for a free slot, a drain for every slot freed. A slot that
        # the claim made with this job's finish has filled again wakes neither for
        # nothing: at one job at a time, that was a turn of the loop per job.
        if self._stop_requested or len(self._slots) + self._claiming < self._capacity():
            self._slot_freed.set()
        if not self._slots and self.state is WorkerState.PROCESSING:
            self._fire(WorkerEvent.ALL_JOBS_DONE)

    async def _execute(self, slot: Slot) -> None:
        try:
            try:
                finish = await self._run_handler(slot)
            finally:
                self._handler_returned(slot)
            if finish is not None and slot.cancel_reason is None:
                await self._commit(slot, finish)
        except asyncio.CancelledError:
            if slot.cancel_reason is None:
                raise
        finally:
            self._free(slot)

    async def _run_handler(self, slot: Slot) -> Finish | None:
        """Run the handler and turn its result into the Finish to commit (or None)."""
        job = slot.claimed.job
        try:
            task = self.app.get_task(job.task)
            args, kwargs = decode_args(job.args)
        except UnknownTaskError as exc:
            return self._dead(slot, f"{exc} on worker {self.id}", ErrorClass.PERMANENT)
        except (ValueError, RecursionError) as exc:
            # RecursionError: nested deeper than any enqueue accepts (written by hand).
            what = exception_text(exc, with_type=False) or "nested too deep"
            return self._dead(slot, f"malformed job payload: {what}", ErrorClass.PERMANENT)
        ctx = JobContext(
            slot=slot,
            store=self.store,
            clock=self.clock,
            local_fencing=self.settings.local_fencing,
            settings=self.settings,
            board=self._board,
            max_result_bytes=self.app.settings.max_payload_bytes,
        )
        timeout = job.timeout or task.timeout or self.settings.job_timeout
        slot.deadline = self.clock.monotonic() + timeout
        try:
            if task.is_async:
                result = await self._run_async(slot, task.fn(ctx, *args, **kwargs), timeout)
            else:
                call = functools.partial(self._in_thread, task.fn, ctx, *args, **kwargs)
                try:
                    fut = self._pool.submit(call)
                except RuntimeError as exc:  # "can't start new thread": out of threads
                    return self._cannot_run(slot, exc)
                result = await self._in_pool(fut, timeout)
        except asyncio.CancelledError as exc:
            current = asyncio.current_task()
            if slot.cancel_reason is not None or (current is not None and current.cancelling()):
                raise  # the worker's cancellation: fenced, stopping
            # Nobody cancelled this task: the handler raised it (or awaited something
            # cancelled). A failure of the attempt like any other, not the end of the task
            # that commits its outcome.
            return await self._handler_failed(slot, ctx, task, exc)
        except _RaisedInThread as wrapped:
            return await self._handler_failed(slot, ctx, task, wrapped.exc)
        except TimeoutError as exc:
            if slot.completed_in_transaction:
                return None
            if slot.done_in_ledger:
                return self._done_in_ledger(slot, exc)
            reason = (
                exception_text(exc, with_type=False)
                or f"hard timeout: attempt ran longer than {timeout:g}s"
            )
            # The sync thread may run on; its ctx calls now refuse, saying why.
            slot.timed_out = reason
            slot.cancelled = True
            slot.failure = FailureKind.TIMEOUT
            if ctx.blames_dependency(exc):
                self._blamed.add(slot)
            await self._effect_over(slot)
            return self._after_failure(slot, Decision(ErrorClass.TRANSIENT, reason), task.retry)
        except BaseException as exc:
            return await self._handler_failed(slot, ctx, task, exc)
        unrun = _never_ran(result) or _not_awaited(ctx.never_awaited())
        if slot.completed_in_transaction:
            if unrun:
                log.warning("job %s: its handler %s", job.id, unrun)
            self.counters.succeeded += 1
            self._finished(slot, Finish(slot.lease, Outcome.SUCCEEDED))
            return None
        if unrun and slot.done_in_ledger:
            log.warning("job %s: its handler %s", job.id, unrun)
            return Finish(slot.lease, Outcome.SUCCEEDED)
        if unrun:
            # Recorded as succeeded, the job's work would silently never happen.
            return self._dead(slot, f"handler of task {job.task!r} {unrun}", ErrorClass.PERMANENT)
        return Finish(slot.lease, Outcome.SUCCEEDED)

    async def _effect_over(self, slot: Slot) -> None:
        """Past the hard timeout of a sync handler whose thread is inside ``ctx.effect``,
        keep the attempt, its lease renewed, until the effect is over (its callee has
        returned and its outcome is recorded), or until ``effect_pending_deadline`` after
        it began, when the reconciler would give the key up too.

        Ended at once, the attempt left the key pending under a lease that was gone:
        the next attempt of the job, or a job of another with the same key, took the key
        over and ran the callee while this thread still ran it. Kept, the attempt holds
        the key: the other waits for it (``EffectPendingError``), then finds it done."""
        key = slot.effect_key
        if key is None:
            return
        job = slot.claimed.job
        limit = slot.effect_since + self.settings.effect_pending_deadline
        log.warning(
            "job %s: hard timeout while its effect %r runs in the handler's thread: the "
            "attempt ends once the effect is over, at most %.0fs from now "
            "(effect_pending_deadline)",
            *(job.id, key, max(0.0, limit - self.clock.monotonic())),
        )
        while slot.effect_key is not None:
            if self.clock.monotonic() >= limit:
                log.warning(
                    "job %s: effect %r still runs in the handler's thread past "
                    "effect_pending_deadline: the attempt ends, and a later attempt may "
                    "run the key again",
                    *(job.id, key),
                )
                return
            # Polled: the thread has no loop to wake this task through, and a hard
            # timeout inside an effect is rare.
            await asyncio.sleep(_EFFECT_POLL)

    def _done_in_ledger(self, slot: Slot, exc: BaseException) -> Finish:
        """The Finish of an attempt whose ``ctx.transaction()`` recorded the job done in
        the ledger, and whose handler then failed with ``exc``: the job has succeeded
        (its writes are committed), so the broker is told so, as when the handler
        returns. A failure recorded instead would run the job again, or bury it."""
        log.warning("job %s raised after its transaction committed: %r", slot.claimed.job.id, exc)
        return Finish(slot.lease, Outcome.SUCCEEDED)

    async def _handler_failed(
        self, slot: Slot, ctx: JobContext, task: Task, exc: BaseException
    ) -> Finish | None:
        """The Finish for an attempt whose handler raised ``exc`` (or None)."""
        job = slot.claimed.job
        ctx.never_awaited()  # closed unawaited: the failure is what the attempt reports
        if slot.cancel_reason is not None:
            # The worker ended the attempt (a drain timeout spared it until its effect
            # was over, say): what its handler raised since is not the job's outcome.
            return None
        if slot.completed_in_transaction:
            log.warning("job %s raised after its transaction committed: %r", job.id, exc)
            return None
        if slot.done_in_ledger and not isinstance(exc, FencedError):
            return self._done_in_ledger(slot, exc)
        decision = self._classify(exc, task.classifier or self.app.classifier)
        # Held back by a breaker, or by another live attempt holding what it needs (a
        # resource lease, an effect key), the job did not fail: nothing for the limiter
        # nor the error rate, which would pause a worker for its jobs' contention.
        held_back = isinstance(exc, DependencyOpenError | LeaseBusyError | EffectPendingError)
        slot.failure = None if held_back else FailureKind.from_error_class(decision.error_class)
        if ctx.blames_dependency(exc):
            self._blamed.add(slot)
        if isinstance(exc, StoreError):
            # From a ctx call of the handler: a transaction, an effect, a fence. Counted
            # with the worker's own failed calls: the summary and the metric agree.
            self.counters.coordination_errors += 1
            self._note_channel(f"job {job.id}", exc, "ledger")
        if isinstance(exc, StoreCorruptError | SchemaVersionError):
            self._store_damaged(exc)
        if isinstance(exc, FencedError):
            if exc.held_resource is None or self.clock.monotonic() >= slot.valid_until:
                self._note_fenced(slot, exc)
                # Not refused by the store: the attempt's own check found its lease
                # untrusted (LeaseExpiredError), by the worker's clock.
                own = not isinstance(exc, StaleTokenError)
                await self._lease_lost(f"job {job.id}: {exc}", own_clock=own)
                return None
            # A resource lease of this attempt was lost (taken over, released by an
            # operator, or its block ended), while the job's own lease holds: only this
            # attempt is over. The worker's other jobs hold leases of their own, which
            # this loss says nothing about: cancelling them would throw their work away.
            if isinstance(exc, StaleTokenError):
                self._note_fenced(slot, exc)
            log.warning(
                "worker %s: job %s lost its lease on %r (%s); that attempt ends, the "
                "worker's other jobs go on",
                *(self.id, job.id, exc.held_resource, exc),
            )
        return self._after_failure(slot, decision, task.retry)

    def _store_damaged(self, exc: StoreError) -> None:
        """A handler met a damaged store (a table of tokenline's gone under the running
        worker): its job was given back, attempt intact, and so would every other job
        that needs what is missing, again and again, and nothing an operator does
        while it runs repairs it. The worker stops (as on SIGTERM: the jobs in flight
        finish or go back); started again, it refuses the store, naming what it lacks,
        until the store is repaired."""
        if self._stop_requested:
            return
        log.error(
            "worker %s: the store is damaged (%s); stopping: repair the store (`tokenline "
            "status` names what it lacks), then start the worker again",
            self.id,
            exc,
            extra={"worker_id": self.id},
        )
        self.request_shutdown()

    async def _await_within(self, awaitable: Awaitable[T], limit: float, late: str = "") -> T:
        """``await awaitable`` under a hard timeout of ``limit`` seconds, as ``async with
        asyncio.timeout(limit)`` would, for less (see deadlines.py): TimeoutError once it
        passes, with ``late`` when the awaited code caught the cancellation and returned
        after its deadline anyway (the timeout holds all the same)."""
        current = asyncio.current_task()
        assert current is not None  # a handler runs in its job's task
        if self._deadlines is None:
            self._deadlines = Deadlines(asyncio.get_running_loop())
        deadline = self._deadlines.start(limit, current)
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if deadline.settle(cancelled=True):
                raise TimeoutError from None
            raise
        except BaseException:
            deadline.settle(cancelled=False)
            raise
        if deadline.settle(cancelled=False):
            raise TimeoutError(late)
        return result

    async def _run_async(
        self, slot: Slot, coro: Coroutine[Any, Any, object], limit: float
    ) -> object:
        """Run an async handler in this task under its hard timeout, taking no step of it
        once its lease is no longer trusted (see ``guard.py``)."""
        check = LeaseCheck(slot, self.clock, self.settings.local_fencing)
        slot.guarded = True
        late = (
            f"hard timeout: attempt ran longer than {limit:g}s "
            "(the handler caught its cancellation and returned late)"
        )
        watch = StepWatch(
            self._watchdog_period, self.clock.monotonic, lambda held: self._held_loop(slot, held)
        )
        try:
            return await self._await_within(
                Guarded(coro, check, lambda: slot.abandoned, watch), limit, late
            )
        except asyncio.CancelledError:
            if not slot.abandoned or slot.cancel_reason is not None:
                raise  # the worker's own cancellation (fenced, stopping): it ends the task
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # the watchdog's cancellation, which closed it
            raise TimeoutError(
                f"hard timeout: attempt ran longer than {limit:g}s, and the handler was "
                f"abandoned after it ignored its cancellation for "
                f"{self.settings.call_timeout:g}s"
            ) from None
        finally:
            slot.guarded = False
            # The guard saw the lease expire before the watchdog did, and the slot is
            # about to be freed, out of the watchdog's sight: fence as it would have.
            fencing = self._fencing or self.state in (WorkerState.FENCED, WorkerState.STOPPED)
            if check.expired and not fencing:
                await self._lease_lost(
                    f"job {slot.claimed.job.id}: {UNTRUSTED}; handler stopped before its next step",
                    own_clock=True,
                )

    async def _in_pool(self, fut: concurrent.futures.Future[object], limit: float) -> object:
        """Wait for ``fut``, a call given to a pool thread, under a hard timeout of
        ``limit`` seconds; a thread that runs on past the attempt is counted until it
        returns."""
        try:
            return await self._await_within(asyncio.wrap_future(fut), limit)
        finally:
            # Not started yet: it never will be. Running: its thread is kept from the
            # next jobs until the handler returns, which no one can make it do.
            if not fut.cancel() and not fut.done():
                self._thread_kept(fut)

    def _cannot_run(self, slot: Slot, exc: RuntimeError) -> Finish:
        """No thread could be started for a sync handler (the process is out of threads
        or memory): its job goes back unrun, no attempt spent, and the worker stops, with
        an error, for a supervisor to start it afresh. It claimed on and failed every
        job it took, innocent ones too, each spending an attempt on the worker's fault."""
        why = f"worker {self.id} cannot start a thread for a sync handler ({exc})"
        if self._fatal is None:
            self._fatal = TokenlineError(
                f"{why}: the process is out of threads or memory; it stopped, giving its "
                "jobs back unrun"
            )
            log.error("%s: stopping, its jobs given back unrun", why)
            self.request_shutdown()
        return Finish(slot.lease, Outcome.RELEASE, 0.0, f"{why}: not run", "coordination")

    def _thread_kept(self, fut: concurrent.futures.Future[object]) -> None:
        before = self.concurrency_limit
        self._threads_kept += 1
        self._limit_moved(before)
        loop = asyncio.get_running_loop()

        def returned(_: concurrent.futures.Future[object]) -> None:
            # On the handler's thread; after a stop, the loop may be closed.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._thread_returned)

        fut.add_done_callback(returned)

    def _thread_returned(self) -> None:
        before = self.concurrency_limit
        self._threads_kept -= 1
        self._limit_moved(before)
        if self._slot_freed is not None:
            self._slot_freed.set()  # the fetch loop may claim again

    def _limit_moved(self, before: int) -> None:
        """Tell the log and the metrics that threads kept by handlers past their attempt
        moved the concurrency limit from ``before``."""
        after = self.concurrency_limit
        if after == before:
            return
        log.log(
            logging.WARNING if after < before else logging.INFO,
            "worker %s: concurrency %d -> %d (%d sync handlers past their attempt still "
            "hold pool threads)",
            self.id,
            before,
            after,
            self._threads_kept,
            extra={"worker_id": self.id},
        )
        if events.enabled():
            events.emit(events.ConcurrencyLimitChanged(self.id, before, after))

    def _in_thread(self, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        """Run a sync handler on a pool thread, counted while it runs."""
        with self._sync_lock:
            self._sync_running += 1
        pid = os.getpid()
        try:
            return fn(*args, **kwargs)
        except Exception:
            raise
        except BaseException as exc:
            # GeneratorExit, CancelledError, SystemExit…: come out of a pool thread's
            # future as they are, asyncio takes them for the awaiting task's own end and
            # the attempt's outcome is lost. Carried over as an ordinary exception, they
            # are classified like any other failure of the handler.
            raise _RaisedInThread(exc) from exc
        finally:
            if os.getpid() != pid:
                _forked_child_returned(fn)
            with self._sync_lock:
                self._sync_running -= 1

    @property
    def sync_handlers_running(self) -> int:
        """Sync handlers still running on pool threads (cancelled ones included)."""
        with self._sync_lock:
            return self._sync_running

    def _note_fenced(self, slot: Slot, exc: FencedError) -> None:
        if isinstance(exc, StaleTokenError):
            self.counters.stale_refused += 1
            self._stale_commit(slot.claimed, exc.operation)

    def _classify(self, exc: BaseException, classifier: Classifier | None) -> Decision:
        """The class of a handler's failure; a classifier that raises (or answers
        something that is not a class) is logged, and the defaults decide: its job is
        still retried or dead-lettered, never left running until its lease expires."""
        try:
            return classify(exc, classifier)
        except BaseException as bug:  # SystemExit, KeyboardInterrupt…: the classifier's own
            log.error(
                "worker %s: the classifier failed on %s (%s); the default classes decide",
                self.id,
                exception_text(exc),
                exception_text(bug),
                exc_info=bug,
            )
            decision = classify(exc)
            why = f"{decision.reason} (the classifier failed: {exception_text(bug)})"
            return Decision(decision.error_class, why, decision.delay)

    def _dead(self, slot: Slot, reason: str, cls: ErrorClass) -> Finish:
        return Finish(slot.lease, Outcome.DEAD, None, reason, cls.value)

    def _after_failure(
        self, slot: Slot, decision: Decision, policy: RetryPolicy | None = None
    ) -> Finish:
        job = slot.claimed.job
        if decision.error_class is ErrorClass.PERMANENT:
            return self._dead(slot, decision.reason, ErrorClass.PERMANENT)
        retry = policy or self.app.retry
        if decision.error_class is ErrorClass.COORDINATION:
            # Not the job's fault: give the attempt back and let it run again after the
            # delay of a dependency's open breaker, if that is what held it back, else
            # after the policy's delay for this attempt (which a release does not spend).
            # At once, a job whose every run meets the same failure (a ledger down while
            # the broker answers; a classifier that calls every error coordination)
            # would be claimed and released again in a tight loop, for ever.
            delay = (
                decision.delay
                if decision.delay is not None
                else policy_delay(retry, max(1, job.attempt))
            )
            return Finish(slot.lease, Outcome.RELEASE, delay, decision.reason, "coordination")
        if job.attempt >= job.max_attempts:
            return self._dead(
                slot,
                f"{decision.reason} (attempt {job.attempt} of {job.max_attempts})",
                ErrorClass.TRANSIENT,
            )
        # policy_delay: a policy that answers no valid delay must not fail the worker.
        delay = decision.delay if decision.delay is not None else policy_delay(retry, job.attempt)
        reason = decision.reason
        if not self._budget.try_spend(job.queue, self.clock.monotonic()):
            # More retries than the queue's budget: a failing dependency must not get
            # them all at once. The attempt is spent as any retry's; only its delay grows.
            window = self.settings.retry_budget_window
            if delay < window:
                budget = self._budget.describe(job.queue, self.clock.monotonic())
                log.info(
                    "job %s: retry budget of queue %s spent (%s); it waits %.0fs",
                    *(job.id, job.queue, budget, window),
                )
                delay = window
                # On the job's record too: `tokenline job` said only the handler's
                # reason, and the minute's wait looked like a backoff gone wrong.
                reason = (
                    f"{reason} (the retry budget of queue {job.queue!r} was spent: it "
                    f"waits {window:g}s)"
                )
        return Finish(slot.lease, Outcome.RETRY, delay, reason, "transient")

    async def _commit(self, slot: Slot, finish: Finish) -> None:
        """Self-fence, then commit through the batch completer; a refusal fences us.

        A commit that failed may still have been made (its answer lost on the way
        back): until a try is answered, the slot stays ``finishing``, so that a renewal
        refused meanwhile (the job is no longer running) fences nothing and a fence
        does not give the job back again, and each try first asks whether the attempt
        already ended this way. Trying it again would be refused, and recorded by the
        store as a stale write, for a commit that was made."""
        assert self._completer is not None
        unsure = False
        while True:
            if self.settings.local_fencing and self.clock.monotonic() >= slot.valid_until:
                await self._lease_lost(
                    f"job {slot.claimed.job.id}: lease no longer trusted by the worker's clock",
                    own_clock=True,
                )
                return
            slot.finishing = True
            try:
                if unsure and await self._made(finish):
                    ok = True
                    break
                ok = await self._completer.submit(finish)
            except JobNotFoundError as exc:
                self._job_gone(slot, finish, exc)
                return
            except StoreError as exc:
                # The outcome is not lost: retry while the lease is still ours.
                unsure = True
                self._coordination_failed("commit", exc)
                await asyncio.sleep(min(1.0, self.settings.renew_period / 2))
                continue
            break
        if not ok:
            self.counters.stale_refused += 1
            self._stale_commit(slot.claimed, finish.outcome.value)
            await self._lease_lost(
                f"job {slot.claimed.job.id}: store refused {finish.outcome.value} "
                f"with token {finish.lease.token}"
            )
            return
        outcome = finish.outcome
        if outcome is Outcome.SUCCEEDED:
            self.counters.succeeded += 1
        elif outcome is Outcome.RETRY:
            self.counters.retried += 1
        elif outcome is Outcome.DEAD:
            self.counters.dead += 1
        else:
            self.counters.released += 1
        self._finished(slot, finish)

    def _job_gone(self, slot: Slot, finish: Finish, exc: JobNotFoundError) -> None:
        """The store no longer has the job whose outcome this worker was committing (a
        broker that lost its keys: a Redis restarted without its data, a FLUSHDB): there
        is nothing left to record it on. Said, and counted as unanswered; what the
        attempt committed in a ledger stays, and the reconciler reports the job."""
        self.counters.unanswered += 1
        log.warning(
            "worker %s: job %s is gone from the store (%s): its outcome %s is recorded "
            "nowhere; what its transaction committed stays committed",
            *(self.id, slot.claimed.job.id, exc, finish.outcome.value),
        )

    async def _made(self, finish: Finish) -> bool:
        """Whether the store already holds ``finish``: its attempt (this token, this
        worker) ended with this outcome, by a try whose answer was lost."""
        lease = finish.lease
        attempts = await self.store.job_attempts(job_id=lease.job_id)
        return any(
            (a.token, a.owner, a.outcome) == (lease.token, lease.owner, finish.outcome.value)
            for a in attempts
        )

    def _finished(self, slot: Slot, finish: Finish) -> None:
        """Log and announce an outcome the store accepted, and let the limiter and the
        error window learn from it."""
        job, token, outcome = slot.claimed.job, slot.claimed.lease.token, finish.outcome
        self._learn(slot, outcome)
        # A success line is wanted by machine-read logs only: the check keeps its cost
        # (a record per job) off the hot path when nobody reads it.
        if outcome is Outcome.SUCCEEDED and not success_log.isEnabledFor(logging.INFO):
            self._announce_finished(slot, finish)
            return
        what = f"job {job.id} ({job.task}) attempt {job.attempt}/{job.max_attempts}"
        cls = finish.error_class or "-"
        fields = {
            "worker_id": self.id,
            "job_id": job.id,
            "task": job.task,
            "queue": job.queue,
            "attempt": job.attempt,
            "token": token,
            "outcome": outcome.value,
            "error_class": finish.error_class,
            "error": finish.error,
        }
        # Every outcome is logged with its class and reason: a job that fails the same
        # way on every attempt must be visible before it goes dead. Successes go to a
        # logger of their own, which the text log of `tokenline worker` leaves out.
        if outcome is Outcome.SUCCEEDED:
            success_log.info("%s succeeded", what, extra=fields)
        elif outcome is Outcome.RETRY:
            again = f"it runs again in {finish.delay or 0.0:.1f}s"
            log.info("%s failed (%s): %s; %s", what, cls, finish.error, again, extra=fields)
        elif outcome is Outcome.DEAD:
            log.warning("%s: dead (%s): %s", what, cls, finish.error, extra=fields)
        else:
            log.info(
                "%s given back, no attempt spent (%s): %s", what, cls, finish.error, extra=fields
            )
        self._announce_finished(slot, finish)

    def _announce_finished(self, slot: Slot, finish: Finish) -> None:
        if not events.enabled():
            return
        job, token, outcome = slot.claimed.job, slot.claimed.lease.token, finish.outcome
        events.emit(
            events.JobFinished(
                worker_id=self.id,
                job_id=job.id,
                task=job.task,
                queue=job.queue,
                attempt=job.attempt,
                token=token,
                outcome=outcome.value,
                error_class=finish.error_class,
                duration=self.clock.monotonic() - slot.started_at,
                waited=_waited(job),
            )
        )

    def _learn(self, slot: Slot, outcome: Outcome) -> None:
        now = self.clock.monotonic()
        before = self.concurrency_limit
        if outcome is Outcome.SUCCEEDED:
            self._limiter.on_success(now - slot.started_at, in_flight=len(self._slots))
            self._errors.record(True, now)
        elif slot.failure is not None:
            self._limiter.on_failure(slot.failure, started=slot.started_at)
            # A dependency's breaker already counted this failure and pauses what needs
            # that dependency; pausing the whole worker for it would stop the rest too.
            if slot not in self._blamed:
                self._errors.record(not slot.failure.is_overload, now)
        after = self.concurrency_limit
        if after != before:
            level = logging.INFO if after < before else logging.DEBUG
            how = self._limiter.describe()
            log.log(level, "worker %s: concurrency %d -> %d (%s)", self.id, before, after, how)
            if events.enabled():
                events.emit(events.ConcurrencyLimitChanged(self.id, before, after))
        self._check_error_rate()

    def _check_error_rate(self) -> None:
        """Pause claiming while too many recent jobs failed from overload; resume once
        the window has moved past them."""
        now = self.clock.monotonic()
        if self._errors.exceeded(now):
            if "error rate" not in self._unhealthy:
                detail = self._errors.describe(now)
                log.warning("worker %s: pausing: %s", self.id, detail)
                self._unhealthy_because("error rate", detail)
        elif "error rate" in self._unhealthy:
            self._healthy_again("error rate", self._errors.describe(now))

    def _stale_commit(self, claimed: ClaimedJob, operation: str) -> None:
        """The store refused this attempt's write: its view of its own lease (still
        valid, by the worker's clock) was stale. The store's answer is the one obeyed."""
        if not events.enabled():
            return
        job, token = claimed.job, claimed.lease.token
        events.emit(events.StaleCommitRefused(self.id, job.id, token, operation))
        events.emit(events.StaleRead(self.id, "job lease", f"job {job.id} token {token}"))

    # -- fencing --------------------------------------------------------------------------
    async def _lease_lost(self, reason: str, *, own_clock: bool = False) -> None:
        """Fence the worker: stop every handler, give back what is still ours, re-register.

        ``own_clock``: the worker's own clock found a lease untrusted (the store refused
        nothing); counted apart, once per fencing, as the fencing itself is."""
        # A flag, not a lock: a handler task that reports a lost lease while the worker
        # is already fencing must not wait for the fencing, which is awaiting it.
        if self.state in (WorkerState.STOPPED, WorkerState.FENCED) or self._fencing:
            return
        self._fencing = True
        self._wake_completer()
        try:
            self.counters.fenced += 1
            if own_clock:
                self.counters.self_fenced += 1
            log.warning("worker %s fenced: %s", self.id, reason)
            self._fire(WorkerEvent.LEASE_LOST, reason)
            await self._cancel_all(f"fenced: {reason}", release=True)
            if self._stop_requested:
                self._fire(WorkerEvent.SHUTDOWN, "shutdown while fenced")
                return
            while self._is(WorkerState.FENCED):
                try:
                    await self._register()
                except StoreError as exc:
                    self._coordination_failed("re-register", exc, "leases")
                    await asyncio.sleep(self.settings.renew_period)
                    continue
                if not self._is(WorkerState.FENCED):
                    # Stopped while it registered (a SIGTERM during a stall): the stop's
                    # deregistration may have gone first, and this one made it live again.
                    with contextlib.suppress(TokenlineError):
                        await self.store.worker_deregister(
                            worker_id=self.id, token=self._membership_token
                        )
                    break
                self._fire(WorkerEvent.REREGISTERED, "fresh membership lease")
        finally:
            self._fencing = False

    async def _cancel_all(
        self, reason: str, *, release: bool, spare_effects: bool = False
    ) -> list[Slot]:
        """End every attempt under way: their ``ctx`` calls refuse from now on, their
        handlers are cancelled, and (``release``) the jobs whose leases are still ours
        are given back. With ``spare_effects`` (a drain timeout), a handler inside
        ``ctx.effect`` is neither cancelled nor given back, nor freed: those slots are
        returned, for :meth:`_effects_over_at_drain`."""
        current = asyncio.current_task()
        slots = list(self._slots.values())
        spared = [
            s
            for s in slots
            if spare_effects
            and (s.effect_key is not None or s.effect_awaited is not None)
            and s.task is not None
            and not s.finishing
        ]
        for slot in slots:
            slot.cancel_reason = reason  # its ctx calls refuse from now on
            if slot in spared:
                # Not cancelled yet: an async handler's guard takes no step of a
                # cancelled slot, and the awaited callee would stop there.
                continue
            slot.cancelled = True
            if slot.task is not None and slot.task is not current:
                slot.task.cancel()
        slots = [s for s in slots if s not in spared]
        now_mono = self.clock.monotonic()
        # Jobs whose lease is still ours go back at once, attempt refunded; the rest
        # expire and the rescuer takes them. A job whose outcome the completer holds is
        # left to it: released first, the job would run again, and its outcome be
        # refused as stale.
        # Nor is a job whose sync handler's thread runs an effect: given back, its next
        # attempt would take the effect's key over while the callee still runs here.
        # Nor one an earlier cancellation gave back already (a second stop while a
        # drain's cancellation still waits for its handlers).
        keep = (
            [
                s
                for s in slots
                if now_mono < s.valid_until
                and not s.finishing
                and s.effect_key is None
                and not s.released
            ]
            if release
            else []
        )
        # Started, cancelled, and neither given back nor being committed: they lapse.
        self.counters.lapsed += sum(
            1
            for s in slots
            if s.task is not None and not s.finishing and not s.released and s not in keep
        )
        if keep:
            for s in keep:
                s.released = True
            await self._release(keep, reason)
        waiting = {s.task for s in slots if s.task is not None and s.task is not current}
        if waiting:
            # Bounded: a task that ignores its cancellation must not keep the worker
            # from fencing or stopping.
            done, stuck = await asyncio.wait(waiting, timeout=self.settings.call_timeout)
            if stuck:
                # They caught their cancellation: close them where they wait, so that no
                # handler can keep its worker from fencing or stopping.
                log.warning(
                    "worker %s: %d job handlers ignored their cancellation; abandoned",
                    *(self.id, len(stuck)),
                )
                for slot in slots:
                    if slot.task in stuck:
                        self._abandon(slot)
                more, stuck = await asyncio.wait(stuck, timeout=self.settings.call_timeout)
                done |= more
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: it ended with the worker's cancellation
            if stuck:
                log.warning("worker %s: %d job tasks did not stop in time", self.id, len(stuck))
        for slot in slots:
            self._free(slot)
        return spared

    async def _effects_over_at_drain(self, spared: list[Slot]) -> None:
        """At a drain timeout, wait for the effects under way in ``spared`` (a sync
        handler's thread inside ``ctx.effect``, or an async handler awaiting it), their
        leases renewed meanwhile, until each is over, at most ``effect_pending_deadline``
        after it began; then cancel those handlers and give their jobs back.

        Cut at the drain timeout, the callee's outcome was unknown: the process ended
        the thread, or the cancellation the awaited call, and the job's next attempt
        took the key over and ran the callee again, as after a crash. Waited for, the
        outcome is recorded, and the next attempt finds the key done. The handlers can
        start no other effect meanwhile (their ``ctx`` calls refuse). A second stop
        request, or a fencing, ends the wait: those jobs are left to their leases."""
        limit = self.settings.effect_pending_deadline
        log.warning(
            "worker %s: drain timeout while %d jobs run an effect: it stops once each "
            "effect is over, at most %.0fs after it began (effect_pending_deadline)",
            *(self.id, len(spared), limit),
        )
        pending = list(spared)
        while pending and self.state is WorkerState.DRAINING:
            now = self.clock.monotonic()
            over = [s for s in pending if s.effect_key is None and s.effect_awaited is None]
            late = [s for s in pending if s not in over and now >= s.effect_since + limit]
            for slot in late:
                log.warning(
                    "job %s: its effect still runs past effect_pending_deadline: left to "
                    "its lease, and a later attempt may run the key again",
                    slot.claimed.job.id,
                )
            if over or late:
                pending = [s for s in pending if s not in over and s not in late]
                await self._end_spared(over, give_back=True)
                await self._end_spared(late, give_back=False)
            if pending:
                # Polled: a sync handler's thread has no loop to wake this task through.
                await asyncio.sleep(_EFFECT_POLL)

    async def _end_spared(self, slots: list[Slot], *, give_back: bool) -> None:
        """Cancel the handlers of ``slots`` spared by a drain timeout, give back
        (``give_back``) those whose leases are still ours, and free them all."""
        if not slots:
            return
        for slot in slots:
            slot.cancelled = True
            if slot.task is not None and not slot.task.done():
                slot.task.cancel()
        now_mono = self.clock.monotonic()
        back = [
            s
            for s in slots
            if give_back and now_mono < s.valid_until and not s.finishing and not s.released
        ]
        self.counters.lapsed += sum(1 for s in slots if not s.finishing and s not in back)
        if back:
            for s in back:
                s.released = True
            await self._release(back, "drain timeout, once its effect was over")
        tasks = {s.task for s in slots if s.task is not None}
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.call_timeout)
        for slot in slots:
            self._free(slot)

    def _coordination_failed(
        self, what: str, exc: Exception, channel: str = "broker", *, reason: str = "coordination"
    ) -> None:
        """A store call failed: count it, say it, and stop fetching until the store is
        healthy again. ``channel``: the role of the call (broker, leases, ledger), unless
        the store says the error came from another role's server. ``reason``: what
        clears it: ``coordination`` a renewal that answers, ``claims`` a claim that does
        (on the split topology the claim asks the ledger, which the renewal never does)."""
        self.counters.coordination_errors += 1
        self._coordination_failures += 1
        log.warning("worker %s: %s failed: %s", self.id, what, exc)
        self._note_channel(what, exc, channel)
        self._unhealthy_because(reason, f"{what} failed: {exc}")

    def _note_channel(self, what: str, exc: Exception, channel: str) -> None:
        """Emit the failure for the metrics, under the role whose server failed."""
        if events.enabled():
            # A store whose roles live on different servers (the split topology) says
            # which failed; on the others every role is the one server's.
            inner = getattr(self.store, "inner", self.store)
            channel_of = getattr(inner, "channel_of", None)
            if channel_of is not None:
                channel = channel_of(exc, channel)
            events.emit(events.CoordinationFailed(self.id, channel, what, str(exc)))

    def _unhealthy_because(self, reason: str, detail: str) -> None:
        """Stop claiming (DRAINING) for ``reason``; in-flight jobs go on."""
        self._unhealthy.add(reason)
        if self.state in (WorkerState.READY, WorkerState.PROCESSING):
            self._fire(WorkerEvent.COORDINATION_UNHEALTHY, detail)

    def _healthy_again(self, reason: str, detail: str) -> None:
        """``reason`` has cleared; claim again once no other reason remains."""
        self._unhealthy.discard(reason)
        if self._unhealthy or self._stop_requested:
            return
        if self.state is WorkerState.DRAINING:
            self._fire(WorkerEvent.COORDINATION_HEALTHY, detail)

    # -- control plane --------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.renew_period):
                    await self._beat_soon.wait()
            self._beat_soon.clear()
            if self.state in (WorkerState.STOPPED, WorkerState.FENCED):
                continue
            await self._renew_once()

    async def _release_leftovers(self) -> None:
        """Give back the resource leases of attempts that ended holding them; one the
        store cannot take now is tried again next tick while it may still be held."""
        left, self._leftover_leases = self._leftover_leases, []
        now = self.clock.monotonic()
        for held in left:
            try:
                released = await self.store.resource_lease_release(lease=held.current)
            except StoreError as exc:
                if now < held.valid_until:
                    self._leftover_leases.append(held)
                else:
                    log.warning("could not release the lease on %r: %s", held.resource, exc)
                continue
            if released:  # else its handler's own late exit gave it back first
                log.warning(
                    "worker %s: released the lease on %r (token %d) that its attempt ended holding",
                    *(self.id, held.resource, held.token),
                )

    async def _renew_once(self) -> None:
        settings = self.settings
        if self._leftover_leases:
            await self._release_leftovers()
        # Finishing slots too: a commit can wait (for a store lock, say) and its job must
        # keep its lease meanwhile; only a refusal of theirs means nothing (below).
        slots = list(self._slots.values())
        sent_at = self.clock.monotonic()
        try:
            # Job leases first: they carry ownership, and their refusal is what fences.
            renewed = await self.store.job_leases_renew(
                owner=self.id, leases=[s.lease for s in slots], ttl=settings.lease_ttl
            )
            beat_sent = self.skew.sent()
            rec = await self.store.worker_heartbeat(
                worker_id=self.id,
                token=self._membership_token,
                state=self.state.value,
                in_flight=len(self._slots),
                ttl=settings.lease_ttl,
                skew=self.skew.value,
                concurrency_limit=self.concurrency_limit,
            )
            if rec is not None:
                self.skew.answered(beat_sent, rec.heartbeat_at)
                if rec.drain_requested and not self._stop_requested:
                    # `tokenline drain`: as a first SIGTERM — claim nothing more, finish
                    # the jobs in flight within drain_timeout, then stop.
                    log.warning("worker %s: drain requested by an operator", self.id)
                    self.request_shutdown()
                beat = self.clock.monotonic()
                gap, self._last_beat = beat - self._last_beat, beat
                if events.enabled():
                    events.emit(events.Heartbeat(self.id, gap, self.skew.value))
            if rec is None:
                # Membership is for visibility, not ownership: nobody else can take it.
                log.warning("worker %s: membership lease had expired; re-registering", self.id)
                await self._register()
            # Resource leases held through ctx.lease, each fenced by its own token.
            await renew_resource_leases(self.store, slots, self.clock)
        except StoreError as exc:
            self._coordination_failed("lease renewal", exc, "leases")
            if events.enabled() and slots:
                events.emit(events.LeaseRenewalFailed(self.id, len(slots), "error", str(exc)))
            return
        lost = []
        for slot, lease in zip(slots, renewed, strict=True):
            key = (slot.claimed.job.id, slot.claimed.lease.token)
            if self._slots.get(key) is not slot:
                continue  # it finished while the renewal was in flight: nothing was lost
            if lease is None:
                if slot.finishing:
                    continue  # its commit may have landed first; the commit's answer decides
                lost.append(slot.claimed.job.id)
            else:
                slot.lease = lease
                slot.valid_until = self._valid_until(sent_at)
        if lost:
            self.counters.renewals_refused += len(lost)
            if events.enabled():
                detail = f"jobs {lost}"
                events.emit(events.LeaseRenewalFailed(self.id, len(lost), "refused", detail))
                events.emit(events.StaleRead(self.id, "job lease", f"renewal refused: {detail}"))
            await self._lease_lost(f"renewal refused for jobs {lost}")
            return
        self._coordination_failures = 0
        self._healthy_again("coordination", "renewal succeeded")
        self._check_error_rate()

    @property
    def _watchdog_period(self) -> float:
        """Seconds between two turns of the watchdog: also how long one step of an async
        handler may hold the event loop before it is reported (see :meth:`_held_loop`)."""
        return min(1.0, self.settings.renew_period / 2)

    def _held_loop(self, slot: Slot, held: float) -> None:
        """One step of ``slot``'s async handler held the event loop ``held`` seconds:
        renewals, the heartbeat and the other handlers waited for it. Logged once per
        attempt, counted every time (and a metric, through the event)."""
        self.counters.loop_held += 1
        job = slot.claimed.job
        if not slot.loop_held_said:
            slot.loop_held_said = True
            log.warning(
                "worker %s: job %s (%s): one step of its async handler held the event loop "
                "for %.1fs (unless the process was paused meanwhile); renewals, the heartbeat "
                "and the other jobs of this worker waited meanwhile, and their leases can "
                "expire. A blocking call (time.sleep, a sync driver, CPU-bound work) belongs in "
                "a sync handler or asyncio.to_thread",
                *(self.id, job.id, job.task, held),
            )
        if events.enabled():
            events.emit(events.LoopHeld(self.id, job.id, job.task, job.queue, held))

    async def _watchdog_loop(self) -> None:
        period = self._watchdog_period
        while True:
            await asyncio.sleep(period)
            self._last_tick = self.clock.monotonic()
            if self._waiting:
                if not self._stop_requested and not self._fencing:
                    self._promote()  # the adaptive limit may have grown since
                await self._give_back_overdue()
            self._abandon_overdue()
            if not self.settings.local_fencing or self.state is WorkerState.STOPPED:
                continue
            now = self.clock.monotonic()
            expired = [s.claimed.job.id for s in self._slots.values() if now >= s.valid_until]
            if expired:
                await self._lease_lost(
                    f"leases of jobs {expired} expired by the worker's own clock "
                    "(was the process paused or cut off?)",
                    own_clock=True,
                )

    def _abandon_overdue(self) -> None:
        """Abandon async handlers still running ``call_timeout`` after their hard timeout
        cancelled them: they caught the cancellation. Left to run, they would keep their
        job's lease renewed (and their worker's slot) for as long as they liked."""
        limit = self.clock.monotonic() - self.settings.call_timeout
        for slot in list(self._slots.values()):
            if slot.guarded and not slot.abandoned and slot.deadline <= limit:
                job = slot.claimed.job
                log.warning(
                    "worker %s: job %s (%s) ignored the cancellation of its hard timeout for "
                    "%gs; its handler is abandoned",
                    *(self.id, job.id, job.task, self.settings.call_timeout),
                )
                self._abandon(slot)

    def _abandon(self, slot: Slot) -> None:
        """Close ``slot``'s async handler at its next resumption, which this wakes."""
        slot.abandoned = True
        if slot.task is not None:
            slot.task.cancel(ABANDONED)

    async def _give_back_overdue(self) -> None:
        """Give back prefetched jobs that waited their patience (a renewal interval, at
        most 1 s under ``prefetch = "auto"``) for a slot: a long job must not hold the
        next one here while other workers are free."""
        patience = self._patience()
        limit = self.clock.monotonic() - patience
        overdue = [s for s in self._waiting if (s.waiting_since or 0.0) <= limit]
        if overdue:
            why = f"prefetched job waited {patience:g}s for a slot: not run"
            await self._give_back(overdue, why)

    @property
    def maintenance(self) -> MaintenanceRunner:
        """The worker's candidacy for maintenance leadership and the services it runs
        as leader (the rescuer and the reconciler unless given others)."""
        if self._maintenance is None:
            leadership = Leadership(
                self.store,
                owner=self.id,
                ttl=self.settings.lease_ttl,
                margin=self.settings.margin,
                clock=self.clock,
            )
            services = self._services
            if services is None:
                services = standard_services(self.store, self.settings, self.app)
            self._maintenance = MaintenanceRunner(
                leadership,
                services,
                renew_interval=self.settings.renew_period,
                may_lead=lambda: self.state not in (WorkerState.STOPPED, WorkerState.FENCED),
                on_report=self._maintenance_report,
            )
        return self._maintenance

    async def _watch_schedules(self) -> None:
        """Say, while another process leads maintenance, which of the app's periodic
        schedules it does not run (see ``maintenance/schedule_watch.py``). Never ends:
        a task of :meth:`run` that ends stops the worker."""
        settings = self.settings
        # Past this, a leader that runs a schedule would have enqueued its instant: two
        # leases (an election after a leader died) and a few scheduler passes.
        slack = 2 * settings.lease_ttl + 5 * settings.periodic_interval
        watch = ScheduleWatch(self.store, self.app.periodics, owner=self.id, slack=slack)
        while True:
            await asyncio.sleep(slack / 2)
            try:
                await watch.check()
            except Exception:  # a bug here must not stop the worker, which it only informs
                log.exception("worker %s: the watch over periodic schedules failed", self.id)

    async def maintenance_once(self) -> bool:
        """Stand for (or keep) maintenance leadership and, if leader, run every
        maintenance service once. Returns whether this worker was the leader."""
        return await self.maintenance.run_once() is not None

    def _maintenance_report(self, report: ServiceReport) -> None:
        if report.service != "rescuer":
            return
        requeued, dead = report.counts["requeued"], report.counts["dead"]
        self.counters.rescued += requeued + dead
        if requeued + dead and events.enabled():
            events.emit(events.JobsRescued(self.id, requeued, dead))


_FORK_HOOKED = False


def _forget_signals_in_forked_children() -> None:
    """Once per process: a child forked from a worker's process (a handler's
    ``os.fork``, ``multiprocessing`` with fork) leaves SIGTERM and SIGINT to their
    defaults and writes no signal to the worker's event loop. It kept the worker's:
    SIGTERM to the child was ignored by it, and woke the *worker*, which began to drain,
    through the signal pipe the two shared."""
    global _FORK_HOOKED
    if not _FORK_HOOKED:
        os.register_at_fork(after_in_child=_child_signals)
        _FORK_HOOKED = True


def _child_signals() -> None:
    # Each on its own: one that fails leaves the others to be done.
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _forked_child_returned(fn: Callable[..., object]) -> NoReturn:
    """A sync handler forked, and the child returned from it into the worker's thread
    pool, where it would wait for work for ever, a copy of the worker that no signal
    ends. It exits here."""
    with contextlib.suppress(Exception):
        name = getattr(fn, "__qualname__", repr(fn))
        os.write(
            2,
            f"tokenline: a child process forked by the handler {name} returned into the "
            f"worker; it exits (pid {os.getpid()}). A forked child must end with "
            "os._exit()\n".encode(),
        )
    os._exit(70)


def runs_alone(job: Job) -> bool:
    """Whether ``job`` runs with no other job beside it on its worker: its earlier
    attempts lost their lease, and one more such loss sends it to the dead-letter
    queue. Every job in flight on a worker that is killed, stalled or cut off loses its
    lease together; alone, a job's last one can be lost only by its own doing."""
    return job.lease_expiries >= max(1, job.max_lease_expiries - 1)


def _not_awaited(calls: list[str]) -> str | None:
    """What is wrong with an async handler that returned without awaiting ``calls``."""
    if not calls:
        return None
    names = ", ".join(dict.fromkeys(calls))
    return (
        f"called {names} without `await` ({len(calls)} time(s)), so what it asked for "
        "never happened: write `await ctx.effect(...)` / `await ctx.fenced(...)`"
    )


def _never_ran(result: object) -> str | None:
    """What is wrong with a handler's ``result`` that is work never started (a coroutine
    not awaited, a generator not iterated), closed here; None for any other result."""
    if inspect.iscoroutine(result) and inspect.getcoroutinestate(result) == "CORO_CREATED":
        result.close()  # else "coroutine was never awaited" at garbage collection
        return (
            "returned a coroutine without awaiting it, so its body never ran: declare the "
            "handler with `async def`, or await the coroutine in it"
        )
    if inspect.isgenerator(result) and inspect.getgeneratorstate(result) == "GEN_CREATED":
        result.close()
        return (
            "returned a generator, so its body never ran (a function with `yield` is a "
            "generator function): a handler runs to completion, it does not yield"
        )
    if inspect.isasyncgen(result):
        return (
            "returned an async generator, so its body never ran (an `async def` with "
            "`yield`): a handler runs to completion, it does not yield"
        )
    return None


class _RaisedInThread(Exception):
    """Carries a sync handler's ``BaseException`` (not an ``Exception``) to its task."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def _waited(job: Job) -> float:
    """Seconds from the moment ``job`` could run to its claim, both by the store's clock
    (the claim stamps ``updated_at``)."""
    return max(0.0, job.updated_at - job.run_at)
