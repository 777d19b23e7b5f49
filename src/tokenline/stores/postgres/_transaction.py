"""``ctx.transaction()`` on PostgreSQL: the user's writes and the completion, atomically.

Two forms, one transaction: ``with`` (a sync handler, in its own thread) gets a
:class:`psycopg.Connection` from the store's sync pool, ``async with`` (an async
handler) a :class:`psycopg.AsyncConnection` from its async pool. What the transaction
sends and decides is written once, as steps (``_steps.py``): :meth:`_opening` from
``BEGIN`` to handing the connection over, :meth:`_closing` from the end of the block to
``COMMIT`` or ``ROLLBACK``. Each form only runs those steps with its driver, so the
argument below holds for both.

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
   no row: everything is rolled back, the refusal recorded and :class:`StaleTokenError`
   raised. An exception in the block rolls both back.
3. The block may not end the transaction itself (migration 0014): its ``COMMIT`` is
   refused by a deferred check, and the connection does not autocommit while it is
   lent, so statements after a ``ROLLBACK`` wait in a new transaction that the block's
   end finds without its guard and rolls back. :class:`NotSupportedError` (a permanent
   error) says why. What is out of reach: a ``ROLLBACK`` the block follows with writes
   and a ``COMMIT`` of its own commits them, as another connection would.

Why it may stay open longer than the lease TTL: the check takes only a ``KEY SHARE``
lock on the job row. The control plane's renewals (and the rescue, and other jobs'
finishes) update no key column, so none of them waits for the transaction: the job
keeps its lease while its worker is healthy, whatever the transaction does. The token,
not the lock, is what keeps a stale commit out (step 2), so a transaction left open by
a paused or cut-off worker cannot keep its job from being rescued either; the rescue
then ends that session (it is named after the attempt), releasing the locks it holds on
the user's rows. Its ``statement_timeout`` and idle limit are the attempt's remaining
time when the worker gives one, else the store timeout.

The sync form blocks its thread; on a thread running an event loop (an async handler
that wrote ``with``) it would stall every job of the worker, so it is refused there.
The connection comes from a pool of its form kept for blocks, whose connections run
read-only outside tokenline's transactions (``_lent.py``): a reference the block kept
cannot write through it once the block has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus

from ..._errors import NotSupportedError, StaleTokenError, StoreError, StoreUnavailableError
from ..._jobs import Finish, Lease, Outcome
from ..._records import DuplicateKind, Fence, by_attempt
from ..base import FencedTransaction
from ._cutoff import Armed
from ._errors import is_read_only
from ._lent import RESET, take_back, take_back_async
from ._steps import AsyncDriver, Begin, End, Status, Steps, SyncDriver, execute, fetch_one

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from .store import PostgresStore

__all__ = ["PostgresFencedTransaction"]

log = logging.getLogger("tokenline.store.postgres")

_ON_LOOP = (
    "`with store.fenced_transaction(...)` blocks its thread, and this thread runs an "
    "asyncio event loop: in an async handler use `async with ctx.transaction()` "
    "(`async with store.fenced_transaction(...)`)"
)


class PostgresFencedTransaction(FencedTransaction):
    """A fenced transaction on a pooled connection: ``with`` (sync handlers) yields a
    :class:`psycopg.Connection`, ``async with`` (async handlers) a
    :class:`psycopg.AsyncConnection`, already inside the transaction. Parameters are
    ``%s``. Do not commit or roll back on it: leaving the block does.
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
        self._entered = False
        self._sync: tuple[ConnectionPool[Any], psycopg.Connection[Any], SyncDriver] | None = None
        # The deadline of the sync block's own statements (the attempt's).
        self._block_cutoff: Armed | None = None
        # The session was reset inside the committed transaction (see _closing).
        self._session_reset = False
        self._async: tuple[AsyncConnection[Any], AsyncDriver] | None = None

    # -- the two forms: each runs the same steps with its own driver ---------------------
    def __enter__(self) -> psycopg.Connection[Any]:
        _refuse_on_event_loop()
        self._enter_once()
        store = self._store
        pool, conn = store._checkout_sync(lent=True)
        driver = SyncDriver(conn)
        try:
            # A thread cannot be cancelled: each wait of this connection has a deadline
            # (_cutoff.py), tokenline's statements the store's, the block the attempt's.
            with store._translate(), store._cutoffs.arm(conn, store._deadline):
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.rollback()  # left in a transaction by a reference kept past a block
                conn.read_only = False  # see _lent.py
                conn.autocommit = False  # see _closing's _block_open
                driver.run(self._opening())
        except BaseException as exc:
            self._give_back_sync(pool, conn, discard=is_read_only(exc))
            raise
        if self._timeout is not None:
            self._block_cutoff = store._cutoffs.arm(conn, self._timeout)
        self._sync = pool, conn, driver
        return conn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._sync is None:
            return
        (pool, conn, driver), self._sync = self._sync, None
        block, self._block_cutoff = self._block_cutoff, None
        if block is not None:
            block.__exit__(None, None, None)
        error = _error(exc_type, exc)
        discard = error is not None and is_read_only(error)
        lost = self._lost(conn, error)
        try:
            with self._store._translate(), self._store._cutoffs.arm(conn, self._store._deadline):
                driver.run(self._closing(error))
        except BaseException as failed:
            discard = discard or is_read_only(failed)
            if lost is None:
                raise
        finally:
            self._give_back_sync(pool, conn, reset=not self._session_reset, discard=discard)
        if lost is not None:
            raise lost from error

    def _give_back_sync(
        self,
        pool: ConnectionPool[Any],
        conn: psycopg.Connection[Any],
        *,
        reset: bool = True,
        discard: bool = False,
    ) -> None:
        """Return ``conn`` to its pool at rest again (autocommit, read-only, its session
        reset unless the committed transaction did: ``_lent.py``); one that cannot be
        put back so (or does not answer in time) is closed, and the pool discards it.
        ``discard``: close it all the same, it answered that it can write nothing (a
        standby's session): the next one the pool opens may reach a writable server."""
        if discard:
            conn.close()
            self._store._checkin_sync(pool, conn)
            return
        try:
            # Disarmed before the pool may lend the connection to another caller.
            with self._store._cutoffs.arm(conn, self._store._deadline):
                take_back(conn, reset=reset)
        except psycopg.Error:
            conn.close()
        finally:
            self._store._checkin_sync(pool, conn)

    async def __aenter__(self) -> AsyncConnection[Any]:
        self._enter_once()
        store = self._store
        conn = await store._checkout()
        driver = AsyncDriver(conn)
        try:
            with store._translate():
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    await conn.rollback()  # as in __enter__
                await conn.set_read_only(False)  # see _lent.py
                await conn.set_autocommit(False)  # see _closing's _block_open
                await driver.run(self._opening())
        except BaseException as exc:
            await _give_back(store, conn, discard=is_read_only(exc))
            raise
        self._async = conn, driver
        return conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._async is None:
            return
        (conn, driver), self._async = self._async, None
        error = _error(exc_type, exc)
        discard = error is not None and is_read_only(error)
        lost = self._lost(conn, error)
        try:
            with self._store._translate():
                await driver.run(self._closing(error))
        except BaseException as failed:
            discard = discard or is_read_only(failed)
            if lost is None:
                raise
        finally:
            await _give_back(self._store, conn, reset=not self._session_reset, discard=discard)
        if lost is not None:
            raise lost from error

    def _lost(
        self, conn: psycopg.Connection[Any] | AsyncConnection[Any], error: BaseException | None
    ) -> StoreUnavailableError | None:
        """The error to raise instead of ``error`` when it says the block's connection
        itself was lost (the server ended the session, the network dropped it): the
        store failed, not the job, so its attempt is given back rather than spent. The
        server rolled the transaction back with the session: nothing of it committed."""
        if not isinstance(error, psycopg.OperationalError) or not conn.broken:
            return None
        return StoreUnavailableError(
            f"the connection of job {self._lease.job_id}'s fenced transaction to PostgreSQL "
            f"{self._store.target.where} was lost ({error}); nothing of the block was "
            "committed"
        )

    def _enter_once(self) -> None:
        if self._entered:
            raise StoreError("a fenced transaction can be entered only once")
        self._entered = True

    # -- the steps, written once ----------------------------------------------------------
    def _opening(self) -> Steps[None]:
        """``BEGIN``, the token check and the fences; a refusal rolls back, is recorded
        on its own and raises before the user writes anything."""
        store, lease = self._store, self._lease
        yield Begin()
        try:
            fenced = yield from store._transaction_begin_steps(lease, self._timeout)
            refused = (yield from store.fences_steps(lease, self._fences)) if fenced else None
        except GeneratorExit:  # abandoned by its driver: nothing more may be sent
            raise
        except BaseException as exc:
            yield from _rollback_quietly(exc)
            raise
        if refused is not None:
            # Roll back (psycopg.Rollback ends the block without an error), then record
            # the refusal in its own transaction: it must outlive the rollback.
            yield End(psycopg.Rollback())
            stale = by_attempt(refused.key, DuplicateKind.STALE, "fence", lease, 0.0)
            yield from _on_its_own(store.record_duplicate_steps(stale))
            raise StaleTokenError(
                resource=f"fence {refused.key!r}", token=refused.token, operation="transaction"
            )
        if not fenced:
            yield End(psycopg.Rollback())
            yield from _on_its_own(store._record_stale_steps(lease, "transaction"))
            raise self._stale()

    def _closing(self, error: BaseException | None) -> Steps[None]:
        """After the block: roll back on ``error``; else finish the job as succeeded
        inside the transaction, then commit both. A block that ended the transaction
        itself (see migration 0014) gets :class:`NotSupportedError` either way."""
        status = yield Status()
        if status == TransactionStatus.IDLE:
            # No transaction at all: the block committed (refused by the guard, so its
            # COMMIT failed and rolled back) or rolled back (and maybe committed writes
            # of its own after that, which are beyond reach). psycopg's transaction
            # block is left all the same (its ROLLBACK is a no-op).
            ended = _ended()
            yield from _rollback_quietly(error or ended)
            raise ended from error
        if error is not None:
            if _explicit_end(error) or (
                status == TransactionStatus.INTRANS and not (yield from self._block_open())
            ):
                yield from _rollback_quietly(error)
                raise _ended() from error
            yield from _rollback_quietly(error)
            return
        try:
            if status != TransactionStatus.INTRANS:
                raise StoreError(
                    "a statement of the fenced transaction's block failed and the block "
                    "went on: the transaction can only roll back"
                )
            # The session as a fresh connection's before tokenline's own statements: a
            # SET ROLE or a tiny statement_timeout the block left would otherwise apply
            # to the completion (refused as the store being unreachable, for ever). Done
            # in the transaction, so it also stands for the reset of giving it back.
            yield from execute(RESET)
            completed = yield from self._complete()
        except GeneratorExit:
            raise
        except BaseException as exc:
            yield from _rollback_quietly(exc)
            if isinstance(exc, StaleTokenError):
                yield from _on_its_own(self._store._record_stale_steps(self._lease, "transaction"))
            raise
        yield End()  # COMMIT: the writes and the completion
        self._session_reset = True
        self.wrote = True
        self.committed = completed

    def _block_open(self) -> Steps[bool]:
        """Close the block's guard: whether the transaction the block was given is still
        the one open. After a ROLLBACK in the block, its later statements ran in a new
        transaction (the connection does not autocommit meanwhile), without the guard."""
        return (yield from fetch_one(self._store._q("transaction_block_close"))) is not None

    def _complete(self) -> Steps[bool]:
        """Close the block's guard and finish the job as succeeded inside the
        transaction; whether it was. A block that ended the transaction (the guard is
        gone), or a job rescued while the transaction was open: raise, it all rolls
        back."""
        finish = Finish(self._lease, Outcome.SUCCEEDED)
        block_open, ok = yield from self._store._complete_block_steps(finish)
        if not block_open:
            raise _ended()
        if not ok:
            raise self._stale()
        return True

    def _stale(self) -> StaleTokenError:
        return StaleTokenError(
            resource=f"job {self._lease.job_id}", token=self._lease.token, operation="transaction"
        )


