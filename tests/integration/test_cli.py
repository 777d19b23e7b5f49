"""The operator CLI against a real SQLite store (and ``migrate`` on PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner

from pg_schema import schema_at_version, schema_exists
from tokenline import App, JobState
from tokenline.cli import main
from tokenline.cli._common import Prefetch, Seconds
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
        assert "schema created (schema version" in out
        code, out = run("migrate", "--url", u)
        assert code == 0
        assert "schema already up to date" in out
        app = App(settings=Settings(url=u, migrate=False))
        assert app.run(lambda s: s.queues_stats()) == []
        app.close()
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.parametrize("found", [0, 9])
def test_concurrent_migrations_each_say_what_they_did(postgres_server: str, found: int) -> None:
    """Six `tokenline migrate` at once on one schema (none, or at version 9): the schema
    was migrated once, under the lock, but each process that had read the old version
    before waiting for the lock said it had created or upgraded it. Exactly one says
    so; the others say it was already up to date."""
    import psycopg
    from psycopg import sql

    from tokenline.stores.postgres import SCHEMA_VERSION

    schema = f"tl_cli_{uuid.uuid4().hex[:8]}"
    u = f"{postgres_server}?schema={schema}"
    waiting = sql.SQL(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND (classid::bigint << 32 | objid::bigint) = "
        "hashtextextended('tokenline migrate ' || %s, 0)"
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        with psycopg.connect(postgres_server) as holder:  # a transaction: the lock's
            if found:
                schema_at_version(holder, schema, found)
                holder.commit()
            # Held while they start, so that every one reads the old version first.
            holder.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended('tokenline migrate ' || %s, 0))",
                (schema,),
            )
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "tokenline", "migrate", "--url", u],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for _ in range(6)
            ]
            deadline = time.monotonic() + 60
            with psycopg.connect(postgres_server, autocommit=True) as watch:
                while True:
                    row = watch.execute(waiting, (schema,)).fetchone()
                    if row == (6,):
                        break
                    assert time.monotonic() < deadline, f"{row} waiting"
                    time.sleep(0.05)
            holder.rollback()  # lets them go, one at a time
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * 6, outs
        did = "schema created" if not found else f"upgraded from version {found} to"
        assert sum(did in out for out in outs) == 1, outs
        assert sum("schema already up to date" in out for out in outs) == 5, outs
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            query = sql.SQL("SELECT max(version) FROM {}.schema_version")
            row = conn.execute(query.format(sql.Identifier(schema))).fetchone()
            assert row == (SCHEMA_VERSION,)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
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


# -- a bad TOKENLINE_* variable ---------------------------------------------------------------
@pytest.mark.parametrize(
    "variable", ["TOKENLINE_MAX_PAYLOAD_BYTES=20", "TOKENLINE_MAX_ATTEMPTS=lots"]
)
def test_help_works_whatever_the_environment_says(variable: str) -> None:
    """Importing the command line built apps (bench's, the drill's, with a periodic task)
    from the environment, so a bad or merely unusual variable broke every command,
    ``--help`` included, with a traceback."""
    name, _, value = variable.partition("=")
    env = {**os.environ, name: value}
    for args in (["--help"], ["drill", "--help"], ["bench", "--help"]):
        out = subprocess.run(
            [sys.executable, "-m", "tokenline", *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Usage:" in out.stdout
        assert out.stderr == ""


@pytest.mark.parametrize(
    ("value", "reason"),
    [("lots", "cannot read 'lots' as int"), ("0", "must be a whole number from 1 to")],
)
@pytest.mark.parametrize("command", [["status"], ["dlq", "list"], ["bench", "--jobs", "100"]])
def test_a_bad_variable_is_one_line_naming_it(
    url: str, value: str, reason: str, command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that needs the settings says which variable holds what, in one line,
    with exit status 2."""
    monkeypatch.setenv("TOKENLINE_MAX_ATTEMPTS", value)
    args = [*command, "--url", url] if command[0] != "bench" else command
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(
        f"error: TOKENLINE_MAX_ATTEMPTS={value!r} is invalid (setting max_attempts): {reason}"
    )
    assert "Traceback" not in result.output


