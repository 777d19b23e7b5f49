"""PostgreSQL that accepts no writes: a hot standby, or ``default_transaction_read_only``
on for the store's role; and one that refuses the role new connections (its limit).

Each test runs as a role of its own that owns the test's schema, made read-only (and
writable again) with ``ALTER ROLE``; only that role's sessions are ever terminated.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from tokenline._errors import OutcomeUnknownError, StoreUnavailableError
from tokenline._jobs import Finish, JobState, NewJob, Outcome
from tokenline.classify import ErrorClass, classify
from tokenline.cli import main
from tokenline.stores.postgres import PostgresStore
from tokenline.stores.postgres._errors import ReadOnlyServerError

pytestmark = pytest.mark.postgres


@dataclass(frozen=True)
class OwnRole:
    """A login role owning the test's schema, and the store URL that connects as it."""

    server: str
    name: str
    schema: str
    url: str

    def jobs(self) -> int:
        """How many jobs the schema holds, read as the test's own user."""
        with psycopg.connect(self.server, autocommit=True) as conn:
            query = sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(self.schema))
            row = conn.execute(query).fetchone()
            assert row is not None
            return int(row[0])

    def read_only(self, on: bool, *, terminate: bool = True) -> None:
        """Make the role's new sessions read-only (or not); ``terminate``: end its
        current sessions too, so that its pools reconnect under the new setting."""
        role = sql.Identifier(self.name)
        with psycopg.connect(self.server, autocommit=True) as conn:
            change = "SET default_transaction_read_only = on" if on else "RESET ALL"
            conn.execute(sql.SQL("ALTER ROLE {} " + change).format(role))
            if terminate:
                self.terminate(conn)

    def terminate(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """End every session of this role (and of no other)."""
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            (self.name,),
        )


@pytest.fixture
def own_role(postgres_server: str, postgres_schema: str) -> Iterator[OwnRole]:
    """A role of this test's own, owner of its (empty) schema."""
    name = f"rofix_{secrets.token_hex(4)}"
    role, schema = sql.Identifier(name), sql.Identifier(postgres_schema)
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        conn.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(schema, role))
    parts = urlsplit(postgres_server)
    netloc = f"{name}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    url = urlunsplit((parts.scheme, netloc, parts.path, f"schema={postgres_schema}", ""))
    own = OwnRole(postgres_server, name, postgres_schema, url)
    try:
        yield own
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            own.terminate(conn)
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(schema))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(role))


async def tries(call: Callable[[], Awaitable[object]], until: type[BaseException] | None) -> int:
    """Call ``call`` until it raises ``until`` (``None``: until it succeeds), at most
    ten times, a fifth of a second apart; how many calls it took. Any other
    :class:`StoreUnavailableError` is a try that failed (the first call after the
    role's sessions were ended finds its connection gone)."""
    for n in range(1, 11):
        try:
            await call()
        except StoreUnavailableError as exc:
            if until is not None and isinstance(exc, until):
                return n
        else:
            if until is None:
                return n
        await asyncio.sleep(0.2)
    raise AssertionError(f"still not {until or 'succeeding'} after 10 tries")


def new() -> NewJob:
    return NewJob(queue="default", task="t", args="[]")


