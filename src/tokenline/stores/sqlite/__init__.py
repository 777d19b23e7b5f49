"""The embedded SQLite store: one file, several worker processes on one machine."""

from .store import SQLiteStore

__all__ = ["SQLiteStore"]
