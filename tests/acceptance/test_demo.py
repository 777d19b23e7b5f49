"""Acceptance: the demo, the project's main job, end to end on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenline.cli.demo import backend_for, run_demo

pytestmark = pytest.mark.acceptance


def test_demo_on_sqlite_writes_every_invoice_exactly_once(tmp_path: Path) -> None:
    """2,000 invoices, 4 workers, one SIGKILLed and one SIGSTOPped: all succeed, the
    SIGKILLed worker's jobs are rescued, and no invoice is written twice."""
    result = run_demo(
        backend_for(f"sqlite:///{tmp_path / 'demo.db'}"), 2000, 4, show_progress=False
    )
    assert (result.succeeded, result.dead, result.invoices, result.duplicates) == (
        2000,
        0,
        2000,
        0,
    )
    assert result.rescues >= 1
    assert result.fencings >= 1
    assert result.ok


def test_postgres_four_workers_kill_and_stop_effects_exactly_once(
    postgres_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 jobs on PostgreSQL, 4 worker processes, one SIGKILLed and one SIGSTOPped past
    its lease: every job succeeds, every business row is written exactly once, and the
    resumed worker's stale writes reach the store and are refused and counted (local
    fencing is off here so that the store's check is what is exercised)."""
    monkeypatch.setenv("TOKENLINE_LOCAL_FENCING", "0")
    result = run_demo(backend_for(postgres_server), 5000, 4, show_progress=False)
    assert (result.succeeded, result.dead, result.invoices, result.duplicates) == (
        5000,
        0,
        5000,
        0,
    )
    assert result.rescues >= 1
    assert result.stale_refused >= 1
    assert result.ok
