"""A throw-away store for runners that drive real worker processes (demo, drill, bench).

A :class:`ScratchStore` is a fresh SQLite file or a fresh PostgreSQL schema with extra
business tables beside tokenline's; runners read their figures back from it with plain
SQL, never through the workers. Each one also has a temporary directory of its own for
the run's files (the workers' logs; the SQLite file unless one was named).

Only an explicit URL is used, never ``TOKENLINE_URL``: these runners create and drop
schemas and kill processes. Without a URL the store is a SQLite file in the temporary
directory. :meth:`ScratchStore.cleanup` removes the directory and drops the schema unless
they are kept, and says what it left behind and why; a SQLite file named by the URL is
recreated at the start and left in place.

A named SQLite file is only recreated when it holds nothing to lose: it does not exist,
is empty, or is the scratch store a previous run of the same command left there (marked
by a table, :data:`MARKER_TABLE`). Anything else may be somebody's store: it is refused
with :class:`ScratchInUseError` before anything is touched, unless ``overwrite`` says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError

__all__ = [
    "MARKER_TABLE",
    "PERIODIC_KEYS",
    "ScratchInUseError",
    "ScratchStore",
    "check_reusable",
    "check_sqlite_dir",
    "scratch_for",
    "through",
    "upstream_of",
]

#: The table a named SQLite scratch file is marked with: which runner made it (its
#: prefix), so the next run of that runner may recreate it without asking.
MARKER_TABLE = "tokenline_scratch_marker"
#: The files of one SQLite store besides the main one.
_SQLITE_SIDE_FILES = ("-wal", "-shm", "-coord", "-coord-wal", "-coord-shm")


class ScratchInUseError(ConfigError):
    """The SQLite file a runner was told to use holds data it did not put there."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            "url",
            f"{str(path)!r} already exists and is not a scratch store of this command; it "
            "would be deleted and recreated: name a new file, or pass --overwrite to delete it",
        )


#: How the idempotency key of a periodic schedule's job begins (``Periodic.key``).
PERIODIC_KEYS = "periodic:"

#: tokenline's own tables by logical name, per dialect (see the stores' schemas).
_SQLITE_TABLES = {
    "jobs": "tokenline_jobs",
    "attempts": "tokenline_attempts",
    "stale": "tokenline_stale_commits",
    "duplicates": "tokenline_duplicates",
}
_POSTGRES_TABLES = {
    "jobs": "jobs",
    "attempts": "attempts",
    "stale": "stale_commits",
    "duplicates": "duplicates",
}


