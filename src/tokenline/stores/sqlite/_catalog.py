"""What a migrated SQLite store holds, and what a damaged one lacks.

The files' ``user_version`` says which migrations ran, not that what they made is
still there: a table, column, index or trigger dropped by hand went unnoticed while every job
that needed it failed, each failure spending an attempt (a dropped trigger silently
removed a safety check). Opening the store, and ``tokenline migrate``, compare both
files with :data:`MAIN` and :data:`COORD` and refuse a store that lacks any of them.

A file whose ``user_version`` is set but that holds none of tokenline's tables is
another application's database (SQLite has one ``user_version`` per file, which
tokenline uses for its schema version): said as such, not as a damaged store or one to
upgrade. A store that holds what a migration after its ``user_version`` makes had that
version set lower by hand (or by another application): said as such too, not as a
store to migrate (migrating it again failed on what the later steps had changed).
:func:`check_version` says both, for opening, migrating and the commands that only ask
whether a store is there alike: each gives the same diagnosis.

Objects a user added (tables of their own in the main file) are not a fault.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path

from ..._errors import StoreCorruptError
from .._columns import RESOURCE_LEASES, SHARED, WORKERS, column_names, lacking

__all__ = [
    "COORD",
    "MADE_AT",
    "MAIN",
    "check_objects",
    "check_version",
    "foreign_file",
    "holds_tokenline_tables",
    "version_and_tables",
    "version_lost",
]

#: What the main file's migrations make, by kind. A test compares it with a freshly
#: migrated file: a migration that adds or drops an object updates it.
MAIN: Mapping[str, frozenset[str]] = {
    "table": frozenset(
        {
            "tokenline_attempts",
            "tokenline_duplicates",
            "tokenline_effects",
            "tokenline_fences",
            "tokenline_jobs",
            "tokenline_lease_tokens",
            "tokenline_paused_queues",
            "tokenline_schedules",
            "tokenline_stale_commits",
            "tokenline_unique_keys",
        }
    ),
    "index": frozenset(
        {
            "tokenline_duplicates_at",
            "tokenline_effects_job",
            "tokenline_jobs_expiry",
            "tokenline_jobs_finished",
            "tokenline_jobs_queue_state",
            "tokenline_jobs_ready",
            "tokenline_jobs_ready_age",
        }
    ),
    "trigger": frozenset(
        {
            "tokenline_jobs_monotonic",
            "tokenline_jobs_types_insert",
            "tokenline_jobs_types_update",
        }
    ),
    "column": column_names(
        [
            *((f"tokenline_{table}", columns) for table, columns in SHARED.items()),
            ("tokenline_lease_tokens", ("resource", "token")),
        ]
    ),
}
#: An object of :data:`MAIN` that each migration makes, by the version it brings the
#: main file to. A migration that adds a version names one here (a test checks it).
MADE_AT: Mapping[int, tuple[str, str]] = {
    2: ("table", "tokenline_effects"),
    3: ("table", "tokenline_lease_tokens"),
    4: ("column", "tokenline_jobs.lease_expiries"),
    5: ("index", "tokenline_jobs_ready_age"),
    6: ("table", "tokenline_schedules"),
    7: ("trigger", "tokenline_jobs_types_insert"),
}
#: What the coordination file's migrations make.
COORD: Mapping[str, frozenset[str]] = {
    "table": frozenset({"clock", "job_leases", "resource_leases", "workers"}),
    "index": frozenset({"job_leases_expiry"}),
    "column": column_names(
        [
            ("clock", ("id", "boot_id", "wall", "uptime")),
            ("job_leases", ("job_id", "token", "owner", "expires_at")),
            ("resource_leases", RESOURCE_LEASES),
            ("workers", WORKERS),
        ]
    ),
}


def _objects(conn: sqlite3.Connection, schema: str) -> dict[str, set[str]]:
    # The schema name is "main" or "coord", never the caller's text.
    query = f"SELECT type, name FROM {schema}.sqlite_master WHERE name NOT LIKE 'sqlite_%'"
    rows = conn.execute(query).fetchall()
    found: dict[str, set[str]] = {}
    for kind, name in rows:
        found.setdefault(str(kind), set()).add(str(name))
    columns = conn.execute(
        f"SELECT m.name || '.' || c.name FROM {schema}.sqlite_master AS m, "
        f"pragma_table_info(m.name, '{schema}') AS c "
        "WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'"
    ).fetchall()
    found["column"] = {str(name) for (name,) in columns}
    return found


def holds_tokenline_tables(conn: sqlite3.Connection) -> bool:
    """Whether the main file of ``conn`` holds any of tokenline's tables."""
    rows = conn.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'").fetchall()
    return bool(MAIN["table"] & {str(name) for (name,) in rows})


