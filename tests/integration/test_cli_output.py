"""What the CLI prints: messages read as prose, user data survives markup and narrow
terminals, --json for machines, and help that says what each command and option does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from pg_schema import schema_exists
from tokenline import App, JobState
from tokenline._clock import FakeClock
from tokenline._errors import StaleTokenError
from tokenline._jobs import NewJob, WorkerRecord
from tokenline._records import Start
from tokenline.cli import main
from tokenline.cli._common import print_table
from tokenline.cli.drill import results_table
from tokenline.drill.checker import Report
from tokenline.drill.runner import ScenarioResult
from tokenline.stores import Store, store_from_url

#: Output as it goes to a pipe: no terminal, no width asked for.
PIPED: dict[str, str | None] = {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
#: Output on a terminal 80 columns wide.
NARROW: dict[str, str | None] = {**PIPED, "COLUMNS": "80"}

LONG_ERROR = (
    "InvoiceError: the customer has no billing address on file, so the invoice for this "
    "order cannot be issued until someone adds one"
)


def cli(*args: str, env: Mapping[str, str | None] = PIPED) -> tuple[int, str]:
    """Run the CLI as a pipe would see it (stdout and stderr together)."""
    result = CliRunner().invoke(main, list(args), env=dict(env), catch_exceptions=False)
    return result.exit_code, result.output


def store_run(url: str, fn: Any) -> Any:
    """Run ``fn(store)`` on an open store for ``url``."""

    async def run() -> Any:
        store = store_from_url(url)
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def task_app(url: str) -> App:
    app = App(url)
    app.task(name="send_invoice", queue="billing", max_attempts=3)(lambda ctx, n: None)
    app.task(name="report", queue="billing")(lambda ctx, text: None)
    return app


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite store holding, in the billing queue: 1 succeeded send_invoice (key
    invoice:42), 2 dead (a long error), 3 dead report job whose key, argument, error and
    worker are full of square brackets, 4 queued, and a stale commit on invoice:44;
    and one live worker, w-[1]."""
    u = f"sqlite:///{tmp_path / 'out.db'}"
    app = task_app(u)

    async def seed(store: Store) -> None:
        await store.jobs_enqueue(
            jobs=[
                app.build_job("send_invoice", [42], idempotency_key="invoice:42"),
                app.build_job("send_invoice", [43], idempotency_key="invoice:43"),
                app.build_job("report", ["[bold]hi[/]"], idempotency_key="[k]"),
                app.build_job("send_invoice", [44], idempotency_key="invoice:44"),
            ]
        )
        done, failed = await store.jobs_claim(owner="w-1", queues=["billing"], limit=2, ttl=30)
        await store.job_complete(lease=done.lease)
        await store.job_dead(lease=failed.lease, error=LONG_ERROR)
        (odd,) = await store.jobs_claim(owner="w-[1]", queues=["billing"], limit=1, ttl=30)
        await store.job_dead(lease=odd.lease, error="[x] boom [bold]not bold[/]")
        (lost,) = await store.jobs_claim(owner="w-2", queues=["billing"], limit=1, ttl=0.05)
        await asyncio.sleep(0.2)
        await store.jobs_rescue()
        with pytest.raises(StaleTokenError):
            await store.job_complete(lease=lost.lease)
        now = await store.store_time()
        await store.worker_register(
            record=WorkerRecord(
                id="w-[1]", host="h", pid=1, queues=("billing",), concurrency=1,
                state="ready", token=0, started_at=now, heartbeat_at=now, expires_at=now,
            ),
            ttl=300,
        )  # fmt: skip

    store_run(u, seed)
    return u


def job_state(url: str, job_id: int) -> JobState:
    async def get(store: Store) -> JobState:
        return (await store.job_get(job_id=job_id)).state

    result: JobState = store_run(url, get)
    return result


# -- 10: prose, not "job(s)" ------------------------------------------------------------
def render(renderable: object, width: int = 200) -> str:
    """What ``renderable`` looks like on a plain terminal ``width`` columns wide."""
    out = Console(width=width, color_system=None, force_terminal=False)
    with out.capture() as captured:
        out.print(renderable)
    return captured.get()


def test_drill_results_count_one_job_in_the_singular() -> None:
    """The drill's table says "1 job" and "1 idle worker", not "1 jobs"."""
    report = Report(jobs=10, affected=1, recovery=2.0, idle_workers=1)
    result = ScenarioResult("kill9", "sqlite", report, lease_ttl=2.0, elapsed=3.0)
    out = render(results_table([result], title="drill"))
    assert "(1 job)" in out
    assert "(1 idle worker)" in out
    assert "1 jobs" not in out


