"""With migrations off (TOKENLINE_MIGRATE=0, migrate=False), a SQLite store that cannot
be used says the one case that applies: the file does not exist (and nothing was
created), or its schema is version N where this tokenline needs M."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline import SchemaVersionError
from tokenline.cli import main
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite.store import COORD_VERSION, SCHEMA_VERSION

OFF = (
    "migrations are off (TOKENLINE_MIGRATE=0, migrate=False, or a command that reads or "
    "acts on a store and never upgrades it)"
)


def _refusal(db: Path) -> str:
    store = SQLiteStore(f"sqlite:///{db}", migrate=False)
    with pytest.raises(SchemaVersionError) as caught:
        asyncio.run(store.open())
    asyncio.run(store.close())
    text = str(caught.value)
    assert "older than" not in text
    return text


def test_a_missing_file_is_said_to_be_missing(tmp_path: Path) -> None:
    """It read "'x.db' does not exist, older than this tokenline's and migrations are
    off": a missing file has no age."""
    db = tmp_path / "nm.db"
    assert _refusal(db) == (
        f"{str(db)!r} does not exist and {OFF}, so nothing was created: run `tokenline "
        "migrate` to create it, or allow migrations"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_missing_coordination_file_is_named_as_such(tmp_path: Path) -> None:
    db = tmp_path / "half.db"
    asyncio.run(SQLiteStore(f"sqlite:///{db}").migrate())
    for side in ("-coord", "-coord-wal", "-coord-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    text = _refusal(db)
    assert text.startswith(f"the store's coordination file {str(db) + '-coord'!r} does not exist")


def test_an_empty_file_holds_no_schema_and_says_which_is_needed(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    db.touch()
    assert _refusal(db) == (
        f"{str(db)!r} holds no tokenline schema; this tokenline needs schema version "
        f"{SCHEMA_VERSION} and {OFF}: run `tokenline migrate`, or allow migrations"
    )


def test_an_old_schema_says_its_version_and_the_one_needed(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    asyncio.run(SQLiteStore(f"sqlite:///{db}").migrate())
    with sqlite3.connect(db) as conn:
        # The last migration added these triggers alone: without them the file is as the
        # one before left it (a user_version set lower alone is refused as set by hand).
        conn.execute("DROP TRIGGER tokenline_jobs_types_insert")
        conn.execute("DROP TRIGGER tokenline_jobs_types_update")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    conn.close()
    assert _refusal(db).startswith(
        f"{str(db)!r} has schema version {SCHEMA_VERSION - 1}; this tokenline needs "
        f"schema version {SCHEMA_VERSION} and {OFF}"
    )


def test_an_old_coordination_schema_says_the_version_it_needs(tmp_path: Path) -> None:
    db = tmp_path / "oldcoord.db"
    asyncio.run(SQLiteStore(f"sqlite:///{db}").migrate())
    with sqlite3.connect(f"{db}-coord") as conn:
        conn.execute(f"PRAGMA user_version = {COORD_VERSION - 1}")
    conn.close()
    assert _refusal(db).startswith(
        f"the store's coordination file {str(db) + '-coord'!r} has schema version "
        f"{COORD_VERSION - 1}; this tokenline needs schema version {COORD_VERSION}"
    )


def test_enqueue_with_migrations_off_on_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"migrate_off_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from tokenline import App\n\napp = App()\napp.task(name='t')(lambda ctx, *a: None)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENLINE_MIGRATE", "0")
    db = tmp_path / "nm.db"
    result = CliRunner().invoke(
        main,
        ["enqueue", "--app", f"{name}:app", "--url", f"sqlite:///{db}", "t", "[1]"],
        terminal_width=400,
        catch_exceptions=False,
    )
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"error: {str(db)!r} does not exist and {OFF}, so nothing was created" in text
    assert not db.exists()
