"""An enqueue whose request reached the store and whose answer was lost says that the job
may exist (``OutcomeUnknownError``), and a unique key makes enqueueing it again safe.

The proxy passes the request to the server and drops its answer: the job is made, and
the caller hears only that the connection failed. It used to say "server closed the
connection" or "cannot reach Redis", as if nothing had been done; a caller that
enqueued again made a second job. A request that never left (no connection could be
made) still fails as a plain ``StoreUnavailableError``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import exceptions as rx

from tokenline import App, JobContext, OutcomeUnknownError, Settings, StoreUnavailableError
from tokenline.drill import ThreadedFaultProxy
from tokenline.stores import split_url
from tokenline.stores.redis._errors import maybe_sent

pytestmark = pytest.mark.timeout(120)

#: Short, so that a lost answer is given up on quickly; the deadline is 2 x 1 + 1 s.
TIMEOUT = 1.0


def _ids(app: App, key: str) -> list[int]:
    """The ids of the jobs of ``key`` in the store (every state)."""
    jobs = app.run(lambda s: s.jobs_list(limit=1000))
    return [job.id for job in jobs if job.idempotency_key == key]


def _app(url: str) -> App:
    app = App(url, settings=Settings(store_timeout=TIMEOUT))

    @app.task(name="demo.t")
    def t(ctx: JobContext, n: int) -> None:
        """Enqueued, never run."""

    return app


@pytest.fixture
def postgres_proxied(postgres_server: str) -> Iterator[tuple[App, ThreadedFaultProxy]]:
    """An app on a fresh schema whose connections go through a fault proxy."""
    import psycopg

    schema = f"tl_unknown_{uuid.uuid4().hex[:8]}"
    with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        app = _app(f"{via}?schema={schema}")
        try:
            yield app, proxy
        finally:
            proxy.clear()
            app.close()
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def redis_proxied(
    redis_url: str, postgres_server: str, absent_schema: str
) -> Iterator[tuple[App, ThreadedFaultProxy]]:
    """An app of the split topology, on a fresh Redis prefix reached through a fault
    proxy (the broker, where jobs are enqueued) and a fresh PostgreSQL schema."""
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with ThreadedFaultProxy(upstream=(host, int(port))) as proxy:
        via = redis_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")
        broker = f"{via}&socket_timeout={TIMEOUT:g}"
        app = _app(split_url(broker, f"{postgres_server}?schema={absent_schema}"))
        try:
            yield app, proxy
        finally:
            proxy.clear()
            app.close()


@pytest.mark.parametrize("call", ["sync", "async"])
@pytest.mark.parametrize("store", ["postgres", "redis"])
def test_an_enqueue_whose_answer_was_lost_says_the_job_may_exist(
    request: pytest.FixtureRequest, store: str, call: str
) -> None:
    """The job was made; the error says it may have been, and the same enqueue with a
    unique key answers with that job's id instead of making a second one."""
    app, proxy = request.getfixturevalue(f"{store}_proxied")
    assert app.enqueue("demo.t", 0) > 0  # connected, schema made, loop and pools warm
    key = f"order-{uuid.uuid4().hex[:8]}"

    def enqueue() -> int:
        if call == "sync":
            return app.enqueue("demo.t", 1, idempotency_key=key, unique=True)
        return app.run(
            lambda s: app.enqueue_async("demo.t", 1, idempotency_key=key, unique=True, store=s)
        )

    proxy.set_faults(drop_to_client=True)  # the request goes through, the answer not
    with pytest.raises(OutcomeUnknownError) as raised:
        enqueue()
    assert isinstance(raised.value, StoreUnavailableError)  # still a coordination error
    message = str(raised.value)
    assert "the job may have been enqueued all the same" in message, message
    assert "give it an idempotency_key with unique=True" in message, message
    proxy.clear()
    (made,) = _ids(app, key)  # made, although its answer was lost
    assert enqueue() == made  # enqueued again: the same job, not a second one
    assert _ids(app, key) == [made]


