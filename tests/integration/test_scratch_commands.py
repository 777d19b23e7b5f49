"""``demo``, ``drill`` and ``bench`` (and the benchmark scripts) run on a store of their
own: only the one ``--url`` names, never ``TOKENLINE_URL``; a fresh SQLite file in a
temporary directory by default, a fresh schema on PostgreSQL; and they leave nothing
behind unless told to keep it, and then say where it is."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tokenline.cli import main
from tokenline.drill._scratch import (
    MARKER_TABLE,
    ScratchInUseError,
    check_reusable,
    scratch_for,
)

# The module, not the command of the same name that tokenline.cli exports.
demo_cli = importlib.import_module("tokenline.cli.demo")

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@dataclass
class Sandbox:
    """A temporary directory, a working directory and a "production" SQLite file named
    by ``TOKENLINE_URL``: a command must leave all three as they were."""

    tmp: Path
    cwd: Path
    prod: Path

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "TMPDIR": str(self.tmp),
            "TOKENLINE_URL": f"sqlite:///{self.prod}",
            "COLUMNS": "200",
        }
        return subprocess.run(
            argv, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=timeout
        )

    def tokenline(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "tokenline", *args)

    def left(self) -> list[str]:
        """Everything now in the three places (all empty at the start)."""
        return sorted(str(p) for d in (self.tmp, self.cwd, self.prod.parent) for p in d.iterdir())


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    dirs = [tmp_path / name for name in ("tmp", "cwd", "prod")]
    for d in dirs:
        d.mkdir()
    return Sandbox(dirs[0], dirs[1], dirs[2] / "prod.db")


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


@pytest.mark.acceptance
def test_demo_ignores_tokenline_url_and_leaves_nothing(sandbox: Sandbox) -> None:
    """A passing demo on the default store: its directory, with the workers' logs, is
    removed; nothing appears in the working directory or beside TOKENLINE_URL's file."""
    result = sandbox.tokenline("demo", "--jobs", "40", "--workers", "2")
    assert result.returncode == 0, _explain(result)
    assert "every invoice written exactly once" in result.stdout
    assert str(sandbox.prod) not in result.stdout
    assert "left behind" not in result.stdout
    assert sandbox.left() == []


@pytest.mark.parametrize("how", ["raises", "invariant broken"])
def test_a_failed_demo_keeps_its_logs_and_says_where(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed demo keeps the workers' logs and prints the directory; it used to leave
    every run's logs in the temporary directory without a word."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def failing_run(
        backend: demo_cli.ScratchStore, jobs: int, workers: int, show_progress: bool
    ) -> demo_cli.DemoResult:
        (backend.work_dir / "worker-0.log").write_text("a worker's last words\n")
        if how == "raises":
            raise click.ClickException("the workers did not start")
        return demo_cli.DemoResult(jobs, jobs, 0, jobs, 0, 0, 0, 0, jobs + 1, 1, 0.0, 1.0)

    monkeypatch.setattr(demo_cli, "_run", failing_run)
    result = CliRunner().invoke(main, ["demo", "--jobs", "10", "--workers", "2"])
    assert result.exit_code == 1, result.output
    found = re.search(
        r"left behind: (\S+) \(kept: the run failed, its logs are there\)", result.output
    )
    assert found, result.output
    kept = Path(found.group(1))
    assert (kept / "worker-0.log").read_text() == "a worker's last words\n"
    assert list(tmp_path.iterdir()) == [kept]


@pytest.mark.acceptance
def test_bench_ignores_tokenline_url_and_leaves_nothing(sandbox: Sandbox) -> None:
    """bench measures on a SQLite file of its own and removes it; it prints the machine's
    core count and load average with the figures."""
    result = sandbox.tokenline("bench", "--jobs", "100", "--workers", "1", "--latency-samples", "3")
    assert result.returncode == 0, _explain(result)
    assert "throughput: 100 no-op jobs" in result.stdout
    assert re.search(r"worker CPU: [\d,]+ µs per job", result.stdout), result.stdout
    assert f"machine: {os.cpu_count()} cores, load average (1/5/15 min) " in result.stdout
    assert "left behind" not in result.stdout
    assert sandbox.left() == []


