"""A store whose schema was damaged by hand (a table, index or trigger dropped) is
refused by name, and a job that meets the damage keeps its attempts."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenline import App, RetryPolicy, Worker, WorkerSettings
from tokenline._errors import StoreCorruptError
from tokenline._jobs import NewJob
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._catalog import COORD, MADE_AT, MAIN
from tokenline.stores.sqlite.store import SCHEMA_VERSION

DEADLINE = 60.0


def _objects(path: Path, schema: str = "main") -> dict[str, set[str]]:
    with sqlite3.connect(path) as conn:
        if schema == "coord":
            conn.execute("ATTACH DATABASE ? AS coord", (f"{path}-coord",))
        rows = conn.execute(
            f"SELECT type, name FROM {schema}.sqlite_master WHERE name NOT LIKE 'sqlite_%'"
        ).fetchall()
        columns = conn.execute(
            f"SELECT m.name, c.name FROM {schema}.sqlite_master AS m, "
            f"pragma_table_info(m.name, '{schema}') AS c "
            "WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%'"
        ).fetchall()
    found: dict[str, set[str]] = {}
    for kind, name in rows:
        found.setdefault(kind, set()).add(name)
    found["column"] = {f"{table}.{column}" for table, column in columns}
    return found


async def test_the_object_lists_are_what_the_migrations_make(tmp_path: Path) -> None:
    """What a damaged store is checked for is exactly what a new store holds: a
    migration that adds an object must name it in _catalog.py."""
    path = tmp_path / "fresh.db"
    await SQLiteStore(f"sqlite:///{path}").migrate()
    assert _objects(path) == {kind: set(names) for kind, names in MAIN.items()}
    assert _objects(path, "coord") == {kind: set(names) for kind, names in COORD.items()}


@pytest.mark.parametrize(
    ("damage", "lacks"),
    [
        ("DROP TABLE tokenline_effects", "table tokenline_effects"),
        ("DROP INDEX tokenline_jobs_ready", "index tokenline_jobs_ready"),
        ("DROP TRIGGER tokenline_jobs_monotonic", "trigger tokenline_jobs_monotonic"),
        ("DROP INDEX coord.job_leases_expiry", "index job_leases_expiry"),
        ("DROP TABLE coord.resource_leases", "table resource_leases"),
        ("ALTER TABLE tokenline_effects DROP COLUMN runs", "column tokenline_effects.runs"),
        ("ALTER TABLE coord.workers DROP COLUMN clock_skew", "column workers.clock_skew"),
    ],
)
async def test_a_damaged_store_is_refused_naming_what_it_lacks(
    tmp_path: Path, damage: str, lacks: str
) -> None:
    """A dropped table, column, index or trigger went unnoticed: `tokenline migrate` said the
    store was up to date while every job that needed the table failed until dead (and
    a dropped trigger silently removed a check). Opening and migrating now refuse it,
    and the jobs stay as they were."""
    path = tmp_path / "damaged.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")])
    await store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("ATTACH DATABASE ? AS coord", (f"{path}-coord",))
        conn.execute(damage)
    for attempt in (
        SQLiteStore(f"sqlite:///{path}").open,
        SQLiteStore(f"sqlite:///{path}").migrate,
    ):
        with pytest.raises(StoreCorruptError, match=f"damaged: it lacks .*{lacks}"):
            await attempt()
    with sqlite3.connect(path) as conn:
        row = conn.execute("SELECT state FROM tokenline_jobs WHERE id = ?", (jid,)).fetchone()
    assert row == ("queued",)


@pytest.mark.parametrize("version", [3, 12])
async def test_another_applications_file_is_refused_and_left_as_it_was(
    tmp_path: Path, version: int
) -> None:
    """A file with its user_version set by another application was taken for an older
    tokenline store (migrating failed on a missing table) or a newer one ("upgrade
    tokenline"), and was switched to WAL on the way. It is now said to be another
    application's, and nothing in it changes."""
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.execute(f"PRAGMA user_version = {version}")
    before = path.read_bytes()
    for attempt in (
        SQLiteStore(f"sqlite:///{path}").open,
        SQLiteStore(f"sqlite:///{path}").migrate,
    ):
        with pytest.raises(StoreCorruptError, match="another application's database"):
            await attempt()
    assert path.read_bytes() == before
    assert not path.with_name(f"{path.name}-coord").exists()


@pytest.mark.parametrize("version", [0, 2, 3, 6])
async def test_a_store_whose_user_version_was_changed_is_refused_and_left_as_it_was(
    tmp_path: Path, version: int
) -> None:
    """A real store whose user_version was set lower (by hand, by another application
    sharing the file) was said to hold no tokenline schema (0), and migrating it failed
    with "duplicate column name" (3) or "damaged: no such table" (2): each now says what
    happened, and nothing changes."""
    path = tmp_path / "store.db"
    await SQLiteStore(f"sqlite:///{path}").migrate()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    before = path.read_bytes()
    for attempt in (
        SQLiteStore(f"sqlite:///{path}").open,
        SQLiteStore(f"sqlite:///{path}").migrate,
    ):
        with pytest.raises(StoreCorruptError, match=f"its user_version, .* says {version}"):
            await attempt()
    assert path.read_bytes() == before


def test_each_migration_names_an_object_it_makes() -> None:
    """A store whose version was set lower is told by the objects of a later migration
    it holds: every version past the first names one, and the store holds it."""
    assert sorted(MADE_AT) == list(range(2, SCHEMA_VERSION + 1))
    for kind, name in MADE_AT.values():
        assert name in MAIN[kind]


def _not_a_store(kind: str, path: Path) -> None:
    """Make at ``path`` a file that is no store to create or migrate."""
    if kind == "directory":
        path.mkdir()
        return
    if kind == "another application's":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            conn.execute("PRAGMA user_version = 3")
        conn.close()
        return
    asyncio.run(SQLiteStore(f"sqlite:///{path}").migrate())
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 2")
    conn.close()


@pytest.mark.parametrize("kind", ["directory", "another application's", "version set lower"])
def test_the_read_commands_say_what_migrate_says(tmp_path: Path, kind: str) -> None:
    """A directory, another application's database and a store whose user_version was
    set lower by hand were each said by status and queues to need `tokenline migrate`
    (or to hold no store), which then refused them for what they were, or failed on a
    missing table. The read commands now give migrate's diagnosis, and nothing changes."""
    from click.testing import CliRunner

    from tokenline.cli import main

    path = tmp_path / "x.db"
    _not_a_store(kind, path)
    before = sorted(p.name for p in tmp_path.iterdir())
    url = f"sqlite:///{path}"
    said = {}
    for command in ("migrate", "queues", "jobs", "status"):
        result = CliRunner().invoke(main, [command, "--url", url])
        assert result.exit_code == 1, (command, result.output)
        said[command] = " ".join(result.output.split())
    assert said["migrate"].startswith("error: ")
    error = said["migrate"].removeprefix("error: ")
    assert said["queues"] == said["jobs"] == said["migrate"]
    assert error in said["status"]
    for command, text in said.items():
        assert "run `tokenline migrate`" not in text, (command, text)
        assert "create one with `tokenline migrate`" not in text, (command, text)
        assert "no such table" not in text, (command, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.fixture(params=["sqlite", "postgres"])
def damaged_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A fresh store's URL and the statement that drops its effects table."""
    if request.param == "sqlite":
        path = tmp_path / "effects.db"
        yield f"sqlite:///{path}", "DROP TABLE tokenline_effects"
        return
    import psycopg

    server: str = request.getfixturevalue("postgres_server")
    schema = f"tl_dmg_{uuid.uuid4().hex[:8]}"
    yield f"{server}?schema={schema}", f"DROP TABLE {schema}.effects CASCADE"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _drop(url: str, statement: str) -> None:
    if url.startswith("sqlite:"):
        with sqlite3.connect(url[len("sqlite:///") :]) as conn:
            conn.execute(statement)
        return
    import psycopg

    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


def _job_row(url: str, jid: int) -> tuple[str, int, str]:
    """A job's state, attempt and last error, read from the store's table directly."""
    if url.startswith("sqlite:"):
        with sqlite3.connect(url[len("sqlite:///") :]) as conn:
            row = conn.execute(
                "SELECT state, attempt, last_error FROM tokenline_jobs WHERE id = ?", (jid,)
            ).fetchone()
    else:
        import psycopg

        schema = url.split("schema=")[1]
        with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
            row = conn.execute(
                f"SELECT state, attempt, last_error FROM {schema}.jobs WHERE id = %s",  # type: ignore[arg-type]
                (jid,),
            ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), str(row[2] or "")


async def test_a_job_that_meets_a_damaged_store_keeps_its_attempts_and_the_worker_stops(
    damaged_url: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The effects table dropped under a running worker: each job that called
    ctx.effect spent an attempt on the store's fault and went dead. The damage is the
    store's: the job is given back, attempt intact, and the worker stops, saying why
    (running on, it gave the same jobs back for ever, and every operator command
    refused the damaged store meanwhile)."""
    url, drop = damaged_url
    app = App(url)
    calls: list[int] = []

    @app.task(name="charge", max_attempts=2, retry=RetryPolicy(base=0.05, cap=0.1))
    def charge(ctx: object, order: int) -> None:
        ctx.effect(f"charge:{order}", calls.append, order)  # type: ignore[attr-defined]

    settings = WorkerSettings(lease_ttl=5, renew_interval=1, poll_interval=0.05)
    store = app.open_store(timeout=settings.call_timeout)
    await store.open()
    worker = Worker(app, settings, store=store)
    jid = await app.enqueue_async("charge", 1)
    await asyncio.to_thread(_drop, url, drop)  # both stores are open: opening refuses it
    try:
        with caplog.at_level(logging.ERROR, logger="tokenline.worker"):
            await asyncio.wait_for(worker.run(), DEADLINE)  # it stops by itself
        # Read by hand: the worker closed its store, and opening one refuses the damage.
        state, attempt, last_error = await asyncio.to_thread(_job_row, url, jid)
        assert state != "dead", last_error
        assert attempt == 0  # given back: the attempt is the store's fault
        assert "damaged" in last_error or "missing" in last_error, last_error
        assert calls == []  # the callee never ran: its key could not be taken
        assert "the store is damaged" in caplog.text
    finally:
        worker.request_shutdown()
        app.close()