class ScratchStore:
    """Where a runner's tables live, and how to read them back."""

    url: str
    #: Table names by logical name: jobs, attempts, stale, duplicates, and the extras.
    tables: dict[str, str]
    #: The placeholder of the dialect's DB-API driver.
    placeholder: str = "?"
    #: A fresh temporary directory for the run's files (logs; the default SQLite file).
    work_dir: Path
    #: Keep the store and the directory after the run (``--keep``).
    keep: bool = False

    def prepare(self, extra: Mapping[str, str]) -> None:
        """Create the store afresh with ``extra`` tables ``{name: column definitions}``."""
        raise NotImplementedError

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """The rows of one query."""
        raise NotImplementedError

    def scalar(self, sql: str) -> int:
        """The first column of the first row of ``sql``, as an int (0 without a row)."""
        found = self.rows(sql)
        return int(found[0][0]) if found and found[0][0] is not None else 0

    def lock_held(self) -> bool:
        """Whether some session holds a write lock and sits idle in its transaction (a
        paused process inside a transaction); a runner pausing workers avoids that."""
        return False

    # -- the jobs, as a runner reads them (SQL here; the split store reads Redis) -------
    def job_rows(self) -> list[tuple[Any, ...]]:
        """Every job: (id, idempotency_key, state, lease_token, last_error, attempt)."""
        return self.rows(
            "SELECT id, idempotency_key, state, lease_token, last_error, attempt "
            f"FROM {self.tables['jobs']}"
        )

    def attempt_rows(self) -> list[tuple[Any, ...]]:
        """Every attempt: (job_id, token, started_at, finished_at, outcome, owner)."""
        return self.rows(
            "SELECT job_id, token, started_at, finished_at, outcome, owner "
            f"FROM {self.tables['attempts']}"
        )

    def periodic_rows(self) -> list[tuple[Any, ...]]:
        """The jobs of periodic schedules (their keys start ``periodic:``): (id,
        idempotency_key, state, created_at)."""
        return self.rows(
            "SELECT id, idempotency_key, state, created_at "
            f"FROM {self.tables['jobs']} WHERE idempotency_key LIKE {self.placeholder}",
            (f"{PERIODIC_KEYS}%",),
        )

    def finished_jobs(self) -> int:
        """How many jobs are succeeded, dead or cancelled."""
        return self.scalar(
            f"SELECT count(*) FROM {self.tables['jobs']} "
            "WHERE state IN ('succeeded', 'dead', 'cancelled')"
        )

    def running_of(self, pid: int) -> list[tuple[int, int]]:
        """(id, token) of the running jobs leased to the worker process ``pid``."""
        return [
            (int(r[0]), int(r[1]))
            for r in self.rows(
                f"SELECT id, lease_token FROM {self.tables['jobs']} "
                f"WHERE state = 'running' AND lease_owner LIKE {self.placeholder}",
                (f"%-{pid}-%",),
            )
        ]

    def tokens_and_states(self, ids: Sequence[int]) -> dict[int, tuple[int, str]]:
        """Token and state of each of the jobs ``ids``."""
        if not ids:
            return {}
        rows = self.rows(
            f"SELECT id, lease_token, state FROM {self.tables['jobs']} "
            f"WHERE id IN ({', '.join(str(int(j)) for j in ids)})"
        )
        return {int(r[0]): (int(r[1]), str(r[2])) for r in rows}

    def stale_refused(self) -> int:
        """Writes the store refused for a stale token."""
        return self.scalar(f"SELECT count(*) FROM {self.tables['stale']}")

    # -- a failover (the split topology's own Redis servers) ----------------------------
    def start_servers(self) -> None:
        """Run the store on servers of the runner's own, a primary and its replica."""
        raise ConfigError("url", "a failover drill runs on the split topology only")

    def wait_replicated(self) -> None:
        """Return once the replica holds every write made so far."""
        raise ConfigError("url", "a failover drill runs on the split topology only")

    def fail_over(self, lost_for: float) -> tuple[str, int]:
        """Fail over to the replica; the address of the new primary."""
        raise ConfigError("url", "a failover drill runs on the split topology only")

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        """Remove what the run created unless it is kept (``keep``; ``keep_files`` keeps
        the directory, e.g. a failed run's logs). Returns what is left, each with why."""
        return self._keep_dir(keep_files)

    def discard(self) -> None:
        """Remove the working directory of a scratch store that was built only to check
        its URL (nothing prepared, nothing run): it is empty."""
        with contextlib.suppress(OSError):
            self.work_dir.rmdir()

    def _keep_dir(self, keep_files: bool) -> list[str]:
        if not self.work_dir.exists():
            return []
        if any(self.work_dir.iterdir()):
            if self.keep:
                return [f"{self.work_dir} (kept: --keep)"]
            if keep_files:
                return [f"{self.work_dir} (kept: the run failed, its logs are there)"]
        shutil.rmtree(self.work_dir, ignore_errors=True)
        return []


def _work_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{prefix.replace('_', '-')}-"))


def _made_by(path: Path) -> str | None:
    """The runner that marked the SQLite file ``path`` as its scratch store (its prefix);
    ``None``: not marked, or not a SQLite file at all. Opened read-only: nothing changes."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute(f"SELECT made_by FROM {MARKER_TABLE}").fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return str(row[0]) if row else None


def check_sqlite_dir(db: Path) -> None:
    """Refuse, as a bad ``url`` setting, a SQLite file ``db`` whose directory is missing
    or cannot take new files (permissions, a read-only mount, a full disk: found by
    creating a file there, removed at once); SQLite only says "unable to open database
    file", once the run has started."""
    parent = db.parent
    if not parent.is_dir():
        raise ConfigError(
            "url", f"cannot create SQLite files in {str(parent)!r}: no such directory"
        )
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ConfigError(
            "url", f"cannot create SQLite files in {str(parent)!r}: {exc.strerror or exc}"
        ) from None


def check_reusable(db: Path, prefix: str) -> None:
    """Raise :class:`ScratchInUseError` unless the SQLite file ``db`` (and the store's
    other files beside it) may be deleted: missing, empty, or marked by ``prefix``."""
    marked = False
    for path in (db, Path(f"{db}-coord")):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        if path.is_dir():
            raise ScratchInUseError(path)
        if not size:
            continue
        if path == db:
            marked = _made_by(path) == prefix
            if not marked:
                raise ScratchInUseError(path)
        elif not marked:
            # The coordination file carries no marker of its own: it is the scratch
            # store's only beside a main file that is.
            raise ScratchInUseError(path)


