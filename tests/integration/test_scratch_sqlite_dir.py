"""``demo``, ``bench`` and ``drill`` on a ``--url`` SQLite file whose directory is not
there: refused before anything starts, in one line naming the directory, exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline import ConfigError
from tokenline.cli import main
from tokenline.drill._scratch import scratch_for


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "--overwrite"])
@pytest.mark.parametrize("command", ["demo", "bench", "drill"])
def test_a_sqlite_file_in_a_missing_directory_is_refused_in_one_line(
    command: str, overwrite: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """demo and bench ended in a sqlite3 "unable to open database file" traceback, exit
    status 1, after making their scratch directory; the drill already said which
    directory is missing. All three now say it alike and leave nothing behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    missing = tmp_path / "nodir"
    args = [command, "--url", f"sqlite:///{missing / 'x.db'}"]
    if overwrite:
        args.append("--overwrite")
    if command == "drill":
        args += ["--scenario", "kill9"]
    result = CliRunner().invoke(main, args, terminal_width=200, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"cannot create SQLite files in {str(missing)!r}: no such directory" in text
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    assert list(scratch.iterdir()) == []


def test_scratch_for_refuses_a_missing_directory_before_making_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal comes before the run's temporary directory is made: nothing is left."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    with pytest.raises(ConfigError, match="no such directory") as caught:
        scratch_for(f"sqlite:///{tmp_path / 'a' / 'b' / 'x.db'}", prefix="tokenline_demo")
    assert caught.value.setting == "url"
    assert list(scratch.iterdir()) == []
