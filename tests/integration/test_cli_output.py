"""What the CLI prints: messages read as prose, user data survives markup and narrow
terminals, --json for machines, and help that says what each command and option does."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from tokenline.cli import main
from tokenline.cli.drill import results_table
from tokenline.drill.checker import Report
from tokenline.drill.runner import ScenarioResult

#: Output as it goes to a pipe: no terminal, no width asked for.
PIPED: dict[str, str | None] = {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}


def cli(*args: str, env: Mapping[str, str | None] = PIPED) -> tuple[int, str]:
    """Run the CLI as a pipe would see it (stdout and stderr together)."""
    result = CliRunner().invoke(main, list(args), env=dict(env), catch_exceptions=False)
    return result.exit_code, result.output


def render(renderable: object, width: int = 200) -> str:
    """What ``renderable`` looks like on a plain terminal ``width`` columns wide."""
    out = Console(width=width, color_system=None, force_terminal=False)
    with out.capture() as captured:
        out.print(renderable)
    return captured.get()


def test_drill_results_count_one_job_in_the_singular() -> None:
    """The drill's table says "1 job" and "1 idle worker", not "1 jobs"."""
    report = Report(jobs=10, affected=1, recovery=2.0, idle_workers=1)
    result = ScenarioResult("kill9", "sqlite", report, lease_ttl=2.0, elapsed=3.0)
    out = render(results_table([result], title="drill"))
    assert "(1 job)" in out
    assert "(1 idle worker)" in out
    assert "1 jobs" not in out


# -- 3: user data is never read as markup ---------------------------------------------------
def test_a_config_error_keeps_its_square_brackets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown setting in a TOML file is reported with the table name as written:
    "in [tokenline.worker] of 'bad.toml'", not "in  of 'bad.toml'"."""
    module = f"cli_output_app_{uuid.uuid4().hex[:8]}"
    store = f"sqlite:///{tmp_path / 'w.db'}"
    (tmp_path / f"{module}.py").write_text(f"import tokenline\napp = tokenline.App({store!r})\n")
    (tmp_path / "bad.toml").write_text("[tokenline.worker]\nconcurency = 5\n")
    monkeypatch.chdir(tmp_path)
    code, out = cli("worker", "--app", f"{module}:app", "--config", "bad.toml")
    assert code == 1
    assert "unknown setting in [tokenline.worker] of 'bad.toml'" in " ".join(out.split())


def test_an_error_quoting_user_input_prints_it_as_written() -> None:
    """An error that quotes what the user typed shows it whole, markup-like text and
    all."""
    code, out = cli("enqueue", "--app", "any:app", "t", '{"note": "[bold]x[/]"}')
    assert code == 1
    assert """ARGS must be a JSON array, got '{"note": "[bold]x[/]"}'""" in out
