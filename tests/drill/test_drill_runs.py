"""The drill end to end: every scenario against real worker processes, on SQLite,
PostgreSQL and the split topology; and, with the protections switched off, the drill
catching the bug."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from tokenline.drill.app import CLOCK_OFFSET_ENV
from tokenline.drill.runner import Drill, DrillError, ScenarioResult
from tokenline.drill.scenarios import DRILL_SCENARIOS, scenarios_for

pytestmark = pytest.mark.acceptance

#: Small enough for CI (a few seconds per scenario), large enough to be loaded when the
#: fault strikes.
JOBS = 200

#: No self-fencing by the worker's clock, for the control experiments (their app, from
#: tests/sabotage.py, also removes the store's token check).
NO_LOCAL_FENCING = {"TOKENLINE_LOCAL_FENCING": "0"}


#: Where the sabotaged apps of the control experiments live (tests/sabotage.py).
TESTS = Path(__file__).parent.parent


#: Scenarios run here only in a form that covers them in full: the periodic leader
#: scenarios strike the leader exactly as these do, with a periodic task besides (see
#: test_covering_scenarios_strike_as_the_ones_they_cover), and test_slow_dependency.py
#: runs slow_dependency itself, with breakers on and off.
COVERED_ELSEWHERE = {
    "kill9_leader": "periodic_kill9_leader",
    "sigstop_leader": "periodic_sigstop_leader",
}
RUN_BY_ITS_OWN_TEST = {"slow_dependency"}


def _scenarios(scheme: str) -> list[str]:
    """The scenarios to run on ``scheme``: all that apply, less those covered."""
    return [
        s.name
        for s in scenarios_for(scheme)
        if s.name not in COVERED_ELSEWHERE and s.name not in RUN_BY_ITS_OWN_TEST
    ]


def test_covering_scenarios_strike_as_the_ones_they_cover() -> None:
    """Each covering scenario has the same fault, victim and expectations as the one it
    covers, on every store that one runs on, and only adds a periodic task."""
    for covered, covering in COVERED_ELSEWHERE.items():
        a, b = DRILL_SCENARIOS[covered], DRILL_SCENARIOS[covering]
        assert b.periodic, covering
        assert not a.periodic, covered
        assert b.stores >= a.stores, covered
        # Everything else alike: the fault, when it strikes, the victim.
        same = dataclasses.replace(
            b, name=a.name, description=a.description, stores=a.stores, periodic=False,
            status=a.status,
        )  # fmt: skip
        assert same == a, covered


def _run(
    url: str | None,
    name: str,
    tmp: Path,
    *,
    app: str | None = None,
    deadline: float = 90,
    **env: str,
) -> ScenarioResult:
    if app is not None:
        env = {**env, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    drill = Drill(url=url, jobs=JOBS, workers=3, seed=1, worker_env=env, deadline=deadline)
    if app is not None:
        drill.app = app
    drill.preflight()
    (result,) = drill.run(drill.select([name]))
    return result


def _explain(result: ScenarioResult) -> str:
    return f"{result.to_json()}\n{result.log_tail}"


def _check_leader_victim(name: str, result: ScenarioResult) -> None:
    """With the leader as victim, another worker was elected, in a newer term."""
    if DRILL_SCENARIOS[name].leader_victim:
        assert result.leader_terms is not None, "no leader was struck"
        struck, last = result.leader_terms
        assert last > struck, _explain(result)


@pytest.mark.parametrize("name", _scenarios("sqlite"))
def test_scenario_keeps_every_invariant_on_sqlite(name: str, tmp_path: Path) -> None:
    """Under each fault no job is lost, no effect is applied twice or by a stale token,
    no state moves back and every expired lease comes back in time."""
    result = _run(None, name, tmp_path)
    assert result.report.ok, _explain(result)
    if DRILL_SCENARIOS[name].injection is not None:
        assert result.fault is not None, "the fault was never injected"
    _check_leader_victim(name, result)


#: Installed as ``sitecustomize`` in the workers' path: the worker whose clock runs ahead
#: (clock_skew's victim) stalls before it imports anything of tokenline.
_SLOW_START = """\
import os, pathlib, time
if float(os.environ.get({env!r}, "0")) > 0:
    pathlib.Path({marker!r}).touch()
    time.sleep({seconds})
