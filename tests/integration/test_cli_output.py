"""What the CLI prints: messages read as prose, user data survives markup and narrow
terminals, --json for machines, and help that says what each command and option does."""

from __future__ import annotations

from rich.console import Console

from tokenline.cli.drill import results_table
from tokenline.drill.checker import Report
from tokenline.drill.runner import ScenarioResult


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
