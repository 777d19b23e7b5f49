"""Typed events from the core: one stream for logs, metrics and the dashboard.

The worker and the job context report what happens to coordination — a job starting
and finishing, a lease renewal refused, a stale commit, a duplicate execution, a view
found stale, the worker changing state — as small frozen records. Anything may listen::

    def on_event(event: tokenline.events.Event) -> None:
        if isinstance(event, tokenline.events.LeaseRenewalFailed):
            page_someone(event)

    tokenline.events.add_hook(on_event)

:class:`tokenline.metrics.WorkerMetrics` is such a hook. Hooks are per process and run
synchronously where the event happens, on the worker's event loop or a handler's
thread: keep them quick and non-blocking. A hook that raises is logged and never
disturbs the worker. With no hook registered, the core builds no event at all
(:func:`enabled` is checked first), so the stream costs nothing when nobody listens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BreakerChanged",
    "ConcurrencyLimitChanged",
    "CoordinationFailed",
    "DependencyCall",
    "DuplicateExecution",
    "Event",
    "Heartbeat",
    "Hook",
    "JobFinished",
    "JobStarted",
    "JobsRescued",
    "LeaderChanged",
    "LeaseRenewalFailed",
    "LoopHeld",
    "MaintenanceRepaired",
    "ResourceLeaseBusy",
    "StaleCommitRefused",
    "StaleRead",
    "WorkerStateChanged",
    "add_hook",
    "emit",
    "enabled",
    "remove_hook",
]

log = logging.getLogger("tokenline.events")


@dataclass(frozen=True, slots=True)
class Event:
    """Base of every event: the worker it happened in."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class WorkerStateChanged(Event):
    """The worker moved between READY, PROCESSING, DRAINING, FENCED and STOPPED."""

    old: str
    new: str
    reason: str


@dataclass(frozen=True, slots=True)
class JobStarted(Event):
    """An attempt began: the job was claimed and its handler is about to run."""

    job_id: int
    task: str
    queue: str
    attempt: int
    token: int
    #: Seconds from the moment the job could run to its claim, by the store's clock.
    waited: float


@dataclass(frozen=True, slots=True)
class JobFinished(Event):
    """An attempt's outcome was accepted by the store.

    ``outcome``: ``succeeded``, ``retry``, ``dead`` or ``release`` (given back, no
    attempt spent). A refused outcome is a :class:`StaleCommitRefused` instead.
    """

    job_id: int
    task: str
    queue: str
    attempt: int
    token: int
    outcome: str
    error_class: str | None
    #: Seconds the attempt ran, by the worker's monotonic clock.
    duration: float
    #: Seconds from the moment the job could run to its claim (store clock).
    waited: float


@dataclass(frozen=True, slots=True)
class LeaseRenewalFailed(Event):
    """A renewal of this worker's job leases failed.

    ``reason``: ``refused`` (the store no longer gives these jobs to this worker: they
    were rescued) or ``error`` (the store could not be reached in time).
    """

    jobs: int
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class StaleCommitRefused(Event):
    """The store refused a write carrying an old token: fencing at work."""

    job_id: int
    token: int
    operation: str


@dataclass(frozen=True, slots=True)
class Heartbeat(Event):
    """The worker renewed its membership.

    ``gap``: seconds since its previous successful heartbeat (monotonic clock);
    ``clock_skew``: its wall clock minus the store's, when measured.
    """

    gap: float
    clock_skew: float | None


@dataclass(frozen=True, slots=True)
class DuplicateExecution(Event):
    """A key's effect was asked for again after it had completed, or a write under it
    was refused as stale; the ledger recorded it."""

    job_id: int
    key: str
    kind: str


@dataclass(frozen=True, slots=True)
class StaleRead(Event):
    """What the worker kept in memory about shared state (``view``) disagreed with the
    store when the store was asked: the store won."""

    view: str
    detail: str


@dataclass(frozen=True, slots=True)
class LoopHeld(Event):
    """One step of an async handler (code between two ``await``\\ s) held the worker's
    event loop for ``seconds``, a watchdog period or longer: a blocking call in an async
    handler, or a pause of the process while it ran. Renewals, the heartbeat and the
    worker's other jobs waited meanwhile."""

    job_id: int
    task: str
    queue: str
    seconds: float


@dataclass(frozen=True, slots=True)
class JobsRescued(Event):
    """As maintenance leader, the worker rescued jobs whose leases had expired."""

    requeued: int
    dead: int


@dataclass(frozen=True, slots=True)
class MaintenanceRepaired(Event):
    """As maintenance leader, a service repaired ``count`` things of one ``kind``
    (``requeued`` by the rescuer, ``effect_pending_expired`` by the reconciler, …)."""

    service: str
    kind: str
    count: int


@dataclass(frozen=True, slots=True)
class LeaderChanged(Event):
    """This process became maintenance leader (``term``), or stopped being (``None``)."""

    term: int | None


@dataclass(frozen=True, slots=True)
class ResourceLeaseBusy(Event):
    """A resource lease (``ctx.lease``) was held by someone else: contention."""

    resource: str


@dataclass(frozen=True, slots=True)
class CoordinationFailed(Event):
    """A store call of one role (``channel``: broker, leases or ledger) failed or timed
    out."""

    channel: str
    operation: str
    error: str


@dataclass(frozen=True, slots=True)
class ConcurrencyLimitChanged(Event):
    """The worker's adaptive limit of jobs run at once moved from ``old`` to ``new``."""

    old: int
    new: int


@dataclass(frozen=True, slots=True)
class DependencyCall(Event):
    """A call to a named dependency (``ctx.dependency``) ended, or was not made.

    ``outcome``: ``ok``, ``failed``, ``slow`` (succeeded past its ``slow_call``),
    ``timeout`` (ran past its ``timeout``) or ``rejected`` (its circuit breaker held it
    back, or a job that needs it was deferred); ``seconds``: how long it ran (0 when
    rejected).
    """

    dependency: str
    outcome: str
    seconds: float


@dataclass(frozen=True, slots=True)
class BreakerChanged(Event):
    """The worker's circuit breaker of a dependency moved between ``closed``, ``open``
    and ``half_open`` (by its own calls, or following the breaker shared in the store)."""

    dependency: str
    old: str
    new: str


#: A listener: called with every event, synchronously.
Hook = Callable[[Event], None]

_hooks: tuple[Hook, ...] = ()
_lock = threading.Lock()


def add_hook(hook: Hook) -> None:
    """Call ``hook`` with every event of this process (once, however often added)."""
    global _hooks
    with _lock:
        if hook not in _hooks:
            _hooks = (*_hooks, hook)


def remove_hook(hook: Hook) -> None:
    """Stop calling ``hook``; a hook that was never added is ignored."""
    global _hooks
    with _lock:
        _hooks = tuple(h for h in _hooks if h != hook)  # ==: bound methods are rebuilt


def enabled() -> bool:
    """Whether any hook listens: check before building an event."""
    return bool(_hooks)


def emit(event: Event) -> None:
    """Give ``event`` to every hook. A hook's error is logged, never raised: observing
    the worker must not change what it does."""
    for hook in _hooks:  # a tuple, replaced whole: safe against concurrent changes
        try:
            hook(event)
        except Exception:
            log.exception("event hook %r failed on %s", hook, type(event).__name__)
