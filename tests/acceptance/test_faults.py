"""Acceptance: real worker processes through the CLI, with kill -9, SIGSTOP and SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from .conftest import DEADLINE, Cluster

pytestmark = pytest.mark.acceptance


def enqueue(cluster: Cluster, *args: object, task: str = "slow_effect") -> int:
    out = cluster.cli("enqueue", "--app", "faultapp:app", task, json.dumps(list(args)))
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def running_on(cluster: Cluster, job_id: int, owner_hint: str | None = None) -> str | None:
    job = cluster.job(job_id)
    if job["state"] != "running":
        return None
    return str(job["lease_owner"])


def registered(cluster: Cluster, pid: int) -> bool:
    return bool(
        cluster.query("SELECT 1 FROM coord.workers WHERE pid = ? AND state != 'stopped'", pid)
    )


def test_sigkilled_workers_job_is_rerun_by_another_within_ttl_plus_rescue(
    cluster: Cluster,
) -> None:
    """A worker killed with SIGKILL mid-job loses it when its lease expires; another
    worker's rescuer requeues it within TTL + one rescue period and runs it once."""
    a = cluster.worker("a")
    jid = enqueue(cluster, "k1", 60, 0.05)
    owner_a = cluster.wait_for("worker a to run the job", lambda: running_on(cluster, jid))
    b = cluster.worker("b")
    cluster.wait_for("worker b to register", lambda: registered(cluster, b.pid))
    expires_at = cluster.job(jid)["live_expires_at"]
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=DEADLINE)
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")
    attempts = cluster.query(
        "SELECT owner, outcome, finished_at, started_at FROM tokenline_attempts "
        "WHERE job_id = ? ORDER BY token",
        jid,
    )
    assert [(r["owner"] == owner_a, r["outcome"]) for r in attempts] == [
        (True, "lease_expired"),
        (False, "succeeded"),
    ]
    # Renewals stopped at the kill, so the lease ran out at most TTL after `expires_at`
    # was read; the rescue came within one rescue period (0.5 s) of that, plus slack
    # for a slow machine. Without the rescuer the job would never run again.
    rescued_at = attempts[0]["finished_at"]
    assert rescued_at - expires_at < 2 + 0.5 + 5
    effects = cluster.query("SELECT key, token FROM effects")
    assert [(r["key"], r["token"]) for r in effects] == [("k1", cluster.job(jid)["lease_token"])]


def _zombie_run(cluster: Cluster, **env: str) -> tuple[int, str, subprocess.Popen[bytes]]:
    """Worker a runs a job, is SIGSTOPped past its lease; worker b is rescued into it and
    is still running it when a is resumed."""
    a = cluster.worker("a", **env)
    jid = enqueue(cluster, "zombie", 3.0, 4.0)
    owner_a = cluster.wait_for("worker a to run the job", lambda: running_on(cluster, jid))
    a.send_signal(signal.SIGSTOP)
    cluster.worker("b")
    cluster.wait_for(
        "worker b to run the rescued job",
        lambda: (o := running_on(cluster, jid)) is not None and o != owner_a,
    )
    a.send_signal(signal.SIGCONT)
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")
    return jid, owner_a, a


def test_sigstopped_worker_fences_itself_and_the_effect_happens_once(cluster: Cluster) -> None:
    """Resumed after its job was re-leased, the paused worker notices on its own clock,
    goes FENCED, commits nothing, re-registers; the effect is written once, by the
    newest token."""
    jid, owner_a, a = _zombie_run(cluster)
    cluster.wait_for("worker a to fence and recover", lambda: "fenced -> ready" in cluster.log(a))
    effects = cluster.query("SELECT token, worker FROM effects WHERE key = 'zombie'")
    job = cluster.job(jid)
    assert [(r["token"], r["worker"] != owner_a) for r in effects] == [(job["lease_token"], True)]
    assert "processing -> fenced" in cluster.log(a)


def test_without_local_fencing_the_store_refuses_the_zombie_commit(cluster: Cluster) -> None:
    """With the worker's own clock check off, the resumed zombie reaches the store,
    which refuses its stale token (recorded), and the worker goes FENCED."""
    jid, owner_a, a = _zombie_run(cluster, TOKENLINE_LOCAL_FENCING="0")
    cluster.wait_for("worker a to be fenced", lambda: "-> fenced" in cluster.log(a))
    stale = cluster.query(
        "SELECT operation, token FROM tokenline_stale_commits WHERE job_id = ? AND owner = ?",
        jid,
        owner_a,
    )
    # Whichever reached the store first, the renewal or the commit, was refused.
    assert stale
    assert {r["operation"] for r in stale} <= {"renew", "transaction"}
    assert {r["token"] for r in stale} == {1}
    effects = cluster.query("SELECT token, worker FROM effects WHERE key = 'zombie'")
    job = cluster.job(jid)
    assert [(r["token"], r["worker"] != owner_a) for r in effects] == [(job["lease_token"], True)]


def test_with_the_token_check_disabled_the_zombie_commit_gets_through(cluster: Cluster) -> None:
    """Control experiment: remove the store's token check (state-only, like many queues)
    and the stale worker's write is accepted — so the check above is what protects."""
    jid, owner_a, _ = _zombie_run(cluster, TOKENLINE_LOCAL_FENCING="0", FAULTAPP_STATE_ONLY="1")
    effects = cluster.query("SELECT token, worker FROM effects WHERE key = 'zombie'")
    assert owner_a in {r["worker"] for r in effects}
    assert min(r["token"] for r in effects) < cluster.job(jid)["lease_token"]


