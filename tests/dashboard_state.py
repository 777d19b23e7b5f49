"""A SQLite store with real jobs, workers and leases in it, for the dashboard's tests.

Every row is written through the store's own operations, as a worker and an enqueuer
write them: jobs enqueued, claimed under a registered worker's name (running, with a
lease and a token), one dead-lettered, workers in each state (one stopped), a resource
lease held.
``faulty=True`` adds what an incident looks like: a worker FENCED, the ``payments``
breaker open, the ``emails`` queue paused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tokenline import App
from tokenline._jobs import NewJob, WorkerRecord
from tokenline.stores import Store, store_from_url

T = TypeVar("T")

#: The resource lease the tests release.
LEASE_KEY = "account:42"
BREAKER = "payments"
TTL = 3600.0

#: Characters that change how text reads, or hide: a right-to-left override, isolates,
#: a zero-width space, a byte-order mark, a terminal escape and a C1 CSI.
SPOOFING = ("\u202e", "\u2066", "\u2067", "\u2069", "\u200b", "\ufeff", "\x1b", "\x9b")
#: A resource lease key, its owner and a worker id that read otherwise than they are.
SPOOF_KEY = "ключ\u202e"
SPOOF_OWNER = "o\u2067wner\u2069"
SPOOF_WORKER = "w\u202eevil"
#: The queue of :func:`plant_spoofed`'s jobs (a queue name is plain ASCII).
SPOOF_QUEUE = "spoof"


@dataclass(frozen=True, slots=True)
class State:
    """What :func:`populate` put in the store."""

    url: str
    app: App
    queued: list[int]
    running: list[int]
    dead: int
    lease_token: int
    workers: dict[str, str]


def _record(wid: str) -> WorkerRecord:
    return WorkerRecord(wid, "host-a", 4242, ("default", "emails"), 4, "ready", 0, 0.0, 0.0, 0.0)


def _job(queue: str, n: int) -> NewJob:
    return NewJob(queue=queue, task="billing.charge", args=f'{{"args": [{n}], "kwargs": {{}}}}')


#: queued ids, running ids, the dead job's id, the resource lease's token, worker states.
Filled = tuple[list[int], list[int], int, int, dict[str, str]]


async def _fill(store: Store, faulty: bool) -> Filled:
    ids = await store.jobs_enqueue(jobs=[_job("default", n) for n in range(8)])
    await store.jobs_enqueue(jobs=[_job("emails", n) for n in range(3)])
    states = {"w-ready": "ready", "w-busy": "processing", "w-draining": "draining"}
    if faulty:
        states["w-fenced"] = "fenced"
    tokens = {}
    for wid in states:
        tokens[wid] = (await store.worker_register(record=_record(wid), ttl=TTL)).token
    claimed = await store.jobs_claim(owner="w-busy", queues=["default"], limit=3, ttl=TTL)
    (doomed, *running) = [c.lease for c in claimed]
    await store.job_dead(lease=doomed, error="card declined: permanent", error_class="permanent")
    for wid, state in states.items():
        in_flight = len(running) if wid == "w-busy" else 0
        await store.worker_heartbeat(
            worker_id=wid, token=tokens[wid], state=state, in_flight=in_flight, ttl=TTL
        )
    gone = await store.worker_register(record=_record("w-gone"), ttl=TTL)
    await store.worker_deregister(worker_id="w-gone", token=gone.token)
    lease = await store.resource_lease_acquire(resource=LEASE_KEY, owner="w-busy", ttl=TTL)
    assert lease is not None
    if faulty:
        await store.queue_pause(queue="emails")
        breaker = f"tokenline:breaker:{BREAKER}"
        assert await store.resource_lease_acquire(resource=breaker, owner="w-busy", ttl=600)
    queued = [i for i in ids if i not in {doomed.job_id, *(r.job_id for r in running)}]
    return queued, [r.job_id for r in running], doomed.job_id, lease.token, states


@dataclass(frozen=True, slots=True)
class Spoofed:
    """What :func:`plant_spoofed` put in the store."""

    dead: int
    running: int
    lease_token: int


async def plant_spoofed(url: str) -> Spoofed:
    """Rows whose free text holds :data:`SPOOFING` characters, as a handler or an
    enqueuer may write them: a worker, a job it runs and one it dead-lettered (task,
    arguments, idempotency key, error), and a resource lease it holds."""
    store = store_from_url(url)
    await store.open()
    try:
        await store.worker_register(record=_record(SPOOF_WORKER), ttl=TTL)
        args = '{"args": ["a\u202eb\u200bc"], "kwargs": {}}'
        jobs = [
            NewJob(queue=SPOOF_QUEUE, task="t\u200bask", args=args, idempotency_key=f"k{n}\u2066")
            for n in range(2)
        ]
        await store.jobs_enqueue(jobs=jobs)
        claimed = await store.jobs_claim(owner=SPOOF_WORKER, queues=[SPOOF_QUEUE], limit=2, ttl=TTL)
        doomed, running = (c.lease for c in claimed)
        error = "boom\x1b[2J\x9b31m\u202egnp.exe\ufeff"
        await store.job_dead(lease=doomed, error=error, error_class="permanent")
        lease = await store.resource_lease_acquire(resource=SPOOF_KEY, owner=SPOOF_OWNER, ttl=TTL)
        assert lease is not None
        return Spoofed(doomed.job_id, running.job_id, lease.token)
    finally:
        await store.close()


def run_apart(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``fn()`` run to completion on an event loop of its own thread: callable where a
    loop already runs (Playwright's sync API keeps one on the main thread)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(fn())).result()


def populate(tmp_path: Path, *, faulty: bool = False) -> State:
    """A SQLite store in ``tmp_path`` as described in the module docstring, and its app."""
    return populate_url(f"sqlite:///{tmp_path / 'dash.db'}", faulty=faulty)


def populate_url(url: str, *, faulty: bool = False) -> State:
    """The store at ``url`` filled as described in the module docstring, and its app."""

    async def run() -> Filled:
        store = store_from_url(url)
        await store.open()
        try:
            return await _fill(store, faulty)
        finally:
            await store.close()

    queued, running, dead, token, workers = run_apart(run)
    app = App(url)
    app.dependency(BREAKER)
    return State(url, app, queued, running, dead, token, workers)


async def fingerprint(url: str) -> tuple[Any, ...]:
    """Everything an action could change: job states, paused queues, drain requests,
    resource lease holders and whether each is held."""
    store = store_from_url(url)
    await store.open()
    try:
        jobs = sorted((j.id, j.state.value, j.attempt) for j in await store.jobs_list(limit=1000))
        paused = sorted(s.queue for s in await store.queues_stats() if s.paused)
        drains = sorted((w.id, w.drain_requested) for w in await store.workers_list())
        now = await store.store_time()
        named = await store.resource_leases_list()
        leases = sorted((r.resource, r.owner, r.token, r.expires_at > now) for r in named)
        return jobs, paused, drains, leases
    finally:
        await store.close()
