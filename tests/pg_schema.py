"""PostgreSQL schemas in tests: one as an older tokenline left it (for the upgrade
tests), and whether one exists at all."""

from __future__ import annotations

from typing import Any


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
