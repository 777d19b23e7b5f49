"""The operator's commands: leases, lease release, drain, and status channel by channel.

Each refusal (an unknown worker, a wrong owner or token) exits non-zero, says what did
not match, and leaves the store as it was. The status tests inject the drill's faults
through an app of the test tree (``statusfaultapp``), never through tokenline's own code.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from pg_schema import schema_at_version
from tokenline._clock import FakeClock
from tokenline._jobs import NewJob, WorkerRecord
from tokenline.cli import main
from tokenline.cli.status import CHANNELS
from tokenline.drill.scenarios import DRILL_SCENARIOS
from tokenline.drill.storefaults import RoleFaults, StoreFaults, write_fault_file
from tokenline.stores import MemoryStore, Store, store_from_url
from tokenline.stores.base import ResourceLease
from tokenline.stores.sqlite import SQLiteStore
from tokenline.stores.sqlite._connection import connect_coord, coord_path, statements
from tokenline.stores.sqlite.store import COORD_VERSION, CQ

T = TypeVar("T")


# -- the store side of drain ----------------------------------------------------------------
def _v1_coordination_file(main: Path) -> None:
    """A coordination file as tokenline left it before drain requests and lease ages
    (version 1), with one live worker and one held resource lease in it."""
    conn = connect_coord(coord_path(main), busy_timeout=5)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for statement in statements(CQ["schema"]):
            conn.execute(statement)
        conn.execute(
            "INSERT INTO coord.workers (id, host, pid, queues, concurrency, state, token, "
            "started_at, heartbeat_at, expires_at) "
            "VALUES ('old-worker', 'h', 1, '[\"default\"]', 4, 'ready', 3, 0, 0, 9e12)"
        )
        conn.execute(
            "INSERT INTO coord.resource_leases (resource, owner, token, expires_at) "
            "VALUES ('account:1', 'old-worker', 7, 9e12)"
        )
        conn.execute("PRAGMA coord.user_version = 1")
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_sqlite_upgrades_a_version_1_coordination_file_in_place(tmp_path: Path) -> None:
    """Opening a store whose coordination file predates drain requests and lease ages
    adds both columns in place: the worker registered before the upgrade is listed, not
    asked to drain, can be asked to, and its heartbeat (same token as before) returns
    the request; the resource lease is listed with its holder and token, its age unknown."""
    main = tmp_path / "old.db"
    _v1_coordination_file(main)

    async def run() -> tuple[Any, ...]:
        store = SQLiteStore(f"sqlite:///{main}", clock=FakeClock())
        await store.open()
        try:
            (before,) = await store.workers_list()
            marked = await store.worker_drain(worker_id="old-worker")
            beat = await store.worker_heartbeat(
                worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10
            )
            (lease,) = await store.resource_leases_list()
            held = (lease.resource, lease.owner, lease.token, lease.acquired_at)
            return before.drain_requested, marked, beat and beat.drain_requested, held
        finally:
            await store.close()

    held = ("account:1", "old-worker", 7, None)
    assert asyncio.run(run()) == (False, True, True, held)
    conn = sqlite3.connect(coord_path(main))
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == COORD_VERSION
    finally:
        conn.close()


@pytest.mark.postgres
async def test_postgres_migrates_a_0004_schema_for_drain_and_lease_ages(
    postgres_server: str, clock: FakeClock
) -> None:
    """A schema at version 4 with a live worker and a held lease is migrated on open: the
    worker can be asked to drain and its heartbeat returns it; the lease is listed with
    its holder and token, its age unknown."""
    import psycopg
    from psycopg import sql

    from tokenline.stores.postgres import SCHEMA_VERSION, PostgresStore

    schema = f"tl_upgrade_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(schema)
    try:
        with psycopg.connect(postgres_server, autocommit=True) as conn, conn.transaction():
            schema_at_version(conn, schema, 4)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.workers (id, host, pid, queues, concurrency, state, token, "
                    "started_at, heartbeat_at, expires_at) "
                    "VALUES ('old-worker', 'h', 1, '{{default}}', 4, 'ready', 3, 0, 0, 9e12)"
                ).format(ident)
            )
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.leases (resource, owner, token, expires_at) "
                    "VALUES ('account:1', 'old-worker', 7, 9e12)"
                ).format(ident)
            )
        store = PostgresStore(f"{postgres_server}?schema={schema}", clock=clock)
        await store.open()
        try:
            (before,) = await store.workers_list()
            assert before.drain_requested is False
            assert await store.worker_drain(worker_id="old-worker") is True
            beat = await store.worker_heartbeat(
                worker_id="old-worker", token=3, state="ready", in_flight=0, ttl=10
            )
            assert beat is not None
            assert beat.drain_requested is True
            (lease,) = await store.resource_leases_list()
            assert (lease.owner, lease.token, lease.acquired_at) == ("old-worker", 7, None)
        finally:
            await store.close()
        with psycopg.connect(postgres_server) as conn:
            row = conn.execute(
                sql.SQL("SELECT max(version) FROM {}.schema_version").format(ident)
            ).fetchone()
            assert row is not None
            assert row[0] == SCHEMA_VERSION
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


# -- leases, lease release, drain --------------------------------------------------------------
def cli(*args: str) -> tuple[int, str]:
    """Run the CLI as a pipe would see it (stdout and stderr together)."""
    env = {"COLUMNS": None, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def on_store(url: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """``fn(store)`` on an open store for ``url`` (the system clock, as the CLI's)."""

    async def run() -> T:
        store = store_from_url(url)
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _record(wid: str) -> WorkerRecord:
    return WorkerRecord(wid, "host", 1, ("default",), 4, "ready", 0, 0.0, 0.0, 0.0)


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A store with a job running under a 60 s lease of worker w-1, a resource lease
    ``account:[1]`` held by ``w-[2]`` (names rich would read as markup), one released
    lease, a live worker w-1 and a stopped worker w-old."""
    u = f"sqlite:///{tmp_path / 'ops.db'}"

    async def seed(store: Store) -> None:
        await store.jobs_enqueue(jobs=[NewJob("billing", "charge", "[]")])
        await store.jobs_claim(owner="w-1", queues=["billing"], limit=1, ttl=60)
        await store.resource_lease_acquire(resource="account:[1]", owner="w-[2]", ttl=60)
        gone = await store.resource_lease_acquire(resource="gone", owner="w-9", ttl=60)
        assert gone is not None
        await store.resource_lease_release(lease=gone)  # expired now, listed with --all
        await store.worker_register(record=_record("w-1"), ttl=60)
        old = await store.worker_register(record=_record("w-old"), ttl=60)
        await store.worker_deregister(worker_id=old.id, token=old.token)

    on_store(u, seed)
    return u


def _named(url: str) -> list[tuple[str, str, int, bool]]:
    async def read(store: Store) -> list[tuple[str, str, int, bool]]:
        now = await store.store_time()
        return [
            (r.resource, r.owner, r.token, r.expires_at > now)
            for r in await store.resource_leases_list()
        ]

    return on_store(url, read)


def test_leases_lists_job_and_resource_leases_by_the_store_clock(url: str) -> None:
    """leases shows the running job's lease (owner, token, expiry ahead, age since the
    claim) and the held resource lease, names as written; --all adds the expired one."""
    code, out = cli("leases", "--url", url, "--json")
    assert code == 0
    report = json.loads(out)
    (jl,) = report["job_leases"]
    assert (jl["job_id"], jl["queue"], jl["task"], jl["owner"], jl["token"]) == (
        1,
        "billing",
        "charge",
        "w-1",
        1,
    )
    assert 0 < jl["expires_in"] <= 60
    assert jl["expires_at"] == pytest.approx(report["now"] + jl["expires_in"])
    assert 0 <= jl["age"] < 30
    (rl,) = report["resource_leases"]
    assert (rl["key"], rl["owner"], rl["token"], rl["held"]) == ("account:[1]", "w-[2]", 1, True)
    assert 0 <= rl["age"] < 30
    assert 0 < rl["expires_in"] <= 60
    code, out = cli("leases", "--url", url, "--all", "--json")
    assert [r["key"] for r in json.loads(out)["resource_leases"]] == ["account:[1]", "gone"]
    gone = json.loads(out)["resource_leases"][1]
    assert (gone["held"], gone["owner"], gone["token"]) == (False, "w-9", 1)
    assert gone["expires_in"] <= 0
    code, out = cli("leases", "--url", url)
    assert code == 0
    assert "account:[1]" in out
    assert "w-[2]" in out
    assert "gone" not in out
    assert "in " in out  # "in 59.9s": the expiry ahead, by the store's clock


def test_lease_release_needs_both_owner_and_token(url: str) -> None:
    """Without --owner or without --token, lease release is a usage error (exit 2) and
    the lease stays held."""
    for args in (["--owner", "w-[2]"], ["--token", "1"], []):
        code, out = cli("lease", "release", "--url", url, "account:[1]", *args)
        assert code == 2
        assert "Missing option" in out
    assert ("account:[1]", "w-[2]", 1, True) in _named(url)


@pytest.mark.parametrize(
    ("owner", "token", "said"),
    [
        ("w-[3]", "1", "owner 'w-[3]' is not its owner ('w-[2]')"),
        ("w-[2]", "0", "token 0 (a stale one) is not its token (1)"),
        ("w-[2]", "2", "token 2 is not its token (1)"),
        ("w-3", "0", "owner 'w-3' is not its owner ('w-[2]') and token 0"),
    ],
)
def test_lease_release_refuses_a_wrong_owner_or_token(
    url: str, owner: str, token: str, said: str
) -> None:
    """A release whose owner or token is not the holder's exits 1 naming what did not
    match, and the lease stays held with the same token."""
    code, out = cli(
        "lease", "release", "--url", url, "account:[1]", "--owner", owner, "--token", token
    )
    assert code == 1
    flat = " ".join(out.split())
    assert said in flat
    assert "nothing changed" in flat
    assert ("account:[1]", "w-[2]", 1, True) in _named(url)


def test_lease_release_of_an_unknown_key_is_refused(url: str) -> None:
    """A key the store has no lease for exits 1, naming the key."""
    code, out = cli("lease", "release", "--url", url, "nope[x]", "--owner", "a", "--token", "1")
    assert code == 1
    assert "no resource lease named 'nope[x]'" in out


def test_lease_release_by_owner_and_token_frees_the_lease(url: str) -> None:
    """With the holder's owner and token the lease is released: no longer held, and the
    next holder gets a higher token. An expired lease needs no release (exit 0)."""
    code, out = cli(
        "lease", "release", "--url", url, "account:[1]", "--owner", "w-[2]", "--token", "1"
    )
    assert code == 0, out
    assert "released lease 'account:[1]' (owner 'w-[2]', token 1)" in out
    assert ("account:[1]", "w-[2]", 1, False) in _named(url)
    taken = on_store(
        url, lambda s: s.resource_lease_acquire(resource="account:[1]", owner="w-4", ttl=60)
    )
    assert taken is not None
    assert taken.token == 2
    code, out = cli("lease", "release", "--url", url, "gone", "--owner", "w-9", "--token", "1")
    assert code == 0
    assert "nothing to release" in out


def test_lease_release_is_fenced_by_the_store() -> None:
    """A lease taken over by a new token between the check and the release is refused by
    the store itself: StaleTokenError, and the new holder keeps it."""

    async def run() -> tuple[bool, ResourceLease | None]:
        store = MemoryStore()
        old = await store.resource_lease_acquire(resource="k", owner="a", ttl=1)
        assert old is not None
        await store.resource_lease_release(lease=old)
        new = await store.resource_lease_acquire(resource="k", owner="a", ttl=60)
        return await store.resource_lease_release(lease=old), new

    released, new = asyncio.run(run())
    assert released is False
    assert new is not None
    assert new.token == 2


def test_drain_marks_a_live_worker(url: str) -> None:
    """drain of a live worker exits 0 and marks its membership; its next heartbeat
    carries the request."""
    code, out = cli("drain", "--url", url, "w-1")
    assert code == 0, out
    assert "asked worker 'w-1' to drain" in out

    async def beat(store: Store) -> bool | None:
        (w,) = [w for w in await store.workers_list() if w.id == "w-1"]
        rec = await store.worker_heartbeat(
            worker_id=w.id, token=w.token, state="draining", in_flight=0, ttl=60
        )
        return rec and rec.drain_requested

    assert on_store(url, beat) is True


def _drain_flags(url: str) -> list[tuple[str, bool]]:
    async def read(store: Store) -> list[tuple[str, bool]]:
        return sorted((w.id, w.drain_requested) for w in await store.workers_list())

    return on_store(url, read)


@pytest.mark.parametrize(
    ("worker", "said"),
    [("w-[unknown]", "no worker with id 'w-[unknown]'"), ("w-old", "it has stopped")],
)
def test_drain_refuses_an_unknown_or_stopped_worker(url: str, worker: str, said: str) -> None:
    """drain of a worker id the store does not know, or of a stopped worker, exits 1
    saying why, and no worker is marked."""
    before = _drain_flags(url)
    code, out = cli("drain", "--url", url, worker)
    assert code == 1
    flat = " ".join(out.split())
    assert said in flat
    assert "nothing changed" in flat
    assert _drain_flags(url) == before == [("w-1", False), ("w-old", False)]


# -- status, channel by channel ----------------------------------------------------------------
HERE = Path(__file__).parent


def status_during(
    url: str, fault_file: Path, faults: StoreFaults | None, *args: str
) -> tuple[int, str]:
    """`tokenline status` in a process of its own whose store takes ``faults`` (written
    to ``fault_file`` first; ``None``: the file removed, no faults)."""
    if faults is None:
        fault_file.unlink(missing_ok=True)
    else:
        write_fault_file(fault_file, faults)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TOKENLINE_", "STATUSFAULTAPP"))
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
        STATUSFAULTAPP_URL=url,
        STATUSFAULTAPP_FAULT_FILE=str(fault_file),
        COLUMNS="200",
    )
    done = subprocess.run(
        [sys.executable, "-m", "tokenline", "status", "--app", "statusfaultapp:app", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


def failing(report: dict[str, Any]) -> dict[str, str]:
    """Each failing channel and how it fails."""
    return {n: c["failure"] for n, c in report["channels"].items() if c["ok"] is False}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite store that exists, with a job in it."""
    u = f"sqlite:///{tmp_path / 'status.db'}"
    on_store(u, lambda s: s.jobs_enqueue(jobs=[NewJob("default", "t", "[]")]))
    return u