def test_the_drill_reports_a_bad_variable_before_starting_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The drill's apps are built (and a bad variable found) before any worker starts."""
    from tokenline.drill import app as drill_app

    # Apps an earlier test built in this process, with other settings, are dropped.
    apps = getattr(drill_app, "_apps", None)
    if apps is not None:
        apps.cache_clear()
    monkeypatch.setenv("TOKENLINE_MAX_ATTEMPTS", "0")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    try:
        result = CliRunner().invoke(main, ["drill", "--scenario", "kill9", "--jobs", "10"])
    finally:
        if apps is not None:
            apps.cache_clear()
    assert result.exit_code == 2, result.output
    assert "error: TOKENLINE_MAX_ATTEMPTS='0' is invalid" in result.output
    assert list(tmp_path.iterdir()) == []


# -- ids out of range -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["job", "99999999999999999999999"], "JOB_ID"),
        (["job", "0"], "JOB_ID"),
        (["dlq", "retry", "2", "99999999999999999999999"], "JOB_IDS"),
        (["dlq", "discard", "2", "0"], "JOB_IDS"),
        (["lease", "release", "k", "--owner", "o", "--token", str(2**64)], "--token"),
    ],
)
def test_an_id_out_of_range_is_refused_naming_the_argument(
    url: str, args: list[str], named: str
) -> None:
    """An id past 64 bits gave an OverflowError traceback on SQLite, and in a batch it
    stopped the good ids from being acted on. Now the argument is refused, naming it,
    with exit status 2 and nothing done."""
    result = CliRunner().invoke(main, [*args[:2], "--url", url, *args[2:]])
    assert result.exit_code == 2, result.output
    assert named in result.output
    assert "9223372036854775807" in result.output
    assert "Traceback" not in result.output
    code, out = run("dlq", "list", "--url", url, "--json")
    assert code == 0
    assert [j["id"] for j in json.loads(out)] == [2]  # job 2 still dead: nothing was done


