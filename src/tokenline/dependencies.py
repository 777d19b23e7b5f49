"""Named dependencies, each behind a circuit breaker that the workers share through the store.

::

    payments = app.dependency("payments-api", timeout=5, failure_rate=0.5, open_for=60)

    @app.task(depends_on=["payments-api"])
    async def charge(ctx, order_id):
        async with ctx.dependency("payments-api"):        # sync handlers: `with`
            await client.post(...)

A task that ``depends_on`` a dependency is not run while that dependency's breaker is
open: the worker gives its jobs back with a delay (the breaker's remaining open time,
at least a second), no attempt spent. ``ctx.dependency(name)`` is what measures: it
applies the dependency's ``timeout``, counts the call's outcome in the breaker, and
raises :class:`~tokenline.DependencyOpenError` instead of calling while the breaker is
open (the job is then given back the same way). A task may use ``ctx.dependency``
without declaring it, and declare it without using it: then only the gate applies, and
while the breaker is half-open it lets one job per claim through, since nothing such a
task does can close the breaker.

**Timeouts.** In an async handler the block is cancelled at ``timeout`` and raises
:class:`TimeoutError`, counted as a timeout. A sync call cannot be interrupted: it runs
to its end and its result stands, but a call that took longer than ``timeout`` is
counted as a timeout all the same. Any other exception out of the block counts as a
failure, except those that say nothing about the dependency: ``Permanent`` (the job's
own fault), a lost lease or a cancelled job, which count as nothing.

**The worker's own backpressure.** A job that fails with what its dependency's breaker
counted (the exception out of the block, or one raised ``from`` it) spends its attempt
and shrinks the concurrency limit like any failure (a timeout as a timeout), but stays
out of the worker's error window: the breaker already holds back what needs that
dependency, and pausing the whole worker would stop everything else as well. Jobs held
back by a breaker count nowhere: they did not run.

**Names** are 1 to 64 of ``A-Z a-z 0-9 _ . -``: each is part of lease names and a
metric label. A task's ``depends_on`` is checked when a worker starts, so the
dependency may be registered before or after the task: an unknown name stops the
worker with a :class:`~tokenline.ConfigError` naming the task and the dependency.

Sharing a breaker through the store
-----------------------------------

Each worker keeps a :class:`~tokenline.backpressure.CircuitBreaker` per dependency, fed
by its own calls. They agree through two resource leases per dependency, with no store
schema of their own (leases are fenced by owner and token, and expire by the *store's*
clock)::

    tokenline:breaker:<name>          held = open, for open_for seconds
    tokenline:breaker:<name>:probe    held = one worker is trying the dependency

1. A worker whose breaker opens takes the **open lease** with a TTL of ``open_for``.
   Someone else holding it already is fine: it is open either way.
2. Every worker reads all leases (:meth:`Store.resource_leases_list`, with the store's
   time) at most once per :data:`VIEW_MAX_AGE` seconds: when a job that needs a
   dependency is about to run or calls it, and every second while one of its breakers
   is not closed. An open lease it sees held opens its own breaker until that lease's
   expiry (converted to its monotonic clock, rounded late).
3. Once the open lease has expired, the dependency is **half-open** for everyone who
   has not seen a trial succeed since. A trial call needs the **probe lease** (TTL:
   the dependency's timeout plus :data:`PROBE_MARGIN`), so one worker at a time tries;
   the others see it held and keep deferring their jobs (half-open, busy).
4. A trial that fails takes the open lease again: open everywhere for ``open_for``.
   ``probe_calls`` trials that succeed close the breaker: the worker releases the probe
   lease and takes and releases it once more under the owner ``closed by <worker>``.
   That record, newer than the last opening, is what tells the others it is closed;
   a probe lease that merely expired (its worker crashed mid-trial) does not, and the
   next worker tries again.

**The view is a cache with an age, and it can only hold a worker back.** It opens
breakers and marks trials busy; an open it has seen is honoured until that lease's
expiry even if the store cannot be read again. It never grants a trial: only taking
the probe lease does, and the store decides that. The one thing it lets a worker do is
close after *someone else's* trial succeeded (a record no older than the view), which
is what that trial was for. When the store cannot be read, each worker falls back on
its own breaker.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from . import events
from ._errors import ConfigError, DependencyOpenError, InvalidInputError, StoreError
from ._jobs import describe
from .backpressure._checks import check_positive
from .backpressure.breaker import (
    DEFAULT_BREAKER_WINDOW,
    DEFAULT_FAILURE_RATE,
    DEFAULT_OPEN_FOR,
    DEFAULT_PROBE_CALLS,
    MIN_CALLS,
    BreakerState,
    CallOutcome,
    CircuitBreaker,
    Permit,
)

if TYPE_CHECKING:
    from ._clock import Clock
    from ._tasks import Task
    from .stores.base import ResourceLease, Store

__all__ = [
    "BREAKER_LEASE_PREFIX",
    "DEFAULT_DEPENDENCY_TIMEOUT",
    "PROBE_MARGIN",
    "VIEW_MAX_AGE",
    "BreakerBoard",
    "Dependency",
    "DependencyRegistry",
    "SharedBreaker",
    "check_dependency_name",
    "dependency_names",
    "read_shared",
]

log = logging.getLogger("tokenline.dependencies")

#: Seconds a call may take by default: generous for an HTTP API (resilience4j's
#: TimeLimiter uses 1 s, sized for in-process RPC, not for jobs).
DEFAULT_DEPENDENCY_TIMEOUT = 10.0
#: Name prefix of the breakers' resource leases.
BREAKER_LEASE_PREFIX = "tokenline:breaker:"
_PROBE_SUFFIX = ":probe"
#: Owner prefix of the record that says a trial succeeded.
_CLOSED_BY = "closed by "
#: Oldest the shared view may be before a worker reads the store again, seconds.
VIEW_MAX_AGE = 1.0
#: Seconds the probe lease outlives the trial call's timeout (store round trips).
PROBE_MARGIN = 1.0
#: Shortest delay of a job deferred by a breaker: no claim-and-give-back spin.
MIN_DELAY = 1.0
_MARKER_TTL = 1.0

DEPENDENCY_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_dependency_name(name: object, what: str = "dependency name") -> str:
    """``name`` if it is a valid dependency name; :class:`InvalidInputError` otherwise."""
    if not isinstance(name, str) or not DEPENDENCY_NAME_RE.fullmatch(name):
        raise InvalidInputError(
            f"{what} must be 1 to 64 of A-Z a-z 0-9 _ . - (it names leases and a metric "
            f"label), got {describe(name)}"
        )
    return name


def dependency_names(names: Iterable[str]) -> tuple[str, ...]:
    """A task's ``depends_on`` as a tuple of valid names, each once, in order."""
    # A string is iterable too: "payments-api" must not become twelve names.
    if isinstance(names, str | bytes):
        raise ConfigError("depends_on", f"must be a list of dependency names, got {names!r}")
    checked = [check_dependency_name(n, "a name in depends_on") for n in names]
    return tuple(dict.fromkeys(checked))


