"""FaultStore: faults by role on the in-memory and SQLite stores, lost acks that still
apply the write, the fault file a controller rewrites, and complete delegation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tokenline._clock import FakeClock
from tokenline._errors import ConfigError, StaleTokenError, TokenlineError
from tokenline._jobs import Finish, JobState, Lease, NewJob, Outcome, WorkerRecord
from tokenline.drill import (
    FAULT_FILE_ENV,
    ROLES,
    FaultStore,
    InjectedFaultError,
    Role,
    RoleFaults,
    StoreFaults,
    role_of,
    wrap_from_env,
    write_fault_file,
)
from tokenline.drill.faultstore import _generated_wrapper
from tokenline.drill.storefaults import UNFAULTED
from tokenline.stores import MemoryStore, Store
from tokenline.stores.base import Broker, Leases, Ledger, ResourceLease
from tokenline.stores.base import Role as SeamRole
from tokenline.stores.sqlite import SQLiteStore

SLACK = 0.02


def new_job(queue: str = "q") -> NewJob:
    """A small job for ``queue``."""
    return NewJob(queue=queue, task="t", args='{"args": [], "kwargs": {}}')


def record(worker_id: str = "w1") -> WorkerRecord:
    """A worker membership row to register."""
    return WorkerRecord(worker_id, "host", 1, ("q",), 4, "ready", 0, 0.0, 0.0, 0.0)


@pytest.fixture(params=["memory", "sqlite"])
async def inner(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Any:
    """An open store of each backend without a network."""
    store: Store
    if request.param == "memory":
        store = MemoryStore(clock=clock)
    else:
        store = SQLiteStore(f"sqlite:///{tmp_path / 'drill.db'}", clock=clock, timeout=5)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@dataclass
class World:
    """A store with a job running under ``lease``, a worker and a named lease."""

    store: FaultStore
    job_id: int
    lease: Lease
    worker: WorkerRecord
    named: ResourceLease


@pytest.fixture
async def world(inner: Store) -> World:
    """Rows for every method to act on, through a FaultStore without faults."""
    fs = FaultStore(inner, seed=1)
    await fs.jobs_enqueue(jobs=[new_job(), new_job()])
    (claimed,) = await fs.jobs_claim(owner="w1", queues=["q"], limit=1, ttl=30)
    worker = await fs.worker_register(record=record(), ttl=30)
    named = await fs.resource_lease_acquire(resource="r", owner="w1", ttl=30)
    assert named is not None
    return World(fs, claimed.job.id, claimed.lease, worker, named)


async def _transaction(w: World) -> None:
    async with w.store.fenced_transaction(lease=w.lease):
        pass


#: One call of each store method, with arguments that fit the world's rows.
CALLS: dict[str, Callable[[World], Awaitable[Any]]] = {
    "jobs_enqueue": lambda w: w.store.jobs_enqueue(jobs=[new_job()]),
    "jobs_claim": lambda w: w.store.jobs_claim(owner="w2", queues=["q"], limit=1, ttl=30),
    "jobs_finish": lambda w: w.store.jobs_finish(finishes=[Finish(w.lease, Outcome.RELEASE)]),
    "job_complete": lambda w: w.store.job_complete(lease=w.lease),
    "job_retry": lambda w: w.store.job_retry(lease=w.lease, delay=0, error="e"),
    "job_dead": lambda w: w.store.job_dead(lease=w.lease, error="e"),
    "job_snooze": lambda w: w.store.job_snooze(lease=w.lease, delay=0),
    "jobs_rescue": lambda w: w.store.jobs_rescue(),
    "reconcile_find": lambda w: w.store.reconcile_find(pending_deadline=60),
    "reconcile_repair": lambda w: w.store.reconcile_repair(leader=w.named, found=[]),
    "queue_pause": lambda w: w.store.queue_pause(queue="other"),
    "queue_resume": lambda w: w.store.queue_resume(queue="other"),
    "queues_stats": lambda w: w.store.queues_stats(),
    "job_get": lambda w: w.store.job_get(job_id=w.job_id),
    "jobs_list": lambda w: w.store.jobs_list(),
    "job_attempts": lambda w: w.store.job_attempts(job_id=w.job_id),
    "jobs_retry_dead": lambda w: w.store.jobs_retry_dead(job_ids=[w.job_id]),
    "jobs_cancel": lambda w: w.store.jobs_cancel(job_ids=[999], reason="r"),
    "stale_commits": lambda w: w.store.stale_commits(),
    "job_leases_renew": lambda w: w.store.job_leases_renew(owner="w1", leases=[w.lease], ttl=30),
    "worker_register": lambda w: w.store.worker_register(record=record("w2"), ttl=30),
    "worker_heartbeat": lambda w: w.store.worker_heartbeat(
        worker_id="w1", token=w.worker.token, state="ready", in_flight=0, ttl=30
    ),
    "worker_deregister": lambda w: w.store.worker_deregister(worker_id="w2", token=1),
    "workers_list": lambda w: w.store.workers_list(),
    "resource_lease_acquire": lambda w: w.store.resource_lease_acquire(
        resource="r2", owner="w1", ttl=30
    ),
    "resource_lease_release": lambda w: w.store.resource_lease_release(lease=w.named),
    "fenced_transaction": _transaction,
}


async def faulted_methods(w: World) -> set[str]:
    """Call every method once; the names that failed with an injected fault."""
    hit = set()
    for call in CALLS.values():
        try:
            await asyncio.wait_for(call(w), 10)
        except InjectedFaultError as exc:
            hit.add(exc.method)  # the name the fault reports, so a misattribution shows
        except TokenlineError:
            pass  # a refusal by the store itself (stale token, not supported): no fault
    return hit


def methods_of(role: Role, store: Store) -> set[str]:
    """The methods in CALLS that belong to ``role`` and that ``store`` can run."""
    names = {n for n in CALLS if ROLES[n] is role}
    if not store.capabilities.transactional_completion:
        names.discard("fenced_transaction")  # refused as unsupported before any fault
    return names


@pytest.mark.parametrize("role", list(Role))
async def test_an_error_fails_exactly_the_methods_of_its_role(world: World, role: Role) -> None:
    """An error fault on one role fails each of that role's methods and no other."""
    world.store.set_role(role, RoleFaults(error=True))
    assert await faulted_methods(world) == methods_of(role, world.store.inner)
    world.store.clear()
    assert await faulted_methods(world) == set()


