"""The columns of the tables that the PostgreSQL and SQLite stores share.

A column dropped by hand (``ALTER TABLE … DROP COLUMN``) passed every check of the
tables' presence and failed only the first statement that named it, each failure
spending a job's attempt. Each store's catalog checks these columns at open, named
``table.column``; tests keep them equal to what a fresh migration makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["RESOURCE_LEASES", "SHARED", "WORKERS", "column_names", "lacking"]

#: Tables by their name on PostgreSQL (SQLite's main file prefixes ``tokenline_``).
SHARED: Mapping[str, tuple[str, ...]] = {
    "attempts": (
        "job_id",
        "token",
        "attempt",
        "owner",
        "started_at",
        "finished_at",
        "outcome",
        "error",
        "error_class",
    ),
    "duplicates": ("id", "key", "kind", "operation", "job_id", "token", "owner", "at"),
    "effects": (
        "key",
        "status",
        "result",
        "error",
        "job_id",
        "token",
        "owner",
        "runs",
        "created_at",
        "updated_at",
        "completed_at",
    ),
    "fences": ("key", "issuer", "token", "job_id", "owner", "updated_at"),
    "jobs": (
        "id",
        "queue",
        "task",
        "args",
        "idempotency_key",
        "priority",
        "run_at",
        "attempt",
        "max_attempts",
        "state",
        "lease_owner",
        "lease_token",
        "lease_expires_at",
        "last_error",
        "error_class",
        "created_at",
        "updated_at",
        "finished_at",
        "timeout",
        "lease_expiries",
        "max_lease_expiries",
    ),
    "paused_queues": ("queue", "paused_at"),
    "schedules": ("name", "mark", "updated_at"),
    "stale_commits": ("id", "job_id", "token", "owner", "operation", "at"),
    "unique_keys": ("key", "job_id", "held_until", "while_active", "created_at"),
}

#: The workers' membership table (PostgreSQL's schema, SQLite's coordination file).
WORKERS: tuple[str, ...] = (
    "id",
    "host",
    "pid",
    "queues",
    "concurrency",
    "state",
    "token",
    "started_at",
    "heartbeat_at",
    "expires_at",
    "in_flight",
    "clock_skew",
    "drain_requested",
    "concurrency_limit",
)

#: Resource leases (``leases`` on PostgreSQL, ``resource_leases`` on SQLite).
RESOURCE_LEASES: tuple[str, ...] = ("resource", "owner", "token", "expires_at", "acquired_at")


def column_names(tables: Iterable[tuple[str, Iterable[str]]]) -> frozenset[str]:
    """Every ``table.column`` of ``tables`` (pairs of a table and its columns)."""
    return frozenset(f"{table}.{column}" for table, columns in tables for column in columns)


def lacking(expected: Mapping[str, frozenset[str]], found: Mapping[str, set[str]]) -> list[str]:
    """What of ``expected`` (names by kind) ``found`` lacks, as "kind name", in the
    order of ``expected``'s kinds. The columns of a missing table are left out: the
    table is what to name."""
    gone = expected.get("table", frozenset()) - found.get("table", set())
    return [
        f"{kind} {name}"
        for kind, names in expected.items()
        for name in sorted(names - found.get(kind, set()))
        if kind != "column" or name.partition(".")[0] not in gone
    ]