def markers(cluster: Cluster, job_id: int, what: str) -> list[int]:
    """The tokens of the attempts that wrote marker ``what`` (see faultapp.paused_write)."""
    rows = cluster.query(
        "SELECT token FROM effects WHERE key = ? AND job_id = ? ORDER BY token", what, job_id
    )
    return [r["token"] for r in rows]


# In the sleep, the watchdog's timer falls due before the handler's: it cancels the handler
# in the same pass, which works only when the handler runs in the job's own task. Holding
# the loop (past the lease even if the stop comes late), the handler is resumed before the
# watchdog looks: only the guard's check at resumption stops it.
@pytest.mark.parametrize(
    ("sleep", "hold"),
    [(5.0, 0.0), (0.0, 3.0)],
    ids=["stopped-in-await-sleep", "stopped-in-a-step-holding-the-loop"],
)
def test_sigstopped_async_handler_takes_no_step_after_its_lease(
    cluster: Cluster, sleep: float, hold: float
) -> None:
    """An async handler stopped past its lease, in ``await asyncio.sleep(5)`` or in a step
    that holds the loop for longer than the lease, never runs the write after that await:
    the worker fences and the job runs again, whole, under a higher token."""
    a = cluster.worker("a")
    jid = enqueue(cluster, sleep, hold, task="paused_write")
    (first,) = cluster.wait_for("the handler to start", lambda: markers(cluster, jid, "started"))
    a.send_signal(signal.SIGSTOP)
    time.sleep(8)  # longer than what is left of the sleep or hold, plus the 2 s lease
    a.send_signal(signal.SIGCONT)
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")
    cluster.wait_for("worker a to fence and recover", lambda: "fenced -> ready" in cluster.log(a))
    last = cluster.job(jid)["lease_token"]
    assert last > first
    assert markers(cluster, jid, "started") == [first, last]
    assert markers(cluster, jid, "after") == [last], "a step ran after the lease was gone"
    assert "processing -> fenced" in cluster.log(a)


def test_sigterm_drains_in_flight_job_then_stops(cluster: Cluster) -> None:
    """SIGTERM: stop fetching, finish the in-flight job, exit 0 with the worker stopped."""
    a = cluster.worker("a")
    jid = enqueue(cluster, "drain", 1.5, 0.0)
    cluster.wait_for("the job to run", lambda: running_on(cluster, jid))
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=DEADLINE) == 0
    assert cluster.job(jid)["state"] == "succeeded"
    assert "-> draining" in cluster.log(a)
    assert [r["state"] for r in cluster.query("SELECT state FROM coord.workers")] == ["stopped"]


def test_second_sigterm_stops_at_once_and_gives_the_job_back(cluster: Cluster) -> None:
    """A second SIGTERM stops the worker without waiting; the job is released with its
    attempt refunded, ready for another worker."""
    a = cluster.worker("a", "--drain-timeout", "60")
    jid = enqueue(cluster, "force", 600, 0.0)  # far beyond DEADLINE: it must not wait
    cluster.wait_for("the job to run", lambda: running_on(cluster, jid))
    a.send_signal(signal.SIGTERM)
    cluster.wait_for("draining", lambda: "-> draining" in cluster.log(a))
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=DEADLINE) == 0
    job = cluster.job(jid)
    assert (job["state"], job["attempt"]) == ("queued", 0)


def test_cli_rejects_bad_input_without_storing_anything(cluster: Cluster) -> None:
    """Unknown task, non-JSON args, bad queue name: a clear error and nothing stored."""
    bad = [
        ("enqueue", "--app", "faultapp:app", "nope", "[]"),
        ("enqueue", "--app", "faultapp:app", "slow_effect", "{not json"),
        ("enqueue", "--app", "faultapp:app", "slow_effect", "[1]", "--queue", "bad queue!"),
        ("pause", "bad queue!"),
    ]
    for args in bad:
        out = cluster.cli(*args)
        assert out.returncode != 0, args
        assert "error" in (out.stderr + out.stdout).lower(), args
    assert cluster.query("SELECT count(*) AS n FROM tokenline_jobs")[0]["n"] == 0


def test_worker_rejects_invalid_settings_naming_them(cluster: Cluster) -> None:
    """An invalid setting stops the worker at start with the setting's name."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenline", "worker", "--app", "faultapp:app",
         "--lease-ttl", "3", "--renew-interval", "2"],
        env=cluster.env(), capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "renew_interval" in out.stderr


def test_corrupt_store_file_is_reported_and_left_untouched(cluster: Cluster) -> None:
    """A file that is not a SQLite database gives a clear error and is not modified."""
    bogus = cluster.tmp / "bogus.db"
    bogus.write_bytes(b"this is not a database, it is an invoice" * 100)
    before = bogus.read_bytes()
    out = subprocess.run(
        [sys.executable, "-m", "tokenline", "queues", "--url", f"sqlite:///{bogus}"],
        capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "not a usable tokenline store" in out.stderr
    assert bogus.read_bytes() == before
