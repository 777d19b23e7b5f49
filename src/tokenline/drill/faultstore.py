"""A store wrapper that injects faults per role, for stores without a network (SQLite).

The fault proxy cannot stand between a worker and a file, and a single PostgreSQL URL
cannot be partitioned per role either; :class:`FaultStore` wraps any store and fails
calls by the role they belong to (:class:`tokenline.stores.base.Role`):

* **broker**: enqueue, claim, finish and its conveniences, rescue, queue operations,
  stats and job reads;
* **leases**: job lease renewal, worker membership, named leases;
* **ledger**: ``fenced_transaction`` and the ledger methods (effects, fences,
  duplicates).

:data:`ROLES` assigns every method. ``open``, ``close``, ``migrate`` and
``wait_for_jobs`` (a wait, not an operation: real stores do not fail it) are never
faulted. Per role, a :class:`RoleFaults` can make calls

* ``hang`` until the fault is cleared, or the store's own timeout passes (then
  :class:`StoreUnavailableError`, as a silent server gives), or the caller gives up;
* wait ``delay`` seconds first;
* raise ``error``: :class:`InjectedFaultError` (a :class:`StoreUnavailableError`)
  instead of running;
* ``fail_after``: run, then raise :class:`InjectedFaultError` — the write is applied but
  the caller never hears so: the lost ack. For ``fenced_transaction`` it fires only
  when the transaction committed.

``probability`` thins ``error`` and ``fail_after`` to a share of calls (a seeded
``random.Random``), and ``methods`` narrows a role's faults to some of its methods.

The drill's worker processes run the drill's app (``tokenline.drill.app``), whose stores
pass through :func:`wrap_from_env`; no other app's do (``store_from_url`` builds plain
stores). Its environment variables:

* ``TOKENLINE_DRILL_FAULTS``: :class:`StoreFaults` as JSON, in effect from the start,
  e.g. ``{"leases": {"error": true}, "ledger": {"fail_after": true,
  "probability": 0.2}}``.
* ``TOKENLINE_DRILL_FAULT_FILE``: a path the store re-reads whenever it changes (checked
  at the next call, at most every 0.1 s), so a drill controller can switch faults in
  running workers. Its content replaces the faults; deleting it clears them. Write it
  with :func:`write_fault_file` (an atomic replace, so a reader never sees half a
  file); a file that does not parse keeps the previous faults, with a warning. Give each
  worker its own file to fault one worker only.
* ``TOKENLINE_DRILL_SEED``: seeds the ``probability`` draws.

Bad JSON or an unknown key in either is a :class:`ConfigError` when the store is
created, before a worker starts.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .._errors import ConfigError
from .._jobs import (
    Attempt,
    ClaimedJob,
    Finish,
    Job,
    JobState,
    Lease,
    NewJob,
    QueueStats,
    RescueReport,
    StaleCommit,
    WorkerRecord,
)
from .._records import Duplicate, EffectBegin, EffectRecord, Fence
from ..stores.base import Depth, FencedTransaction, Inconsistency, ResourceLease, Store
from ._spec import check_number
from .storefaults import FaultFile, InjectedFaultError, Role, RoleFaults, StoreFaults, role_of

__all__ = ["FAULTS_ENV", "FAULT_FILE_ENV", "SEED_ENV", "FaultStore", "wrap_from_env"]

log = logging.getLogger("tokenline.drill.faultstore")

T = TypeVar("T")

FAULTS_ENV = "TOKENLINE_DRILL_FAULTS"
FAULT_FILE_ENV = "TOKENLINE_DRILL_FAULT_FILE"
SEED_ENV = "TOKENLINE_DRILL_SEED"

#: How often a hung call looks whether its fault was cleared.
_HANG_POLL = 0.05


@dataclass(frozen=True, slots=True)
class _Plan:
    """What to do to one call, decided once before it runs."""

    hang: bool
    delay: float
    error: bool
    fail_after: bool


_NOTHING = _Plan(False, 0.0, False, False)


class FaultStore(Store):
    """Wraps ``inner`` and injects :class:`StoreFaults` into its calls, by role.

    Every call is delegated: the methods of :class:`Store` explicitly (or, for one
    added to the seam later, by a wrapper generated at import), anything else the inner
    store has through ``__getattr__`` (its coroutine methods with their role's faults,
    other attributes as they are). ``injected`` counts the faults injected, by
    ``"<role>.<kind>"`` (kinds: ``hang``, ``delay``, ``error``, ``fail_after``).
    """

    def __init__(
        self,
        inner: Store,
        *,
        faults: StoreFaults | None = None,
        fault_file: str | os.PathLike[str] | None = None,
        poll_interval: float = 0.1,
        hang_limit: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self._lock = threading.Lock()  # sync transactions run on handler threads
        self._faults = faults or StoreFaults()
        self._file: FaultFile | None = None
        if fault_file is not None:
            self._file = FaultFile(Path(fault_file), check_number("poll_interval", poll_interval))
            self._faults = self._file.load() or self._faults
        timeout = getattr(inner, "timeout", None)
        default_limit = float(timeout) if isinstance(timeout, int | float) else None
        self.hang_limit = hang_limit if hang_limit is not None else default_limit
        self._rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"FaultStore({self.inner!r})"

    def __getattr__(self, name: str) -> Any:
        # Only reached for names FaultStore lacks: store-specific methods and attributes.
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._run(name, lambda: attr(*args, **kwargs))

        return call

    # -- faults ---------------------------------------------------------------------------
    @property
    def faults(self) -> StoreFaults:
        """The faults in effect now (re-read from the fault file when it changed)."""
        with self._lock:
            if self._file is not None:
                self._faults = self._file.poll(self._faults)
            return self._faults

    def set_faults(self, faults: StoreFaults) -> None:
        """Switch to ``faults`` now (until the fault file, if any, changes next)."""
        if not isinstance(faults, StoreFaults):
            raise TypeError(f"expected StoreFaults, got {faults!r}")
        with self._lock:
            self._faults = faults

    def set_role(self, role: Role, faults: RoleFaults) -> None:
        """Switch the faults of one role, leaving the others as they are."""
        with self._lock:
            self._faults = StoreFaults(**{**self._by_role(), Role(role).value: faults})

    def clear(self) -> None:
        """Remove every fault."""
        self.set_faults(StoreFaults())

    def _by_role(self) -> dict[str, RoleFaults]:
        return {r.value: self._faults.for_role(r) for r in Role}

    def _active(self, method: str) -> RoleFaults | None:
        """The faults that hit ``method`` now, if any."""
        role = role_of(method)
        if role is None:
            return None
        faults = self.faults.for_role(role)
        return faults if faults.applies_to(method) else None

    def _plan(self, method: str) -> _Plan:
        f = self._active(method)
        if f is None:
            return _NOTHING
        with self._lock:
            hit = self._rng.random() < f.probability
        return _Plan(f.hang, f.delay, f.error and hit, f.fail_after and hit)

    def _count(self, method: str, kind: str) -> Role:
        role = role_of(method) or Role.BROKER
        with self._lock:
            self.injected[f"{role.value}.{kind}"] += 1
        return role

    def _inject(self, method: str, kind: str, *, count: bool = True) -> InjectedFaultError:
        role = self._count(method, kind) if count else (role_of(method) or Role.BROKER)
        if kind == "fail_after":
            text = f"the {role.value} lost the answer to {method} after applying it"
        elif kind == "hang":
            text = f"the {role.value} did not answer {method} within {self.hang_limit:g}s"
        else:
            text = f"the {role.value} role is unavailable ({method})"
        return InjectedFaultError(f"drill fault: {text}", role=role, method=method, kind=kind)

    def _hanging(self, method: str, since: float) -> bool:
        """Whether a hang on ``method`` goes on; raises once ``hang_limit`` is reached."""
        found = self._active(method)
        if found is None or not found.hang:
            return False
        if self.hang_limit is not None and time.monotonic() - since >= self.hang_limit:
            raise self._inject(method, "hang", count=False)  # counted when it began
        return True

    async def _before(self, method: str) -> _Plan:
        plan = self._plan(method)
        if plan.hang:
            self._count(method, "hang")
            since = time.monotonic()
            # Polled: the fault is cleared from another thread or process (the fault
            # file), which no asyncio.Event of this loop can hear.
            while self._hanging(method, since):  # noqa: ASYNC110
                await asyncio.sleep(_HANG_POLL)
            plan = self._plan(method)  # the faults that follow the hang
        if plan.delay:
            self._count(method, "delay")
            await asyncio.sleep(plan.delay)
        if plan.error:
            raise self._inject(method, "error")
        return plan

    def _before_sync(self, method: str) -> _Plan:
        """:meth:`_before` for a synchronous caller (a sync handler's transaction)."""
        plan = self._plan(method)
        if plan.hang:
            self._count(method, "hang")
            since = time.monotonic()
            while self._hanging(method, since):
                time.sleep(_HANG_POLL)
            plan = self._plan(method)
        if plan.delay:
            self._count(method, "delay")
            time.sleep(plan.delay)
        if plan.error:
            raise self._inject(method, "error")
        return plan

    async def _run(self, method: str, call: Callable[[], Awaitable[T]]) -> T:
        plan = await self._before(method)
        result = await call()
        if plan.fail_after:
            raise self._inject(method, "fail_after")
        return result

    # -- life cycle (never faulted) -------------------------------------------------------
    async def open(self) -> None:
        """Open the inner store."""
        await self.inner.open()

    async def close(self) -> None:
        """Close the inner store."""
        await self.inner.close()

    # The timeout is the poll period, as in the seam.
    async def wait_for_jobs(self, *, queues: Sequence[str], timeout: float) -> None:  # noqa: ASYNC109
        """Wait on the inner store (a wait, never faulted)."""
        await self.inner.wait_for_jobs(queues=queues, timeout=timeout)

    # -- broker ---------------------------------------------------------------------------
    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_enqueue", lambda: self.inner.jobs_enqueue(jobs=jobs, connection=connection)
        )

    async def jobs_claim(
        self,
        *,
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> list[ClaimedJob]:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_claim",
            lambda: self.inner.jobs_claim(
                owner=owner, queues=queues, limit=limit, ttl=ttl, priority_aging=priority_aging
            ),
        )

    async def jobs_finish(self, *, finishes: Sequence[Finish]) -> list[bool]:
        """The inner store's, with the broker role's faults."""
        return await self._run("jobs_finish", lambda: self.inner.jobs_finish(finishes=finishes))

    def jobs_enqueue_blocking(self, *, jobs: Sequence[NewJob]) -> list[int]:
        """The inner store's, with the broker role's faults."""
        plan = self._before_sync("jobs_enqueue_blocking")
        ids = self.inner.jobs_enqueue_blocking(jobs=jobs)
        if plan.fail_after:
            raise self._inject("jobs_enqueue_blocking", "fail_after")
        return ids

    async def jobs_finish_and_claim(
        self,
        *,
        finishes: Sequence[Finish],
        owner: str,
        queues: Sequence[str],
        limit: int,
        ttl: float,
        priority_aging: float | None = None,
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """The inner store's, with the broker role's faults: a ``fail_after`` loses the
        answer to both, so the claimed jobs wait for their leases to expire."""
        return await self._run(
            "jobs_finish_and_claim",
            lambda: self.inner.jobs_finish_and_claim(
                finishes=finishes,
                owner=owner,
                queues=queues,
                limit=limit,
                ttl=ttl,
                priority_aging=priority_aging,
            ),
        )

    async def job_complete(self, *, lease: Lease) -> None:
        """The inner store's, with the broker role's faults."""
        await self._run("job_complete", lambda: self.inner.job_complete(lease=lease))

    async def job_retry(
        self, *, lease: Lease, delay: float, error: str, error_class: str = "transient"
    ) -> None:
        """The inner store's, with the broker role's faults."""
        await self._run(
            "job_retry",
            lambda: self.inner.job_retry(
                lease=lease, delay=delay, error=error, error_class=error_class
            ),
        )

    async def job_dead(self, *, lease: Lease, error: str, error_class: str = "permanent") -> None:
        """The inner store's, with the broker role's faults."""
        await self._run(
            "job_dead",
            lambda: self.inner.job_dead(lease=lease, error=error, error_class=error_class),
        )

    async def job_snooze(self, *, lease: Lease, delay: float, reason: str = "snoozed") -> None:
        """The inner store's, with the broker role's faults."""
        await self._run(
            "job_snooze", lambda: self.inner.job_snooze(lease=lease, delay=delay, reason=reason)
        )

    async def jobs_rescue(
        self, *, limit: int = 1000, leader: ResourceLease | None = None
    ) -> RescueReport:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_rescue", lambda: self.inner.jobs_rescue(limit=limit, leader=leader)
        )

    async def queue_pause(self, *, queue: str) -> None:
        """The inner store's, with the broker role's faults."""
        await self._run("queue_pause", lambda: self.inner.queue_pause(queue=queue))

    async def queue_resume(self, *, queue: str) -> None:
        """The inner store's, with the broker role's faults."""
        await self._run("queue_resume", lambda: self.inner.queue_resume(queue=queue))

    async def queues_stats(self) -> list[QueueStats]:
        """The inner store's, with the broker role's faults."""
        return await self._run("queues_stats", self.inner.queues_stats)

    async def jobs_depth(self) -> list[Depth]:
        """The inner store's, with the broker role's faults."""
        return await self._run("jobs_depth", self.inner.jobs_depth)

    async def job_get(self, *, job_id: int) -> Job:
        """The inner store's, with the broker role's faults."""
        return await self._run("job_get", lambda: self.inner.job_get(job_id=job_id))

    async def jobs_list(
        self,
        *,
        state: JobState | None = None,
        queue: str | None = None,
        limit: int = 100,
        args_limit: int | None = None,
    ) -> list[Job]:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_list",
            lambda: self.inner.jobs_list(
                state=state, queue=queue, limit=limit, args_limit=args_limit
            ),
        )

    async def job_attempts(self, *, job_id: int) -> list[Attempt]:
        """The inner store's, with the broker role's faults."""
        return await self._run("job_attempts", lambda: self.inner.job_attempts(job_id=job_id))

    async def jobs_retry_dead(self, *, job_ids: Sequence[int]) -> int:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_retry_dead", lambda: self.inner.jobs_retry_dead(job_ids=job_ids)
        )

    async def jobs_cancel(self, *, job_ids: Sequence[int], reason: str) -> int:
        """The inner store's, with the broker role's faults."""
        return await self._run(
            "jobs_cancel", lambda: self.inner.jobs_cancel(job_ids=job_ids, reason=reason)
        )

    async def stale_commits(self, *, limit: int = 100) -> tuple[int, list[StaleCommit]]:
        """The inner store's, with the broker role's faults."""
        return await self._run("stale_commits", lambda: self.inner.stale_commits(limit=limit))

    # -- leases ---------------------------------------------------------------------------
    async def job_leases_renew(
        self, *, owner: str, leases: Sequence[Lease], ttl: float
    ) -> list[Lease | None]:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "job_leases_renew",
            lambda: self.inner.job_leases_renew(owner=owner, leases=leases, ttl=ttl),
        )

    async def worker_register(self, *, record: WorkerRecord, ttl: float) -> WorkerRecord:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "worker_register", lambda: self.inner.worker_register(record=record, ttl=ttl)
        )

    async def worker_heartbeat(
        self,
        *,
        worker_id: str,
        token: int,
        state: str,
        in_flight: int,
        ttl: float,
        skew: float | None = None,
        concurrency_limit: int | None = None,
    ) -> WorkerRecord | None:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "worker_heartbeat",
            lambda: self.inner.worker_heartbeat(
                worker_id=worker_id,
                token=token,
                state=state,
                in_flight=in_flight,
                ttl=ttl,
                skew=skew,
                concurrency_limit=concurrency_limit,
            ),
        )

    async def store_time(self) -> float:
        """The inner store's, with the leases role's faults."""
        return await self._run("store_time", self.inner.store_time)

    async def worker_deregister(self, *, worker_id: str, token: int) -> None:
        """The inner store's, with the leases role's faults."""
        await self._run(
            "worker_deregister",
            lambda: self.inner.worker_deregister(worker_id=worker_id, token=token),
        )

    async def workers_list(self) -> list[WorkerRecord]:
        """The inner store's, with the leases role's faults."""
        return await self._run("workers_list", self.inner.workers_list)

    async def worker_drain(self, *, worker_id: str) -> bool:
        """The inner store's, with the leases role's faults."""
        return await self._run("worker_drain", lambda: self.inner.worker_drain(worker_id=worker_id))

    async def resource_lease_acquire(
        self, *, resource: str, owner: str, ttl: float
    ) -> ResourceLease | None:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "resource_lease_acquire",
            lambda: self.inner.resource_lease_acquire(resource=resource, owner=owner, ttl=ttl),
        )

    async def resource_lease_release(self, *, lease: ResourceLease) -> bool:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "resource_lease_release", lambda: self.inner.resource_lease_release(lease=lease)
        )

    async def resource_lease_renew(
        self, *, lease: ResourceLease, ttl: float
    ) -> ResourceLease | None:
        """The inner store's, with the leases role's faults."""
        return await self._run(
            "resource_lease_renew", lambda: self.inner.resource_lease_renew(lease=lease, ttl=ttl)
        )

    async def resource_leases_list(self) -> list[ResourceLease]:
        """The inner store's, with the leases role's faults."""
        return await self._run("resource_leases_list", self.inner.resource_leases_list)

    async def migrate(self) -> int | None:
        """The inner store's, never faulted."""
        return await self.inner.migrate()

    # -- ledger ---------------------------------------------------------------------------
    async def effect_begin(self, *, lease: Lease, key: str) -> EffectBegin:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "effect_begin", lambda: self.inner.effect_begin(lease=lease, key=key)
        )

    async def effect_finish(
        self, *, lease: Lease, key: str, result: str | None = None, error: str | None = None
    ) -> bool:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "effect_finish",
            lambda: self.inner.effect_finish(lease=lease, key=key, result=result, error=error),
        )

    async def effects_list(
        self, *, job_id: int | None = None, key: str | None = None, limit: int = 100
    ) -> list[EffectRecord]:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "effects_list", lambda: self.inner.effects_list(job_id=job_id, key=key, limit=limit)
        )

    async def fence_write(self, *, lease: Lease, fence: Fence) -> bool:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "fence_write", lambda: self.inner.fence_write(lease=lease, fence=fence)
        )

    async def duplicates_list(
        self, *, since: float | None = None, limit: int = 10_000
    ) -> list[Duplicate]:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "duplicates_list", lambda: self.inner.duplicates_list(since=since, limit=limit)
        )

    async def reconcile_find(
        self, *, pending_deadline: float, limit: int = 1000
    ) -> list[Inconsistency]:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "reconcile_find",
            lambda: self.inner.reconcile_find(pending_deadline=pending_deadline, limit=limit),
        )

    async def reconcile_repair(
        self, *, leader: ResourceLease, found: Sequence[Inconsistency]
    ) -> list[bool]:
        """The inner store's, with the ledger role's faults."""
        return await self._run(
            "reconcile_repair", lambda: self.inner.reconcile_repair(leader=leader, found=found)
        )

    def fenced_transaction(self, *, lease: Lease, **options: Any) -> FencedTransaction:
        """Ledger role: faults at entry, and ``fail_after`` once it has committed."""
        # **options carries what the seam may add to the call (fences, say) unchanged.
        return _FaultyTransaction(self, self.inner.fenced_transaction(lease=lease, **options))


