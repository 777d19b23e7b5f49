"""Error classification: what happens after a handler fails.

=============  ===========================================  ==============================
class          examples                                     action
=============  ===========================================  ==============================
transient      timeouts, connection resets, unknown errors  retry with backoff, then dead
permanent      ``Permanent``, bad arguments (``TypeError``), dead at once, with the reason
               invalid input (``InvalidInputError``), an
               API used wrongly (``NotSupportedError``,
               ``ConfigError``)
coordination   lease lost, store unreachable, cancelled,    no ack, no attempt burned
               a dependency's breaker open                  (a breaker: after its delay)
               (``DependencyOpenError``)
=============  ===========================================  ==============================

A user classifier runs first; returning ``None`` falls through to the defaults.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import (
    ConfigError,
    DependencyOpenError,
    FencedError,
    InvalidInputError,
    NotSupportedError,
    Permanent,
    Retry,
    StoreUnavailableError,
)
from ._jobs import exception_text

__all__ = ["Classifier", "Decision", "ErrorClass", "classify"]


class ErrorClass(enum.StrEnum):
    """The three kinds of failure, each with its own handling."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"
    COORDINATION = "coordination"


@dataclass(frozen=True, slots=True)
class Decision:
    """The class of a failure, and an explicit retry delay when the handler gave one."""

    error_class: ErrorClass
    reason: str
    delay: float | None = None


#: A user classifier: return an :class:`ErrorClass` (or a :class:`Decision`) to decide,
#: or ``None`` to fall back on the defaults.
Classifier = Callable[[BaseException], "ErrorClass | Decision | None"]


def _describe(exc: BaseException) -> str:
    return exception_text(exc)


def classify(exc: BaseException, user: Classifier | None = None) -> Decision:
    """Decide the class of ``exc``; ``user`` is consulted first."""
    # Explicit signals from the handler beat any classifier.
    if isinstance(exc, Retry):
        return Decision(ErrorClass.TRANSIENT, exc.reason, exc.delay)
    if isinstance(exc, Permanent):
        return Decision(ErrorClass.PERMANENT, exc.reason)
    if isinstance(exc, FencedError | StoreUnavailableError):
        return Decision(ErrorClass.COORDINATION, _describe(exc))
    if isinstance(exc, DependencyOpenError):
        # The dependency was not called: the job waits for the breaker, attempt intact.
        return Decision(ErrorClass.COORDINATION, _describe(exc), exc.retry_after)
    if user is not None:
        verdict = user(exc)
        if isinstance(verdict, Decision):
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
    ):
        return Decision(ErrorClass.PERMANENT, _describe(exc))
    return Decision(ErrorClass.TRANSIENT, _describe(exc))