@pytest.mark.acceptance
def test_bench_keep_says_where_the_store_is(sandbox: Sandbox) -> None:
    """With --keep the store stays, and the output names it."""
    result = sandbox.tokenline(
        "bench", "--jobs", "100", "--workers", "1", "--latency-samples", "0", "--keep"
    )
    assert result.returncode == 0, _explain(result)
    found = re.search(r"left behind: (\S+) \(kept: --keep\)", result.stdout)
    assert found, result.stdout
    kept = Path(found.group(1))
    assert kept.parent == sandbox.tmp
    assert (kept / "tokenline_bench.db").is_file()
    assert sandbox.left() == [str(kept)]


def _schemas(url: str, like: str) -> set[str]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (like,))
        return {r[0] for r in rows.fetchall()}


def _default_schema_bench_jobs(url: str) -> int:
    """bench's jobs in the default ``tokenline`` schema, where it used to enqueue them."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('tokenline.jobs')").fetchone() == (None,):
            return 0
        row = conn.execute("SELECT count(*) FROM tokenline.jobs WHERE task = 'bench.noop'")
        return int(row.fetchone()[0])  # type: ignore[index]


@pytest.fixture
def env_schema(postgres_server: str) -> Iterator[str]:
    """A PostgreSQL URL in TOKENLINE_URL whose schema must never be created."""
    schema = f"tokenline_env_{uuid.uuid4().hex[:8]}"
    yield f"{postgres_server}?schema={schema}"
    assert _schemas(postgres_server, schema) == set()


@pytest.mark.acceptance
@pytest.mark.postgres
@pytest.mark.parametrize("keep", [False, True])
def test_bench_on_postgres_runs_in_a_fresh_schema_of_its_own(
    sandbox: Sandbox, postgres_server: str, env_schema: str, keep: bool
) -> None:
    """bench on PostgreSQL counts only its own jobs, in a fresh ``tokenline_bench_…``
    schema: dropped afterwards, or kept and named with --keep. It used to enqueue into
    the default schema, count earlier runs' jobs and leave them there."""
    before = _default_schema_bench_jobs(postgres_server)
    result = subprocess.run(
        [sys.executable, "-m", "tokenline", "bench", "--url", postgres_server,
         "--jobs", "100", "--workers", "1", "--latency-samples", "0",
         *(["--keep"] if keep else [])],
        env={**os.environ, "TMPDIR": str(sandbox.tmp), "TOKENLINE_URL": env_schema},
        cwd=sandbox.cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, _explain(result)
    found = re.search(r"schema=(tokenline_bench_[0-9a-f]{8})\b", result.stdout)
    assert found, result.stdout
    schema = found.group(1)
    try:
        assert _default_schema_bench_jobs(postgres_server) == before
        if keep:
            assert f"left behind: PostgreSQL schema {schema} (kept: --keep)" in result.stdout
            assert _schemas(postgres_server, schema) == {schema}
        else:
            assert "left behind" not in result.stdout
            assert _schemas(postgres_server, schema) == set()
        assert sandbox.left() == []
    finally:
        import psycopg

        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.acceptance
def test_make_bench_leaves_nothing(sandbox: Sandbox) -> None:
    """benchmarks/run.py (``make bench``) used to leave a bench.db behind each run."""
    result = sandbox.run(
        sys.executable, str(BENCHMARKS / "run.py"),
        "--jobs", "100", "--workers", "1", "--latency-samples", "0",
    )  # fmt: skip
    assert result.returncode == 0, _explain(result)
    assert f"machine: {os.cpu_count()} cores" in result.stdout
    assert sandbox.left() == []


@pytest.mark.acceptance
def test_ledger_bench_leaves_nothing(sandbox: Sandbox) -> None:
    """benchmarks/ledger_bench.py used to leave a directory per measurement."""
    result = sandbox.run(
        sys.executable, str(BENCHMARKS / "ledger_bench.py"), "--jobs", "50", "--rounds", "1"
    )
    assert result.returncode == 0, _explain(result)
    assert "with ctx.effect" in result.stdout
    assert sandbox.left() == []


@pytest.mark.acceptance
def test_claim_bench_reports_each_case_and_leaves_nothing(sandbox: Sandbox) -> None:
    """benchmarks/claim_bench.py: a median per case, the core count, nothing left."""
    result = sandbox.run(
        sys.executable, str(BENCHMARKS / "claim_bench.py"),
        "--backlog", "200", "--later", "300", "--claims", "3", "--size", "5",
    )  # fmt: skip
    assert result.returncode == 0, _explain(result)
    for case in ("runnable:", "later:", "due:", "baseline:", "spread:"):
        assert f"SQLite, {case}" in result.stdout, result.stdout
    assert f"{os.cpu_count()} cores" in result.stdout
    assert sandbox.left() == []


@pytest.mark.acceptance
def test_enqueue_many_bench_reports_each_kind_and_leaves_nothing(sandbox: Sandbox) -> None:
    """benchmarks/enqueue_many_bench.py: a median per kind of batch, the core count,
    nothing left."""
    result = sandbox.run(
        sys.executable, str(BENCHMARKS / "enqueue_many_bench.py"),
        "--jobs", "120", "--batch", "50", "--rounds", "1",
    )  # fmt: skip
    assert result.returncode == 0, _explain(result)
    for kind in ("plain:", "keyed:", "unique:"):
        assert f"SQLite, {kind}" in result.stdout, result.stdout
    assert f"{os.cpu_count()} cores" in result.stdout
    assert sandbox.left() == []


def _sink_tables(url: str) -> set[str]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables "
            "WHERE table_name LIKE 'tokenline_scenario_sink_%'"
        )
        return {r[0] for r in rows.fetchall()}


