"""Error classification: explicit signals, coordination errors, defaults, user classifier."""

from __future__ import annotations

import math
import sqlite3
from typing import Any

import pytest

from tokenline import (
    MAX_DELAY,
    Decision,
    EffectPendingError,
    ErrorClass,
    FencedError,
    InvalidInputError,
    JobCancelled,
    LeaseBusyError,
    LeaseExpiredError,
    Permanent,
    Retry,
    SchemaVersionError,
    StaleTokenError,
    StoreCorruptError,
    StoreUnavailableError,
    classify,
)


def test_retry_is_transient_with_its_delay() -> None:
    """Retry(delay) is transient and carries the handler's delay and reason."""
    decision = classify(Retry(2.5, reason="rate limited"))
    assert decision == Decision(ErrorClass.TRANSIENT, "rate limited", 2.5)


def test_retry_without_delay_leaves_delay_to_the_policy() -> None:
    """Retry() with no delay is transient with delay None, so backoff decides."""
    decision = classify(Retry())
    assert decision.error_class is ErrorClass.TRANSIENT
    assert decision.delay is None


def test_retry_zero_delay_is_kept() -> None:
    """Retry(0) keeps delay 0 (retry now), distinct from None (use backoff)."""
    assert classify(Retry(0)).delay == 0


def test_negative_retry_delay_is_rejected() -> None:
    """Retry(-1) raises ValueError at once instead of scheduling into the past."""
    with pytest.raises(ValueError, match="delay"):
        Retry(-1)


BAD_DELAYS = [
    -1,
    -0.001,
    math.nan,
    math.inf,
    10**400,
    MAX_DELAY + 1,
    "soon",
    "5",
    True,
    [1],
]


@pytest.mark.parametrize("delay", BAD_DELAYS)
def test_a_retry_delay_is_checked_like_an_enqueue_delay(delay: Any) -> None:
    """Retry(delay) refuses what enqueue(delay=) refuses, at once, naming the delay: a
    string or a huge integer would otherwise fail later, inside the worker."""
    with pytest.raises(InvalidInputError, match="Retry delay") as info:
        Retry(delay)
    assert isinstance(info.value, ValueError)  # as before: except ValueError still works


@pytest.mark.parametrize("delay", [0, 0.5, 30, MAX_DELAY])
def test_a_valid_retry_delay_is_kept(delay: float) -> None:
    """From 0 to MAX_DELAY seconds, an int or a float."""
    assert classify(Retry(delay)).delay == delay


@pytest.mark.parametrize("delay", BAD_DELAYS)
def test_a_decision_delay_is_checked_too(delay: Any) -> None:
    """A classifier's Decision(delay=...) is checked like Retry's."""
    with pytest.raises(InvalidInputError, match="Decision delay"):
        Decision(ErrorClass.TRANSIENT, "why", delay)


def test_a_decision_needs_an_error_class() -> None:
    """A string where an ErrorClass belongs is refused when the Decision is made."""
    with pytest.raises(InvalidInputError, match="ErrorClass"):
        Decision("transient", "why")  # type: ignore[arg-type]


def test_a_decision_altered_after_it_was_made_is_refused_by_classify() -> None:
    """A Decision whose delay was changed after its checks makes classify raise (the
    worker logs a failing classifier, and the defaults decide)."""
    bad = Decision(ErrorClass.TRANSIENT, "why", 1.0)
    object.__setattr__(bad, "delay", "soon")
    with pytest.raises(InvalidInputError, match="delay"):
        classify(ValueError("x"), lambda exc: bad)


def test_a_retry_altered_after_it_was_made_leaves_the_delay_to_the_policy() -> None:
    """Retry's delay changed after it was made: still a retry, the policy's delay."""
    exc = Retry(1.0, reason="later")
    exc.delay = "soon"  # type: ignore[assignment]
    decision = classify(exc)
    assert decision.error_class is ErrorClass.TRANSIENT
    assert decision.delay is None
    assert decision.reason.startswith("later (its delay")


def test_permanent_is_permanent_with_its_reason() -> None:
    """Permanent(reason) is permanent and keeps the reason for the dead-letter record."""
    decision = classify(Permanent("order 7 does not exist"))
    assert decision.error_class is ErrorClass.PERMANENT
    assert decision.reason == "order 7 does not exist"
    assert decision.delay is None


