"""The store exporter: the store-wide view, its age when the store fails, and HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenline import App, FakeClock
from tokenline._errors import ConfigError
from tokenline._jobs import Lease, NewJob, WorkerRecord
from tokenline.cli.exporter import exporter
from tokenline.drill.faultstore import FaultStore
from tokenline.drill.storefaults import Role, RoleFaults
from tokenline.metrics import MAX_QUEUES, StoreCollector, serve
from tokenline.stores import Store
from tokenline.stores.sqlite import SQLiteStore


def job(task: str, queue: str = "mail", **kw: Any) -> NewJob:
    return NewJob(queue=queue, task=task, args="[]", **kw)


def record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, "host", 1, ("mail",), 4, "ready", 0, 0.0, 0.0, 0.0)


async def seed(store: Store) -> None:
    """Two queues' worth of jobs in every state the exporter reports, two workers (one
    gone), an expired job lease nobody rescued, and one refused stale write."""
    await store.jobs_enqueue(jobs=[job("digest", priority=10), job("send", priority=5)])
    (orphan,) = await store.jobs_claim(owner="w-live", queues=["mail"], limit=1, ttl=0.05)
    (doomed,) = await store.jobs_claim(owner="w-live", queues=["mail"], limit=1, ttl=30)
    await store.job_dead(lease=doomed.lease, error="bad input")
    await store.jobs_enqueue(
        jobs=[job("send"), job("send"), job("send", delay=60), job("charge", queue="billing")]
    )
    await store.queue_pause(queue="billing")
    live = await store.worker_register(record=record("w-live"), ttl=30)
    await store.worker_heartbeat(
        worker_id="w-live", token=live.token, state="processing", in_flight=1, ttl=30, skew=0.25
    )
    gone = await store.worker_register(record=record("w-gone"), ttl=30)
    await store.worker_deregister(worker_id="w-gone", token=gone.token)
    # A resource lease of a live worker's job, and one of a worker that is gone.
    assert await store.resource_lease_acquire(resource="acct:1", owner="w-live/job1/t1", ttl=60)
    assert await store.resource_lease_acquire(resource="acct:2", owner="w-gone/job2/t1", ttl=60)
    forged = Lease(orphan.lease.job_id, "w-live", orphan.lease.token + 5, 0.0)
    assert await store.job_leases_renew(owner="w-live", leases=[forged], ttl=30) == [None]
    await asyncio.sleep(0.2)  # the orphan's lease expires by the store's clock


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A SQLite store seeded by :func:`seed`."""
    url = f"sqlite:///{tmp_path / 'exported.db'}"
    with App(url) as app:
        app.run(seed)
    return url


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The sample ``name`` with ``labels`` (None when absent)."""
    return registry.get_sample_value(name, labels)


def test_the_store_view_on_sqlite(db_url: str) -> None:
    """Depth per queue, task and state; oldest runnable age; paused queues; dead jobs;
    live workers with their heartbeat age and skew; expired job leases not rescued;
    stale writes and duplicates recorded; a fresh view from a reachable store."""
    app = App(db_url)
    collector = StoreCollector(app, max_age=0)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        depth = "tokenline_queue_depth"
        assert sample(registry, depth, queue="mail", task="send", state="queued") == 2
        assert sample(registry, depth, queue="mail", task="send", state="scheduled") == 1
        assert sample(registry, depth, queue="mail", task="send", state="running") == 0
        assert sample(registry, depth, queue="mail", task="digest", state="running") == 1
        assert sample(registry, depth, queue="billing", task="charge", state="queued") == 1
        oldest = sample(registry, "tokenline_queue_oldest_job_age_seconds", queue="mail")
        assert oldest is not None
        assert 0 < oldest < 60
        assert sample(registry, "tokenline_queue_paused", queue="billing") == 1
        assert sample(registry, "tokenline_queue_paused", queue="mail") == 0
        assert sample(registry, "tokenline_dead_jobs", queue="mail") == 1
        assert sample(registry, "tokenline_dead_jobs", queue="billing") == 0
        assert sample(registry, "tokenline_workers", state="processing") == 1
        assert sample(registry, "tokenline_workers", state="ready") == 0
        age = sample(registry, "tokenline_worker_heartbeat_age_seconds", worker="w-live")
        assert age is not None
        assert 0 <= age < 30
        assert sample(registry, "tokenline_worker_heartbeat_age_seconds", worker="w-gone") is None
        assert sample(registry, "tokenline_worker_clock_skew_seconds", worker="w-live") == 0.25
        assert sample(registry, "tokenline_orphan_job_leases") == 1
        assert sample(registry, "tokenline_orphan_resource_leases") == 1
        assert sample(registry, "tokenline_stale_commits_recorded_total") == 1
        assert sample(registry, "tokenline_duplicates_recorded_total", kind="stale") == 1
        assert sample(registry, "tokenline_duplicates_recorded_total", kind="repeat") == 0
        assert sample(registry, "tokenline_exporter_store_up") == 1
        view_age = sample(registry, "tokenline_exporter_view_age_seconds")
        assert view_age is not None
        assert 0 <= view_age < 5
        # Read again, the same records are not counted twice.
        assert sample(registry, "tokenline_duplicates_recorded_total", kind="stale") == 1
    finally:
        collector.close()
        app.close()


def test_the_series_of_many_queues_are_capped_to_the_largest_and_the_rest_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """3,000 queues: the per-queue series of the 100 largest only (by unfinished jobs,
    then the oldest runnable job), the others counted in a gauge of their own and
    logged once, not at every scrape."""
    small = [f"q{n:04d}" for n in range(3000)]

    async def many(store: Store) -> None:
        # One scheduled job each: equal depth and no runnable age, ranked by name.
        await store.jobs_enqueue(jobs=[job("send", queue=q, delay=600) for q in small])
        await store.jobs_enqueue(jobs=[job("send", queue="z-deep") for _ in range(5)])
        await store.jobs_enqueue(jobs=[job("send", queue="z-old")])
        await asyncio.sleep(0.05)  # z-old's job has waited, by the store's clock

    url = f"sqlite:///{tmp_path / 'many.db'}"
    with App(url) as seeder:
        seeder.run(many)
    app = App(url)
    collector = StoreCollector(app, max_age=0)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        with caplog.at_level(logging.WARNING, logger="tokenline.metrics"):
            text = generate_latest(registry).decode()
            generate_latest(registry)
        per_queue = ("queue_depth", "queue_oldest_job_age_seconds", "queue_paused", "dead_jobs")
        queues: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            if family.name.removeprefix("tokenline_") in per_queue:
                queues[family.name] = {s.labels["queue"] for s in family.samples}
        assert set(queues) == {f"tokenline_{name}" for name in per_queue}
        expected = {"z-deep", "z-old", *small[: MAX_QUEUES - 2]}
        for name, seen in queues.items():
            assert seen == expected, name
        served = [line for line in text.splitlines() if 'queue="' in line]
        assert len(served) == MAX_QUEUES * 6  # three depth states, age, paused, dead
        omitted = len(small) + 2 - MAX_QUEUES
        assert sample(registry, "tokenline_exporter_queues_omitted") == omitted
        depth = {"queue": "z-deep", "task": "send", "state": "queued"}
        assert registry.get_sample_value("tokenline_queue_depth", depth) == 5
        warnings = [r.getMessage() for r in caplog.records if r.name == "tokenline.metrics"]
        assert len(warnings) == 1, warnings
        assert f"{omitted} left out" in warnings[0]
    finally:
        collector.close()
        app.close()


def test_no_queue_is_omitted_below_the_cap(db_url: str) -> None:
    """Under the cap every queue is served and the omitted gauge says 0."""
    app = App(db_url)
    collector = StoreCollector(app, max_age=0)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        assert sample(registry, "tokenline_exporter_queues_omitted") == 0
        assert sample(registry, "tokenline_queue_paused", queue="billing") == 1
        assert sample(registry, "tokenline_dead_jobs", queue="mail") == 1
    finally:
        collector.close()
        app.close()


@pytest.fixture
def faulty(db_url: str) -> Iterator[tuple[FaultStore, StoreCollector, FakeClock]]:
    """A collector over the seeded store behind a fault injector, on a fake clock."""
    clock = FakeClock()
    store = FaultStore(SQLiteStore(db_url))
    collector = StoreCollector(store, max_age=5, timeout=0.5, clock=clock)
    try:
        yield store, collector, clock
    finally:
        store.clear()
        collector.close()


def test_an_unreachable_store_is_served_as_down_with_its_view_ageing(
    faulty: tuple[FaultStore, StoreCollector, FakeClock],
) -> None:
    """When the store cannot be read, store_up drops to 0 and the view served keeps its
    age, growing; readiness fails with the reason; the store's return refreshes it."""
    store, collector, clock = faulty
    registry = CollectorRegistry()
    registry.register(collector)
    assert sample(registry, "tokenline_exporter_view_age_seconds") == 0
    assert sample(registry, "tokenline_exporter_store_up") == 1
    store.set_role(Role.BROKER, RoleFaults(error=True))
    clock.advance(2)
    # Younger than max_age: the view is served as it is, without a read.
    assert sample(registry, "tokenline_exporter_store_up") == 1
    assert sample(registry, "tokenline_exporter_view_age_seconds") == 2
    clock.advance(4)
    assert sample(registry, "tokenline_exporter_store_up") == 0
    assert sample(registry, "tokenline_exporter_view_age_seconds") == 6
    depth = {"queue": "mail", "task": "send", "state": "queued"}
    assert registry.get_sample_value("tokenline_queue_depth", depth) == 2
    clock.advance(10)
    assert sample(registry, "tokenline_exporter_view_age_seconds") == 16
    ok, reason = collector.ready()
    assert not ok
    assert "store read failed" in reason
    store.clear()
    clock.advance(5)
    assert collector.ready() == (True, "store reachable")
    assert sample(registry, "tokenline_exporter_store_up") == 1
    assert sample(registry, "tokenline_exporter_view_age_seconds") == 0


