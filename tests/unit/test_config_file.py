"""Config files: whatever their content, a file that cannot take effect as written is a
ConfigError naming the file, the table or setting, and why; never a traceback, never
silently ignored."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tokenline import ConfigError, Settings, WorkerSettings, load_settings
from tokenline.cli import main

WORKER = "tokenline.worker"


def _toml(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "c.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _refused(path: Path, cls: type[Any] = WorkerSettings, section: str = WORKER) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(cls, environ={}, file=path, section=section)
    assert str(path) in str(info.value)
    return info.value


# -- a file that cannot be read ---------------------------------------------------------------
def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 raised UnicodeDecodeError out of the worker command."""
    err = _refused(_toml(tmp_path, b"\xff\xfe"))
    assert err.setting == "config"
    assert "not UTF-8" in err.reason


def test_a_directory_is_a_config_error(tmp_path: Path) -> None:
    """A directory given as the file raised IsADirectoryError."""
    err = _refused(tmp_path)
    assert err.setting == "config"
    assert "is a directory" in err.reason


def test_a_file_that_may_not_be_read_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the process may not read (permissions) raised PermissionError."""
    path = _toml(tmp_path, "[tokenline]\n")
    real_open = os.open

    def refuse(name: Any, *args: Any, **kwargs: Any) -> int:
        if str(name) == str(path):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    err = _refused(path)
    assert err.setting == "config"
    assert "cannot be read: Permission denied" in err.reason


def test_a_device_is_refused_not_read_until_memory_runs_out() -> None:
    """`--config /dev/zero` read zeros until the process ran out of memory (a
    traceback under a memory limit). Anything but a regular file is refused."""
    err = _refused(Path("/dev/zero"))
    assert err.setting == "config"
    assert "not a regular file" in err.reason


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    """`--config` naming a FIFO held the command until something wrote to it."""
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    err = _refused(fifo)  # returns: the open does not wait for a writer
    assert "not a regular file" in err.reason


def test_a_file_too_large_for_settings_is_refused(tmp_path: Path) -> None:
    """A settings file is a few hundred bytes: past a megabyte it is not one."""
    path = _toml(tmp_path, "[tokenline]\n" + "# filler\n" * 200_000)
    err = _refused(path)
    assert "larger than 1,048,576 bytes" in err.reason


def test_toml_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    """The TOML reader recurses into nested arrays: RecursionError, not a setting error."""
    depth = sys.getrecursionlimit() * 2
    err = _refused(_toml(tmp_path, "x = " + "[" * depth + "]" * depth + "\n"))
    assert err.setting == "config"
    assert "not valid TOML" in err.reason


# -- a value where a table is due, a table where a value is ----------------------------------
@pytest.mark.parametrize(
    ("text", "setting", "got"),
    [
        ("[tokenline]\nworker = 5\n", WORKER, "got 5"),
        ('[tokenline]\nworker = "x"\n', WORKER, "got 'x'"),
        ("tokenline = [1]\n", "tokenline", "got [1]"),
        ("[[tokenline.worker]]\nconcurrency = 3\n", WORKER, "array of tables"),
        ("[[tokenline]]\nurl = 'x'\n", "tokenline", "array of tables"),
    ],
)
def test_a_value_where_a_table_is_due_names_the_table(
    tmp_path: Path, text: str, setting: str, got: str
) -> None:
    """`[tokenline]\\nworker = 5` ended in AttributeError: 'int' object has no attribute
    'items'; `[[tokenline.worker]]` likewise, from a list."""
    err = _refused(_toml(tmp_path, text))
    assert err.setting == setting
    assert f"must be a table [{setting}]" in err.reason
    assert got in err.reason


@pytest.mark.parametrize(
    "text",
    [
        "[tokenline.worker]\nconcurrency = {}\n",
        "[tokenline.worker]\nconcurrency = { value = 3 }\n",
        "[tokenline.worker.concurrency]\nvalue = 3\n",
    ],
)
def test_a_table_where_a_value_is_due_names_the_setting(tmp_path: Path, text: str) -> None:
    """A table given as a setting's value was dropped silently: the default ran instead."""
    err = _refused(_toml(tmp_path, text))
    assert err.setting == "concurrency"
    assert "must be a value, not a table" in err.reason


