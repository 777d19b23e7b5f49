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
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError

__all__ = ["ScratchStore", "scratch_for", "through", "upstream_of"]

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

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        """Remove what the run created unless it is kept (``keep``; ``keep_files`` keeps
        the directory, e.g. a failed run's logs). Returns what is left, each with why."""
        return self._keep_dir(keep_files)

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


class _SQLiteScratch(ScratchStore):
    def __init__(self, db: Path | None, keep: bool, prefix: str) -> None:
        self.work_dir = _work_dir(prefix)
        #: Whether the file was named by the URL (then it is left in place afterwards).
        self.named = db is not None
        self.db = db if db is not None else self.work_dir / f"{prefix}.db"
        self.url = f"sqlite:///{self.db}"
        self.keep = keep
        self.tables = dict(_SQLITE_TABLES)

    def prepare(self, extra: Mapping[str, str]) -> None:
        for suffix in ("", "-wal", "-shm", "-coord", "-coord-wal", "-coord-shm"):
            Path(f"{self.db}{suffix}").unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            for name, columns in extra.items():
                conn.execute(f"CREATE TABLE {name} ({columns})")
                self.tables[name] = name

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
    extra tables live too). The jobs are in Redis: read them through the store."""

    def __init__(self, broker: str, ledger: str, keep: bool, prefix: str) -> None:
        super().__init__(ledger, keep, prefix)
        from ..stores import split_url

        self.key_prefix = self.schema
        sep = "&" if "?" in broker else "?"
        self.broker_base = broker
        self.broker = f"{broker}{sep}prefix={self.key_prefix}"
        self.url = split_url(self.broker, self.url)

    def cleanup(self, *, keep_files: bool = False) -> list[str]:
        left = super().cleanup(keep_files=keep_files)
        if self.keep:
            return [f"Redis keys {{{self.key_prefix}}}:* (kept: --keep)", *left]
        import redis

        with redis.Redis.from_url(self.broker_base) as client:
            keys = list(client.scan_iter(match=f"{{{self.key_prefix}}}:*", count=1000))
            for start in range(0, len(keys), 1000):
                client.delete(*keys[start : start + 1000])
        return left


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
    url: str | None, *, keep: bool = False, prefix: str = "tokenline_scratch"
) -> ScratchStore:
    """The scratch store for a ``sqlite:///file``, ``postgresql://…`` or split URL; ``None``: a
    SQLite file in a fresh temporary directory. ``prefix`` starts the schema's and the
    directory's names."""
    if url is None:
        return _SQLiteScratch(None, keep, prefix)
    if url.startswith("sqlite:///"):
        return _SQLiteScratch(Path(url[len("sqlite:///") :]), keep, prefix)
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
