"""`pause`, `resume` and `enqueue` as an operator meets them: a misspelt queue is
pointed out, and bad input to enqueue is a usage error (exit status 2) whatever
the option, while a store that fails is exit status 1."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tokenline import App
from tokenline._jobs import WorkerRecord
from tokenline.cli import main
from tokenline.stores import store_from_url


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def app_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """An app of two tasks, bill (queue billing) and mail (queue mail), on a SQLite file
    holding one job of bill and one of a task on the default queue: (--app, --url)."""
    name = f"queue_commands_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from tokenline import App\n\napp = App()\n"
        "app.task(name='bill', queue='billing')(lambda ctx, *a: None)\n"
        "app.task(name='mail', queue='mail')(lambda ctx, *a: None)\n"
    )
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    with App(url) as app:
        app.task(name="bill", queue="billing")(lambda ctx: None)
        app.task(name="other")(lambda ctx: None)
        app.enqueue("bill")
        app.enqueue("other")
    return f"{name}:app", url


def paused(url: str) -> set[str]:
    with App(url) as app:
        return {s.queue for s in app.run(lambda s: s.queues_stats()) if s.paused}


# -- pause ------------------------------------------------------------------------------
def test_pausing_a_queue_nothing_uses_warns_naming_the_queues(app_spec: tuple[str, str]) -> None:
    """`pause biling` said "paused biling", exit 0, like a pause that worked, while
    billing kept running. It is still done (a queue may be paused before its first
    job), with a warning naming the queues that are in use."""
    _, url = app_spec
    result = cli("pause", "--url", url, "biling")
    assert result.exit_code == 0, result.output
    assert result.stdout == "paused biling\n"
    assert result.stderr == (
        "warning: no job or worker uses queue 'biling' (queues: billing, default); "
        "paused all the same\n"
    )
    assert paused(url) == {"biling"}


def test_pausing_a_queue_in_use_says_nothing_more(app_spec: tuple[str, str]) -> None:
    spec, url = app_spec
    result = cli("pause", "--url", url, "billing")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "paused billing\n", "")
    # A queue only a task of --app names is expected: its first job is yet to come.
    result = cli("pause", "--app", spec, "--url", url, "mail")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
    assert paused(url) == {"billing", "mail"}


def test_pausing_a_queue_a_worker_consumes_says_nothing_more(app_spec: tuple[str, str]) -> None:
    _, url = app_spec

    async def register() -> None:
        store = store_from_url(url)
        await store.open()
        try:
            record = WorkerRecord("w1", "host", 1, ("reports",), 4, "ready", 0, 0.0, 0.0, 0.0)
            await store.worker_register(record=record, ttl=30)
        finally:
            await store.close()

    asyncio.run(register())
    result = cli("pause", "--url", url, "reports")
    assert (result.exit_code, result.stderr) == (0, "")


def test_pausing_on_an_empty_store_says_no_queue_is_in_use(tmp_path: Path) -> None:
    result = cli("pause", "--url", f"sqlite:///{tmp_path / 'new.db'}", "first")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: no job or worker uses queue 'first' (queues: none); paused all the same\n"
    )


def test_pausing_a_queue_already_paused_warns_and_changes_nothing(
    app_spec: tuple[str, str],
) -> None:
    """A second `pause` said "paused billing" again, where `resume` of a queue that
    was not paused warns: a script could not tell which command paused it. It now
    warns, and says nothing on stdout."""
    _, url = app_spec
    assert cli("pause", "--url", url, "billing").stdout == "paused billing\n"
    result = cli("pause", "--url", url, "billing")
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "",
        "warning: queue 'billing' was already paused; nothing changed\n",
    )
    assert paused(url) == {"billing"}


# -- resume -----------------------------------------------------------------------------
def test_resuming_a_queue_that_is_not_paused_warns_naming_the_paused_ones(
    app_spec: tuple[str, str],
) -> None:
    """`resume` of a queue that was not paused said "resumed", as if it had changed
    something: a misspelt name left the paused queue paused without a word. It now
    warns, and says nothing on stdout, which a script reads as what was done."""
    _, url = app_spec
    assert cli("pause", "--url", url, "billing").exit_code == 0
    result = cli("resume", "--url", url, "biling")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert result.stderr == (
        "warning: queue 'biling' was not paused (paused queues: billing); nothing changed\n"
    )
    assert paused(url) == {"billing"}
    result = cli("resume", "--url", url, "billing")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "resumed billing\n", "")
    assert paused(url) == set()
    result = cli("resume", "--url", url, "billing")
    assert (result.stdout, result.stderr) == (
        "",
        "warning: queue 'billing' was not paused (paused queues: none); nothing changed\n",
    )


# -- enqueue ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--priority", "99999999999"], "Invalid value for '--priority'"),
        (["--priority", "-99999999999"], "Invalid value for '--priority'"),
        (["--queue", "bad/queue"], "Invalid value for '--queue': invalid queue name"),
        (["--queue", ""], "Invalid value for '--queue': invalid queue name"),
        (["--key", ""], "Invalid value for '--key': idempotency_key must be a non-empty"),
        (["--delay", "nan"], "Invalid value for '--delay'"),
        (["--priority", "high"], "Invalid value for '--priority'"),
        # int() and float() read these as 3, 1000 and 3: nobody typed those numbers.
        (["--priority", "\u0663"], "'\u0663' is not a whole number in digits 0-9"),
        (["--delay", "1_000"], "'1_000' is not a number of seconds in digits 0-9"),
        (["--delay", "\u0663"], "'\u0663' is not a number of seconds in digits 0-9"),
        (["--priority", "1_0"], "'1_0' is not a whole number in digits 0-9"),
    ],
)
def test_a_bad_enqueue_option_is_a_usage_error(
    app_spec: tuple[str, str], given: list[str], said: str
) -> None:
    """--priority out of range, a bad --queue and an empty --key exited 1, a bad
    --delay 2: each is now refused by its option, exit status 2, nothing stored."""
    spec, url = app_spec
    result = cli("enqueue", "--app", spec, "--url", url, "bill", *given)
    assert result.exit_code == 2, result.output
    assert said in result.output
    with App(url) as app:
        assert len(app.run(lambda s: s.jobs_list(limit=10))) == 2


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["nosuch"], "error: unknown task 'nosuch' (registered: bill, mail)"),
        (["bill", "{}"], "error: ARGS must be a JSON array"),
        (["bill", "[1,"], "error: args is not valid JSON"),
        (["bill", "[1]", "--kwargs", '{"x": 1}'], "error: args of task 'bill' do not fit"),
    ],
)
def test_other_bad_enqueue_input_is_exit_status_2(
    app_spec: tuple[str, str], given: list[str], said: str
) -> None:
    """What the App refuses (an unknown task, arguments the task does not take) is bad
    input as well: one error line and exit status 2, as an option's."""
    spec, url = app_spec
    result = cli("enqueue", "--app", spec, "--url", url, *given)
    assert result.exit_code == 2, result.output
    assert said in result.stderr