def test_enqueue_with_the_split_brokers_redis_down_is_one_line(postgres_server: str) -> None:
    """enqueue on the split topology with Redis down: one error line, exit status 1;
    it used to be followed by the ledger pool's teardown tracebacks."""
    url = f"split:?broker=redis://127.0.0.1:1/0&ledger={postgres_server}"
    out = subprocess.run(
        [sys.executable, "-m", "tokenline", "enqueue", "--app", "tokenline.demo:app",
         "demo.invoice", "[1, 100]"],
        env={**os.environ, "TOKENLINE_URL": url},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: cannot reach Redis at 127.0.0.1:1")


@pytest.mark.postgres
def test_a_command_on_a_redis_broker_that_does_not_answer_waits_for_it_once(
    redis_url: str, postgres_server: str, absent_schema: str
) -> None:
    """The check for a prefix never used gave a silent Redis 2 s, then opening the
    store waited out the store timeout again: a command failed after both. It now
    fails on the first wait, one connection per command, with no note that a change
    may have been made."""
    from tokenline.drill import ThreadedFaultProxy
    from tokenline.stores import split_url

    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with ThreadedFaultProxy(upstream=(host, int(port))) as proxy:
        proxy.set_faults(blackhole=True)
        broker = redis_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")
        url = split_url(f"{broker}&socket_timeout=1", f"{postgres_server}?schema={absent_schema}")
        for n, command in enumerate([["jobs"], ["queues"], ["cancel", "1"]], start=1):
            code, out = run(*command, "--url", url)
            assert code == 1, (command, out)
            assert f"cannot reach Redis at 127.0.0.1:{proxy.port}" in out, out
            assert "may have made the change" not in out, (command, out)
            assert proxy.stats.accepted == n, (command, proxy.stats)


@pytest.mark.postgres
def test_a_redis_prefix_never_used_is_noted(redis_url: str, postgres_server: str) -> None:
    """On the split topology a mistyped key prefix showed a healthy, empty store:
    `queues` empty, `dlq retry ID` "no such job". The commands that read or act on what
    is stored now add a note naming the prefix; the right prefix gets none. A note,
    not a refusal: after Redis lost its keys, `reconcile` must still run."""
    from tokenline.stores import split_url

    schema = f"tl_prefix_{uuid.uuid4().hex[:8]}"
    ledger = f"{postgres_server}?schema={schema}"
    url = split_url(redis_url, ledger)
    typo = split_url(redis_url.replace("prefix=", "prefix=typo_"), ledger)
    try:
        with App(url) as app:
            app.task(name="t")(lambda ctx: None)
            app.enqueue("t")
        for args in (["queues"], ["jobs"], ["dlq", "list"], ["reconcile"]):
            code, out = run(*args, "--url", typo)
            assert code == 0, (args, out)
            assert "holds no tokenline keys under the prefix '{typo_tl_test_" in out, out
            code, out = run(*args, "--url", url)
            assert code == 0, (args, out)
            assert "holds no tokenline keys" not in out
    finally:
        import psycopg
        import redis

        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")  # type: ignore[arg-type]
        name = redis_url.rpartition("prefix=")[2]
        with redis.Redis.from_url(redis_url.partition("?")[0]) as client:
            left = list(client.scan_iter(match=f"{{typo_{name}}}:*"))  # reconcile's
            if left:
                client.delete(*left)


# -- float options ----------------------------------------------------------------------------
def _commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_float_option_is_a_checked_number_of_seconds() -> None:
    """No option takes a bare float (or click's FloatRange, which lets nan through):
    each is the shared checked type, so none accepts nan, inf or a value out of range."""
    floats = [
        (" ".join(path), p.name)
        for path, command in _commands(main)
        for p in command.params
        if isinstance(p.type, click.types.FloatParamType) or p.type is click.FLOAT
    ]
    assert floats == []
    checked = {
        (" ".join(path), p.name)
        for path, command in _commands(main)
        for p in command.params
        if isinstance(p.type, Seconds)
    }
    assert {("worker", "lease_ttl"), ("migrate", "timeout"), ("scale-hint", "interval")} <= checked


@pytest.mark.parametrize(
    ("args", "option", "said"),
    [
        (["migrate", "--timeout", "nan"], "--timeout", "not a finite number"),
        (["status", "--timeout", "inf"], "--timeout", "not a finite number"),
        (["scale-hint", "--interval", "nan"], "--interval", "not a finite number"),
        (["scale-hint", "--interval", "-1"], "--interval", "not in the range 0 <= x <= 3600"),
        (["worker", "--lease-ttl", "1e-9"], "--lease-ttl", "not in the range 0.5 <= x"),
        (["worker", "--poll-interval", "-inf"], "--poll-interval", "not a finite number"),
        (["enqueue", "t", "--delay", "nan"], "--delay", "not a finite number"),
        (["enqueue", "t", "--delay", "1e12"], "--delay", "not in the range 0 <= x"),
        (["bench", "--window", "nan"], "--window", "not a finite number"),
        (["exporter", "--max-age", "inf"], "--max-age", "not a finite number"),
        (["dashboard", "--timeout", "nan"], "--timeout", "not a finite number"),
    ],
)
def test_every_float_option_refuses_what_is_no_finite_number_in_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], option: str, said: str
) -> None:
    """nan and inf used to pass: migrate crashed, status and scale-hint misreported, and
    a worker took a lease TTL of a nanosecond. Each is now a usage error naming the
    option, exit status 2, before anything is opened (no store file appears)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output
    assert said in result.output
    assert list(tmp_path.iterdir()) == []


#: Durations around every bound a worker setting has (0, the lease TTL's, a day,
#: 100 years), each side of it.
_PROBES = [0, 1e-9, 0.001, 0.3, 0.5, 1, 86_400, 86_400.5, 100_000, 3_155_760_000, 3.2e9]


def test_each_worker_duration_option_takes_the_range_its_setting_does() -> None:
    """A worker's duration flag (and so its TOKENLINE_ variable) accepts a value exactly
    when the setting does, as from a --config file. --drain-timeout refused 100000
    (past a day) which the setting takes up to 100 years, and --lease-ttl took 0.3
    (from 0.1) which the setting then refused (from 0.5)."""
    from tokenline._config import MAX_INTERVAL, WorkerSettings
    from tokenline._errors import ConfigError

    # store_timeout's own check goes to 100 years, but it must also be shorter than
    # lease_ttl, at most a day: the flag says a day, as the App's store_timeout does.
    tighter = {"store_timeout": MAX_INTERVAL}

    worker = dict(_commands(main))[("worker",)]
    options = [p for p in worker.params if isinstance(p.type, Seconds)]
    assert {p.name for p in options} >= {"drain_timeout", "lease_ttl", "startup_wait"}
    disagree = []
    for option in options:
        assert option.name is not None
        for value in _PROBES:
            try:
                option.type.convert(value, option, None)
                flag = True
            except click.BadParameter:
                flag = False
            try:
                WorkerSettings(**{option.name: value})
                setting = True
            except ConfigError as exc:
                # Only its own range counts: another setting's bound (effect_pending_deadline
                # under a long lease_ttl, say) is no verdict on this value.
                setting = not (exc.setting == option.name and "finite number" in exc.reason)
            if value > tighter.get(option.name, value):
                setting = False
            if flag != setting:
                disagree.append((option.name, value, flag, setting))
    assert disagree == []


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_a_drain_timeout_past_a_day_reaches_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """--drain-timeout 100000, or TOKENLINE_DRAIN_TIMEOUT=100000, is no usage error:
    the worker goes on to its settings (where a bad --prefetch stops it before any
    store is opened)."""
    monkeypatch.chdir(tmp_path)
    args = ["worker", "--app", "tokenline.demo:app", "--prefetch", "5000"]
    if how == "flag":
        args += ["--drain-timeout", "100000"]
    else:
        monkeypatch.setenv("TOKENLINE_DRAIN_TIMEOUT", "100000")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "invalid setting 'prefetch'" in result.output
    assert "drain" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "exit_code", "said"),
    [
        ("eight", 2, "neither 'auto' nor a whole number"),
        ("2.5", 2, "neither 'auto' nor a whole number"),
        ("5000", 2, "invalid setting 'prefetch': must be from 0 to 1000"),
    ],
)
def test_worker_prefetch_is_auto_or_a_number_in_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, exit_code: int, said: str
) -> None:
    """``worker --prefetch`` takes ``auto`` or a whole number from 0 to 1000; anything
    else is refused naming the option or the setting, before any store is opened."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        main, ["worker", "--app", "tokenline.demo:app", "--prefetch", value]
    )
    assert result.exit_code == exit_code, result.output
    assert said in result.output
    assert list(tmp_path.iterdir()) == []