@dataclass(frozen=True, slots=True)
class Dependency:
    """A named external dependency and the settings of its circuit breaker.

    Built by :meth:`App.dependency <tokenline.App.dependency>`, which validates every
    setting (a :class:`~tokenline.ConfigError` names the bad one). The breaker's
    parameters are those of :class:`~tokenline.backpressure.CircuitBreaker`.
    """

    name: str
    #: Seconds a call may take; async calls are cancelled at it, sync ones counted.
    timeout: float = DEFAULT_DEPENDENCY_TIMEOUT
    failure_rate: float = DEFAULT_FAILURE_RATE
    #: A success slower than this is counted as bad (``None``: never); at most ``timeout``.
    slow_call: float | None = None
    window: float = DEFAULT_BREAKER_WINDOW
    min_calls: int = MIN_CALLS
    open_for: float = DEFAULT_OPEN_FOR
    probe_calls: int = DEFAULT_PROBE_CALLS

    def __post_init__(self) -> None:
        check_dependency_name(self.name)
        check_positive("timeout", self.timeout)
        self.new_breaker()  # validates the breaker's settings, naming the bad one
        if self.slow_call is not None and self.slow_call > self.timeout:
            raise ConfigError(
                "slow_call",
                f"must be <= timeout ({self.timeout:g}s): a call slower than its timeout "
                f"is a timeout already, got {self.slow_call!r}",
            )

    def new_breaker(self) -> CircuitBreaker:
        """A fresh, closed breaker with these settings."""
        return CircuitBreaker(
            failure_rate=self.failure_rate,
            window=self.window,
            min_calls=self.min_calls,
            open_for=self.open_for,
            slow_call=self.slow_call,
            probe_calls=self.probe_calls,
        )

    @property
    def open_lease(self) -> str:
        """The resource lease held while the breaker is open."""
        return BREAKER_LEASE_PREFIX + self.name

    @property
    def probe_lease(self) -> str:
        """The resource lease held by the one worker trying the dependency."""
        return BREAKER_LEASE_PREFIX + self.name + _PROBE_SUFFIX


