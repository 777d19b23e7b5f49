"""What a migrated schema holds, and what a damaged one lacks.

The schema's version says which migrations ran, not that what they made is still
there: a table, column, index, trigger or constraint dropped by hand (a clean-up script run
against the wrong schema, a restore that left one out) went unnoticed while its
absence failed every job that needed it, each failure spending an attempt, or, for a
trigger or constraint, silently removed a safety check. Opening the store, and
``tokenline migrate``, compare the schema with :data:`OBJECTS`, what the migrations
make, and refuse a schema that lacks any of it.

Objects a user added to the schema (an index of their own) are not a fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import tuple_row

from ..._errors import StoreCorruptError
from .._columns import RESOURCE_LEASES, SHARED, WORKERS, column_names, lacking
from .._sql import load_queries
from ._target import Target

__all__ = ["OBJECTS", "check_objects", "damage_error", "missing_objects"]

#: The tables with a primary key (open_blocks has none: see its migration).
_KEYED_TABLES = frozenset(
    {
        "attempts",
        "duplicates",
        "effects",
        "fences",
        "jobs",
        "leases",
        "paused_queues",
        "schedules",
        "schema_version",
        "stale_commits",
        "unique_keys",
        "workers",
    }
)
#: Their primary keys: each is a constraint and the index it made.
_PRIMARY_KEYS = frozenset(f"{table}_pkey" for table in _KEYED_TABLES)

#: What the migrations up to this code's version make, by kind. A test compares it with
#: a freshly migrated schema: a migration that adds or drops an object updates it.
OBJECTS: Mapping[str, frozenset[str]] = {
    "table": _KEYED_TABLES | {"open_blocks"},
    "sequence": frozenset({"duplicates_id_seq", "job_ids", "stale_commits_id_seq"}),
    "index": _PRIMARY_KEYS
    | {
        "duplicates_at",
        "effects_job",
        "jobs_expiry",
        "jobs_finished",
        "jobs_queue_state",
        "jobs_ready",
        "jobs_ready_age",
        "open_blocks_xact",
    },
    "function": frozenset(
        {
            "block_closed",
            "jobs_monotonic",
            "now_epoch",
            "runnable_jobs",
            "top_runnable_priority",
            "unique_key_released",
        }
    ),
    "trigger": frozenset({"jobs_monotonic", "open_blocks_closed"}),
    "column": column_names(
        [
            *SHARED.items(),
            ("leases", RESOURCE_LEASES),
            ("workers", WORKERS),
            ("open_blocks", ("xact",)),
            ("schema_version", ("version", "name", "applied_at")),
        ]
    ),
    "constraint": _PRIMARY_KEYS
    | {
        "attempts_job_id_fkey",
        "duplicates_kind_check",
        "effects_status_check",
        "jobs_state_check",
        "open_blocks_closed",
    },
}

_Q = load_queries(__name__.rpartition(".")[0])


async def schema_objects(conn: AsyncConnection[Any], schema: str) -> dict[str, set[str]]:
    """The objects ``schema`` holds, by kind (as :data:`OBJECTS` names the kinds)."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(_Q["schema_objects"], {"schema": schema})
    found: dict[str, set[str]] = {}
    for kind, name in await cur.fetchall():
        found.setdefault(kind, set()).add(name)
    return found


async def missing_objects(conn: AsyncConnection[Any], schema: str) -> list[str]:
    """What of :data:`OBJECTS` ``schema`` lacks, as "kind name", sorted by kind."""
    return lacking(OBJECTS, await schema_objects(conn, schema))


def damage_error(missing: list[str], version: int, target: Target) -> StoreCorruptError:
    """The error for a schema at this code's version that lacks ``missing``."""
    return StoreCorruptError(
        f"the tokenline schema {target.schema!r} of {target.where} is at version {version} "
        f"but damaged: it lacks {', '.join(missing)}. Nothing was run against it. "
        "Migrating cannot rebuild part of a schema: restore it from a backup, or recreate "
        "what is missing as the store's migrations.sql defines it"
    )


async def check_objects(conn: AsyncConnection[Any], version: int, target: Target) -> None:
    """Raise :func:`damage_error` when the schema lacks any of :data:`OBJECTS`."""
    missing = await missing_objects(conn, target.schema)
    if missing:
        raise damage_error(missing, version, target)
