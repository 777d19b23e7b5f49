"""Job value objects, the limits of what a job may hold, and the job state machine.

::

    scheduled ──► queued ──► running ──► succeeded
        │  ▲         │         │  │
        │  └─────────┼─────────┘  ├────► dead ──(operator: dlq retry)──► queued
        │            │  retry /   │
        │            │  release   └────► cancelled
        └────────────┴──────────────────► cancelled

States only move along these arrows, and the store enforces it: every transition is a
conditional update (``WHERE state = …``), so a ``succeeded`` or ``dead`` job never goes
back to ``running`` whatever a stale worker sends. ``scheduled`` is a job whose
``run_at`` lies in the future (delayed, or waiting for a retry); a claim takes
``scheduled`` and ``queued`` jobs whose ``run_at`` has come.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._config import validate_queue_name

__all__ = [
    "ALLOWED_TRANSITIONS",
    "LEASE_EXPIRED",
    "MAX_ATTEMPTS",
    "MAX_DELAY",
    "MAX_ERROR_LENGTH",
    "MAX_INT_DIGITS",
    "MAX_PAYLOAD_DEPTH",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Attempt",
    "ClaimedJob",
    "Finish",
    "Job",
    "JobState",
    "Lease",
    "NewJob",
    "Outcome",
    "QueueStats",
    "Rescue",
    "RescueCandidate",
    "RescueReport",
    "StaleCommit",
    "Transition",
    "Unique",
    "WorkerRecord",
    "attempts_problem",
    "can_transition",
    "check_queue_name",
    "claim_key",
    "describe",
    "effective_priority",
    "error_text",
    "exception_text",
    "finish_transition",
    "priority_problem",
    "renewal_was_stale",
    "rescue_transition",
    "run_at_problem",
    "seconds_problem",
]


def error_text(text: str) -> str:
    """``text`` as every store can keep it: NUL characters (which PostgreSQL refuses)
    and lone surrogates (which no store can encode) written as backslash escapes, and
    cut to :data:`MAX_ERROR_LENGTH` characters, saying how long it was.

    Error texts come from exceptions raised by user code. Refused by the store, one
    would fail the commit of its job on every try: the job would run again and again,
    and a worker at one job at a time would run nothing else."""
    if not isinstance(text, str):  # a user classifier's reason may be anything
        text = describe(text, MAX_ERROR_LENGTH)
    if not text.isascii() or "\x00" in text:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        text = text.replace("\x00", "\\x00")
    if len(text) > MAX_ERROR_LENGTH:
        cut = f"… ({len(text)} characters)"
        text = text[: MAX_ERROR_LENGTH - len(cut)] + cut
    return text


def exception_text(exc: BaseException, *, with_type: bool = True) -> str:
    """``Type: message`` of ``exc`` (``Type`` alone when it has no message; the message
    alone without ``with_type``), never failing itself: ``__str__`` is user code too,
    and one that raises must not keep a failed job from being recorded."""
    try:
        text = str(exc)
    except Exception:
        text = "<str() of the exception raised>"
    if not with_type:
        return text
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def describe(value: object, limit: int = 60) -> str:
    """``repr(value)`` for an error message: shortened, and never failing itself."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__, or one nested too deep to print
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else f"{text[:limit]}…"


# -- limits of what a job may hold ------------------------------------------------------------
# Every store holds every job within these limits, and every display can show it: bad
# input is refused at enqueue, before anything is stored (see App.build_job).

#: Longest ``delay``, ``unique_for`` and task ``timeout``, and the furthest ``run_at``
#: may lie ahead of now: 100 years (of 365.25 days), in seconds.
MAX_DELAY = 3_155_760_000
#: Lowest and highest job priority: the range of PostgreSQL's ``integer`` column.
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
#: Highest ``max_attempts`` and ``max_lease_expiries`` (the same column type).
MAX_ATTEMPTS = 2**31 - 1
#: Deepest nesting of lists and objects inside one argument: a JSON decoder (the
#: worker's among them) fails on payloads nested far deeper.
MAX_PAYLOAD_DEPTH = 100
#: Most decimal digits of an integer argument; Python's own limit on converting an
#: integer to or from text (4300 by default) would otherwise decide per process.
MAX_INT_DIGITS = 4000
#: Longest error text a store keeps for a job's attempt or an effect, in characters:
#: an exception's message is the user's, and may be megabytes long.
MAX_ERROR_LENGTH = 2000


