"""The handler's view of its job: identity, token, cancellation, fenced commits, the
ledger (``effect``, ``fenced``, ``lease``; see ``tokenline/effects.py`` and
``worker/resources.py`` for how they work and what they guarantee), and calls to named
dependencies under their circuit breakers (``dependency``; see
``tokenline/dependencies.py``)."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._clock import Clock
from .._errors import (
    DependencyOpenError,
    FencedError,
    InvalidInputError,
    JobCancelled,
    LeaseExpiredError,
    NotSupportedError,
    Permanent,
    StaleTokenError,
)
from .._jobs import Lease, describe
from .._records import Fence, Start
from ..backpressure import CallOutcome, Permit
from ..dependencies import BreakerBoard, Dependency
from ..effects import (
    DEFAULT_EFFECT_WAIT,
    EffectRun,
    call_claimed,
    decode_result,
    fence_for,
    record_failure,
    running_effect,
    stored_result,
)
from .resources import LeaseScope
from .slot import Slot

if TYPE_CHECKING:
    from .._config import WorkerSettings
    from ..stores.base import FencedTransaction, Store

T = TypeVar("T")
#: Calls kept in sight before those already awaited are dropped from the list.
_HANDED_PRUNE = 64
_CREATED = inspect.CORO_CREATED

__all__ = ["DependencyScope", "JobContext", "LeaseHandle"]


class JobContext:
    """Passed as the first argument to every handler.

    ``token`` is the job's fencing token for this attempt: hand it to your own tables
    (``WHERE last_token < :token``) to refuse writes from a stale attempt.
    """

    def __init__(
        self,
        *,
        slot: Slot,
        store: Store,
        clock: Clock,
        local_fencing: bool,
        settings: WorkerSettings | None = None,
        board: BreakerBoard | None = None,
        max_result_bytes: int | None = None,
    ) -> None:
        self._slot = slot
        #: Longest effect result stored (the app's max_payload_bytes; None: no limit).
        self._max_result_bytes = max_result_bytes
        self._board = board
        #: The last exception a dependency's breaker counted as that dependency's failure.
        self._dependency_error: BaseException | None = None
        #: The coroutines ``ctx.effect``/``ctx.fenced`` handed an async handler, until
        #: it returns: one it never awaited is a fence or effect that never happened.
        self._handed: list[tuple[str, Coroutine[Any, Any, Any]]] = []
        self._store = store
        self._clock = clock
        self._local_fencing = local_fencing
        self._settings = settings
        # Built on the worker's loop: sync handlers reach the store through it.
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        job = slot.claimed.job
        self.job_id: int = job.id
        self.task: str = job.task
        self.queue: str = job.queue
        self.attempt: int = job.attempt
        self.max_attempts: int = job.max_attempts
        self.idempotency_key: str | None = job.idempotency_key
        self.token: int = slot.lease.token

    def __repr__(self) -> str:
        return (
            f"<JobContext job={self.job_id} task={self.task} "
            f"attempt={self.attempt} token={self.token}>"
        )

    @property
    def lease(self) -> LeaseHandle:
        """The job's current lease (``ctx.lease.owner``, ``.token``, ``.expires_at``), and,
        called, a lease on a business resource: ``with ctx.lease("account:42") as l:``."""
        return LeaseHandle(self)

    @property
    def job_lease(self) -> Lease:
        """The job's current lease as a value (its expiry moves with each renewal)."""
        return self._slot.lease

    @property
    def store(self) -> Store:
        """The worker's store (for the ledger helpers; handlers rarely need it)."""
        return self._store

    @property
    def clock(self) -> Clock:
        """The worker's clock."""
        return self._clock

    @property
    def cancelled(self) -> bool:
        """True once the worker has cancelled this job (fenced, timed out, stopping)."""
        return self._slot.cancelled

    def check(self) -> None:
        """Raise if this attempt must stop: cancelled, or its lease is no longer trusted.

        Long sync handlers should call it between steps; every ``ctx`` commit calls it.
        """
        if self._slot.ended:
            why = self._slot.cancel_reason or self._slot.timed_out or "the attempt was stopped"
            raise JobCancelled(f"job {self.job_id} was cancelled by the worker: {why}")
        if self._local_fencing and self._clock.monotonic() >= self._slot.valid_until:
            raise LeaseExpiredError(
                f"job {self.job_id}: the lease (token {self.token}) may have expired by the "
                "worker's own clock; not committing"
            )
        for held in self._slot.resources:
            held.check()

    def refuse_inside_transaction(self, what: str, *, lease: bool = False) -> None:
        """Raise if ``what`` (a ledger write, or with ``lease`` a resource lease) would
        wait for this job's own open transaction, which holds what the write needs
        (SQLite's only write lock, the split ledger's job fence row): refused at once
        instead of hanging until the store's timeout, attempt after attempt."""
        caps = self._store.capabilities
        waits = caps.lease_waits_for_transaction if lease else caps.ledger_waits_for_transaction
        if self._slot.in_transaction and waits:
            raise NotSupportedError(
                f"{what} inside ctx.transaction() on {type(self._store).__name__} would wait "
                "for the transaction's own locks: call it before or after the "
                "transaction, or use ctx.transaction(fence=...) for fences"
            )

    @property
    def placeholder(self) -> str:
        """The parameter marker of the connection ``ctx.transaction()`` hands you: ``?``
        (SQLite, memory) or ``%s`` (PostgreSQL), for SQL that runs on every store."""
        return self._store.capabilities.placeholder

    def _hand(self, what: str, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """Give ``coro`` to the async handler that called ``what``, keeping sight of it
        until the handler returns (see :meth:`never_awaited`)."""
        handed = self._handed
        if len(handed) >= _HANDED_PRUNE:
            # A handler awaiting calls in a long loop: forget those already started.
            handed[:] = [(w, c) for w, c in handed if inspect.getcoroutinestate(c) == _CREATED]
        handed.append((what, coro))
        return coro

    def never_awaited(self) -> list[str]:
        """The ``ctx`` calls whose coroutine the handler never awaited (closed here, so
        nothing warns later), oldest first; forgets them all."""
        missed = []
        for what, coro in self._handed:
            if inspect.getcoroutinestate(coro) == _CREATED:
                coro.close()
                missed.append(what)
        self._handed.clear()
        return missed

    @staticmethod
    def _on_loop() -> bool:
        """Whether the caller runs on an event loop (an async handler's task)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def run_sync(self, coro: Coroutine[Any, Any, T], instead: str) -> T:
        """Run ``coro`` on the worker's loop from a sync handler's thread and wait for it.

        From the loop itself this would deadlock, so it raises, naming ``instead``.
        """
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is not None:
            coro.close()
            raise NotSupportedError(
                f"this is the sync form, for sync handlers; in an async handler use {instead}"
                if running is not None
                else "this job context has no worker loop to reach the store through"
            )
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:
            # The loop is closed: the worker stopped while this thread ran on (a thread
            # it could not stop). Closed here, the coroutine is not reported as never
            # awaited; the attempt is over.
            coro.close()
            raise JobCancelled(
                f"job {self.job_id}: its worker has stopped (its event loop is closed)"
            ) from None
        return future.result()

    # -- ledger ---------------------------------------------------------------------------
    def effect(
        self,
        key: str,
        fn: Callable[..., T],
        /,
        *args: Any,
        wait: float = DEFAULT_EFFECT_WAIT,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` at most once per ``key`` and return its result; a
        repeat of a completed key returns the stored result without calling ``fn``.

        One name for both kinds of handler: ``ctx.effect(...)`` in a sync handler (``fn``
        runs in the handler's thread), ``await ctx.effect(...)`` in an async one (``fn``
        may then be a coroutine function). The result must be JSON; what comes back is
        the JSON value (a tuple comes back as a list), the same on the first run and on
        repeats. ``wait``: seconds to wait for another live attempt running the same key.
        ``fn`` can read the key from :func:`tokenline.current_effect` to hand it to an
        external API. See ``tokenline/effects.py`` for what is and is not guaranteed.
        """
        if self._on_loop():
            return self._hand("ctx.effect", self.effect_async(key, fn, *args, wait=wait, **kwargs))
        self.check()
        self.refuse_inside_transaction("ctx.effect")
        require_callable(f"ctx.effect({key!r}, ...)", fn)
        refuse_async_callee(f"ctx.effect({key!r}, ...)", fn)
        run = self._effect_run(key, wait)
        slot = self._slot
        # Marked from the claim on: once the claim is sent, the key may be pending under
        # this attempt, and the worker must not give the job back meanwhile.
        slot.effect_key, slot.effect_since = run.key, self._clock.monotonic()
        try:
            begin = self.run_sync(run.claim(), "await ctx.effect_async(...)")
            if begin.start is Start.DONE:
                assert begin.record is not None
                return stored_result(run.key, begin.record)
            try:
                self._unless_stopped_while_claiming()
                with running_effect(run.call):
                    # Recorded as a failure, not a result: the awaitable never ran, so a
                    # later attempt may run the key.
                    value = refuse_awaitable(f"ctx.effect({key!r}, ...)", fn(*args, **kwargs))
            except BaseException as exc:
                self.run_sync(record_failure(run, exc), "await ctx.effect_async(...)")
                raise
            return self.run_sync(run.completed(value), "await ctx.effect_async(...)")
        finally:
            slot.effect_key = None  # the key is recorded, or left for the reconciler

    async def effect_async(
        self,
        key: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        wait: float = DEFAULT_EFFECT_WAIT,
        **kwargs: Any,
    ) -> Any:
        """:meth:`effect` in an async handler, by its explicit name: ``fn`` may be a
        coroutine function (awaited) or a plain one (called on the event loop: keep it
        quick)."""
        self.check()
        self.refuse_inside_transaction("ctx.effect_async")
        require_callable(f"ctx.effect_async({key!r}, ...)", fn)
        run = self._effect_run(key, wait)
        slot = self._slot
        # As the sync handler's effect_key: a drain timeout waits for this effect rather
        # than cancel it (Worker._effects_over_at_drain).
        slot.effect_awaited, slot.effect_since = run.key, self._clock.monotonic()
        try:
            begin = await run.claim()
            if begin.start is Start.DONE:
                assert begin.record is not None
                return stored_result(run.key, begin.record)
            try:
                self._unless_stopped_while_claiming()
            except BaseException as exc:
                await record_failure(run, exc)
                raise
            return await call_claimed(run, fn, *args, **kwargs)
        finally:
            slot.effect_awaited = None

    def _unless_stopped_while_claiming(self) -> None:
        """Raise if the worker ended the attempt while its effect's key was being
        claimed (a drain timeout, a hard timeout): the callee is then not started, and
        the key, recorded failed, stays free to run; a claim waiting for another
        attempt's key stops waiting, having taken nothing."""
        if self._slot.ended:
            self.check()

    def _effect_run(self, key: str, wait: float) -> EffectRun:
        return EffectRun(
            self._store,
            self.job_lease,
            key,
            clock=self._clock,
            wait=wait,
            max_bytes=self._max_result_bytes,
            trusted=self._lease_trusted,
            ended=self._unless_stopped_while_claiming,
        )

    def _lease_trusted(self) -> bool:
        """The job's lease is still within its trust window by the worker's clock (with
        or without local fencing): no other attempt can have the job yet."""
        return self._clock.monotonic() < self._slot.valid_until

    def _fence(self, key: str) -> Fence:
        held = next((h for h in self._slot.resources if h.resource == key), None)
        if held is not None:
            return fence_for(key, held.token, held.resource, held.owner)
        return fence_for(key, self.token, None, None)

    async def fenced_async(self, key: str) -> int:
        """Record this attempt's token as the highest that wrote ``key`` and return it, or
        raise :class:`StaleTokenError` when a higher one already has (async handlers).

        The token is the resource lease's when ``ctx.lease(key)`` is held, else the
        job's: fence a key written by many jobs through a resource lease, since tokens
        of different jobs cannot be compared. Carry the returned token into your own
        rows (``WHERE last_token <= :token``).
        """
        self.check()
        self.refuse_inside_transaction("ctx.fenced")
        fence = self._fence(key)
        if not await self._store.fence_write(lease=self.job_lease, fence=fence):
            exc = StaleTokenError(resource=f"fence {key!r}", token=fence.token, operation="fence")
            # Under a resource lease's token: a later holder of that lease wrote.
            exc.held_resource = fence.resource
            raise exc
        return fence.token

    def fenced(self, key: str) -> Any:
        """:meth:`fenced_async` under one name for both kinds of handler:
        ``ctx.fenced(key)`` in a sync handler, ``await ctx.fenced(key)`` in an async one."""
        if self._on_loop():
            return self._hand("ctx.fenced", self.fenced_async(key))
        return self.run_sync(self.fenced_async(key), "await ctx.fenced(...)")

    def resource_lease(
        self, resource: str, *, ttl: float | None = None, wait: float = 0.0
    ) -> LeaseScope:
        """``ctx.lease(resource, ...)``: a lease on a business resource — one holder at a
        time across all workers, with its own monotonic token; ``with`` in sync handlers,
        ``async with`` in async ones.

        ``ttl`` defaults to the worker's job lease TTL; the control plane renews the
        lease while it is held. ``wait``: seconds to keep trying while someone else holds
        it (default: one try), then :class:`~tokenline.LeaseBusyError`. See
        ``worker/resources.py``.
        """
        settings = self._settings
        default_ttl = settings.lease_ttl if settings is not None else 30.0
        min_ttl = 3 * settings.renew_period if settings is not None else 0.0
        return LeaseScope(
            self,
            self._slot,
            resource,
            ttl=default_ttl if ttl is None else ttl,
            wait=wait,
            min_ttl=min_ttl,
        )

    def dependency(self, name: str) -> DependencyScope:
        """One call to the named dependency under its circuit breaker and timeout:
        ``with ctx.dependency("payments-api"):`` in sync handlers, ``async with`` in async
        ones, or ``.call(fn, *args)`` / ``await .call_async(fn, *args)``.

        Raises :class:`~tokenline.DependencyOpenError` instead of calling while the
        breaker is open (the job is given back, no attempt spent), and
        :class:`~tokenline.InvalidInputError` for a name ``app.dependency`` did not
        register. See ``tokenline/dependencies.py``.
        """
        board = self._board
        if board is None:
            raise NotSupportedError("this job context has no worker to keep breakers in")
        return DependencyScope(self, board, name)

    def blames_dependency(self, exc: BaseException) -> bool:
        """Whether ``exc`` is, or was raised from, a failure a dependency's breaker
        counted (the worker leaves those out of its error window: the breaker is the
        narrower pause)."""
        current: BaseException | None = exc
        for _ in range(8):  # a cause chain, not a cycle
            if current is None:
                return False
            if current is self._dependency_error:
                return True
            current = current.__cause__
        return False

    def transaction(self, *, fence: str | Sequence[str] = ()) -> _ContextTransaction:
        """A store transaction that verifies this attempt's token first and completes the
        job on commit, together with your writes: the business effect happens once.

        ``with ctx.transaction() as conn:`` in sync handlers, ``async with`` in async
        handlers, on every store. ``conn`` is the store's own driver connection:
        ``sqlite3`` (SQLite, and the in-memory store's private database), ``psycopg``
        (PostgreSQL: sync or async to match); write parameters with
        :attr:`placeholder`. A stale token raises :class:`StaleTokenError` before any of
        your writes; an exception inside the block rolls everything back. ``fence``: keys to
        advance in the same transaction, as :meth:`fenced` does (a lower token than
        the highest that wrote is refused before any of your writes).
        """
        keys = [fence] if isinstance(fence, str) else list(fence)
        fences = [self._fence(k) for k in keys]
        return _ContextTransaction(self, self._slot, self._store, fences)


class LeaseHandle:
    """What ``ctx.lease`` is: the job's lease, read through attributes, and a factory of
    resource leases when called (see :meth:`JobContext.resource_lease`)."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: JobContext) -> None:
        self._ctx = ctx

    def __call__(self, resource: str, *, ttl: float | None = None, wait: float = 0.0) -> LeaseScope:
        """A lease on ``resource``: ``with``/``async with`` it."""
        return self._ctx.resource_lease(resource, ttl=ttl, wait=wait)

    @property
    def job_id(self) -> int:
        """The job's id."""
        return self._ctx.job_lease.job_id

    @property
    def owner(self) -> str:
        """The worker holding the job."""
        return self._ctx.job_lease.owner

    @property
    def token(self) -> int:
        """The job's fencing token for this attempt."""
        return self._ctx.job_lease.token

    @property
    def expires_at(self) -> float:
        """When the store lets the job's lease go unless renewed (epoch seconds)."""
        return self._ctx.job_lease.expires_at

    def __repr__(self) -> str:
        return repr(self._ctx.job_lease)


def _outcome(exc: BaseException | None) -> CallOutcome | None:
    """How an exception out of a dependency block counts (see ``dependencies.py``)."""
    if exc is None:
        return CallOutcome.OK
    if isinstance(exc, TimeoutError):
        return CallOutcome.TIMEOUT
    if not isinstance(exc, Exception) or isinstance(
        exc, Permanent | FencedError | DependencyOpenError
    ):
        return None
    return CallOutcome.FAILED


class DependencyScope:
    """``ctx.dependency(name)``: one call to a dependency under its breaker.

    ``with`` in sync handlers, ``async with`` in async ones (each use is one call), or
    :meth:`call` / :meth:`call_async`. Entering raises
    :class:`~tokenline.DependencyOpenError` when the breaker holds the call back; the
    outcome of the block is counted on leaving (see ``tokenline/dependencies.py``).
    """

    def __init__(self, ctx: JobContext, board: BreakerBoard, name: str) -> None:
        self.dependency = board.dependencies.require(name)
        self._ctx = ctx
        self._board = board
        self._permit: Permit | None = None
        self._started = 0.0
        self._timeout: asyncio.Timeout | None = None

    def _check(self) -> None:
        if self._permit is not None:
            raise NotSupportedError("a ctx.dependency(...) scope is one call: ask for another")
        self._ctx.check()  # a cancelled or fenced attempt calls nobody

    def _begin(self, permit: Permit) -> None:
        self._permit = permit
        self._started = self._board.clock.monotonic()

    def __enter__(self) -> Dependency:
        if self._ctx._on_loop():
            raise NotSupportedError(
                "`with ctx.dependency()` in an async handler would block the event loop: "
                "use `async with ctx.dependency(...)`"
            )
        self._check()
        name = self.dependency.name
        self._begin(self._ctx.run_sync(self._board.admit(name), "async with ctx.dependency()"))
        return self.dependency

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        permit, seconds = self._permit, self._board.clock.monotonic() - self._started
        assert permit is not None
        outcome = _outcome(exc)
        if outcome is not None and seconds > self.dependency.timeout:
            outcome = CallOutcome.TIMEOUT  # a sync call is not interrupted, only counted
        name = self.dependency.name
        finish = self._board.finish(name, permit, outcome, seconds)
        counted = self._ctx.run_sync(finish, "async with ctx.dependency()")
        self._blame(exc, counted)

    def _blame(self, exc: BaseException | None, counted: CallOutcome | None) -> None:
        if exc is not None and counted is not None and counted.is_bad:
            self._ctx._dependency_error = exc

    async def __aenter__(self) -> Dependency:
        self._check()
        self._begin(await self._board.admit(self.dependency.name))
        self._timeout = asyncio.timeout(self.dependency.timeout)
        await self._timeout.__aenter__()
        return self.dependency

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        permit, timeout = self._permit, self._timeout
        assert permit is not None
        assert timeout is not None
        seconds = self._board.clock.monotonic() - self._started
        name = self.dependency.name
        try:
            await timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as expired:
            late = TimeoutError(
                f"dependency {name!r} did not answer within {self.dependency.timeout:g}s"
            )
            self._blame(late, await self._board.finish(name, permit, CallOutcome.TIMEOUT, seconds))
            raise late from expired
        outcome = _outcome(exc)
        if outcome is None and isinstance(exc, asyncio.CancelledError):
            self._board.finish_soon(name, permit)
        else:
            self._blame(exc, await self._board.finish(name, permit, outcome, seconds))

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` as one call to the dependency (sync handlers)."""
        what = f"ctx.dependency({self.dependency.name!r}).call(...)"
        if self._ctx._on_loop():
            # Before the callee is looked at: the form, not the callee, is what is wrong.
            raise NotSupportedError(
                f"{what} is the sync form, for sync handlers; in an async handler use "
                f"`await ctx.dependency({self.dependency.name!r}).call_async(...)`"
            )
        require_callable(what, fn)
        refuse_async_callee(what, fn)
        with self:
            value = fn(*args, **kwargs)
        # Outside the call: an awaitable handed back is the handler's mistake, not a
        # failure of the dependency for its breaker to count.
        return refuse_awaitable(what, value)

    async def call_async(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, awaited if it returns an awaitable, as one call to the
        dependency under its timeout (async handlers)."""
        require_callable(f"ctx.dependency({self.dependency.name!r}).call_async(...)", fn)
        async with self:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return result


def require_callable(what: str, fn: object) -> None:
    """Refuse a ``fn`` that cannot be called, before anything is claimed or counted:
    called, its ``TypeError`` came after the effect's key was taken (and recorded as
    failed, as if the callee had run), or inside a dependency's call (a failure for its
    breaker to count)."""
    if not callable(fn):
        got = f"{type(fn).__name__} {describe(fn)}"
        raise InvalidInputError(f"{what} needs a function to call, got {got}")


def refuse_async_callee(what: str, fn: Callable[..., Any]) -> None:
    """Refuse a coroutine function given to the sync form ``what``: a handler's thread
    cannot await it, so it would never run while the call looked done."""
    # An object whose __call__ is async is one too (read from its type, as a call does).
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - not a callable test
    if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call)):
        raise NotSupportedError(
            f"{what} in a sync handler was given {_callee_name(fn)}, a coroutine function "
            "that this thread cannot await, so it would never run: make the handler "
            "`async def` and await the call, or pass a plain function"
        )


def refuse_awaitable(what: str, value: T) -> T:
    """``value``, unless it is an awaitable returned to the sync form ``what`` (then
    closed unrun, and refused as :func:`refuse_async_callee` refuses its function)."""
    if inspect.isawaitable(value) or inspect.isasyncgen(value):
        if inspect.iscoroutine(value):
            value.close()  # never started: nothing ran, and no "never awaited" warning
        raise NotSupportedError(
            f"{what} in a sync handler got an awaitable back ({type(value).__name__}), "
            "which this thread cannot await, so its work never ran: make the handler "
            "`async def` and await the call, or pass a plain function"
        )
    return value


def _callee_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return repr(name) if isinstance(name, str) else repr(type(fn).__name__)


class _ContextTransaction:
    """Adds the worker's own checks around a store's fenced transaction."""

    def __init__(
        self, ctx: JobContext, slot: Slot, store: Store, fences: Sequence[Fence] = ()
    ) -> None:
        self._ctx = ctx
        self._slot = slot
        self._store = store
        self._fences = fences
        self._inner: FencedTransaction | None = None

    def _begin(self) -> FencedTransaction:
        self._ctx.check()
        if self._slot.completed_in_transaction or self._slot.done_in_ledger:
            raise FencedError(f"job {self._ctx.job_id} already completed in a transaction")
        if self._slot.in_transaction:
            raise NotSupportedError(
                f"job {self._ctx.job_id} already has a ctx.transaction() open: "
                "do all the job's writes in one transaction"
            )
        # The store may keep the transaction open as long as the attempt may run.
        remaining = self._slot.deadline - self._ctx.clock.monotonic()
        open_for = None if math.isinf(remaining) else max(0.0, remaining) + 1.0
        self._inner = self._store.fenced_transaction(
            lease=self._slot.lease, fences=self._fences, timeout=open_for
        )
        self._slot.in_transaction = True
        return self._inner

    def _verdict(self, exc_type: Any) -> tuple[Any, BaseException | None]:
        """Before committing, check once more that the attempt may still commit."""
        if exc_type is not None:
            return exc_type, None
        try:
            self._ctx.check()
        except FencedError as exc:
            return type(exc), exc
        return None, None

    def __enter__(self) -> Any:
        if self._ctx._on_loop():
            # Blocking calls on the event loop would stop the worker's control plane.
            raise NotSupportedError(
                "`with ctx.transaction()` in an async handler would block the event loop: "
                "use `async with ctx.transaction() as conn:`"
            )
        inner = self._begin()
        try:
            return inner.__enter__()
        except BaseException:
            self._slot.in_transaction = False
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        inner = self._inner
        assert inner is not None
        kind, err = self._verdict(exc_type)
        try:
            inner.__exit__(kind, err or exc, tb)
        finally:
            self._slot.in_transaction = False
        self._slot.completed_in_transaction = inner.committed
        self._slot.done_in_ledger = inner.wrote and not inner.committed
        if err is not None:
            raise err

    async def __aenter__(self) -> Any:
        inner = self._begin()
        try:
            return await inner.__aenter__()
        except BaseException:
            self._slot.in_transaction = False
            raise

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        inner = self._inner
        assert inner is not None
        kind, err = self._verdict(exc_type)
        try:
            await inner.__aexit__(kind, err or exc, tb)
        finally:
            self._slot.in_transaction = False
        self._slot.completed_in_transaction = inner.committed
        self._slot.done_in_ledger = inner.wrote and not inner.committed
        if err is not None:
            raise err


def decode_args(raw: str) -> tuple[list[Any], dict[str, Any]]:
    """Split a stored payload into positional and keyword arguments."""
    payload = decode_result(raw)
    if not isinstance(payload, dict):
        raise ValueError("payload is not a JSON object")
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("payload args must be a list and kwargs an object")
    return args, kwargs