@pytest.mark.parametrize("reason", ["", "   ", "\n", None])
def test_a_blank_reason_is_recorded_as_such_never_empty(reason: str) -> None:
    """Permanent("") dead-lettered its job with an empty reason, which listings show
    blank and the drill counts as a job lost without a reason; Retry(reason="") alike.
    Permanent(None) was recorded as the text "None"."""
    assert classify(Permanent(reason)).reason == "Permanent raised without a reason"
    assert classify(Retry(1.0, reason)).reason == "Retry raised without a reason"


def test_a_reason_that_is_not_text_is_recorded_as_text() -> None:
    """A reason of another type (a handler passing an exception or a number) is kept
    as its repr, so that the record is text."""
    assert classify(Permanent(404)).reason == "404"  # type: ignore[arg-type]
    assert classify(Permanent(KeyError("k"))).reason == "KeyError('k')"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc",
    [
        FencedError("lost"),
        StaleTokenError(resource="job 1", token=3, operation="complete"),
        LeaseExpiredError("expired"),
        JobCancelled("cancelled"),
        StoreUnavailableError("down"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_coordination_errors_are_coordination(exc: BaseException) -> None:
    """Fencing and store-unavailable errors are coordination failures, never the job's fault."""
    decision = classify(exc)
    assert decision.error_class is ErrorClass.COORDINATION
    assert type(exc).__name__ in decision.reason


def test_type_error_is_permanent() -> None:
    """A TypeError (handler called with wrong arguments) is permanent: retrying cannot help."""
    decision = classify(TypeError("f() takes 1 positional argument but 2 were given"))
    assert decision.error_class is ErrorClass.PERMANENT
    assert decision.reason.startswith("TypeError: f() takes")


@pytest.mark.parametrize(
    "exc",
    [ValueError("x"), ConnectionResetError(), TimeoutError(), RuntimeError("boom"), KeyError(1)],
    ids=lambda e: type(e).__name__,
)
def test_other_exceptions_are_transient(exc: BaseException) -> None:
    """Anything not otherwise recognised is transient, and the reason names its type."""
    decision = classify(exc)
    assert decision.error_class is ErrorClass.TRANSIENT
    assert decision.delay is None
    assert decision.reason.startswith(type(exc).__name__)


def test_reason_of_exception_without_message_is_its_type_name() -> None:
    """An exception with an empty message is described by its type name alone."""
    assert classify(ConnectionResetError()).reason == "ConnectionResetError"


def test_user_classifier_error_class_overrides_default() -> None:
    """A classifier returning an ErrorClass decides, and the reason still describes the error."""
    decision = classify(ValueError("bad row"), lambda exc: ErrorClass.PERMANENT)
    assert decision == Decision(ErrorClass.PERMANENT, "ValueError: bad row")


def test_user_classifier_decision_is_returned_as_is() -> None:
    """A classifier returning a Decision is used verbatim, delay included."""
    mine = Decision(ErrorClass.TRANSIENT, "upstream 503", 9.0)
    assert classify(RuntimeError("503"), lambda exc: mine) is mine


def test_user_classifier_none_falls_through_to_defaults() -> None:
    """A classifier returning None leaves the default classification in place."""
    calls: list[BaseException] = []

    def classifier(exc: BaseException) -> None:
        calls.append(exc)

    err = TypeError("nope")
    assert classify(err, classifier).error_class is ErrorClass.PERMANENT
    assert classify(ValueError("x"), classifier).error_class is ErrorClass.TRANSIENT
    assert calls[0] is err
    assert len(calls) == 2


def test_user_classifier_is_consulted_before_type_error_default() -> None:
    """The user classifier runs before the TypeError-is-permanent default and can override it."""
    decision = classify(TypeError("flaky driver"), lambda exc: ErrorClass.TRANSIENT)
    assert decision.error_class is ErrorClass.TRANSIENT


def test_explicit_signals_beat_the_user_classifier() -> None:
    """Retry and Permanent raised by the handler are not overridden by a classifier."""

    def everything_is_coordination(exc: BaseException) -> ErrorClass:
        return ErrorClass.COORDINATION

    assert classify(Retry(1), everything_is_coordination).error_class is ErrorClass.TRANSIENT
    assert classify(Permanent("x"), everything_is_coordination).error_class is (
        ErrorClass.PERMANENT
    )


@pytest.mark.parametrize(
    "junk", ["permanent", 1, True, object()], ids=["str", "int", "bool", "object"]
)
def test_classifier_returning_junk_raises_type_error(junk: object) -> None:
    """A classifier returning anything but ErrorClass, Decision or None is a TypeError."""
    with pytest.raises(TypeError, match="classifier returned"):
        classify(ValueError("x"), lambda exc: junk)  # type: ignore[arg-type,return-value]


class _DriverError(Exception):
    """A database driver's error carrying its SQLSTATE, as psycopg's do."""

    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(f"server said {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("42P01", ErrorClass.PERMANENT),  # undefined table
        ("42703", ErrorClass.PERMANENT),  # undefined column
        ("42601", ErrorClass.PERMANENT),  # syntax error
        ("42501", ErrorClass.PERMANENT),  # insufficient privilege
        ("22012", ErrorClass.PERMANENT),  # division by zero
        ("22P02", ErrorClass.PERMANENT),  # invalid text representation
        ("23505", ErrorClass.PERMANENT),  # unique violation
        ("0A000", ErrorClass.PERMANENT),  # feature not supported
        ("40001", ErrorClass.TRANSIENT),  # serialization failure
        ("40P01", ErrorClass.TRANSIENT),  # deadlock detected
        ("55P03", ErrorClass.TRANSIENT),  # lock not available
        ("57014", ErrorClass.TRANSIENT),  # statement timeout
        ("08006", ErrorClass.TRANSIENT),  # connection failure
        ("53300", ErrorClass.TRANSIENT),  # too many connections
        (None, ErrorClass.TRANSIENT),
        ("42", ErrorClass.TRANSIENT),  # not an SQLSTATE
    ],
)
def test_a_database_error_met_every_time_is_permanent(
    sqlstate: str | None, expected: ErrorClass
) -> None:
    """A handler's statement on a table that is not there was retried as transient
    until its attempts ran out, spending the queue's retry budget on the way. An error
    the same statement meets every time (its SQLSTATE class) is now permanent; one a
    retry can get past (a conflict, a timeout, a lost connection) stays transient."""
    decision = classify(_DriverError(sqlstate))
    assert decision.error_class is expected
    assert decision.reason == f"_DriverError: server said {sqlstate}"


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("SELECT * FROM nowhere", ErrorClass.PERMANENT),
        ("SELEC 1", ErrorClass.PERMANENT),
        ("INSERT INTO t VALUES (1)", ErrorClass.PERMANENT),  # primary key taken
    ],
)
def test_an_sqlite_error_in_the_statement_is_permanent(
    statement: str, expected: ErrorClass
) -> None:
    """The same on SQLite, by its result code."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a INTEGER PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.Error) as caught:
        conn.execute(statement)
    assert classify(caught.value).error_class is expected


def test_a_busy_sqlite_database_stays_transient(tmp_path: Any) -> None:
    """A database locked by another connection is worth another try."""
    path = tmp_path / "busy.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (a)")
    holder.execute("BEGIN EXCLUSIVE")
    other = sqlite3.connect(path, timeout=0)
    with pytest.raises(sqlite3.OperationalError) as caught:
        other.execute("SELECT * FROM t")
    assert caught.value.sqlite_errorname == "SQLITE_BUSY"
    assert classify(caught.value).error_class is ErrorClass.TRANSIENT


@pytest.mark.parametrize(
    "exc",
    [
        LeaseBusyError("the lease on 'account:42' is held by someone else"),
        EffectPendingError("key 'charge:1' is pending under job 7 token 3 (worker w1)"),
    ],
)
def test_contention_is_coordination_not_a_failure_of_the_job(exc: Exception) -> None:
    """Another live attempt held the resource lease or the effect key for the whole
    wait: counted as a transient failure, the wait spent the job's attempts, and jobs
    that only had to wait their turn ended dead. Given back instead, attempt intact."""
    assert classify(exc).error_class is ErrorClass.COORDINATION
    # A user classifier is not asked: contention is tokenline's own signal.
    assert classify(exc, lambda e: ErrorClass.PERMANENT).error_class is ErrorClass.COORDINATION


@pytest.mark.parametrize(
    "exc",
    [
        StoreCorruptError("the tokenline schema 's' is missing or incomplete"),
        SchemaVersionError("the tokenline schema 's' is at version 15, newer than this"),
    ],
)
def test_a_damaged_store_is_coordination_not_a_failure_of_the_job(exc: Exception) -> None:
    """A table dropped from the store failed every job that needed it, each spending
    its attempts until dead: the store's fault, charged to the jobs. Given back
    instead, attempt intact, until the store is repaired."""
    assert classify(exc).error_class is ErrorClass.COORDINATION