def _integer_problem(value: object, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, got {describe(value)}"
    if not low <= value <= high:
        return f"must be between {low} and {high}, got {describe(value)}"
    return None


def priority_problem(value: object) -> str | None:
    """Why ``value`` is no job priority (an int from MIN_PRIORITY to MAX_PRIORITY)."""
    return _integer_problem(value, MIN_PRIORITY, MAX_PRIORITY)


def attempts_problem(value: object) -> str | None:
    """Why ``value`` is no ``max_attempts`` / ``max_lease_expiries`` (1 to MAX_ATTEMPTS)."""
    return _integer_problem(value, 1, MAX_ATTEMPTS)


def seconds_problem(value: object, *, zero: bool) -> str | None:
    """Why ``value`` is no duration: a finite number of seconds, at most MAX_DELAY,
    and above 0 (or, with ``zero``, at least 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number of seconds, got {describe(value)}"
    if isinstance(value, float) and math.isnan(value):
        return "must be a number of seconds, got nan"
    if value < 0 or (value == 0 and not zero):
        return f"must be {'>=' if zero else '>'} 0 seconds, got {describe(value)}"
    if value > MAX_DELAY:
        return f"must be at most {MAX_DELAY} seconds (100 years, MAX_DELAY), got {describe(value)}"
    return None


def run_at_problem(value: object, now: float) -> str | None:
    """Why ``value`` is no ``run_at``: a UTC timestamp in epoch seconds from 0 to
    ``now`` + MAX_DELAY."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a UTC timestamp in epoch seconds, got {describe(value)}"
    if isinstance(value, float) and math.isnan(value):
        return "must be a UTC timestamp in epoch seconds, got nan"
    if value < 0:
        return f"must be a UTC timestamp >= 0 (1970-01-01), got {describe(value)}"
    if value > now + MAX_DELAY:
        return (
            f"must be at most {MAX_DELAY} seconds (100 years, MAX_DELAY) after now, "
            f"got {describe(value)}"
        )
    return None


def check_queue_name(name: object) -> str:
    """Return ``name`` if it is a valid queue name, else raise :class:`QueueNameError`.

    The whole name must match: a trailing newline is no more a queue name than any other
    control character.
    """
    return validate_queue_name(name)


class JobState(enum.StrEnum):
    """Where a job is in its life."""

    SCHEDULED = "scheduled"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True for states a worker can never take the job out of."""
        return self in (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)


ALLOWED_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.SCHEDULED: frozenset({JobState.QUEUED, JobState.RUNNING, JobState.CANCELLED}),
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.DEAD, JobState.QUEUED, JobState.SCHEDULED}
    ),
    JobState.SUCCEEDED: frozenset(),
    # Only an operator's explicit dead-letter retry revives a dead job, and it goes to
    # queued, never straight to running.
    JobState.DEAD: frozenset({JobState.QUEUED, JobState.CANCELLED}),
    JobState.CANCELLED: frozenset(),
}


def can_transition(src: JobState, dst: JobState) -> bool:
    """Whether the job state machine allows ``src`` → ``dst``."""
    return dst in ALLOWED_TRANSITIONS[src]


class Unique(enum.StrEnum):
    """How long a unique job's idempotency key keeps a second job out.

    The key is held by the job that took it; an enqueue of the same key while it is held
    returns that job's id instead of inserting. ``unique_for`` (seconds, by the store's
    clock) ends the hold early in both modes.
    """

    ALWAYS = "always"  # held for good (or until unique_for runs out)
    ACTIVE = "active"  # held until the job is finished: succeeded, dead or cancelled


@dataclass(frozen=True, slots=True)
class NewJob:
    """A validated job ready to be inserted by a store."""

    queue: str
    task: str
    args: str  # JSON text: the core validates and encodes, stores only copy it
    idempotency_key: str | None = None
    priority: int = 0
    #: An absolute time the user asked for (epoch seconds, compared with the store's
    #: clock); ``None``: ``delay`` seconds after the store's now.
    run_at: float | None = None
    #: Seconds after the store's now; a duration, so the enqueuer's clock never matters.
    delay: float | None = None
    max_attempts: int = 5
    timeout: float | None = None
    #: Lease expiries (lost workers) before the job goes dead; not attempts.
    max_lease_expiries: int = 3
    #: Enqueue as a unique job: its idempotency key keeps a second job out (see Unique).
    unique: Unique | None = None
    #: With ``unique``: the hold ends this many seconds after the job was enqueued.
    unique_for: float | None = None


@dataclass(frozen=True, slots=True)
class Lease:
    """Proof of ownership of a job: present it on every renewal and commit."""

    job_id: int
    owner: str
    token: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the store holds it."""

    id: int
    queue: str
    task: str
    args: str
    idempotency_key: str | None
    priority: int
    run_at: float
    attempt: int
    max_attempts: int
    state: JobState
    lease_owner: str | None
    lease_token: int
    lease_expires_at: float | None
    last_error: str | None
    error_class: str | None
    created_at: float
    updated_at: float
    finished_at: float | None
    timeout: float | None
    #: Times a worker lost this job's lease (it crashed, was killed, paused or cut off).
    lease_expiries: int = 0
    #: Lease expiries after which the job goes dead.
    max_lease_expiries: int = 3


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job handed to a worker together with its fresh lease."""

    job: Job
    lease: Lease


class Outcome(enum.StrEnum):
    """How an attempt ends, as sent to :meth:`Store.jobs_finish`."""

    SUCCEEDED = "succeeded"  # → succeeded
    RETRY = "retry"  # → scheduled/queued at run_at; the attempt is burned
    DEAD = "dead"  # → dead, with the reason
    RELEASE = "release"  # → queued/scheduled at run_at; the attempt is given back


@dataclass(frozen=True, slots=True)
class Finish:
    """One finalising write, conditional on the lease's token inside the store.

    ``delay`` (retry and release) is a duration: the store runs the job again that many
    seconds after its own now, so a worker's wall clock never decides when.
    """

    lease: Lease
    outcome: Outcome
    delay: float | None = None
    error: str | None = None
    error_class: str | None = None

    def __post_init__(self) -> None:
        # Here, once, for every store and every path that ends an attempt.
        if self.error is not None:
            object.__setattr__(self, "error", error_text(self.error))


@dataclass(frozen=True, slots=True)
class Transition:
    """What a store does to a job row when it accepts a :class:`Finish`.

    Decided here, once, for every store; the store only applies it under the token
    check (``run_at`` = its now + ``delay`` when ``delay`` is not ``None``).
    """

    state: JobState
    #: Seconds after the store's now to run again; ``None`` keeps ``run_at``.
    delay: float | None
    #: Attempts given back: 1 when the job was put aside rather than failed.
    refund: int
    #: Whether ``finished_at`` is set (a final state).
    finished: bool


def finish_transition(fin: Finish) -> Transition:
    """The one rule mapping an attempt's outcome to the job's next state.

    A retry or release waits at most :data:`MAX_DELAY`, like an enqueue: ``Retry`` and
    ``Decision`` refuse a longer delay when made, and this bound holds it for every
    other path too, so no store holds a time past that.
    """
    if fin.outcome is Outcome.SUCCEEDED:
        return Transition(JobState.SUCCEEDED, None, 0, True)
    if fin.outcome is Outcome.DEAD:
        return Transition(JobState.DEAD, None, 0, True)
    delay = min(max(0.0, fin.delay or 0.0), MAX_DELAY)
    state = JobState.SCHEDULED if delay > 0 else JobState.QUEUED
    # A release gives the attempt back: the job did not fail, it was put aside.
    return Transition(state, delay, 1 if fin.outcome is Outcome.RELEASE else 0, False)


# -- the order of a claim -------------------------------------------------------------------
def effective_priority(priority: int, run_at: float, now: float, aging: float | None) -> int:
    """A runnable job's priority as a claim ranks it: one point more per ``aging``
    seconds since its ``run_at``, by the store's clock (``now``); ``None``: no aging.

    Whole points only: a job that has waited less than ``aging`` keeps its own
    priority, so jobs enqueued together keep the order their priorities give them,
    while one left waiting climbs, and no stream of higher-priority work starves it.
    """
    if aging is None or run_at >= now:
        return priority
    return priority + math.floor((now - run_at) / aging)


def claim_key(
    priority: int, run_at: float, job_id: int, now: float, aging: float | None
) -> tuple[int, float, int]:
    """Sort key of a claim, the same in every store: highest effective priority first
    (see :func:`effective_priority`), then oldest ``run_at``, then lowest id.

    A rescued job keeps its ``run_at``, so it keeps its place, and the priority its
    wait has earned.
    """
    return (-effective_priority(priority, run_at, now, aging), run_at, job_id)


def renewal_was_stale(
    holder_token: int | None, holder_owner: str | None, token: int, owner: str
) -> bool:
    """Whether a refused renewal of ``(token, owner)`` was a stale write — someone else's
    token or owner holds the lease now — rather than a lease that merely expired, or one
    its own owner finished (owner cleared, token unchanged). No record of the lease at
    all: nothing can be said, so not stale. The one rule every store records by."""
    if holder_token is None:
        return False
    return holder_token != token or (holder_owner is not None and holder_owner != owner)


#: The reason a rescued attempt ends with.
LEASE_EXPIRED = "lease expired: the worker stopped renewing it"


@dataclass(frozen=True, slots=True)
class RescueCandidate:
    """A running job whose lease has expired by the store's clock."""

    job_id: int
    token: int
    owner: str | None
    attempt: int
    max_attempts: int
    lease_expiries: int = 0
    max_lease_expiries: int = 3


