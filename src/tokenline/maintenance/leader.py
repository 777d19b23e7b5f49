"""Leader election for maintenance: one leader per term, fenced like every job.

The leader is whoever holds the resource lease :data:`MAINTENANCE_LEASE`; the lease's
token is the **term**. The store issues a new token each time the lease changes hands
(or is taken again after it lapsed or was released), so terms only ever increase.

States of one candidate (:class:`Leadership`)::

                    acquire: new term
       FOLLOWER ──────────────────────────────▶ LEADER
          ▲  ▲                                    │  │
          │  │   renewal refused / store error    │  │ renewal ok: trusted until
          │  └────────────────────────────────────┘  │ sent + TTL - margin
          │      (step down; next tick: candidate)   │ (monotonic clock)
          │                                          │
          └──────────────────────────────────────────┘
             trust lapsed (paused, cut off) or a
             write refused: step down, release, and
             stand again for a *new* term

Safety argument:

* **One writer per term.** Every maintenance write (``jobs_rescue``,
  ``reconcile_repair``, and the pruner's and scheduler's) takes ``leader`` and the
  store checks, in the same transaction as the write (query ``leader_holds``), that the
  maintenance lease still has that owner and token and is unexpired *by the store's
  clock*. A rival can only take the lease once it has expired by that clock, and takes
  it with a higher token; from then on the deposed leader's writes match nothing and
  are refused (:class:`~tokenline.StaleTokenError`), whatever its own clock believes.
  Nothing here decides safety: the store's check does.
* **Stepping down early.** A leader trusts its term only until ``sent + TTL - margin``
  by its *monotonic* clock, ``sent`` being when its last successful renewal (or
  acquisition) was sent: the store's expiry is at least that late. A process resumed
  from a pause or a partition sees the gap at once and stops acting before the store
  would refuse it: the refusal is the guarantee, the step-down avoids pointless work.
* **Liveness.** A leader that is paused or cut off stops renewing; its lease expires by
  the store's clock within one TTL of its last renewal, and any candidate that asks
  after that (every ``renew_interval``) takes a new term. So the others wait at most
  TTL + renew interval to lead, then one service interval to act.
"""

from __future__ import annotations

import logging

from .._clock import Clock
from .._errors import StoreError
from ..stores.base import Leases, ResourceLease

__all__ = ["MAINTENANCE_LEASE", "Leadership"]

log = logging.getLogger("tokenline.maintenance")

#: The resource lease whose holder leads maintenance (``tokenline leases`` lists it).
MAINTENANCE_LEASE = "tokenline:maintenance"


class Leadership:
    """One candidate for maintenance leadership: elects, renews and steps down.

    ``margin``: seconds under the TTL after which the leader no longer trusts its last
    renewal (by ``clock.monotonic``). Call :meth:`elect` every renew interval; read
    :meth:`current` before each write, and pass what it returns to the store.
    """

    def __init__(
        self,
        store: Leases,
        *,
        owner: str,
        ttl: float,
        margin: float,
        clock: Clock,
        resource: str = MAINTENANCE_LEASE,
    ) -> None:
        self.store = store
        self.owner = owner
        self.ttl = ttl
        self.margin = margin
        self.clock = clock
        self.resource = resource
        self._lease: ResourceLease | None = None
        # The term last stepped down from: released before standing again.
        self._stale: ResourceLease | None = None
        self._trusted_until = 0.0
        #: Terms this candidate has won, and times it stepped down.
        self.elections = 0
        self.step_downs = 0

    @property
    def term(self) -> int | None:
        """The term this candidate leads now (trusted), or ``None``."""
        lease = self.current()
        return None if lease is None else lease.token

    def current(self) -> ResourceLease | None:
        """The lease to fence maintenance writes with, while its last renewal is still
        trusted by the monotonic clock; ``None`` (having stepped down) otherwise."""
        if self._lease is not None and self.clock.monotonic() >= self._trusted_until:
            self.step_down("its last renewal is too old to trust (paused or cut off?)")
        return self._lease

    def step_down(self, reason: str) -> None:
        """Stop acting as leader now; the next :meth:`elect` stands for a new term."""
        if self._lease is None:
            return
        log.warning(
            "%s steps down as maintenance leader (term %d): %s",
            self.owner,
            self._lease.token,
            reason,
        )
        self.step_downs += 1
        self._stale = self._lease
        self._lease = None

    async def elect(self) -> ResourceLease | None:
        """Renew the term held, or stand for a new one; return the lease if leader.

        A store error keeps what was held (trusted until its deadline) and re-raises:
        the caller retries at its next tick.
        """
        sent = self.clock.monotonic()
        if self.current() is not None:
            assert self._lease is not None
            renewed = await self.store.resource_lease_renew(lease=self._lease, ttl=self.ttl)
            if renewed is None:
                self.step_down(
                    "the store refused its renewal: its lease had expired by the store's "
                    "clock, or a newer term exists"
                )
                return None
            self._trust(renewed, sent)
            return renewed
        stale = self._stale
        if stale is not None:
            # A term this candidate stopped trusting is never resumed: give it back (a
            # no-op if it is already gone) so that winning again means a new term. If
            # the release fails, it is tried again before the next stand.
            await self.store.resource_lease_release(lease=stale)
            self._stale = None
        lease = await self.store.resource_lease_acquire(
            resource=self.resource, owner=self.owner, ttl=self.ttl
        )
        if lease is None:
            return None
        self.elections += 1
        log.info("%s is maintenance leader, term %d", self.owner, lease.token)
        self._trust(lease, sent)
        return lease

    def _trust(self, lease: ResourceLease, sent: float) -> None:
        self._lease = lease
        self._trusted_until = sent + self.ttl - self.margin

    async def resign(self) -> None:
        """Step down and give the lease back (best effort, and only if this term still
        holds it), so another candidate leads at once."""
        lease = self._lease or self._stale
        self._lease = self._stale = None
        if lease is not None:
            try:
                await self.store.resource_lease_release(lease=lease)
            except StoreError as exc:
                log.warning("could not release the maintenance lease: %s", exc)
