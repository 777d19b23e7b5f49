"""Exactly-once business effects for handlers: ``ctx.effect``, fences and their helpers.

``ctx.effect(key, fn, *args)`` runs ``fn`` at most once per ``key`` across every attempt
of every job, and returns its result; a repeat returns the stored result instead::

    @app.task
    def send_receipt(ctx, order_id):                       # sync handler
        ctx.effect(f"receipt:{order_id}", mailer.send, order_id)

    @app.task
    async def charge(ctx, order_id, cents):                # async handler
        key = f"charge:{order_id}"
        await ctx.effect_async(key, psp.charge, cents, idempotency_key=key)

How one call goes (the store's side is in ``stores/base.py``):

1. **Claim.** In one transaction the store checks this attempt's job token, then takes
   the key as ``pending`` under ``(job, token)``: if it is new, ``failed``, or pending
   under an attempt that lost its lease (within one job: only a newer token takes over).
   A ``completed`` key returns its stored result without running ``fn`` and records a
   *repeat* duplicate. A key pending under a live attempt is waited for (``wait``
   seconds, then :class:`EffectPendingError`: the job is retried later). A refusal raises
   :class:`StaleTokenError` and is recorded.
2. **Run** ``fn`` — in the handler's thread (sync) or task (async). While it runs,
   :func:`current_effect` tells it the key, job and token.
3. **Record** ``completed`` with the JSON of the result, or ``failed`` with the error,
   only if the key is still pending under this ``(job, token)``. A result that cannot
   be stored (not JSON, or over ``max_payload_bytes``) is recorded ``completed``
   *without* a result, for ``fn`` has run: the attempt fails with
   :class:`PayloadError`, and a repeat raises :class:`PayloadError` too, saying so,
   instead of running ``fn`` again. The job's lease is not
   re-checked here: the effect has happened, and refusing its record would only make it
   happen again. If a newer attempt took the key over meanwhile, the record is refused
   (recorded) and :class:`StaleTokenError` raised.

What is guaranteed, precisely:

* In the ledger, a key is ``completed`` at most once, by one ``(job, token)``; every
  later execution of that key is recorded as a repeat and returns the stored result.
* ``fn`` itself starts at most once per key *unless* an attempt loses its lease while
  ``fn`` runs (a crash, a partition, a pause past its TTL): then a newer attempt runs it
  again. A sync handler's hard timeout is no such loss: its thread runs on, so the
  worker keeps the attempt, lease renewed, until the effect is over (at most
  ``effect_pending_deadline`` after it began; see ``Worker._effect_over``). Nor is a
  stop: at the drain timeout of a first SIGTERM, handlers inside an effect, sync or
  async, are waited for the same way (``Worker._effects_over_at_drain``); a second
  SIGTERM stops at once, and is such a loss. tokenline
  cannot undo or fence a call that left the process (an email, a payment API). Hand
  the key to the callee (``idempotency_key=key``, or ``current_effect().key``) so that
  it deduplicates too; that, not tokenline, is what makes such an effect exactly-once.
* For writes to the store's own database, use ``ctx.transaction()``: the token check,
  your writes and the job's completion commit in one transaction (exactly-once).

**Fences** carry a token into data the ledger does not own. ``ctx.fenced(key)`` records
the attempt's token (or, inside ``ctx.lease(key)``, the resource lease's token) as the
highest that wrote ``key``, refusing a lower one with :class:`StaleTokenError`;
``ctx.transaction(fence=key)`` does the same inside the transaction. Carry the same token
into your own tables::

    UPDATE accounts SET balance = :balance, last_token = :token
    WHERE id = :id AND last_token <= :token      -- zero rows: a newer holder wrote first

and pass the row count to :func:`require_fenced`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import events
from ._errors import (
    EffectPendingError,
    InvalidInputError,
    PayloadError,
    StaleTokenError,
    StoreUnavailableError,
    TokenlineError,
)
from ._jobs import error_text, exception_text
from ._records import EffectBegin, EffectRecord, EffectStatus, Fence, Start, validate_key

if TYPE_CHECKING:
    from ._clock import Clock
    from ._jobs import Lease
    from .stores.base import Store

__all__ = [
    "DEFAULT_EFFECT_WAIT",
    "EffectCall",
    "EffectRun",
    "call_claimed",
    "current_effect",
    "decode_result",
    "encode_result",
    "fence_for",
    "record_failure",
    "require_fenced",
    "run_effect",
    "run_effect_as",
    "stored_result",
]

log = logging.getLogger("tokenline.ledger")

#: How long ``ctx.effect`` waits, by default, for another live attempt to finish the
#: same key before giving up with :class:`EffectPendingError` (seconds).
DEFAULT_EFFECT_WAIT = 30.0
#: Longest pause between two looks at a key pending under another attempt.
_POLL_CAP = 1.0
#: First pause before a record of an effect's outcome is tried again.
_RECORD_PAUSE = 0.05

_CURRENT: contextvars.ContextVar[EffectCall | None] = contextvars.ContextVar(
    "tokenline_effect", default=None
)


def _finite(seconds: float) -> bool:
    """``seconds`` is a number from 0 that a float holds (not NaN, not endless)."""
    try:
        return 0 <= float(seconds) < math.inf
    except OverflowError:
        return False


@dataclass(frozen=True, slots=True)
class EffectCall:
    """The effect being run: give ``key`` to an external API so it can deduplicate."""

    key: str
    job_id: int
    token: int


def current_effect() -> EffectCall | None:
    """The effect ``ctx.effect`` is running in this thread or task, else ``None``."""
    return _CURRENT.get()


#: The effects running in this thread or task, outermost first: an effect run from inside
#: one of its own key could only wait for itself.
_RUNNING: contextvars.ContextVar[tuple[EffectCall, ...]] = contextvars.ContextVar(
    "tokenline_effects_running", default=()
)


@contextlib.contextmanager
def running_effect(call: EffectCall) -> Iterator[None]:
    """Make ``call`` the :func:`current_effect` for the duration of the block."""
    reset = _CURRENT.set(call)
    outer = _RUNNING.set((*_RUNNING.get(), call))
    try:
        yield
    finally:
        _RUNNING.reset(outer)
        _CURRENT.reset(reset)


def encode_result(key: str, value: Any, max_bytes: int | None = None) -> str:
    """The JSON text stored for an effect's result; :class:`PayloadError` if it has none,
    or if it is longer than ``max_bytes`` (UTF-8)."""
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        why = str(exc)
        if "integer string conversion" in why:
            # Python's own words advise raising its limit, which is not ours to change.
            why = (
                f"it holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                "which Python does not write as text"
            )
        raise PayloadError(
            f"the result of effect {key!r} cannot be stored as JSON ({why}); return a JSON "
            "value (dict, list, str, number, bool or None) from the effect"
        ) from None
    # Characters bound bytes from below (at most 4 bytes each): encode only when needed.
    if max_bytes is not None and len(text) * 4 > max_bytes:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise PayloadError(
                f"the result of effect {key!r} is {size} bytes of JSON, over the limit of "
                f"{max_bytes} (setting max_payload_bytes); return less from the effect"
            )
    return text


def decode_result(text: str | None) -> Any:
    """The value of a stored result (``None`` for an effect that returned nothing)."""
    return None if text is None else json.loads(text)


def stored_result(key: str, record: EffectRecord) -> Any:
    """What a repeat of the completed effect ``key`` returns: its stored result, or
    :class:`PayloadError` if it ran but its result could not be stored."""
    if record.result is None:
        # Results are stored as JSON text ("null" for None): no text means unstorable.
        raise PayloadError(
            f"effect {key!r} ran once (job {record.job_id}, token {record.token}), but its "
            "result could not be stored; it does not run again, so there is no result"
        )
    return json.loads(record.result)


def require_fenced(rowcount: int, *, resource: str, token: int) -> None:
    """Raise :class:`StaleTokenError` when a fenced write to your own table matched no
    row (``… WHERE last_token <= :token``): a newer token has written there first."""
    if rowcount < 1:
        raise StaleTokenError(resource=resource, token=token, operation="fenced write")


class EffectRun:
    """One ``ctx.effect`` call against a store: claim the key, then record the outcome.

    The async core of both facades: ``ctx.effect`` (sync handlers, which run ``fn`` in
    their own thread between the two steps) and ``ctx.effect_async``.
    """

    def __init__(
        self,
        store: Store,
        lease: Lease,
        key: str,
        *,
        clock: Clock,
        wait: float,
        max_bytes: int | None = None,
        trusted: Callable[[], bool] | None = None,
        ended: Callable[[], None] | None = None,
    ) -> None:
        self.key = validate_key(key, "effect key")
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not _finite(wait):
            # An endless wait would outlive the attempt: give a number of seconds.
            raise InvalidInputError(f"wait must be a finite number of seconds >= 0, got {wait!r}")
        if any(c.key == self.key and c.job_id == lease.job_id for c in _RUNNING.get()):
            # Its key is pending under this very attempt, which would wait for itself
            # until `wait` ran out, on every attempt: refused at once, as a bug.
            raise InvalidInputError(
                f"effect {self.key!r} is called from inside itself: an effect cannot run "
                "its own key again before it has returned"
            )
        self.store = store
        self.lease = lease
        self.clock = clock
        self.wait = float(wait)
        #: Longest result stored, in bytes of JSON (None: no limit).
        self.max_bytes = max_bytes
        #: Whether the attempt still trusts its job lease: while it does, a record of
        #: the outcome that the store could not take is tried again (see _record).
        self.trusted = trusted
        #: Raises once the worker has ended the attempt (a drain timeout): the claim then
        #: stops waiting for another attempt's key, having taken nothing.
        self.ended = ended

    @property
    def call(self) -> EffectCall:
        """What :func:`current_effect` shows while the callee runs."""
        return EffectCall(self.key, self.lease.job_id, self.lease.token)

    def _stale(self, operation: str) -> StaleTokenError:
        return StaleTokenError(
            resource=f"effect {self.key!r}", token=self.lease.token, operation=operation
        )

    def _duplicate(self, kind: str) -> None:
        if events.enabled():
            lease = self.lease
            events.emit(events.DuplicateExecution(lease.owner, lease.job_id, self.key, kind))

    async def claim(self) -> EffectBegin:
        """``RUN`` (run the callee now) or ``DONE`` (the stored record); raises on a refusal
        or once a live attempt has held the key for longer than ``wait``."""
        deadline = self.clock.monotonic() + self.wait
        pause = 0.01
        while True:
            begin = await self.store.effect_begin(lease=self.lease, key=self.key)
            if begin.start is Start.RUN:
                return begin
            if begin.start is Start.DONE:
                self._duplicate("repeat")  # the store recorded it too
                return begin
            if begin.start is Start.STALE:
                self._duplicate("stale")
                raise self._stale("effect")
            if self.ended is not None:
                # Pending under another live attempt, nothing taken: a stopping worker
                # gives this job back now rather than wait out `wait` for that one.
                self.ended()
            left = deadline - self.clock.monotonic()
            if left <= 0 or not math.isfinite(left):
                owner = begin.record.owner if begin.record else "another attempt"
                raise EffectPendingError(
                    f"effect {self.key!r} is pending under {owner}, whose lease is live; "
                    f"gave up after waiting {self.wait:g}s (the job will be retried)"
                )
            # Polling: the store has no event for another process's commit.
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_CAP)

    async def completed(self, value: Any) -> Any:
        """Record ``value`` as the result; return it as a repeat would see it (decoded)."""
        try:
            text = encode_result(self.key, value, self.max_bytes)
        except PayloadError as exc:
            # The effect ran: recorded failed, the key would run it again. Completed
            # without a result, it never runs again, and a repeat says why it has none.
            log.error("effect %r ran, but its result is not stored: %s", self.key, exc)
            if not await self._record(None):
                raise self._stale("effect_complete") from exc
            raise
        if not await self._record(text):
            raise self._stale("effect_complete")
        return decode_result(text)

    async def _record(self, text: str | None) -> bool:
        """Mark the key completed (with ``text``, the result's JSON, if any), trying again
        while the store is unavailable and the attempt still trusts its lease.

        The callee has run: left pending, the key would be taken over by the attempt
        that runs the job next, and run again, although this attempt's lease never
        lapsed. A try whose answer was lost may have been committed: before each new
        try, the key's record says whether it was.
        """
        pause = _RECORD_PAUSE
        tried = False
        while True:
            try:
                if tried:
                    records = await self.store.effects_list(key=self.key, limit=1)
                    record = records[0] if records else None
                    if (
                        record is not None
                        and record.status is EffectStatus.COMPLETED
                        and (record.job_id, record.token) == (self.lease.job_id, self.lease.token)
                    ):
                        return True
                tried = True
                return await self.store.effect_finish(lease=self.lease, key=self.key, result=text)
            except StoreUnavailableError as exc:
                if self.trusted is None or not self.trusted():
                    raise
                if events.enabled():
                    # Retried in the attempt, it never reaches the worker's own count.
                    events.emit(
                        events.CoordinationFailed(
                            self.lease.owner, "ledger", f"effect {self.key!r}", str(exc)
                        )
                    )
                log.warning(
                    "effect %r ran, but its record did not reach the store (%s); trying "
                    "again in %.2fs while the job's lease is trusted",
                    self.key,
                    exc,
                    pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_CAP)

    async def failed(self, exc: BaseException) -> None:
        """Record that the callee raised ``exc``: the key may run again."""
        error = error_text(exception_text(exc))
        await self.store.effect_finish(lease=self.lease, key=self.key, error=error)


async def run_effect(
    store: Store,
    lease: Lease,
    key: str,
    fn: Callable[..., Any],
    *args: Any,
    clock: Clock,
    wait: float = DEFAULT_EFFECT_WAIT,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` at most once per ``key`` for the attempt holding
    ``lease`` (awaiting it if it returns an awaitable); the core of ``ctx.effect_async``."""
    return await run_effect_as(
        EffectRun(store, lease, key, clock=clock, wait=wait), fn, *args, **kwargs
    )


async def run_effect_as(run: EffectRun, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`run_effect` for a :class:`EffectRun` made by the caller (with its limits)."""
    begin = await run.claim()
    if begin.start is Start.DONE:
        assert begin.record is not None
        return stored_result(run.key, begin.record)
    return await call_claimed(run, fn, *args, **kwargs)


async def call_claimed(run: EffectRun, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` (awaiting what it returns, if awaitable) for the key ``run`` has
    claimed to run, and record its outcome: its result, or that it raised."""
    try:
        with running_effect(run.call):
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
    except asyncio.CancelledError:
        # Cancelled from outside (a hard timeout, a stop, a fencing) while it ran: the
        # call may have done its work, or still be doing it (in a thread it was handed
        # to). Recorded failed, the key ran again at once, beside it, and no audit
        # listed it. Its outcome is unknown: the key stays pending under this attempt,
        # for the next to take over once this one is gone, recorded as a rerun.
        raise
    except BaseException as exc:
        await record_failure(run, exc)
        raise
    return await run.completed(value)


async def record_failure(run: EffectRun, exc: BaseException) -> None:
    """Record the callee's failure; a store that fails too must not hide ``exc``."""
    try:
        # Shielded: a handler cancelled while the record is sent still records it.
        await asyncio.shield(run.failed(exc))
    except TokenlineError as store_exc:
        log.warning("could not record the failure of effect %r: %s", run.key, store_exc)


def fence_for(key: str, token: int, resource: str | None, owner: str | None) -> Fence:
    """A validated :class:`Fence` on ``key``."""
    return Fence(validate_key(key, "fence key"), token, resource, owner)
