"""Worker metrics: what each event does to the Prometheus samples, and readiness."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from tokenline import App, FakeClock, JobContext, JobState, Worker, events
from tokenline import metrics as metrics_module
from tokenline._jobs import QueueStats
from tokenline.metrics import (
    MAX_PREFIXES,
    MAX_QUEUES,
    WorkerMetrics,
    _largest_queues,
    _Reading,
    label_prefix,
    worker_health,
)
from tokenline.stores import Store
from tokenline.stores.base import Depth
from unit.test_worker import FAST, eventually, job_in, running


@pytest.fixture
def registry() -> CollectorRegistry:
    """A registry of this test's own."""
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> WorkerMetrics:
    """Worker metrics in this test's registry (fed by hand, not hooked)."""
    return WorkerMetrics(registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The sample ``name`` with ``labels``, or None when there is none."""
    return registry.get_sample_value(name, labels)


def test_a_started_and_finished_attempt_counts_and_times(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """A start counts and observes its wait; a finish counts its outcome and observes
    its run time, and wait plus run as its latency."""
    metrics(events.JobStarted("w", 1, "send", "mail", 1, 1, waited=0.3))
    metrics(events.JobFinished("w", 1, "send", "mail", 1, 1, "succeeded", None, 2.0, 0.3))
    metrics(events.JobFinished("w", 2, "send", "mail", 1, 3, "retry", "transient", 0.01, 0.0))
    assert value(registry, "tokenline_jobs_started_total", queue="mail", task="send") == 1
    finished = "tokenline_jobs_finished_total"
    assert value(registry, finished, queue="mail", task="send", outcome="succeeded") == 1
    assert value(registry, finished, queue="mail", task="send", outcome="retry") == 1
    duration = "tokenline_job_duration_seconds"
    assert value(registry, duration + "_count", queue="mail", task="send") == 2
    assert value(registry, duration + "_sum", queue="mail", task="send") == pytest.approx(2.01)
    assert value(registry, duration + "_bucket", queue="mail", task="send", le="0.01") == 1
    assert value(registry, "tokenline_job_wait_seconds_sum", queue="mail") == pytest.approx(0.3)
    assert value(registry, "tokenline_job_latency_seconds_sum", queue="mail") == pytest.approx(2.31)
    assert value(registry, "tokenline_job_latency_seconds_bucket", queue="mail", le="2.5") == 2


def test_coordination_events_count_by_their_bounded_labels(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """Renewal failures, stale commits and reads, steps that held the loop, rescues and
    store errors count under their reason, operation, view, task, outcome and channel,
    never under free text."""
    metrics(events.LeaseRenewalFailed("w", 3, "refused", "jobs 1, 2, 3"))
    metrics(events.LeaseRenewalFailed("w", 1, "error", "timeout"))
    metrics(events.LeaseRenewalFailed("w", 1, "error", "timeout again"))
    metrics(events.StaleCommitRefused("w", 7, 2, "succeeded"))
    metrics(events.StaleRead("w", "job lease", "job 7 token 2"))
    metrics(events.LoopHeld("w", 7, "resize", "images", 1.5))
    metrics(events.LoopHeld("w", 8, "resize", "images", 2.5))
    metrics(events.JobsRescued("w", requeued=4, dead=1))
    metrics(events.CoordinationFailed("w", "leases", "lease renewal", "connection refused"))
    metrics(events.CoordinationFailed("w", "ledger", "job 9", "timeout"))
    failures = "tokenline_lease_renewal_failures_total"
    assert value(registry, failures, reason="refused") == 1
    assert value(registry, failures, reason="error") == 2
    assert value(registry, "tokenline_stale_commits_refused_total", operation="succeeded") == 1
    assert value(registry, "tokenline_stale_reads_total", view="job lease") == 1
    held = "tokenline_event_loop_held_total"
    assert value(registry, held, queue="images", task="resize") == 2
    assert value(registry, "tokenline_jobs_rescued_total", outcome="requeued") == 4
    assert value(registry, "tokenline_jobs_rescued_total", outcome="dead") == 1
    assert value(registry, "tokenline_coordination_errors_total", channel="leases") == 1
    assert value(registry, "tokenline_coordination_errors_total", channel="ledger") == 1
    names = {m.name for m in registry.collect()}
    samples = [s for m in registry.collect() for s in m.samples]
    assert "tokenline_coordination_errors" in names
    assert not any("lease renewal" in s.labels.values() for s in samples)


def test_worker_state_is_one_for_the_current_state_only(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """Every state has a series from the start, at 0; a change sets the new state to 1
    and every other to 0."""
    states = ("ready", "processing", "draining", "fenced", "stopped")
    assert [value(registry, "tokenline_worker_state", state=s) for s in states] == [0] * 5
    metrics(events.WorkerStateChanged("w", "ready", "processing", "claimed"))
    metrics(events.WorkerStateChanged("w", "processing", "draining", "store down"))
    got = {s: value(registry, "tokenline_worker_state", state=s) for s in states}
    assert got == {"ready": 0, "processing": 0, "draining": 1, "fenced": 0, "stopped": 0}


def test_heartbeat_sets_gap_and_a_measured_skew(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """A heartbeat sets the gap; its skew only when measured (None keeps the last)."""
    metrics(events.Heartbeat("w", gap=10.2, clock_skew=-0.4))
    metrics(events.Heartbeat("w", gap=9.9, clock_skew=None))
    assert value(registry, "tokenline_heartbeat_gap_seconds") == pytest.approx(9.9)
    assert value(registry, "tokenline_clock_skew_seconds") == pytest.approx(-0.4)


def test_key_and_resource_labels_are_prefixes() -> None:
    """A key's label is the text before its first colon, or the whole key, cut to 32."""
    assert label_prefix("invoice:42:send") == "invoice"
    assert label_prefix("plain-key") == "plain-key"
    assert label_prefix("x" * 40 + ":1") == "x" * 32
    assert label_prefix(":leading") == ""


def test_duplicate_and_busy_prefixes_are_bounded(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """After 100 distinct prefixes, new ones count as ``other``; known ones keep theirs."""
    for n in range(MAX_PREFIXES + 5):
        metrics(events.DuplicateExecution("w", n, f"k{n}:x", "repeat"))
        metrics(events.ResourceLeaseBusy("w", f"r{n}:x"))
    metrics(events.DuplicateExecution("w", 1, "k0:again", "stale"))
    dup = "tokenline_duplicate_executions_total"
    assert value(registry, dup, key_prefix="k0", kind="repeat") == 1
    assert value(registry, dup, key_prefix="k0", kind="stale") == 1
    assert value(registry, dup, key_prefix=f"k{MAX_PREFIXES - 1}", kind="repeat") == 1
    assert value(registry, dup, key_prefix=f"k{MAX_PREFIXES}", kind="repeat") is None
    assert value(registry, dup, key_prefix="other", kind="repeat") == 5
    busy = "tokenline_resource_lease_busy_total"
    assert value(registry, busy, resource_prefix="other") == 5
    labels = {
        s.labels["key_prefix"]
        for m in registry.collect()
        if m.name == "tokenline_duplicate_executions"
        for s in m.samples
    }
    assert len(labels) == MAX_PREFIXES + 1


async def test_a_worker_with_the_hook_moves_the_job_metrics(registry: CollectorRegistry) -> None:
    """A real worker on the memory store, with WorkerMetrics hooked, counts the start
    and the success and times the handler."""
    app = App("memory://")
    store: Store = app.open_store()

    @app.task(name="t.metrics_ok", queue="reports")
    async def ok(ctx: JobContext) -> None:
        pass

    metrics = WorkerMetrics(registry)
    events.add_hook(metrics)
    try:
        jid = await app.enqueue_async("t.metrics_ok", store=store)
        async with running(Worker(app, dataclasses.replace(FAST, queues=("reports",)))):
            await job_in(store, jid, JobState.SUCCEEDED)
            labels = {"queue": "reports", "task": "t.metrics_ok"}
            await eventually(
                lambda: (
                    registry.get_sample_value(
                        "tokenline_jobs_finished_total", {**labels, "outcome": "succeeded"}
                    )
                    == 1
                ),
                "the success is counted",
            )
    finally:
        events.remove_hook(metrics)
    assert value(registry, "tokenline_jobs_started_total", **labels) == 1
    assert value(registry, "tokenline_job_duration_seconds_count", **labels) == 1
    assert value(registry, "tokenline_job_wait_seconds_count", queue="reports") == 1
    assert value(registry, "tokenline_worker_state", state="stopped") == 1


def test_worker_health_checks_are_the_workers_own() -> None:
    """/healthz and /readyz ask the worker: liveness and readiness (their rules are
    tested in test_worker_health.py). A worker not started yet lives but is not ready."""
    worker = Worker(App("memory://", clock=FakeClock()), FAST)
    health, ready = worker_health(worker)
    assert health() == worker.liveness() == (True, "ok")
    ok, reason = ready()
    assert not ok
    assert "not started" in reason


def test_tokenline_imports_without_prometheus_client_and_metrics_names_the_extra() -> None:
    """Without prometheus_client, ``import tokenline`` works and ``tokenline.metrics``
    fails with the install hint."""
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None\n"
        "import tokenline, tokenline.cli\n"
        "try:\n"
        "    import tokenline.metrics\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'tokenline[metrics]'" in out.stdout


def test_maintenance_repairs_count_by_service_and_kind_and_the_term_is_a_gauge(
    registry: CollectorRegistry, metrics: WorkerMetrics
) -> None:
    """Repairs add up per service and kind; the leader term gauge follows the term this
    process leads, back to 0 when it steps down."""
    metrics(events.MaintenanceRepaired("w", "reconciler", "effect_pending_expired", 2))
    metrics(events.MaintenanceRepaired("w", "reconciler", "effect_pending_expired", 1))
    metrics(events.MaintenanceRepaired("w", "rescuer", "requeued", 5))
    repairs = "tokenline_maintenance_repairs_total"
    kind = "effect_pending_expired"
    assert value(registry, repairs, service="reconciler", kind=kind) == 3
    assert value(registry, repairs, service="rescuer", kind="requeued") == 5
    metrics(events.LeaderChanged("w", 7))
    assert value(registry, "tokenline_maintenance_leader_term") == 7
    metrics(events.LeaderChanged("w", None))
    assert value(registry, "tokenline_maintenance_leader_term") == 0


def test_the_metrics_server_bounds_its_connections_and_logs_no_client_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Clients that connect and send nothing took a worker to hundreds of threads, and
    each client that hung up before reading (a scrape that timed out) left a
    traceback in the worker's log. Silent connections are now closed after a while,
    those past a bound at once, and a client gone is no error."""
    import contextlib
    import logging
    import socket
    import struct
    import threading
    import time

    from tokenline import metrics

    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 3)
    # Long enough that no held connection ends by itself while the bound is checked:
    # no wait below is a race with the idle timeout, however slow the machine.
    monkeypatch.setattr(metrics._Handler, "timeout", 60.0)
    server = metrics.serve(0)
    opened: list[socket.socket] = []
    try:
        threads = threading.active_count()
        with caplog.at_level(logging.DEBUG, logger="tokenline.metrics"):
            for _ in range(8):  # slowloris: connect, send nothing
                opened.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            # The five past the bound are closed unread: they read the end; the three
            # held ones read nothing.
            ends: list[bytes] = []
            for sock in opened:
                sock.settimeout(1.0)
                with contextlib.suppress(TimeoutError):
                    ends.append(sock.recv(1))
            assert ends == [b""] * 5, ends
            assert threading.active_count() <= threads + 3
            for sock in opened:
                sock.close()
            opened.clear()
            # A silent connection is closed once its time is up.
            monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
            deadline = time.monotonic() + 10
            while True:  # the held slots free as their handlers see the hang-ups
                silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                opened.append(silent)
                silent.settimeout(0.3)
                try:
                    silent.recv(1)  # closed at once: the slots are not free yet
                except TimeoutError:
                    break  # held: the server is waiting for its request
                assert time.monotonic() < deadline, "the hung-up connections kept their slots"
                time.sleep(0.1)
            silent.settimeout(5)
            assert silent.recv(1) == b""  # closed by the idle timeout, not held on
            for _ in range(5):  # requests sent, answers never read
                gone = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                gone.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                gone.close()  # a reset, before the answer is read
            # The reset ones may still hold their slots a moment (a loaded machine), and
            # a client past the bound is closed unread: the scrape answers once they end.
            answer = b""
            deadline = time.monotonic() + 10
            while not answer and time.monotonic() < deadline:
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as scrape:
                    scrape.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                    answer = scrape.recv(100)
                if not answer:
                    time.sleep(0.1)
            assert answer.startswith(b"HTTP/1.0 200"), answer
            time.sleep(0.3)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        for sock in opened:
            sock.close()
        server.close()


@pytest.mark.parametrize("cap", range(1, 10))
def test_the_queues_served_are_the_largest_then_the_oldest_then_the_most_dead(
    cap: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the cap, unfinished jobs rank first, then the oldest runnable job, then dead
    jobs, then the name; a queue only registered (no job yet) ranks with the empty."""
    monkeypatch.setattr(metrics_module, "MAX_QUEUES", cap)
    depth = [
        Depth("z-deep", "t", "queued", 2),
        Depth("z-deep", "t", "running", 1),
        Depth("z-old", "t", "queued", 1),
        Depth("y-young", "t", "queued", 1),
        Depth("f-later", "t", "scheduled", 1),
    ]
    stats = [
        QueueStats("z-old", {"queued": 1}, oldest_ready_age=30.0),
        QueueStats("y-young", {"queued": 1}, oldest_ready_age=1.0),
        QueueStats("x-dead", {"dead": 4}),
        QueueStats("v-dead", {"dead": 1}),
        QueueStats("w-empty", {"succeeded": 9}),
    ]
    view = _Reading(0.0, depth, stats, [], 0, 0, None)
    pairs = [("a-registered", "t")] + [(d.queue, d.task) for d in depth]
    ranked = ["z-deep", "z-old", "y-young", "f-later", "x-dead", "v-dead", "a-registered"]
    ranked.append("w-empty")
    served, omitted = _largest_queues(view, pairs)
    assert served == set(ranked[:cap])
    assert omitted == max(0, len(ranked) - cap)


def test_queues_up_to_the_cap_are_all_served() -> None:
    """Exactly :data:`MAX_QUEUES` queues, however empty: all served, none left out."""
    stats = [QueueStats(f"q{n}") for n in range(MAX_QUEUES)]
    view = _Reading(0.0, [], stats, [], 0, 0, None)
    served, omitted = _largest_queues(view, [])
    assert (len(served), omitted) == (MAX_QUEUES, 0)
