"""``ctx.transaction()`` on PostgreSQL: the user's writes and the completion, atomically.

Why a stale worker cannot commit through it:

1. The transaction's first statement (``transaction_begin``) checks the job row's
   token, owner and ``state = 'running'``. No row: the token is stale, the transaction
   is rolled back before the user wrote anything, the refusal is recorded in its own
   transaction and :class:`StaleTokenError` is raised. Each requested fence is then
   advanced in the same transaction (a lower token than the highest that wrote is
   refused the same way, before any user write).
2. On a clean exit the job is finished with the same fenced statement as
   ``jobs_finish`` — ``UPDATE … WHERE lease_token = ? AND lease_owner = ? AND state =
   'running'`` — and one ``COMMIT`` makes the user's writes and the completion durable
   together. If the job was rescued meanwhile (its token bumped), that update matches
   no row: everything is rolled back and :class:`StaleTokenError` raised. An exception
   in the block rolls both back.

Why it may stay open longer than the lease TTL: the check takes only a ``KEY SHARE``
lock on the job row. The control plane's renewals (and the rescue, and other jobs'
finishes) update no key column, so none of them waits for the transaction: the job
keeps its lease while its worker is healthy, whatever the transaction does. The token,
not the lock, is what keeps a stale commit out (step 2), so a transaction left open by
a paused or cut-off worker cannot keep its job from being rescued either; the rescue
then ends that session (it is named after the attempt), releasing the locks it holds on
the user's rows. Its ``statement_timeout`` and idle limit are the attempt's remaining
time when the worker gives one, else the store timeout.

The connection comes from the store's pool and is returned afterwards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus

from ..._errors import NotSupportedError, StaleTokenError, StoreError
from ..._jobs import Finish, Lease, Outcome
from ..._ledger import DuplicateKind, Fence, by_attempt
from ..base import FencedTransaction

if TYPE_CHECKING:
    from types import TracebackType

    from .store import PostgresStore

__all__ = ["PostgresFencedTransaction"]

log = logging.getLogger("tokenline.store.postgres")

_SYNC = (
    "the PostgreSQL store's transactions are asynchronous: use "
    "`async with store.fenced_transaction(...)` (ctx.transaction() in an async handler)"
)


class PostgresFencedTransaction(FencedTransaction):
    """A fenced transaction on a pooled connection; use it with ``async with``.

    ``async with`` yields the :class:`psycopg.AsyncConnection`, already inside the
    transaction. Do not commit or roll back on it: leaving the block does.
    """

    def __init__(
        self,
        store: PostgresStore,
        lease: Lease,
        fences: Sequence[Fence] = (),
        timeout: float | None = None,
    ) -> None:
        self._store = store
        self._lease = lease
        self._fences = tuple(fences)
        self._timeout = timeout
        self._cm: contextlib.AbstractAsyncContextManager[AsyncConnection[Any]] | None = None

    def __enter__(self) -> Any:
        raise NotSupportedError(_SYNC)

    def __exit__(self, *exc: object) -> None:
        raise NotSupportedError(_SYNC)

    async def __aenter__(self) -> AsyncConnection[Any]:
        if self._cm is not None:
            raise StoreError("a fenced transaction can be entered only once")
        self._cm = self._run()
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        if self._cm is None:
            return
        exc_type, exc_value, tb = cast(
            "tuple[type[BaseException] | None, BaseException | None, TracebackType | None]",
            exc,
        )
        await self._cm.__aexit__(exc_type, exc_value, tb)

    def _stale(self) -> StaleTokenError:
        return StaleTokenError(
            resource=f"job {self._lease.job_id}", token=self._lease.token, operation="transaction"
        )

    @contextlib.asynccontextmanager
    async def _run(self) -> AsyncIterator[AsyncConnection[Any]]:
        store, lease = self._store, self._lease
        conn = await store._checkout()
        try:
            tx = conn.transaction()
            with store._translate():
                await tx.__aenter__()
                fenced = await store._transaction_begin_on(conn, lease, self._timeout)
                refused = await store.fences_on(conn, lease, self._fences) if fenced else None
            if refused is not None:
                with store._translate():
                    await tx.__aexit__(psycopg.Rollback, psycopg.Rollback(), None)
                    stale = by_attempt(refused.key, DuplicateKind.STALE, "fence", lease, 0.0)
                    await store.record_duplicate_on(conn, stale)
                raise StaleTokenError(
                    resource=f"fence {refused.key!r}", token=refused.token, operation="transaction"
                )
            if not fenced:
                with store._translate():
                    # Roll back (psycopg.Rollback ends the block without an error), then
                    # record the refusal in its own transaction: it must outlive the rollback.
                    await tx.__aexit__(psycopg.Rollback, psycopg.Rollback(), None)
                    await store._record_stale_on(conn, lease, "transaction")
                raise self._stale()
            try:
                yield conn
            except BaseException as exc:
                await _rollback_quietly(tx, exc)
                raise
            await self._commit(conn, tx)
        finally:
            # The pool rolls back, or discards, a connection left in a transaction or broken.
            await store._checkin(conn)

    async def _commit(
        self, conn: AsyncConnection[Any], tx: contextlib.AbstractAsyncContextManager[Any]
    ) -> None:
        """Finish the job as succeeded inside the transaction, then commit both."""
        store, lease = self._store, self._lease
        with store._translate():
            try:
                if conn.info.transaction_status != TransactionStatus.INTRANS:
                    raise StoreError(
                        "the fenced transaction was ended inside its block; "
                        "leave COMMIT and ROLLBACK to the `async with`"
                    )
                completed = await self._complete(conn)
            except BaseException as exc:
                await _rollback_quietly(tx, exc)
                if isinstance(exc, StaleTokenError):
                    await store._record_stale_on(conn, lease, "transaction")
                raise
            await tx.__aexit__(None, None, None)  # COMMIT: the writes and the completion
        self.wrote = True
        self.committed = completed

    async def _complete(self, conn: AsyncConnection[Any]) -> bool:
        """Finish the job as succeeded inside the transaction; whether it was. If the
        job was rescued while the transaction was open, raise: it all rolls back."""
        (ok,) = await self._store._finish_on(conn, [Finish(self._lease, Outcome.SUCCEEDED)])
        if not ok:
            raise self._stale()
        return True


async def _rollback_quietly(
    tx: contextlib.AbstractAsyncContextManager[Any], exc: BaseException
) -> None:
    """Roll back while ``exc`` propagates; a failing rollback must not mask it."""
    try:
        await tx.__aexit__(type(exc), exc, exc.__traceback__)
    except Exception as rollback_exc:  # the connection is broken: the pool discards it
        log.warning("rollback of a fenced transaction failed: %s", rollback_exc)
