"""What only the SQLite store promises: its file, its schema, its trigger, its outbox."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from tokenline import App, SchemaVersionError, StoreCorruptError, StoreUnavailableError
from tokenline._clock import FakeClock
from tokenline._errors import StoreError
from tokenline._jobs import JobState, NewJob
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite.store import SCHEMA_VERSION


def job() -> NewJob:
    return NewJob(queue="default", task="t", args="[]")


async def test_missing_directory_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    """A store path in a directory that does not exist names that directory."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        await store.open()


async def test_corrupt_file_is_reported_and_not_modified(tmp_path: Path) -> None:
    """A file that is not SQLite raises StoreCorruptError and keeps its bytes."""
    path = tmp_path / "bad.db"
    path.write_bytes(b"not a database " * 200)
    before = path.read_bytes()
    with pytest.raises(StoreCorruptError, match="not a usable tokenline store"):
        await SQLiteStore(f"sqlite:///{path}").open()
    assert path.read_bytes() == before


async def test_newer_schema_is_refused_with_a_hint(tmp_path: Path) -> None:
    """A file written by a newer tokenline is refused, not downgraded."""
    path = tmp_path / "new.db"
    await SQLiteStore(f"sqlite:///{path}").migrate()  # a store, then a newer one's mark
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(SchemaVersionError, match="upgrade tokenline"):
        await SQLiteStore(f"sqlite:///{path}").open()


@pytest.mark.parametrize("which", ["", "-coord"])
async def test_a_directory_in_place_of_a_file_is_named(tmp_path: Path, which: str) -> None:
    """A store path that is a directory was said "unable to open database file (check
    that the directory exists and is writable)", sending the operator to look at the
    directory's rights."""
    path = tmp_path / "jobs.db"
    os.mkdir(f"{path}{which}")
    with pytest.raises(StoreUnavailableError, match="is a directory, not a file"):
        await SQLiteStore(f"sqlite:///{path}").open()


def test_url_without_a_file_is_refused() -> None:
    """``sqlite:///:memory:`` cannot be shared by worker processes: say so."""
    with pytest.raises(StoreError, match="memory://"):
        SQLiteStore("sqlite:///:memory:")


async def test_reopening_keeps_data_and_schema(tmp_path: Path) -> None:
    """Opening an existing store does not recreate or lose anything."""
    url = f"sqlite:///{tmp_path / 'keep.db'}"
    first = SQLiteStore(url)
    await first.open()
    (jid,) = await first.jobs_enqueue(jobs=[job()])
    await first.close()
    second = SQLiteStore(url)
    await second.open()
    assert (await second.job_get(job_id=jid)).state is JobState.QUEUED
    await second.close()


async def test_the_store_itself_refuses_a_backwards_state_move(tmp_path: Path) -> None:
    """Even raw SQL cannot move a succeeded job back to running: the trigger aborts."""
    path = tmp_path / "mono.db"
    store = SQLiteStore(f"sqlite:///{path}", clock=FakeClock())
    await store.open()
    await store.jobs_enqueue(jobs=[job()])
    (c,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=5)
    await store.job_complete(lease=c.lease)
    await store.close()
    with sqlite3.connect(path) as conn, pytest.raises(sqlite3.IntegrityError, match="illegal"):
        conn.execute("UPDATE tokenline_jobs SET state = 'running' WHERE id = ?", (c.job.id,))


def test_outbox_enqueue_exists_only_if_the_callers_transaction_commits(tmp_path: Path) -> None:
    """enqueue(connection=conn) joins the caller's transaction: rollback leaves no job."""
    path = tmp_path / "outbox.db"
    app = App(f"sqlite:///{path}")

    @app.task(name="ship")
    def ship(ctx: object, order: int) -> None:
        """A task to enqueue."""

    app.run(lambda s: s.queues_stats())  # creates the schema
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE orders (id INTEGER)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO orders VALUES (1)")
    app.enqueue("ship", 1, connection=conn)
    conn.execute("ROLLBACK")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO orders VALUES (2)")
    jid = app.enqueue("ship", 2, connection=conn)
    conn.execute("COMMIT")
    conn.close()
    jobs = app.run(lambda s: s.jobs_list())
    app.close()
    assert [(j.id, j.args) for j in jobs] == [(jid, '{"args":[2],"kwargs":{}}')]