def test_prefetch_option_reads_auto_in_any_case_and_numbers() -> None:
    """The option's type turns its text into the setting's value."""
    kind = Prefetch()
    assert kind.convert("auto", None, None) == "auto"
    assert kind.convert(" Auto ", None, None) == "auto"
    assert kind.convert("16", None, None) == 16
    assert kind.convert(3, None, None) == 3


# -- log levels -------------------------------------------------------------------------------
def test_every_log_level_option_is_checked_before_the_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``maintenance --log-level bogus`` reached the logging set-up and ended in a
    traceback. Every command's --log-level is now the one checked option: an unknown
    level is a usage error naming it, exit status 2; any case of a known one works."""
    monkeypatch.chdir(tmp_path)
    taking = [
        path
        for path, command in _commands(main)
        if any(p.name == "log_level" for p in command.params)
    ]
    assert {("worker",), ("maintenance",)} <= set(taking)
    for path in taking:
        (option,) = [p for p in dict(_commands(main))[path].params if p.name == "log_level"]
        assert option.envvar == "TOKENLINE_LOG_LEVEL"
        result = CliRunner().invoke(main, [*path, "--log-level", "bogus"])
        assert result.exit_code == 2, (path, result.output)
        assert "Invalid value for '--log-level'" in result.output
        assert "'bogus' is not one of 'debug', 'info', 'warning', 'error'" in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert list(tmp_path.iterdir()) == []


# -- a store that is not there ----------------------------------------------------------------
READING = [
    ["queues"],
    ["workers"],
    ["jobs"],
    ["job", "1"],
    ["dlq", "list"],
    ["dlq", "retry", "1"],
    ["dlq", "discard", "1"],
    ["leases"],
    ["lease", "release", "k", "--owner", "o", "--token", "1"],
    ["drain", "w-1"],
    ["audit", "duplicates"],
    ["reconcile", "--dry-run"],
    ["scale-hint", "--interval", "0"],
]


@pytest.mark.parametrize("command", READING, ids=[" ".join(c) for c in READING])
def test_a_command_that_reads_refuses_a_missing_sqlite_file(
    tmp_path: Path, command: list[str]
) -> None:
    """A mistyped SQLite path used to get an empty store created there, and an answer
    from it ("no jobs"). Commands that read, or act on what is stored, now say there is
    no store, exit status 2, and create nothing."""
    typo = tmp_path / "tokenlin.db"
    result = CliRunner().invoke(main, [*command, "--url", f"sqlite:///{typo}"])
    assert result.exit_code == 2, result.output
    assert f"error: no tokenline store at {typo}" in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["empty", "other tables"])
@pytest.mark.parametrize("command", READING, ids=[" ".join(c) for c in READING])
def test_a_command_that_reads_refuses_a_sqlite_file_that_is_not_a_store(
    tmp_path: Path, command: list[str], content: str
) -> None:
    """An empty file, or a database of the user's own tables: opening it would write
    tokenline's schema into it. Refused, exit status 2, the file left byte for byte as
    it was and nothing created beside it."""
    import sqlite3

    path = tmp_path / "app.db"
    path.touch()
    if content == "other tables":
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE users (id INTEGER)")
            conn.commit()
    before = path.read_bytes()
    result = CliRunner().invoke(main, [*command, "--url", f"sqlite:///{path}"])
    assert result.exit_code == 2, result.output
    assert f"error: {str(path)!r} holds no tokenline store" in " ".join(result.output.split())
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]


def test_a_command_that_reads_recreates_no_missing_coordination_file(tmp_path: Path) -> None:
    """A store whose -coord file was removed: each reading command put a new, empty one
    in its place (every lease gone, the store reported healthy). Refused, exit status
    2, naming the file; nothing created."""
    path = tmp_path / "q.db"
    assert CliRunner().invoke(main, ["migrate", "--url", f"sqlite:///{path}"]).exit_code == 0
    for coord in tmp_path.glob("q.db-coord*"):
        coord.unlink()
    for command in READING:
        result = CliRunner().invoke(main, [*command, "--url", f"sqlite:///{path}"])
        assert result.exit_code == 2, (command, result.output)
        assert "the coordination file" in result.output
        assert "is missing" in " ".join(result.output.split())
    # Reading a WAL database leaves SQLite's own -wal and -shm beside it: no store file.
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix not in (".db-wal", ".db-shm")) == [
        "q.db"
    ]


def test_a_command_that_reads_refuses_a_postgres_schema_that_is_not_installed(
    postgres_server: str, absent_schema: str
) -> None:
    """A mistyped ?schema= got a new schema installed under that name, and an answer
    from it ("no jobs"). Every command that reads is refused, exit status 2, naming the
    schema and the database, and no schema is created."""
    url = f"{postgres_server}?schema={absent_schema}"
    for command in READING:
        result = CliRunner().invoke(main, [*command, "--url", url])
        assert result.exit_code == 2, (command, result.output)
        flat = " ".join(result.output.split())
        assert f"error: the tokenline schema {absent_schema!r} of database" in flat, flat
        assert "is not installed (nothing was created" in flat
    assert not schema_exists(postgres_server, absent_schema)


def test_a_command_on_a_postgres_server_that_does_not_answer_waits_for_it_once(
    postgres_server: str, absent_schema: str
) -> None:
    """Before a command reads or acts, it asks whether the schema is installed. A
    server that did not answer that question was asked again by opening the store, so
    the command failed after twice its connection timeout (21 s by default). It now
    fails on the first: one connection per command, exit status 1, the server named,
    and no note that a change may have been made."""
    from tokenline.drill import ThreadedFaultProxy

    commands = [["jobs"], ["job", "1"], ["reconcile", "--dry-run"], ["dlq", "retry", "1"]]
    with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        proxy.set_faults(blackhole=True)
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        url = f"{via}?schema={absent_schema}&connect_timeout=2"
        for n, command in enumerate(commands, start=1):
            result = CliRunner().invoke(main, [*command, "--url", url])
            flat = " ".join(result.output.split())
            # reconcile's 1 says something was repaired: it could not act, 2.
            assert result.exit_code == (2 if command[0] == "reconcile" else 1), (command, flat)
            assert f"PostgreSQL on 127.0.0.1:{proxy.port} did not accept a connection" in flat
            assert "may have made the change" not in flat, (command, flat)
            assert proxy.stats.accepted == n, (command, proxy.stats)
    assert not schema_exists(postgres_server, absent_schema)


def test_status_on_a_postgres_server_that_does_not_answer_waits_for_it_once(
    postgres_server: str, absent_schema: str
) -> None:
    """`status` asked whether the schema was installed, and when the server did not
    answer, opened the store and waited as long again: twice its --timeout. It now
    reports the silent server from the first wait, on one connection."""
    from tokenline.drill import ThreadedFaultProxy

    with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        proxy.set_faults(blackhole=True)
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        url = f"{via}?schema={absent_schema}"
        result = CliRunner().invoke(main, ["status", "--url", url, "--timeout", "2", "--json"])
        assert proxy.stats.accepted == 1, proxy.stats
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["store"] in ("unreachable", "slow"), report
    assert {c["ok"] for c in report["channels"].values()} == {False}, report


def test_scale_hint_on_a_postgres_server_that_does_not_answer_says_hold(
    postgres_server: str, absent_schema: str
) -> None:
    """An outage is an answer for scale-hint (hold: more workers would only add load),
    not an error: its check that the schema is installed does not fail the command
    when the server is silent. And it is the answer at the first look: the command
    waited its interval and looked again, waiting out the silent server each time
    (30 s with the defaults); an interval of ten minutes would outlast the test."""
    from tokenline.drill import ThreadedFaultProxy

    with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
        proxy.set_faults(blackhole=True)
        via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        url = f"{via}?schema={absent_schema}"
        args = ["scale-hint", "--url", url, "--interval", "600", "--timeout", "2", "--json"]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    hint = json.loads(result.stdout)
    assert hint["advice"] == "hold", hint
    assert hint["seconds"] == 0, hint  # one look
    assert not schema_exists(postgres_server, absent_schema)


def test_the_dashboard_refuses_a_store_that_is_not_there(tmp_path: Path) -> None:
    """The dashboard reads the store and acts on it: a mistyped path is refused before
    it serves anything, and nothing is created."""
    typo = tmp_path / "tokenlin.db"
    done = subprocess.run(
        [sys.executable, "-m", "tokenline", "dashboard", "--url", f"sqlite:///{typo}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"no tokenline store at {typo}" in " ".join(done.stderr.split())
    assert list(tmp_path.iterdir()) == []


def test_an_empty_tokenline_url_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TOKENLINE_URL= (set, empty) fell back to sqlite:///tokenline.db in the working
    directory without a word."""
    monkeypatch.chdir(tmp_path)
    for command in (["queues"], ["migrate"], ["enqueue", "--app", "x:y", "t"]):
        result = CliRunner().invoke(main, command, env={"TOKENLINE_URL": ""})
        assert result.exit_code == 2, result.output
        assert "TOKENLINE_URL is set but empty" in result.output
    assert list(tmp_path.iterdir()) == []


