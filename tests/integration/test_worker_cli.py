"""``tokenline worker`` as a user starts it: which store it runs on, and what it says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenline import App, JobState

DEADLINE = 60.0

APP_MODULE = """
from tokenline import App

app = App({url!r})


@app.task(name="shop.bill")
def bill(ctx, n):
    return n
"""


def _job_state(url: str, jid: int) -> JobState:
    app = App(url)
    try:
        return app.run(lambda s: s.job_get(job_id=jid)).state
    finally:
        app.close()


def _wait_until_done(
    url: str, jid: int, proc: subprocess.Popen[str], output: Callable[[], str]
) -> None:
    """Wait until job ``jid`` on ``url`` has succeeded; fail with the worker's ``output``
    if the worker exits first or the deadline passes."""
    deadline = time.monotonic() + DEADLINE
    while _job_state(url, jid) is not JobState.SUCCEEDED:
        assert proc.poll() is None, output()
        assert time.monotonic() < deadline, f"job {jid} did not run on {url}:\n{output()}"
        time.sleep(0.1)


def _run_worker_until(
    tmp_path: Path, url: str, jid: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """Start a worker, wait for job ``jid`` to succeed on ``url``, SIGTERM it, collect."""
    return _stop_worker_after(tmp_path, url, jid, None, *extra)


def _stop_worker_after(
    tmp_path: Path, url: str, jid: int, again_after: float | None, *extra: str
) -> subprocess.CompletedProcess[str]:
    """:func:`_run_worker_until`, with a second SIGTERM ``again_after`` seconds after the
    first (unless the worker has exited by then)."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TOKENLINE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenline", "worker", "--app", "appmod:app", *extra],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_until_done(url, jid, proc, lambda: str(proc.communicate()))
        proc.send_signal(signal.SIGTERM)
        if again_after is not None:
            time.sleep(again_after)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _write_app(tmp_path: Path, url: str) -> None:
    (tmp_path / "appmod.py").write_text(textwrap.dedent(APP_MODULE.format(url=url)))


