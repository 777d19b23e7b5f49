"""The drill's slow_dependency scenario: a dependency that times out for a while, then
heals. With breakers on, every invariant holds, no job is dead-lettered and no job held
back spends an attempt; with them off, the same jobs call the dependency more often
while it fails. Also the figures' definitions and the checks, on hand-made data."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tokenline.cli.drill import dependency_table, results_table
from tokenline.drill.checker import Attempt, Report, Snapshot, check
from tokenline.drill.dependency import DependencyFigures, back_to_full
from tokenline.drill.runner import ScenarioResult
from tokenline.drill.scenarios import DRILL_SCENARIOS

JOBS = 100


def _drill(url: str, breakers: str) -> dict[str, Any]:
    """One ``tokenline drill --scenario slow_dependency --json`` run, its one row."""
    result = subprocess.run(
        [sys.executable, "-m", "tokenline", "drill", "--scenario", "slow_dependency",
         "--jobs", str(JOBS), "--seed", "1", "--breakers", breakers, "--json", "--url", url],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    (row,) = json.loads(result.stdout)
    assert isinstance(row, dict)
    return row


def _stores() -> list[object]:
    return ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.acceptance
@pytest.mark.parametrize("store", _stores())
def test_breakers_keep_the_invariants_and_spare_the_failing_dependency(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Breakers on: the run passes (no job lost, dead-lettered or charged an attempt
    for being held back) and the dependency gets fewer calls per minute during the
    fault than with breakers off, which still loses no job and applies no effect twice."""
    url = (
        request.getfixturevalue("postgres_server")
        if store == "postgres"
        else f"sqlite:///{tmp_path / 'dep.db'}"
    )
    on = _drill(url, "on")
    off = _drill(url, "off")
    assert on["ok"] is True, on
    assert on["dead_letters_behind_breaker"] == on["attempts_spent_by_deferrals"] == 0, on
    dep_on, dep_off = on["dependency"], off["dependency"]
    assert dep_on["breakers"] is True
    assert dep_off["breakers"] is False
    assert dep_on["dead_lettered"] == 0, on
    assert dep_on["fault_seconds"] > 0
    assert dep_off["fault_seconds"] > 0
    assert off["lost"] == off["duplicate_effects"] == off["stale_writes_accepted"] == 0, off
    assert off["pending"] == 0, off
    assert dep_on["calls_per_minute_during_fault"] < dep_off["calls_per_minute_during_fault"], (
        dep_on,
        dep_off,
    )
    print(f"\n{store}: breakers on {dep_on}\n{store}: breakers off {dep_off}")


def test_slow_dependency_applies_to_both_stores_and_only_its_jobs_call() -> None:
    """The scenario runs on SQLite and PostgreSQL, and it is the only one whose jobs
    call the dependency: the other scenarios' workers keep no breaker."""
    scenario = DRILL_SCENARIOS["slow_dependency"]
    assert scenario.applies_to("sqlite")
    assert scenario.applies_to("postgresql")
    callers = [s.name for s in DRILL_SCENARIOS.values() if s.calls_dependency]
    assert callers == ["slow_dependency"]


def test_full_throughput_is_the_first_full_second_after_the_heal() -> None:
    """Ten jobs a second before a fault from 10 to 20 s; after the heal a slow second,
    then ten a second from 22 s: full throughput is back 2 s after the heal."""
    before = [9.0 + i / 10 for i in range(10)]
    slow = [20.5, 21.5]
    full = [22.0 + i / 10 for i in range(30)]
    assert back_to_full([*before, *slow, *full], 10.0, 20.0) == pytest.approx(2.0)


def test_too_few_jobs_left_for_a_full_second_means_until_the_last() -> None:
    """With fewer jobs left than a second's worth, the backlog drained is the end."""
    before = [9.0 + i / 100 for i in range(100)]
    assert back_to_full([*before, 20.5, 20.6, 23.0], 10.0, 20.0) == pytest.approx(3.0)
    assert back_to_full(before, 10.0, 20.0) is None


def _snapshot(state: str, spent: int, outcomes: list[str]) -> Snapshot:
    attempts = [
        Attempt(1, token, 100.0 + token, 100.5 + token, outcome)
        for token, outcome in enumerate(outcomes, start=1)
    ]
    succeeded = state == "succeeded"
    return Snapshot(
        jobs={1: ("k:0", state, len(outcomes), None if succeeded else "timed out")},
        attempts=attempts,
        effects=[("k:0", 1, len(outcomes))] if succeeded else [],
        stale_refused=0,
        ledger_duplicates=0,
        spent={1: spent},
    )


@pytest.mark.parametrize("guarded", [True, False])
def test_behind_a_breaker_a_dead_letter_is_a_violation(guarded: bool) -> None:
    """A job dead-lettered behind its breaker fails the run; without one it is allowed."""
    snap = _snapshot("dead", 2, ["retry", "dead"])
    report = check(snap, keys=["k:0"], lease_ttl=2.0, rescue_interval=0.5, guarded=guarded)
    assert report.dead_letters == (1 if guarded else 0)
    assert report.ok is not guarded


def test_behind_a_breaker_a_job_held_back_keeps_its_attempt() -> None:
    """Three deferrals (releases) and one run: one attempt spent is right, two is an
    attempt charged for being held back."""
    outcomes = ["release", "release", "release", "succeeded"]
    good = check(_snapshot("succeeded", 1, outcomes), keys=["k:0"], lease_ttl=2.0,
                 rescue_interval=0.5, guarded=True)  # fmt: skip
    assert good.ok, good.violations
    bad = check(_snapshot("succeeded", 2, outcomes), keys=["k:0"], lease_ttl=2.0,
                rescue_interval=0.5, guarded=True)  # fmt: skip
    assert bad.spent_by_deferrals == 1
    assert not bad.ok


def test_the_report_shows_the_dependency_figures_and_what_failed() -> None:
    """The dependency's own table shows each run's figures, breakers on or off; a run
    with breakers on that dead-lettered a job says so in its verdict."""
    figures = DependencyFigures(True, 150, 5.0, 360.0, 30, 0, 1.5)
    on = ScenarioResult(
        "slow_dependency", "sqlite", Report(jobs=100, dead_letters=1, spent_by_deferrals=1),
        lease_ttl=2.0, elapsed=9.0, dependency=figures,
    )  # fmt: skip
    off = ScenarioResult(
        "slow_dependency", "sqlite", Report(jobs=100), lease_ttl=2.0, elapsed=9.0,
        dependency=DependencyFigures(False, 190, 5.0, 1100.0, 90, 2, None),
    )  # fmt: skip
    kill9 = ScenarioResult("kill9", "sqlite", Report(jobs=100), lease_ttl=2.0, elapsed=9.0)
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    console.print(results_table([on, off, kill9], title="drill"))
    table = dependency_table([on, off, kill9])
    assert table is not None
    console.print(table)
    text = out.getvalue()
    assert "(1 dead-lettered, 1 attempt spent held back)" in text
    assert "calls/min in fault" in text
    rows = [line for line in text.splitlines() if "slow_dependency" in line]
    assert "│ on " in rows[-2]
    assert "1.5s" in rows[-2]
    assert "│ off " in rows[-1]
    assert "1,100" in rows[-1]
    assert dependency_table([kill9]) is None
