"""One exception tree for everything tokenline raises.

Every backend translates its driver's errors (``sqlite3``, ``psycopg``, ``redis``) into
this tree at its boundary, so callers never catch a driver exception::

    TokenlineError
    ├── ConfigError                 an invalid setting; names the setting and why
    ├── InvalidInputError           bad input from a caller; nothing was stored
    │   ├── UnknownTaskError        no task registered under that name
    │   ├── PayloadError            args not JSON, or larger than the limit
    │   └── QueueNameError          a queue name outside [A-Za-z0-9_.:-]{1,64}
    ├── JobNotFoundError            no job with that id
    ├── NotSupportedError           the store lacks a capability
    ├── EffectPendingError          another live attempt is running the effect of that key
    ├── LeaseBusyError              the resource lease is held by someone else
    ├── DependencyOpenError         a dependency's circuit breaker is open: not called
    ├── StoreError                  the store failed
    │   ├── StoreUnavailableError   cannot reach it / timed out (coordination)
    │   ├── StoreCorruptError       the file or schema is damaged
    │   └── SchemaVersionError      the schema is older or newer than this code
    └── FencedError                 ownership lost: nothing may be committed
        ├── StaleTokenError         the store refused a commit from an older token
        └── LeaseExpiredError       the worker's own clock says its lease is gone

Handlers steer retries with two signals that are not errors of tokenline itself:
``Retry(delay)`` and ``Permanent(reason)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._redact import redact

__all__ = [
    "ConfigError",
    "DependencyOpenError",
    "EffectPendingError",
    "FencedError",
    "InvalidInputError",
    "JobCancelled",
    "JobNotFoundError",
    "LeaseBusyError",
    "LeaseExpiredError",
    "NotSupportedError",
    "OutcomeUnknownError",
    "PayloadError",
    "Permanent",
    "QueueNameError",
    "Retry",
    "SchemaVersionError",
    "StaleTokenError",
    "StoreCorruptError",
    "StoreError",
    "StoreUnavailableError",
    "TokenlineError",
    "UnknownTaskError",
]


class TokenlineError(Exception):
    """Base class of every error tokenline raises."""

    def __str__(self) -> str:
        # A message may quote a store URL, and a URL may carry a password: the text of
        # every tokenline error shows it as *** (see _redact.py).
        return redact(super().__str__())


class ConfigError(TokenlineError, ValueError):
    """A setting is invalid; the message names the setting and the reason."""

    def __init__(self, setting: str, reason: str) -> None:
        self.setting = setting
        self.reason = reason
        super().__init__(f"invalid setting {setting!r}: {reason}")


class InvalidInputError(TokenlineError, ValueError):
    """Input from a caller was rejected before anything was stored."""


class UnknownTaskError(InvalidInputError):
    """No task is registered under the given name."""


class PayloadError(InvalidInputError):
    """Job arguments are not JSON-serialisable or exceed the size limit."""


class QueueNameError(InvalidInputError):
    """A queue name is empty, too long or has characters outside ``[A-Za-z0-9_.:-]``."""


class JobNotFoundError(TokenlineError, LookupError):
    """No job exists with the given id."""


class NotSupportedError(TokenlineError):
    """The configured store lacks the capability an operation needs."""


class EffectPendingError(TokenlineError):
    """The effect's key is pending under another attempt whose lease is still live.

    Raised by ``ctx.effect`` once its ``wait`` is over. It is not a fencing error, nor
    a fault of the job: it is given back, no attempt spent (coordination), to run again
    after the retry policy's delay, by when the other attempt has finished the effect
    or lost its lease.
    """


class LeaseBusyError(TokenlineError):
    """Another holder kept the resource lease for the whole of ``ctx.lease``'s ``wait``.

    Contention, not a fault of the job: it is given back, no attempt spent
    (coordination), to run again after the retry policy's delay."""


class DependencyOpenError(TokenlineError):
    """A named dependency's circuit breaker did not let the call through: it is open,
    or half-open with another worker trying it.

    Not the job's fault, and no failure of the dependency either (it was not called):
    the worker gives the job back without spending an attempt, to run again after
    ``retry_after`` seconds, and neither its concurrency limit nor its error rate
    counts it. ``state``: ``open`` or ``half_open``.
    """

    def __init__(self, dependency: str, *, retry_after: float, state: str = "open") -> None:
        self.dependency = dependency
        self.retry_after = retry_after
        self.state = state
        how = "open" if state == "open" else "being tried by another worker"
        super().__init__(
            f"dependency {dependency!r} is {how}: not called; the job waits {retry_after:.1f}s"
        )


