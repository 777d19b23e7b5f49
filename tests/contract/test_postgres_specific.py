"""What the PostgreSQL store promises beyond the shared contract.

Notifications, transactional enqueue, schema migrations, error messages and timeouts
(the sync form of the fenced transaction: test_postgres_sync_transaction.py).
Tests that need the server of ``TOKENLINE_TEST_POSTGRES_URL`` are skipped without it,
and fail in CI (see conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pg_plans import generic_plan
from pg_schema import schema_at_version
from tokenline._clock import FakeClock
from tokenline._errors import (
    ConfigError,
    InvalidInputError,
    JobNotFoundError,
    SchemaVersionError,
    StaleTokenError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
)
from tokenline._jobs import (
    ALLOWED_TRANSITIONS,
    Finish,
    JobState,
    Lease,
    NewJob,
    Outcome,
    WorkerRecord,
)
from tokenline.stores import store_from_url
from tokenline.stores.postgres import SCHEMA_VERSION, PostgresStore
from tokenline.stores.postgres._arrays import BinaryArray
from tokenline.stores.postgres._deadline import CANCEL_GRACE, run_bounded
from tokenline.stores.postgres._notifier import CROWDED
from tokenline.stores.postgres.store import (
    COPY_THRESHOLD,
    LITERAL_CLAIM_LIMIT,
    for_one_row,
    with_claim_limit,
)

pytestmark = pytest.mark.postgres


def new(queue: str = "default") -> NewJob:
    return NewJob(queue=queue, task="t", args="[]")


@pytest.fixture
async def pg(postgres_url: str) -> AsyncIterator[PostgresStore]:
    """An open store on this test's schema, on the database's own clock."""
    store = PostgresStore(postgres_url, timeout=5)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def listener_pid(
    admin: psycopg.AsyncConnection[Any], schema: str, *, not_pid: int | None = None
) -> int:
    """The backend pid of the store's LISTEN connection, once it is listening."""
    listen = f'LISTEN "tokenline_{schema}"'
    for _ in range(100):
        cur = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE query = %s AND pid <> %s",
            (listen, not_pid or 0),
        )
        row = await cur.fetchone()
        if row is not None:
            return int(row[0])
        await asyncio.sleep(0.05)
    raise AssertionError("the store never started listening")


async def test_notify_wakes_wait_for_jobs_early(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """An enqueue on a waited-for queue ends the wait at once; other queues do not."""
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema)
    await pg.jobs_enqueue(jobs=[new("b")])
    await asyncio.sleep(0.3)
    assert not waiter.done()
    started = time.monotonic()
    await pg.jobs_enqueue(jobs=[new("a")])
    await asyncio.wait_for(waiter, timeout=5)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("batch", [1, 3])
async def test_a_blocking_enqueue_wakes_wait_for_jobs_too(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str, batch: int
) -> None:
    """The synchronous fast path (single-row statement or batch) notifies like the
    async one, and only for the queue it enqueued on."""
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema)
    await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=[new("b")] * batch)
    await asyncio.sleep(0.3)
    assert not waiter.done()
    ids = await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=[new("a")] * batch)
    await asyncio.wait_for(waiter, timeout=5)
    assert len(set(ids)) == batch


async def test_a_copied_batch_is_all_or_nothing_and_notifies(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """A large batch goes in by COPY in one transaction: a row the server refuses
    leaves no job of the batch behind, and a batch that commits wakes waiters."""
    bad = [new("a")] * 99 + [NewJob(queue="a", task="t", args='["\x00"]')]
    with pytest.raises(StoreError):
        await pg.jobs_enqueue(jobs=bad)
    with pytest.raises(StoreError):
        await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=bad)
    assert await pg.jobs_list(limit=10) == []
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema)
    ids = await pg.jobs_enqueue(jobs=[new("a")] * 100)
    await asyncio.wait_for(waiter, timeout=5)
    assert len(ids) == 100


async def test_a_copied_batch_stores_every_field_as_the_statement_does(pg: PostgresStore) -> None:
    """A large batch is copied in binary form, a small one inserted by a statement: the
    same jobs come out the same either way, extremes of each column's range included."""
    kinds = [
        NewJob(queue="q", task="t", args='{"args":["é\\u0000✓"],"kwargs":{}}', priority=-(2**31)),
        NewJob(queue="q", task="t", args="[]", priority=2**31 - 1, max_attempts=2**31 - 1),
        NewJob(queue="q", task="t", args="[]", run_at=4_102_444_800.125, timeout=0.25),
        NewJob(queue="q", task="t", args="[]", delay=30.5, timeout=3600, max_lease_expiries=1),
        NewJob(queue="r", task="u", args="[]", idempotency_key="key ✓", max_attempts=1),
    ]
    small = await pg.jobs_enqueue(jobs=kinds)
    large = await pg.jobs_enqueue(jobs=kinds * 20)
    assert len(large) == 100 >= COPY_THRESHOLD > len(small)

    def fields(job: Any) -> tuple[Any, ...]:
        return (
            job.queue, job.task, job.args, job.idempotency_key, job.priority,
            job.max_attempts, job.state, job.timeout, job.max_lease_expiries,
            job.run_at if job.run_at > 4e9 else round(job.run_at - job.created_at, 3),
        )  # fmt: skip

    expected = [fields(await pg.job_get(job_id=i)) for i in small]
    for n, job_id in enumerate(large):
        assert fields(await pg.job_get(job_id=job_id)) == expected[n % len(kinds)], n


@contextlib.contextmanager
def sent_after_commit(pg: PostgresStore) -> Iterator[list[list[str]]]:
    """While enough other enqueues are under way (held open here) for the next to be
    crowded, the notifications ``pg``'s enqueues hand to its notifier, sent after their
    commit: one list of queues per notifying transaction."""
    sent: list[list[str]] = []
    notifier = pg._notifier
    assert notifier is not None
    send = notifier._send

    def recording(queues: list[str]) -> None:
        send(queues)
        sent.append(queues)

    notifier._send = recording
    try:
        with contextlib.ExitStack() as under_way:
            for _ in range(CROWDED - 1):
                assert under_way.enter_context(notifier.enqueue()) is None
            yield sent
    finally:
        notifier._send = send