class _FaultyTransaction(FencedTransaction):
    """A fenced transaction with the ledger role's faults around the inner one."""

    def __init__(self, store: FaultStore, inner: FencedTransaction) -> None:
        self._store = store
        self._inner = inner
        self._plan = _NOTHING

    def __enter__(self) -> Any:
        self._plan = self._store._before_sync("fenced_transaction")
        return self._inner.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._inner.__exit__(exc_type, exc, tb)
        finally:
            self.committed = self._inner.committed
        self._after()

    async def __aenter__(self) -> Any:
        self._plan = await self._store._before("fenced_transaction")
        return await self._inner.__aenter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self._inner.__aexit__(exc_type, exc, tb)
        finally:
            self.committed = self._inner.committed
        self._after()

    def _after(self) -> None:
        # ``wrote``, not ``committed``: under the test-only split completion the COMMIT
        # carries the user's writes but not the completion, and its answer can be lost too.
        if (self._inner.wrote or self.committed) and self._plan.fail_after:
            raise self._store._inject("fenced_transaction", "fail_after")


def _generated_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A delegating method for a seam method FaultStore does not define itself."""

    async def faulted(self: FaultStore, *args: Any, **kwargs: Any) -> Any:
        return await self._run(name, lambda: getattr(self.inner, name)(*args, **kwargs))

    # Synchronous: we cannot know what it returns, so it passes through unfaulted.
    def plain(self: FaultStore, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method: Callable[..., Any] = faulted if inspect.iscoroutinefunction(original) else plain
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Delegates to the inner store ({role_of(name) or 'never faulted'})."
    method.__dict__["generated"] = True  # lets a test insist on explicit wrappers
    return method


def _delegate_the_rest(cls: type[FaultStore]) -> None:
    # Inheriting a seam method would run Store's default (often "not supported") instead
    # of the inner store's implementation: generate a delegating wrapper instead.
    seam = {
        name: value
        for klass in reversed(Store.__mro__[:-1])  # every role of the seam, then Store
        for name, value in vars(klass).items()
    }
    for name, value in seam.items():
        if not name.startswith("_") and callable(value) and name not in vars(cls):
            setattr(cls, name, _generated_wrapper(name, value))
    abc.update_abstractmethods(cls)


_delegate_the_rest(FaultStore)


def wrap_from_env(store: Store, environ: Mapping[str, str] | None = None) -> Store:
    """``store`` wrapped in a :class:`FaultStore` when the drill's environment variables
    ask for one (see the module docstring); otherwise ``store`` itself."""
    env = os.environ if environ is None else environ
    text = env.get(FAULTS_ENV, "").strip()
    path = env.get(FAULT_FILE_ENV, "").strip()
    if not text and not path:
        return store
    seed_text = env.get(SEED_ENV, "").strip()
    try:
        seed = int(seed_text) if seed_text else None
    except ValueError:
        raise ConfigError(SEED_ENV, f"must be a whole number, got {seed_text!r}") from None
    faults = StoreFaults.from_json(text, FAULTS_ENV) if text else None
    log.warning("drill faults are active on %s (tests and drills only)", type(store).__name__)
    return FaultStore(store, faults=faults, fault_file=path or None, seed=seed)