def test_migrate_says_what_it_did(tmp_path: Path) -> None:
    """migrate said "up to date" even when it had just created or upgraded the schema."""
    from tokenline.stores.sqlite.store import SCHEMA_VERSION

    db = tmp_path / "m.db"
    code, out = run("migrate", "--url", f"sqlite:///{db}")
    assert code == 0
    assert f"schema created (schema version {SCHEMA_VERSION})" in out
    code, out = run("migrate", "--url", f"sqlite:///{db}")
    assert code == 0
    assert "schema already up to date" in out
    assert "nothing done" in out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_reading_commands_leave_an_older_postgres_schema_as_it_is(
    postgres_server: str, absent_schema: str
) -> None:
    """A newer tokenline's `status` or `jobs` upgraded the schema of the store it was
    asked about: diagnosing production changed it. They now say it needs migrating
    (status: "not migrated"; the others exit 1 naming `tokenline migrate`) and leave
    it at its version; `tokenline migrate` upgrades it."""
    import psycopg

    from tokenline.stores.postgres._migrations import SCHEMA_VERSION

    with psycopg.connect(postgres_server) as conn:
        schema_at_version(conn, absent_schema, SCHEMA_VERSION - 1)

    def version() -> int:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT max(version) FROM {absent_schema}.schema_version"  # type: ignore[arg-type]
            ).fetchone()
            assert row is not None
            return int(row[0])

    url = f"{postgres_server}?schema={absent_schema}"
    result = CliRunner().invoke(main, ["status", "--url", url, "--json"])
    assert result.exit_code == 1, result.output
    assert set(json.loads(result.stdout)["channels"]["broker"].values()) >= {"not migrated"}
    for command in (["jobs"], ["queues"], ["dlq", "list"], ["job", "1"]):
        result = CliRunner().invoke(main, [*command, "--url", url])
        assert result.exit_code == 1, (command, result.output)
        assert "run `tokenline migrate`" in " ".join(result.output.split()), result.output
    # The exporter reads the store too: it reports the schema, never upgrades it.
    port = _free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "tokenline", "exporter", "--url", url, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert exporter.poll() is None, exporter.communicate()
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the exporter never answered"
                time.sleep(0.1)
        assert ready.status_code == 503, ready.text
    finally:
        exporter.terminate()
        exporter.communicate(timeout=60)
    assert version() == SCHEMA_VERSION - 1
    assert CliRunner().invoke(main, ["migrate", "--url", url]).exit_code == 0
    assert version() == SCHEMA_VERSION
    assert CliRunner().invoke(main, ["jobs", "--url", url]).exit_code == 0