class StoreError(TokenlineError):
    """The store failed to carry out an operation."""

    #: The kind of server that failed (``"PostgreSQL"``, ``"Redis"``, ``"SQLite"``),
    #: where the store knows it: on the split topology it says which role failed.
    server: str | None = None
    #: Whether the store is known to have changed nothing (the server refused the
    #: request whole): an operator's command then does not say it may have.
    changed_nothing: bool = False


class StoreUnavailableError(StoreError):
    """The store cannot be reached, or did not answer within its timeout.

    For a worker this is a *coordination* failure: it stops fetching (DRAINING) and
    retries later; no job attempt is burned.
    """


class OutcomeUnknownError(StoreUnavailableError):
    """A write reached the store, or may have, and its answer was lost (the connection
    dropped, or the store did not answer in time): it may have been made all the same.

    Raised by an enqueue whose request was sent: the job may exist. Enqueue it again
    with an ``idempotency_key`` and ``unique=True`` (or ``"active"``), and the store
    answers with the id of the job it made, if it did, instead of making a second one.
    """


@contextlib.contextmanager
def from_server(server: str) -> Iterator[None]:
    """Mark the :class:`StoreError` raised inside as ``server``'s, unless it already
    names one (raised by a store nested inside)."""
    try:
        yield
    except StoreError as exc:
        if exc.server is None:
            exc.server = server
        raise


def enqueue_outcome_unknown(exc: StoreUnavailableError, jobs: int) -> OutcomeUnknownError:
    """``exc``, raised once an enqueue of ``jobs`` jobs was sent, saying what it means."""
    if isinstance(exc, OutcomeUnknownError):
        return exc
    what, it = ("the job", "it") if jobs == 1 else (f"the {jobs:,} jobs", "each")
    return OutcomeUnknownError(
        f"{exc}; {what} may have been enqueued all the same (the request may have reached "
        f"the store before its answer was lost). To enqueue again without risking a second "
        f"job, give {it} an idempotency_key with unique=True"
    )


class StoreCorruptError(StoreError):
    """The store's file or schema is damaged or is not a tokenline store."""


class SchemaVersionError(StoreError):
    """The store's schema version differs from the one this code expects."""


class FencedError(TokenlineError):
    """Ownership of a job or resource is lost; nothing may be committed under it."""

    #: The resource lease (``ctx.lease``) this loss is about, or ``None`` when it is the
    #: job's own lease. Losing a resource lease ends the attempt that held it; losing a
    #: job lease fences the whole worker, whose other leases may be just as stale.
    held_resource: str | None = None


class StaleTokenError(FencedError):
    """The store refused a write because a newer fencing token has been issued.

    Attributes name the job (or resource), the token presented and the operation.
    """

    def __init__(self, *, resource: str, token: int, operation: str) -> None:
        self.resource = resource
        self.token = token
        self.operation = operation
        super().__init__(
            f"{operation} refused for {resource}: token {token} is stale "
            "(a newer owner holds it, or it has already finished)"
        )


class LeaseExpiredError(FencedError):
    """The worker's own monotonic clock says its lease may have expired.

    Raised before a commit is even attempted, so a paused or cut-off worker does no
    pointless work; the store-side token check remains the guarantee.
    """


class JobCancelled(FencedError):
    """The worker cancelled this job (fenced, force-stopped or timed out).

    Sync handlers see it from any ``ctx`` call once the cancellation flag is set.
    """


class Retry(Exception):
    """Raise from a handler to retry the job after ``delay`` seconds.

    The retry burns an attempt; once ``max_attempts`` is reached the job goes dead.
    ``delay`` is checked like an enqueue's: a number of seconds from 0 to ``MAX_DELAY``
    (not a bool, a string, NaN or infinity), else :class:`InvalidInputError` here,
    which fails the job as permanent with that message.
    """

    def __init__(self, delay: float | None = None, reason: str = "retry requested") -> None:
        if delay is not None:
            # Imported here: _jobs imports this module.
            from ._jobs import seconds_problem

            if (problem := seconds_problem(delay, zero=True)) is not None:
                raise InvalidInputError(f"Retry delay {problem}")
        self.delay = delay
        self.reason = reason
        super().__init__(reason)


class Permanent(Exception):
    """Raise from a handler to dead-letter the job at once, with ``reason``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)
