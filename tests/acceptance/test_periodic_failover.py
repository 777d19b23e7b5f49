"""A periodic job every second, real worker processes, and a maintenance leader that is
killed (kill -9) and then paused (SIGSTOP) past its lease: no instant runs twice, none
is skipped (catch_up="all")."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
from typing import Any

from .conftest import HERE, Cluster

MAINT = "tokenline:maintenance"


def start(cluster: Cluster, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
    log = cluster.tmp / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, env=cluster.env(), stdout=fh, stderr=fh, cwd=HERE)
    cluster.procs.append((proc, log))
    return proc


def worker(cluster: Cluster, name: str) -> subprocess.Popen[bytes]:
    """A worker of the periodic app: it runs the ticks and stands for leadership."""
    return start(
        cluster,
        name,
        [
            sys.executable, "-m", "tokenline", "worker", "--app", "periodicapp:app",
            "--queues", "acc", "--concurrency", "4", "--lease-ttl", "3",
            "--renew-interval", "1", "--rescue-interval", "0.5", "--poll-interval", "0.05",
        ],
    )  # fmt: skip


def holder(cluster: Cluster) -> tuple[str, int] | None:
    """The owner holding the maintenance lease, and its token (by the store's rows)."""
    rows = cluster.query("SELECT owner, token FROM coord.resource_leases WHERE resource = ?", MAINT)
    return (rows[0]["owner"], rows[0]["token"]) if rows else None


def ticks(cluster: Cluster) -> int:
    return int(cluster.query("SELECT count(*) FROM ticks")[0][0])


def proc_of(cluster: Cluster, owner: str) -> subprocess.Popen[bytes]:
    """The worker process whose membership is ``owner``."""
    (row,) = cluster.query("SELECT pid FROM coord.workers WHERE id = ?", owner)
    return next(p for p, _ in cluster.procs if p.pid == int(row["pid"]))


def test_no_instant_twice_and_none_skipped_across_leader_kill_and_pause(
    cluster: Cluster,
) -> None:
    """kill -9 the leader, then SIGSTOP the next one past its TTL and resume it: every
    instant from the first to the last ran exactly once."""
    with cluster.sql() as conn:
        conn.execute("CREATE TABLE ticks (key TEXT, job_id INTEGER, token INTEGER)")
    for name in ("a", "b"):
        worker(cluster, name)

    def progressed(since: int, by: int) -> Any:
        return lambda: ticks(cluster) >= since + by

    cluster.wait_for("the first ticks", progressed(0, 3))
    first = cluster.wait_for("a leader", lambda: holder(cluster))
    proc_of(cluster, first[0]).send_signal(signal.SIGKILL)
    at_kill = ticks(cluster)
    second = cluster.wait_for(
        "a new leader after kill -9",
        lambda: (h := holder(cluster)) and h[0] != first[0] and h,
    )
    cluster.wait_for("ticks after the kill", progressed(at_kill, 4))

    standby = worker(cluster, "c")  # a new standby for the next failure
    # Registered before the pause: a worker still starting when the leader is stopped in
    # the middle of a write waits on the file's lock, and may give up before it resumes.
    cluster.wait_for(
        "the standby to register",
        lambda: cluster.query("SELECT 1 FROM coord.workers WHERE pid = ?", standby.pid),
    )
    paused = proc_of(cluster, second[0])
    paused.send_signal(signal.SIGSTOP)
    at_pause = ticks(cluster)
    cluster.wait_for(
        "a new leader while the last one is paused",
        lambda: (h := holder(cluster)) and h[0] != second[0] and h,
    )
    cluster.wait_for("ticks during the pause", progressed(at_pause, 4))
    paused.send_signal(signal.SIGCONT)
    cluster.wait_for("ticks after the resume", progressed(ticks(cluster), 4))

    # The leader goes on enqueueing: judge the instants enqueued up to now, in order.
    cutoff = int(cluster.query("SELECT max(id) FROM tokenline_jobs WHERE task = 'tick'")[0][0])
    cluster.wait_for(
        "every instant enqueued so far to finish",
        lambda: (
            not cluster.query(
                "SELECT 1 FROM tokenline_jobs WHERE task = 'tick' AND id <= ? "
                "AND state NOT IN ('succeeded', 'dead')",
                cutoff,
            )
        ),
    )
    jobs = [r["idempotency_key"] for r in cluster.query(
        "SELECT idempotency_key FROM tokenline_jobs WHERE task = 'tick' AND id <= ?", cutoff
    )]  # fmt: skip
    ran = [r["key"] for r in cluster.query("SELECT key FROM ticks WHERE job_id <= ?", cutoff)]
    states = cluster.query(
        "SELECT DISTINCT state FROM tokenline_jobs WHERE task = 'tick' AND id <= ?", cutoff
    )
    assert len(jobs) == len(set(jobs)), "an instant was enqueued twice"
    assert sorted(ran) == sorted(jobs), "an instant ran twice, or not at all"
    assert {r["state"] for r in states} == {"succeeded"}
    seconds = sorted(int(dt.datetime.strptime(k, "periodic:tick:%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=dt.UTC).timestamp()) for k in jobs)  # fmt: skip
    assert seconds == list(range(seconds[0], seconds[-1] + 1)), "an instant was skipped"
    assert len(seconds) >= 15
