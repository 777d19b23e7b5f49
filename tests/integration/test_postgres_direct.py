"""The single blocking enqueue sent through the connection's libpq handle
(``stores/postgres/_direct.py``): the same job as psycopg's path makes, a statement the
session lost prepared again, errors raised as psycopg's, the connection left usable,
and the wake-up sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from pg_schema import fresh_store
from tokenline import InvalidInputError, OutcomeUnknownError, StoreError, StoreUnavailableError
from tokenline._jobs import NewJob
from tokenline.stores.postgres import PostgresStore
from tokenline.stores.postgres import _direct as direct


@pytest.fixture
async def store(postgres_server: str) -> AsyncIterator[PostgresStore]:
    """An open store on a fresh schema, dropped afterwards."""
    async with fresh_store(postgres_server, "tl_direct") as s:
        yield s


class _Name(str):
    """A str subclass: no plain text form for the direct path, so psycopg's path."""

    __slots__ = ()


def _row(store: PostgresStore, jid: int, *, absolute: bool) -> tuple[Any, ...]:
    """A job's stored columns that the enqueue sets, but its id and creation time:
    its run_at as stored if ``absolute``, else from its creation."""
    pool, conn = store._checkout_sync()
    try:
        row = conn.execute(
            f"SELECT queue, task, args, idempotency_key, priority, attempt, max_attempts, "
            f"state, timeout, max_lease_expiries, "
            f"CASE WHEN %s THEN run_at ELSE run_at - created_at END "
            f"FROM {store.schema}.jobs WHERE id = %s",
            (absolute, jid),
        ).fetchone()
    finally:
        pool.putconn(conn)
    assert row is not None
    return tuple(row)


def _direct_calls(store: PostgresStore) -> list[bool]:
    """Record, per enqueue of ``store``, whether the direct path answered it."""
    calls: list[bool] = []
    sent = store._enqueue_one_direct

    def spy(*args: Any, **kwargs: Any) -> Any:
        answer = sent(*args, **kwargs)
        calls.append(answer is not None)
        return answer

    store._enqueue_one_direct = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"idempotency_key": "k-é", "priority": -7, "max_attempts": 9, "timeout": 2.5},
        {"delay": 30.25, "max_lease_expiries": 4},
        {"run_at": 4102444800.125},
    ],
    ids=["plain", "key-priority-timeout", "delay", "run-at"],
)
async def test_the_direct_path_stores_the_job_psycopgs_path_stores(
    store: PostgresStore, fields: dict[str, Any]
) -> None:
    """The same columns, value for value, from both paths (a ``str`` subclass as the
    task's name sends the second job through psycopg)."""
    calls = _direct_calls(store)
    args = '{"args": ["naïve \\"quoted\\" text", 1.5e-300, 12345678901234], "kwargs": {}}'
    direct_job = NewJob(queue="default", task="t", args=args, **fields)
    psycopg_job = NewJob(queue="default", task=_Name("t"), args=args, **fields)
    (a,) = store.jobs_enqueue_blocking(jobs=[direct_job])
    (b,) = store.jobs_enqueue_blocking(jobs=[psycopg_job])
    assert calls == [True, False]
    assert b == a + 1
    absolute = "run_at" in fields
    assert _row(store, a, absolute=absolute) == _row(store, b, absolute=absolute)


async def test_a_statement_the_session_lost_is_prepared_again(store: PostgresStore) -> None:
    """A ``DEALLOCATE ALL`` (as a pooler in front of the server may send) between two
    enqueues on one connection: the second enqueue still goes in, once."""
    job = NewJob(queue="default", task="t", args="[1]")
    calls = _direct_calls(store)
    (first,) = store.jobs_enqueue_blocking(jobs=[job])
    pool, conn = store._checkout_sync()
    try:
        assert b"tokenline_enqueue_one" in conn.direct_prepared
        conn.execute("DEALLOCATE ALL")
    finally:
        pool.putconn(conn)
    (second,) = store.jobs_enqueue_blocking(jobs=[job])
    assert calls == [True, True]
    assert second == first + 1
    pool, conn = store._checkout_sync()
    try:
        (count,) = conn.execute(f"SELECT count(*) FROM {store.schema}.jobs").fetchone() or (0,)
    finally:
        pool.putconn(conn)
    assert count == 2


