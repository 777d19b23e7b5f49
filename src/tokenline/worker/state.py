"""The worker state machine, as a pure transition table.

::

                 job started                      all jobs done
        ┌──────────────────────────┐   ┌────────────────────────────────┐
        │                          ▼   │                                │
      READY ◄───────────────── PROCESSING ──────────────────────────────┘
      │ ▲  \\  coordination healthy  │   │
      │ │   \\                       │   │ lease lost / stale commit
      │ │    └──► DRAINING ◄─────────┘   ▼
      │ │ coordination  │  unhealthy   FENCED ──── re-registered ───► READY
      │ │ healthy ──────┘    shutdown    │
      │ └──────── re-registered ─────────┘
      │                 │
      └── shutdown ─────┴──► (DRAINING) ── drained / drain timeout ──► STOPPED

* READY: may fetch new jobs.
* PROCESSING: running jobs; may still fetch while below its concurrency limit.
* DRAINING: fetches nothing new; finishes in-flight jobs that can still be committed.
  Entered when coordination (the store) is unhealthy, or on shutdown.
* FENCED: lost its lease or ownership; in-flight handlers are cancelled and nothing
  that needs ownership is committed. Leaves by re-registering with a fresh lease.
* STOPPED: exited. A second shutdown request (or FORCE_STOP) gets here from anywhere.

The safety argument lives in the store (every commit is conditional on the token); this
machine makes a worker that *knows* it may have lost ownership stop working early
instead of being refused at the end.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from .._errors import TokenlineError

__all__ = ["TRANSITIONS", "InvalidTransitionError", "WorkerEvent", "WorkerState", "next_state"]


class WorkerState(enum.StrEnum):
    """What a worker is doing, as shown in metrics, logs and the CLI."""

    READY = "ready"
    PROCESSING = "processing"
    DRAINING = "draining"
    FENCED = "fenced"
    STOPPED = "stopped"

    @property
    def may_fetch(self) -> bool:
        """Whether a worker in this state may claim new jobs."""
        return self in (WorkerState.READY, WorkerState.PROCESSING)


class WorkerEvent(enum.StrEnum):
    """Things that happen to a worker."""

    JOB_STARTED = "job_started"
    ALL_JOBS_DONE = "all_jobs_done"
    COORDINATION_UNHEALTHY = "coordination_unhealthy"
    COORDINATION_HEALTHY = "coordination_healthy"
    LEASE_LOST = "lease_lost"
    REREGISTERED = "reregistered"
    SHUTDOWN = "shutdown"
    DRAINED = "drained"
    DRAIN_TIMEOUT = "drain_timeout"
    FORCE_STOP = "force_stop"


class InvalidTransitionError(TokenlineError):
    """An event that the worker state machine does not accept in the current state."""


S, E = WorkerState, WorkerEvent

#: Every allowed (state, event) pair and where it leads. Anything else is a bug.
TRANSITIONS: Mapping[tuple[WorkerState, WorkerEvent], WorkerState] = {
    (S.READY, E.JOB_STARTED): S.PROCESSING,
    (S.READY, E.COORDINATION_UNHEALTHY): S.DRAINING,
    (S.READY, E.COORDINATION_HEALTHY): S.READY,
    (S.READY, E.LEASE_LOST): S.FENCED,
    (S.READY, E.SHUTDOWN): S.DRAINING,
    (S.READY, E.FORCE_STOP): S.STOPPED,
    (S.PROCESSING, E.JOB_STARTED): S.PROCESSING,
    (S.PROCESSING, E.ALL_JOBS_DONE): S.READY,
    (S.PROCESSING, E.COORDINATION_UNHEALTHY): S.DRAINING,
    (S.PROCESSING, E.COORDINATION_HEALTHY): S.PROCESSING,
    (S.PROCESSING, E.LEASE_LOST): S.FENCED,
    (S.PROCESSING, E.SHUTDOWN): S.DRAINING,
    (S.PROCESSING, E.FORCE_STOP): S.STOPPED,
    (S.DRAINING, E.ALL_JOBS_DONE): S.DRAINING,
    (S.DRAINING, E.COORDINATION_UNHEALTHY): S.DRAINING,
    (S.DRAINING, E.COORDINATION_HEALTHY): S.READY,
    (S.DRAINING, E.LEASE_LOST): S.FENCED,
    (S.DRAINING, E.SHUTDOWN): S.DRAINING,
    (S.DRAINING, E.DRAINED): S.STOPPED,
    (S.DRAINING, E.DRAIN_TIMEOUT): S.STOPPED,
    (S.DRAINING, E.FORCE_STOP): S.STOPPED,
    (S.FENCED, E.LEASE_LOST): S.FENCED,
    (S.FENCED, E.ALL_JOBS_DONE): S.FENCED,
    (S.FENCED, E.COORDINATION_UNHEALTHY): S.FENCED,
    (S.FENCED, E.REREGISTERED): S.READY,
    (S.FENCED, E.SHUTDOWN): S.STOPPED,
    (S.FENCED, E.FORCE_STOP): S.STOPPED,
    (S.STOPPED, E.FORCE_STOP): S.STOPPED,
    (S.STOPPED, E.SHUTDOWN): S.STOPPED,
}


def next_state(state: WorkerState, event: WorkerEvent) -> WorkerState:
    """The state after ``event`` in ``state``; raise if the pair is not in the table."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransitionError(
            f"worker cannot handle {event.value} while {state.value}"
        ) from None