def _ended() -> NotSupportedError:
    """The error of a block that ended, or tried to end, its own transaction."""
    return NotSupportedError(
        "COMMIT or ROLLBACK inside `with ctx.transaction()` is refused: leaving the block "
        "commits its writes together with the job's completion (an exception in it rolls "
        "them back); the transaction was rolled back (a ROLLBACK followed by a COMMIT of "
        "the block's own commits what came between, which tokenline cannot undo)"
    )


def _explicit_end(error: BaseException) -> bool:
    """Whether ``error`` says the block tried to end its transaction: psycopg refusing
    ``conn.commit()`` or ``conn.rollback()`` inside the transaction block, or the server
    an invalid transaction termination (the guard of migration 0014 refusing a COMMIT,
    a COMMIT in a ``DO`` block or a procedure)."""
    if isinstance(error, psycopg.errors.InvalidTransactionTermination):
        return True
    return isinstance(error, psycopg.ProgrammingError) and "within a Transaction context" in str(
        error
    )


def _on_its_own(steps: Steps[None]) -> Steps[None]:
    """``steps`` in a transaction of their own (a record that must outlive the fenced
    transaction's rollback): the connection does not autocommit while it is lent."""
    yield Begin()
    try:
        yield from steps
    except GeneratorExit:
        raise
    except BaseException as exc:
        yield from _rollback_quietly(exc)
        raise
    yield End()


async def _give_back(
    store: PostgresStore,
    conn: AsyncConnection[Any],
    *,
    reset: bool = True,
    discard: bool = False,
) -> None:
    """:meth:`PostgresFencedTransaction._give_back_sync` for the async pool."""
    if discard:
        await conn.close()
        await store._checkin(conn)
        return
    try:
        await take_back_async(conn, reset=reset)
    except psycopg.Error:
        await conn.close()
    finally:
        await store._checkin(conn)


def _rollback_quietly(exc: BaseException) -> Steps[None]:
    """Roll back while ``exc`` propagates; a failing rollback must not mask it."""
    try:
        yield End(exc)
    except Exception as rollback_exc:  # the connection is broken: the pool discards it
        log.warning("rollback of a fenced transaction failed: %s", rollback_exc)


def _error(exc_type: Any, exc: Any) -> BaseException | None:
    """The exception leaving the block, if any (an instance even if only a type came)."""
    if isinstance(exc, BaseException):
        return exc
    return exc_type() if exc_type is not None else None


def _refuse_on_event_loop() -> None:
    """Raise at once on a thread that runs an event loop: the blocking form would stall
    everything the loop runs there (a worker's other jobs, its lease renewals)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise NotSupportedError(_ON_LOOP)
