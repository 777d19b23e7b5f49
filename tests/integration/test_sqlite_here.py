"""Short SQLite calls on the event loop's own thread (see ``SQLiteStore._on_main``).

A claim, a finish, a small enqueue and an effect's two steps run on the caller's thread
when nothing makes them wait; otherwise they go to the lane's thread, which waits. What
these tests pin down: the loop never waits for another connection's lock, a call that
finds a lock held midway leaves nothing done before it is run again on the lane (a finish
applied twice would be refused by its own token), and the write-ahead logs are still
checkpointed, by the lane, though these connections never checkpoint themselves.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tokenline._errors import StoreError
from tokenline._jobs import Finish, JobState, NewJob, Outcome
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite import _connection as sqlite_connection
from tokenline.stores.sqlite import store as sqlite_store
from tokenline.stores.sqlite._connection import coord_path
from tokenline.stores.sqlite._lanes import Lane

#: The store's busy timeout in these tests: a loop thread that waited for another
#: connection's lock would stop turning for that long (the lock is held throughout).
BUSY_TIMEOUT = 5.0


def _job(n: int = 0) -> NewJob:
    return NewJob(queue="default", task="t", args=f"[{n}]")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(f"sqlite:///{tmp_path / 'here.db'}", timeout=BUSY_TIMEOUT)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def lane_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the calls that went to a lane's thread."""
    calls: list[str] = []
    real = Lane.call

    async def counted(self: Lane, fn: Callable[..., Any], **kwargs: Any) -> Any:
        calls.append(getattr(fn, "__qualname__", repr(fn)))
        return await real(self, fn, **kwargs)

    monkeypatch.setattr(Lane, "call", counted)
    return calls


async def _longest_stall(seconds: float) -> float:
    """The longest the loop went without turning (in steps of 10 ms) during
    ``seconds``: on a loaded machine turns come late, but a loop blocked on a lock
    would stop for the whole busy timeout."""
    longest = 0.0
    began = last = time.monotonic()
    while last - began < seconds:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    return longest


def _holder(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False)


