"""Statements written once, run on psycopg's sync or async connection.

A *steps* function is a generator that does no I/O. It yields what to do next — a
:class:`Query` (a statement, and how much of its answer to fetch), :class:`Begin` or
:class:`End` (a transaction's boundaries), :class:`InTransaction` (a look at the
connection's state) — receives each answer, or has the error raised where it yielded,
and returns its result. :class:`SyncDriver` runs steps on a :class:`psycopg.Connection`
(a sync handler's ``with ctx.transaction()``), :class:`AsyncDriver` on a
:class:`psycopg.AsyncConnection` (everything else). The drivers only send, fetch and
report; which statements a fenced transaction sends, in which order, and what it makes
of their answers exists once, in the steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeAlias, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow, tuple_row

from ..._errors import StoreError

__all__ = [
    "AsyncDriver",
    "Begin",
    "Copy",
    "End",
    "InTransaction",
    "Query",
    "Status",
    "Step",
    "Steps",
    "SyncDriver",
    "execute",
    "fetch_all",
    "fetch_one",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Query:
    """Send ``sql`` with ``params``; answer with nothing, the first row or every row."""

    sql: str
    params: Mapping[str, Any] | None = None
    fetch: Literal["none", "one", "all"] = "none"


@dataclass(frozen=True, slots=True)
class Copy:
    """``COPY … FROM STDIN`` with ``rows`` (tuples in the statement's column order);
    with ``types`` (the columns' type names), in binary form: the statement must say
    ``(FORMAT BINARY)``."""

    sql: str
    rows: Sequence[tuple[Any, ...]]
    types: Sequence[str] | None = None


@dataclass(frozen=True, slots=True)
class Begin:
    """Open a transaction (psycopg's ``conn.transaction()``, entered)."""


@dataclass(frozen=True, slots=True)
class End:
    """Leave the transaction opened by :class:`Begin`: ``COMMIT`` when ``error`` is
    ``None``, else ``ROLLBACK`` (``error`` is what psycopg's transaction exits with)."""

    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class InTransaction:
    """Answer whether the connection is inside a transaction (no round trip)."""


@dataclass(frozen=True, slots=True)
class Status:
    """Answer the connection's :class:`~psycopg.pq.TransactionStatus` (no round trip)."""


Step: TypeAlias = Query | Copy | Begin | End | InTransaction | Status
#: A generator of steps returning ``T``.
Steps: TypeAlias = Generator[Step, Any, T]


def execute(sql: str, params: Mapping[str, Any] | None = None) -> Steps[None]:
    """Send one statement, fetching nothing."""
    yield Query(sql, params)


def fetch_one(sql: str, params: Mapping[str, Any] | None = None) -> Steps[TupleRow | None]:
    """Send one statement; its first row, or ``None``."""
    row: TupleRow | None = yield Query(sql, params, "one")
    return row


def fetch_all(sql: str, params: Mapping[str, Any] | None = None) -> Steps[list[TupleRow]]:
    """Send one statement; all its rows."""
    rows: list[TupleRow] = yield Query(sql, params, "all")
    return rows


class _Resumer(Generic[T]):
    """Moves a steps generator on with an answer or an error, and keeps its result."""

    #: What the steps returned; set once :meth:`resume` has returned ``None``.
    result: T

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps

    def resume(self, answer: Any = None, error: BaseException | None = None) -> Step | None:
        """The next step, or ``None`` once the steps returned (see :attr:`result`)."""
        try:
            if error is not None:
                return self._steps.throw(error)
            return self._steps.send(answer)
        except StopIteration as done:
            self.result = done.value
            return None


def _exit_args(error: BaseException | None) -> tuple[Any, Any, Any]:
    if error is None:
        return None, None, None
    return type(error), error, error.__traceback__


def _no_transaction() -> StoreError:
    return StoreError("End without Begin: no transaction is open on this connection")


class SyncDriver:
    """Runs steps on a :class:`psycopg.Connection`; holds its transaction between runs."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._tx: contextlib.AbstractContextManager[Any] | None = None

    def run(self, steps: Steps[T]) -> T:
        """Run ``steps`` to the end and return their result."""
        resumer = _Resumer(steps)
        step = resumer.resume()
        while step is not None:
            answer: Any = None
            error: BaseException | None = None
            try:
                answer = self._do(step)
            except BaseException as exc:  # the steps decide what becomes of it
                error = exc
            step = resumer.resume(answer, error)
        return resumer.result

    def _do(self, step: Step) -> Any:
        if isinstance(step, Query):
            cur = self.conn.cursor(row_factory=tuple_row)
            cur.execute(step.sql, step.params)
            if step.fetch == "one":
                return cur.fetchone()
            return cur.fetchall() if step.fetch == "all" else None
        if isinstance(step, Copy):
            with self.conn.cursor().copy(step.sql) as copy:
                if step.types is not None:
                    copy.set_types(step.types)
                for row in step.rows:
                    copy.write_row(row)
            return None
        if isinstance(step, Begin):
            tx = self.conn.transaction()
            tx.__enter__()
            self._tx = tx
            return None
        if isinstance(step, End):
            ending, self._tx = self._tx, None
            if ending is None:
                raise _no_transaction()
            ending.__exit__(*_exit_args(step.error))
            return None
        if isinstance(step, Status):
            return self.conn.info.transaction_status
        return self.conn.info.transaction_status == TransactionStatus.INTRANS


class AsyncDriver:
    """Runs steps on a :class:`psycopg.AsyncConnection`; holds its transaction between
    runs."""

    def __init__(self, conn: AsyncConnection[Any]) -> None:
        self.conn = conn
        self._tx: contextlib.AbstractAsyncContextManager[Any] | None = None

    async def run(self, steps: Steps[T]) -> T:
        """Run ``steps`` to the end and return their result."""
        resumer = _Resumer(steps)
        step = resumer.resume()
        while step is not None:
            answer: Any = None
            error: BaseException | None = None
            try:
                answer = await self._do(step)
            except BaseException as exc:  # the steps decide what becomes of it
                error = exc
            step = resumer.resume(answer, error)
        return resumer.result

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Query):
            cur = self.conn.cursor(row_factory=tuple_row)
            await cur.execute(step.sql, step.params)
            if step.fetch == "one":
                return await cur.fetchone()
            return await cur.fetchall() if step.fetch == "all" else None
        if isinstance(step, Copy):
            async with self.conn.cursor().copy(step.sql) as copy:
                if step.types is not None:
                    copy.set_types(step.types)
                for row in step.rows:
                    await copy.write_row(row)
            return None
        if isinstance(step, Begin):
            tx = self.conn.transaction()
            await tx.__aenter__()
            self._tx = tx
            return None
        if isinstance(step, End):
            ending, self._tx = self._tx, None
            if ending is None:
                raise _no_transaction()
            await ending.__aexit__(*_exit_args(step.error))
            return None
        if isinstance(step, Status):
            return self.conn.info.transaction_status
        return self.conn.info.transaction_status == TransactionStatus.INTRANS
