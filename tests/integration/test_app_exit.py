"""An App left open closes cleanly when the interpreter exits, on every store.

A script that enqueues and exits without ``app.close()`` must not leave its store's
connection pool to be torn down mid-flight ("Task was destroyed but it is pending!"),
nor print any "Exception ignored"; ``with App(...) as app:`` closes at the end of the
block, and ``close()`` stays safe to call again, by hand or at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenline import App

#: What an unclean exit prints; none of it may reach stderr.
FORBIDDEN = ("Task was destroyed", "Exception ignored", "Traceback", "could not close")

PROLOGUE = """
import atexit, sys, threading
from tokenline import App, _app

# atexit runs last: after the app's own exit hook, which must have closed every store.
atexit.register(lambda: print("stores open at exit:", len(_app._open_portals)))

app = App(sys.argv[1])

@app.task(name="t")
def t(ctx, n):
    pass

app.enqueue("t", 1)
"""

#: How each script ends, and the jobs it leaves stored.
ENDINGS = {
    "left open": ("", 1),
    "closed twice": ("app.close()\napp.close()", 1),
    "used again after close": ('app.close()\napp.enqueue("t", 2)', 2),
    "dropped without close": ("del app\nimport gc\ngc.collect()", 1),
    "with block": (
        """
        with App(sys.argv[1]) as other:
            other.task(name="t")(lambda ctx, n: None)
            other.enqueue("t", 3)
        assert not [
            th for th in threading.enumerate()
            if th.name == "tokenline-portal" and th is not app._portal._thread
        ], "the with block left its loop running"
        """,
        2,
    ),
}


def run_script(tmp_path: Path, url: str, ending: str) -> subprocess.CompletedProcess[str]:
    """Run the prologue and ``ending`` as a script on ``url``; it must succeed."""
    script = tmp_path / f"script_{uuid.uuid4().hex[:6]}.py"
    script.write_text(PROLOGUE + textwrap.dedent(ending) + '\nprint("done")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    done = subprocess.run(
        [sys.executable, "-W", "default", str(script), url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    assert "stores open at exit: 0" in done.stdout, done.stdout
    return done


def assert_clean(stderr: str) -> None:
    found = [text for text in FORBIDDEN if text in stderr]
    assert found == [], stderr


def count_jobs(url: str) -> int:
    with App(url) as app:
        return len(app.run(lambda s: s.jobs_list()))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite store in a fresh directory."""
    return f"sqlite:///{tmp_path / 'exit.db'}"


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A PostgreSQL store on a fresh schema, dropped afterwards."""
    import psycopg

    schema = f"tl_exit_{uuid.uuid4().hex[:8]}"
    try:
        yield f"{postgres_server}?schema={schema}"
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_sqlite_app_exits_cleanly(tmp_path: Path, sqlite_url: str, ending: str) -> None:
    """On SQLite the script exits cleanly and its jobs are stored."""
    code, jobs = ENDINGS[ending]
    assert_clean(run_script(tmp_path, sqlite_url, code).stderr)
    assert count_jobs(sqlite_url) == jobs


@pytest.mark.postgres
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_postgres_app_exits_cleanly(tmp_path: Path, postgres_url: str, ending: str) -> None:
    """On PostgreSQL the pool is closed before the interpreter goes: no pending tasks
    destroyed, nothing ignored; the jobs are stored."""
    code, jobs = ENDINGS[ending]
    assert_clean(run_script(tmp_path, postgres_url, code).stderr)
    assert count_jobs(postgres_url) == jobs


def test_exit_after_the_loop_thread_is_gone(tmp_path: Path, sqlite_url: str) -> None:
    """If the facade's loop thread has already stopped, exit closes nothing and says
    nothing; the app still works if used again."""
    ending = """
        portal = app._portal
        portal._loop.call_soon_threadsafe(portal._loop.stop)
        portal._thread.join()
        app.enqueue("t", 2)
        portal._loop.call_soon_threadsafe(portal._loop.stop)
        portal._thread.join()
    """
    assert_clean(run_script(tmp_path, sqlite_url, ending).stderr)
    assert count_jobs(sqlite_url) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_exits_cleanly(tmp_path: Path, sqlite_url: str) -> None:
    """A child forked after the app opened its store has no loop thread: it opens its
    own when used, and both processes exit cleanly."""
    ending = """
        import os
        pid = os.fork()
        if pid == 0:
            app.enqueue("t", 2)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    """
    assert_clean(run_script(tmp_path, sqlite_url, ending).stderr)
    assert count_jobs(sqlite_url) == 2


def test_app_is_a_context_manager(sqlite_url: str) -> None:
    """``with App(...) as app`` gives the app and closes its store and loop at the end."""
    with App(sqlite_url) as app:
        app.task(name="t")(lambda ctx, n: None)
        app.enqueue("t", 1)
        thread = app._portal._thread
        assert thread is not None
        assert thread.is_alive()
    assert not thread.is_alive()
    assert app._portal.store is None