@pytest.mark.parametrize("env", [PIPED, NARROW], ids=["piped", "80 columns"])
def test_drill_tables_are_whole_when_piped(
    env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Piped (into a file, a ticket, `| cat`), the drill's table was cut to 80 columns:
    "kil…", "los…", headers wrapped over lines. Piped, it is printed as wide as it needs,
    as listings are; on a terminal, it still fits the terminal."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    report = Report(jobs=2000, affected=3, recovery=12.5, idle_workers=1)
    results = [
        ScenarioResult(name, "postgres", report, lease_ttl=2.0, elapsed=3.0)
        for name in ("partition_lease_store", "lost_ack", "kill9")
    ]
    print_table(results_table(results, title="tokenline drill — postgres, lease TTL 2s, seed 7"))
    lines = capsys.readouterr().out.splitlines()
    if env is NARROW:
        assert max(len(line) for line in lines) <= 80
        return
    assert max(len(line) for line in lines) > 80
    header = next(line for line in lines if "scenario" in line)
    for name in ("dup. effects", "early rescues", "dup. executions", "rescued (bound)", "verdict"):
        assert name in header
    for name in ("partition_lease_store", "lost_ack", "kill9"):
        assert any(name in line and "12.5s (3 jobs)" in line for line in lines), name
    assert not any("…" in line for line in lines)


def test_counts_in_messages_read_as_prose(url: str) -> None:
    """Counts agree with their nouns ("requeued 1 dead job", "1 stale write", "1 key"),
    and no message hedges with "(s)"."""
    outputs = [cli("dlq", "retry", "--url", url, "2"), cli("audit", "duplicates", "--url", url)]
    assert "requeued 1 dead job: 2" in outputs[0][1]
    assert (
        "0 duplicate executions, 0 reruns after an unknown outcome, 1 stale write refused, 1 key"
        in outputs[1][1]
    )
    outputs.append(cli("dlq", "discard", "--url", url, "3"))
    assert "discarded 1 dead job: 3" in outputs[2][1]
    for _code, out in outputs:
        assert "(s)" not in out


# -- 3: user data is never read as markup ---------------------------------------------------
def test_a_config_error_keeps_its_square_brackets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown setting in a TOML file is reported with the table name as written:
    "in [tokenline.worker] of 'bad.toml'", not "in  of 'bad.toml'"."""
    module = f"cli_output_app_{uuid.uuid4().hex[:8]}"
    store = f"sqlite:///{tmp_path / 'w.db'}"
    (tmp_path / f"{module}.py").write_text(f"import tokenline\napp = tokenline.App({store!r})\n")
    (tmp_path / "bad.toml").write_text("[tokenline.worker]\nconcurency = 5\n")
    monkeypatch.chdir(tmp_path)
    code, out = cli("worker", "--app", f"{module}:app", "--config", "bad.toml")
    assert code == 2  # a bad setting: nothing was done
    assert "unknown setting in [tokenline.worker] of 'bad.toml'" in " ".join(out.split())


def test_square_brackets_in_job_data_print_as_written(url: str) -> None:
    """A key, an argument, an error and a worker id holding "[bold]" or "[x]" are
    printed as they are stored, in listings and in the job view."""
    code, out = cli("jobs", "--url", url)
    assert code == 0
    assert "[k]" in out
    assert "[x] boom [bold]not bold[/]" in out
    code, out = cli("dlq", "list", "--url", url)
    assert "[x] boom [bold]not bold[/]" in out
    code, out = cli("job", "--url", url, "3")
    assert code == 0
    assert "[bold]hi[/]" in out  # the argument
    assert "key [k]" in out
    assert "w-[1]" in out  # the attempt's worker
    assert out.count("[x] boom [bold]not bold[/]") == 2  # last error, and the attempt's
    code, out = cli("workers", "--url", url)
    assert "w-[1]" in out


def test_a_line_break_in_a_stored_error_cannot_forge_a_line_of_the_job_view(
    tmp_path: Path,
) -> None:
    """A handler's error holding a line break printed, in `tokenline job ID`, a second
    line of the handler's choosing under "last error", one that read as tokenline's own.
    The break is written as \\x0a, as in the listings and the logs."""
    u = f"sqlite:///{tmp_path / 'forged.db'}"
    app = task_app(u)
    forged = "boom\n2026-12-05 10:00:00 INFO tokenline.worker: job 1 succeeded"

    async def seed(store: Store) -> None:
        await store.jobs_enqueue(jobs=[app.build_job("report", ["x"])])
        (c,) = await store.jobs_claim(owner="w-1", queues=["billing"], limit=1, ttl=30)
        await store.job_dead(lease=c.lease, error=forged)

    store_run(u, seed)
    code, out = cli("job", "--url", u, "1", env={**PIPED, "COLUMNS": "300"})
    assert code == 0, out
    assert not any(line.startswith("2026-12-05") for line in out.splitlines()), out
    assert "last error boom\\x0a2026-12-05 10:00:00 INFO tokenline.worker" in out


def test_an_error_quoting_user_input_prints_it_as_written() -> None:
    """An error that quotes what the user typed shows it whole, markup-like text and
    all."""
    code, out = cli("enqueue", "--app", "any:app", "t", '{"note": "[bold]x[/]"}')
    assert code == 2
    assert """ARGS must be a JSON array, got '{"note": "[bold]x[/]"}'""" in out


# -- 4: tables keep names whole; --json --------------------------------------------------------
@pytest.mark.parametrize("env", [PIPED, NARROW], ids=["piped", "80 columns"])
def test_listings_keep_names_whole(url: str, env: dict[str, str | None]) -> None:
    """Piped, or on a terminal 80 columns wide, queue, task, state and key names appear
    whole; a long error is cut at a cell's end with "…", never silently."""
    code, out = cli("jobs", "--url", url, env=env)
    assert code == 0
    for name in ("billing", "send_invoice", "succeeded", "invoice:42", "invoice:43"):
        assert name in out
    assert "InvoiceError: the" in out
    assert LONG_ERROR not in out
    assert "…" in out
    code, out = cli("queues", "--url", url, env=env)
    for name in ("billing", "scheduled", "succeeded", "running", "queued", "dead"):
        assert name in out
    code, out = cli("job", "--url", url, "2", env=env)
    assert "send_invoice" in out
    assert "billing" in out
    for command in (["jobs"], ["queues"], ["workers"], ["dlq", "list"]):
        code, out = cli(*command, "--url", url, env=env)
        assert code == 0
        assert "billing" in out
        if env is NARROW:
            assert max(len(line) for line in out.splitlines()) <= 80, command


def test_narrow_terminal_says_which_columns_it_left_out(url: str) -> None:
    """At 80 columns the jobs listing leaves out its least needed columns and says so,
    instead of cutting the names."""
    out = cli("jobs", "--url", url, env=NARROW)[1]
    assert "not shown, too narrow: token, run at; see --json" in out
    out = cli("jobs", "--url", url, env=PIPED)[1]
    assert "run at" in out
    assert "not shown" not in out


def loads(*args: str) -> Any:
    code, out = cli(*args)
    assert code == 0, out
    return json.loads(out)


def test_every_listing_prints_json_with_the_stored_data(url: str) -> None:
    """--json on each listing prints one JSON document with the stored values."""
    jobs = loads("jobs", "--url", url, "--json")
    by_id = {j["id"]: j for j in jobs}
    assert by_id[1]["task"] == "send_invoice"
    assert by_id[1]["queue"] == "billing"
    assert by_id[1]["state"] == "succeeded"
    assert by_id[1]["idempotency_key"] == "invoice:42"
    assert by_id[1]["args"] == [42]
    assert by_id[2]["last_error"] == LONG_ERROR
    assert by_id[3]["args"] == ["[bold]hi[/]"]
    dead = loads("dlq", "list", "--url", url, "--json")
    assert sorted(j["id"] for j in dead) == [2, 3]
    one = loads("job", "--url", url, "--json", "2")
    assert one["id"] == 2
    assert one["last_error"] == LONG_ERROR
    assert one["earlier_attempts"] == 0
    assert [(a["owner"], a["outcome"], a["counted_as"]) for a in one["attempts"]] == [
        ("w-1", "dead", "attempt")
    ]
    queues = loads("queues", "--url", url, "--json")
    assert queues == [
        {
            "queue": "billing",
            "counts": {
                "scheduled": 0,
                "queued": 1,
                "running": 0,
                "succeeded": 1,
                "dead": 2,
                "cancelled": 0,
            },
            "oldest_ready_age": queues[0]["oldest_ready_age"],
            "paused": False,
        }
    ]
    workers = loads("workers", "--url", url, "--json")
    assert [(w["id"], w["alive"], w["queues"]) for w in workers] == [("w-[1]", True, ["billing"])]
    status = loads("status", "--url", url, "--json")
    assert status["store"] == "ok"
    assert {n: c["ok"] for n, c in status["channels"].items()} == {
        "broker": True,
        "leases": True,
        "ledger": True,
    }
    assert [{**q, "oldest_ready_age": None} for q in status["queues"]] == [
        {**q, "oldest_ready_age": None} for q in queues
    ]
    assert [w["id"] for w in status["workers"]] == ["w-[1]"]
    assert status["stale_commits"]["total"] == 1
    assert status["stale_commits"]["recent"][0]["job_id"] == 4
    audit = loads("audit", "duplicates", "--url", url, "--json")
    assert (audit["repeats"], audit["reruns"], audit["stale"]) == (0, 0, 1)
    assert [(k["key"], k["jobs"], k["workers"]) for k in audit["keys"]] == [
        ("invoice:44", [4], ["w-2"])
    ]


def test_audit_lists_an_effect_rerun_after_an_unknown_outcome_first(tmp_path: Path) -> None:
    """An effect whose attempt lost its lease while the callee ran was taken over and
    run again, and `audit duplicates` did not list it, while it listed the repeats
    that returned a stored result: the one place the effect may have happened twice
    was missing. Reruns have a column, a count and come first."""
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    clock = FakeClock()

    async def scene(store: Store) -> None:
        def job() -> NewJob:
            return NewJob(queue="default", task="t", args="[]")

        await store.jobs_enqueue(jobs=[job(), job(), job()])
        lost, done, again = [
            (await store.jobs_claim(owner=o, queues=["default"], limit=1, ttl=t))[0]
            for o, t in (("w1", 5), ("w2", 60), ("w3", 60))
        ]
        assert (await store.effect_begin(lease=lost.lease, key="charge:9")).start is Start.RUN
        assert (await store.effect_begin(lease=done.lease, key="mail:1")).start is Start.RUN
        assert await store.effect_finish(lease=done.lease, key="mail:1", result="1")
        assert (await store.effect_begin(lease=again.lease, key="mail:1")).start is Start.DONE
        clock.advance(6)  # w1's lease is gone, its callee's outcome unknown
        assert (await store.effect_begin(lease=again.lease, key="charge:9")).start is Start.RUN

    async def run() -> None:
        store = store_from_url(url, clock=clock)
        await store.open()
        try:
            await scene(store)
        finally:
            await store.close()

    asyncio.run(run())
    audit = json.loads(cli("audit", "duplicates", "--url", url, "--json")[1])
    assert (audit["repeats"], audit["reruns"], audit["stale"]) == (1, 1, 0)
    assert [(k["key"], k["repeats"], k["reruns"]) for k in audit["keys"]] == [
        ("charge:9", 0, 1),
        ("mail:1", 1, 0),
    ]
    code, out = cli("audit", "duplicates", "--url", url, env={**PIPED, "COLUMNS": "200"})
    assert code == 0, out
    assert "1 duplicate execution, 1 rerun after an unknown outcome" in out
    lines = out.splitlines()
    header = next(line for line in lines if "reruns" in line)
    assert header.split()[:4] == ["key", "repeats", "reruns", "stale"]
    rows = [line.split()[:4] for line in lines if line.split()[:1] in (["charge:9"], ["mail:1"])]
    assert rows == [["charge:9", "0", "1", "0"], ["mail:1", "1", "0", "0"]]


def test_workers_show_their_adaptive_limit_and_a_drain_request_not_yet_begun(
    tmp_path: Path,
) -> None:
    """`tokenline workers` shows each worker's adaptive limit out of its concurrency
    ("-" before it reported one), and marks a worker asked to drain that has not begun
    draining "(drain requested)"; --json has concurrency_limit and drain_requested."""
    u = f"sqlite:///{tmp_path / 'workers.db'}"

    async def seed(store: Store) -> None:
        now = await store.store_time()
        for wid, concurrency, state, limit, drain in (
            ("w-busy", 10, "processing", 7, True),
            ("w-new", 4, "ready", None, False),
            ("w-going", 8, "draining", 2, True),
        ):
            rec = await store.worker_register(
                record=WorkerRecord(wid, "h", 1, ("billing",), concurrency, state, 0, now, now,
                                    now),
                ttl=300,
            )  # fmt: skip
            await store.worker_heartbeat(
                worker_id=wid, token=rec.token, state=state, in_flight=limit or 0, ttl=300,
                concurrency_limit=limit,
            )  # fmt: skip
            if drain:
                assert await store.worker_drain(worker_id=wid)

    store_run(u, seed)
    code, out = cli("workers", "--url", u)
    assert code == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("w-")}
    assert "processing (drain requested)" in rows["w-busy"]
    assert " 7/10 " in rows["w-busy"]
    assert " ready " in rows["w-new"]
    assert "drain requested" not in rows["w-new"]
    assert " -/4 " in rows["w-new"]
    assert " draining " in rows["w-going"]
    assert "drain requested" not in rows["w-going"]
    assert " 2/8 " in rows["w-going"]
    listed = {w["id"]: w for w in loads("workers", "--url", u, "--json")}
    assert {wid: (w["state"], w["concurrency_limit"], w["drain_requested"])
            for wid, w in listed.items()} == {
        "w-busy": ("processing", 7, True),
        "w-new": ("ready", None, False),
        "w-going": ("draining", 2, True),
    }  # fmt: skip


