"""`enqueue` as an operator meets it: bad input is a usage error (exit status 2)
whatever the option, while a store that fails is exit status 1."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tokenline import App
from tokenline.cli import main


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
