"""An App whose first enqueues come from several threads at once opens one store, and
exits cleanly without ``app.close()``.

Each thread's first enqueue finds no store open yet and asks the facade's loop for
one. Each used to open its own: the app kept, and closed at exit, only the last, and
on PostgreSQL the others' connection pools were torn down with the loop (hundreds of
"Task was destroyed but it is pending!" and "Event loop is closed" lines on stderr).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tokenline import App
from tokenline.stores import split_url

THREADS = 8
JOBS = 50

#: What an unclean exit prints; none of it may reach stderr.
FORBIDDEN = (
    "Task was destroyed",
    "Event loop is closed",
    "Exception ignored",
    "Traceback",
    "could not close",
)

SCRIPT = f"""
import sys, threading
from concurrent.futures import ThreadPoolExecutor
from tokenline import App

app = App(sys.argv[1])

@app.task(name="u")
def u(ctx, x):
    pass

# Every thread's first enqueue at once: none of them finds the store open.
start = threading.Barrier({THREADS}, timeout=30)

def send(first):
    start.wait()
    for n in range(first, {JOBS}, {THREADS}):
        app.enqueue(u, n)

with ThreadPoolExecutor({THREADS}) as ex:
    list(ex.map(send, range({THREADS})))
print("done")
"""


def _postgres(server: str, prefix: str) -> Iterator[str]:
    """A store URL on a fresh schema, dropped afterwards."""
    import psycopg

    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    try:
        yield f"{server}?schema={schema}"
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), "split"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store of each kind the facade enqueues to from the caller's thread."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'threads.db'}"
    elif request.param == "postgres":
        yield from _postgres(request.getfixturevalue("postgres_server"), "tl_exitth")
    else:
        redis: str = request.getfixturevalue("redis_url")
        for ledger in _postgres(request.getfixturevalue("postgres_server"), "tl_exitths"):
            yield split_url(broker=redis, ledger=ledger)


def test_threaded_enqueues_then_exit_without_close(tmp_path: Path, url: str) -> None:
    """The script exits with status 0, prints nothing to stderr, and stores every job."""
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    done = subprocess.run(
        [sys.executable, "-W", "default", str(script), url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    assert [text for text in FORBIDDEN if text in done.stderr] == [], done.stderr
    assert done.stderr == ""
    with App(url) as app:
        assert len(app.run(lambda s: s.jobs_list(limit=2 * JOBS))) == JOBS


def test_concurrent_first_enqueues_open_one_store(tmp_path: Path) -> None:
    """Threads whose first enqueues race share the one store the first of them opens."""
    app = App(f"sqlite:///{tmp_path / 'one.db'}")
    app.task(name="u")(lambda ctx, x: None)
    opened: list[object] = []
    new_store = app.open_store

    def counting_open_store(*, timeout: float | None = None) -> object:
        store = new_store(timeout=timeout)
        opened.append(store)
        return store

    app.open_store = counting_open_store  # type: ignore[method-assign,assignment]
    start = threading.Barrier(THREADS, timeout=30)

    def send(n: int) -> int:
        start.wait()
        return app.enqueue("u", n)

    try:
        with ThreadPoolExecutor(THREADS) as ex:
            ids = list(ex.map(send, range(THREADS)))
        assert len(set(ids)) == THREADS
        assert len(opened) == 1
    finally:
        app.close()


def test_close_while_threads_enqueue_leaves_none_waiting(url: str) -> None:
    """``app.close()`` while other threads enqueue: each enqueue under way ends on the
    store being closed, and the next ones open it again. Threads used to wait for ever
    for a loop that had stopped, or found the store closed under them ("the PostgreSQL
    store is closed; call open() first")."""
    app = App(url)
    app.task(name="u")(lambda ctx, x: None)
    app.enqueue("u", -1)
    per_thread, threads = 150, 4
    errors: list[BaseException] = []
    ids: list[int] = []
    lock = threading.Lock()

    def send(first: int) -> None:
        try:
            for n in range(first, first + per_thread):
                jid = app.enqueue("u", n)
                with lock:
                    ids.append(jid)
        except BaseException as exc:  # any error fails the test below, named
            errors.append(exc)

    workers = [
        threading.Thread(target=send, args=(t * per_thread,), daemon=True) for t in range(threads)
    ]
    try:
        for w in workers:
            w.start()
        closes = 0
        while any(w.is_alive() for w in workers) and closes < 200:
            app.close()
            closes += 1
        for w in workers:
            w.join(60)
        assert not [w for w in workers if w.is_alive()], "an enqueue never returned"
        assert errors == []
        assert len(set(ids)) == threads * per_thread
        assert closes > 1
    finally:
        app.close()
    with App(url) as again:
        stored = again.run(lambda s: s.jobs_list(limit=10 * threads * per_thread))
    assert len(stored) == threads * per_thread + 1