@pytest.mark.parametrize("size", [1, 3, COPY_THRESHOLD])
@pytest.mark.parametrize("blocking", [False, True])
async def test_an_enqueue_beside_another_notifies_after_its_commit(
    pg: PostgresStore,
    admin: psycopg.AsyncConnection[Any],
    postgres_schema: str,
    size: int,
    blocking: bool,
) -> None:
    """Enqueues that overlap commit without a NOTIFY (which would make their commits
    wait for each other's disk flushes) and notify right after, in a transaction of
    their own: a waiting worker still wakes, for the queues with a job ready now
    only. Every statement and path: one row, a batch, a copied batch."""
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema)

    async def enqueue(jobs: list[NewJob]) -> list[int]:
        if blocking:
            return await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=jobs)
        return await pg.jobs_enqueue(jobs=jobs)

    with sent_after_commit(pg) as sent:
        later = NewJob(queue="s", task="t", args="[]", delay=600)
        await enqueue([later] * size)  # scheduled: nothing to wake anyone for
        await enqueue([new("b")] * size)
        await asyncio.sleep(0.3)
        assert not waiter.done()
        ids = await enqueue([new("a")] * size)
        await asyncio.wait_for(waiter, timeout=5)
        await enqueue([new("d")] + [new("c")] * (size - 1))
        expected = {"a", "b", "d"} | ({"c"} if size > 1 else set())
        for _ in range(100):  # sent from the notifier's thread
            if {q for queues in sent for q in queues} >= expected:
                break
            await asyncio.sleep(0.05)
    assert {q for queues in sent for q in queues} == expected
    assert all(queues == sorted(set(queues)) for queues in sent)
    assert len(set(ids)) == size
    assert len(await pg.jobs_list(limit=5 * size)) == 4 * size


async def test_a_lone_enqueue_notifies_in_its_own_transaction(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """Nothing overlaps it: the NOTIFY rides in the enqueue's transaction, with no
    transaction of its own after."""
    notifier = pg._notifier
    assert notifier is not None
    sent: list[list[str]] = []
    notifier._send = sent.append
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema)
    await pg.jobs_enqueue(jobs=[new("a")])
    await asyncio.wait_for(waiter, timeout=5)
    await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=[new("a")] * COPY_THRESHOLD)
    assert sent == []


@pytest.mark.parametrize("size", [COPY_THRESHOLD - 1, COPY_THRESHOLD])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 2**31),
        ("priority", -(2**31) - 1),
        ("priority", True),
        ("priority", 1.5),
        ("max_attempts", 2**31),
        ("max_lease_expiries", -(2**31) - 1),
        ("timeout", "30"),
    ],
)
async def test_a_value_no_column_can_hold_is_refused_on_both_paths(
    pg: PostgresStore, size: int, field: str, value: Any
) -> None:
    """A job built by hand (the App refuses these before any store sees them) with a
    value out of its column's range or of the wrong type: refused as bad input naming
    the job and the field, nothing stored, whether the batch goes by statement or by
    COPY. The binary COPY wrote such integers wrapped around (2**31 became -2**31), or a
    bool as 1."""
    bad = NewJob(queue="q", task="t", args="[]", **{field: value})
    jobs = [new("q")] * (size - 1) + [bad]
    with pytest.raises(InvalidInputError, match=rf"job {size - 1} of the batch: {field} "):
        await pg.jobs_enqueue(jobs=jobs)
    with pytest.raises(InvalidInputError, match=rf"job {size - 1} of the batch: {field} "):
        await asyncio.to_thread(pg.jobs_enqueue_blocking, jobs=jobs)
    assert await pg.jobs_list(limit=10) == []


async def test_lost_listener_falls_back_to_polling_and_comes_back(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """Killing the LISTEN connection never hangs or fails a waiter: it returns by its
    timeout, and a later wait listens again on a new connection."""
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    pid = await listener_pid(admin, postgres_schema)
    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    # A notification may have been missed while the connection was down: the waiter is
    # woken so the worker polls, rather than sleeping out its 30 seconds.
    await asyncio.wait_for(waiter, timeout=5)

    started = time.monotonic()
    await pg.wait_for_jobs(queues=["a"], timeout=0.5)
    assert 0.4 < time.monotonic() - started < 3

    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["a"], timeout=30))
    await listener_pid(admin, postgres_schema, not_pid=pid)
    await pg.jobs_enqueue(jobs=[new("a")])
    await asyncio.wait_for(waiter, timeout=5)


async def test_enqueue_joins_the_callers_transaction(
    pg: PostgresStore,
    postgres_server: str,
    admin: psycopg.AsyncConnection[Any],
    postgres_schema: str,
) -> None:
    """Outbox: jobs enqueued on the caller's connection exist, and wake workers, only
    if the caller's transaction commits."""
    waiter = asyncio.create_task(pg.wait_for_jobs(queues=["default"], timeout=30))
    await listener_pid(admin, postgres_schema)
    conn = await psycopg.AsyncConnection.connect(postgres_server, autocommit=True)
    rolled_back: list[int] = []

    async def enqueue_then_fail() -> None:
        async with conn.transaction():
            rolled_back.extend(await pg.jobs_enqueue(jobs=[new()], connection=conn))
            raise RuntimeError("business rule broken")

    try:
        with pytest.raises(RuntimeError, match="business rule"):
            await enqueue_then_fail()
        with pytest.raises(JobNotFoundError):
            await pg.job_get(job_id=rolled_back[0])
        await asyncio.sleep(0.3)
        assert not waiter.done()

        async with conn.transaction():
            ids = await pg.jobs_enqueue(jobs=[new(), new()], connection=conn)
            with pytest.raises(JobNotFoundError):  # invisible until the caller commits
                await pg.job_get(job_id=ids[0])
        assert [(await pg.job_get(job_id=i)).state for i in ids] == [JobState.QUEUED] * 2
        await asyncio.wait_for(waiter, timeout=5)
    finally:
        await conn.close()


