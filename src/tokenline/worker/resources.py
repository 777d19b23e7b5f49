"""Resource leases for handlers: ``ctx.lease(resource)``, one writer per business resource.

::

    async with ctx.lease("account:42", ttl=30, wait=5) as lease:   # async handlers
        ...                                                         # lease.token: fence with it
    with ctx.lease("account:42") as lease:                          # sync handlers
        ...

**Acquire.** The named lease is taken if it is free or expired, with a new token: one
higher than any token ever issued for that resource (a release only expires the row, so
the counter survives). If someone else holds it, ``ctx.lease`` retries with growing
pauses for up to ``wait`` seconds (default 0: one try), then raises
:class:`~tokenline.LeaseBusyError`; the job is retried later.

**Hold.** The worker's control plane renews every held lease on each renewal tick,
fenced by owner *and* token. Its holder trusts it until ``ttl`` minus a tenth after the
last renewal was sent (by the monotonic clock): past that, or once a renewal is refused,
``lease.check()`` and every ``ctx`` call raise :class:`~tokenline.LeaseExpiredError` —
the holder must stop writing. ``ttl`` must be at least three renewal intervals, so that
two failed renewals in a row do not lose the lease, and at most ``MAX_LEASE_TTL`` (the
bound on ``lease_ttl``), so that a lease whose holder died always expires.

**Release** happens on leaving the block, best effort: only the holder of ``(owner,
token)`` can release, and a lease whose release fails expires on its own at ``ttl``.
The owner is unique per job attempt (``worker/job/token``), so two jobs of one worker
never share a lease, and a lease outlives no attempt by more than its ``ttl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import events
from .._config import MAX_LEASE_TTL
from .._errors import InvalidInputError, LeaseBusyError, LeaseExpiredError, TokenlineError
from .._records import validate_key

if TYPE_CHECKING:
    from .._clock import Clock
    from ..stores.base import ResourceLease, Store
    from .context import JobContext
    from .slot import Slot

__all__ = ["HeldLease", "LeaseScope", "renew_resource_leases"]

log = logging.getLogger("tokenline.worker")

#: Longest pause between two tries at a busy lease.
_POLL_CAP = 1.0


@dataclass(eq=False)
class HeldLease:
    """A resource lease held by a job attempt (what ``with ctx.lease(...)`` yields)."""

    current: ResourceLease
    ttl: float
    #: Monotonic time after which the holder no longer trusts the lease.
    valid_until: float
    clock: Clock = field(repr=False)
    lost: bool = False
    #: Given back at the end of its ``with ctx.lease(...)`` block.
    released: bool = False

    @property
    def resource(self) -> str:
        """The resource's name."""
        return self.current.resource

    @property
    def token(self) -> int:
        """This holder's fencing token: higher than every earlier holder's."""
        return self.current.token

    @property
    def owner(self) -> str:
        """The owner recorded in the store (unique per job attempt)."""
        return self.current.owner

    @property
    def expires_at(self) -> float:
        """When the store lets the lease go unless it is renewed (epoch seconds)."""
        return self.current.expires_at

    def check(self) -> None:
        """Raise :class:`LeaseExpiredError` once the lease is lost, no longer trusted or
        released (its block has ended: another holder may have it now)."""
        if self.released:
            why = "was released when its ctx.lease block ended"
        elif self.lost:
            why = "was taken over: a renewal was refused"
        elif self.clock.monotonic() >= self.valid_until:
            why = "may have expired by the worker's own clock"
        else:
            return
        exc = LeaseExpiredError(f"lease on {self.resource!r} (token {self.token}) {why}")
        exc.held_resource = self.resource
        raise exc


def _valid_until(sent_at: float, ttl: float) -> float:
    # Measured from when the request was sent: the store's expiry is at least this late.
    return sent_at + ttl - ttl / 10