async def test_a_connection_that_keeps_no_prepared_statement_takes_psycopgs_path(
    store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepared and lost again at once (as behind a pooler that hands each statement
    to another session): the enqueue goes in once, through psycopg, and that connection
    does not try the direct path again."""
    # A prepare that the session does not keep: the name is noted, nothing is sent.
    monkeypatch.setattr(
        direct, "_prepare", lambda conn, name, statement, encoding: conn.direct_prepared.add(name)
    )
    calls = _direct_calls(store)
    job = NewJob(queue="default", task="t", args="[1]")
    (first,) = store.jobs_enqueue_blocking(jobs=[job])
    (second,) = store.jobs_enqueue_blocking(jobs=[job])
    assert calls == [False, False]
    assert second == first + 1
    pool, conn = store._checkout_sync()
    try:
        assert conn.direct_off
        (count,) = conn.execute(f"SELECT count(*) FROM {store.schema}.jobs").fetchone() or (0,)
    finally:
        pool.putconn(conn)
    assert count == 2


async def test_an_error_answer_is_psycopgs_error_and_leaves_the_connection_usable(
    store: PostgresStore,
) -> None:
    """The server's error comes back as psycopg's exception for its SQLSTATE, which the
    store translates as on psycopg's path; the same connection serves the next call."""
    pool, conn = store._checkout_sync()
    try:
        statement = direct.RawStatement.convert("SELECT 1 / %(n)s::integer")
        with pytest.raises(psycopg.errors.DivisionByZero):
            direct.run(conn, b"tokenline_test_divide", statement, {"n": 0})
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert direct.run(conn, b"tokenline_test_divide", statement, {"n": 1}) == [(b"1",)]
    finally:
        pool.putconn(conn)


async def test_a_refused_enqueue_is_translated(store: PostgresStore) -> None:
    """A session that may not write: the enqueue is refused as a coordination error on
    the direct path too, and is not taken for one whose outcome is unknown."""
    pool, conn = store._checkout_sync()
    try:
        conn.execute("SET default_transaction_read_only = on")
    finally:
        pool.putconn(conn)
    with pytest.raises(StoreUnavailableError, match="read-only") as refused:
        store.jobs_enqueue_blocking(jobs=[NewJob(queue="default", task="t", args="[1]")])
    assert type(refused.value).__name__ == "ReadOnlyServerError"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, None),
        (True, b"t"),
        (False, b"f"),
        (-(2**63), b"-9223372036854775808"),
        (0.1, b"0.1"),
        (-1e-310, b"-1e-310"),
        ("ünï\u2028", "ünï\u2028".encode()),
        (float("nan"), False),
        (float("inf"), False),
        ("a\x00b", False),
        (_Name("q"), False),
        (b"bytes", False),
        ([1], False),
    ],
)
def test_only_values_with_one_plain_text_form_go_direct(value: Any, text: Any) -> None:
    """What the direct path sends for each kind of value; ``False`` sends the call
    through psycopg, which adapts (or refuses) the value its own way."""
    assert direct._text(value) == text
    assert type(direct._text(value)) is type(text)


async def test_a_direct_enqueue_wakes_a_listener(
    store: PostgresStore, postgres_server: str
) -> None:
    """The enqueue's notification is sent in its transaction on the direct path."""
    with psycopg.connect(postgres_server, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.target.channel}"')
        calls = _direct_calls(store)
        store.jobs_enqueue_blocking(jobs=[NewJob(queue="mail", task="t", args="[1]")])
        assert calls == [True]
        heard = [n.payload for n in listener.notifies(timeout=30, stop_after=1)]
    assert heard == ["mail"]