@dataclass(frozen=True, slots=True)
class Rescue:
    """What a rescue does to one job: the transition, and the reason it records."""

    transition: Transition
    reason: str


def rescue_transition(c: RescueCandidate) -> Rescue:
    """The one rule for a job whose worker lost its lease.

    A lost lease is not the job's failure, so the attempt is given back; it counts
    toward ``max_lease_expiries`` instead. Below that limit the job goes back to the
    queue at once, *in its place*: its ``run_at`` is kept, so it runs before the jobs
    queued after it (of its priority), not behind a backlog that built up while its
    worker was dying. At the limit it goes dead — a job that kills every worker that
    runs it (a poison job) must not loop forever.
    """
    expiries = c.lease_expiries + 1
    if expiries >= c.max_lease_expiries:
        reason = (
            f"the worker lost its lease {expiries} times (max_lease_expiries "
            f"{c.max_lease_expiries}; last holder {c.owner or 'unknown'}): its worker "
            "crashed, stalled or was cut off during each of those attempts"
        )
        return Rescue(Transition(JobState.DEAD, None, 1, True), reason)
    reason = (
        f"{LEASE_EXPIRED} (lease expiry {expiries} of {c.max_lease_expiries}; "
        "the attempt is given back)"
    )
    return Rescue(Transition(JobState.QUEUED, None, 1, False), reason)