class LeaseScope:
    """``ctx.lease(...)``: acquire on entry, release on exit; ``with`` or ``async with``."""

    def __init__(
        self,
        ctx: JobContext,
        slot: Slot,
        resource: str,
        *,
        ttl: float,
        wait: float,
        min_ttl: float,
    ) -> None:
        self._resource = validate_key(resource, "lease resource")
        for name, value in (("ttl", ttl), ("wait", wait)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidInputError(f"{name} must be a number of seconds, got {value!r}")
        # An int is compared as it is: math.isfinite would overflow on 10**400. The bound
        # is the job lease TTL's: a lease whose holder died must still expire, within a
        # bound an operator can wait out, even when nothing reconciles it.
        finite = isinstance(ttl, int) or math.isfinite(ttl)
        if not (finite and 0 < ttl <= MAX_LEASE_TTL):
            raise InvalidInputError(
                f"lease ttl must be a finite number of seconds above 0 and at most "
                f"{MAX_LEASE_TTL:g} (the longest lease_ttl), got {ttl!r}"
            )
        if ttl < min_ttl:
            raise InvalidInputError(
                f"lease ttl {ttl:g}s is shorter than three renewal intervals ({min_ttl:g}s): "
                "the control plane could not keep it"
            )
        if not (isinstance(wait, int) or math.isfinite(wait)) or not wait >= 0:
            # An endless wait would outlive the attempt, and its lease would hold it.
            raise InvalidInputError(f"wait must be a finite number of seconds >= 0, got {wait!r}")
        if any(h.resource == self._resource for h in slot.resources):
            raise InvalidInputError(f"this attempt already holds the lease on {resource!r}")
        self._ctx = ctx
        self._slot = slot
        self._ttl = float(ttl)
        self._wait = float(wait)
        self._held: HeldLease | None = None

    async def _acquire(self) -> HeldLease:
        ctx, clock = self._ctx, self._ctx.clock
        ctx.check()
        ctx.refuse_inside_transaction("ctx.lease", lease=True)
        owner = f"{ctx.job_lease.owner}/job{ctx.job_id}/t{ctx.token}"
        deadline = clock.monotonic() + self._wait
        pause = 0.01
        while True:
            sent_at = clock.monotonic()
            got = await ctx.store.resource_lease_acquire(
                resource=self._resource, owner=owner, ttl=self._ttl
            )
            if got is not None:
                held = HeldLease(got, self._ttl, _valid_until(sent_at, self._ttl), clock)
                self._slot.resources.append(held)
                self._held = held
                return held
            left = deadline - clock.monotonic()
            if left <= 0:
                if events.enabled():
                    events.emit(events.ResourceLeaseBusy(ctx.job_lease.owner, self._resource))
                raise LeaseBusyError(
                    f"the lease on {self._resource!r} is held by someone else "
                    f"(waited {self._wait:g}s)"
                )
            # Polling: the store has no event for another holder's release.
            await asyncio.sleep(min(pause, left))
            ctx.check()
            pause = min(pause * 2, _POLL_CAP)

    async def _release(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        held.released = True
        with contextlib.suppress(ValueError):
            self._slot.resources.remove(held)
        try:
            await self._ctx.store.resource_lease_release(lease=held.current)
        except TokenlineError as exc:  # best effort: it expires at its ttl anyway
            log.warning("could not release the lease on %r: %s", held.resource, exc)

    async def __aenter__(self) -> HeldLease:
        return await self._acquire()

    async def __aexit__(self, *exc: object) -> None:
        # Shielded: a cancelled handler still gives the lease back.
        await asyncio.shield(self._release())

    def __enter__(self) -> HeldLease:
        return self._ctx.run_sync(self._acquire(), "async with ctx.lease(...)")

    def __exit__(self, *exc: object) -> None:
        self._ctx.run_sync(self._release(), "async with ctx.lease(...)")


async def renew_resource_leases(store: Store, slots: Iterable[Slot], clock: Clock) -> None:
    """Control-plane hook: renew every resource lease held by ``slots``, each fenced by
    its owner and token. A refused renewal marks the lease lost (its holder's next
    ``check`` raises); a failing store leaves it to the next tick, while it still may."""
    for slot in list(slots):
        for held in list(slot.resources):
            if held.lost:
                continue
            sent_at = clock.monotonic()
            renewed = await store.resource_lease_renew(lease=held.current, ttl=held.ttl)
            if renewed is None:
                held.lost = True
                log.warning(
                    "lease on %r (token %d) was lost: renewal refused", held.resource, held.token
                )
                continue
            held.current = renewed
            held.valid_until = _valid_until(sent_at, held.ttl)