@pytest.mark.parametrize("role", list(Role))
async def test_a_delay_slows_only_its_role(world: World, role: Role) -> None:
    """A delay holds each call of the role for at least that long, and only those."""
    world.store.set_role(role, RoleFaults(delay=0.05))
    started = time.monotonic()
    assert await faulted_methods(world) == set()
    expected = methods_of(role, world.store.inner)
    assert time.monotonic() - started >= len(expected) * 0.05 - SLACK
    assert dict(world.store.injected) == ({f"{role}.delay": len(expected)} if expected else {})


async def test_methods_narrow_a_role_to_some_calls(world: World) -> None:
    """``methods`` limits a role's faults to the calls it names."""
    world.store.set_role(
        Role.LEASES, RoleFaults(error=True, methods=frozenset({"job_leases_renew"}))
    )
    assert await faulted_methods(world) == {"job_leases_renew"}


async def test_a_hang_lasts_until_cleared(world: World) -> None:
    """A hung call blocks while the fault stays on and completes once it is cleared."""
    world.store.set_role(Role.BROKER, RoleFaults(hang=True))
    call = asyncio.ensure_future(world.store.job_get(job_id=world.job_id))
    await asyncio.sleep(0.3)
    assert not call.done()
    assert (await world.store.job_leases_renew(owner="w1", leases=[world.lease], ttl=30))[0]
    world.store.clear()
    assert (await asyncio.wait_for(call, 10)).id == world.job_id
    assert world.store.injected["broker.hang"] == 1


async def test_a_hang_gives_up_at_the_callers_timeout(world: World) -> None:
    """A caller's own timeout ends a hung call."""
    world.store.set_role(Role.LEASES, RoleFaults(hang=True))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(world.store.workers_list(), 0.2)


