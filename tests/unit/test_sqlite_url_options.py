"""A ``sqlite:`` URL takes no query string nor fragment: what follows a ``?`` or ``#``
became part of the file name (``q.db?foo=1``). It is a bad ``url`` setting naming what
was given, from the API and the command line alike, and nothing is created on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline import App, ConfigError
from tokenline.cli import main
from tokenline.drill._scratch import scratch_for
from tokenline.stores import store_from_url

CASES = [
    ("?foo=1", "SQLite URLs take no query parameters, but {url!r} gives parameter 'foo'"),
    ("?foo=1&bar&foo=2", "but {url!r} gives parameters 'foo', 'bar':"),
    ("?mode=ro", "gives parameter 'mode'"),
    ("?", "but {url!r} has the query string '?':"),
    ("#part", "SQLite URLs take no #fragment, but {url!r} has '#part'"),
    ("?a=1#b", "gives parameter 'a'"),
]


@pytest.mark.parametrize(("tail", "said"), CASES)
def test_the_store_refuses_a_sqlite_url_with_options(tmp_path: Path, tail: str, said: str) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}{tail}"
    with pytest.raises(ConfigError) as caught:
        store_from_url(url)
    assert caught.value.setting == "url"
    assert said.format(url=url) in caught.value.reason
    assert list(tmp_path.iterdir()) == []


def test_an_app_on_a_sqlite_url_with_a_query_creates_nothing(tmp_path: Path) -> None:
    """App(url="sqlite:///q.db?foo=1").enqueue made files q.db?foo=1 and q.db?foo=1-coord."""
    app = App(url=f"sqlite:///{tmp_path / 'q.db'}?foo=1")
    app.task(name="t")(lambda ctx: None)
    try:
        with pytest.raises(ConfigError, match="gives parameter 'foo'"):
            app.enqueue("t")
    finally:
        app.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("tail", "said"), CASES[:1] + CASES[4:5])
@pytest.mark.parametrize("command", [["status"], ["queues"], ["migrate"], ["pause", "default"]])
def test_the_cli_refuses_a_sqlite_url_with_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], tail: str, said: str
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'q.db'}{tail}"
    result = CliRunner().invoke(main, [*command, "--url", url], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"error: invalid setting 'url': {said.format(url=url)}" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_the_scratch_commands_refuse_a_sqlite_url_with_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    url = f"sqlite:///{tmp_path / 'q.db'}?foo=1"
    result = CliRunner().invoke(
        main, [command, "--url", url], terminal_width=200, catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    assert "gives parameter 'foo'" in " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    assert list(scratch.iterdir()) == []
    with pytest.raises(ConfigError, match="gives parameter 'foo'"):
        scratch_for(url)
