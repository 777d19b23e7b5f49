"""The invariant checker on hand-made snapshots: each invariant, broken on purpose."""

from __future__ import annotations

from tokenline._periodic import Periodic
from tokenline.drill.checker import SLACK, Attempt, FaultWindow, Report, Snapshot, check

TTL = 2.0
KEYS = ["k:0", "k:1"]


def _clean() -> Snapshot:
    return Snapshot(
        jobs={1: ("k:0", "succeeded", 1, None), 2: ("k:1", "succeeded", 2, None)},
        attempts=[
            Attempt(1, 1, 100.0, 100.1, "succeeded"),
            Attempt(2, 1, 100.0, 103.0, "lease_expired"),
            Attempt(2, 2, 103.5, 104.0, "succeeded"),
        ],
        effects=[("k:0", 1, 1), ("k:1", 2, 2)],
        stale_refused=1,
        ledger_duplicates=0,
    )


def _check(snap: Snapshot, fault: FaultWindow | None = None) -> object:
    return check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5, fault=fault)


def test_a_clean_run_passes_and_counts_what_is_allowed() -> None:
    """A rescued and re-run job is no violation; its re-run and the refused stale commit
    are counted as duplicate executions, and the recovery time is measured from the fault."""
    report = check(
        _clean(), keys=KEYS, lease_ttl=TTL, rescue_interval=0.5, fault=FaultWindow(101.0, 101.0)
    )
    assert report.ok, report.violations
    assert report.duplicate_executions == 2
    assert report.affected == 1
    assert report.recovery == 2.5
    assert report.rescue_lag == 2.0  # from the fault, not from the start of the attempt


def test_a_missing_job_or_a_success_without_its_effect_is_lost() -> None:
    """No lost job: a key without a job, and a succeeded job without its effect, count."""
    snap = _clean()
    del snap.jobs[1]
    report = check(snap, keys=[*KEYS, "k:2"], lease_ttl=TTL, rescue_interval=0.5)
    assert report.lost == 2
    assert not report.ok


def test_a_second_row_for_a_key_is_a_duplicate_effect() -> None:
    """Once per key: two business rows for one key break the invariant."""
    snap = _clean()
    snap.effects.append(("k:1", 2, 1))
    report = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    assert report.duplicate_effects == 1
    assert report.stale_writes == 1  # and token 1 was not the newest
    assert not report.ok


def test_an_effect_by_an_old_token_is_a_stale_write() -> None:
    """Fenced commits: the row must carry the job's newest, succeeded token."""
    snap = _clean()
    snap.effects[1] = ("k:1", 2, 1)
    report = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    assert report.stale_writes == 1
    assert report.duplicate_effects == 0


def test_two_successes_or_an_attempt_after_success_move_state_backwards() -> None:
    """Monotonic states: a second success, or a run after the success, are refused."""
    snap = _clean()
    snap.attempts.append(Attempt(1, 2, 200.0, 200.1, "succeeded"))
    report = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    assert report.backwards == 1


def test_a_rescue_later_than_ttl_plus_period_plus_slack_is_reported() -> None:
    """Ownership expires: an expired lease rescued too late is a violation."""
    snap = _clean()
    snap.attempts[1] = Attempt(2, 1, 100.0, 120.0, "lease_expired")
    assert check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5).late_recoveries == 1
    # During a fault on every worker nobody can rescue: the clock starts at its end.
    fault = FaultWindow(100.0, 115.0, all_workers=True)
    report = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5, fault=fault)
    assert report.late_recoveries == 0


def test_a_job_still_pending_fails_the_run_without_being_lost() -> None:
    """A job still queued when the run ends is visible, not lost, but the run fails."""
    snap = _clean()
    snap.jobs[2] = ("k:1", "queued", 2, None)
    snap.effects.pop()
    report = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    assert (report.lost, report.pending, report.ok) == (0, 1, False)


def test_a_stall_of_the_whole_store_extends_the_recovery_bound() -> None:
    """A paused SQLite writer holds the one write lock for its whole pause: nobody can
    rescue meanwhile, so the bound is the pause plus one rescue period when that is
    longer than two TTLs — and stays two TTLs otherwise."""
    snap = Snapshot(jobs={}, attempts=[], effects=[], stale_refused=0, ledger_duplicates=0)
    plain = check(snap, keys=[], lease_ttl=2.0, rescue_interval=0.5)
    stalled = check(snap, keys=[], lease_ttl=2.0, rescue_interval=0.5, stall=8.0)
    short = check(snap, keys=[], lease_ttl=2.0, rescue_interval=0.5, stall=1.0)
    assert plain.recovery_bound == 2 * 2.0 + 0.5 + SLACK
    assert stalled.recovery_bound == 8.0 + 0.5 + SLACK
    assert short.recovery_bound == plain.recovery_bound


def test_with_the_leader_hit_the_bound_is_one_ttl_and_an_election_period() -> None:
    """When the fault hit the maintenance leader, the bound is the README's: lease TTL +
    renew (election) interval + rescue period (+ slack), not a second whole TTL."""
    snap = _clean()
    plain = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    leader = check(snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5, renew_interval=0.5)
    assert plain.recovery_bound == 2 * TTL + 0.5 + SLACK
    assert leader.recovery_bound == TTL + 0.5 + 0.5 + SLACK


