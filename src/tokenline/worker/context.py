"""The handler's view of its job: identity, token, cancellation and fenced commits."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._clock import Clock
from .._errors import FencedError, JobCancelled, LeaseExpiredError
from .._jobs import ClaimedJob, Lease

if TYPE_CHECKING:
    import asyncio

    from ..stores.base import FencedTransaction, Store

__all__ = ["JobContext"]


@dataclass(eq=False)
class Slot:
    """A worker's bookkeeping for one in-flight job (private to the worker)."""

    claimed: ClaimedJob
    lease: Lease
    #: Monotonic deadline after which the worker no longer trusts its lease.
    valid_until: float
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None
    task: asyncio.Task[None] | None = None
    completed_in_transaction: bool = False
    #: Its outcome is being committed: a renewal refused meanwhile means nothing.
    finishing: bool = False


class JobContext:
    """Passed as the first argument to every handler.

    ``token`` is the job's fencing token for this attempt: hand it to your own tables
    (``WHERE last_token < :token``) to refuse writes from a stale attempt.
    """

    def __init__(self, *, slot: Slot, store: Store, clock: Clock, local_fencing: bool) -> None:
        self._slot = slot
        self._store = store
        self._clock = clock
        self._local_fencing = local_fencing
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
    def lease(self) -> Lease:
        """The job's current lease (its expiry moves with each renewal)."""
        return self._slot.lease

    @property
    def cancelled(self) -> bool:
        """True once the worker has cancelled this job (fenced, timed out, stopping)."""
        return self._slot.cancel.is_set()

    def check(self) -> None:
        """Raise if this attempt must stop: cancelled, or its lease is no longer trusted.

        Long sync handlers should call it between steps; every ``ctx`` commit calls it.
        """
        if self._slot.cancel.is_set():
            raise JobCancelled(
                f"job {self.job_id} was cancelled by the worker: {self._slot.cancel_reason}"
            )
        if self._local_fencing and self._clock.monotonic() >= self._slot.valid_until:
            raise LeaseExpiredError(
                f"job {self.job_id}: the lease (token {self.token}) may have expired by the "
                "worker's own clock; not committing"
            )

    def transaction(self) -> _ContextTransaction:
        """A store transaction that verifies this attempt's token first and completes the
        job on commit, together with your writes: the business effect happens once.

        ``with ctx.transaction() as conn:`` in sync handlers (SQLite), ``async with`` in
        async handlers. A stale token raises :class:`StaleTokenError` before any of your
        writes; an exception inside the block rolls everything back.
        """
        return _ContextTransaction(self, self._slot, self._store)


class _ContextTransaction:
    """Adds the worker's own checks around a store's fenced transaction."""

    def __init__(self, ctx: JobContext, slot: Slot, store: Store) -> None:
        self._ctx = ctx
        self._slot = slot
        self._store = store
        self._inner: FencedTransaction | None = None

    def _begin(self) -> FencedTransaction:
        self._ctx.check()
        if self._slot.completed_in_transaction:
            raise FencedError(f"job {self._ctx.job_id} already completed in a transaction")
        self._inner = self._store.fenced_transaction(lease=self._slot.lease)
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
        return self._begin().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        inner = self._inner
        assert inner is not None
        kind, err = self._verdict(exc_type)
        inner.__exit__(kind, err or exc, tb)
        self._slot.completed_in_transaction = inner.committed
        if err is not None:
            raise err

    async def __aenter__(self) -> Any:
        return await self._begin().__aenter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        inner = self._inner
        assert inner is not None
        kind, err = self._verdict(exc_type)
        await inner.__aexit__(kind, err or exc, tb)
        self._slot.completed_in_transaction = inner.committed
        if err is not None:
            raise err


def decode_args(raw: str) -> tuple[list[Any], dict[str, Any]]:
    """Split a stored payload into positional and keyword arguments."""
    payload = json.loads(raw)
    if not isinstance(payload, dict):
        raise ValueError("payload is not a JSON object")
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("payload args must be a list and kwargs an object")
    return args, kwargs