async def test_a_session_in_another_client_encoding_stores_keys_exactly(
    postgres_server: str,
) -> None:
    """A URL that asks for LATIN1 sessions: a key with accents is stored as given
    (through psycopg, which encodes for the session), and one that LATIN1 cannot
    write is refused, naming the characters, with nothing stored."""
    async with fresh_store(postgres_server, "tl_direct", "&client_encoding=LATIN1") as s:
        calls = _direct_calls(s)
        (jid,) = s.jobs_enqueue_blocking(
            jobs=[NewJob(queue="default", task="t", args="[1]", idempotency_key="café")]
        )
        assert calls == [False]
        with pytest.raises(
            InvalidInputError, match=r"'😀' cannot be written in the client encoding .*\(latin-1\)"
        ):
            s.jobs_enqueue_blocking(
                jobs=[NewJob(queue="default", task="t", args="[2]", idempotency_key="a😀")]
            )
        with pytest.raises(InvalidInputError, match="nothing was written"):
            await s.jobs_enqueue(
                jobs=[NewJob(queue="default", task="t", args="[3]", idempotency_key="b😀")]
            )
        async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as c:
            cur = await c.execute(f"SELECT id, idempotency_key FROM {s.schema}.jobs")
            assert await cur.fetchall() == [(jid, "café")]


async def test_an_error_at_the_commit_after_the_rows_is_raised(store: PostgresStore) -> None:
    """A deferred check that fails when the enqueue commits answers after the row the
    statement returned: the enqueue raises, and returns no id of a job never stored."""
    pool, conn = store._checkout_sync()
    try:
        conn.execute(
            f"CREATE FUNCTION {store.schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
        )
        conn.execute(
            f"CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON {store.schema}.jobs "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"EXECUTE FUNCTION {store.schema}.refuse()"
        )
    finally:
        store._checkin_sync(pool, conn)
    calls = _direct_calls(store)
    with pytest.raises(StoreError, match="refused at commit") as raised:
        store.jobs_enqueue_blocking(jobs=[NewJob(queue="default", task="t", args="[1]")])
    assert not isinstance(raised.value, OutcomeUnknownError)  # the server said: rolled back
    assert calls == []  # raised inside the direct path, before it answered
    pool, conn = store._checkout_sync()
    try:
        (count,) = conn.execute(f"SELECT count(*) FROM {store.schema}.jobs").fetchone() or (1,)
    finally:
        store._checkin_sync(pool, conn)
    assert count == 0


class _Result:
    """A libpq result as _direct reads it."""

    def __init__(self, status: psycopg.pq.ExecStatus, fields: dict[int, bytes]) -> None:
        self.status = status
        self._fields = fields

    def error_field(self, field: int) -> bytes | None:
        return self._fields.get(field)

    def get_error_message(self, encoding: str = "utf-8") -> str:
        return (self._fields.get(psycopg.pq.DiagnosticField.MESSAGE_PRIMARY) or b"").decode()


class _Answering:
    """A libpq handle with the whole answer in, one part per get_result."""

    def __init__(self, *parts: _Result) -> None:
        self._parts = list(parts)
        self.socket = 0

    def flush(self) -> int:
        return 0

    def is_busy(self) -> bool:
        return False

    def get_result(self) -> _Result | None:
        return self._parts.pop(0) if self._parts else None


def test_a_session_ended_after_the_rows_leaves_the_outcome_unknown() -> None:
    """The row came, then the server ended the session (FATAL): whether the statement
    committed is not known, so no row is taken for an answer."""
    field = psycopg.pq.DiagnosticField
    rows = _Result(psycopg.pq.ExecStatus.TUPLES_OK, {})
    ended = _Result(
        psycopg.pq.ExecStatus.FATAL_ERROR,
        {
            field.SQLSTATE: b"57P01",
            field.SEVERITY_NONLOCALIZED: b"FATAL",
            field.MESSAGE_PRIMARY: b"terminating connection due to administrator command",
        },
    )
    with pytest.raises(psycopg.OperationalError, match="ended after the statement") as raised:
        direct._results(_Answering(rows, ended), "utf-8")  # type: ignore[arg-type]
    assert raised.value.sqlstate is None  # so the store says: outcome unknown
    with pytest.raises(psycopg.errors.AdminShutdown):  # before any row: the server's word
        direct._results(_Answering(ended), "utf-8")  # type: ignore[arg-type]
    assert direct._results(_Answering(rows), "utf-8") is rows  # type: ignore[arg-type]