"""


def test_a_worker_slow_to_start_is_struck_only_once_it_works(tmp_path: Path) -> None:
    """The jobs wait for every worker: a victim that takes longer to start than the
    others take to reach the fault's moment is not killed before it ever ran a job
    (clock_skew holds every worker to working)."""
    site = tmp_path / "site"
    site.mkdir()
    code = _SLOW_START.format(env=CLOCK_OFFSET_ENV, marker=str(tmp_path / "slow"), seconds=5)
    (site / "sitecustomize.py").write_text(code)
    result = _run(None, "clock_skew", tmp_path, PYTHONPATH=str(site))
    assert (tmp_path / "slow").exists(), "the victim was not slowed"
    assert result.report.idle_workers == 0, _explain(result)
    assert result.report.ok, _explain(result)


def test_a_worker_that_exits_before_registering_fails_the_run_at_once(tmp_path: Path) -> None:
    """A worker that dies while starting is named, with its log, before any job is
    enqueued, rather than leaving the run to its deadline."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import os, sys\nif float(os.environ.get({CLOCK_OFFSET_ENV!r}, '0')) > 0:\n"
        "    sys.exit('this worker cannot start')\n"
    )
    with pytest.raises(DrillError, match=r"worker-\d exited before any job") as info:
        _run(None, "clock_skew", tmp_path, PYTHONPATH=str(site))
    assert "this worker cannot start" in str(info.value)


@pytest.mark.parametrize("prefetch", ["0", "4"])
@pytest.mark.parametrize("name", ["lost_ack", "kill9"])
def test_workers_with_a_fixed_prefetch_keep_every_invariant(
    name: str, prefetch: str, tmp_path: Path
) -> None:
    """The scenarios above run the default, ``prefetch = auto``. Workers that never
    prefetch keep every invariant too, and so do workers that always hold prefetched
    jobs (claimed with their finishes, waiting under lease): a lost answer to a
    finish-and-claim strands more jobs, and a killed worker takes its prefetched jobs
    down with it; none is lost, none runs its effect twice."""
    result = _run(None, name, tmp_path, TOKENLINE_PREFETCH=prefetch)
    assert result.report.ok, _explain(result)
    assert result.fault is not None, "the fault was never injected"


@pytest.mark.postgres
@pytest.mark.parametrize("name", _scenarios("postgresql"))
def test_scenario_keeps_every_invariant_on_postgres(
    name: str, tmp_path: Path, postgres_server: str
) -> None:
    """The same on PostgreSQL, each worker behind its own fault proxy."""
    result = _run(postgres_server, name, tmp_path)
    assert result.report.ok, _explain(result)
    if DRILL_SCENARIOS[name].injection is not None:
        assert result.fault is not None, "the fault was never injected"
    _check_leader_victim(name, result)


@pytest.mark.postgres
@pytest.mark.parametrize("name", _scenarios("split"))
def test_scenario_keeps_every_invariant_on_the_split_topology(
    name: str, tmp_path: Path, postgres_server: str, redis_server: str, request: Any
) -> None:
    """The same on the split topology: broker and leases on Redis, each worker reaching
    it through its own fault proxy, the ledger on PostgreSQL (redis_failover: on a
    primary and replica of the drill's own); and during each fault, tokenline status
    names the failing channels' server as the scenario declares."""
    if name == "redis_failover":
        request.getfixturevalue("redis_server_binary")
    from tokenline.stores import split_url

    result = _run(split_url(redis_server, postgres_server), name, tmp_path)
    assert result.report.ok, _explain(result)
    if DRILL_SCENARIOS[name].injection is not None:
        assert result.fault is not None, "the fault was never injected"
    _check_status(name, result)