def test_worker_on_another_url_runs_the_apps_tasks_there_and_says_so(tmp_path: Path) -> None:
    """--url naming another store than the app's: the app's tasks run on that store (no
    job is dead-lettered as unknown), and stderr names both URLs."""
    built_for = f"sqlite:///{tmp_path / 'built.db'}"
    given = f"sqlite:///{tmp_path / 'given.db'}"
    _write_app(tmp_path, built_for)
    app = App(given)
    app.task(name="shop.bill")(lambda ctx, n: n)
    jid = app.enqueue("shop.bill", [1])
    app.close()

    done = _run_worker_until(tmp_path, given, jid, "--url", given, "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    assert built_for in done.stderr
    assert given in done.stderr
    assert not (tmp_path / "built.db").exists(), "the worker touched the app's own store"


def test_worker_log_shows_outcomes_not_per_job_state_chatter(tmp_path: Path) -> None:
    """At the default log level the worker logs what an operator needs (start, drain, stop
    with its counters as prose), not a ready/processing line per job."""
    url = f"sqlite:///{tmp_path / 'w.db'}"
    _write_app(tmp_path, url)
    app = App(url)
    app.task(name="shop.bill")(lambda ctx, n: n)
    ids = [app.enqueue("shop.bill", [n]) for n in range(5)]
    app.close()

    done = _run_worker_until(tmp_path, url, ids[-1], "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    assert "ready -> processing" not in done.stderr
    assert "processing -> ready" not in done.stderr
    assert "-> draining" in done.stderr
    assert "WorkerCounters(" not in done.stdout + done.stderr
    assert "worker stopped: started 5 jobs: 5 succeeded, 0 retried, 0 dead" in done.stdout


def test_worker_debug_log_keeps_the_state_chatter(tmp_path: Path) -> None:
    """--log-level debug still shows every state change, for whoever needs it."""
    url = f"sqlite:///{tmp_path / 'd.db'}"
    _write_app(tmp_path, url)
    app = App(url)
    app.task(name="shop.bill")(lambda ctx, n: n)
    jid = app.enqueue("shop.bill", [1])
    app.close()

    done = _run_worker_until(tmp_path, url, jid, "--log-level", "debug", "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    assert "ready -> processing" in done.stderr


def test_worker_json_log_has_a_line_per_outcome_with_its_fields(tmp_path: Path) -> None:
    """--log-format json: every line is a JSON object; each job outcome has one, with the
    worker id, job id, token, attempt and outcome; state changes carry old and new."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    _write_app(tmp_path, url)
    app = App(url)
    app.task(name="shop.bill")(lambda ctx, n: n)
    ids = [app.enqueue("shop.bill", [n]) for n in range(3)]
    app.close()

    done = _run_worker_until(
        tmp_path, url, ids[-1], "--log-format", "json", "--poll-interval", "0.2"
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    outcomes = {r["job_id"]: r for r in lines if r.get("outcome")}
    assert sorted(outcomes) == sorted(ids)
    for r in outcomes.values():
        assert r["outcome"] == "succeeded"
        assert r["attempt"] == 1
        assert r["token"] >= 1
        assert r["worker_id"]
    moves = [(r["old_state"], r["new_state"]) for r in lines if "new_state" in r]
    assert ("ready", "draining") in moves or ("processing", "draining") in moves


def test_an_app_moved_to_another_url_keeps_its_dependencies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tasks moved to the given store keep their options, depends_on included, and
    the app's registered dependencies come along: a gated task must stay gated."""
    from tokenline.cli import _common

    built = App(f"sqlite:///{tmp_path / 'built.db'}")
    built.dependency("payments-api", timeout=2)
    built.task(name="shop.charge", max_attempts=4, depends_on=["payments-api"])(lambda ctx: 1)
    monkeypatch.setattr(_common, "load_app", lambda spec: built)
    moved = _common.resolve_app("x:app", f"sqlite:///{tmp_path / 'given.db'}")
    task = moved.get_task("shop.charge")
    assert (task.max_attempts, task.depends_on) == (4, ("payments-api",))
    assert moved.dependencies["payments-api"] == built.dependencies["payments-api"]


def _start_waiting_worker(
    tmp_path: Path, url: str, wait: str
) -> tuple[subprocess.Popen[str], Path]:
    """A worker started on ``url`` (whose directory does not exist yet) with
    ``--startup-wait``; returned once its log says it is waiting, with the log's path."""
    _write_app(tmp_path, url)
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TOKENLINE_URL", None)
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenline", "worker", "--app", "appmod:app",
             "--startup-wait", wait, "--poll-interval", "0.05"],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    deadline = time.monotonic() + DEADLINE
    while "store unavailable at start-up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the worker never said it was waiting:\n{log.read_text()}")
        time.sleep(0.05)
    return proc, log


def test_a_worker_started_before_its_store_can_be_opened_waits_for_it(tmp_path: Path) -> None:
    """With --startup-wait, a worker whose SQLite directory does not exist yet keeps
    trying, saying why, and runs jobs once the directory is there."""
    url = f"sqlite:///{tmp_path / 'later' / 'jobs.db'}"
    proc, log = _start_waiting_worker(tmp_path, url, "120")
    try:
        assert "does not exist" in log.read_text()
        (tmp_path / "later").mkdir()
        app = App(url)
        app.task(name="shop.bill")(lambda ctx, n: n)
        jid = app.enqueue("shop.bill", 3)
        app.close()
        _wait_until_done(url, jid, proc, log.read_text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_waiting_for_its_store_stops_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM ends the wait at once: the worker exits 0 and says it stopped waiting."""
    proc, log = _start_waiting_worker(tmp_path, f"sqlite:///{tmp_path / 'no' / 'j.db'}", "3600")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 0, log.read_text()
        assert "stopped while waiting for its store" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("gap", [0.0, 0.02, 0.05, 0.2])
def test_a_second_sigterm_as_the_worker_exits_leaves_a_clean_exit(
    tmp_path: Path, gap: float
) -> None:
    """A second SIGTERM that arrived after the worker stopped, while the process was
    exiting, killed it with status 143 after a clean stop. The worker's handlers now
    give way to ignoring both signals: the exit status is 0 whenever the second comes."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    _write_app(tmp_path, url)
    with App(url) as app:
        app.task(name="shop.bill")(lambda ctx, n: n)
        jid = app.enqueue("shop.bill", 1)
    done = _stop_worker_after(tmp_path, url, jid, gap)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "worker stopped" in done.stdout, (done.stdout, done.stderr)


STOPPER_MODULE = """
import asyncio

from tokenline import App

app = App({url!r})


@app.task(name="shop.stop")
async def stop(ctx):
    asyncio.get_running_loop().stop()


@app.task(name="shop.bill")
def bill(ctx, n):
    return n
"""


def test_a_handler_that_stops_the_event_loop_does_not_end_the_worker(tmp_path: Path) -> None:
    """An async handler calling loop.stop() ended the worker with a traceback ("Event
    loop stopped before Future completed"), its other jobs held until their leases
    expired. The worker now runs on, says so, runs the jobs after it and stops cleanly."""
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    (tmp_path / "appmod.py").write_text(textwrap.dedent(STOPPER_MODULE.format(url=url)))
    app = App(url)
    app.task(name="shop.stop")(lambda ctx: None)
    app.task(name="shop.bill")(lambda ctx, n: n)
    app.enqueue("shop.stop")
    ids = [app.enqueue("shop.bill", [n]) for n in range(3)]
    app.close()

    done = _run_worker_until(tmp_path, url, ids[-1], "--poll-interval", "0.2")
    assert done.returncode == 0, done.stderr
    assert "a job's handler stopped the event loop" in done.stderr
    assert "Traceback" not in done.stderr
    assert all(_job_state(url, jid) is JobState.SUCCEEDED for jid in ids)
    assert "worker stopped: started 4 jobs: 4 succeeded" in done.stdout


FORKER_MODULE = """
import os
import time

from tokenline import App

app = App({url!r})


@app.task(name="shop.fork_returns")
def fork_returns(ctx):
    pid = os.fork()
    if pid == 0:
        with open({returned!r}, "w") as f:
            f.write(str(os.getpid()))
    return None


@app.task(name="shop.fork_sleeps")
def fork_sleeps(ctx):
    pid = os.fork()
    if pid == 0:
        with open({sleeping!r}, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
    return None


@app.task(name="shop.bill")
def bill(ctx, n):
    return n
"""


def _gone(pid: int) -> bool:
    """The process has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def _wait_for_file(path: Path) -> int:
    deadline = time.monotonic() + DEADLINE
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_handlers_forked_child_neither_lingers_nor_signals_the_worker(
    tmp_path: Path,
) -> None:
    """A sync handler's forked child that returned from the handler went back into the
    worker's thread pool and waited there for ever, ignoring SIGTERM; and SIGTERM sent
    to a forked child woke the worker itself, through the signal pipe they shared, and
    it began to drain. The child that returns now exits, and a SIGTERM ends a child
    and no one else."""
    url = f"sqlite:///{tmp_path / 'fork.db'}"
    returned, sleeping = tmp_path / "returned.pid", tmp_path / "sleeping.pid"
    module = FORKER_MODULE.format(url=url, returned=str(returned), sleeping=str(sleeping))
    (tmp_path / "appmod.py").write_text(textwrap.dedent(module))
    app = App(url)
    for name in ("shop.fork_returns", "shop.fork_sleeps"):
        app.task(name=name)(lambda ctx: None)
    app.task(name="shop.bill")(lambda ctx, n: n)
    app.enqueue("shop.fork_returns")
    app.enqueue("shop.fork_sleeps")
    app.close()

    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TOKENLINE_URL", None)
    command = ["worker", "--app", "appmod:app", "--poll-interval", "0.2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenline", *command],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        child = _wait_for_file(returned)
        deadline = time.monotonic() + DEADLINE
        while not _gone(child):
            assert time.monotonic() < deadline, "the child that returned still runs"
            time.sleep(0.05)
        sleeper = _wait_for_file(sleeping)
        os.kill(sleeper, signal.SIGTERM)
        deadline = time.monotonic() + DEADLINE
        while not _gone(sleeper):
            assert time.monotonic() < deadline, "the sleeping child ignored SIGTERM"
            time.sleep(0.05)
        # The worker took no part in the child's signal: it still claims and runs jobs.
        app = App(url)
        app.task(name="shop.bill")(lambda ctx, n: n)
        jid = app.enqueue("shop.bill", [1])
        app.close()
        _wait_until_done(url, jid, proc, lambda: str(proc.communicate()))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert err.count("-> draining") == 1, err  # the SIGTERM sent to the worker, at the end
    assert "returned into the worker; it exits" in err


HANGING_THREAD_MODULE = """
import asyncio
import threading

from tokenline import App

app = App({url!r})


@app.task(name="shop.hang")
async def hang(ctx):
    await asyncio.to_thread(threading.Event().wait)  # never returns


@app.task(name="shop.bill")
def bill(ctx, n):
    return n
"""


def test_a_stopped_worker_exits_though_a_handler_left_a_thread_running(tmp_path: Path) -> None:
    """An async handler that handed a call that never returns to asyncio.to_thread kept
    its worker's process alive for ever after the stop: the event loop's runner waited
    for the thread as it closed, and a second SIGTERM did nothing. The process now
    exits once the worker has stopped, saying so; the job goes back to the queue."""
    url = f"sqlite:///{tmp_path / 'hang.db'}"
    (tmp_path / "appmod.py").write_text(textwrap.dedent(HANGING_THREAD_MODULE.format(url=url)))
    app = App(url)
    app.task(name="shop.hang")(lambda ctx: None)
    app.task(name="shop.bill")(lambda ctx, n: n)
    hung = app.enqueue("shop.hang")
    jid = app.enqueue("shop.bill", [1])
    app.close()

    done = _run_worker_until(tmp_path, url, jid, "--drain-timeout", "0.5")
    assert done.returncode == 0, done.stderr
    assert "exiting with calls of handlers in threads still running" in done.stderr
    assert "worker stopped" in done.stdout, (done.stdout, done.stderr)
    assert _job_state(url, hung) is JobState.QUEUED  # given back by the drain timeout
