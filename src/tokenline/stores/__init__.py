"""Store backends behind one seam (:class:`~tokenline.stores.base.Store`).

``store_from_url`` picks the backend from the URL scheme and imports optional drivers
lazily, failing with an install hint when an extra is missing.
"""

from __future__ import annotations

from .._clock import Clock
from .._errors import ConfigError, NotSupportedError
from .base import Capabilities, FencedTransaction, ResourceLease, Store
from .memory import MemoryStore

__all__ = [
    "Capabilities",
    "FencedTransaction",
    "MemoryStore",
    "ResourceLease",
    "Store",
    "store_from_url",
]


def store_from_url(
    url: str, *, clock: Clock | None = None, timeout: float = 10.0, migrate: bool = True
) -> Store:
    """A new, unopened store for ``url`` (``sqlite:///…``, ``postgresql://…``, ``memory://``).

    It builds the store and nothing else: no setting or environment variable can hand
    back a wrapped or weakened one. ``clock`` replaces the store's own clock (tests).
    ``migrate=False``: a store with versioned migrations refuses an outdated schema
    instead of upgrading it on open (run ``tokenline migrate``).
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        return SQLiteStore(url, clock=clock, timeout=timeout)
    if scheme == "memory":
        return MemoryStore(clock=clock)
    if scheme in ("postgresql", "postgres"):
        try:
            from .postgres import PostgresStore
        except ModuleNotFoundError as exc:  # pragma: no cover - depends on extras
            if exc.name and exc.name.startswith(("psycopg", "tokenline.stores.postgres")):
                raise NotSupportedError(
                    "the PostgreSQL store needs psycopg: pip install 'tokenline[postgres]'"
                ) from exc
            raise
        return PostgresStore(url, clock=clock, timeout=timeout, migrate=migrate)
    raise ConfigError(
        "url",
        f"unsupported store URL {url!r}: use sqlite:///path.db, postgresql://… or memory://",
    )