# -- 5: status says what is true --------------------------------------------------------------
def test_status_on_a_reachable_postgres_without_the_schema(postgres_server: str) -> None:
    """A PostgreSQL server that answers but has no tokenline schema (and migrating on
    open is off) is reported reachable, with the schema not installed and the command
    that installs it; not as unreachable."""
    import psycopg

    schema = f"tl_status_{uuid.uuid4().hex[:8]}"
    u = f"{postgres_server}?schema={schema}"
    env = {**PIPED, "TOKENLINE_MIGRATE": "0"}
    try:
        code, out = cli("status", "--url", u, env=env)
        assert code == 1
        assert "UNREACHABLE" not in out
        assert "reachable" in out
        flat = " ".join(out.split())
        assert "not installed" in flat
        assert "run `tokenline migrate`" in flat
        code, out = cli("status", "--url", u, "--json", env=env)
        assert code == 1
        report = json.loads(out)
        assert report["store"] == "schema not ready"
        assert "not installed" in report["error"]
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_status_creates_no_postgres_schema_that_is_not_there(
    postgres_server: str, absent_schema: str
) -> None:
    """With migrating on open left on (the default), status on a schema that is not
    installed says so, as above, and installs nothing: a mistyped ?schema= used to get
    a new, empty, healthy-looking store."""
    code, out = cli("status", "--url", f"{postgres_server}?schema={absent_schema}", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "schema not ready"
    assert "is not installed" in report["error"]
    assert "run `tokenline migrate`" in report["error"]
    assert not schema_exists(postgres_server, absent_schema)


@pytest.mark.parametrize("redis_up", [True, False])
def test_split_status_without_the_ledger_schema_still_probes_redis(
    postgres_server: str, absent_schema: str, redis_url: str, redis_up: bool
) -> None:
    """A new split topology: the ledger's schema is not installed (and status installs
    none), and Redis is probed all the same, so a Redis that is down is said to be
    unreachable rather than to need a migration."""
    from tokenline.stores import split_url

    broker = redis_url if redis_up else "redis://127.0.0.1:1/0"
    u = split_url(broker=broker, ledger=f"{postgres_server}?schema={absent_schema}")
    code, out = cli("status", "--url", u, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "schema not ready"
    failures = {name: c["failure"] for name, c in report["channels"].items()}
    redis_state = "not migrated" if redis_up else "unreachable"
    assert failures == {"broker": redis_state, "leases": redis_state, "ledger": "not migrated"}
    if not redis_up:
        assert "Redis" in report["channels"]["broker"]["error"]
    assert (report["queues"], report["workers"]) == (None, None)
    assert not schema_exists(postgres_server, absent_schema)


def test_status_calls_a_broker_whose_writes_wait_slow_on_sqlite(url: str) -> None:
    """Another connection holds the file's write lock: reads still answer, but every
    enqueue, claim and finish waits. The broker channel said "ok"; it now fails as slow
    while the lock is held, and is ok again once it is let go."""
    path = url[len("sqlite:///") :]
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as holder:
        holder.execute("BEGIN IMMEDIATE")
        code, out = cli("status", "--url", url, "--timeout", "1", "--json")
        holder.execute("ROLLBACK")
    assert code == 1
    broker = json.loads(out)["channels"]["broker"]
    assert (broker["ok"], broker["failure"]) == (False, "slow"), broker
    assert "write lock" in broker["error"]
    code, out = cli("status", "--url", url, "--timeout", "5", "--json")
    assert json.loads(out)["channels"]["broker"]["ok"] is True, out


@pytest.mark.parametrize(
    ("table", "slowed"),
    [
        ("jobs", {"broker", "leases"}),
        ("attempts", {"broker"}),
        ("unique_keys", {"broker"}),
        ("workers", {"leases"}),
        ("open_blocks", {"ledger"}),
        ("effects", {"ledger"}),
    ],
)
def test_status_calls_a_channel_slow_when_any_table_it_writes_is_held(
    postgres_server: str, absent_schema: str, table: str, slowed: set[str]
) -> None:
    """A session holding a table against writes (LOCK TABLE … IN EXCLUSIVE MODE, which
    reads pass; a VACUUM FULL, a CLUSTER) stalls every channel that writes it: only the
    jobs table was looked at, and with attempts (claims and finishes), open_blocks
    (every fenced transaction) or workers (heartbeats) held, status said every channel
    was ok. Each channel that writes the table is now slow, naming it; the others stay
    ok."""
    import psycopg

    u = f"{postgres_server}?schema={absent_schema}"
    assert cli("migrate", "--url", u)[0] == 0
    with psycopg.connect(postgres_server) as holder:
        holder.execute(f"LOCK TABLE {absent_schema}.{table} IN EXCLUSIVE MODE")
        code, out = cli("status", "--url", u, "--timeout", "1", "--json")
        holder.rollback()
    assert code == 1
    channels = json.loads(out)["channels"]
    for name in slowed:
        slow = channels[name]
        assert (slow["ok"], slow["failure"]) == (False, "slow"), channels
        assert f"the {table} table" in slow["error"], slow
    assert all(c["ok"] for name, c in channels.items() if name not in slowed), channels
    code, out = cli("status", "--url", u, "--timeout", "5", "--json")
    assert all(c["ok"] for c in json.loads(out)["channels"].values()), out


def test_status_leaves_a_sqlite_file_of_other_tables_as_it_was(tmp_path: Path) -> None:
    """A database of the user's own tables: status says it holds no tokenline store and
    writes nothing into it."""
    import sqlite3

    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
        conn.commit()
    before = path.read_bytes()
    code, out = cli("status", "--url", f"sqlite:///{path}")
    assert code == 1
    assert "holds no tokenline store" in " ".join(out.split())
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]


def test_status_on_a_sqlite_file_that_does_not_exist(tmp_path: Path) -> None:
    """status on a SQLite path with no file says so and leaves no empty store behind."""
    missing = tmp_path / "typo.db"
    code, out = cli("status", "--url", f"sqlite:///{missing}")
    assert code == 1
    assert "no store file" in out
    assert "UNREACHABLE" not in out
    assert not missing.exists()


def test_status_names_its_channels(url: str) -> None:
    """status reports broker, leases and ledger each, saying what each carries."""
    code, out = cli("status", "--url", url)
    assert code == 0
    for line in ("broker  ok", "leases  ok", "ledger  ok"):
        assert line in out
    assert "the queue" in out
    assert "job ownership" in out
    assert "effects and fenced writes" in out


# -- 6: dlq retry / discard name what they could not do ------------------------------------
def test_dlq_retry_names_each_id_it_cannot_requeue(url: str) -> None:
    """dlq retry of a missing job and of a succeeded one names each with the reason and
    exits 1; the dead job given with them is still requeued."""
    code, out = cli("dlq", "retry", "--url", url, "99999", "1", "2")
    assert code == 1
    assert "requeued 1 dead job: 2" in out
    assert "not requeued: job 99999: no such job" in out
    assert "not requeued: job 1: not dead: its state is succeeded" in out
    assert job_state(url, 2) is JobState.QUEUED
    code, out = cli("dlq", "retry", "--url", url, "99999")
    assert code == 1
    assert "requeued 0 dead jobs" in out


def test_dlq_discard_names_each_id_it_cannot_discard(url: str) -> None:
    """dlq discard does the same: the dead one is discarded, the others are named."""
    code, out = cli("dlq", "discard", "--url", url, "4", "3", "12345")
    assert code == 1
    assert "discarded 1 dead job: 3" in out
    assert "not discarded: job 4: not dead: its state is queued" in out
    assert "not discarded: job 12345: no such job" in out
    assert job_state(url, 3) is JobState.CANCELLED
    assert job_state(url, 4) is JobState.QUEUED


@pytest.mark.parametrize("verb", ["retry", "discard"])
@pytest.mark.parametrize("ids", [["3"], ["999999"]], ids=["dead", "unknown"])
def test_dlq_refuses_ids_with_all(url: str, verb: str, ids: list[str]) -> None:
    """Ids with --all acted on every dead job, ignoring the ids (or said "0 dead jobs"
    for an unknown id): refused as a usage error naming both, nothing done."""
    code, out = cli("dlq", verb, "--url", url, *ids, "--all")
    assert code == 2
    assert f"give job ids ({ids[0]}) or --all, not both" in out
    assert (job_state(url, 2), job_state(url, 3)) == (JobState.DEAD, JobState.DEAD)


# -- 7: a DLQ retry resets the budget, and the job view says so -----------------------------
def test_a_job_retried_from_the_dlq_shows_its_fresh_budget(tmp_path: Path) -> None:
    """A job that used its 3 attempts and was retried from the DLQ runs as attempt 1/3,
    and the job view says it was retried and how many attempts came before."""
    u = f"sqlite:///{tmp_path / 'budget.db'}"
    app = task_app(u)

    async def fail_three_times(store: Store) -> int:
        (jid,) = await store.jobs_enqueue(jobs=[app.build_job("send_invoice", [1])])
        for _ in range(2):
            (c,) = await store.jobs_claim(owner="w-1", queues=["billing"], limit=1, ttl=30)
            await store.job_retry(lease=c.lease, delay=0, error="timeout")
        (c,) = await store.jobs_claim(owner="w-1", queues=["billing"], limit=1, ttl=30)
        await store.job_dead(lease=c.lease, error="gave up")
        return jid

    jid = store_run(u, fail_three_times)
    assert cli("dlq", "retry", "--url", u, str(jid))[0] == 0

    async def claim(store: Store) -> None:
        await store.jobs_claim(owner="w-2", queues=["billing"], limit=1, ttl=30)

    store_run(u, claim)
    code, out = cli("job", "--url", u, str(jid))
    assert code == 0
    assert "attempt 1/3 (retried from the DLQ; 3 earlier attempts)" in out
    assert loads("job", "--url", u, "--json", str(jid))["earlier_attempts"] == 3


# -- help ---------------------------------------------------------------------------------------
def walk(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    """Every command under ``group``, named as typed."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        yield " ".join((*path, name)), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))


COMMANDS = dict(walk(main))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_a_whole_summary_and_every_option_its_help(name: str) -> None:
    """A command's summary is a whole sentence (not cut at "(e.g." or with "..."), and
    each of its options says what it does."""
    cmd = COMMANDS[name]
    summary = cmd.get_short_help_str(limit=sys.maxsize)
    assert summary.endswith("."), summary
    assert not summary.endswith(("...", "e.g.", "i.e.")), summary
    assert summary.count("(") == summary.count(")"), summary
    lacking = [
        p.name
        for p in cmd.params
        if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()
    ]
    assert lacking == [], f"{name}: options without help: {lacking}"


@pytest.mark.parametrize("group", ["", "dlq", "audit"])
def test_command_listings_are_never_cut(group: str) -> None:
    """`tokenline --help` (and each group's) lists every summary whole at 80 columns."""
    code, out = cli(*group.split(), "--help", env=NARROW)
    assert code == 0
    commands = out.split("Commands:")[1]
    assert "..." not in commands
    names = [n for n in COMMANDS if n.startswith(group) and n.count(" ") == bool(group)]
    for name in names:
        summary = " ".join(COMMANDS[name].get_short_help_str(limit=sys.maxsize).split())
        assert summary in " ".join(commands.split())


def test_messages_never_break_a_path_at_the_terminal_width(tmp_path: Path) -> None:
    """On a narrow terminal a message stays one line: a path or URL in it stays whole,
    for whoever copies it or greps for it."""
    deep = tmp_path / ("d" * 60) / "nowhere" / "store.db"
    result = CliRunner().invoke(
        main, ["status", "--url", f"sqlite:///{deep}"], env={"COLUMNS": "40"}
    )
    assert result.exit_code == 1
    assert str(deep.parent) in result.output


# -- control characters in stored text never reach the terminal ---------------------------------
EVIL = "boom\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe\r\x7f"


@pytest.fixture
def evil_url(tmp_path: Path) -> str:
    """A store whose dead job carries terminal control sequences in its error, argument
    and worker name, and an effect of it with them in its result (keys refuse them)."""
    u = f"sqlite:///{tmp_path / 'evil.db'}"
    app = task_app(u)

    async def seed(store: Store) -> None:
        await store.jobs_enqueue(jobs=[app.build_job("report", [EVIL], idempotency_key="k:1")])
        (c,) = await store.jobs_claim(owner="w\x1b[5m", queues=["billing"], limit=1, ttl=30)
        await store.effect_begin(lease=c.lease, key="fx")
        await store.effect_finish(lease=c.lease, key="fx", result=EVIL)
        await store.job_dead(lease=c.lease, error=EVIL)

    store_run(u, seed)
    return u


@pytest.mark.parametrize(
    "args",
    [["job", "1"], ["jobs"], ["dlq", "list"], ["jobs", "--state", "dead"]],
    ids=lambda a: " ".join(a),
)
def test_control_characters_in_stored_text_are_escaped(evil_url: str, args: list[str]) -> None:
    """A raw ESC in a stored error went straight to the terminal (``tokenline job``), where
    it can retitle the window, clear the screen or hide text. Every human listing now
    shows control characters as escapes."""
    code, out = cli(*args, "--url", evil_url, env=NARROW)
    assert code == 0, out
    for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\r", "\x7f"):
        assert raw not in out, (raw, out)
    if args == ["job", "1"]:
        assert "\\x1b]0;owned\\x07\\x1b[2J" in out
        assert "\\u202egnp.exe" in out
        assert "w\\x1b[5m" in out  # the worker's name, in the attempts


#: Keys that differ only by a character that shows as nothing or as a line break.
LOOKALIKE_KEYS = ["u\u2028tail:0", "u\u2029tail:0", "u\u200btail:0", "u\ufefftail:0", "utail:0"]


@pytest.mark.parametrize("args", [["jobs"], ["jobs", "--state", "queued"]], ids=" ".join)
def test_keys_that_differ_never_look_the_same(tmp_path: Path, args: list[str]) -> None:
    """A key holding a line or paragraph separator was split in the listing, its tail
    dropped, and one holding a zero-width space or a byte-order mark looked the same as
    the key without it. Each such character now shows as its escape, the key whole."""
    u = f"sqlite:///{tmp_path / 'lookalike.db'}"
    app = task_app(u)

    async def seed(store: Store) -> None:
        jobs = [app.build_job("report", ["x"], idempotency_key=k) for k in LOOKALIKE_KEYS]
        await store.jobs_enqueue(jobs=jobs)

    store_run(u, seed)
    code, out = cli(*args, "--url", u, env=NARROW)
    assert code == 0, out
    for shown in ("u\\u2028tail:0", "u\\u2029tail:0", "u\\u200btail:0", "u\\ufefftail:0"):
        assert shown in out, (shown, out)
    for raw in ("\u2028", "\u2029", "\u200b", "\ufeff"):
        assert raw not in out
    assert out.count("tail:0") == len(LOOKALIKE_KEYS)


def test_json_output_is_valid_utf8_whatever_the_store_holds(tmp_path: Path) -> None:
    """An argument with a lone surrogate (JSON allows one, escaped) made ``job --json``
    write bytes that are not UTF-8. Every --json output now writes such a character as
    its escape, \\udcff, keeps other text as it is, and reads back to what is stored."""
    u = f"sqlite:///{tmp_path / 'surrogate.db'}"
    app = task_app(u)
    text_arg = "bad byte \udcff in é"

    async def seed(store: Store) -> None:
        await store.jobs_enqueue(jobs=[app.build_job("report", [text_arg])])
        (c,) = await store.jobs_claim(owner="w-1", queues=["billing"], limit=1, ttl=30)
        await store.job_dead(lease=c.lease, error="no")

    store_run(u, seed)
    for args in (["job", "1"], ["jobs"], ["dlq", "list"]):
        out = subprocess.run(
            [sys.executable, "-m", "tokenline", *args, "--url", u, "--json"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        text = out.stdout.decode("utf-8")  # strict: raises on invalid UTF-8
        data = json.loads(text)
        job = data if isinstance(data, dict) else data[0]
        assert job["args"] == [text_arg]
        assert "é" in text


def test_bytes_where_the_store_keeps_text_print_as_hex(url: str) -> None:
    """A BLOB in a SQLite text column (a hand-edited row) made every --json listing of it
    fail on bytes JSON cannot hold, a table of its key fail, and audit fail to sort it
    among text. Each prints such a value as <bytes: HEX>, never as the text it might
    decode to."""
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(
            "UPDATE tokenline_jobs SET args = x'5b315d', idempotency_key = x'fffe00', "
            "last_error = x'00ff' WHERE id = 3"
        )
        db.execute(
            "INSERT INTO tokenline_stale_commits (job_id, token, owner, operation, at) "
            "SELECT job_id, token, x'fffe00', operation, at FROM tokenline_stale_commits"
        )
    for args in (["jobs"], ["job", "3"], ["dlq", "list"]):
        code, out = cli(*args, "--url", url, "--json")
        assert code == 0, out
        data = json.loads(out)
        job = data if isinstance(data, dict) else next(j for j in data if j["id"] == 3)
        assert (job["args"], job["kwargs"]) == ("<bytes: 5b315d>", {})
        assert (job["idempotency_key"], job["last_error"]) == ("<bytes: fffe00>", "<bytes: 00ff>")
    code, out = cli("jobs", "--url", url)
    assert (code, "<bytes: fffe00>" in out) == (0, True), out
    code, out = cli("job", "3", "--url", url)
    assert (code, "args <bytes: 5b315d>" in out) == (0, True), out
    code, out = cli("audit", "duplicates", "--url", url, "--json")
    assert code == 0, out
    assert "<bytes: fffe00>" in json.loads(out)["keys"][0]["workers"]


def test_job_names_a_rerun_as_the_audit_counts_it(tmp_path: Path) -> None:
    """`tokenline job ID` showed a rerun after an unknown outcome as "repeat
    effect_rerun", while `tokenline audit duplicates` counted it as a rerun."""
    from tokenline._jobs import Finish, Outcome

    url = f"sqlite:///{tmp_path / 'rerun.db'}"
    app = App(url)

    async def rerun(store: Any) -> int:
        (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        (first,) = await store.jobs_claim(owner="a", queues=["default"], limit=1, ttl=60)
        await store.effect_begin(lease=first.lease, key="charge:9")  # pending under it
        await store.jobs_finish(finishes=[Finish(first.lease, Outcome.RELEASE, 0.0, "x", "y")])
        (second,) = await store.jobs_claim(owner="b", queues=["default"], limit=1, ttl=60)
        await store.effect_begin(lease=second.lease, key="charge:9")  # takes it over
        return int(jid)

    jid = app.run(rerun)
    app.close()
    result = CliRunner().invoke(main, ["job", str(jid), "--url", url])
    assert result.exit_code == 0, result.output
    assert "rerun effect_rerun on 'charge:9' by token 2" in result.output
    assert "repeat effect_rerun" not in result.output
