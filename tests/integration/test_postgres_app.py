"""The App on PostgreSQL: the outbox enqueue from sync and async code."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tokenline import App


@pytest.fixture
def pg_app(postgres_server: str) -> Iterator[App]:
    """An app on a fresh schema, dropped afterwards."""
    import psycopg

    schema = f"tl_app_{uuid.uuid4().hex[:8]}"
    app = App(f"{postgres_server}?schema={schema}")

    @app.task(name="ship")
    def ship(ctx: object, order: int) -> None:
        """A task to enqueue."""

    app.run(lambda s: s.queues_stats())  # creates the schema
    try:
        yield app
    finally:
        app.close()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _args(app: App) -> list[str]:
    return sorted(j.args for j in app.run(lambda s: s.jobs_list()))


def test_sync_outbox_job_exists_iff_the_transaction_commits(
    pg_app: App, postgres_server: str
) -> None:
    """app.enqueue(connection=conn) with a sync psycopg connection joins its transaction."""
    import psycopg

    with psycopg.connect(postgres_server) as conn:
        with conn.transaction():
            pg_app.enqueue("ship", 1, connection=conn)
            raise psycopg.Rollback  # the business transaction rolls back: no job
        with conn.transaction():
            pg_app.enqueue("ship", 2, connection=conn)
    assert _args(pg_app) == ['{"args":[2],"kwargs":{}}']


async def test_async_outbox_job_exists_iff_the_transaction_commits(
    pg_app: App, postgres_server: str
) -> None:
    """enqueue_async(connection=conn) with an AsyncConnection joins its transaction."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(postgres_server) as conn:
        async with conn.transaction():
            await pg_app.enqueue_async("ship", 3, connection=conn)
            raise psycopg.Rollback
        async with conn.transaction():
            await pg_app.enqueue_async("ship", 4, connection=conn)
    assert _args(pg_app) == ['{"args":[4],"kwargs":{}}']


def test_outbox_connection_from_the_store_url_with_its_schema(pg_app: App) -> None:
    """libpq refuses tokenline's ``?schema=``; ``libpq_url`` gives the URL it takes, and
    an outbox enqueue through that connection lands in the app's schema."""
    import psycopg

    from tokenline.stores.postgres import libpq_url

    assert "?schema=" in pg_app.url
    with pytest.raises(psycopg.ProgrammingError, match="schema"):
        psycopg.connect(pg_app.url).close()
    assert "schema" not in libpq_url(pg_app.url)
    with psycopg.connect(libpq_url(pg_app.url)) as conn, conn.transaction():
        pg_app.enqueue("ship", 5, connection=conn)
    assert _args(pg_app) == ['{"args":[5],"kwargs":{}}']


def test_outbox_refuses_an_autocommit_connection(pg_app: App, postgres_server: str) -> None:
    """A connection that would commit the job on its own is refused; nothing stored."""
    import psycopg

    from tokenline import StoreError

    with (
        psycopg.connect(postgres_server, autocommit=True) as conn,
        pytest.raises(StoreError, match="open transaction"),
    ):
        pg_app.enqueue("ship", 5, connection=conn)
    assert _args(pg_app) == []


def test_outbox_on_a_schema_not_yet_created_says_to_migrate(postgres_server: str) -> None:
    """The outbox enqueue runs in the caller's transaction, so it never creates the
    schema: on a new one the error says so, how to migrate and that the caller's
    transaction must be rolled back; after a migration the same call works."""
    import psycopg

    from tokenline import StoreCorruptError

    schema = f"tl_new_{uuid.uuid4().hex[:8]}"
    app = App(f"{postgres_server}?schema={schema}")
    app.task(name="ship")(lambda ctx, order: None)
    try:
        with psycopg.connect(postgres_server) as conn:
            with pytest.raises(StoreCorruptError) as info, conn.transaction():
                app.enqueue("ship", 1, connection=conn)
            text = str(info.value)
            for part in (schema, "tokenline migrate", "never creates the schema", "roll it"):
                assert part in text, text
            app.run(lambda s: s.queues_stats())  # the app's own store migrates
            with conn.transaction():
                app.enqueue("ship", 2, connection=conn)
        assert _args(app) == ['{"args":[2],"kwargs":{}}']
    finally:
        app.close()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
