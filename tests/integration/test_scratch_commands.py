"""``demo``, ``drill`` and ``bench`` (and the benchmark scripts) run on a store of their
own: only the one ``--url`` names, never ``TOKENLINE_URL``; a fresh SQLite file in a
temporary directory by default, a fresh schema on PostgreSQL; and they leave nothing
behind unless told to keep it, and then say where it is."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tokenline.cli import main

# The module, not the command of the same name that tokenline.cli exports.
demo_cli = importlib.import_module("tokenline.cli.demo")


@dataclass
class Sandbox:
    """A temporary directory, a working directory and a "production" SQLite file named
    by ``TOKENLINE_URL``: a command must leave all three as they were."""

    tmp: Path
    cwd: Path
    prod: Path

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "TMPDIR": str(self.tmp),
            "TOKENLINE_URL": f"sqlite:///{self.prod}",
            "COLUMNS": "200",
        }
        return subprocess.run(
            argv, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=timeout
        )

    def tokenline(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "tokenline", *args)

    def left(self) -> list[str]:
        """Everything now in the three places (all empty at the start)."""
        return sorted(str(p) for d in (self.tmp, self.cwd, self.prod.parent) for p in d.iterdir())


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    dirs = [tmp_path / name for name in ("tmp", "cwd", "prod")]
    for d in dirs:
        d.mkdir()
    return Sandbox(dirs[0], dirs[1], dirs[2] / "prod.db")


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


@pytest.mark.acceptance
def test_demo_ignores_tokenline_url_and_leaves_nothing(sandbox: Sandbox) -> None:
    """A passing demo on the default store: its directory, with the workers' logs, is
    removed; nothing appears in the working directory or beside TOKENLINE_URL's file."""
    result = sandbox.tokenline("demo", "--jobs", "40", "--workers", "2")
    assert result.returncode == 0, _explain(result)
    assert "every invoice written exactly once" in result.stdout
    assert str(sandbox.prod) not in result.stdout
    assert "left behind" not in result.stdout
    assert sandbox.left() == []


@pytest.mark.parametrize("how", ["raises", "invariant broken"])
def test_a_failed_demo_keeps_its_logs_and_says_where(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed demo keeps the workers' logs and prints the directory; it used to leave
    every run's logs in the temporary directory without a word."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def failing_run(
        backend: demo_cli.ScratchStore, jobs: int, workers: int, show_progress: bool
    ) -> demo_cli.DemoResult:
        (backend.work_dir / "worker-0.log").write_text("a worker's last words\n")
        if how == "raises":
            raise click.ClickException("the workers did not start")
        return demo_cli.DemoResult(jobs, jobs, 0, jobs, 0, 0, 0, 0, jobs + 1, 1, 0.0, 1.0)

    monkeypatch.setattr(demo_cli, "_run", failing_run)
    result = CliRunner().invoke(main, ["demo", "--jobs", "10", "--workers", "2"])
    assert result.exit_code == 1, result.output
    found = re.search(
        r"left behind: (\S+) \(kept: the run failed, its logs are there\)", result.output
    )
    assert found, result.output
    kept = Path(found.group(1))
    assert (kept / "worker-0.log").read_text() == "a worker's last words\n"
    assert list(tmp_path.iterdir()) == [kept]