def test_outbox_refuses_a_connection_to_another_file(tmp_path: Path) -> None:
    """A connection to another tokenline store (or any other database) had the job
    written there, where no worker of this app looks: refused, naming both files,
    nothing written to either; a connection to the store's file by another path (a
    symlink) is the same file, and accepted."""
    ours, theirs = tmp_path / "ours.db", tmp_path / "theirs.db"
    app, other = App(f"sqlite:///{ours}"), App(f"sqlite:///{theirs}")
    for a in (app, other):

        @a.task(name="ship")
        def ship(ctx: object) -> None:
            """A task to enqueue."""

        a.run(lambda s: s.queues_stats())  # creates the schema
    try:
        for target in (theirs, ":memory:"):
            conn = sqlite3.connect(target, isolation_level=None)
            conn.execute("BEGIN")
            with pytest.raises(StoreError, match="not this store's file") as caught:
                app.enqueue("ship", connection=conn)
            assert str(ours) in str(caught.value)
            conn.execute("ROLLBACK")
            conn.close()
        (tmp_path / "link.db").symlink_to(ours)
        conn = sqlite3.connect(tmp_path / "link.db", isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        jid = app.enqueue("ship", connection=conn)
        conn.execute("COMMIT")
        conn.close()
        assert [j.id for j in app.run(lambda s: s.jobs_list())] == [jid]
        assert other.run(lambda s: s.jobs_list()) == []
    finally:
        app.close()
        other.close()


def test_outbox_needs_an_open_transaction(tmp_path: Path) -> None:
    """A connection outside a transaction would commit the job on its own: refused."""
    path = tmp_path / "outbox2.db"
    app = App(f"sqlite:///{path}")

    @app.task(name="ship")
    def ship(ctx: object) -> None:
        """A task to enqueue."""

    app.run(lambda s: s.queues_stats())
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(StoreError, match="open transaction"):
        app.enqueue("ship", connection=conn)
    conn.close()
    # A closed one raised the driver's own ProgrammingError, naming no connection=.
    with pytest.raises(StoreError, match="connection= is closed"):
        app.enqueue("ship", connection=conn)
    with pytest.raises(StoreError, match="not str"):
        app.enqueue("ship", connection="outbox2.db")
    assert app.run(lambda s: s.jobs_list()) == []
    app.close()


async def test_a_call_given_up_on_before_it_starts_never_runs() -> None:
    """A store call whose caller stopped waiting while it queued behind a slow one is
    skipped, never run late: a claim must not land for a worker that gave up on it."""
    from tokenline.stores.sqlite._lanes import Lane

    lane = Lane("test-lane")
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()
    try:

        def slow(abandoned: object) -> None:
            started.set()
            release.wait(10)
            ran.append("slow")

        def late(abandoned: object) -> None:
            ran.append("late")

        first = asyncio.ensure_future(lane.call(slow, deadline=30, path=Path("x.db")))
        await asyncio.to_thread(started.wait, 10)
        with pytest.raises(StoreUnavailableError, match="did not answer"):
            await lane.call(late, deadline=0.2, path=Path("x.db"))
        release.set()
        await first
        await lane.run(lambda: None)  # everything queued has been taken off the queue
        assert ran == ["slow"]
    finally:
        release.set()
        lane.close()


async def test_transaction_waits_for_another_processes_lock_instead_of_failing(
    tmp_path: Path,
) -> None:
    """A fenced transaction that finds the file locked by another process waits for the
    attempt's remaining time rather than the store timeout, so a neighbour's long
    transaction does not make the job give its attempt back and start over."""
    url = f"sqlite:///{tmp_path / 'wait.db'}"
    store = SQLiteStore(url, timeout=0.3)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[job()])
        (claimed,) = await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        holder = sqlite3.connect(
            tmp_path / "wait.db", isolation_level=None, check_same_thread=False
        )
        holder.execute("BEGIN IMMEDIATE")
        rollback = threading.Timer(1.0, lambda: holder.execute("ROLLBACK"))
        rollback.start()

        def in_transaction() -> None:
            with store.fenced_transaction(lease=claimed.lease, timeout=10) as conn:
                conn.execute("CREATE TABLE marks (n)")

        await asyncio.to_thread(in_transaction)
        # The lock frees inside the timer's ROLLBACK, which may still be running: closing
        # the connection under it crashed the interpreter (seen once in CI).
        await asyncio.to_thread(rollback.join)
        holder.close()
        assert (await store.job_get(job_id=claimed.job.id)).state is JobState.SUCCEEDED
    finally:
        await store.close()