async def test_a_hang_ends_at_the_store_timeout_like_a_silent_store(inner: Store) -> None:
    """Past ``hang_limit`` (by default the inner store's timeout) a hung call fails as
    a store that never answered would."""
    fs = FaultStore(inner, hang_limit=0.2)
    fs.set_role(Role.BROKER, RoleFaults(hang=True))
    started = time.monotonic()
    with pytest.raises(InjectedFaultError, match="did not answer") as info:
        await fs.jobs_list()
    assert time.monotonic() - started >= 0.2 - SLACK
    assert info.value.kind == "hang"
    if isinstance(inner, SQLiteStore):
        assert FaultStore(inner).hang_limit == inner.timeout


async def test_fail_after_success_applies_the_write(world: World) -> None:
    """A lost ack: the caller gets an error, yet the completion was applied, and a
    second attempt to complete is refused as stale."""
    world.store.set_role(
        Role.BROKER, RoleFaults(fail_after=True, methods=frozenset({"jobs_finish"}))
    )
    with pytest.raises(InjectedFaultError, match="after applying") as info:
        await world.store.jobs_finish(finishes=[Finish(world.lease, Outcome.SUCCEEDED)])
    assert info.value.kind == "fail_after"
    world.store.clear()
    assert (await world.store.job_get(job_id=world.job_id)).state is JobState.SUCCEEDED
    with pytest.raises(StaleTokenError):
        await world.store.job_complete(lease=world.lease)


async def test_fail_after_enqueue_still_inserts(world: World) -> None:
    """An enqueue whose ack is lost has inserted its job all the same."""
    before = len(await world.store.jobs_list())
    world.store.set_role(Role.BROKER, RoleFaults(fail_after=True))
    with pytest.raises(InjectedFaultError):
        await world.store.jobs_enqueue(jobs=[new_job()])
    world.store.clear()
    assert len(await world.store.jobs_list()) == before + 1


async def test_probability_thins_faults_reproducibly(inner: Store) -> None:
    """``probability`` hits a share of calls; the same seed hits the same calls."""

    async def pattern(seed: int) -> list[bool]:
        fs = FaultStore(inner, seed=seed)
        fs.set_role(Role.BROKER, RoleFaults(error=True, probability=0.5))
        out = []
        for _ in range(200):
            try:
                await fs.queues_stats()
                out.append(False)
            except InjectedFaultError:
                out.append(True)
        return out

    first = await pattern(5)
    assert 40 < sum(first) < 160
    assert await pattern(5) == first


async def test_store_specific_methods_are_delegated_with_their_role(clock: FakeClock) -> None:
    """Methods only the inner store has are reached through the wrapper and take the
    faults of the role their name implies; plain attributes pass through."""

    class Extended(MemoryStore):
        flavour = "extended"

        async def effect_audit(self) -> str:
            return "audited"

        async def jobs_purge(self) -> int:
            return 3

    fs = FaultStore(Extended(clock=clock))
    assert fs.flavour == "extended"
    assert await fs.effect_audit() == "audited"
    fs.set_role(Role.LEDGER, RoleFaults(error=True))
    with pytest.raises(InjectedFaultError):
        await fs.effect_audit()
    assert await fs.jobs_purge() == 3
    with pytest.raises(AttributeError):
        _ = fs.no_such_thing


def test_every_abstract_store_method_is_wrapped_explicitly() -> None:
    """Each abstract method of the seam has its own typed wrapper in FaultStore: a new
    one must be added there (with its role in ROLES), not left to a generated one."""
    for name in sorted(Store.__abstractmethods__):
        own = vars(FaultStore).get(name)
        assert own is not None, f"FaultStore does not wrap Store.{name}"
        assert not getattr(own, "generated", False), f"FaultStore.{name} is not explicit"
    assert not FaultStore.__abstractmethods__