def version_and_tables(conn: sqlite3.Connection) -> tuple[int, bool]:
    """The main file's ``user_version`` and whether it holds any of tokenline's
    tables, read in one transaction: read apart, another process's migration could
    commit between the two reads, and a new file would look like one whose version was
    lost (tables there, version 0)."""
    conn.execute("BEGIN")
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        return version, holds_tokenline_tables(conn)
    finally:
        conn.execute("ROLLBACK")


def check_version(conn: sqlite3.Connection, path: Path) -> tuple[int, bool]:
    """The main file's ``user_version`` and whether it holds any of tokenline's tables,
    read in one transaction (see :func:`version_and_tables`), once the version is known
    to be the file's own: another application's database (:func:`foreign_file`) and a
    store whose version was set lower than its tables say (:func:`version_lost`) are
    refused. Nothing is changed."""
    conn.execute("BEGIN")
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        ours = holds_tokenline_tables(conn)
        found = _objects(conn, "main") if ours else {}
    finally:
        conn.execute("ROLLBACK")
    if version and not ours:
        raise foreign_file(path, version)
    made = [v for v, (kind, name) in MADE_AT.items() if name in found.get(kind, ())]
    if ours and (version == 0 or max(made, default=0) > version):
        raise version_lost(path, version, max(made, default=None))
    return version, ours


def foreign_file(path: Path, version: int) -> StoreCorruptError:
    """The error for a file whose ``user_version`` is set but that holds no tokenline
    table: another application's database, left as it is."""
    return StoreCorruptError(
        f"{str(path)!r} holds no tokenline tables, yet its user_version is {version}: it "
        "looks like another application's database, which nothing here changed. "
        "tokenline keeps its schema version in the file's user_version, so an "
        "application that sets user_version for its own tables cannot share the file: "
        "give tokenline a file of its own"
    )


def version_lost(path: Path, version: int, made: int | None = None) -> StoreCorruptError:
    """The error for a tokenline store whose ``user_version`` (``version``) is lower
    than its tables say: set by hand or by another application sharing the file.
    ``made``: the latest version whose migration's objects (:data:`MADE_AT`) it holds,
    when known."""
    tables = f" (its tables are those of version {made} at least)" if made else ""
    return StoreCorruptError(
        f"{str(path)!r} holds tokenline's tables, but its user_version, where tokenline "
        f"keeps its schema version, says {version}{tables}: set by hand or by another "
        "application? Nothing was changed. Restore the file from a backup, or set "
        "PRAGMA user_version back to the version this store had; an application that "
        "sets user_version cannot share tokenline's file"
    )


def check_objects(
    conn: sqlite3.Connection,
    schema: str,
    path: Path,
    expected: Mapping[str, frozenset[str]],
    version: int,
) -> None:
    """Refuse ``schema`` ("main" or "coord", on ``conn``) when it lacks any of
    ``expected``, naming what it lacks."""
    missing = lacking(expected, _objects(conn, schema))
    if missing:
        raise StoreCorruptError(
            f"{str(path)!r} is at schema version {version} but damaged: it lacks "
            f"{', '.join(missing)}. Nothing was run against it. Migrating cannot rebuild "
            "part of a schema: restore the store's files from a backup"
        )
