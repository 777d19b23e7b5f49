"""What the CLI reads from its user before it builds anything: JSON arguments, app
specs, queue names, URLs and durations are refused in one line naming what is wrong."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tokenline import App
from tokenline.cli import main


def cli(*args: str) -> tuple[int, str]:
    """Run the CLI (stdout and stderr together); an exception it lets out fails the
    test as the traceback a user would see."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def app_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """An importable module with an app of one task, t, on a SQLite file: (--app, --url);
    the app is also holder.app, and number is 3."""
    name = f"cli_input_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import types\n\nfrom tokenline import App\n\napp = App()\n"
        "app.task(name='t')(lambda ctx, *a, **k: None)\n"
        "holder = types.SimpleNamespace(app=app)\nnumber = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    return f"{name}:app", f"sqlite:///{tmp_path / 'cli.db'}"


def stored(url: str) -> list[Any]:
    with App(url) as app:
        return [j.id for j in app.run(lambda s: s.jobs_list(limit=10))]


# -- JSON arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("digits", [4001, 5000], ids=["under Python's limit", "over it"])
@pytest.mark.parametrize("where", ["args", "kwargs"])
def test_enqueue_refuses_an_integer_of_too_many_digits_naming_the_argument(
    app_spec: tuple[str, str], digits: int, where: str
) -> None:
    """An integer past Python's 4300-digit limit on converting text ended in a
    ValueError traceback; now either length is refused as the App refuses it, naming
    the argument, with nothing stored: bad input, exit status 2."""
    spec, url = app_spec
    number = "-" + "9" * digits
    given = ["[1]", "--kwargs", f'{{"n": {number}}}'] if where == "kwargs" else [f"[{number}]"]
    code, out = cli("enqueue", "--app", spec, "--url", url, "t", *given)
    assert code == 2, out
    assert f"error: {where} has an integer of more than 4000 digits (MAX_INT_DIGITS)" in out
    assert stored(url) == []


def test_enqueue_takes_an_integer_of_the_most_digits_allowed(app_spec: tuple[str, str]) -> None:
    spec, url = app_spec
    code, out = cli("enqueue", "--app", spec, "--url", url, "t", f"[{'9' * 4000}]")
    assert code == 0, out
    assert stored(url) == [1]


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["[1,"], "error: args is not valid JSON: Expecting value"),
        (["[1]", "--kwargs", '{"a": '], "error: kwargs is not valid JSON: Expecting value"),
        (["[1]", "--kwargs", "[" * 10_000], "error: kwargs is nested too deeply to decode"),
    ],
)
def test_enqueue_names_which_argument_is_not_json(
    app_spec: tuple[str, str], given: list[str], said: str
) -> None:
    """A decoding error said "arguments" (and "args" for --kwargs nested too deep).
    It is bad input: exit status 2."""
    spec, url = app_spec
    code, out = cli("enqueue", "--app", spec, "--url", url, "t", *given)
    assert code == 2, out
    assert said in out


@pytest.mark.parametrize("kwargs", ["null", "[1]", '"x"', "3", ""])
def test_enqueue_refuses_kwargs_that_are_not_an_object(
    app_spec: tuple[str, str], kwargs: str
) -> None:
    """ARGS `null` was refused and `--kwargs null` taken as no keyword arguments (an
    empty --kwargs was not even read). --kwargs that is not a JSON object is now
    refused as ARGS that is not an array is: bad input, exit status 2, nothing stored."""
    spec, url = app_spec
    code, out = cli("enqueue", "--app", spec, "--url", url, "t", "--kwargs", kwargs)
    assert code == 2, out
    said = "kwargs is not valid JSON" if not kwargs else "--kwargs must be a JSON object"
    assert said in out
    if kwargs:
        assert f"got {kwargs!r}" in out
    assert cli("enqueue", "--app", spec, "--url", url, "t", "--kwargs", "{}")[0] == 0


@pytest.mark.parametrize("worker_id", ["", "a\x1bb"])
def test_drain_refuses_a_worker_id_that_none_can_have(
    app_spec: tuple[str, str], worker_id: str
) -> None:
    """`tokenline drain ""` asked the store, and exited 1 with "no worker with id ''":
    an id no worker can have is bad input, refused naming the argument, exit status 2,
    before the store is opened."""
    _, url = app_spec
    code, out = cli("drain", worker_id, "--url", url)
    assert code == 2, out
    assert "Invalid value for 'WORKER_ID'" in out
    assert "no worker with id" not in out
    assert not Path(url.removeprefix("sqlite:///")).exists()


# -- --app ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("attribute", "said"),
    [
        ("nosuch", "module '{m}' has no attribute 'nosuch'"),
        ("app.nosuch", "{m}:app (App) has no attribute 'nosuch'"),
        ("holder.app.nosuch", "{m}:holder.app (App) has no attribute 'nosuch'"),
        ("holder..app", "the attribute path 'holder..app' has an empty name"),
        ("number", "is not a tokenline.App (got int)"),
    ],
)
def test_app_names_the_attribute_that_is_missing(
    app_spec: tuple[str, str], attribute: str, said: str
) -> None:
    """A missing attribute was reported as "not a tokenline.App (got NoneType)"."""
    spec, url = app_spec
    module = spec.partition(":")[0]
    code, out = cli("queues", "--app", f"{module}:{attribute}", "--url", url)
    assert code == 2, out
    assert said.format(m=module) in out
    assert "NoneType" not in out


def test_app_may_be_a_dotted_attribute(app_spec: tuple[str, str]) -> None:
    spec, url = app_spec
    module = spec.partition(":")[0]
    code, out = cli("enqueue", "--app", f"{module}:holder.app", "--url", url, "t", "[1]")
    assert code == 0, out
    assert stored(url) == [1]


# -- memory:// --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [["enqueue", "t", "[1]"], ["pause", "default"], ["resume", "default"], ["migrate"]],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("url", ["memory://", "MEMORY://x"])
def test_a_command_that_stores_refuses_the_memory_store(
    app_spec: tuple[str, str], command: list[str], url: str
) -> None:
    """The job, pause or schema went with the process while the command said it was
    done (an id printed, exit status 0)."""
    spec, _ = app_spec
    code, out = cli(command[0], "--app", spec, "--url", url, *command[1:])
    assert code == 2, out
    assert f"{command[0]} on {url}: the memory store lives only inside one process" in out


# -- queue names ------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["jobs"], ["dlq", "list"]], ids=" ".join)
@pytest.mark.parametrize("name", ["bad queue", "", "q\n"])
def test_a_queue_filter_is_checked_like_a_queue_name(
    app_spec: tuple[str, str], command: list[str], name: str
) -> None:
    """jobs --queue and dlq list --queue took any text and listed nothing, exit status
    0, while pause refused the same name."""
    _, url = app_spec
    assert cli("migrate", "--url", url)[0] == 0
    code, out = cli(*command, "--url", url, "--queue", name)
    assert code == 2, out
    assert f"Invalid value for '--queue': invalid queue name {name!r}" in out
    code, out = cli(*command, "--url", url, "--queue", "default")
    assert code == 0, out


@pytest.mark.parametrize("queues", ["a,,b", "a,", ",a", " , "])
def test_worker_refuses_an_empty_name_in_its_queues(
    app_spec: tuple[str, str], queues: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty name between commas was dropped: the worker ran without it."""
    import tokenline.cli

    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"a worker started on --queues {queues!r}")

    monkeypatch.setattr(tokenline.cli, "run_worker", started)
    spec, url = app_spec
    code, out = cli("worker", "--app", spec, "--url", url, "--queues", queues)
    assert code == 2, out
    assert f"invalid setting 'queues': {queues!r} has an empty queue name" in out