async def test_a_claim_its_caller_gave_up_on_claims_nothing(tmp_path: Path) -> None:
    """A claim that queued behind a slow call, then waited for another process's lock,
    is still waiting when its caller's deadline passes: it is interrupted, and when the
    lock frees it has claimed nothing — a claim landing for a worker that gave up on it
    would leave jobs running that nobody runs until their lease ran out."""
    import time

    url = f"sqlite:///{tmp_path / 'late.db'}"
    store = SQLiteStore(url, timeout=1.0)  # the caller's deadline: 2 x 1 + 1 = 3 s
    await store.open()
    holder = sqlite3.connect(tmp_path / "late.db", isolation_level=None, check_same_thread=False)
    timer = threading.Timer(3.6, holder.rollback)
    try:
        await store.jobs_enqueue(jobs=[job()])
        began = time.monotonic()
        # Occupies the main thread for 2.6 s: the claim starts then, 0.4 s before its
        # caller's deadline, and finds the file locked until 3.6 s.
        occupied = threading.Event()

        def occupy(conn: sqlite3.Connection) -> None:
            occupied.set()
            time.sleep(2.6)

        busy = asyncio.ensure_future(store._call(occupy))
        await asyncio.to_thread(occupied.wait, 10)
        holder.execute("BEGIN IMMEDIATE")
        timer.start()
        with pytest.raises(StoreUnavailableError):
            await store.jobs_claim(owner="w", queues=["default"], limit=1, ttl=30)
        assert time.monotonic() - began < 3.6  # it gave up before the lock freed
        await busy
        await asyncio.to_thread(timer.join)
        await asyncio.sleep(1.5)  # past the claim's own busy timeout
        assert await store.jobs_list(state=JobState.RUNNING) == []
    finally:
        # Never closed under the timer's rollback, which may still be running.
        if timer.is_alive():
            await asyncio.to_thread(timer.join)
        holder.close()
        await store.close()


async def test_processes_opening_a_new_file_together_all_succeed(tmp_path: Path) -> None:
    """Several stores opening the same new file at once (workers started together)
    race to switch it to WAL and create its schema; SQLite answers the losers "busy"
    at once. Every one of them opens, none reports the store unavailable."""
    failures = 0
    for round_ in range(20):
        url = f"sqlite:///{tmp_path / f'race-{round_}.db'}"

        async def one(url: str = url) -> None:
            store = SQLiteStore(url, timeout=5)
            await store.open()
            try:
                await store.queues_stats()
            finally:
                await store.close()

        results = await asyncio.gather(*(one() for _ in range(4)), return_exceptions=True)
        failures += sum(isinstance(r, BaseException) for r in results)
    assert failures == 0


# -- migrate=False (TOKENLINE_MIGRATE=0), as on PostgreSQL ---------------------------------------
def test_migrate_off_refuses_a_missing_store_and_creates_nothing(tmp_path: Path) -> None:
    """With migrations off, opening a store that has no schema yet says to run
    ``tokenline migrate`` and leaves no file behind; it used to create the schema."""
    db = tmp_path / "new.db"
    store = SQLiteStore(f"sqlite:///{db}", migrate=False)
    with pytest.raises(SchemaVersionError, match="run `tokenline migrate`"):
        asyncio.run(store.open())
    assert list(tmp_path.iterdir()) == []
    assert asyncio.run(store.migrate()) == SCHEMA_VERSION  # migrate() itself still works
    asyncio.run(store.open())
    asyncio.run(store.close())


def test_migrate_off_refuses_an_old_schema_and_leaves_it(tmp_path: Path) -> None:
    """An outdated schema is refused, not upgraded, with migrations off; through the app's
    settings too (``Settings(migrate=False)``, which TOKENLINE_MIGRATE=0 sets)."""
    from tokenline import Settings

    db = tmp_path / "old.db"
    asyncio.run(SQLiteStore(f"sqlite:///{db}").migrate())
    with sqlite3.connect(db) as conn:
        # The last migration added these triggers alone: without them the file is as the
        # one before left it (a user_version set lower alone is refused as set by hand).
        conn.execute("DROP TRIGGER tokenline_jobs_types_insert")
        conn.execute("DROP TRIGGER tokenline_jobs_types_update")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    conn.close()
    before = db.read_bytes()
    app = App(settings=Settings(url=f"sqlite:///{db}", migrate=False))
    try:
        with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION - 1}"):
            app.run(lambda s: s.queues_stats())
    finally:
        app.close()
    assert db.read_bytes() == before
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION - 1
    conn.close()


