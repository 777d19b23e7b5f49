"""``sqlite3`` errors translated into tokenline's exception tree, by SQLite's error code.

The primary result code (the low byte of ``sqlite_errorcode``) decides: a busy or locked
file is a passing coordination failure; a file that cannot be opened, read or written
is unavailable; a file that is not a database is corrupt (and left untouched); a refused
constraint or trigger is a refused write. Messages name the file.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from ..._errors import StoreCorruptError, StoreError, StoreUnavailableError

__all__ = ["SQLiteBusyError", "map_sqlite_errors"]

_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
_UNAVAILABLE = frozenset(
    {
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_AUTH,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_INTERRUPT,
    }
)
_HINT = "check that the directory exists and is writable"
_HINTS = {
    sqlite3.SQLITE_FULL: (
        "the disk holding it is full, or the file reached its size limit: "
        "the write was rolled back; free space, then try again"
    ),
}
_CORRUPT = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_FORMAT})


class SQLiteBusyError(StoreUnavailableError):
    """Another connection holds the file's write lock longer than the busy timeout."""


def _primary(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


@contextlib.contextmanager
def map_sqlite_errors(path: Path) -> Iterator[None]:
    """Translate ``sqlite3`` errors raised inside the block, naming ``path``."""
    try:
        yield
    except sqlite3.Error as exc:
        where = repr(str(path))
        code = _primary(exc)
        if code in _BUSY:
            raise SQLiteBusyError(f"SQLite store {where} is busy: {exc}") from exc
        if code in _UNAVAILABLE:
            raise StoreUnavailableError(
                f"cannot use SQLite store {where}: {exc} ({_HINTS.get(code, _HINT)})"
            ) from exc
        if code in _CORRUPT:
            raise StoreCorruptError(
                f"{where} is not a usable tokenline store ({exc}); nothing was changed"
            ) from exc
        if code == sqlite3.SQLITE_CONSTRAINT:
            raise StoreError(f"SQLite store {where} refused a write: {exc}") from exc
        raise StoreError(f"SQLite store {where}: {exc}") from exc