def test_lease_listings_on_a_slow_link_date_what_they_read_after_reading_it(
    postgres_server: str, absent_schema: str
) -> None:
    """On a slow link ``leases`` and ``workers`` read the store's clock first, then the
    rows, which a holder renewed meanwhile: expiries beyond the TTL and negative ages.
    The clock is now read after the rows it ages."""
    import threading

    from tokenline.drill import Faults, ThreadedFaultProxy
    from tokenline.stores.base import ResourceLease

    ttl = 6.0
    direct = App(f"{postgres_server}?schema={absent_schema}")
    lease = direct.run(lambda s: s.resource_lease_acquire(resource="acct:1", owner="w", ttl=ttl))
    assert lease is not None
    done = threading.Event()

    def renew() -> None:  # the holder, on a link of its own, renewing all the while
        held: ResourceLease | None = lease
        while not done.wait(0.05) and held is not None:
            held = direct.run(lambda s, held=held: s.resource_lease_renew(lease=held, ttl=ttl))

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        with ThreadedFaultProxy(upstream=("127.0.0.1", 5432)) as proxy:
            proxy.set_faults(Faults(latency=0.3))
            via = postgres_server.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
            url = f"{via}?schema={absent_schema}"
            result = CliRunner().invoke(main, ["leases", "--url", url, "--json"])
    finally:
        done.set()
        renewer.join(30)
        direct.close()
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["resource_leases"]
    assert row["expires_in"] <= ttl, row
    assert row["age"] >= 0, row


