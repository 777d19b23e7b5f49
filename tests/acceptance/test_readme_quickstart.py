"""The README's quick start, as a new user runs it: its ``jobs.py`` copied out of the
README unchanged, ``python jobs.py`` to enqueue, ``tokenline worker`` to run — on SQLite
and on PostgreSQL."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.acceptance

README = Path(__file__).parent.parent.parent / "README.md"
DEADLINE = 120.0
TABLE = "CREATE TABLE invoices (order_id bigint, token bigint)"


def quickstart() -> str:
    """The ``# jobs.py`` code block of the README's quick start, as it is."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    match = re.search(r"```python\n(# jobs\.py\n.*?)```", section, re.S)
    assert match, "the README's quick start has no jobs.py block"
    return match.group(1)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """(URL, a function running SQL on the store's database) with the invoices table."""
    if request.param == "sqlite":
        db = tmp_path / "tokenline.db"
        with sqlite3.connect(db) as conn:
            conn.execute(TABLE)

        def sql(query: str) -> list[tuple[Any, ...]]:
            with sqlite3.connect(db) as conn:
                return conn.execute(query).fetchall()

        yield f"sqlite:///{db}", sql
        return
    import psycopg

    server: str = request.getfixturevalue("postgres_server")
    schema = f"tl_qs_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path TO {schema}")
        conn.execute(TABLE)

    def pg_sql(query: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {schema}")
            return conn.execute(query).fetchall()

    yield f"{server}?schema={schema}&options=-c%20search_path%3D{schema}", pg_sql
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_the_readme_quick_start_runs_unchanged(store: tuple[str, Any], tmp_path: Path) -> None:
    """Every invoice is written once, with the token of the attempt that wrote it, and
    the job with a negative order id is dead with its reason."""
    url, sql = store
    (tmp_path / "jobs.py").write_text(quickstart())
    env = {**os.environ, "TOKENLINE_URL": url, "PYTHONPATH": str(tmp_path), "COLUMNS": "250"}
    enqueue = subprocess.run(
        [sys.executable, "jobs.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert enqueue.returncode == 0, enqueue.stderr
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenline", "worker", "--app", "jobs:app", "--queues",
         "billing", "--concurrency", "20"],
        cwd=tmp_path, env=env, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if sql("SELECT count(*) FROM invoices")[0][0] >= 1000:
                break
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=DEADLINE)
        log.close()
    out = (tmp_path / "worker.log").read_text(errors="replace")
    rows = sql("SELECT order_id, count(*) FROM invoices GROUP BY order_id")
    assert len(rows) == 1000, out[-3000:]
    assert all(n == 1 for _, n in rows)
    status = subprocess.run(
        [sys.executable, "-m", "tokenline", "dlq", "list"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert "negative order id" in status.stdout, status.stdout + status.stderr