# -- store URLs -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("sqlite://relative.db", "not a SQLite URL: 'sqlite://relative.db'"),
        ("sqlite:relative.db", "not a SQLite URL: 'sqlite:relative.db'"),
        ("sqlite:///", "'sqlite:///' names no file"),
        ("sqlite:////", "'sqlite:////' names a directory, not a file"),
        ("sqlite:///.", "'sqlite:///.' names a directory, not a file"),
        ("sqlite:///sub/..", "'sqlite:///sub/..' names a directory, not a file"),
        (f"sqlite:///{'n' * 250}.db", f"the file name in 'sqlite:///{'n' * 250}.db' is 253"),
        ("foo://x", "unsupported store URL 'foo://x'"),  # as it was: the same kind
    ],
)
@pytest.mark.parametrize("command", [["queues"], ["status"], ["pause", "default"]], ids=" ".join)
def test_a_malformed_sqlite_url_is_a_bad_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], url: str, said: str
) -> None:
    """A SQLite URL that names no file failed as the store opened, exit status 1 (or,
    naming a directory or a name too long for the store's files beside it, with a
    Python traceback), while every other malformed URL is a bad setting, exit
    status 2."""
    monkeypatch.chdir(tmp_path)
    code, out = cli(*command, "--url", url)
    assert code == 2, out
    assert f"error: invalid setting 'url': {said}" in out
    assert list(tmp_path.iterdir()) == []