def test_status_and_migrate_show_no_password(postgres_server: str, absent_schema: str) -> None:
    """``status`` (text and ``--json``) and ``migrate`` printed the store URL with its
    password; output an operator pastes into a ticket. The server here trusts every
    connection, so the password is never checked, only printed, or not."""
    secret = "S3cretPW"
    url = postgres_server.replace("postgres@", f"postgres:{secret}@") + f"?schema={absent_schema}"
    assert secret in url
    outputs = [
        CliRunner().invoke(main, ["migrate", "--url", url]),
        CliRunner().invoke(main, ["status", "--url", url]),
        CliRunner().invoke(main, ["status", "--url", url, "--json"]),
    ]
    for result in outputs:
        assert result.exit_code == 0, result.output
        assert secret not in result.output, result.output
    assert json.loads(outputs[2].stdout)["url"].startswith("postgresql://postgres:***@")


@pytest.mark.parametrize(
    ("variable", "good", "option", "bad", "said"),
    [
        ("TOKENLINE_URL", "sqlite:///elsewhere.db", "--url", "sqlite:///", "names no file"),
        ("TOKENLINE_RENEW_INTERVAL", "5", "--renew-interval", "20", "at most lease_ttl / 3"),
    ],
)
def test_a_bad_option_is_not_blamed_on_a_good_variable(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    good: str,
    option: str,
    bad: str,
    said: str,
) -> None:
    """The option wins over the variable; its bad value was reported as the variable's,
    quoting the variable's good value, and the operator fixed the wrong thing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, good)
    args = ["worker", "--app", "tokenline.cli.bench:app", option, bad]
    if option != "--url":
        args += ["--url", f"sqlite:///{tmp_path / 'store.db'}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert said in line, line
    assert variable not in line, line
    assert good not in line, line
