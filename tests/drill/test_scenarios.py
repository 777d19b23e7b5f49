"""Scenario descriptions: which apply where, and a seed that fixes the schedule."""

from __future__ import annotations

import pytest

from tokenline.drill.scenarios import (
    DRILL_SCENARIOS,
    Action,
    Injection,
    Scenario,
    Schedule,
    StatusExpectation,
    scenarios_for,
)


def test_pg_restart_applies_to_postgresql_only() -> None:
    """A server restart has no meaning for a file: SQLite runs every other scenario."""
    assert "pg_restart" not in {s.name for s in scenarios_for("sqlite")}
    assert [s.name for s in scenarios_for("postgresql")] == [
        n for n in DRILL_SCENARIOS if n not in SPLIT_ONLY
    ]


#: The scenarios that cut or fail over Redis: the split topology's alone.
SPLIT_ONLY = {"redis_partition_one", "redis_partition_all", "redis_failover"}


def test_the_split_topology_runs_the_redis_faults_and_the_process_and_role_ones() -> None:
    """The split topology runs its Redis scenarios, and those whose fault hits a process
    or a role (not one connection carrying every role, which it does not have); the
    leader is struck there by the periodic scenarios, which also check its schedule."""
    assert {s.name for s in scenarios_for("split")} == {
        "kill9", "sigstop", "lost_ack", "partition_leases", *SPLIT_ONLY,
        "periodic_kill9_leader", "periodic_sigstop_leader",
    }  # fmt: skip
    assert not SPLIT_ONLY & {s.name for s in scenarios_for("sqlite")}
    redis_faults = [DRILL_SCENARIOS[n].faults_for("split") for n in sorted(SPLIT_ONLY)]
    assert all(store is None for store, _ in redis_faults)


def test_the_seed_fixes_the_schedule() -> None:
    """The same seed gives the same moment and victim; the schedule stays in range."""
    s = DRILL_SCENARIOS["kill9"]
    a = Schedule.draw(s, jobs=2000, workers=4, seed=7)
    assert a == Schedule.draw(s, jobs=2000, workers=4, seed=7)
    draws = {Schedule.draw(s, jobs=2000, workers=4, seed=n) for n in range(20)}
    assert len(draws) > 1
    assert all(0 < d.at_jobs < 2000 and 0 <= d.victim < 4 for d in draws)


def test_every_network_fault_has_a_sqlite_equivalent() -> None:
    """Each scenario that runs on SQLite has FaultStore faults (or is a signal, or
    injects nothing into the store's channels)."""
    for s in scenarios_for("sqlite"):
        store, proxy = s.faults_for("sqlite")
        assert proxy is None
        assert store is not None or s.injection is None or s.injection.action is not Action.FAULT
        if s.injection is None:
            assert s.hold_ttls > 0, f"{s.name} injects nothing and changes nothing"


def test_a_fault_injection_without_faults_is_refused() -> None:
    """A scenario that would inject nothing is a drill that proves nothing."""
    with pytest.raises(ValueError, match="needs store or proxy faults"):
        Injection(Action.FAULT)


def test_the_periodic_scenarios_strike_the_leader_where_schedules_are_kept() -> None:
    """The periodic scenarios hit the maintenance leader (the one enqueueing the
    instants), on every topology: the split topology keeps its schedules in Redis."""
    periodic = [s for s in DRILL_SCENARIOS.values() if s.periodic]
    assert {s.name for s in periodic} == {"periodic_kill9_leader", "periodic_sigstop_leader"}
    for s in periodic:
        assert s.leader_victim
        assert s.applies_to("sqlite")
        assert s.applies_to("postgresql")
        assert s.applies_to("split")


def test_each_split_scenario_declares_what_status_must_say() -> None:
    """On the split topology status must blame Redis for broker and leases when Redis is
    cut or fails over, the leases channel alone for a leases partition, and nothing when
    only a process is struck."""
    status = {s.name: s.status for s in scenarios_for("split")}
    assert all(expected is not None for expected in status.values())
    for name in SPLIT_ONLY:
        assert status[name] == StatusExpectation(failing=frozenset({"broker", "leases"}))
    assert status["partition_leases"] == StatusExpectation(failing=frozenset({"leases"}))
    for name in ("kill9", "sigstop", "periodic_kill9_leader", "periodic_sigstop_leader"):
        assert status[name] == StatusExpectation()


def test_a_split_scenario_without_a_status_expectation_is_refused() -> None:
    """A scenario on the split topology that says nothing of status would check nothing."""
    with pytest.raises(ValueError, match="declare its status"):
        Scenario("x", "x", Injection(Action.KILL), stores=frozenset({"split"}))
