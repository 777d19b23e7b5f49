"""Store backends behind one seam (:class:`~tokenline.stores.base.Store`).

``store_from_url`` picks the backend from the URL scheme and imports optional drivers
lazily, failing with an install hint when an extra is missing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec

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

_P = ParamSpec("_P")


def _drill_faults(build: Callable[_P, Store]) -> Callable[_P, Store]:
    # The drill switches faults on in worker processes through the environment; without
    # its variables the store comes back as built (see tokenline.drill.faultstore).
    @functools.wraps(build)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> Store:
        from ..drill.faultstore import wrap_from_env

        return wrap_from_env(build(*args, **kwargs))

    return wrapped


@_drill_faults
def store_from_url(
    url: str, *, clock: Clock | None = None, timeout: float = 10.0, migrate: bool = True
) -> Store:
    """A new, unopened store for ``url`` (``sqlite:///…``, ``postgresql://…``, ``memory://``).

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
