"""``with store.fenced_transaction(...)`` on PostgreSQL: the sync form of the transaction.

A sync handler runs in a thread of its own, so each test runs the sync form in a thread
(``asyncio.to_thread``) while the test's event loop plays the rest of the world: the
control plane, other workers, the rescuer. Transactions that must stay open while
something else happens are entered and left step by step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tokenline._clock import FakeClock
from tokenline._errors import NotSupportedError, StaleTokenError, StoreError, StoreUnavailableError
from tokenline._jobs import ClaimedJob, Finish, JobState, Lease, NewJob, Outcome
from tokenline._records import DuplicateKind, Fence
from tokenline.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

INSERT = "INSERT INTO marks (n) VALUES (%s)"


@pytest.fixture
async def pg(postgres_url: str, clock: FakeClock) -> AsyncIterator[PostgresStore]:
    """An open store on this test's schema, driven by the fake clock."""
    store = PostgresStore(postgres_url, clock=clock, timeout=5)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def marks(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> Callable[[], Awaitable[list[int]]]:
    """Creates the business table ``marks`` (the store's URL puts the test's schema
    first on the search path); returns a function reading its committed rows."""
    table = sql.SQL("{}.marks").format(sql.Identifier(postgres_schema))
    await admin.execute(sql.SQL("CREATE TABLE {} (n integer)").format(table))

    async def read() -> list[int]:
        cur = await admin.execute(sql.SQL("SELECT n FROM {} ORDER BY n").format(table))
        return [row[0] for row in await cur.fetchall()]

    return read


async def claim(store: PostgresStore, ttl: float = 30) -> ClaimedJob:
    """Enqueue one job and claim it."""
    await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=ttl)
    return claimed


async def state_of(store: PostgresStore, job_id: int) -> JobState:
    return (await store.job_get(job_id=job_id)).state


async def test_with_commits_the_writes_and_the_completion_together(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """`with` yields a sync psycopg.Connection already inside the transaction (session
    named after the attempt, limits from ``timeout``); nothing of it is visible until
    the block ends, then the user's row and the job's completion commit together."""
    c = await claim(pg)
    transaction = pg.fenced_transaction(lease=c.lease, timeout=30)
    conn = await asyncio.to_thread(transaction.__enter__)
    assert isinstance(conn, psycopg.Connection)
    await asyncio.to_thread(conn.execute, INSERT, (1,))
    cur = await asyncio.to_thread(
        conn.execute,
        "SELECT current_setting('application_name'), current_setting('statement_timeout'), "
        "current_setting('idle_in_transaction_session_timeout')",
    )
    assert cur.fetchone() == (pg.session_name(c.lease), "30s", "30s")
    assert (await marks(), await state_of(pg, c.job.id)) == ([], JobState.RUNNING)

    await asyncio.to_thread(transaction.__exit__, None, None, None)
    assert (transaction.wrote, transaction.committed) == (True, True)
    assert (await marks(), await state_of(pg, c.job.id)) == ([1], JobState.SUCCEEDED)
    assert (await pg.stale_commits())[0] == 0


async def test_a_stale_lease_is_refused_before_any_write_and_recorded(pg: PostgresStore) -> None:
    """A lease whose token no longer holds the job raises StaleTokenError on entry,
    before the block runs; the refusal is recorded and the job is left alone."""
    c = await claim(pg)
    stale = Lease(c.job.id, c.lease.owner, c.lease.token + 1, c.lease.expires_at)

    def run() -> None:
        with pg.fenced_transaction(lease=stale):
            pytest.fail("the block must not run")

    with pytest.raises(StaleTokenError, match=f"job {c.job.id}"):
        await asyncio.to_thread(run)
    total, commits = await pg.stale_commits()
    assert [(s.job_id, s.token, s.operation) for s in commits] == [
        (c.job.id, stale.token, "transaction")
    ]
    assert total == 1
    assert await state_of(pg, c.job.id) is JobState.RUNNING


async def test_a_job_finished_elsewhere_meanwhile_is_refused_at_commit(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """If the job stops being this attempt's while the sync transaction is open (here
    retried through another connection, which does not wait for it), the commit is
    refused: the user's writes roll back, the refusal is recorded, StaleTokenError."""
    c = await claim(pg)
    transaction = pg.fenced_transaction(lease=c.lease)
    conn = await asyncio.to_thread(transaction.__enter__)
    await asyncio.to_thread(conn.execute, INSERT, (1,))
    assert await pg.jobs_finish(finishes=[Finish(c.lease, Outcome.RETRY, 60.0)]) == [True]

    with pytest.raises(StaleTokenError, match=f"job {c.job.id}"):
        await asyncio.to_thread(transaction.__exit__, None, None, None)
    assert (transaction.wrote, transaction.committed) == (False, False)
    assert await marks() == []
    assert await state_of(pg, c.job.id) is JobState.SCHEDULED
    _, commits = await pg.stale_commits()
    assert [(s.job_id, s.token, s.operation) for s in commits] == [
        (c.job.id, c.lease.token, "transaction")
    ]


async def test_a_rescue_ends_the_open_sync_transaction_and_nothing_of_it_commits(
    pg: PostgresStore,
    marks: Callable[[], Awaitable[list[int]]],
    admin: psycopg.AsyncConnection[Any],
    clock: FakeClock,
) -> None:
    """A sync transaction left open past its lease does not keep the job from being
    rescued; the rescue ends its session, so leaving the block fails with a StoreError
    and commits nothing; the broken connection is not handed out again."""
    c = await claim(pg, ttl=5)
    transaction = pg.fenced_transaction(lease=c.lease)
    conn = await asyncio.to_thread(transaction.__enter__)
    await asyncio.to_thread(conn.execute, INSERT, (1,))
    clock.advance(6)
    assert list((await pg.jobs_rescue()).requeued) == [c.job.id]

    session = pg.session_name(c.lease)
    for _ in range(100):
        cur = await admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (session,)
        )
        if await cur.fetchone() == (0,):
            break
        await asyncio.sleep(0.05)
    with pytest.raises(StoreError):
        await asyncio.to_thread(transaction.__exit__, None, None, None)
    assert await marks() == []
    job = await pg.job_get(job_id=c.job.id)
    assert (job.state, job.lease_token) == (JobState.QUEUED, c.lease.token + 1)

    (again,) = await pg.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)

    def commit_again() -> None:
        with pg.fenced_transaction(lease=again.lease) as fresh:
            fresh.execute(INSERT, (2,))

    await asyncio.to_thread(commit_again)
    assert (await marks(), await state_of(pg, c.job.id)) == ([2], JobState.SUCCEEDED)


