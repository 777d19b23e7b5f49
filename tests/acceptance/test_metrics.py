"""Acceptance: a worker's /metrics, /healthz and /readyz while real faults hit it.

Each fault moves the counters it predicts: a lease store that fails, renewal failures
and coordination errors on the leases channel (and readiness lost, liveness kept); a
zombie's commit, a stale commit refused or a renewal refused, and a stale read; a lost
ack of an effect retried in its attempt, and a lost job ack after its effect counted
as a duplicate execution of its key.
"""

from __future__ import annotations

import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenline.drill.storefaults import RoleFaults, StoreFaults, write_fault_file

from .conftest import Cluster
from .test_faults import enqueue, running_on

pytestmark = pytest.mark.acceptance

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def scrape(port: int) -> Samples:
    status, text = get(port, "/metrics")
    if status != 200:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def until(cluster: Cluster, port: int, what: str, check: Callable[[Samples], bool]) -> Samples:
    return cluster.wait_for(what, lambda: (s := scrape(port)) and check(s) and s)


def test_a_failing_lease_store_moves_renewal_failures_and_readiness(cluster: Cluster) -> None:
    """Leases failing: renewal failures (error) and leases-channel coordination errors
    count up, /readyz turns 503 while /healthz stays 200; after the fault, ready again."""
    port, faults = free_port(), cluster.tmp / "faults.json"
    a = cluster.worker("a", "--metrics-port", str(port), FAULTAPP_FAULT_FILE=str(faults))
    until(cluster, port, "the metrics endpoint", lambda s: True)
    cluster.wait_for("ready", lambda: get(port, "/readyz")[0] == 200)
    jid = enqueue(cluster, "lease-fault", 30.0, 0.0)  # holds a lease through the fault
    cluster.wait_for("the job to run", lambda: running_on(cluster, jid))
    write_fault_file(faults, StoreFaults(leases=RoleFaults(error=True)))
    s = until(
        cluster,
        port,
        "renewal failures",
        lambda s: total(s, "tokenline_lease_renewal_failures_total", reason="error") > 0,
    )
    assert total(s, "tokenline_coordination_errors_total", channel="leases") > 0
    assert total(s, "tokenline_coordination_errors_total", channel="ledger") == 0
    cluster.wait_for("not ready", lambda: get(port, "/readyz")[0] == 503)
    assert get(port, "/healthz")[0] == 200
    faults.unlink()
    cluster.wait_for("ready again", lambda: get(port, "/readyz")[0] == 200)
    a.send_signal(signal.SIGKILL)


def test_a_zombie_commit_moves_stale_counters(cluster: Cluster) -> None:
    """A worker paused past its lease (its own clock check off) reaches the store after
    its job was re-leased: the store refuses it — a stale commit or a refused renewal,
    whichever came first — and the worker counts a stale read of its lease view."""
    port = free_port()
    a = cluster.worker("a", "--metrics-port", str(port), TOKENLINE_LOCAL_FENCING="0")
    jid = enqueue(cluster, "zombie", 3.0, 4.0)
    owner_a = cluster.wait_for("worker a to run the job", lambda: running_on(cluster, jid))
    a.send_signal(signal.SIGSTOP)
    cluster.worker("b")
    cluster.wait_for(
        "worker b to run the rescued job",
        lambda: (o := running_on(cluster, jid)) is not None and o != owner_a,
    )
    a.send_signal(signal.SIGCONT)
    s = until(
        cluster,
        port,
        "a stale read",
        lambda s: total(s, "tokenline_stale_reads_total", view="job lease") > 0,
    )
    refused = total(s, "tokenline_stale_commits_refused_total") + total(
        s, "tokenline_lease_renewal_failures_total", reason="refused"
    )
    assert refused >= 1
    assert total(s, "tokenline_jobs_finished_total", outcome="succeeded") == 0