VALUES = [
    "-1", "0", "1.5", "nan", "inf", "-inf", '"x"', '""', "true", "[]", "[1]", "[[1]]",
    '["a", 1]', "[{ a = 1 }]", "{}", "{ a = 1 }", "1979-05-27", "1979-05-27T07:32:00Z",
    "07:32:00", "9223372036854775807", "-9223372036854775808", '"auto"', '["a", "a"]',
]  # fmt: skip


@pytest.mark.parametrize(("cls", "section"), [(WorkerSettings, WORKER), (Settings, "tokenline")])
def test_any_value_of_any_setting_builds_or_is_a_config_error(
    tmp_path: Path, cls: type[Any], section: str
) -> None:
    """Every TOML type, given to every setting, is accepted or refused as ConfigError."""
    for field in dataclasses.fields(cls):
        for value in VALUES:
            path = _toml(tmp_path, f"[{section}]\n{field.name} = {value}\n")
            with contextlib.suppress(ConfigError):
                load_settings(cls, environ={}, file=path, section=section)


# -- tables: the file's tokenline tables, and those that look meant to be ---------------------
@pytest.mark.parametrize(
    ("text", "not_read"),
    [
        ("[other]\nx = 1\n", []),
        ("", []),
        ("[worker]\nconcurrency = 0\n", ["[worker]"]),
        ("[tokenline_worker]\nconcurrency = 0\n", ["[tokenline_worker]"]),
        ("[Tokenline.worker]\nconcurrency = 0\n", ["[Tokenline]"]),
        ("[tool.tokenline.worker]\nconcurrency = 0\n", ["[tool.tokenline]"]),
        ("concurrency = 0\n[other]\nx = 1\n", ["concurrency (outside any table)"]),
    ],
)
def test_a_file_without_a_tokenline_table_is_an_error_naming_lookalikes(
    tmp_path: Path, text: str, not_read: list[str]
) -> None:
    """A file given explicitly that holds no [tokenline] table took no effect, silently:
    the worker ran with its defaults. It is an error saying so, naming the tables (and
    top-level settings) that look meant for tokenline."""
    err = _refused(_toml(tmp_path, text))
    assert err.setting == "config"
    assert "has no [tokenline] table" in err.reason
    assert "put the settings in [tokenline.worker]" in err.reason
    for name in not_read:
        assert name in err.reason
    if not not_read:
        assert "not read" not in err.reason


@pytest.mark.parametrize(
    ("text", "setting", "says"),
    [
        (
            "[tokenline.worker]\nconcurrency = 3\n[tokenline.worker.extra]\nconcurrency = 0\n",
            "tokenline.worker.extra",
            "unknown table",
        ),
        ("[tokenline.workers]\nconcurrency = 0\n", "tokenline.workers", "unknown table"),
        ("[tokenline]\nconcurrency = 0\n", "concurrency", "belongs in [tokenline.worker]"),
        ("[tokenline]\nsomething = 0\n", "something", "unknown setting in [tokenline]"),
        ("[tokenline.worker]\nconcurency = 3\n", "concurency", "did you mean 'concurrency'?"),
    ],
)
def test_an_unknown_table_or_key_under_tokenline_is_an_error(
    tmp_path: Path, text: str, setting: str, says: str
) -> None:
    """A sub-table of [tokenline.worker], an unknown table under [tokenline], and a key
    of [tokenline] the worker never reads were ignored: the worker ran with its defaults."""
    err = _refused(_toml(tmp_path, text))
    assert err.setting == setting
    assert says in err.reason


def test_a_worker_setting_in_the_app_table_is_refused_by_either_reader(tmp_path: Path) -> None:
    """Each tokenline table of the file is checked whichever one is being read."""
    path = _toml(tmp_path, "[tokenline]\nmax_attempts = 3\n[tokenline.worker]\nlease_tll = 1\n")
    assert _refused(path, Settings, "tokenline").setting == "lease_tll"