async def test_short_calls_run_on_the_loop_thread_when_nothing_holds_the_file(
    store: SQLiteStore, lane_calls: list[str]
) -> None:
    """Enqueue, claim, finish and finish-and-claim of a few jobs, with no other writer:
    none of them goes to the lane's thread, and each does what it does on the lane."""
    ids = await store.jobs_enqueue(jobs=[_job(1), _job(2)])
    (first,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
    done, (second,) = await store.jobs_finish_and_claim(
        finishes=[Finish(first.lease, Outcome.SUCCEEDED)],
        owner="w",
        queues=["default"],
        limit=1,
        ttl=30,
    )
    assert done == [True]
    assert await store.jobs_finish(finishes=[Finish(second.lease, Outcome.SUCCEEDED)]) == [True]
    assert lane_calls == []
    assert [first.job.id, second.job.id] == ids
    for jid in ids:
        assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED


async def test_a_big_enqueue_goes_to_the_lane(store: SQLiteStore, lane_calls: list[str]) -> None:
    """An enqueue of many jobs may take long: it never runs on the loop's thread."""
    await store.jobs_enqueue(jobs=[_job(n) for n in range(sqlite_store._HERE_MAX_ROWS + 1)])
    assert len(lane_calls) == 1


async def test_a_lock_held_by_another_connection_never_blocks_the_loop(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """While another connection holds the main file's write lock, a claim waits on the
    lane's thread: the loop keeps turning meanwhile, and once the lock is let go the
    claim takes the job, once."""
    (jid,) = await store.jobs_enqueue(jobs=[_job()])
    holder = _holder(tmp_path / "here.db")
    holder.execute("BEGIN IMMEDIATE")
    try:
        claim = asyncio.ensure_future(
            store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        )
        # Blocked, the loop would have stopped until the busy timeout.
        assert await _longest_stall(1.0) < BUSY_TIMEOUT / 2
        assert not claim.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    (claimed,) = await claim
    assert claimed.job.id == jid
    assert claimed.lease.token == 1
    assert [a.token for a in await store.job_attempts(job_id=jid)] == [1]


async def test_a_lock_found_midway_leaves_nothing_done_before_the_lane_runs_it(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """A finish-and-claim on the loop's thread applies the finish, then finds the
    coordination file locked by another connection: it rolls back and runs again on the
    lane, which waits for that lock. The finish is applied once — applied twice, the
    second would be refused by its own token and recorded as a stale commit."""
    await store.jobs_enqueue(jobs=[_job(1), _job(2)])
    (first,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
    holder = _holder(coord_path(tmp_path / "here.db"))
    holder.execute("BEGIN IMMEDIATE")
    try:
        call = asyncio.ensure_future(
            store.jobs_finish_and_claim(
                finishes=[Finish(first.lease, Outcome.SUCCEEDED)],
                owner="w",
                queues=["default"],
                limit=1,
                ttl=30,
            )
        )
        assert await _longest_stall(1.0) < BUSY_TIMEOUT / 2  # it never waited for it
        assert not call.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    done, claimed = await call
    assert done == [True]
    assert [c.lease.token for c in claimed] == [1]
    assert (await store.stale_commits())[0] == 0
    (attempt,) = await store.job_attempts(job_id=first.job.id)
    assert attempt.outcome == "succeeded"


def _log_pages(path: Path) -> int:
    """The size of the write-ahead log of ``path``, in pages: a log that a checkpoint
    has copied back is written again from its start, so its size is the most that was
    ever uncopied at once."""
    return (path.with_name(path.name + "-wal").stat().st_size - 32) // (4096 + 24)


async def _churn(store: SQLiteStore, jobs: int) -> None:
    for n in range(jobs):
        await store.jobs_enqueue(jobs=[_job(n)])
        (c,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        await store.jobs_finish(finishes=[Finish(c.lease, Outcome.SUCCEEDED)])


@pytest.mark.parametrize("every", [200, 10**9], ids=["checkpointed", "never"])
async def test_the_lane_checkpoints_what_the_loop_thread_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """The lane's connections never checkpoint on their own (their commits may be on the
    loop's thread): every ``_CHECKPOINT_ROWS`` rows the store has the lane do it, so the
    log does not grow without end. The control run, with no such checkpoints, shows that
    the log would."""
    monkeypatch.setattr(sqlite_store, "_CHECKPOINT_ROWS", every)
    store = SQLiteStore(f"sqlite:///{tmp_path / 'log.db'}", timeout=5.0)
    await store.open()
    try:
        await _churn(store, 300)
        await store._flush()  # the checkpoints it started
        pages = _log_pages(tmp_path / "log.db")
    finally:
        await store.close()
    # 300 jobs, each enqueued, claimed and finished on its own, write about 5,000 pages.
    if every == 200:
        assert pages < 1500, pages
    else:
        assert pages > 3000, pages


async def test_a_call_that_meets_the_store_closing_is_a_clear_store_error(
    tmp_path: Path,
) -> None:
    """The turn of the loop a call takes before it runs may let the store close (here a
    close with nothing to wait for, done within that turn): the call then says the store
    is not open, never a bare error from a closed thread or connection."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'closing.db'}", timeout=5.0)
    await store.open()
    store._callers = None  # nothing for close() to wait for: it ends within one turn
    call = asyncio.ensure_future(store.jobs_enqueue(jobs=[_job()]))
    await asyncio.sleep(0)  # the call is at its turn of the loop
    await store.close()
    with pytest.raises(StoreError, match="not open"):
        await call


@pytest.mark.parametrize("cut", [True, False], ids=["cut-back", "control"])
async def test_a_log_grown_past_its_limit_is_started_again_and_cut_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool
) -> None:
    """With other processes reading all the time (several workers on one file), the
    log could not be written again from its start, and it kept the size it reached for
    as long as the file was in use: hundreds of MB. Here a reader holds its snapshot
    while jobs run, and the log grows; once it lets go, the store's checkpoint of a log
    past its limit has it started again (RESTART) and cut back. The control run,
    without the limit, keeps the log at its largest."""
    monkeypatch.setattr(sqlite_store, "_CHECKPOINT_ROWS", 200)
    monkeypatch.setattr(sqlite_store, "_WAL_LOOK_EVERY", 0.0)
    threshold = 512 * 1024
    monkeypatch.setattr(sqlite_store, "_WAL_RESTART_BYTES", threshold if cut else 10**12)
    monkeypatch.setattr(sqlite_connection, "WAL_SIZE_LIMIT", 256 * 1024 if cut else -1)
    path = tmp_path / "busy.db"
    wal = path.with_name(path.name + "-wal")
    store = SQLiteStore(f"sqlite:///{path}", timeout=5.0)
    await store.open()
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM tokenline_jobs").fetchone()  # its snapshot
        await _churn(store, 100)
        await store._flush()
        grown = wal.stat().st_size
        assert grown > 6 * threshold, grown  # 100 jobs: about 7 MB of log
        tried, kept = store.wal_restarts
        if cut:
            # Tried, kept from finishing by the reader, and tried again less and less
            # often (each try holds the store's calls briefly), not at every call.
            assert kept >= 1, store.wal_restarts
            assert tried < 20, store.wal_restarts
        reader.execute("COMMIT")
        # The next look at the log may be a few seconds off (the back-off): jobs go on
        # meanwhile, as they would.
        async with asyncio.timeout(60):
            while True:
                await _churn(store, 10)
                await store._flush()
                after = wal.stat().st_size
                if not cut or after < 2 * threshold:
                    break
    finally:
        reader.close()
        await store.close()
    if not cut:
        assert after >= grown
        assert store.wal_restarts == [0, 0]
