"""Cancelling jobs that have not run yet: ``app.cancel`` and ``tokenline cancel``.

There was no way for a user or an operator to cancel a queued job: only dead ones could
be discarded. A cancelled job never runs; a running one finishes its attempt; each id
not cancelled is named with the reason.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline import App, InvalidInputError, JobState
from tokenline.cli import main


def _app(path: Path) -> App:
    app = App(f"sqlite:///{path}")

    @app.task(name="t")
    def t(ctx: object, i: int) -> None:
        """A task to enqueue."""

    return app


def _states(app: App, ids: list[int]) -> list[JobState]:
    async def read(store: object) -> list[JobState]:
        return [(await store.job_get(job_id=j)).state for j in ids]  # type: ignore[attr-defined]

    return app.run(read)


def test_app_cancel_cancels_what_has_not_run_and_leaves_the_rest(tmp_path: Path) -> None:
    """Queued and scheduled jobs are cancelled, with the reason as their last error; a
    running job is left running, a succeeded one succeeded; the count says how many."""
    app = _app(tmp_path / "c.db")
    running, done = app.enqueue("t", 3), app.enqueue("t", 4)

    async def run_both_finish_one(store: object) -> None:
        claimed = await store.jobs_claim(owner="w", queues=["default"], limit=2, ttl=60)  # type: ignore[attr-defined]
        (finished,) = [c for c in claimed if c.job.id == done]
        await store.job_complete(lease=finished.lease)  # type: ignore[attr-defined]

    app.run(run_both_finish_one)
    queued, scheduled = app.enqueue("t", 1), app.enqueue("t", 2, delay=3600)
    assert app.cancel(queued, scheduled, running, done, reason="order withdrawn") == 2
    assert _states(app, [queued, scheduled, running, done]) == [
        JobState.CANCELLED,
        JobState.CANCELLED,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ]
    job = app.run(lambda s: s.job_get(job_id=queued))
    assert job.last_error == "order withdrawn"
    assert asyncio.run(app.cancel_async(scheduled)) == 0  # already cancelled
    assert app.cancel() == 0
    app.close()


@pytest.mark.parametrize(
    ("ids", "reason", "message"),
    [
        ((0,), "x", "job ids are whole numbers from 1"),
        ((True,), "x", "job ids are whole numbers from 1"),
        (("7",), "x", "job ids are whole numbers from 1"),
        ((2**63,), "x", "job ids are whole numbers from 1"),
        ((1,), "", "reason must be a non-empty string"),
        ((1,), None, "reason must be a non-empty string"),
        ((1,), "r" * 2001, "over the limit of 2000"),
    ],
)
def test_app_cancel_refuses_bad_input_naming_it(
    tmp_path: Path, ids: tuple[object, ...], reason: object, message: str
) -> None:
    app = _app(tmp_path / "c.db")
    jid = app.enqueue("t", 1)
    with pytest.raises(InvalidInputError, match=message):
        app.cancel(*ids, reason=reason)  # type: ignore[arg-type]
    assert _states(app, [jid]) == [JobState.QUEUED]
    app.close()


def test_the_cancel_command_names_each_id_it_did_not_cancel(tmp_path: Path) -> None:
    """Exit status 0 when every id was cancelled; else 1, each other id named with why
    (no such job, already cancelled), the others cancelled all the same."""
    path = tmp_path / "c.db"
    app = _app(path)
    first, second = app.enqueue("t", 1), app.enqueue("t", 2, delay=60)
    app.close()
    url = f"sqlite:///{path}"
    result = CliRunner().invoke(main, ["cancel", str(first), "--url", url])
    assert result.exit_code == 0, result.output
    assert f"cancelled 1 job: {first}" in result.output
    result = CliRunner().invoke(
        main, ["cancel", str(first), str(second), "999", "--url", url, "--reason", "stop"]
    )
    assert result.exit_code == 1, result.output
    assert f"cancelled 1 job: {second}" in result.output
    assert f"not cancelled: job {first}: it is already cancelled" in result.output
    assert "not cancelled: job 999: no such job" in result.output
    app = _app(path)
    assert _states(app, [first, second]) == [JobState.CANCELLED] * 2
    assert app.run(lambda s: s.job_get(job_id=second)).last_error == "stop"
    app.close()


def test_the_cancel_command_refuses_a_store_that_is_not_there(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["cancel", "1", "--url", f"sqlite:///{tmp_path / 'x.db'}"])
    assert result.exit_code == 2
    assert list(tmp_path.iterdir()) == []


def test_a_reason_is_kept_as_every_store_can_keep_it(tmp_path: Path) -> None:
    """A lone surrogate failed the cancel with a raw UnicodeEncodeError, and a NUL was
    stored raw (PostgreSQL refuses one): both are kept as escapes, as errors are."""
    app = _app(tmp_path / "c.db")
    first, second = app.enqueue("t", 1), app.enqueue("t", 2)
    assert app.cancel(first, reason="sur\udcffx") == 1
    assert app.cancel(second, reason="nul\x00here") == 1
    errors = [app.run(lambda s, j=j: s.job_get(job_id=j)).last_error for j in (first, second)]
    assert errors == ["sur\\udcffx", "nul\\x00here"]
    app.close()


@pytest.mark.parametrize("text", ["\u0663", "1_0", "+3", " ", "3.0"])
def test_the_cancel_command_reads_ids_in_ascii_digits_only(tmp_path: Path, text: str) -> None:
    """int() reads 1_0 as 10 and an Arabic-Indic three as 3: a job nobody typed would
    be cancelled. Refused as a usage error; nothing cancelled."""
    path = tmp_path / "c.db"
    app = _app(path)
    ids = [app.enqueue("t", i) for i in range(12)]
    app.close()
    result = CliRunner().invoke(main, ["cancel", text, "--url", f"sqlite:///{path}"])
    assert result.exit_code == 2, result.output
    assert "is not a whole number in digits 0-9" in result.output
    app = _app(path)
    assert set(_states(app, ids)) == {JobState.QUEUED}
    app.close()


@pytest.mark.parametrize(
    ("reason", "message"),
    [("x" * 2001, "reason is 2001 characters, over the limit of 2000"), ("  ", "non-empty")],
)
def test_the_cancel_command_checks_the_reason_as_the_api_does(
    tmp_path: Path, reason: str, message: str
) -> None:
    """The command cancelled with a reason of 3,000 characters, stored cut, where
    ``app.cancel`` refuses one over 2,000: it now refuses it too, as a usage error,
    and nothing is cancelled."""
    path = tmp_path / "c.db"
    app = _app(path)
    ids = [app.enqueue("t", i) for i in range(2)]
    app.close()
    result = CliRunner().invoke(
        main, ["cancel", str(ids[0]), "--url", f"sqlite:///{path}", "--reason", reason]
    )
    assert result.exit_code == 2, result.output
    assert message in result.output
    app = _app(path)
    assert set(_states(app, ids)) == {JobState.QUEUED}
    app.close()


def test_a_store_lost_during_a_cancel_is_said_to_leave_it_unsure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store applied the cancel and its answer was lost (a connection cut just
    then): the command said only "cannot reach" the store, as if nothing had been done.
    It now adds that the change may have been made, and where to look; exit status 1."""
    from tokenline import StoreUnavailableError
    from tokenline.stores.sqlite.store import SQLiteStore

    path = tmp_path / "c.db"
    app = _app(path)
    (jid,) = [app.enqueue("t", 1)]
    app.close()
    applied = SQLiteStore.jobs_cancel

    async def lost_answer(self: SQLiteStore, **kwargs: object) -> int:
        await applied(self, **kwargs)  # type: ignore[arg-type]
        raise StoreUnavailableError("cannot reach the store (connection reset)")

    monkeypatch.setattr(SQLiteStore, "jobs_cancel", lost_answer)
    result = CliRunner().invoke(main, ["cancel", str(jid), "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert "error: cannot reach the store (connection reset)" in result.output
    assert "may have made the change before its answer was lost" in result.output
    assert "tokenline job ID" in result.output
    monkeypatch.undo()
    app = _app(path)
    assert _states(app, [jid]) == [JobState.CANCELLED]
    app.close()


def test_the_drivers_own_warnings_stay_off_the_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During an outage psycopg's pool printed its warnings ("discarding closed
    connection …") as raw lines before the command's one-line error. Where logging is
    not configured, they are no longer printed; the error still is."""
    import logging

    from tokenline import StoreUnavailableError
    from tokenline.stores.sqlite.store import SQLiteStore

    path = tmp_path / "c.db"
    app = _app(path)
    (jid,) = [app.enqueue("t", 1)]
    app.close()

    async def noisy(self: SQLiteStore, **kwargs: object) -> int:
        logging.getLogger("psycopg.pool").warning("discarding closed connection: BAD")
        logging.getLogger("redis.connection").warning("connection reset by peer")
        raise StoreUnavailableError("cannot reach the store")

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as outside pytest
    for name in ("psycopg", "redis"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
    monkeypatch.setattr(SQLiteStore, "jobs_cancel", noisy)
    result = CliRunner().invoke(main, ["cancel", str(jid), "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert "error: cannot reach the store" in result.output
    assert "discarding closed connection" not in result.output
    assert "connection reset by peer" not in result.output


def _claimed(path: Path, *, ttl: float) -> int:
    """The id of a job on the SQLite store at ``path``, claimed for ``ttl`` seconds by a
    worker that never comes back."""
    app = _app(path)
    jid = app.enqueue("t", 1)

    async def claim(store: object) -> None:
        await store.jobs_claim(owner="gone", queues=["default"], limit=1, ttl=ttl)  # type: ignore[attr-defined]

    app.run(claim)
    app.close()
    return jid


def test_a_running_job_whose_lease_expired_is_said_to_wait_for_the_rescue(
    tmp_path: Path,
) -> None:
    """A running job whose worker was killed was said to be left to finish its attempt,
    which will never finish. The command now says its lease expired, how long ago by
    the store's clock, and that the rescue queues it again; the job is left running."""
    path = tmp_path / "c.db"
    jid = _claimed(path, ttl=0.2)
    time.sleep(0.5)
    result = CliRunner().invoke(main, ["cancel", str(jid), "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    said = result.output.split(f"not cancelled: job {jid}: ")[1]
    assert re.match(r"it is running, but its lease expired \d+\.\ds ago by the store's clock", said)
    assert "the maintenance leader's rescue queues it again" in said
    assert "its attempt finishes as it would" not in said
    app = _app(path)
    assert _states(app, [jid]) == [JobState.RUNNING]
    app.close()


def test_a_running_job_whose_lease_is_held_is_left_to_finish(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    jid = _claimed(path, ttl=600)
    result = CliRunner().invoke(main, ["cancel", str(jid), "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert f"not cancelled: job {jid}: it is running: its attempt finishes" in result.output


@pytest.mark.parametrize("command", [["pause", "billing"], ["cancel", "ID"]])
def test_a_write_lock_never_taken_is_said_to_have_changed_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """Another connection held the SQLite write lock (a handler inside
    ctx.transaction()) for the whole store timeout: the command failed saying that the
    store may have made the change before its answer was lost, and nothing had been
    written. It now says nothing was changed, and points at `tokenline status`."""
    import sqlite3

    path = tmp_path / "c.db"
    app = _app(path)
    jid = app.enqueue("t", 1)
    app.close()
    monkeypatch.setenv("TOKENLINE_STORE_TIMEOUT", "0.5")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        args = [str(jid) if a == "ID" else a for a in command]
        result = CliRunner().invoke(main, [*args, "--url", f"sqlite:///{path}"])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert result.exit_code == 1, result.output
    assert "is busy: database is locked" in result.output
    assert "may have made the change" not in result.output
    assert "did not take this change at all, so nothing was changed" in result.output
    assert "`tokenline status` says what keeps it from writing" in result.output
    app = _app(path)
    assert _states(app, [jid]) == [JobState.QUEUED]
    assert not [q for q in app.run(lambda s: s.queues_stats()) if q.paused]
    app.close()


def test_the_ids_cancelled_before_the_store_failed_are_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that fails part way through a cancel of several ids: the ones already
    cancelled are said before the error, which is about the next one only."""
    from tokenline import StoreUnavailableError
    from tokenline.stores.sqlite.store import SQLiteStore

    path = tmp_path / "c.db"
    app = _app(path)
    first, second = app.enqueue("t", 1), app.enqueue("t", 2)
    app.close()
    applied = SQLiteStore.jobs_cancel

    async def fail_second(self: SQLiteStore, *, job_ids: list[int], reason: str) -> int:
        if job_ids == [second]:
            raise StoreUnavailableError("cannot reach the store (connection reset)")
        return await applied(self, job_ids=job_ids, reason=reason)

    monkeypatch.setattr(SQLiteStore, "jobs_cancel", fail_second)
    url = f"sqlite:///{path}"
    result = CliRunner().invoke(main, ["cancel", str(first), str(second), "--url", url])
    assert result.exit_code == 1, result.output
    said = result.output.index(f"cancelled 1 job: {first}")
    assert said < result.output.index("error: cannot reach the store")
