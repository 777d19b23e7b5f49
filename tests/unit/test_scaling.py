"""The scale hint's rules, in order: coordination and dependencies before backlog."""

from __future__ import annotations

from tokenline.scaling import Advice, Snapshot, WorkerLoad, scale_hint

BUSY = WorkerLoad(state="processing", in_flight=10, limit=10)
IDLE = WorkerLoad(state="ready", in_flight=2, limit=10)
DRAINING = WorkerLoad(state="draining", in_flight=3, limit=10)


def snap(at: float, backlog: int, *workers: WorkerLoad, **kw: object) -> Snapshot:
    return Snapshot(at=at, backlog=backlog, workers=workers, **kw)  # type: ignore[arg-type]


def test_a_growing_backlog_with_every_worker_at_its_limit_asks_for_workers() -> None:
    hint = scale_hint(snap(0, 100, BUSY, BUSY), snap(5, 180, BUSY, BUSY))
    assert hint.advice is Advice.ADD
    assert "grew from 100 to 180" in hint.reason
    assert hint.json()["workers_busy"] == 2


def test_a_failing_channel_holds_whatever_the_backlog() -> None:
    """Leases timing out: more workers would add renewals to a store that cannot answer."""
    hint = scale_hint(snap(0, 100, BUSY), snap(5, 500, BUSY, failing_channels={"leases": "slow"}))
    assert hint.advice is Advice.HOLD
    assert "leases slow" in hint.reason


def test_an_open_breaker_holds() -> None:
    hint = scale_hint(snap(0, 100, BUSY), snap(5, 500, BUSY, open_dependencies=["payments-api"]))
    assert hint.advice is Advice.HOLD
    assert "payments-api" in hint.reason


def test_mostly_draining_workers_hold() -> None:
    hint = scale_hint(
        snap(0, 100, DRAINING, DRAINING, BUSY), snap(5, 300, DRAINING, DRAINING, BUSY)
    )
    assert hint.advice is Advice.HOLD
    assert "2 of 3" in hint.reason


def test_no_worker_and_waiting_jobs_asks_for_one() -> None:
    assert scale_hint(snap(0, 0), snap(5, 3)).advice is Advice.ADD


def test_free_slots_mean_worker_count_is_not_the_bottleneck() -> None:
    hint = scale_hint(snap(0, 100, BUSY, IDLE), snap(5, 150, BUSY, IDLE))
    assert hint.advice is Advice.HOLD
    assert "1 of 2 workers have free slots" in hint.reason


def test_a_steady_or_shrinking_backlog_is_enough() -> None:
    assert scale_hint(snap(0, 100, BUSY), snap(5, 100, BUSY)).advice is Advice.ENOUGH
    assert scale_hint(snap(0, 100, BUSY), snap(5, 20, BUSY)).advice is Advice.ENOUGH


def test_workers_with_no_slot_and_nothing_running_hold_not_enough() -> None:
    """A worker whose limit came down to nothing (its threads held by handlers past
    their attempts) runs no job: a flat backlog then means nothing is processed. It
    said "the workers keep up", and a growing one asked for more workers that would
    stall the same way."""
    stuck = WorkerLoad(state="ready", in_flight=0, limit=0)
    for later in (216, 300):
        hint = scale_hint(snap(0, 216, stuck), snap(5, later, stuck))
        assert hint.advice is Advice.HOLD, hint
        assert "none of the 1 fetching workers runs a job or has a free slot" in hint.reason
    # Nothing waiting: nothing is held up.
    assert scale_hint(snap(0, 0, stuck), snap(5, 0, stuck)).advice is Advice.ENOUGH
    # One worker still running jobs: the rules on the backlog decide.
    busy_and_stuck = (BUSY, stuck)
    assert scale_hint(snap(0, 100, *busy_and_stuck), snap(5, 180, *busy_and_stuck)).advice is (
        Advice.ADD
    )


def test_a_worker_record_with_a_limit_of_zero_has_no_free_slot() -> None:
    """The CLI read a limit of 0 as unknown and took the configured concurrency, so a
    worker that could run nothing counted as having free slots."""
    import dataclasses

    from tokenline._jobs import WorkerRecord
    from tokenline.cli.scale import _load

    record = WorkerRecord(
        id="w", host="h", pid=1, queues=("default",), concurrency=4, state="ready", token=1,
        started_at=0.0, heartbeat_at=0.0, expires_at=30.0, in_flight=0, concurrency_limit=0,
    )  # fmt: skip
    load = _load(record)
    assert (load.limit, load.busy) == (0, True)
    unknown = _load(dataclasses.replace(record, concurrency_limit=None))
    assert unknown.limit == 4


def test_no_worker_and_nothing_runnable_is_not_the_workers_keeping_up() -> None:
    """With no worker live and five jobs in a paused queue, the hint said "the workers
    keep up". It says that none is live and nothing is runnable, and names the jobs the
    paused queues hold."""
    hint = scale_hint(snap(0, 0, paused_jobs=5), snap(5, 0, paused_jobs=5))
    assert hint.advice is Advice.ENOUGH
    assert hint.reason == (
        "no worker is live, and no job is runnable; paused queues hold 5 jobs "
        "(`tokenline resume` runs them)"
    )
    assert hint.json()["paused_jobs"] == 5
    live = scale_hint(snap(0, 0, IDLE, paused_jobs=2), snap(5, 0, IDLE, paused_jobs=2))
    assert live.reason.startswith("the workers keep up: backlog 0 → 0 in 5s; paused queues")
