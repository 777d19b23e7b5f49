"""Versioned schema migrations, applied atomically under an advisory lock.

The schema's version is the highest row of ``<schema>.schema_version``; the code's
is :data:`SCHEMA_VERSION`, the last block of ``migrations.sql``. Applying runs every
pending block, the version rows and, on a new database, ``CREATE SCHEMA`` in *one*
transaction holding ``pg_advisory_xact_lock``: many workers starting at once migrate
once, and a failure (or a kill) leaves the schema exactly as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection, errors, sql
from psycopg.rows import tuple_row

from ..._errors import SchemaVersionError, StoreCorruptError, StoreError
from .._sql import load_queries
from ._target import Target

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Migration",
    "apply_migrations",
    "compose",
    "schema_version",
    "too_new",
    "too_old",
]

_NAME = re.compile(r"migration_(\d{4})_([a-z0-9_]+)")


def compose(text: str, schema: str) -> str:
    """``text`` with its ``{schema}`` and ``{job_ids}`` placeholders filled, quoted.

    Identifiers go through :class:`psycopg.sql.Identifier` and the sequence name through
    :class:`psycopg.sql.Literal`: the schema name never reaches SQL as pasted text.
    """
    return (
        sql.SQL(text)
        .format(
            schema=sql.Identifier(schema),
            job_ids=sql.Literal(sql.Identifier(schema, "job_ids").as_string()),
        )
        .as_string()
    )


@dataclass(frozen=True, slots=True)
class Migration:
    """One block of ``migrations.sql``: the version it produces and its SQL."""

    version: int
    name: str
    sql: str


def _load() -> tuple[Migration, ...]:
    found = []
    for name, text in load_queries(__name__.rpartition(".")[0], "migrations.sql").items():
        match = _NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"migration {name!r} is not named migration_NNNN_description")
        found.append(Migration(int(match[1]), name, text))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise ValueError("migrations must be numbered 1, 2, 3… without gaps")
    return tuple(found)


MIGRATIONS: tuple[Migration, ...] = _load()
#: The schema version this code reads and writes.
SCHEMA_VERSION: int = MIGRATIONS[-1].version
_Q = load_queries(__name__.rpartition(".")[0])


async def _scalar(conn: AsyncConnection[Any], query: str, params: dict[str, Any]) -> Any:
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(query, params)
    row = await cur.fetchone()
    if row is None:  # every query used here returns one row
        raise StoreError(f"PostgreSQL returned no row for {query!r}")
    return row[0]


async def schema_version(conn: AsyncConnection[Any], schema: str) -> int:
    """The schema's current version; 0 when tokenline was never installed in it."""
    if not await _scalar(conn, _Q["version_table_exists"], {"schema": schema}):
        return 0
    return int(await _scalar(conn, compose(_Q["version_current"], schema), {}))


def too_new(version: int, target: Target) -> SchemaVersionError:
    """The error for a schema written by a newer tokenline."""
    return SchemaVersionError(
        f"the tokenline schema {target.schema!r} of {target.where} is at version {version}, "
        f"newer than this tokenline's {SCHEMA_VERSION}: upgrade tokenline "
        "(pip install -U 'tokenline[postgres]')"
    )


def too_old(version: int, target: Target) -> SchemaVersionError:
    """The error for a schema that needs migrating while migrating is disabled."""
    state = "not installed" if version == 0 else f"at version {version}"
    return SchemaVersionError(
        f"the tokenline schema {target.schema!r} of {target.where} is {state}; this "
        f"tokenline needs version {SCHEMA_VERSION}: run `tokenline migrate` "
        "(or, from code, open the store with migrate=True)"
    )


async def apply_migrations(conn: AsyncConnection[Any], target: Target) -> tuple[int, int]:
    """Bring the schema to :data:`SCHEMA_VERSION` in one transaction; return its
    version before, as read under the lock, and after. Equal: another process
    migrated it while this one waited for the lock, and nothing was done here.

    ``conn`` must be in autocommit mode (no transaction open): this opens its own.
    """
    schema = target.schema
    async with conn.transaction():
        await conn.execute(_Q["migrate_lock"], {"schema": schema})
        # Read under the lock: whoever held it before us may have just migrated.
        version = await schema_version(conn, schema)
        if version > SCHEMA_VERSION:
            raise too_new(version, target)
        if version == SCHEMA_VERSION:
            return version, version
        # Only when missing: CREATE SCHEMA needs CREATE on the database even with
        # IF NOT EXISTS, and later migrations should not need that privilege.
        if not await _scalar(conn, _Q["schema_exists"], {"schema": schema}):
            await conn.execute(compose(_Q["schema_create"], schema))
        await conn.execute(compose(_Q["version_table_create"], schema))
        for migration in MIGRATIONS[version:]:
            try:
                # No parameters: psycopg sends the block as one multi-statement query.
                await conn.execute(compose(migration.sql, schema))
            except (errors.DuplicateTable, errors.DuplicateObject, errors.DuplicateFunction) as exc:
                # What a migration the schema has not recorded would make is there
                # already: its version rows were removed by hand, or another tool made
                # the objects. Rolled back whole; said so, not as the server's words.
                raise StoreCorruptError(
                    f"the tokenline schema {schema!r} of {target.where} records version "
                    f"{version}, yet holds what migration {migration.version} "
                    f"({migration.name}) makes ({str(exc).strip()}): its schema_version "
                    "table was changed by hand? Nothing was migrated; restore the schema "
                    "from a backup, or put back the rows that were removed"
                ) from exc
            await conn.execute(
                compose(_Q["version_record"], schema),
                {"version": migration.version, "name": migration.name},
            )
    return version, SCHEMA_VERSION