@dataclass(frozen=True, slots=True)
class Attempt:
    """One execution attempt of a job, as recorded by the store."""

    job_id: int
    attempt: int
    token: int
    owner: str
    started_at: float
    finished_at: float | None
    outcome: str | None
    error: str | None
    error_class: str | None


@dataclass(frozen=True, slots=True)
class StaleCommit:
    """A write the store refused because its token was stale."""

    job_id: int
    token: int
    owner: str
    operation: str
    at: float


@dataclass(frozen=True, slots=True)
class RescueReport:
    """What one rescue pass did with jobs whose lease had expired."""

    requeued: Sequence[int] = ()
    dead: Sequence[int] = ()
    #: (job id, token) of each attempt rescued, where a store reports them (Redis: the
    #: split topology ends those attempts' sessions on its ledger).
    attempts: Sequence[tuple[int, int]] = ()


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counts per state and the age of the oldest ready job, for one queue."""

    queue: str
    counts: Mapping[str, int] = field(default_factory=dict)
    oldest_ready_age: float | None = None
    paused: bool = False

    def count(self, state: JobState) -> int:
        """Jobs in ``state``."""
        return int(self.counts.get(state.value, 0))


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker's membership row: who it is, its state and its lease."""

    id: str
    host: str
    pid: int
    queues: tuple[str, ...]
    concurrency: int
    state: str
    token: int
    started_at: float
    heartbeat_at: float
    expires_at: float
    in_flight: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: The worker's wall clock minus the store's, in seconds, as the worker measured it.
    clock_skew: float | None = None
    #: An operator asked this membership to drain (``tokenline drain``); the worker
    #: reads it from its heartbeat. A new registration starts without it.
    drain_requested: bool = False
    #: The worker's adaptive concurrency limit (from ``concurrency_floor`` to
    #: ``concurrency``), as it last reported it; ``None`` until it has.
    concurrency_limit: int | None = None