# -- a periodic schedule every second (the periodic_* scenarios) -----------------------------
EVERY_SECOND = Periodic(name="tick", task="tick", cron="* * * * * *", catch_up="all")
#: 2026-01-01T00:00:00Z: the schedule's first instant in these snapshots.
T0 = 1767225600.0


def _ticks(*instants: float, lag: float = 0.2) -> Snapshot:
    """A run of the drill's jobs (_clean) and one finished job and row per instant."""
    snap = _clean()
    for i, t in enumerate(instants):
        job_id, key = 100 + i, EVERY_SECOND.key(t)
        snap.jobs[job_id] = (key, "succeeded", 1, None)
        snap.attempts.append(Attempt(job_id, 1, t + lag, t + lag + 0.1, "succeeded"))
        snap.effects.append((key, job_id, 1))
        snap.periodic.append((job_id, key, "succeeded", t + lag))
    return snap


def _check_ticks(snap: Snapshot, ended: float | None = None) -> Report:
    return check(
        snap, keys=KEYS, lease_ttl=TTL, rescue_interval=0.5, schedule=EVERY_SECOND, ended=ended
    )


def test_every_instant_once_passes_and_is_counted() -> None:
    """Ten instants, each with one job and one row, enqueued on time: a pass."""
    report = _check_ticks(_ticks(*(T0 + s for s in range(10))), ended=T0 + 10)
    assert report.ok, report.violations
    assert (report.periodic_instants, report.periodic_doubled, report.periodic_skipped) == (
        10,
        0,
        0,
    )
    assert report.periodic_bound == 2 * TTL + 1.0 + SLACK


def test_an_instant_enqueued_and_run_twice_is_doubled() -> None:
    """No instant twice: a second job for an instant (a deposed leader's, or a leader
    that trusted the released unique key) that ran again is a doubled instant and a
    duplicate effect."""
    snap = _ticks(*(T0 + s for s in range(5)))
    key = EVERY_SECOND.key(T0 + 2)
    snap.jobs[200] = (key, "succeeded", 1, None)
    snap.attempts.append(Attempt(200, 1, T0 + 4.5, T0 + 4.6, "succeeded"))
    snap.effects.append((key, 200, 1))
    snap.periodic.append((200, key, "succeeded", T0 + 4.5))
    report = _check_ticks(snap)
    assert report.periodic_doubled == 1
    assert report.duplicate_effects == 1
    assert not report.ok
    assert any("enqueued 2 times" in v for v in report.violations)


def test_an_instant_never_enqueued_between_two_others_is_skipped() -> None:
    """None skipped: a gap in the instants from the first to the last is reported."""
    report = _check_ticks(_ticks(*(T0 + s for s in range(6) if s != 3)))
    assert (report.periodic_instants, report.periodic_skipped) == (6, 1)
    assert not report.ok
    assert any(EVERY_SECOND.key(T0 + 3) in v for v in report.violations)


def test_an_instant_whose_job_succeeded_without_its_row_is_skipped_and_lost() -> None:
    """An instant counts as run by its business row, not by its job's state."""
    snap = _ticks(*(T0 + s for s in range(4)))
    snap.effects.remove((EVERY_SECOND.key(T0 + 1), 101, 1))
    report = _check_ticks(snap)
    assert (report.periodic_skipped, report.lost) == (1, 1)


def test_instants_still_pending_when_the_workers_stopped_end_the_span() -> None:
    """The last instants may be queued when the run stops: they are not judged (and not
    skipped), so the span ends before the first of them."""
    snap = _ticks(*(T0 + s for s in range(5)))
    key = EVERY_SECOND.key(T0 + 5)
    snap.periodic.append((300, key, "queued", T0 + 5.2))
    snap.jobs[300] = (key, "queued", 0, None)
    report = _check_ticks(snap)
    assert report.ok, report.violations
    assert report.periodic_instants == 5


def test_an_instant_enqueued_later_than_the_bound_is_late() -> None:
    """The schedule keeps up: an instant enqueued more than the bound after its time
    (the leader gone too long) is late, even if it then ran once."""
    report = _check_ticks(_ticks(*(T0 + s for s in range(4)), lag=9.0))
    assert report.periodic_late == 4
    assert report.periodic_lag == 9.0
    assert not report.ok


def test_instants_due_long_before_the_end_but_never_enqueued_are_late() -> None:
    """A schedule that stopped (no leader took over) leaves no gap between its first
    and last instants: the instants due a bound before the run ended catch it."""
    snap = _ticks(*(T0 + s for s in range(4)))
    assert _check_ticks(snap, ended=T0 + 5).ok
    report = _check_ticks(snap, ended=T0 + 20)
    # The bound is 2 TTLs + the scheduler's period + slack (7 s): T0+4 … T0+13 are late.
    assert report.periodic_bound == 7.0
    assert report.periodic_late == 10
    assert not report.ok


def test_a_schedule_that_never_ran_fails_the_run() -> None:
    """A periodic scenario in which no instant was enqueued proves nothing: it fails."""
    report = _check_ticks(_clean())
    assert report.periodic_instants == 0
    assert not report.ok


def test_without_a_schedule_no_periodic_figure_is_reported() -> None:
    """The other scenarios report no periodic figures (None, not zero)."""
    report = check(_ticks(T0), keys=KEYS, lease_ttl=TTL, rescue_interval=0.5)
    assert report.periodic_instants is None
    assert report.ok
