"""The operator CLI against a real SQLite store (and ``migrate`` on PostgreSQL)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenline import App, JobState
from tokenline.cli import main
from tokenline.stores import store_from_url


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables are not cut to 80 columns, so assertions can read whole cells."""
    from tokenline.cli import _common

    monkeypatch.setattr(_common.console, "width", 250)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite store with one succeeded, one dead and one queued job."""
    u = f"sqlite:///{tmp_path / 'cli.db'}"

    async def seed() -> None:
        store = store_from_url(u)
        await store.open()
        app = App(u)

        @app.task(name="t")
        def t(ctx: object, n: int) -> None:
            """A task."""

        jobs = [app.build_job("t", [n], idempotency_key=f"k:{n}") for n in range(3)]
        await store.jobs_enqueue(jobs=jobs)
        a, b = await store.jobs_claim(owner="w-1", queues=["default"], limit=2, ttl=30)
        await store.job_complete(lease=a.lease)
        await store.job_dead(lease=b.lease, error="invalid invoice")
        await store.close()

    asyncio.run(seed())
    return u


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_queues_and_status_show_counts_per_state(url: str) -> None:
    """queues and status report the jobs per state and the store's health."""
    code, out = run("queues", "--url", url)
    assert code == 0
    assert "default" in out
    code, out = run("status", "--url", url)
    assert code == 0
    assert "ok" in out
    assert "stale commits refused by the store: 0" in out


def test_job_shows_attempt_history_with_tokens(url: str) -> None:
    """job ID prints the job and each attempt with worker, token and outcome."""
    code, out = run("job", "--url", url, "2")
    assert code == 0
    assert "dead" in out
    assert "invalid invoice" in out
    assert "w-1" in out


def test_unknown_job_is_a_clear_error(url: str) -> None:
    """Asking for a job that does not exist exits non-zero naming the id."""
    result = CliRunner().invoke(main, ["job", "--url", url, "999"])
    assert result.exit_code == 1
    assert "999" in result.output


def test_dlq_list_retry_discard(url: str) -> None:
    """Dead jobs are listed, can be requeued, and discarded ones never run again."""
    code, out = run("dlq", "list", "--url", url)
    assert code == 0
    assert "invalid invoice" in out
    code, out = run("dlq", "retry", "--url", url, "2")
    assert (code, "requeued 1" in out) == (0, True)

    async def state(job_id: int) -> JobState:
        store = store_from_url(url)
        await store.open()
        try:
            return (await store.job_get(job_id=job_id)).state
        finally:
            await store.close()

    assert asyncio.run(state(2)) is JobState.QUEUED
    code, out = run("dlq", "discard", "--url", url, "--all")
    assert (code, "discarded 0" in out) == (0, True)


def test_pause_and_resume_a_queue(url: str) -> None:
    """pause marks the queue paused in the listing; resume clears it."""
    assert run("pause", "--url", url, "default")[0] == 0
    assert "yes" in run("queues", "--url", url)[1]
    assert run("resume", "--url", url, "default")[0] == 0
    assert "yes" not in run("queues", "--url", url)[1]


def test_jobs_filters_by_state(url: str) -> None:
    """jobs --state lists only jobs in that state."""
    code, out = run("jobs", "--url", url, "--state", "succeeded")
    assert code == 0
    assert "succeeded" in out
    assert "queued" not in out


def test_worker_help_shows_environment_variables() -> None:
    """Every worker option names its TOKENLINE_ environment variable in --help."""
    code, out = run("worker", "--help")
    assert code == 0
    for var in ("TOKENLINE_LEASE_TTL", "TOKENLINE_RENEW_INTERVAL", "TOKENLINE_CONCURRENCY"):
        assert var in out


def test_migrate_on_postgres_then_a_non_migrating_app_opens(postgres_server: str) -> None:
    """tokenline migrate creates the schema; before it, an app with migrate=False is
    refused with a hint to run it."""
    import psycopg

    from tokenline import SchemaVersionError, Settings

    schema = f"tl_cli_{uuid.uuid4().hex[:8]}"
    u = f"{postgres_server}?schema={schema}"
    try:
        no_migrate = App(settings=Settings(url=u, migrate=False))
        with pytest.raises(SchemaVersionError, match="tokenline migrate"):
            no_migrate.run(lambda s: s.queues_stats())
        no_migrate.close()
        code, out = run("migrate", "--url", u)
        assert code == 0
        assert "schema version" in out
        app = App(settings=Settings(url=u, migrate=False))
        assert app.run(lambda s: s.queues_stats()) == []
        app.close()
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_job_says_what_each_attempt_counted_toward(tmp_path: Path) -> None:
    """job ID shows the lease expiries beside the attempts, and for each attempt which
    limit it counted toward: a lost lease is a lease expiry, a release is given back."""
    u = f"sqlite:///{tmp_path / 'counted.db'}"

    async def seed() -> int:
        from tokenline._clock import FakeClock

        clock = FakeClock()
        store = store_from_url(u, clock=clock)
        await store.open()
        app = App(u)
        app.task(name="t")(lambda ctx: None)
        (jid,) = await store.jobs_enqueue(jobs=[app.build_job("t")])
        await store.jobs_claim(owner="w-lost", queues=["default"], limit=1, ttl=5)
        clock.advance(6)
        await store.jobs_rescue()
        (second,) = await store.jobs_claim(owner="w-kind", queues=["default"], limit=1, ttl=5)
        await store.job_snooze(lease=second.lease, delay=0)
        await store.close()
        return jid

    jid = asyncio.run(seed())
    code, out = run("job", "--url", u, str(jid))
    assert code == 0
    assert "lease expiries 1/3" in out
    lost = next(line for line in out.splitlines() if "w-lost" in line)
    kind = next(line for line in out.splitlines() if "w-kind" in line)
    assert "lease expiry" in lost
    assert "given back" in kind