def test_a_silent_store_is_down_after_the_read_timeout(
    faulty: tuple[FaultStore, StoreCollector, FakeClock],
) -> None:
    """A store that never answers costs a scrape the read timeout, not a hang, and
    counts as down; before any view, its age is infinite."""
    store, collector, _ = faulty
    store.set_role(Role.BROKER, RoleFaults(hang=True))
    registry = CollectorRegistry()
    registry.register(collector)
    started = time.monotonic()
    assert sample(registry, "tokenline_exporter_store_up") == 0
    assert time.monotonic() - started < 5
    assert sample(registry, "tokenline_exporter_view_age_seconds") == float("inf")
    assert (
        sample(registry, "tokenline_queue_depth", queue="mail", task="send", state="queued") is None
    )
    ok, reason = collector.ready()
    assert not ok
    assert "timed out" in reason


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_http_server_serves_metrics_health_and_readiness() -> None:
    """/metrics parses as Prometheus text; /healthz answers from its check alone;
    /readyz is 200 or 503 with the reason as its check says; anything else is 404."""
    registry = CollectorRegistry()
    Counter("tokenline_probe_total", "A probe.", registry=registry).inc(3)
    state = {"ready": (True, "fine")}
    server = serve(0, registry=registry, ready=lambda: state["ready"])
    try:
        status, text = get(server.url + "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["tokenline_probe"].samples[0].value == 3
        assert get(server.url + "/healthz") == (200, "ok\n")
        assert get(server.url + "/readyz") == (200, "fine\n")
        state["ready"] = (False, "store unreachable")
        assert get(server.url + "/readyz") == (503, "store unreachable\n")
        assert get(server.url + "/nope")[0] == 404
    finally:
        server.close()
    server.close()  # twice is harmless


def test_a_port_in_use_is_a_config_error_and_starts_nothing() -> None:
    """Serving on a port already taken names the port and starts no thread."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.name for t in threading.enumerate()}
        with pytest.raises(ConfigError, match=f"metrics port {port} is in use") as refused:
            serve(port)
        assert refused.value.setting == "port"
        assert {t.name for t in threading.enumerate()} == before


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("nosuchhost.invalid", "cannot resolve metrics host 'nosuchhost.invalid'"),
        ("192.0.2.1", "metrics host '192.0.2.1' is not an address of this machine"),
    ],
)
def test_a_host_that_cannot_be_listened_on_is_blamed_not_the_port(host: str, said: str) -> None:
    """A host name that does not resolve, or an address not of this machine, is a
    ConfigError naming the host; it used to be called an invalid port."""
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError) as refused:
        serve(0, host=host)
    assert refused.value.setting == "host"
    assert said in refused.value.reason
    assert {t.name for t in threading.enumerate()} == before


def test_a_privileged_port_is_blamed_on_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port the user may not bind (as below 1024 without privileges, which these
    tests may have, hence the refusal is simulated) names the port, not the host."""
    import errno

    def refuse(*args: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tokenline.metrics._Server", refuse)
    with pytest.raises(ConfigError, match="metrics port 80 may not be bound") as refused:
        serve(80)
    assert refused.value.setting == "port"


@pytest.mark.parametrize(
    "command",
    [
        ["exporter", "--host", "nosuchhost.invalid"],
        # A worker refuses port 0; the port is never bound, the host failing first.
        ["worker", "--app", "tokenline.demo:app", "--metrics-port", "9464", "--metrics-host",
         "nosuchhost.invalid"],
        ["maintenance", "--metrics-port", "0", "--metrics-host", "nosuchhost.invalid"],
    ],
)  # fmt: skip
def test_each_command_serving_metrics_names_an_unknown_host(
    db_url: str, command: list[str]
) -> None:
    """The exporter, a worker and the maintenance process each exit 2 (bad input) on a
    metrics host that does not resolve, saying the host is at fault, not the port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    done = subprocess.run(
        [sys.executable, "-m", "tokenline", *command, "--url", db_url],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: invalid setting 'host': cannot resolve metrics host"), line


def test_the_exporter_command_on_a_port_in_use_says_so(db_url: str) -> None:
    """The command exits 2 (bad input) naming the port when it is taken, before serving
    anything."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(exporter, ["--url", db_url, "--port", str(port)])
    assert result.exit_code == 2
    assert f"metrics port {port} is in use" in result.output


def test_the_exporter_command_serves_the_store_until_sigterm(db_url: str) -> None:
    """``tokenline exporter`` serves the store's metrics and readiness over HTTP, and
    stops cleanly on SIGTERM."""
    code = "from tokenline.cli.exporter import exporter; exporter()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--url", db_url, "--port", "0", "--max-age", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "/metrics" in line, line
        url = line.split(" on ", 1)[1].strip()
        status, text = get(url)
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        key = ("tokenline_queue_depth", (("queue", "mail"), ("state", "queued"), ("task", "send")))
        assert samples[key] == 2
        assert samples[("tokenline_exporter_store_up", ())] == 1
        base = url.removesuffix("/metrics")
        assert get(base + "/readyz") == (200, "store reachable\n")
        assert get(base + "/healthz") == (200, "ok\n")
        status, body = get(base + "/scale-hint")
        assert status == 200
        hint = json.loads(body)
        # Two jobs ready (the paused queue's left out), one live worker with free slots,
        # nothing growing: enough.
        assert (hint["advice"], hint["backlog_after"], hint["workers"]) == ("enough", 2, 1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_store_that_is_not_there_is_reported_down_and_never_created(tmp_path: Path) -> None:
    """The exporter's first read used to open the store, which created a mistyped SQLite
    file (and would install a mistyped PostgreSQL schema): an empty store that looked
    healthy. Now the store is down, /readyz says what is missing, nothing is created;
    once a worker or `tokenline migrate` creates it, the next read finds it."""
    path = tmp_path / "later.db"
    app = App(f"sqlite:///{path}")
    collector = StoreCollector(app, max_age=0)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        ready, why = collector.ready()
        assert not ready
        assert f"no tokenline store at {path}" in why
        assert sample(registry, "tokenline_exporter_store_up") == 0
        assert list(tmp_path.iterdir()) == []

        async def migrate() -> None:
            await SQLiteStore(f"sqlite:///{path}").migrate()

        asyncio.run(migrate())
        assert collector.ready() == (True, "store reachable")
        assert sample(registry, "tokenline_exporter_store_up") == 1
    finally:
        collector.close()
        app.close()


async def test_a_collector_read_from_a_running_event_loop_finds_its_store(
    tmp_path: Path,
) -> None:
    """An async web app that serves the metrics from its own loop calls the collector
    there: asking whether the store exists must not need a loop of its own there."""
    path = tmp_path / "there.db"
    await SQLiteStore(f"sqlite:///{path}").migrate()
    app = App(f"sqlite:///{path}")
    collector = StoreCollector(app, max_age=0)
    try:
        assert collector.ready() == (True, "store reachable")
    finally:
        collector.close()
        app.close()


def test_the_exporter_scale_hint_answers_hold_at_once_on_a_failing_channel() -> None:
    """The exporter's /scale-hint took two looks a second apart even when the first
    found a channel failing (11 s on a stalled store); the command answered hold at
    once. It does too: one look, whatever its interval (ten minutes here, which would
    outlast the test otherwise)."""
    from tokenline.cli.scale import ScaleHinter
    from tokenline.stores import store_from_url

    down = "postgresql://postgres@127.0.0.1:1/test"  # nothing listens there
    hinter = ScaleHinter(lambda: store_from_url(down), timeout=2.0, min_interval=600.0)
    for _ in range(2):
        status, body, _ = hinter.answer()
        hint = json.loads(body)
        assert (status, hint["advice"], hint["seconds"]) == (200, "hold", 0), hint