def test_every_store_method_has_a_role_and_is_delegated() -> None:
    """Every public method of the seam — each role's and the store's own — has an entry
    in ROLES, its role is the one the seam declares, and none falls through to the
    seam's own default (which would bypass the inner store)."""
    public = {
        name: klass
        for klass in (Broker, Leases, Ledger, Store)
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    }
    assert sorted(n for n in public if n not in ROLES) == []
    declared = {Broker: SeamRole.BROKER, Leases: SeamRole.LEASES, Ledger: SeamRole.LEDGER}
    for name, klass in public.items():
        if klass in declared and name not in UNFAULTED:
            assert ROLES[name] is declared[klass], name
    assert [n for n in public if getattr(FaultStore, n) is getattr(Store, n)] == []


async def test_a_seam_method_added_later_is_delegated_with_faults(clock: FakeClock) -> None:
    """The wrapper generated for a seam method FaultStore does not know reaches the
    inner store's implementation and applies the role's faults."""

    class WithLedger(MemoryStore):
        async def effect_poke(self, *, key: str) -> str:
            return f"poked {key}"

    async def seam_default(self: Store, *, key: str) -> str:
        raise AssertionError("the seam's default must not run")

    poke = _generated_wrapper("effect_poke", seam_default)
    fs = FaultStore(WithLedger(clock=clock))
    assert await poke(fs, key="k") == "poked k"
    fs.set_role(Role.LEDGER, RoleFaults(error=True))
    with pytest.raises(InjectedFaultError):
        await poke(fs, key="k")


def test_roles_of_unlisted_methods_follow_their_names() -> None:
    """Methods missing from ROLES get a role from their name."""
    assert role_of("ledger_scan") is Role.LEDGER
    assert role_of("effects_prune") is Role.LEDGER
    assert role_of("lease_steal") is Role.LEASES
    assert role_of("jobs_purge") is Role.BROKER
    assert role_of("wait_for_jobs") is None


def test_fault_descriptions_are_validated() -> None:
    """Unknown roles or keys, misplaced methods and bad values are refused by name."""
    with pytest.raises(ConfigError, match="unknown role"):
        StoreFaults.from_json('{"brokr": {}}')
    with pytest.raises(ConfigError, match="eror"):
        StoreFaults.from_json('{"broker": {"eror": true}}')
    with pytest.raises(ConfigError, match=r"faults\.leases\.delay"):
        StoreFaults.from_json('{"leases": {"delay": -1}}')
    with pytest.raises(ConfigError, match="not a broker method"):
        StoreFaults.from_json('{"broker": {"error": true, "methods": ["job_leases_renew"]}}')
    with pytest.raises(ConfigError, match="at least one"):
        RoleFaults(error=True, methods=frozenset())
    with pytest.raises(ConfigError, match="probability"):
        RoleFaults(error=True, probability=2)
    with pytest.raises(ConfigError, match="JSON"):
        StoreFaults.from_json("{broker")
    faults = StoreFaults(
        leases=RoleFaults(hang=True),
        ledger=RoleFaults(fail_after=True, probability=0.2, methods=frozenset({"fence_write"})),
    )
    assert StoreFaults.from_json(faults.to_json()) == faults
    assert StoreFaults().to_json() == "{}"


def test_the_fault_file_switches_faults_while_the_store_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store follows every rewrite of its fault file, clears its faults when the
    file goes away, and keeps them (with a warning) when the file does not parse."""
    path = tmp_path / "faults.json"
    store = FaultStore(MemoryStore(), fault_file=path, poll_interval=0)
    assert store.faults == StoreFaults()
    broker_down = StoreFaults(broker=RoleFaults(error=True))
    write_fault_file(path, broker_down)
    assert store.faults == broker_down
    path.write_text("{not json", encoding="utf-8")
    assert store.faults == broker_down
    assert "ignoring fault file" in caplog.text
    write_fault_file(path, StoreFaults(leases=RoleFaults(delay=1)))
    assert store.faults == StoreFaults(leases=RoleFaults(delay=1))
    path.unlink()
    assert store.faults == StoreFaults()


def test_a_bad_fault_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    """A fault file that exists but is invalid stops the store before it is used."""
    path = tmp_path / "faults.json"
    path.write_text('{"ledgr": {}}', encoding="utf-8")
    with pytest.raises(ConfigError, match="ledgr"):
        wrap_from_env(MemoryStore(), {FAULT_FILE_ENV: str(path)})