async def test_enqueue_refuses_a_connection_outside_a_transaction(
    pg: PostgresStore, postgres_server: str
) -> None:
    """An autocommit connection would commit the jobs on their own: refused clearly."""
    async with await psycopg.AsyncConnection.connect(postgres_server, autocommit=True) as conn:
        with pytest.raises(StoreError, match="open transaction"):
            await pg.jobs_enqueue(jobs=[new()], connection=conn)
    with pytest.raises(StoreError, match="must be a psycopg connection"):
        await pg.jobs_enqueue(jobs=[new()], connection=object())
    # A closed one was said to be outside a transaction: true, but not what to fix.
    closed = await psycopg.AsyncConnection.connect(postgres_server)
    await closed.close()
    with pytest.raises(StoreError, match="connection= is closed"):
        await pg.jobs_enqueue(jobs=[new()], connection=closed)
    assert await pg.jobs_list() == []


async def test_schema_newer_than_the_code_is_refused(
    pg: PostgresStore, postgres_url: str, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """A schema migrated by a newer tokenline is neither used nor touched."""
    await admin.execute(
        sql.SQL("INSERT INTO {}.schema_version (version, name) VALUES (%s, 'future')").format(
            sql.Identifier(postgres_schema)
        ),
        (SCHEMA_VERSION + 1,),
    )
    newer = PostgresStore(postgres_url)
    with pytest.raises(SchemaVersionError, match="upgrade tokenline"):
        await newer.open()
    with pytest.raises(SchemaVersionError, match="upgrade tokenline"):
        await newer.migrate()


async def test_migrate_disabled_refuses_an_empty_schema_and_creates_nothing(
    postgres_url: str, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """migrate=False on a fresh schema says to run `tokenline migrate`; after it, opens."""
    store = PostgresStore(postgres_url, migrate=False)
    with pytest.raises(SchemaVersionError, match="run `tokenline migrate`"):
        await store.open()
    cur = await admin.execute(
        "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (postgres_schema,)
    )
    assert await cur.fetchone() == (0,)
    assert await store.migrate() == SCHEMA_VERSION
    assert await store.migrate() == SCHEMA_VERSION  # idempotent
    await store.open()
    try:
        assert await store.jobs_list() == []
    finally:
        await store.close()


async def test_concurrent_first_opens_migrate_once(postgres_url: str) -> None:
    """Workers starting together on a new schema all open it; the advisory lock makes
    one of them migrate and the others find it current."""
    stores = [PostgresStore(postgres_url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        (jid,) = await stores[0].jobs_enqueue(jobs=[new()])
        assert (await stores[3].job_get(job_id=jid)).state is JobState.QUEUED
    finally:
        await asyncio.gather(*(s.close() for s in stores))


@pytest.fixture
def dml_role(postgres_server: str, postgres_schema: str) -> Iterator[str]:
    """A store URL as a login role of this test's own, granted on the test's schema (at
    version 9, owned by the test's user) what a worker needs at run time and no more:
    USAGE on the schema, SELECT, INSERT, UPDATE and DELETE on its tables, USAGE and
    SELECT on its sequences."""
    name = f"rofix_{secrets.token_hex(4)}"
    role, schema = sql.Identifier(name), sql.Identifier(postgres_schema)
    with psycopg.connect(postgres_server) as conn:
        schema_at_version(conn, postgres_schema, 9)
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, role))
        conn.execute(
            sql.SQL(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA {} GRANT SELECT, INSERT, UPDATE, DELETE "
                "ON TABLES TO {}"
            ).format(schema, role)
        )
        conn.execute(
            sql.SQL(
                "ALTER DEFAULT PRIVILEGES IN SCHEMA {} GRANT USAGE, SELECT ON SEQUENCES TO {}"
            ).format(schema, role)
        )
        for grant in (
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}",
            "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {} TO {}",
        ):
            conn.execute(sql.SQL(grant).format(schema, role))
    user = conninfo_to_dict(postgres_server).get("user", "postgres")
    try:
        yield postgres_server.replace(f"//{user}@", f"//{name}@", 1) + f"?schema={postgres_schema}"
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
            conn.execute(sql.SQL("DROP ROLE {}").format(role))


async def test_a_role_that_may_not_migrate_is_told_to_migrate_as_the_owner(
    dml_role: str, postgres_url: str
) -> None:
    """A worker's role with every run-time grant, opening an older schema with migration
    on (the default): the DDL is refused, and the hint said to grant it USAGE and ALL on
    the tables, which it has. It says to migrate as the schema's owner, or to start
    workers with migration off once that is done; and with the schema migrated by its
    owner, the role does a worker's work with those grants alone."""
    with pytest.raises(StoreUnavailableError) as refused:
        await PostgresStore(dml_role, timeout=5).open()
    text = str(refused.value)
    assert "may not migrate" in text, text
    assert "at version 9" in text, text
    assert "`tokenline migrate` as the role that owns it" in text, text
    assert "TOKENLINE_MIGRATE=0" in text, text
    assert "GRANT USAGE ON SCHEMA" not in text, text

    await PostgresStore(postgres_url).migrate()
    store = PostgresStore(dml_role, timeout=5, migrate=False)
    await store.open()
    try:
        record = WorkerRecord("w", "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)
        member = await store.worker_register(record=record, ttl=60)
        beat = await store.worker_heartbeat(
            worker_id="w", token=member.token, state="ready", in_flight=0, ttl=60
        )
        assert beat is not None
        (jid,) = await store.jobs_enqueue(jobs=[new()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)
        assert await store.job_leases_renew(owner="w", leases=[claimed.lease], ttl=60)
        assert (await store.effect_begin(lease=claimed.lease, key="k")) is not None
        assert await store.effect_finish(lease=claimed.lease, key="k", result="1")
        async with store.fenced_transaction(lease=claimed.lease):
            pass
        assert (await store.job_get(job_id=jid)).state is JobState.SUCCEEDED
        await store.queue_pause(queue="default")
        await store.queue_resume(queue="default")
        held = await store.resource_lease_acquire(resource="r", owner="w", ttl=60)
        assert held is not None
        assert await store.resource_lease_release(lease=held)
        await store.jobs_rescue()
        await store.worker_deregister(worker_id="w", token=member.token)
    finally:
        await store.close()


async def test_a_failed_migration_leaves_nothing_behind(
    postgres_url: str, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """Migrations run in one transaction: when one statement fails, none of the others
    (nor the version row) remain."""
    schema = sql.Identifier(postgres_schema)
    await admin.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
    await admin.execute(sql.SQL("CREATE TABLE {}.leases (x int)").format(schema))
    with pytest.raises(StoreError, match="leases"):
        await PostgresStore(postgres_url).open()
    cur = await admin.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = %s", (postgres_schema,)
    )
    assert await cur.fetchall() == [("leases",)]


async def test_the_object_list_is_what_the_migrations_make(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """The objects a damaged schema is checked for are exactly those a fresh migration
    makes: a migration that adds one must name it in _catalog.OBJECTS."""
    from tokenline.stores.postgres._catalog import OBJECTS, schema_objects

    found = await schema_objects(admin, postgres_schema)
    assert {kind: set(names) for kind, names in OBJECTS.items()} == found


@pytest.mark.parametrize(
    ("damage", "lacks"),
    [
        ("DROP TABLE {}.open_blocks CASCADE", "table open_blocks"),
        ("DROP INDEX {}.jobs_ready", "index jobs_ready"),
        ("DROP TRIGGER jobs_monotonic ON {}.jobs", "trigger jobs_monotonic"),
        ("ALTER TABLE {}.jobs DROP CONSTRAINT jobs_state_check", "constraint jobs_state_check"),
        ("ALTER TABLE {}.unique_keys DROP CONSTRAINT unique_keys_pkey", "index unique_keys_pkey"),
        ("DROP FUNCTION {}.unique_key_released", "function unique_key_released"),
        ("ALTER TABLE {}.jobs DROP COLUMN max_lease_expiries", "column jobs.max_lease_expiries"),
        ("ALTER TABLE {}.workers DROP COLUMN clock_skew", "column workers.clock_skew"),
    ],
)
async def test_a_damaged_schema_is_refused_by_open_and_migrate_naming_what_it_lacks(
    pg: PostgresStore,
    postgres_url: str,
    admin: psycopg.AsyncConnection[Any],
    postgres_schema: str,
    damage: str,
    lacks: str,
) -> None:
    """A table, column, index, trigger, constraint or function dropped by hand went unnoticed:
    `tokenline migrate` said the schema was up to date, status said ok, and every job
    that needed the missing table spent its attempts until it was dead (or, for the
    state trigger, a safety check was gone). Opening the store and migrating now refuse
    the schema, naming what it lacks, and change nothing."""
    (jid,) = await pg.jobs_enqueue(jobs=[new()])
    await admin.execute(sql.SQL(damage).format(sql.Identifier(postgres_schema)))
    for attempt in (PostgresStore(postgres_url).open, PostgresStore(postgres_url).migrate):
        with pytest.raises(StoreCorruptError, match=f"damaged: it lacks .*{lacks}"):
            await attempt()
    cur = await admin.execute(
        sql.SQL("SELECT state FROM {}.jobs WHERE id = %s").format(sql.Identifier(postgres_schema)),
        (jid,),
    )
    assert await cur.fetchall() == [("queued",)]


async def test_version_rows_removed_by_hand_are_named_not_the_servers_words(
    pg: PostgresStore, postgres_url: str, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """With the schema_version rows of its last migrations deleted by hand, opening the
    store ran those migrations again and failed with the server's own words (`relation
    "open_blocks" already exists`). It now says what the schema records and holds, and
    migrates nothing: the rows stay as they were."""
    from tokenline.stores.postgres._migrations import SCHEMA_VERSION

    await admin.execute(
        sql.SQL("DELETE FROM {}.schema_version WHERE version >= 13").format(
            sql.Identifier(postgres_schema)
        )
    )
    for attempt in (PostgresStore(postgres_url).open, PostgresStore(postgres_url).migrate):
        with pytest.raises(StoreCorruptError, match=r"records version 12, yet holds what migr"):
            await attempt()
    cur = await admin.execute(
        sql.SQL("SELECT max(version) FROM {}.schema_version").format(
            sql.Identifier(postgres_schema)
        )
    )
    assert await cur.fetchall() == [(12,)]
    assert SCHEMA_VERSION >= 13


async def test_wrong_database_name_is_named_in_the_error(postgres_server: str) -> None:
    """A missing database is reported by name, with how to create it."""
    base, _, _ = postgres_server.rpartition("/")
    missing = f"tokenline_missing_{secrets.token_hex(4)}"
    store = PostgresStore(f"{base}/{missing}", timeout=3)
    with pytest.raises(StoreUnavailableError, match=f"{missing}.*createdb"):
        await store.open()


async def test_unreachable_server_fails_fast_with_the_address() -> None:
    """Nothing listening on the port: a clear error within the timeout, never a hang."""
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test", timeout=2)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1:1\b"):
        await store.open()
    assert time.monotonic() - started < 10


async def test_busy_pool_raises_instead_of_hanging(postgres_url: str) -> None:
    """With every pooled connection taken, an operation fails after the timeout."""
    store = PostgresStore(postgres_url, timeout=1, max_connections=1)
    await store.open()
    try:
        pool = store._require_pool()
        held = await pool.getconn()  # the pool's one connection, as a long call holds it
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="within 1s"):
                await store.jobs_list()
            assert time.monotonic() - started < 5
        finally:
            await pool.putconn(held)
    finally:
        await store.close()


async def test_statement_timeout_bounds_a_blocked_write(
    postgres_url: str, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """A finish stuck behind another session's row lock is cancelled by the server
    after the store timeout and reported as the store being unavailable."""
    blocked = PostgresStore(postgres_url, timeout=1)
    await blocked.open()
    try:
        await blocked.jobs_enqueue(jobs=[new()])
        (claimed,) = await blocked.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        jobs = sql.SQL("{}.jobs").format(sql.Identifier(postgres_schema))
        async with admin.transaction():
            await admin.execute(
                sql.SQL("SELECT id FROM {} WHERE id = %s FOR UPDATE").format(jobs),
                (claimed.job.id,),
            )
            with pytest.raises(StoreUnavailableError, match="statement_timeout"):
                await blocked.jobs_finish(finishes=[Finish(claimed.lease, Outcome.RETRY)])
        assert (await blocked.job_get(job_id=claimed.job.id)).state is JobState.RUNNING
    finally:
        await blocked.close()


async def test_open_fenced_transaction_blocks_no_renewal_and_refuses_a_lost_job(
    postgres_url: str,
) -> None:
    """While a fenced transaction is open, a renewal of its job and a finish sent on
    another connection do not wait for it; once the job is no longer this attempt's
    (here, retried meanwhile), its commit is refused and the user's writes roll back."""
    holder = PostgresStore(postgres_url, timeout=5)
    other = PostgresStore(postgres_url, timeout=1)
    await holder.open()
    await other.open()
    try:
        await holder.jobs_enqueue(jobs=[new()])
        (claimed,) = await holder.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        transaction = holder.fenced_transaction(lease=claimed.lease)
        conn = await transaction.__aenter__()
        await conn.execute("CREATE TABLE marks (n int)")
        renewed = await other.job_leases_renew(owner="w", leases=[claimed.lease], ttl=30)
        assert renewed[0] is not None
        retry = Finish(claimed.lease, Outcome.RETRY, 60.0)
        assert await other.jobs_finish(finishes=[retry]) == [True]
        with pytest.raises(StaleTokenError):
            await transaction.__aexit__(None, None, None)
        job = await holder.job_get(job_id=claimed.job.id)
        assert job.state is JobState.SCHEDULED
        async with holder._pool.connection() as conn:  # type: ignore[union-attr]
            cur = await conn.execute("SELECT to_regclass('marks')")
            assert (await cur.fetchone()) == (None,)
    finally:
        await other.close()
        await holder.close()


async def test_rescue_ends_the_open_transaction_of_the_attempt_it_rescues(
    postgres_url: str, admin: psycopg.AsyncConnection[Any], clock: FakeClock
) -> None:
    """A fenced transaction left open by an attempt whose lease expired (its worker
    paused or cut off) neither keeps the job from being rescued nor outlives the
    rescue: the rescuer ends that session, so its locks on user rows go at once."""
    zombie = PostgresStore(postgres_url, clock=clock, timeout=5)
    rescuer = PostgresStore(postgres_url, clock=clock, timeout=5)
    await zombie.open()
    await rescuer.open()
    try:
        await zombie.jobs_enqueue(jobs=[new()])
        (claimed,) = await zombie.jobs_claim(owner="w", queues=["default"], limit=1, ttl=5)
        session = zombie.session_name(claimed.lease)
        transaction = zombie.fenced_transaction(lease=claimed.lease)
        await transaction.__aenter__()

        async def open_sessions() -> int:
            cur = await admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (session,)
            )
            row = await cur.fetchone()
            return int(row[0]) if row else 0

        assert await open_sessions() == 1
        clock.advance(6)
        report = await rescuer.jobs_rescue()
        assert list(report.requeued) == [claimed.job.id]
        for _ in range(100):
            if await open_sessions() == 0:
                break
            await asyncio.sleep(0.05)
        assert await open_sessions() == 0
        with pytest.raises(StoreError):
            await transaction.__aexit__(None, None, None)
        job = await rescuer.job_get(job_id=claimed.job.id)
        assert (job.state, job.lease_token) == (JobState.QUEUED, claimed.lease.token + 1)
    finally:
        await rescuer.close()
        await zombie.close()


async def test_a_paused_commit_does_not_keep_its_expired_job_from_the_rescue(
    postgres_url: str, admin: psycopg.AsyncConnection[Any], clock: FakeClock
) -> None:
    """An attempt paused between its completion UPDATE and its COMMIT holds the job's
    row lock, in a session allowed to idle for the attempt's whole timeout. Once its
    lease expires, the rescue ends that session (rolling the commit back) and the next
    rescue takes the job: ownership does not outlast the lease."""
    zombie = PostgresStore(postgres_url, clock=clock, timeout=5)
    rescuer = PostgresStore(postgres_url, clock=clock, timeout=5)
    await zombie.open()
    await rescuer.open()
    try:
        await zombie.jobs_enqueue(jobs=[new()])
        (claimed,) = await zombie.jobs_claim(owner="w", queues=["default"], limit=1, ttl=5)
        transaction = zombie.fenced_transaction(lease=claimed.lease, timeout=600)
        conn = await transaction.__aenter__()
        await conn.execute("CREATE TABLE paused_marks (n int)")
        # The lock the completion UPDATE takes, then the pause before COMMIT.
        await conn.execute(
            f"SELECT id FROM {zombie.target.schema}.jobs WHERE id = %s FOR NO KEY UPDATE",
            (claimed.job.id,),
        )
        clock.advance(6)
        for _ in range(100):
            report = await rescuer.jobs_rescue()
            if report.requeued:
                break
            await asyncio.sleep(0.05)
        assert list(report.requeued) == [claimed.job.id]
        with pytest.raises(StoreError):
            await transaction.__aexit__(None, None, None)
        job = await rescuer.job_get(job_id=claimed.job.id)
        assert (job.state, job.lease_token) == (JobState.QUEUED, claimed.lease.token + 1)
        cur = await admin.execute("SELECT to_regclass('paused_marks')")
        assert (await cur.fetchone()) == (None,), "the paused commit went through"
    finally:
        await rescuer.close()
        await zombie.close()


async def test_database_refuses_backwards_state_moves(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """The trigger refuses succeeded → running even from SQL that bypasses the store."""
    (jid,) = await pg.jobs_enqueue(jobs=[new()])
    (claimed,) = await pg.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
    await pg.job_complete(lease=claimed.lease)
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal job state transition"):
        await admin.execute(
            sql.SQL("UPDATE {}.jobs SET state = 'running' WHERE id = %s").format(
                sql.Identifier(postgres_schema)
            ),
            (jid,),
        )


async def test_the_database_allows_exactly_the_transitions_the_code_allows(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str
) -> None:
    """Every pair of states, moved by plain SQL: the trigger lets through exactly the
    moves in ALLOWED_TRANSITIONS (and a write that keeps the state), and refuses every
    other one by name, leaving the row as it was."""
    await pg.jobs_enqueue(jobs=[new()])  # the schema exists, migrated
    jobs = sql.Identifier(postgres_schema, "jobs")
    pairs = [(src, dst) for src in JobState for dst in JobState]
    cur = await admin.execute(
        sql.SQL(
            "INSERT INTO {} (queue, task, args, run_at, max_attempts, state, created_at, "
            "updated_at) SELECT 'pairs', 't', '[]', 0, 1, s, 0, 0 FROM unnest(%s::text[]) "
            "WITH ORDINALITY AS u (s, n) ORDER BY n RETURNING id"
        ).format(jobs),
        ([src.value for src, _ in pairs],),
    )
    ids = [row[0] for row in await cur.fetchall()]
    refused: list[tuple[JobState, JobState]] = []
    messages: list[str] = []
    for (src, dst), jid in zip(pairs, ids, strict=True):
        try:
            await admin.execute(
                sql.SQL("UPDATE {} SET state = %s WHERE id = %s").format(jobs), (dst.value, jid)
            )
        except psycopg.errors.CheckViolation as exc:
            messages.append(exc.diag.message_primary or "")
            refused.append((src, dst))
            cur = await admin.execute(
                sql.SQL("SELECT state FROM {} WHERE id = %s").format(jobs), (jid,)
            )
            assert (await cur.fetchone()) == (src.value,)
    expected = [(s, d) for s, d in pairs if s != d and d not in ALLOWED_TRANSITIONS[s]]
    assert refused == expected
    by_id = dict(zip(pairs, ids, strict=True))
    assert messages == [
        f"tokenline: illegal job state transition {s.value} -> {d.value} (job {by_id[s, d]})"
        for s, d in expected
    ]


async def test_leases_follow_the_database_clock(pg: PostgresStore) -> None:
    """Without an injected clock, expiry is the database's now plus the TTL."""
    await pg.jobs_enqueue(jobs=[new()])
    (claimed,) = await pg.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)
    assert claimed.lease.expires_at == pytest.approx(time.time() + 60, abs=5)
    assert list((await pg.jobs_rescue()).requeued) == []


@pytest.mark.parametrize("sabotaged", [False, True])
async def test_the_token_lines_are_what_refuse_a_stale_finish(
    postgres_url: str, clock: FakeClock, sabotaged: bool
) -> None:
    """A stale token's finish of a running job is refused; with the query lines marked
    ``-- fence`` removed (the test tree's state-only store), it is accepted: those lines
    are the check, and the control experiments remove exactly them."""
    from sabotage import state_only_postgres

    store = (
        state_only_postgres(postgres_url, clock=clock)
        if sabotaged
        else PostgresStore(postgres_url, clock=clock)
    )
    await store.open()
    try:
        (jid,) = await store.jobs_enqueue(jobs=[new()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        zombie = Lease(jid, "zombie", claimed.lease.token - 1, claimed.lease.expires_at)
        stale = Finish(zombie, Outcome.SUCCEEDED)
        assert await store.jobs_finish(finishes=[stale]) == [sabotaged]
    finally:
        await store.close()


@pytest.mark.parametrize(
    "schema", ["Upper", "1digit", "x" * 51, "a-b", "robert');drop table jobs;--"]
)
def test_schema_name_is_validated(schema: str) -> None:
    """Only plain lower-case identifiers are accepted as schema names."""
    with pytest.raises(ConfigError, match="schema"):
        PostgresStore(f"postgresql://app@db.example/app?schema={schema}")


@pytest.mark.parametrize("schema", ["information_schema", "pg_jobs", "pg_temp"])
def test_a_system_schema_is_refused(schema: str) -> None:
    """``?schema=information_schema`` was accepted: tokenline's tables went into it,
    and pg_dump, which leaves that schema out, left every job out of the backup."""
    with pytest.raises(ConfigError, match="one of PostgreSQL's own"):
        PostgresStore(f"postgresql://app@db.example/app?schema={schema}")


def test_store_from_url_builds_a_postgres_store() -> None:
    """postgresql:// URLs reach this store, with the schema taken from the URL and
    every other parameter left to libpq."""
    store = store_from_url("postgresql://app@db.example/app?sslmode=require&schema=billing")
    assert isinstance(store, PostgresStore)
    assert store.schema == "billing"
    assert "sslmode=require" in store.target.conninfo
    assert "billing" not in store.target.conninfo


class _Relay:
    """A TCP relay to the test server that a test can cut or silence."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: While true, bytes are swallowed both ways: a peer that stopped answering.
        self.silent = False

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        self._writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                if not self.silent:
                    dst.write(data)
                    await dst.drain()
        dst.close()

    async def cut(self) -> None:
        """Refuse new connections and drop every open one: the server is gone."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def relay_url(
    postgres_server: str, postgres_url_via: Callable[[str], str]
) -> AsyncIterator[tuple[str, _Relay]]:
    """A store URL for this test's schema that goes through a relay the test controls."""
    params = conninfo_to_dict(postgres_server)
    relay = _Relay(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    port = await relay.start()
    auth = quote(str(params.get("user", "postgres")))
    if params.get("password"):
        auth += ":" + quote(str(params["password"]))
    url = f"postgresql://{auth}@127.0.0.1:{port}/{quote(str(params.get('dbname', 'test')))}"
    try:
        yield postgres_url_via(url), relay
    finally:
        await relay.cut()


async def test_a_vanished_server_is_reported_not_waited_for(
    relay_url: tuple[str, _Relay],
) -> None:
    """Once the server is gone, operations fail with StoreUnavailableError within the
    timeout: the pool's dead connections are noticed, new ones are refused."""
    url, relay = relay_url
    store = PostgresStore(url, timeout=1)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[new()])
        await relay.cut()
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.jobs_list()
        assert time.monotonic() - started < 5
    finally:
        await store.close()


async def test_a_silent_server_is_reported_not_waited_for(
    relay_url: tuple[str, _Relay],
) -> None:
    """A server that stops answering without closing anything (a partition) cannot
    hold an operation past the store's deadline."""
    url, relay = relay_url
    store = PostgresStore(url, timeout=1)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[new()])
        relay.silent = True
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await store.jobs_list()
        assert time.monotonic() - started < 10
    finally:
        await relay.cut()
        await store.close()


async def test_deadline_cuts_an_operation_that_absorbs_a_polite_cancel() -> None:
    """Like psycopg waiting for the server to confirm a cancel, an operation may absorb
    the first cancellation; the second, after a short grace, ends it."""

    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await run_bounded(stubborn(), 0.1)
    assert time.monotonic() - started < 0.1 + CANCEL_GRACE + 1


async def test_deadline_hands_back_a_result_that_arrives_too_late() -> None:
    """A result produced while the operation is being given up (a pooled connection at
    the last moment) goes to ``discard`` instead of leaking."""
    discarded: list[str] = []

    async def late() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "connection"
        return "never"

    async def discard(result: str) -> None:
        discarded.append(result)

    with pytest.raises(TimeoutError):
        await run_bounded(late(), 0.05, discard=discard)
    assert discarded == ["connection"]


def test_a_small_claim_names_its_size_in_the_text_and_a_big_one_does_not() -> None:
    """Up to LITERAL_CLAIM_LIMIT the number replaces every %(limit)s; beyond, the
    parameter stays (so the texts per statement stay few)."""
    text = "SELECT 1 LIMIT %(limit)s; HAVING count(*) >= %(limit)s"
    assert with_claim_limit(text, 1) == "SELECT 1 LIMIT 1; HAVING count(*) >= 1"
    assert with_claim_limit(text, LITERAL_CLAIM_LIMIT).count(str(LITERAL_CLAIM_LIMIT)) == 2
    assert with_claim_limit(text, LITERAL_CLAIM_LIMIT + 1) == text
    assert with_claim_limit(text, 0) == text


@pytest.mark.parametrize("fused", [False, True])
async def test_small_claims_keep_one_plan_on_the_server(
    pg: PostgresStore, postgres_url: str, fused: bool
) -> None:
    """Executed as a prepared statement, a small claim (alone or fused with a finish)
    gets the server's generic plan, not a fresh plan per call: with its limit as a
    parameter the server re-plans every call (it takes the LIMIT for a tenth of the
    table), which cost more than the claim itself. A few thousand jobs queued, enough
    for that guess to make every generic plan look dear."""
    await pg.jobs_enqueue(jobs=[new() for _ in range(5000)])
    conn = await psycopg.AsyncConnection.connect(pg.target.conninfo, autocommit=True)
    try:
        held: list[Lease] = []
        for _ in range(12):
            params = pg._claim_params("w", ["default"], 1, 60.0, None)
            if fused:
                done = [Finish(lease, Outcome.SUCCEEDED) for lease in held]
                params = {**pg._finish_params(done), **params}
            cur = await conn.execute(pg._claim_text(1, fused=fused), params, prepare=True)
            rows = await cur.fetchall()
            jid, token = _col(cur, "id"), _col(cur, "lease_token")
            held = [Lease(int(r[jid]), "w", int(r[token]), 0.0) for r in rows]
        # The most used one (an empty first batch of finishes has other parameter types).
        await assert_one_plan_kept(conn)
    finally:
        await conn.close()


async def assert_one_plan_kept(conn: psycopg.AsyncConnection[Any]) -> None:
    """The statement ``conn`` prepared most often runs on the plan the server keeps:
    planned afresh only for its first five runs, as PostgreSQL does before choosing."""
    cur = await conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
        " ORDER BY generic_plans + custom_plans DESC LIMIT 1"
    )
    ((generic, custom),) = await cur.fetchall()
    assert generic > 0, (generic, custom)
    assert custom <= 5, (generic, custom)


def _col(cur: psycopg.AsyncCursor[Any], name: str) -> int:
    assert cur.description is not None
    return [c.name for c in cur.description].index(name)


@pytest.mark.parametrize("limit", [LITERAL_CLAIM_LIMIT, LITERAL_CLAIM_LIMIT + 1])
async def test_a_claim_takes_exactly_its_limit_on_both_sides_of_the_literal_bound(
    pg: PostgresStore, limit: int
) -> None:
    """The texts with the number and with the parameter claim the same: the best
    ``limit`` jobs, no more, in priority order, alone and fused with a finish."""
    await pg.jobs_enqueue(jobs=[NewJob("default", "t", "[]", priority=p % 5) for p in range(60)])
    alone = await pg.jobs_claim(owner="w", queues=["default"], limit=limit, ttl=60)
    assert len(alone) == limit
    assert [c.job.priority for c in alone] == sorted((c.job.priority for c in alone), reverse=True)
    assert all(c.job.priority == 4 for c in alone[:12])
    done, fused = await pg.jobs_finish_and_claim(
        finishes=[Finish(alone[0].lease, Outcome.SUCCEEDED)],
        owner="w",
        queues=["default"],
        limit=limit,
        ttl=60,
    )
    assert done == [True]
    assert len(fused) == limit
    taken = {c.job.id for c in alone} | {c.job.id for c in fused}
    assert len(taken) == 2 * limit


@pytest.mark.parametrize(
    "statement",
    [
        "claim",
        "finish_and_claim",
        "finish_one_and_claim",
        "finish",
        "finish_one",
        "job_leases_renew",
    ],
)
async def test_the_plans_kept_for_per_job_statements_read_jobs_by_index(
    pg: PostgresStore, admin: psycopg.AsyncConnection[Any], postgres_schema: str, statement: str
) -> None:
    """The plan the server keeps for a worker's per-job statements (made without the
    parameters' values) reads the jobs table by index on a table of some thousands of
    jobs: never a scan of the whole table per call (a claim with its size as a
    parameter does: it fails so). A finish reads its jobs by primary key, never through
    the index of running jobs: statistics taken while few jobs ran made that look cheap,
    and each finish then read every running job (the finish's state check on the
    updated row itself did so)."""
    await pg.jobs_enqueue(jobs=[new() for _ in range(5000)])
    await admin.execute(f'ANALYZE "{postgres_schema}".jobs')
    one = Finish(Lease(1, "w", 1, 0.0), Outcome.SUCCEEDED)
    text = {
        "claim": pg._claim_text(1),
        "finish_and_claim": pg._claim_text(1, fused=True),
        "finish_one_and_claim": pg._claim_text(1, fused=True, one=True),
        "finish_one": pg._finish_statement([one])[0],
    }.get(statement) or pg._q(statement)
    plan = await generic_plan(admin, text)
    assert "Seq Scan on jobs" not in plan, plan
    if statement.startswith("finish"):
        assert "jobs_expiry" not in plan, plan


async def test_a_finish_of_one_job_keeps_one_plan_on_the_server(
    pg: PostgresStore, postgres_url: str
) -> None:
    """Executed as a prepared statement, the finish of one job (the batch a worker at
    one job at a time mostly sends) gets the server's generic plan, not a fresh plan
    per call: given arrays, the server guessed ten rows, found that plan dearer than
    one for the one row, and planned every call afresh."""
    await pg.jobs_enqueue(jobs=[new() for _ in range(5000)])
    claimed = await pg.jobs_claim(owner="w", queues=["default"], limit=12, ttl=60)
    conn = await psycopg.AsyncConnection.connect(pg.target.conninfo, autocommit=True)
    try:
        for c in claimed:
            text, params = pg._finish_statement([Finish(c.lease, Outcome.SUCCEEDED)])
            cur = await conn.execute(text, params, prepare=True)
            assert len(await cur.fetchall()) == 1  # accepted
        await assert_one_plan_kept(conn)
    finally:
        await conn.close()


def test_a_batch_statement_for_one_row_takes_each_array_as_its_one_element() -> None:
    """Every array parameter, element type kept, and nothing else."""
    text = "unnest(%(a)s::bigint[], %(b)s::double precision[]) WHERE x = %(now)s"
    assert for_one_row(text) == (
        "unnest(ARRAY[%(a)s::bigint], ARRAY[%(b)s::double precision]) WHERE x = %(now)s"
    )
    with pytest.raises(StoreError):
        for_one_row("SELECT %(now)s")


#: Typed in binary, a list of strings reaches the server as text[]; in text form, as an
#: untyped literal the server reads as whatever the statement needs (here uuid[]).
ARRAY_TYPE = "SELECT pg_typeof(%s)::text"
UUID_IN = "SELECT %s::uuid = ANY(%s)"


async def test_batch_arrays_go_in_binary_and_a_handlers_lists_as_before(
    pg: PostgresStore,
) -> None:
    """The store's batch arrays (BinaryArray) reach the server typed, in binary form,
    on both pools. A plain list in a handler's own statement, on the connection
    ctx.transaction() hands it, still goes as an untyped text literal: compared with
    a uuid column it is read as uuid[], where a text[] would be refused."""
    one = "6f1c2a9e-2b3c-4d5e-8f90-1a2b3c4d5e6f"
    await pg.jobs_enqueue(jobs=[new(), new()])
    first, second = await pg.jobs_claim(owner="w", queues=["default"], limit=2, ttl=60)

    async with pg.fenced_transaction(lease=first.lease) as conn:
        cur = await conn.execute(ARRAY_TYPE, (BinaryArray(["a", None]),))
        assert await cur.fetchone() == ("text[]",)
        cur = await conn.execute(UUID_IN, (one, [one]))
        assert await cur.fetchone() == (True,)

    def sync_form() -> list[Any]:
        with pg.fenced_transaction(lease=second.lease) as conn:
            return [
                conn.execute(ARRAY_TYPE, (BinaryArray([1, 2]),)).fetchone(),
                conn.execute(UUID_IN, (one, [one])).fetchone(),
            ]

    assert await asyncio.to_thread(sync_form) == [("smallint[]",), (True,)]
    # Both jobs were finished by their transactions: the arrays in them went through.
    assert {j.state for j in await pg.jobs_list()} == {JobState.SUCCEEDED}