_ROLE_DOWN = {
    # The drill's own scenario: renewals (and every other leases call) fail.
    "leases": DRILL_SCENARIOS["partition_leases"].injection.store,
    "ledger": StoreFaults(ledger=RoleFaults(error=True)),
    "broker": StoreFaults(broker=RoleFaults(error=True)),
}


#: What `status --json` reads through each channel: null, never empty, when it fails.
_CARRIED = {"broker": ("queues", "stale_commits"), "leases": ("workers",), "ledger": ()}


@pytest.mark.parametrize("role", sorted(_ROLE_DOWN))
def test_status_during_a_drill_fault_names_that_channel_and_only_it(
    sqlite_url: str, tmp_path: Path, role: str
) -> None:
    """While one role's calls fail (the drill's FaultStore), status exits 1 naming that
    channel as failing, unreachable, and every other channel ok; once the fault is
    cleared, every channel is ok again."""
    faults = _ROLE_DOWN[role]
    assert faults is not None
    fault_file = tmp_path / "faults.json"
    code, out = status_during(sqlite_url, fault_file, faults, "--json")
    assert code == 1, out
    report = json.loads(out)
    assert report["store"] == "ok"
    assert failing(report) == {role: "unreachable"}
    assert "drill fault" in report["channels"][role]["error"]
    assert all(c["ok"] for n, c in report["channels"].items() if n != role)
    # What the failing channel carries is null (it used to be an empty list, as from a
    # healthy empty store); what the others carry is read.
    assert {k for k in ("queues", "workers", "stale_commits") if report[k] is None} == set(
        _CARRIED[role]
    ), report
    code, out = status_during(sqlite_url, fault_file, faults)
    assert code == 1
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "FAILING  unreachable: drill fault" in lines[role]
    assert [n for n in CHANNELS if " ok " in lines[n]] == [n for n in CHANNELS if n != role]
    unknown = {line.split(":")[0] for line in out.splitlines() if "UNKNOWN" in line}
    assert unknown == {k.replace("_", " ") for k in _CARRIED[role]}, out
    code, out = status_during(sqlite_url, fault_file, None, "--json")
    assert code == 0, out
    assert failing(json.loads(out)) == {}


