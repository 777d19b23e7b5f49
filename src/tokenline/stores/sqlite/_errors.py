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


#: The first 16 bytes of every SQLite database file.
_HEADER = b"SQLite format 3\x00"


def _files(path: Path) -> list[Path]:
    """``path`` and, for a store's main file, its coordination file beside it."""
    coord = path.with_name(path.name + "-coord")
    return [path] if path.name.endswith("-coord") else [path, coord]


def _damaged(path: Path) -> Path:
    """The file of the store at ``path`` whose header is not SQLite's (``path`` when
    none is, or when they cannot be read)."""
    for candidate in _files(path):
        with contextlib.suppress(OSError), candidate.open("rb") as fh:
            head = fh.read(len(_HEADER))
            if head and head != _HEADER:
                return candidate
    return path


def _hint(path: Path, code: int | None) -> str:
    """What to do about a file that cannot be used: a coordination file gone from a
    store that is still there was deleted while it was open, most likely."""
    hint = _HINTS.get(code, _HINT) if code is not None else _HINT
    if code == sqlite3.SQLITE_CANTOPEN and path.is_file():
        missing = [f for f in _files(path)[1:] if not f.exists()]
        if missing:
            hint = (
                f"its coordination file {str(missing[0])!r} is missing: deleted while the "
                "store was open? Restart the processes that use this store; the first to "
                "open it creates the file again and every lease expires"
            )
    return hint


def _primary(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def _lacks_own_table(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says a table of tokenline's own is missing: its main tables are
    all named ``tokenline_…``, and the coordination file is attached as ``coord``."""
    text = str(exc)
    if not text.startswith("no such table: "):
        return False
    table = text.removeprefix("no such table: ")
    return table.startswith(("tokenline_", "main.tokenline_", "coord."))


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
                f"cannot use SQLite store {where}: {exc} ({_hint(path, code)})"
            ) from exc
        if code in _CORRUPT:
            # SQLite does not say which file of the connection it could not read: the
            # store's, or the coordination file attached to it. The headers do.
            raise StoreCorruptError(
                f"{str(_damaged(path))!r} is not a usable tokenline store file ({exc}); "
                "nothing was changed"
            ) from exc
        if _lacks_own_table(exc):
            # A table of tokenline's dropped from a store at the current version: the
            # store's fault, not the job's (see _catalog.py, which refuses it at open).
            raise StoreCorruptError(
                f"SQLite store {where} is damaged: {exc}. Restore the store's files from a backup"
            ) from exc
        if code == sqlite3.SQLITE_CONSTRAINT:
            raise StoreError(f"SQLite store {where} refused a write: {exc}") from exc
        raise StoreError(f"SQLite store {where}: {exc}") from exc