def test_a_lost_effect_ack_is_recorded_within_the_attempt(cluster: Cluster) -> None:
    """The ledger applies an effect's outcome but its answer is lost: while the lease is
    trusted the worker finds the record already there, so the job succeeds on its first
    attempt, the effect ran once and no repeat is counted; the lost answer is still a
    ledger coordination error."""
    port, faults = free_port(), cluster.tmp / "faults.json"
    write_fault_file(
        faults,
        StoreFaults(ledger=RoleFaults(fail_after=True, methods=frozenset({"effect_finish"}))),
    )
    cluster.worker("a", "--metrics-port", str(port), FAULTAPP_FAULT_FILE=str(faults))
    jid = enqueue(cluster, "charge:41", task="charge_once")
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")
    s = until(
        cluster,
        port,
        "a ledger coordination error",
        lambda s: total(s, "tokenline_coordination_errors_total", channel="ledger") >= 1,
    )
    assert cluster.job(jid)["attempt"] == 1
    assert total(s, "tokenline_duplicate_executions_total", key_prefix="charge") == 0
    effects = cluster.query("SELECT key FROM effects WHERE key = 'charge:41'")
    assert len(effects) == 1, "the effect ran twice"


def test_a_lost_job_ack_after_its_effect_moves_duplicate_executions(cluster: Cluster) -> None:
    """The effect is recorded, but the broker refuses the job's finish and the worker
    dies: the job runs again on another worker, finds the key completed, and that repeat
    is counted by key prefix while the effect itself ran once."""
    port_a, port_b, faults = free_port(), free_port(), cluster.tmp / "faults.json"
    write_fault_file(
        faults,
        StoreFaults(
            broker=RoleFaults(
                error=True, methods=frozenset({"jobs_finish", "jobs_finish_and_claim"})
            )
        ),
    )
    a = cluster.worker("a", "--metrics-port", str(port_a), FAULTAPP_FAULT_FILE=str(faults))
    jid = enqueue(cluster, "charge:42", task="charge_once")
    cluster.wait_for(
        "the effect to run",
        lambda: cluster.query("SELECT key FROM effects WHERE key = 'charge:42'"),
    )
    until(
        cluster,
        port_a,
        "the finish to fail",
        lambda s: total(s, "tokenline_coordination_errors_total", channel="broker") >= 1,
    )
    first = cluster.job(jid)
    assert first["state"] == "running"
    a.send_signal(signal.SIGKILL)
    faults.unlink()
    cluster.worker("b", "--metrics-port", str(port_b))
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")
    s = until(
        cluster,
        port_b,
        "a duplicate execution",
        lambda s: total(s, "tokenline_duplicate_executions_total", key_prefix="charge") > 0,
    )
    assert total(s, "tokenline_duplicate_executions_total", kind="repeat") >= 1
    assert cluster.job(jid)["lease_token"] > first["lease_token"], "not run again"
    effects = cluster.query("SELECT key FROM effects WHERE key = 'charge:42'")
    assert len(effects) == 1, "the effect ran twice"


def test_a_metrics_port_in_use_is_refused_before_the_worker_starts(cluster: Cluster) -> None:
    """A clear error naming the port, a non-zero exit, and no worker registered."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cluster.cli("worker", "--app", "faultapp:app", "--metrics-port", str(port))
    assert out.returncode != 0
    assert f"metrics port {port} is in use" in out.stderr
    assert not cluster.query("SELECT 1 FROM coord.workers")


def test_metrics_endpoints_parse_and_unknown_paths_are_404(cluster: Cluster) -> None:
    """/metrics is Prometheus text with the worker's state, its concurrency limit and
    the process's own figures; anything else is 404."""
    port = free_port()
    cluster.worker("a", "--metrics-port", str(port))
    s = until(cluster, port, "the worker state", lambda s: total(s, "tokenline_worker_state") == 1)
    assert total(s, "tokenline_worker_state", state="ready") == 1
    assert get(port, "/nope")[0] == 404
    assert total(s, "tokenline_concurrency_limit") == 2  # the cluster's --concurrency
    assert total(s, "process_cpu_seconds_total") > 0
