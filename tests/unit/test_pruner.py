"""The pruner service: retention settings, batches, dry runs and a deposed leader."""

from __future__ import annotations

import pytest

from tokenline._clock import FakeClock
from tokenline._config import WorkerSettings
from tokenline._errors import ConfigError
from tokenline._jobs import Finish, NewJob, Outcome
from tokenline.maintenance._service import Service
from tokenline.maintenance.pruner import Pruner, Retention
from tokenline.stores import MemoryStore

DAY = 86_400.0


async def finished(store: MemoryStore, n: int, outcome: Outcome = Outcome.SUCCEEDED) -> None:
    await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]") for _ in range(n)])
    claimed = await store.jobs_claim(owner="w", queues=["q"], limit=n, ttl=10)
    await store.jobs_finish(finishes=[Finish(c.lease, outcome, None, "e", "x") for c in claimed])


@pytest.mark.parametrize("setting", ["retention_finished", "retention_dead", "retention_audit"])
def test_a_retention_shorter_than_the_lease_ttl_is_refused_by_name(setting: str) -> None:
    """Bad input: a retention below lease_ttl names the setting at start-up."""
    with pytest.raises(ConfigError, match=setting) as caught:
        WorkerSettings(lease_ttl=60, **{setting: 59.0})
    assert caught.value.setting == setting
    assert WorkerSettings(lease_ttl=60, **{setting: 60.0})


@pytest.mark.parametrize("setting", ["prune_interval", "periodic_interval", "prune_batch"])
def test_a_zero_interval_or_batch_is_refused_by_name(setting: str) -> None:
    """Bad input: an interval (or batch) of zero names the setting."""
    with pytest.raises(ConfigError) as caught:
        WorkerSettings(**{setting: 0})
    assert caught.value.setting == setting


def test_defaults_keep_dead_letters_longer_than_finished_jobs() -> None:
    """The documented defaults: 7 days for finished jobs, 30 for dead ones and audit."""
    s = WorkerSettings()
    assert (s.retention_finished, s.retention_dead, s.retention_audit) == (
        7 * DAY,
        30 * DAY,
        30 * DAY,
    )


def test_services_take_their_settings() -> None:
    """The pruner and the scheduler are built from the validated worker settings."""
    from tokenline import App
    from tokenline.maintenance.scheduler import Scheduler

    settings = WorkerSettings(
        retention_finished=100, retention_dead=200, retention_audit=300, prune_batch=7,
        prune_interval=9, periodic_interval=0.5,
    )  # fmt: skip
    store = MemoryStore()
    pruner = Pruner.from_settings(store, settings)
    assert pruner.retention == Retention(100, 200, 300)
    assert (pruner.batch, pruner.interval) == (7, 9)
    assert Scheduler.from_settings(store, App("memory://"), settings).interval == 0.5


async def test_run_once_prunes_in_batches_and_reports_counts(clock: FakeClock) -> None:
    """Every old finished job goes, batch after batch; dead ones wait for their own
    retention; the report and the counters say how many."""
    store = MemoryStore(clock=clock)
    await finished(store, 7)
    await finished(store, 2, Outcome.DEAD)
    clock.advance(2 * DAY)
    pruner = Pruner(store, Retention(finished=DAY, dead=3 * DAY, audit=DAY), batch=3, pause=0)
    assert isinstance(pruner, Service)
    lease = await store.resource_lease_acquire(resource="tokenline:maintenance", owner="a", ttl=30)
    assert lease is not None

    preview = await pruner.run_once(leader=None, dry_run=True)
    assert preview.counts == {"jobs_pruned": 7}
    assert len(await store.jobs_list()) == 9

    report = await pruner.run_once(leader=lease)
    assert not report.refused
    assert report.counts == {"jobs_pruned": 7}
    assert len(await store.jobs_list()) == 2
    clock.advance(2 * DAY)
    lease = await store.resource_lease_acquire(resource="tokenline:maintenance", owner="a", ttl=30)
    assert lease is not None
    report = await pruner.run_once(leader=lease)
    assert report.counts == {"dead_jobs_pruned": 2}
    assert pruner.counters == {"jobs_pruned": 7, "dead_jobs_pruned": 2}


async def test_a_deposed_leader_run_is_refused_and_deletes_nothing(clock: FakeClock) -> None:
    """The run stops at the first refused batch and says so."""
    store = MemoryStore(clock=clock)
    await finished(store, 3)
    clock.advance(2 * DAY)
    old = await store.resource_lease_acquire(resource="tokenline:maintenance", owner="a", ttl=5)
    assert old is not None
    clock.advance(6)
    assert await store.resource_lease_acquire(resource="tokenline:maintenance", owner="b", ttl=5)
    report = await Pruner(store, Retention(DAY, DAY, DAY)).run_once(leader=old)
    assert report.refused
    assert report.total == 0
    assert len(await store.jobs_list()) == 3