@pytest.mark.acceptance
@pytest.mark.postgres
def test_scenario_bench_checks_its_sink_and_leaves_nothing(
    sandbox: Sandbox, postgres_server: str
) -> None:
    """benchmarks/scenario_bench.py: the run passes only with every job in the sink
    exactly once, prints its medians with the core count, and removes its store file and
    its sink table."""
    before = _sink_tables(postgres_server)
    result = sandbox.run(
        sys.executable, str(BENCHMARKS / "scenario_bench.py"),
        "--jobs", "40", "--sink", postgres_server,
    )  # fmt: skip
    assert result.returncode == 0, _explain(result)
    assert '"processed_per_s"' in result.stdout
    assert f"(median of 1); {os.cpu_count()} cores" in result.stdout
    assert sandbox.left() == []
    assert _sink_tables(postgres_server) == before


@pytest.mark.acceptance
def test_drill_ignores_tokenline_url_and_leaves_nothing(sandbox: Sandbox) -> None:
    """One short scenario: the drill does not run on TOKENLINE_URL's store (it used to
    create files beside it), and removes its own files and logs."""
    result = sandbox.tokenline("drill", "--scenario", "kill9", "--jobs", "30", "--workers", "2")
    # The verdict is the drill tests' business; here: it ran (exit 2 is an error).
    assert result.returncode in (0, 1), _explain(result)
    assert "kill9:" in result.stdout
    assert "left behind" not in result.stdout
    assert sandbox.left() == []


@pytest.mark.parametrize("command", ["demo", "drill", "bench"])
def test_help_says_which_store_is_used(command: str) -> None:
    """Each command's --help says it runs on its own store and never reads TOKENLINE_URL
    (the drill used to read it without saying so)."""
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "TOKENLINE_URL is not read" in text
    assert "a fresh schema" in text
    assert "temporary director" in text
    assert "env var" not in text