class DependencyRegistry(Mapping[str, Dependency]):
    """The dependencies an app registered, by name (``app.dependencies``)."""

    def __init__(self) -> None:
        self._deps: dict[str, Dependency] = {}

    def add(self, dependency: Dependency) -> Dependency:
        """Register ``dependency``; a name registered already is refused, whatever its
        settings, as a task's name is: two registrations of one name would share one
        breaker, and with equal settings (the defaults, say) nothing would show it."""
        if dependency.name in self._deps:
            raise InvalidInputError(
                f"a dependency named {dependency.name!r} is already registered; to use "
                f"it elsewhere, take app.dependencies[{dependency.name!r}]"
            )
        self._deps[dependency.name] = dependency
        return dependency

    def __getitem__(self, name: str) -> Dependency:
        return self._deps[name]

    def require(self, name: str) -> Dependency:
        """The dependency named ``name``; :class:`InvalidInputError` if unregistered."""
        try:
            return self._deps[name]
        except (KeyError, TypeError):
            raise InvalidInputError(
                f"unknown dependency {describe(name)} (registered: {self._known()}); "
                "register it with app.dependency(name, ...)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._deps)

    def __len__(self) -> int:
        return len(self._deps)

    def _known(self) -> str:
        return ", ".join(sorted(self._deps)) or "none"

    def check_tasks(self, tasks: Iterable[Task]) -> None:
        """Raise :class:`ConfigError` for the first task that depends on a name that is
        not registered (checked when a worker starts)."""
        for task in tasks:
            for name in task.depends_on:
                if name not in self._deps:
                    raise ConfigError(
                        "depends_on",
                        f"task {task.name!r} depends on {name!r}, which is not a registered "
                        f"dependency (registered: {self._known()}); register it with "
                        f"app.dependency({name!r}, ...)",
                    )


# -- the shared state, as read from the store ----------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedBreaker:
    """One dependency's breaker as the store's leases say it is at ``now`` (store clock)."""

    dependency: str
    state: BreakerState
    #: While open: when the open lease expires (store clock).
    open_until: float | None = None
    #: While half-open: the worker holding the probe lease, and until when.
    prober: str | None = None
    probe_until: float | None = None


def read_shared(leases: Iterable[ResourceLease], now: float) -> dict[str, SharedBreaker]:
    """Each dependency's shared breaker from the store's resource leases at ``now`` (the
    store's time): the rules of the module docstring. Dependencies never opened have
    no lease and are absent (closed)."""
    records = {lease.resource: lease for lease in leases}
    shared: dict[str, SharedBreaker] = {}
    for resource, opened in records.items():
        name = resource.removeprefix(BREAKER_LEASE_PREFIX)
        if name == resource or ":" in name:
            continue  # not a breaker's open lease (names have no ':')
        probe = records.get(resource + _PROBE_SUFFIX)
        shared[name] = _shared(name, opened, probe, now)
    return shared


def _shared(
    name: str, opened: ResourceLease, probe: ResourceLease | None, now: float
) -> SharedBreaker:
    if opened.expires_at > now:
        return SharedBreaker(name, BreakerState.OPEN, open_until=opened.expires_at)
    # Store times: a probe record is about the last opening only if taken after it.
    if probe is not None and (probe.acquired_at or 0.0) > (opened.acquired_at or 0.0):
        if probe.owner.startswith(_CLOSED_BY):
            return SharedBreaker(name, BreakerState.CLOSED)
        if probe.expires_at > now:
            return SharedBreaker(
                name, BreakerState.HALF_OPEN, prober=probe.owner, probe_until=probe.expires_at
            )
    return SharedBreaker(name, BreakerState.HALF_OPEN)


# -- one worker's breakers ------------------------------------------------------------------


class BreakerBoard:
    """A worker's breakers, one per registered dependency, kept in step with the store.

    Everything runs on the worker's event loop (sync handlers reach it through
    ``ctx``): breakers are not thread-safe.
    """

    def __init__(
        self,
        dependencies: DependencyRegistry,
        *,
        worker_id: str,
        clock: Clock,
        max_age: float = VIEW_MAX_AGE,
    ) -> None:
        self.dependencies = dependencies
        self.worker_id = worker_id
        self.clock = clock
        self.max_age = max_age
        self._store: Store | None = None
        self._breakers: dict[str, CircuitBreaker] = {}
        self._announced: dict[str, BreakerState] = {}
        #: Monotonic time until which another worker's trial holds each dependency.
        self._busy_until: dict[str, float] = {}
        self._probes: dict[str, ResourceLease] = {}
        self._tried_at: float | None = None
        self._read_at: float | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._failing = False

    def bind(self, store: Store) -> None:
        """Use ``store`` (the worker's, once open) for the shared state."""
        self._store = store

    @property
    def active(self) -> bool:
        """Whether the app registered any dependency."""
        return bool(self.dependencies)

    @property
    def view_age(self) -> float | None:
        """Seconds since the shared view was last read (``None``: never)."""
        return None if self._read_at is None else self.clock.monotonic() - self._read_at

    def breaker(self, name: str) -> CircuitBreaker:
        """This worker's breaker of ``name``; :class:`InvalidInputError` if unknown."""
        found = self._breakers.get(name)
        if found is None:
            found = self._breakers[name] = self.dependencies.require(name).new_breaker()
        return found

    def state(self, name: str) -> BreakerState:
        """The state of this worker's breaker of ``name`` now."""
        state = self.breaker(name).state(self.clock.monotonic())
        self._announce(name, state)
        return state

    def _announce(self, name: str, state: BreakerState) -> None:
        old = self._announced.get(name, BreakerState.CLOSED)
        if old is state:
            return
        self._announced[name] = state
        level = logging.WARNING if state is BreakerState.OPEN else logging.INFO
        log.log(
            level,
            "worker %s: dependency %s: circuit breaker %s -> %s (%s)",
            *(self.worker_id, name, old.value, state.value),
            self.breaker(name).describe(self.clock.monotonic()),
            extra={"worker_id": self.worker_id, "dependency": name},
        )
        if events.enabled():
            events.emit(events.BreakerChanged(self.worker_id, name, old.value, state.value))

    # -- the shared view -------------------------------------------------------------------
    async def refresh_if_stale(self) -> None:
        """Read the shared state unless it was tried less than ``max_age`` ago; one read
        at a time, whoever asks."""
        if not self.active or self._store is None:
            return
        now = self.clock.monotonic()
        running = self._refreshing is not None and not self._refreshing.done()
        if not running and self._tried_at is not None and now - self._tried_at < self.max_age:
            return
        if not running:
            self._tried_at = now
            self._refreshing = asyncio.ensure_future(self._refresh())
        assert self._refreshing is not None
        await asyncio.shield(self._refreshing)

    async def watch(self) -> None:
        """Run for the worker's life, keeping the view fresh even when none of its jobs
        asks: the worker opens when another worker's breaker opened (an idle worker
        too, so every worker's view, and what operators see of it, agrees within
        ``max_age``), and closes after someone else's successful trial (and says so)."""
        while True:
            await asyncio.sleep(self.max_age)
            await self.refresh_if_stale()
            for name in self.dependencies:
                self.state(name)  # open -> half-open happens with time: announce it

    async def _refresh(self) -> None:
        assert self._store is not None
        try:
            # The store's time first: every expiry then looks later than it is, so the
            # view errs on holding back.
            store_now = await self._store.store_time()
            leases = await self._store.resource_leases_list()
        except (StoreError, TimeoutError) as exc:
            if not self._failing:
                log.warning(
                    "worker %s: cannot read the shared circuit breakers (%s); each "
                    "dependency follows this worker's own breaker meanwhile",
                    *(self.worker_id, exc),
                )
            self._failing = True
            return
        self._failing = False
        self._read_at = self.clock.monotonic()
        self._adopt(read_shared(leases, store_now), store_now, self._read_at)

    def _adopt(self, shared: Mapping[str, SharedBreaker], store_now: float, read_at: float) -> None:
        for name in self.dependencies:
            seen = shared.get(name)
            breaker = self.breaker(name)
            self._busy_until.pop(name, None)
            if seen is None:
                pass  # never opened anywhere: this worker's own evidence decides
            elif seen.state is BreakerState.OPEN and seen.open_until is not None:
                breaker.trip(read_at, until=read_at + (seen.open_until - store_now))
            elif seen.state is BreakerState.HALF_OPEN:
                breaker.half_open(read_at)
                if seen.prober not in (None, self.worker_id) and seen.probe_until is not None:
                    self._busy_until[name] = read_at + (seen.probe_until - store_now)
            elif breaker.state(read_at) is BreakerState.HALF_OPEN and not breaker.trials_in_flight:
                breaker.reset(read_at)  # someone's trial succeeded since it last opened
            self.state(name)

    # -- before a job runs -----------------------------------------------------------------
    def hold_back(
        self, names: Iterable[str], trials: dict[str, int]
    ) -> tuple[str, float, BreakerState] | None:
        """Whether a job needing ``names`` must wait: ``(dependency, delay, state)`` for
        the longest wait, or ``None`` to run it. ``trials`` counts, per dependency, the
        jobs of the same claim already let through half-open (one trial slot each)."""
        now = self.clock.monotonic()
        worst: tuple[str, float, BreakerState] | None = None
        admitted: list[str] = []
        for name in names:
            breaker = self.breaker(name)
            state = self.state(name)
            delay: float | None = None
            if state is BreakerState.OPEN:
                delay = breaker.remaining(now)
            elif state is BreakerState.HALF_OPEN:
                busy = self._busy_until.get(name, 0.0) - now
                slots = breaker.probe_calls - breaker.trials_in_flight - trials.get(name, 0)
                if busy > 0 or slots <= 0:
                    delay = busy
                else:
                    admitted.append(name)
            if delay is not None and (worst is None or delay > worst[1]):
                worst = (name, max(MIN_DELAY, delay), state)
        if worst is None:
            for name in admitted:
                trials[name] = trials.get(name, 0) + 1
        return worst

    # -- around a call ---------------------------------------------------------------------
    async def admit(self, name: str) -> Permit:
        """A permit to call ``name`` now, or :class:`DependencyOpenError`."""
        dependency = self.dependencies.require(name)
        await self.refresh_if_stale()
        breaker = self.breaker(name)
        now = self.clock.monotonic()
        state = self.state(name)
        if state is BreakerState.OPEN:
            self._reject(name, breaker.remaining(now), state)
        busy = self._busy_until.get(name, 0.0) - now
        if state is BreakerState.HALF_OPEN and busy > 0:
            self._reject(name, busy, state)
        permit = breaker.try_acquire(now)
        if permit is None:
            self._reject(name, MIN_DELAY, state)
        if permit.trial:
            assert self._store is not None, "the board is not bound to a store"
            try:
                lease = await self._store.resource_lease_acquire(
                    resource=dependency.probe_lease,
                    owner=self.worker_id,
                    ttl=dependency.timeout + PROBE_MARGIN,
                )
            except BaseException:
                breaker.cancel(permit)
                raise
            if lease is None:
                breaker.cancel(permit)
                self._reject(name, MIN_DELAY, state)
            self._probes[name] = lease
        return permit

    def _reject(self, name: str, delay: float, state: BreakerState) -> NoReturn:
        if events.enabled():
            events.emit(events.DependencyCall(self.worker_id, name, "rejected", 0.0))
        raise DependencyOpenError(name, retry_after=max(MIN_DELAY, delay), state=state.value)

    def rejected(self, name: str) -> None:
        """A job needing ``name`` was deferred before it ran: count it as rejected."""
        if events.enabled():
            events.emit(events.DependencyCall(self.worker_id, name, "rejected", 0.0))

    async def finish(
        self, name: str, permit: Permit, outcome: CallOutcome | None, seconds: float
    ) -> CallOutcome | None:
        """Count the call of ``permit``: ``OK`` (judged slow or not here), ``FAILED`` or
        ``TIMEOUT``; ``None``: it says nothing about the dependency. Publishes what the
        breaker became; store errors are logged, never raised."""
        breaker = self.breaker(name)
        now = self.clock.monotonic()
        before = breaker.state(now)
        counted: CallOutcome | None = None
        if outcome is None:
            breaker.cancel(permit)
        elif outcome is CallOutcome.OK:
            counted = breaker.on_success(permit, seconds, now)
        else:
            counted = breaker.on_failure(permit, now, timeout=outcome is CallOutcome.TIMEOUT)
        after = self.state(name)
        if counted is not None and events.enabled():
            events.emit(events.DependencyCall(self.worker_id, name, counted.value, seconds))
        try:
            if after is BreakerState.OPEN and before is not BreakerState.OPEN:
                await self._publish_open(name)
            elif permit.trial and after is BreakerState.CLOSED:
                await self._publish_closed(name)
            elif permit.trial and not breaker.trials_in_flight:
                await self._release_probe(name)
        except (StoreError, TimeoutError) as exc:
            log.warning("worker %s: dependency %s not shared: %s", self.worker_id, name, exc)
        return counted

    def finish_soon(self, name: str, permit: Permit) -> None:
        """:meth:`finish` of a call that ended without an outcome (the job was cancelled),
        without waiting: a task being cancelled must not wait for the store."""

        async def finish() -> None:
            await self.finish(name, permit, None, 0.0)

        task = asyncio.ensure_future(finish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_open(self, name: str) -> None:
        dependency = self.dependencies.require(name)
        assert self._store is not None
        await self._store.resource_lease_acquire(
            resource=dependency.open_lease, owner=self.worker_id, ttl=dependency.open_for
        )
        await self._release_probe(name)

    async def _publish_closed(self, name: str) -> None:
        dependency = self.dependencies.require(name)
        assert self._store is not None
        if not await self._release_probe(name):
            return  # the probe lease was lost: its new holder's trial decides
        marker = await self._store.resource_lease_acquire(
            resource=dependency.probe_lease, owner=_CLOSED_BY + self.worker_id, ttl=_MARKER_TTL
        )
        if marker is not None:
            await self._store.resource_lease_release(lease=marker)

    async def _release_probe(self, name: str) -> bool:
        lease = self._probes.pop(name, None)
        if lease is None or self._store is None:
            return False
        return await self._store.resource_lease_release(lease=lease)