class _SQLiteScratch(ScratchStore):
    def __init__(self, db: Path | None, keep: bool, prefix: str, overwrite: bool) -> None:
        #: Whether the file was named by the URL (then it is left in place afterwards).
        self.named = db is not None
        self.prefix = prefix
        self.overwrite = overwrite
        if db is not None:  # before the directory: a refusal leaves nothing
            check_sqlite_dir(db)
            if not overwrite:
                check_reusable(db, prefix)
        self.work_dir = _work_dir(prefix)
        self.db = db if db is not None else self.work_dir / f"{prefix}.db"
        self.url = f"sqlite:///{self.db}"
        self.keep = keep
        self.tables = dict(_SQLITE_TABLES)

    def prepare(self, extra: Mapping[str, str]) -> None:
        if self.named and not self.overwrite:
            check_reusable(self.db, self.prefix)  # it may have been written since
        for suffix in ("", *_SQLITE_SIDE_FILES):
            Path(f"{self.db}{suffix}").unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            conn.execute(f"CREATE TABLE {MARKER_TABLE} (made_by TEXT NOT NULL)")
            conn.execute(f"INSERT INTO {MARKER_TABLE} VALUES (?)", (self.prefix,))
            for name, columns in extra.items():
                conn.execute(f"CREATE TABLE {name} ({columns})")
                self.tables[name] = name
            conn.commit()

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as conn:
            return [tuple(r) for r in conn.execute(sql, tuple(params)).fetchall()]

    def lock_held(self) -> bool:
        # A writer paused inside BEGIN IMMEDIATE holds a whole file — the store's, or the
        # coordination file every renewal writes: probe both.
        for path in (self.db, Path(f"{self.db}-coord")):
            if not path.exists():
                continue
            conn = sqlite3.connect(path, timeout=0.5, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
            except sqlite3.OperationalError:
                return True
            finally:
                conn.close()
        return False

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        left = self._keep_dir(keep_files)
        if self.named and self.db.exists():
            return [f"{self.db} (the SQLite file named by --url)", *left]
        return left


class _PostgresScratch(ScratchStore):
    placeholder = "%s"

    def __init__(self, base_url: str, keep: bool, prefix: str) -> None:
        import psycopg  # the postgres extra; its absence is reported by store_from_url

        self._psycopg = psycopg
        self.schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
        sep = "&" if "?" in base_url else "?"
        self.conninfo = base_url
        self.url = f"{base_url}{sep}schema={self.schema}"
        self.keep = keep
        self.tables = {k: f"{self.schema}.{v}" for k, v in _POSTGRES_TABLES.items()}
        self._created = False
        self.work_dir = _work_dir(prefix)

    def prepare(self, extra: Mapping[str, str]) -> None:
        with self._psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
            self._created = True
            for name, columns in extra.items():
                self.tables[name] = f"{self.schema}.{name}"
                conn.execute(f"CREATE TABLE {self.tables[name]} ({columns})")

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._psycopg.connect(self.conninfo, autocommit=True) as conn:
            return [tuple(r) for r in conn.execute(sql, tuple(params)).fetchall()]

    def lock_held(self) -> bool:
        # A row lock held by a paused worker blocks the rescue of that row (and the
        # statement rescuing it): sessions idle inside a transaction are that worker.
        sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%%' "
            "AND now() - state_change > interval '200 milliseconds'"
        )
        return self.scalar(sql) > 0

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        left = self._keep_dir(keep_files)
        if not self._created:
            return left
        if self.keep:
            return [f"PostgreSQL schema {self.schema} (kept: --keep)", *left]
        with self._psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
        self._created = False
        return left