def _somebodys_store(path: Path) -> bytes:
    """A SQLite file with a row in it, as a user's own store would be; its bytes."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total INTEGER)")
        conn.execute("INSERT INTO invoices VALUES (1, 4200)")
        conn.commit()
    return path.read_bytes()


@pytest.mark.parametrize(
    ("command", "named"),
    [("demo", "prod.db"), ("bench", "prod.db"), ("drill", "prod-kill9.db")],
)
def test_a_named_sqlite_file_with_data_is_refused_and_left_alone(
    command: str, named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``demo --url sqlite:///existing.db`` used to delete the file and its data; bench and
    the drill (a file per scenario beside the named one) did the same. Each now refuses a
    file that holds data it did not put there, with exit status 2, and touches nothing."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    before = _somebodys_store(tmp_path / named)
    args = [command, "--url", f"sqlite:///{tmp_path / 'prod.db'}"]
    if command == "drill":
        args += ["--scenario", "kill9"]
    result = CliRunner().invoke(main, args, terminal_width=200)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--overwrite" in text
    assert str(tmp_path / named) in text
    assert (tmp_path / named).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({named, "tmp"})
    assert list(scratch.iterdir()) == []


def test_a_scratch_file_of_the_same_command_is_recreated(tmp_path: Path) -> None:
    """The file a runner made in an earlier run is its own scratch store: the next run
    recreates it without asking; another runner's, or one with --overwrite, likewise only
    when told."""
    db = tmp_path / "demo.db"
    first = scratch_for(f"sqlite:///{db}", prefix="tokenline_demo")
    first.prepare({"demo_invoices": "order_id BIGINT"})
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("INSERT INTO demo_invoices VALUES (1)")
        conn.commit()
    assert first.scalar("SELECT count(*) FROM demo_invoices") == 1
    first.cleanup()
    again = scratch_for(f"sqlite:///{db}", prefix="tokenline_demo")
    again.prepare({"demo_invoices": "order_id BIGINT"})
    assert again.scalar("SELECT count(*) FROM demo_invoices") == 0
    again.cleanup()
    with pytest.raises(ScratchInUseError):
        scratch_for(f"sqlite:///{db}", prefix="tokenline_bench")
    _somebodys_store(tmp_path / "mine.db")
    forced = scratch_for(f"sqlite:///{tmp_path / 'mine.db'}", overwrite=True)
    forced.prepare({})
    assert forced.rows("SELECT name FROM sqlite_master WHERE name = 'invoices'") == []
    forced.cleanup()


def test_a_scratch_stores_coordination_file_is_reusable_only_beside_its_marked_file(
    tmp_path: Path,
) -> None:
    """A named store's ``-coord`` file has no marker of its own: beside a main file that
    the same command marked, a second run may recreate both (the drill runs twice on one
    ``--url``); beside a missing or foreign main file, it is someone else's data."""

    def sqlite_file(path: Path, marker: str | None) -> None:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute(
                "CREATE TABLE t (x)" if marker is None else f"CREATE TABLE {MARKER_TABLE} (made_by)"
            )
            if marker is not None:
                conn.execute(f"INSERT INTO {MARKER_TABLE} VALUES (?)", (marker,))
            conn.commit()

    db = tmp_path / "store.db"
    coord = tmp_path / "store.db-coord"
    sqlite_file(coord, None)
    with pytest.raises(ScratchInUseError, match=r"store\.db-coord"):
        check_reusable(db, "tokenline_drill")  # no main file: the coordination file is data
    sqlite_file(db, "tokenline_drill")
    check_reusable(db, "tokenline_drill")  # a scratch store of this command: reusable
    with pytest.raises(ScratchInUseError, match=r"store\.db'"):
        check_reusable(db, "tokenline_demo")  # another command's
