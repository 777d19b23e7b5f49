"""``tokenline drill`` on a ``sqlite:`` URL with a query string or a fragment: refused
by the preflight, naming the URL as the user typed it, before the banner prints or any
file or directory is made (each scenario's file is named after the URL, and the refusal
used to come only once the first scenario started, naming that scenario's file)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline.cli import main
from tokenline.drill.runner import Drill, DrillError


@pytest.mark.parametrize(
    ("given", "said"),
    [("d.db?foo=1", "gives parameter 'foo'"), ("d.db#part", "has '#part'")],
)
def test_the_url_as_typed_is_refused_before_anything_starts(
    given: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    url = f"sqlite:///{given}"
    result = CliRunner().invoke(
        main, ["drill", "--url", url, "--jobs", "10"], terminal_width=250, catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:"), text  # no banner before it
    assert f"{url!r} {said}" in text
    assert "kill9" not in text
    assert list(work.iterdir()) == []
    assert list(scratch.iterdir()) == []


def test_the_preflight_refuses_sqlite_url_options(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}?foo=1"
    with pytest.raises(DrillError, match="take no query parameters") as caught:
        Drill(url=url, jobs=10).preflight()
    assert repr(url) in str(caught.value)
    assert list(tmp_path.iterdir()) == []
