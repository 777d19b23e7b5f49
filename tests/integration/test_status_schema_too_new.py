"""``tokenline status`` on a store whose schema a newer tokenline wrote: every channel
fails as "schema too new", not "not migrated" (whose remedy, a migration, cannot help)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tokenline._errors import SchemaVersionError, StoreUnavailableError
from tokenline.cli import main
from tokenline.health import CHANNELS, FAILURES, failure_kind
from tokenline.stores.postgres._migrations import SCHEMA_VERSION as PG_VERSION

PIPED = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=PIPED, catch_exceptions=False)
    return result.exit_code, result.output


def failures(report: dict[str, Any]) -> dict[str, str | None]:
    return {name: c["failure"] for name, c in report["channels"].items()}


def assert_too_new(url: str) -> None:
    code, out = cli("status", "--url", url, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "schema not ready"
    assert "newer than this tokenline" in report["error"]
    assert failures(report) == dict.fromkeys(CHANNELS, "schema too new")
    code, out = cli("status", "--url", url)
    assert code == 1
    for name in CHANNELS:
        assert f"{name:<7} FAILING  schema too new" in out
    assert "not migrated" not in out


def test_the_failure_kinds_tell_a_newer_schema_from_an_older_one() -> None:
    assert "schema too new" in FAILURES
    newer = SchemaVersionError("'x.db' has schema version 99, newer than this tokenline's 7")
    older = SchemaVersionError("'x.db' has schema version 3; this tokenline needs 7")
    assert failure_kind(newer) == "schema too new"
    assert failure_kind(older) == "not migrated"
    wrapped = StoreUnavailableError("opening failed")
    wrapped.__cause__ = newer
    assert failure_kind(wrapped) == "schema too new"


@pytest.mark.postgres
def test_status_of_a_postgres_schema_newer_than_this_tokenline(
    postgres_server: str, absent_schema: str
) -> None:
    import psycopg

    url = f"{postgres_server}?schema={absent_schema}"
    code, _ = cli("migrate", "--url", url)
    assert code == 0
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {absent_schema}.schema_version (version, name) VALUES (%s, 'future')",
            (PG_VERSION + 1,),
        )
    assert_too_new(url)


@pytest.mark.parametrize("which", ["store", "coordination"])
def test_status_of_a_sqlite_store_newer_than_this_tokenline(tmp_path: Path, which: str) -> None:
    path = tmp_path / "newer.db"
    url = f"sqlite:///{path}"
    code, _ = cli("migrate", "--url", url)
    assert code == 0
    target = path if which == "store" else path.with_name(path.name + "-coord")
    conn = sqlite3.connect(target)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute(f"PRAGMA user_version = {version + 1:d}")
        conn.commit()
    finally:
        conn.close()
    assert_too_new(url)
