"""Error classification: what happens after a handler fails.

=============  ===========================================  ==============================
class          examples                                     action
=============  ===========================================  ==============================
transient      timeouts, connection resets, unknown errors  retry with backoff, then dead
permanent      ``Permanent``, bad arguments (``TypeError``), dead at once, with the reason
               invalid input (``InvalidInputError``), an
               API used wrongly (``NotSupportedError``,
               ``ConfigError``), a database error the
               same statement meets every time (SQL
               errors, see :func:`sql_fault`)
coordination   lease lost, store unreachable, cancelled,    no ack, no attempt burned
               a dependency's breaker open                  (a breaker: after its delay)
               (``DependencyOpenError``), another live
               attempt holding what it waited for (a
               resource lease: ``LeaseBusyError``; an
               effect key: ``EffectPendingError``)
=============  ===========================================  ==============================

A user classifier runs first; returning ``None`` falls through to the defaults.
"""

from __future__ import annotations

import enum
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import (
    ConfigError,
    DependencyOpenError,
    EffectPendingError,
    FencedError,
    InvalidInputError,
    LeaseBusyError,
    NotSupportedError,
    Permanent,
    Retry,
    SchemaVersionError,
    StoreCorruptError,
    StoreUnavailableError,
)
from ._jobs import describe, exception_text, seconds_problem

__all__ = ["Classifier", "Decision", "ErrorClass", "classify", "delay_problem", "sql_fault"]


class ErrorClass(enum.StrEnum):
    """The three kinds of failure, each with its own handling."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"
    COORDINATION = "coordination"


@dataclass(frozen=True, slots=True)
class Decision:
    """The class of a failure, and an explicit retry delay when the handler gave one.

    ``delay`` is checked like an enqueue's (seconds from 0 to ``MAX_DELAY``, a number),
    and ``error_class`` must be an :class:`ErrorClass`: else :class:`InvalidInputError`
    here, in the classifier that built it, which the worker logs as a classifier failure.
    """

    error_class: ErrorClass
    reason: str
    delay: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.error_class, ErrorClass):
            raise InvalidInputError(
                f"Decision error_class must be an ErrorClass, got {describe(self.error_class)}"
            )
        if (problem := delay_problem(self.delay)) is not None:
            raise InvalidInputError(f"Decision delay {problem}")


def delay_problem(delay: object) -> str | None:
    """Why ``delay`` is no retry delay (``None``, or seconds from 0 to ``MAX_DELAY``)."""
    return None if delay is None else seconds_problem(delay, zero=True)


#: A user classifier: return an :class:`ErrorClass` (or a :class:`Decision`) to decide,
#: or ``None`` to fall back on the defaults.
Classifier = Callable[[BaseException], "ErrorClass | Decision | None"]


#: SQLSTATE classes of the errors a statement meets every time it runs, whatever the
#: load: 0A feature not supported, 21 cardinality violation, 22 data exception (bad
#: input syntax, division by zero, out of range), 23 integrity constraint violation,
#: 42 syntax error or access rule violation (undefined table or column, no privilege),
#: 44 with check option violation. Left transient: connection errors (08), rollbacks
#: for serialization or deadlock (40), lock and statement timeouts, resources, shutdown.
PERMANENT_SQLSTATE_CLASSES = frozenset({"0A", "21", "22", "23", "42", "44"})

#: SQLite's result codes for an SQL error (syntax, no such table or column) and a
#: constraint violated: the same every time. Busy, locked, I/O and full stay transient.
_PERMANENT_SQLITE_CODES = ("SQLITE_ERROR", "SQLITE_CONSTRAINT", "SQLITE_MISMATCH")


def sql_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error the same statement meets every time: a
    PostgreSQL error (any driver giving ``sqlstate``) of a class in
    :data:`PERMANENT_SQLSTATE_CLASSES`, or an SQLite error in the statement or a
    constraint. Retrying those only burns attempts (and the queue's retry budget)."""
    state = getattr(exc, "sqlstate", None)
    if isinstance(state, str) and len(state) == 5:
        return state[:2] in PERMANENT_SQLSTATE_CLASSES
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None)
        return isinstance(name, str) and name.startswith(_PERMANENT_SQLITE_CODES)
    return False


def _describe(exc: BaseException) -> str:
    return exception_text(exc)


def _given(reason: object, signal: str) -> str:
    """The reason a handler gave with ``Permanent`` or ``Retry``, as recorded: kept as
    given, but never blank (a dead job must say why) nor anything but text."""
    if reason is None:  # Permanent(None): no reason given, not the text "None"
        return f"{signal} raised without a reason"
    text = reason if isinstance(reason, str) else repr(reason)
    return text if text.strip() else f"{signal} raised without a reason"


def classify(exc: BaseException, user: Classifier | None = None) -> Decision:
    """Decide the class of ``exc``; ``user`` is consulted first."""
    # Explicit signals from the handler beat any classifier.
    if isinstance(exc, Retry):
        # Checked when the Retry was made; a delay changed since is left to the policy.
        if (problem := delay_problem(exc.delay)) is not None:
            why = f"{exc.reason} (its delay {problem}: the retry policy decides)"
            return Decision(ErrorClass.TRANSIENT, why)
        return Decision(ErrorClass.TRANSIENT, _given(exc.reason, "Retry"), exc.delay)
    if isinstance(exc, Permanent):
        return Decision(ErrorClass.PERMANENT, _given(exc.reason, "Permanent"))
    if isinstance(exc, FencedError | StoreUnavailableError):
        return Decision(ErrorClass.COORDINATION, _describe(exc))
    if isinstance(exc, StoreCorruptError | SchemaVersionError):
        # The store's schema is damaged or not this code's: the job is not at fault,
        # and spending its attempts dead-lettered every job that met it. It waits,
        # attempt intact, for the store to be repaired.
        return Decision(ErrorClass.COORDINATION, _describe(exc))
    if isinstance(exc, LeaseBusyError | EffectPendingError):
        # Contention, not a fault of the job: another live attempt holds the resource or
        # the key. Spending attempts on it dead-lettered jobs that only had to wait
        # their turn; they wait the retry policy's delay instead.
        return Decision(ErrorClass.COORDINATION, _describe(exc))
    if isinstance(exc, DependencyOpenError):
        # The dependency was not called: the job waits for the breaker, attempt intact.
        retry_after = exc.retry_after if delay_problem(exc.retry_after) is None else None
        return Decision(ErrorClass.COORDINATION, _describe(exc), retry_after)
    if user is not None:
        verdict = user(exc)
        if isinstance(verdict, Decision):
            # Made valid, but a frozen dataclass can still be altered after: check again.
            if (problem := delay_problem(verdict.delay)) is not None:
                raise InvalidInputError(f"classifier returned a Decision whose delay {problem}")
            return verdict
        if isinstance(verdict, ErrorClass):
            return Decision(verdict, _describe(exc))
        if verdict is not None:
            raise TypeError(
                f"classifier returned {verdict!r}; expected ErrorClass, Decision or None"
            )
    # A handler called with arguments it cannot take, handing tokenline input it refuses
    # (an effect result that is not JSON), or using its API in a way that cannot work
    # (the sync form in an async handler, a capability the store lacks) will fail the
    # same way every time: retrying it only burns attempts.
    if isinstance(
        exc,
        TypeError | NotImplementedError | InvalidInputError | NotSupportedError | ConfigError,
    ) or sql_fault(exc):
        return Decision(ErrorClass.PERMANENT, _describe(exc))
    return Decision(ErrorClass.TRANSIENT, _describe(exc))