def test_other_tools_tables_are_left_alone(tmp_path: Path) -> None:
    """A shared file (a pyproject.toml) may hold other tools' tables, [worker] included."""
    path = _toml(
        tmp_path,
        "[tool.black]\nline-length = 100\n[worker]\nthreads = 4\n"
        "[tokenline]\nmax_attempts = 3\n[tokenline.worker]\nconcurrency = 3\n",
    )
    assert load_settings(WorkerSettings, environ={}, file=path, section=WORKER).concurrency == 3
    assert load_settings(Settings, environ={}, file=path).max_attempts == 3


def test_a_file_with_the_tokenline_table_but_not_the_section_gives_defaults(
    tmp_path: Path,
) -> None:
    """[tokenline] alone is a tokenline file with no worker settings: defaults."""
    path = _toml(tmp_path, "[tokenline]\nmax_attempts = 3\n")
    assert load_settings(WorkerSettings, environ={}, file=path, section=WORKER) == WorkerSettings()


def test_a_nested_section_needs_its_own_table(tmp_path: Path) -> None:
    """With section tool.tokenline (a pyproject.toml), [tool] of other tools is not enough."""
    path = _toml(tmp_path, "[tool.black]\nline-length = 100\n[tool.tokenlin]\nmax_attempts = 3\n")
    err = _refused(path, Settings, "tool.tokenline")
    assert "has no [tool.tokenline] table" in err.reason
    assert "[tool.tokenlin]" in err.reason


# -- the worker command -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"[tokenline]\nworker = 5\n", "invalid setting 'tokenline.worker': must be a table"),
        (b"\xff\xfe", "is not valid TOML: not UTF-8 text"),
        (b"[worker]\nconcurrency = 0\n", "has no [tokenline] table"),
        (b"[tokenline.worker.extra]\nconcurrency = 0\n", "'tokenline.worker.extra': unknown"),
    ],
)
def test_the_worker_command_reports_a_bad_file_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: bytes, says: str
) -> None:
    """A file the worker cannot use is one line naming it, exit status 2: no traceback."""
    module = f"config_file_app_{uuid.uuid4().hex[:8]}"
    store = f"sqlite:///{tmp_path / 'w.db'}"
    (tmp_path / f"{module}.py").write_text(f"import tokenline\napp = tokenline.App({store!r})\n")
    (tmp_path / "c.toml").write_bytes(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(main, ["worker", "--app", f"{module}:app", "--config", "c.toml"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert says in " ".join(result.output.split())
    assert "'c.toml'" in result.output


def test_app_settings_a_worker_config_would_silently_ignore_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[tokenline]`` in a worker's ``--config`` was checked, then not applied: the app
    ran with its own settings while the file said otherwise. A value the app does not
    run with is now refused, naming both values and where the app's come from."""
    module = f"config_file_app_{uuid.uuid4().hex[:8]}"
    store = f"sqlite:///{tmp_path / 'w.db'}"
    (tmp_path / f"{module}.py").write_text(f"import tokenline\napp = tokenline.App({store!r})\n")
    (tmp_path / "c.toml").write_text(
        "[tokenline]\nmax_attempts = 9\n\n[tokenline.worker]\nconcurrency = 2\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TOKENLINE_MAX_ATTEMPTS", raising=False)
    result = CliRunner().invoke(main, ["worker", "--app", f"{module}:app", "--config", "c.toml"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert (
        "[tokenline] in 'c.toml' is not in effect: max_attempts = 9 (the app runs with 5)" in said
    )
    assert "--config applies [tokenline.worker] only" in said


def test_app_settings_in_a_worker_config_that_are_in_effect_pass(tmp_path: Path) -> None:
    """The app loaded the same file, or an option or a variable set the key (they win
    over the file): nothing is ignored, nothing is refused."""
    from tokenline._config import not_in_effect

    path = tmp_path / "c.toml"
    path.write_text("[tokenline]\nmax_attempts = 9\nurl = 'sqlite:///a.db'\n")
    assert not_in_effect(path, load_settings(Settings, file=path, environ={})) == []
    applied = Settings(url="sqlite:///b.db", max_attempts=9)
    assert not_in_effect(path, applied, overridden={"url"}) == []
    assert not_in_effect(path, applied) == [
        "url = 'sqlite:///a.db' (the app runs with 'sqlite:///b.db')"
    ]