# -- audit --since ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("since", "said"),
    [
        ("99999999999d", "'99999999999d' reaches back before the epoch (1970-01-01 UTC)"),
        ("9" * 400 + "d", f"'{'9' * 400}d' reaches back before the epoch"),
        ("-5", "'-5' is before the epoch"),
        ("1969-12-31", "'1969-12-31' is before the epoch"),
        ("", "'' is empty: give a duration (30m, 2h, 7d), an ISO time or epoch seconds"),
        (" ", "' ' is empty"),
        ("nan", "'nan' is not a time"),
        ("inf", "'inf' is not a time"),
    ],
)
def test_audit_since_is_a_time_since_the_epoch(
    app_spec: tuple[str, str], since: str, said: str
) -> None:
    """A duration reaching before 1970 was taken and printed as "since -8.64e+15
    (epoch seconds)", and an empty --since read as no filter at all."""
    _, url = app_spec
    assert cli("migrate", "--url", url)[0] == 0
    code, out = cli("audit", "duplicates", "--url", url, "--since", since)
    assert code == 2, out
    assert f"Invalid value for --since: {said}" in out


@pytest.mark.parametrize("since", ["1h", "0", "1970-01-01", "2026-01-01T00:00:00+02:00"])
def test_audit_since_takes_each_form(app_spec: tuple[str, str], since: str) -> None:
    _, url = app_spec
    assert cli("migrate", "--url", url)[0] == 0
    code, out = cli("audit", "duplicates", "--url", url, "--since", since)
    assert code == 0, out
    assert "0 keys since " in out


@pytest.mark.parametrize(
    ("prefix", "said"),
    [
        ("", "invalid Redis key prefix '': it is empty (prefix= with no name)"),
        ("a%20b", "invalid Redis key prefix 'a b': it may hold no braces or whitespace"),
    ],
)
def test_a_bad_redis_key_prefix_says_what_is_wrong(prefix: str, said: str) -> None:
    """An empty prefix was refused as having "no braces or spaces", which it has not."""
    broker = f"redis://127.0.0.1:6379/0?prefix={prefix}"
    code, out = cli("queues", "--broker", broker, "--ledger", "postgresql://127.0.0.1/x")
    assert code == 2, out
    assert said in out


@pytest.mark.parametrize(
    ("given", "missing", "needs"),
    [
        (["--broker"], "--ledger (TOKENLINE_LEDGER)", "the ledger's postgresql://… URL"),
        (["--ledger"], "--broker (TOKENLINE_BROKER)", "the broker's redis://host:port/db URL"),
        (
            ["--leases", "--ledger"],
            "--broker (TOKENLINE_BROKER)",
            "the broker's redis://host:port/db URL",
        ),
    ],
)
def test_a_split_role_left_out_is_said_to_be_missing(
    given: list[str], missing: str, needs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--broker without --ledger was refused as "Invalid value for --ledger: the split
    topology needs postgresql://… here, got ''", as if an empty URL had been given. A
    role left out is now said to be missing, with what it needs; exit status 2."""
    for role in ("URL", "BROKER", "LEASES", "LEDGER"):
        monkeypatch.delenv(f"TOKENLINE_{role}", raising=False)
    urls = {
        "--broker": "redis://127.0.0.1:6379/7?prefix=wtc",
        "--leases": "redis://127.0.0.1:6379/7?prefix=wtc",
        "--ledger": "postgresql://127.0.0.1/x?schema=wtc_x",
    }
    code, out = cli("queues", *(a for option in given for a in (option, urls[option])))
    assert code == 2, out
    flat = " ".join(out.split())
    assert f"{missing} is missing: with {' and '.join(given)}, the split topology" in flat
    assert f"also needs {needs}" in flat
    assert "got ''" not in flat


def test_no_help_text_shows_a_range_without_bounds() -> None:
    """Every command's --help: an integer option without bounds showed "x<=None"
    (`worker --concurrency`, `--claim-batch`, `drill --seed`); the worker's options
    show the limits they enforce."""
    import click

    from tokenline.cli import main

    def commands(group: click.Group, path: list[str]) -> list[list[str]]:
        found = []
        for name, command in group.commands.items():
            found.append([*path, name])
            if isinstance(command, click.Group):
                found += commands(command, [*path, name])
        return found

    every = commands(main, [])
    assert ["worker"] in every
    assert ["dlq", "list"] in every
    for path in every:
        result = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        assert "None]" not in result.output, path
        assert "<=None" not in result.output, path
    worker_help = CliRunner().invoke(main, ["worker", "--help"], terminal_width=200).output
    assert "1<=x<=10000" in worker_help
    assert "1<=x<=1000]" in worker_help