async def test_a_refused_write_is_a_coordination_failure_that_says_why(own_role: OwnRole) -> None:
    """On a role whose sessions are read-only, an enqueue and a finish are refused as
    the store being unavailable (a worker drains and tries again; no attempt is spent),
    saying that the server accepts no writes and why, not as a failed operation; the
    enqueue is known not to have been made (not an outcome unknown), and nothing was
    written."""
    store = PostgresStore(own_role.url, timeout=5)
    await store.open()
    try:
        (jid,) = await store.jobs_enqueue(jobs=[new()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=60)
    finally:
        await store.close()
    own_role.read_only(True)
    store = PostgresStore(own_role.url, timeout=5)
    await store.open()  # the schema is current: opening writes nothing
    try:
        with pytest.raises(StoreUnavailableError) as enqueued:
            await store.jobs_enqueue(jobs=[new()])
        assert not isinstance(enqueued.value, OutcomeUnknownError)
        finish = Finish(claimed.lease, Outcome.SUCCEEDED)
        with pytest.raises(StoreUnavailableError) as finished:
            await store.jobs_finish(finishes=[finish])
        for refused in (enqueued.value, finished.value):
            text = str(refused)
            assert "accepts no writes" in text, text
            assert "default_transaction_read_only" in text, text
            assert "standby" in text, text
            assert classify(refused).error_class is ErrorClass.COORDINATION
        assert [j.id for j in await store.jobs_list()] == [jid]
        job = await store.job_get(job_id=jid)
        assert (job.state, job.attempt) == (JobState.RUNNING, 1)
        assert job.lease_token == claimed.lease.token
    finally:
        await store.close()


def test_status_says_every_channel_refuses_on_a_server_that_takes_no_writes(
    own_role: OwnRole,
) -> None:
    """Reads answer and the jobs table's lock is granted to a read-only transaction, so
    the channels looked ok while every enqueue, renewal and ledger write failed: each
    is reported refusing, saying the server accepts no writes and what it refuses, and
    status exits 1."""
    asyncio.run(PostgresStore(own_role.url, timeout=5).migrate())
    own_role.read_only(True)
    env = {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
    refused = {
        "broker": "enqueues, claims and finishes are refused",
        "leases": "lease renewals, heartbeats and worker registration are refused",
        "ledger": "the ledger's writes (effects, fences, fenced transactions) are refused",
    }
    for args in ([], ["--json"]):
        result = CliRunner().invoke(
            main, ["status", "--url", own_role.url, *args], env=env, catch_exceptions=False
        )
        assert result.exit_code == 1, result.output
        texts = []
        if args:
            for name in refused:
                channel = json.loads(result.output)["channels"][name]
                assert (channel["ok"], channel["failure"]) == (False, "refusing"), channel
                texts.append(channel["error"])
        else:
            text = " ".join(result.output.split())
            for name in refused:
                assert f"{name} FAILING refusing" in text, text
            texts.append(text)
        for text in texts:
            assert f"on {urlsplit(own_role.url).hostname}:" in text, text
            assert "accepts no writes" in text, text
            assert f"default_transaction_read_only is on for role {own_role.name!r}" in text
        assert all(what in " ".join(texts) for what in refused.values()), texts


def test_a_command_refused_as_read_only_does_not_say_it_may_have_changed_anything(
    own_role: OwnRole,
) -> None:
    """`tokenline pause` on a read-only server printed "the store may have made the
    change before its answer was lost": the server refused the write whole, and the
    error says nothing was written."""
    asyncio.run(PostgresStore(own_role.url, timeout=5).migrate())
    own_role.read_only(True)
    env = {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
    result = CliRunner().invoke(
        main, ["pause", "billing", "--url", own_role.url], env=env, catch_exceptions=False
    )
    assert result.exit_code == 1, result.output
    assert "accepts no writes" in result.output, result.output
    assert "may have made the change" not in result.output, result.output


@pytest.mark.parametrize("blocking", [False, True])
async def test_the_store_writes_again_once_the_server_takes_writes(
    own_role: OwnRole, blocking: bool
) -> None:
    """A pool kept the connections that had answered "read-only": once the role could
    write again, every enqueue still failed for as long as the process ran. A
    connection that answers so is closed instead, and the store recovers by itself
    (the main pool and the blocking one alike); each success is one job, no more."""
    store = PostgresStore(own_role.url, timeout=5)
    await store.open()

    async def enqueue() -> None:
        if blocking:
            await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[new()])
        else:
            await store.jobs_enqueue(jobs=[new()])

    try:
        await enqueue()
        own_role.read_only(True)  # and its sessions ended: the pools reconnect read-only
        await tries(enqueue, ReadOnlyServerError)
        own_role.read_only(False, terminate=False)
        # The pool may have opened a read-only connection before the reset: a few tries.
        assert await tries(enqueue, None) <= 3
        assert own_role.jobs() == 2
    finally:
        await store.close()


async def test_a_connection_the_server_refuses_is_said_with_its_reason(
    own_role: OwnRole,
) -> None:
    """The role's connection limit reached: a call that needed one more connection
    waited out the pool and said "the server is unreachable, or every connection of
    the pool is busy", while the server answered, naming its reason, in psycopg's log
    only. The error now gives the server's reason (not calling every failure a refusal:
    a connection that timed out fails the same way, and says so)."""
    await PostgresStore(own_role.url, timeout=5).migrate()
    with psycopg.connect(own_role.server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER ROLE {} CONNECTION LIMIT 1").format(sql.Identifier(own_role.name))
        )
    store = PostgresStore(own_role.url, timeout=1)
    await store.open()  # its pool's one connection: the role's limit
    try:
        pool = store._require_pool()
        async with pool.connection():  # held: the next call needs another
            with pytest.raises(StoreUnavailableError) as refused:
                await store.queues_stats()
        text = str(refused.value)
        assert "the last try to connect failed" in text, text
        assert "too many connections for role" in text, text
        assert "every connection of the pool is busy" not in text, text
    finally:
        await store.close()