def test_a_blocking_enqueue_that_could_not_connect_says_nothing_was_sent(
    postgres_proxied: tuple[App, ThreadedFaultProxy],
) -> None:
    """The first enqueue from ordinary code opens a connection of its own: refused, no
    request went out, and the error is the plain one, with no word of a job that may
    exist."""
    app, proxy = postgres_proxied
    assert app.enqueue_many("demo.t", []) == []
    app.run(lambda s: s.store_time())  # the store open; the blocking pool still empty
    proxy.set_faults(refuse=True)
    with pytest.raises(StoreUnavailableError) as raised:
        app.enqueue("demo.t", 1)
    assert not isinstance(raised.value, OutcomeUnknownError), raised.value
    assert "may have been enqueued" not in str(raised.value)


def test_redis_errors_of_a_connection_never_made_are_not_taken_for_sent() -> None:
    """redis-py's failures to connect, and Redis's own refusals, sent nothing that
    could have been carried out; a timeout reading an answer, or a connection closed
    mid-request, may have."""

    def unavailable(cause: BaseException) -> StoreUnavailableError:
        exc = StoreUnavailableError(str(cause))
        exc.__cause__ = cause
        return exc

    never = [
        rx.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
        rx.TimeoutError("Timeout connecting to server"),
        rx.AuthenticationError("invalid username-password pair"),
        rx.ReadOnlyError("You can't write against a read only replica."),
        rx.BusyLoadingError("Redis is loading the dataset in memory"),
    ]
    maybe = [
        rx.TimeoutError("Timeout reading from socket"),
        rx.ConnectionError("Connection closed by server."),
        TimeoutError("no answer within 3s"),
    ]
    assert [maybe_sent(unavailable(c)) for c in never] == [False] * len(never)
    assert [maybe_sent(unavailable(c)) for c in maybe] == [True] * len(maybe)


async def test_a_sqlite_enqueue_given_up_on_once_begun_says_the_job_may_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async enqueue on SQLite that runs past the store's deadline on its thread (a
    disk that stalls mid-write) is given up on; it had begun, and it commits when the
    disk comes back: the error says that the job may exist, and it does."""
    import threading
    import time

    from tokenline._jobs import NewJob
    from tokenline.stores.sqlite import SQLiteStore

    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}", timeout=0.5)  # deadline 2 s
    await store.open()
    stalled = threading.Event()
    insert = store._enqueue_on

    def stalling(conn: object, jobs: object) -> object:
        if threading.current_thread() is not threading.main_thread():  # on the lane
            time.sleep(3)  # the disk stalls past the deadline, then writes
            stalled.set()
        return insert(conn, jobs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_enqueue_on", stalling)
    jobs = [NewJob(queue="default", task="t", args=f"[{n}]") for n in range(200)]
    try:
        with pytest.raises(OutcomeUnknownError) as raised:
            await store.jobs_enqueue(jobs=jobs)  # too many rows for the loop's own thread
        assert "did not answer within 2s" in str(raised.value)
        assert "the 200 jobs may have been enqueued all the same" in str(raised.value)
        await asyncio.to_thread(stalled.wait, 30)
        monkeypatch.undo()
        depth = await store.jobs_depth()
        assert sum(d.count for d in depth) == 200  # made after its caller gave up
    finally:
        await store.close()


@pytest.mark.parametrize("call", ["sync", "async"])
def test_an_enqueue_the_server_cancelled_says_nothing_was_enqueued(
    postgres_server: str, absent_schema: str, call: str
) -> None:
    """The server answered, with its statement timeout (the jobs table locked by an
    operator): the statement rolled back, and the error is the plain one, not "may have
    been enqueued", which would leave a caller trusting it with no job at all."""
    import psycopg

    app = _app(f"{postgres_server}?schema={absent_schema}")
    try:
        app.enqueue("demo.t", 0)  # the schema made
        with psycopg.connect(postgres_server) as locker:
            locker.execute(f"LOCK TABLE {absent_schema}.jobs IN ACCESS EXCLUSIVE MODE")

            def enqueue() -> int:
                if call == "sync":
                    return app.enqueue("demo.t", 1)
                return app.run(lambda s: app.enqueue_async("demo.t", 1, store=s))

            with pytest.raises(StoreUnavailableError) as raised:
                enqueue()
            locker.rollback()
        assert "statement_timeout" in str(raised.value), raised.value
        assert not isinstance(raised.value, OutcomeUnknownError), raised.value
        assert len(app.run(lambda s: s.jobs_list(limit=10))) == 1  # nothing was made
    finally:
        app.close()