async def test_a_priority_or_run_at_of_the_wrong_type_is_refused_by_the_file(
    tmp_path: Path,
) -> None:
    """SQLite keeps whatever type a statement writes: a priority of 'abc', written by
    hand, stopped every worker of its queue (the claim ranks in Python), and a run_at of
    'soon' left its job queued for good. The file refuses both, from any SQL, and a
    value of the right type written as text is stored as a number; the claim then
    hands out every job."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'q.db'}")
    await store.open()
    try:
        ids = await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")] * 3)
        with sqlite3.connect(tmp_path / "q.db") as conn:
            for sql in (
                "UPDATE tokenline_jobs SET priority = 'abc' WHERE id = ?",
                "UPDATE tokenline_jobs SET run_at = 'soon' WHERE id = ?",
                "UPDATE tokenline_jobs SET priority = x'00' WHERE id = ?",
                "UPDATE tokenline_jobs SET queue = x'71' WHERE id = ?",
                "UPDATE tokenline_jobs SET run_at = -1e999 WHERE id = ?",
                "UPDATE tokenline_jobs SET run_at = 1e999 WHERE id = ?",
            ):
                with pytest.raises(sqlite3.IntegrityError, match="priority must be an integer"):
                    conn.execute(sql, (ids[0],))
            with pytest.raises(sqlite3.IntegrityError, match="priority must be an integer"):
                conn.execute(
                    "INSERT INTO tokenline_jobs (queue, task, args, priority, run_at, "
                    "max_attempts, state, created_at, updated_at) "
                    "VALUES ('q', 't', '[]', 'high', 0, 1, 'queued', 0, 0)"
                )
            conn.execute("UPDATE tokenline_jobs SET priority = '7' WHERE id = ?", (ids[1],))
            rows = conn.execute(
                "SELECT typeof(priority), typeof(run_at) FROM tokenline_jobs ORDER BY id"
            ).fetchall()
        assert rows == [("integer", "real")] * 3
        claimed = await store.jobs_claim(owner="w", queues=["q"], limit=10, ttl=30)
        assert [c.job.id for c in claimed] == [ids[1], ids[0], ids[2]]
    finally:
        await store.close()


def _read_coord(main: Path, coord: Path) -> None:
    """Open a store connection with ``coord`` attached and read from it."""
    from tokenline.stores.sqlite._connection import connect_main

    conn = connect_main(main, busy_timeout=1.0, coord=coord)
    try:
        conn.execute("SELECT count(*) FROM coord.sqlite_master").fetchall()
    finally:
        conn.close()


def test_a_damaged_or_deleted_coordination_file_is_named(tmp_path: Path) -> None:
    """SQLite's "file is not a database" does not say which file of a connection it
    could not read: the error blamed the store's file when its coordination file was
    the damaged one. A coordination file deleted while the store was open is named too,
    with what to do."""
    from tokenline.stores.sqlite._connection import coord_path
    from tokenline.stores.sqlite._errors import map_sqlite_errors

    main = tmp_path / "q.db"
    asyncio.run(SQLiteStore(f"sqlite:///{main}").migrate())
    coord = coord_path(main)
    for leftover in tmp_path.glob("q.db-coord-*"):  # its log and index: the file alone
        leftover.unlink()
    with coord.open("r+b") as fh:
        fh.write(b"GARBAGE!GARBAGE!")
    with pytest.raises(StoreCorruptError) as caught, map_sqlite_errors(main):
        _read_coord(main, coord)
    assert str(caught.value).startswith(f"{str(coord)!r} is not a usable tokenline store file")
    coord.unlink()
    with pytest.raises(StoreUnavailableError) as gone, map_sqlite_errors(main):
        _read_coord(main, coord)
    assert f"its coordination file {str(coord)!r} is missing" in str(gone.value)
    assert "Restart the processes that use this store" in str(gone.value)


@pytest.mark.parametrize("reading", [1, 2])
async def test_a_migration_committed_between_two_reads_is_not_a_lost_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reading: int
) -> None:
    """The opener reads the file's version, then whether it holds tokenline's tables.
    Another process that migrates the new file between those two reads must not make
    it look like a store whose version was lost (tables there, version 0): both reads
    come from one snapshot. Here the other process tries at that exact moment, in the
    opener's first reading (before the switch to WAL) or its second (in migrating)."""
    from tokenline.stores.sqlite import _catalog

    path = tmp_path / "between.db"
    real = _catalog.holds_tokenline_tables
    other: list[BaseException | None] = []
    started = threading.Event()
    calls: list[int] = []

    def migrate_elsewhere() -> None:
        async def go() -> None:
            store = SQLiteStore(f"sqlite:///{path}", timeout=0.3)
            try:
                await store.open()
            finally:
                await store.close()

        try:
            asyncio.run(go())
            other.append(None)
        except BaseException as exc:  # the snapshot's lock may keep it out: fine
            other.append(exc)

    def between(conn: sqlite3.Connection) -> bool:
        if threading.current_thread().name != "other-opener":
            calls.append(1)
        if len(calls) == reading and not started.is_set():
            started.set()
            thread = threading.Thread(target=migrate_elsewhere, name="other-opener")
            thread.start()
            thread.join()
        return real(conn)

    monkeypatch.setattr(_catalog, "holds_tokenline_tables", between)
    store = SQLiteStore(f"sqlite:///{path}", timeout=5)
    await store.open()
    try:
        assert other, "the other opener never ran between the two reads"
        assert await store.queues_stats() == []
    finally:
        await store.close()
