"""PostgreSQL schemas in tests: one as an older tokenline left it (for the upgrade
tests), whether one exists at all, and a store on a fresh one."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenline.stores.postgres import PostgresStore


def schema_at_version(conn: Any, schema: str, version: int) -> None:
    """Create ``schema`` on ``conn`` (a psycopg connection in a transaction) with the
    first ``version`` migrations applied and recorded, as that release would have."""
    from psycopg import sql

    from tokenline.stores.postgres._migrations import MIGRATIONS, compose

    ident = sql.Identifier(schema)
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {}.schema_version (version integer PRIMARY KEY, name text "
            "NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(ident)
    )
    for m in MIGRATIONS[:version]:
        conn.execute(compose(m.sql, schema).encode())
        conn.execute(
            sql.SQL("INSERT INTO {}.schema_version (version, name) VALUES (%s, %s)").format(ident),
            (m.version, m.name),
        )


def schema_exists(server: str, schema: str) -> bool:
    """Whether ``schema`` exists on the PostgreSQL ``server``."""
    import psycopg

    with psycopg.connect(server, autocommit=True) as conn:
        cur = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,))
        return cur.fetchone() == (1,)


@contextlib.asynccontextmanager
async def fresh_store(
    server: str, prefix: str, query: str = "", **options: Any
) -> AsyncIterator[PostgresStore]:
    """An open PostgreSQL store on a fresh schema named ``prefix`` and a random suffix
    (``query``: more of the URL's parameters, each after ``&``; ``{schema}`` in it is
    the schema's name), closed and its schema dropped afterwards."""
    import psycopg

    from tokenline.stores.postgres import PostgresStore

    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(f"{server}?schema={schema}{query.format(schema=schema)}", **options)
    await store.open()
    try:
        yield store
    finally:
        await store.close()
        async with await psycopg.AsyncConnection.connect(server, autocommit=True) as c:
            await c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