def test_enqueue_to_a_store_that_fails_is_exit_status_1(app_spec: tuple[str, str]) -> None:
    """A store that cannot be reached is no usage error: exit status 1."""
    spec, _ = app_spec
    url = "postgresql://postgres@127.0.0.1:1/test"
    result = cli("enqueue", "--app", spec, "--url", url, "bill")
    assert result.exit_code == 1, result.output
    assert "error: cannot reach PostgreSQL" in result.stderr


def test_a_good_enqueue_still_prints_the_id(app_spec: tuple[str, str]) -> None:
    spec, url = app_spec
    given = ["--priority", "5", "--queue", "mail", "--key", "k:1", "--delay", "0"]
    result = cli("enqueue", "--app", spec, "--url", url, "bill", *given)
    assert result.exit_code == 0, result.output
    assert result.stdout == "3\n"


@pytest.mark.parametrize(
    "command",
    [["pause", "billing"], ["queues"], ["enqueue", "bill"], ["cancel", "1"], ["dlq", "retry", "1"]],
    ids=" ".join,
)
def test_an_empty_url_beside_an_app_is_refused_not_taken_as_the_apps(
    app_spec: tuple[str, str], tmp_path: Path, command: list[str]
) -> None:
    """``--app … --url ''`` acted on the app's own store (here a tokenline.db it
    created in the working directory), silently, where ``--url ''`` alone and an empty
    TOKENLINE_URL are refused. Refused the same way now, nothing created."""
    spec, _ = app_spec
    before = sorted(p.name for p in tmp_path.iterdir())
    result = cli(*command, "--app", spec, "--url", "")
    assert result.exit_code == 2, result.output
    assert "must be a non-empty store URL" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before