def _check_status(name: str, result: ScenarioResult) -> None:
    """tokenline status, run as the struck worker during the fault, named Redis for the
    channels a Redis fault cuts, and blamed no channel the fault did not cut."""
    expected = DRILL_SCENARIOS[name].status
    assert expected is not None
    seen = result.status
    assert seen is not None, "tokenline status never ran during the fault"
    assert seen.error is None, _explain(result)
    assert result.report.status_wrong == 0, _explain(result)
    for channel, c in seen.channels.items():
        if channel in expected.failing:
            assert c.ok is False, _explain(result)
            server = "Redis at " if channel != "ledger" else "PostgreSQL "
            assert (seen.named(channel) or "").startswith(server), _explain(result)
        elif channel not in expected.maybe:
            assert c.ok is True, _explain(result)


def _stores() -> list[object]:
    return [None, pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("store", _stores())
def test_the_drill_catches_a_zombie_when_the_token_check_is_off(
    store: str | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With state-only checks, the paused worker wakes while the new owner works and
    commits with its old token: the drill reports the stale write (and a duplicate)."""
    url = request.getfixturevalue("postgres_server") if store else None
    result = _run(url, "sigstop", tmp_path, app="sabotage:unfenced", **NO_LOCAL_FENCING)
    assert not result.report.ok, _explain(result)
    assert result.report.stale_writes + result.report.duplicate_effects > 0, _explain(result)


@pytest.mark.parametrize("store", _stores())
def test_the_drill_catches_a_lost_ack_without_transactional_completion(
    store: str | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Turning the token check off is not enough to break lost_ack: the effect and the
    completion commit together, and a finished job never runs again. With the completion
    split from the effect (tests/sabotage.py), a lost ack re-runs the job: the drill
    reports the duplicate effect."""
    url = request.getfixturevalue("postgres_server") if store else None
    # Without prefetch: this control needs the struck worker to go on committing through
    # the fault. With jobs prefetched, one lost answer to a finish-and-claim takes up to
    # 17 jobs out of its reach and its retried finish fences it, so in some runs too few
    # of its commits remain for the fault to strike (measured on SQLite: 1 of 3 runs
    # caught with auto, against 3 of 3 without).
    # The faults strike at random (30 % of the struck worker's commits while they last):
    # on a loaded machine a run can see too few of them to re-run a completed job. The
    # sabotage must show in one of three runs; with the completion in the transaction,
    # no run may (the test_scenario_keeps_every_invariant_… tests).
    runs = []
    for attempt in range(3):
        result = _run(
            url,
            "lost_ack",
            tmp_path / str(attempt),
            app="sabotage:split",
            TOKENLINE_PREFETCH="0",
            **NO_LOCAL_FENCING,
        )
        runs.append(result)
        if result.report.duplicate_effects > 0:
            break
    assert not result.report.ok, "\n".join(_explain(r) for r in runs)
    assert result.report.duplicate_effects > 0, "\n".join(_explain(r) for r in runs)


@pytest.mark.parametrize("store", _stores())
def test_the_drill_catches_stores_that_follow_the_workers_clocks(
    store: str | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """With each worker's wall clock in its store (as tokenline once did), the worker an
    hour ahead rescues leases that live workers still renew and the one an hour behind
    never claims a job: clock_skew reports early rescues or an idle worker."""
    url = request.getfixturevalue("postgres_server") if store else None
    # A short deadline: jobs stuck behind the skewed clocks need not all finish.
    result = _run(url, "clock_skew", tmp_path, app="sabotage:worker_clock", deadline=15)
    assert not result.report.ok, _explain(result)
    assert result.report.early_rescues + result.report.idle_workers > 0, _explain(result)