class _SplitScratch(_PostgresScratch):
    """The split topology: a fresh ``{prefix_…}`` key prefix on the Redis server the
    broker URL names, and a fresh schema on the ledger's PostgreSQL server (where the
    extra tables live too). The jobs and their attempts are read from Redis (the key
    layout of ``stores/redis/scripts/_lib.lua``), a job's final token from the ledger."""

    def __init__(self, broker: str, ledger: str, keep: bool, prefix: str) -> None:
        super().__init__(ledger, keep, prefix)
        from ..stores import split_url

        self.key_prefix = self.schema
        sep = "&" if "?" in broker else "?"
        self.broker_base = broker
        self.broker = f"{broker}{sep}prefix={self.key_prefix}"
        self.ledger = self.url
        self.url = split_url(self.broker, self.ledger)
        self._keys = "{" + self.key_prefix + "}:"
        #: The runner's own Redis servers (a failover drill): primary, replica.
        self._servers: list[subprocess.Popen[bytes]] = []
        self._ports: list[int] = []

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.broker_base, decode_responses=True, socket_timeout=10)

    def _epoch_base(self, client: Any) -> int:
        return int(client.get(self._keys + "epoch") or 0) << 32

    def _hashes(self, client: Any, ids: Sequence[int], fields: Sequence[str]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for jid in ids:
            pipe.hmget(f"{self._keys}job:{jid}", *fields)
        return list(pipe.execute())

    def job_rows(self) -> list[tuple[Any, ...]]:
        done = {
            int(r[0]): int(r[1])
            for r in self.rows(
                f"SELECT job_id, done_token FROM {self.schema}.job_fences "
                "WHERE done_token IS NOT NULL"
            )
        }
        fields = ("idempotency_key", "state", "lease_token", "last_error", "attempt")
        with self._redis() as client:
            base = self._epoch_base(client)
            ids = [int(j) for j in client.zrange(self._keys + "all", 0, -1)]
            rows = self._hashes(client, ids, fields)
        out = []
        for jid, (key, state, token, error, attempt) in zip(ids, rows, strict=True):
            final = done.get(jid, base + int(token)) if state == "succeeded" else base + int(token)
            out.append((jid, key, state, final, error, int(attempt)))
        return out

    def attempt_rows(self) -> list[tuple[Any, ...]]:
        import json

        with self._redis() as client:
            ids = [int(j) for j in client.zrange(self._keys + "all", 0, -1)]
            pipe = client.pipeline(transaction=False)
            for jid in ids:
                pipe.lrange(f"{self._keys}attempts:{jid}", 0, -1)
            lists = pipe.execute()
        out = []
        for jid, items in zip(ids, lists, strict=True):
            for raw in items:
                a = json.loads(raw)
                finished = a["finished_at"]
                out.append(
                    (jid, int(a["token"]), float(a["started_at"]),
                     None if finished is None else float(finished), a["outcome"], a["owner"])
                )  # fmt: skip
        return out

    def periodic_rows(self) -> list[tuple[Any, ...]]:
        with self._redis() as client:
            ids = [int(j) for j in client.zrange(self._keys + "all", 0, -1)]
            rows = self._hashes(client, ids, ("idempotency_key", "state", "created_at"))
        return [
            (jid, key, state, float(created))
            for jid, (key, state, created) in zip(ids, rows, strict=True)
            if key is not None and key.startswith(PERIODIC_KEYS)
        ]

    def finished_jobs(self) -> int:
        with self._redis() as client:
            pipe = client.pipeline(transaction=False)
            for state in ("succeeded", "dead", "cancelled"):
                pipe.zcard(f"{self._keys}st:{state}")
            return sum(int(n) for n in pipe.execute())

    def running_of(self, pid: int) -> list[tuple[int, int]]:
        with self._redis() as client:
            base = self._epoch_base(client)
            ids = [int(j) for j in client.zrange(self._keys + "st:running", 0, -1)]
            rows = self._hashes(client, ids, ("lease_owner", "lease_token"))
        return [
            (jid, base + int(token))
            for jid, (owner, token) in zip(ids, rows, strict=True)
            if owner and f"-{pid}-" in owner
        ]

    def tokens_and_states(self, ids: Sequence[int]) -> dict[int, tuple[int, str]]:
        with self._redis() as client:
            base = self._epoch_base(client)
            rows = self._hashes(client, ids, ("lease_token", "state"))
        return {
            jid: (base + int(token), str(state))
            for jid, (token, state) in zip(ids, rows, strict=True)
            if state is not None
        }

    def stale_refused(self) -> int:
        with self._redis() as client:
            in_redis = int(client.get(self._keys + "stale_n") or 0)
        return in_redis + super().stale_refused()

    def start_servers(self) -> None:
        """Start a ``redis-server`` primary and its replica on free loopback ports, with
        nothing on disk, and put the store on the primary."""
        import time

        from ..stores import split_url

        program = shutil.which("redis-server")
        if program is None:
            raise ConfigError("url", "a failover drill needs redis-server on the PATH")
        ports = [_free_port(), _free_port()]
        for i, (name, port) in enumerate(zip(("primary", "replica"), ports, strict=True)):
            args = [
                program, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.work_dir),
                "--logfile", str(self.work_dir / f"redis-{name}.log"),
            ]  # fmt: skip
            if i == 1:
                args += ["--replicaof", "127.0.0.1", str(ports[0])]
            self._servers.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
        self._ports = ports
        self.broker_base = f"redis://127.0.0.1:{ports[0]}/0"
        self.broker = f"{self.broker_base}?prefix={self.key_prefix}"
        self.url = split_url(self.broker, self.ledger)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with self._redis_at(ports[1]) as replica:
                    if replica.info("replication").get("master_link_status") == "up":
                        return
            except Exception:  # not listening yet
                pass
            time.sleep(0.05)
        raise ConfigError("url", "the drill's Redis replica did not sync within 30s")

    def _redis_at(self, port: int) -> Any:
        import redis

        return redis.Redis(port=port, decode_responses=True, socket_timeout=10)

    def wait_replicated(self) -> None:
        with self._redis_at(self._ports[0]) as primary:
            if int(primary.wait(1, 30_000)) < 1:
                raise ConfigError("url", "the drill's Redis replica did not catch up")

    def fail_over(self, lost_for: float) -> tuple[str, int]:
        """Cut the replica off (paused, its link killed), let the primary take writes
        the replica never sees for ``lost_for`` seconds, kill the primary, and promote
        the replica: an asynchronous failover that loses the last writes."""
        import time

        primary, replica = self._servers
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            with self._redis_at(self._ports[0]) as client:
                client.execute_command("CLIENT", "KILL", "TYPE", "replica")
            time.sleep(lost_for)
            primary.kill()
            primary.wait(timeout=10)
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with self._redis_at(self._ports[1]) as client:
                    client.execute_command("REPLICAOF", "NO", "ONE")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.broker_base = f"redis://127.0.0.1:{self._ports[1]}/0"
        return "127.0.0.1", self._ports[1]

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        try:
            return self._cleanup(keep_files)
        finally:
            for server in self._servers:
                if server.poll() is None:
                    server.kill()
                server.wait(timeout=10)
            self._servers = []

    def _cleanup(self, keep_files: bool) -> list[str]:
        left = super().cleanup(keep_files=keep_files)
        if self._servers:
            return left  # the runner's own servers, stopped afterwards: nothing to keep
        if self.keep:
            return [f"Redis keys {self._keys}* (kept: --keep)", *left]
        with self._redis() as client:
            keys = list(client.scan_iter(match=f"{self._keys}*", count=1000))
            for start in range(0, len(keys), 1000):
                client.delete(*keys[start : start + 1000])
        return left


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def through(url: str, host: str, port: int) -> str:
    """``url`` with its network location replaced by ``host:port`` (a proxy's)."""
    parts = urllib.parse.urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def upstream_of(url: str) -> tuple[str, int]:
    """The ``(host, port)`` a PostgreSQL URL connects to (defaults: localhost, 5432)."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def scratch_for(
    url: str | None,
    *,
    keep: bool = False,
    prefix: str = "tokenline_scratch",
    overwrite: bool = False,
) -> ScratchStore:
    """The scratch store for a ``sqlite:///file``, ``postgresql://…`` or split URL; ``None``: a
    SQLite file in a fresh temporary directory. ``prefix`` starts the schema's and the
    directory's names. A named SQLite file that holds data this runner did not put there
    raises :class:`ScratchInUseError` unless ``overwrite``."""
    if url is None:
        return _SQLiteScratch(None, keep, prefix, overwrite)
    if url.startswith("sqlite:///"):
        from ..stores import refuse_sqlite_url_options

        refuse_sqlite_url_options(url)
        return _SQLiteScratch(Path(url[len("sqlite:///") :]), keep, prefix, overwrite)
    if url.startswith(("postgresql://", "postgres://")):
        if "schema=" in url:
            raise ConfigError("url", "a fresh schema is picked for each run: leave ?schema= out")
        return _PostgresScratch(url, keep, prefix)
    if url.startswith("split:"):
        from ..stores import _split_parts

        broker, _, ledger = _split_parts(url)
        if "prefix=" in broker or "schema=" in ledger:
            raise ConfigError(
                "url", "a fresh key prefix and schema are picked for each run: leave them out"
            )
        return _SplitScratch(broker, ledger, keep, prefix)
    raise ConfigError(
        "url", f"runs on sqlite:///…, postgresql://… or the split topology, not {url!r}"
    )