async def test_an_exception_in_the_block_rolls_everything_back(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """An exception inside `with` rolls back the user's writes, leaves the job running
    and reaches the caller unchanged; the attempt can still commit afterwards."""
    c = await claim(pg)
    transaction = pg.fenced_transaction(lease=c.lease)

    def write_then_fail() -> None:
        with transaction as conn:
            conn.execute(INSERT, (1,))
            raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        await asyncio.to_thread(write_then_fail)
    assert (transaction.wrote, transaction.committed) == (False, False)
    assert (await marks(), await state_of(pg, c.job.id)) == ([], JobState.RUNNING)
    assert (await pg.stale_commits())[0] == 0

    def write() -> None:
        with pg.fenced_transaction(lease=c.lease) as conn:
            conn.execute(INSERT, (2,))

    await asyncio.to_thread(write)
    assert (await marks(), await state_of(pg, c.job.id)) == ([2], JobState.SUCCEEDED)


async def test_ending_the_transaction_inside_the_block_is_refused(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """A block that commits by itself: its COMMIT fails (the guard of migration 0014),
    the block's end raises the NotSupportedError that says why, nothing it wrote is
    kept and the job is not completed."""
    c = await claim(pg)

    def commit_inside() -> None:
        with pg.fenced_transaction(lease=c.lease) as conn:
            conn.execute(INSERT, (3,))
            conn.execute("COMMIT")

    with pytest.raises(NotSupportedError, match=r"inside `with ctx.transaction\(\)` is refused"):
        await asyncio.to_thread(commit_inside)
    assert await marks() == []
    assert await state_of(pg, c.job.id) is JobState.RUNNING


async def test_a_lower_fence_is_refused_before_any_write_and_an_equal_one_passes(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """``fences=`` are advanced inside the sync transaction: a token lower than the
    highest that wrote the key raises StaleTokenError before the block runs (recorded
    as a stale duplicate, job left running); the same token passes and commits."""
    c = await claim(pg)
    high = c.lease.token + 1
    assert await pg.fence_write(lease=c.lease, fence=Fence("invoice:1", high))

    def run(token: int) -> None:
        with pg.fenced_transaction(lease=c.lease, fences=[Fence("invoice:1", token)]) as conn:
            conn.execute(INSERT, (token,))

    with pytest.raises(StaleTokenError, match="fence 'invoice:1'"):
        await asyncio.to_thread(run, c.lease.token)
    assert (await marks(), await state_of(pg, c.job.id)) == ([], JobState.RUNNING)
    assert [
        (d.key, d.kind, d.operation, d.job_id, d.token) for d in await pg.duplicates_list()
    ] == [("invoice:1", DuplicateKind.STALE, "fence", c.job.id, c.lease.token)]

    await asyncio.to_thread(run, high)
    assert (await marks(), await state_of(pg, c.job.id)) == ([high], JobState.SUCCEEDED)


async def test_the_sync_form_on_an_event_loop_is_refused_at_once(
    pg: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`with` on a thread running an event loop (an async handler that forgot `async`)
    raises NotSupportedError naming `async with ctx.transaction()`, before taking a
    connection: the loop is never blocked."""
    c = await claim(pg)

    def checkout() -> Any:
        raise AssertionError("the sync form took a connection on the event loop")

    monkeypatch.setattr(pg, "_checkout_sync", checkout)
    with (
        pytest.raises(NotSupportedError, match=r"async with ctx\.transaction\(\)"),
        pg.fenced_transaction(lease=c.lease),
    ):
        pytest.fail("the block must not run")
    assert pg._lent_sync_pool is None
    async with pg.fenced_transaction(lease=c.lease):
        pass
    assert await state_of(pg, c.job.id) is JobState.SUCCEEDED


async def test_the_sync_pool_opens_on_first_use_and_close_closes_it(
    postgres_url: str, admin: psycopg.AsyncConnection[Any]
) -> None:
    """The sync pool exists only once a sync transaction asked for it; close() closes
    it with its connections, and a sync transaction after close() is refused."""
    store = PostgresStore(postgres_url, timeout=5)
    await store.open()
    try:
        c = await claim(store)
        async with store.fenced_transaction(lease=c.lease):
            pass
        assert store._lent_sync_pool is None

        d = await claim(store)

        def backend_pid() -> int:
            with store.fenced_transaction(lease=d.lease) as conn:
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                return int(row[0])

        pid = await asyncio.to_thread(backend_pid)
        pool = store._lent_sync_pool
        assert pool is not None
        assert not pool.closed
    finally:
        await store.close()
    assert store._lent_sync_pool is None
    assert pool.closed
    for _ in range(100):
        cur = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        if await cur.fetchone() == (0,):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the sync pool's connection outlived close()")

    def after_close() -> None:
        with store.fenced_transaction(lease=d.lease):
            pytest.fail("the block must not run")

    with pytest.raises(StoreError, match="not open"):
        await asyncio.to_thread(after_close)


async def test_a_busy_sync_pool_raises_instead_of_hanging(postgres_url: str) -> None:
    """With every sync connection taken, another sync transaction fails with
    StoreUnavailableError after the store timeout; the async pool is not affected."""
    store = PostgresStore(postgres_url, timeout=1, max_connections=1)
    await store.open()
    try:
        first, second = await claim(store), await claim(store)
        holding = store.fenced_transaction(lease=first.lease)
        await asyncio.to_thread(holding.__enter__)
        try:

            def run() -> None:
                with store.fenced_transaction(lease=second.lease):
                    pytest.fail("the block must not run")

            with pytest.raises(StoreUnavailableError, match="within 1s"):
                await asyncio.to_thread(run)
            assert await state_of(store, second.job.id) is JobState.RUNNING
        finally:
            await asyncio.to_thread(holding.__exit__, None, None, None)
        assert await state_of(store, first.job.id) is JobState.SUCCEEDED
    finally:
        await store.close()


async def test_open_for_longer_than_the_ttl_blocks_no_renewal_and_commits(
    postgres_url: str, clock: FakeClock, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """While a sync transaction is open, renewals of its job through another connection
    (statement timeout 1 s) do not wait for it; renewed past its first TTL, the job is
    not rescued and the transaction commits."""
    holder = PostgresStore(postgres_url, clock=clock, timeout=5)
    other = PostgresStore(postgres_url, clock=clock, timeout=1)
    await holder.open()
    await other.open()
    try:
        c = await claim(holder, ttl=5)
        transaction = holder.fenced_transaction(lease=c.lease)
        conn = await asyncio.to_thread(transaction.__enter__)
        await asyncio.to_thread(conn.execute, INSERT, (1,))
        for _ in range(3):
            clock.advance(4)
            (renewed,) = await other.job_leases_renew(owner="w", leases=[c.lease], ttl=5)
            assert renewed is not None
            assert list((await other.jobs_rescue()).requeued) == []
        await asyncio.to_thread(transaction.__exit__, None, None, None)
        assert transaction.committed
        assert (await marks(), await state_of(holder, c.job.id)) == ([1], JobState.SUCCEEDED)
    finally:
        await other.close()
        await holder.close()


async def test_the_split_completion_sabotage_reaches_both_forms(
    pg: PostgresStore, marks: Callable[[], Awaitable[list[int]]]
) -> None:
    """The test tree's split completion (the lost_ack control experiment) overrides the
    one ``_complete`` both forms run: `with` and `async with` commit the user's writes
    without completing the job."""
    from sabotage import _split

    store = _split(pg)
    sync_job, async_job = await claim(pg), await claim(pg)
    sync_tx = store.fenced_transaction(lease=sync_job.lease)

    def run() -> None:
        with sync_tx as conn:
            conn.execute(INSERT, (1,))

    await asyncio.to_thread(run)
    async_tx = store.fenced_transaction(lease=async_job.lease)
    async with async_tx as aconn:
        await aconn.execute(INSERT, (2,))

    assert [(t.wrote, t.committed) for t in (sync_tx, async_tx)] == [(True, False)] * 2
    assert await marks() == [1, 2]
    assert [await state_of(pg, j.job.id) for j in (sync_job, async_job)] == [JobState.RUNNING] * 2


_SESSION_QUERIES = (
    "SELECT current_setting('search_path')",
    "SELECT current_user",
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    "SELECT count(*) FROM pg_class WHERE relname = 'left_behind' AND relpersistence = 't'",
    "SELECT count(*) FROM pg_listening_channels()",
    "SELECT current_setting('statement_timeout')",
    "SELECT pg_backend_pid()",
)

#: What a block may leave on its connection's session (each undone when it is given
#: back), and how the next block on that connection sees it.
LEFT_BEHIND = [
    "SET search_path TO pg_catalog",
    "SET ROLE tl_block_role",
    "SELECT pg_advisory_lock(424242)",
    "CREATE TEMP TABLE left_behind (n integer)",
    "LISTEN left_behind",
    "SET statement_timeout = 1",  # last: 1 ms would cancel the statements after it
]


def _session(conn: Any) -> tuple[Any, ...]:
    """What the next block sees of the session (sync form)."""
    return tuple(conn.execute(q).fetchone()[0] for q in _SESSION_QUERIES)


@pytest.fixture
async def block_role(
    admin: psycopg.AsyncConnection[Any], postgres_server: str
) -> AsyncIterator[str]:
    """A role the test's user may SET ROLE to."""
    await admin.execute("DROP ROLE IF EXISTS tl_block_role")
    # No privilege on tokenline's schema: the completion must not run under it.
    await admin.execute("CREATE ROLE tl_block_role")
    user = psycopg.conninfo.conninfo_to_dict(postgres_server).get("user", "postgres")
    await admin.execute(sql.SQL("GRANT tl_block_role TO {}").format(sql.Identifier(str(user))))
    try:
        yield "tl_block_role"
    finally:
        await admin.execute("DROP ROLE IF EXISTS tl_block_role")


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_a_block_leaves_nothing_on_its_session_for_the_next_job(
    postgres_url: str, marks: Any, block_role: str, form: str
) -> None:
    """One job's block changes its session (search path, a role with no privilege on
    tokenline's schema, an advisory lock, a temp table, LISTEN, a 1 ms timeout) and
    commits: its completion still runs (under the block's role or timeout it was
    refused as the store being unreachable, and the job given back for ever), and the
    next job's block, on the same pooled connection, finds the session as a fresh one:
    a tenant's search path or a role leaking into it would have its writes land
    elsewhere, and a session advisory lock would stay held by an idle pooled connection
    for ever."""
    store = PostgresStore(postgres_url, timeout=5, max_connections=1)
    await store.open()
    try:
        first, second, third = await claim(store), await claim(store), await claim(store)

        def fresh_sync(lease: Lease) -> tuple[Any, ...]:
            with store.fenced_transaction(lease=lease) as conn:
                return _session(conn)

        async def fresh(lease: Lease) -> tuple[Any, ...]:
            if form == "sync":
                return await asyncio.to_thread(fresh_sync, lease)
            async with store.fenced_transaction(lease=lease) as conn:
                seen = []
                for q in _SESSION_QUERIES:
                    cur = await conn.execute(q)
                    row = await cur.fetchone()
                    assert row is not None
                    seen.append(row[0])
                return tuple(seen)

        def meddle_sync(lease: Lease) -> None:
            with store.fenced_transaction(lease=lease) as conn:
                conn.execute(INSERT, (1,))
                for statement in LEFT_BEHIND:
                    conn.execute(statement)

        async def meddle(lease: Lease) -> None:
            if form == "sync":
                await asyncio.to_thread(meddle_sync, lease)
                return
            async with store.fenced_transaction(lease=lease) as conn:
                await conn.execute(INSERT, (1,))
                for statement in LEFT_BEHIND:
                    await conn.execute(statement)

        before = await fresh(first.lease)
        await meddle(second.lease)
        after = await fresh(third.lease)
        assert after[-1] == before[-1]  # the same pooled connection
        assert after == before
        assert before[1:5] == (before[1], 0, 0, 0)
        assert await marks() == [1]
    finally:
        await store.close()


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_what_a_kept_reference_or_a_block_leaves_on_the_connection_costs_no_job(
    postgres_url: str, marks: Any, form: str
) -> None:
    """A reference kept past its block opens a transaction on the pooled connection
    (autocommit off, one read), and the block had set a dict row factory: the next
    job's block on that connection still runs, with plain tuples. Before, its checkout
    failed ("can't change 'read_only' now") and the job lost an attempt to someone
    else's leftovers, and rows came back as dicts."""
    store = PostgresStore(postgres_url, timeout=5, max_connections=1)
    await store.open()
    try:
        first, second = await claim(store), await claim(store)
        kept: list[Any] = []

        def block_sync(lease: Lease, n: int) -> Any:
            with store.fenced_transaction(lease=lease) as conn:
                row = conn.execute("SELECT 42").fetchone()
                conn.execute(INSERT, (n,))
                conn.row_factory = psycopg.rows.dict_row
                kept.append(conn)
                return row[0]

        async def block(lease: Lease, n: int) -> Any:
            if form == "sync":
                return await asyncio.to_thread(block_sync, lease, n)
            async with store.fenced_transaction(lease=lease) as conn:
                row = await (await conn.execute("SELECT 42")).fetchone()
                await conn.execute(INSERT, (n,))
                conn.row_factory = psycopg.rows.dict_row
                kept.append(conn)
                return row[0]

        assert await block(first.lease, 1) == 42
        (conn,) = kept
        if form == "sync":
            conn.autocommit = False
            conn.execute("SELECT 1")
        else:
            await conn.set_autocommit(False)
            await conn.execute("SELECT 1")
        assert conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
        assert await block(second.lease, 2) == 42
        assert kept[1] is conn  # the same pooled connection
        assert await marks() == [1, 2]
    finally:
        await store.close()


@pytest.mark.parametrize("form", ["sync", "async"])
async def test_a_block_whose_connection_is_lost_is_a_store_failure_not_the_jobs(
    pg: PostgresStore,
    admin: psycopg.AsyncConnection[Any],
    marks: Callable[[], Awaitable[list[int]]],
    form: str,
) -> None:
    """The server ended the block's session (pg_terminate_backend, a failover, a cut
    network): the user's next statement raised psycopg's AdminShutdown out of the
    block, classified as the job's transient failure, and each such loss spent an
    attempt, up to dead. It is now the store's failure (coordination: the attempt is
    given back), chained from psycopg's error; nothing of the block committed."""
    from tokenline.classify import ErrorClass, classify

    c = await claim(pg)
    if form == "sync":

        def run() -> None:
            with pg.fenced_transaction(lease=c.lease, timeout=30) as conn:
                conn.execute(INSERT, (1,))
                asyncio.run_coroutine_threadsafe(
                    admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,)),
                    loop,
                ).result(30)
                conn.execute(INSERT, (2,))

        loop = asyncio.get_running_loop()
        with pytest.raises(StoreUnavailableError, match="was lost") as lost:
            await asyncio.to_thread(run)
    else:

        async def arun() -> None:
            async with pg.fenced_transaction(lease=c.lease, timeout=30) as aconn:
                await aconn.execute(INSERT, (1,))
                await admin.execute("SELECT pg_terminate_backend(%s)", (aconn.info.backend_pid,))
                await aconn.execute(INSERT, (2,))

        with pytest.raises(StoreUnavailableError, match="was lost") as lost:
            await arun()
    assert isinstance(lost.value.__cause__, psycopg.OperationalError)
    assert classify(lost.value).error_class is ErrorClass.COORDINATION
    assert (await marks(), await state_of(pg, c.job.id)) == ([], JobState.RUNNING)
    # The store goes on: a new block of the same attempt, on another connection, commits.
    async with pg.fenced_transaction(lease=c.lease, timeout=30) as again:
        await again.execute(INSERT, (3,))
    assert (await marks(), await state_of(pg, c.job.id)) == ([3], JobState.SUCCEEDED)