def test_status_during_a_store_wide_outage_fails_every_channel(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The drill's total partition (every role failing): status names all three
    channels failing, unreachable."""
    faults = DRILL_SCENARIOS["partition_total"].injection.store
    code, out = status_during(sqlite_url, tmp_path / "faults.json", faults, "--json")
    assert code == 1
    assert failing(json.loads(out)) == dict.fromkeys(CHANNELS, "unreachable")


def test_status_calls_a_channel_that_does_not_answer_in_time_slow(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A channel whose calls hang is reported slow once --timeout has passed, the
    others ok; the drill's slow store (every call delayed) makes every channel slow."""
    fault_file = tmp_path / "faults.json"
    hang = StoreFaults(leases=RoleFaults(hang=True))
    started = time.monotonic()
    code, out = status_during(sqlite_url, fault_file, hang, "--json", "--timeout", "0.5")
    assert code == 1
    report = json.loads(out)
    assert failing(report) == {"leases": "slow"}
    assert report["channels"]["leases"]["error"] == "no answer within 0.5s"
    assert time.monotonic() - started < 30
    slow = DRILL_SCENARIOS["slow_store"].injection.store
    code, out = status_during(sqlite_url, fault_file, slow, "--json", "--timeout", "0.3")
    assert code == 1
    assert failing(json.loads(out)) == dict.fromkeys(CHANNELS, "slow")


def test_status_of_an_unreachable_sqlite_store_fails_every_channel(tmp_path: Path) -> None:
    """A SQLite store in a directory that does not exist: the store and every channel
    unreachable, exit 1, and nothing created."""
    u = f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    code, out = cli("status", "--url", u, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "unreachable"
    assert failing(report) == dict.fromkeys(CHANNELS, "unreachable")
    assert [report[k] for k in ("queues", "workers", "stale_commits")] == [None] * 3
    code, out = cli("status", "--url", u)
    assert code == 1
    for name in CHANNELS:
        assert f"{name:<7} FAILING  unreachable" in out
    assert not (tmp_path / "no-such-dir").exists()


def test_status_of_postgres_on_a_closed_port_fails_every_channel() -> None:
    """A PostgreSQL URL on a port nobody listens on: every channel unreachable."""
    pytest.importorskip("psycopg")
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out = cli("status", "--url", f"postgresql://postgres@127.0.0.1:{port}/x", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "unreachable"
    assert failing(report) == dict.fromkeys(CHANNELS, "unreachable")
    assert [report[k] for k in ("queues", "workers", "stale_commits")] == [None] * 3


def test_status_of_a_missing_sqlite_file_says_not_migrated(tmp_path: Path) -> None:
    """A SQLite path whose file does not exist (in a directory that does): every
    channel not migrated, and no file created."""
    missing = tmp_path / "typo.db"
    code, out = cli("status", "--url", f"sqlite:///{missing}", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["store"] == "missing"
    assert failing(report) == dict.fromkeys(CHANNELS, "not migrated")
    assert not missing.exists()


@pytest.mark.postgres
def test_status_of_postgres_refusing_a_role_without_privileges(postgres_server: str) -> None:
    """A role that may log in but not use tokenline's schema: the store answers with
    a refusal, and every channel is reported refusing (not unreachable)."""
    import psycopg
    from psycopg import sql

    schema = f"tl_status_{uuid.uuid4().hex[:8]}"
    role = f"tl_nopriv_{uuid.uuid4().hex[:8]}"
    on_store(f"{postgres_server}?schema={schema}", lambda s: s.queues_stats())
    try:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        parts = urlsplit(postgres_server)
        host = parts.hostname or "127.0.0.1"
        url = f"postgresql://{role}@{host}:{parts.port or 5432}{parts.path}?schema={schema}"
        code, out = cli("status", "--url", url, "--json")
        assert code == 1, out
        report = json.loads(out)
        assert report["store"] == "refusing", report
        assert failing(report) == dict.fromkeys(CHANNELS, "refusing")
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
