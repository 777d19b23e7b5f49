"""Loads named queries from a dialect's ``queries.sql``.

Each query starts with a ``-- name: <name>`` line and runs to the next one, so SQL
lives in one data file per dialect, never in f-strings.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["load_queries"]

_HEADER = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def load_queries(package: str, filename: str = "queries.sql") -> dict[str, str]:
    """Return ``{name: sql}`` for every named query in ``package``'s ``filename``."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice in {package}/{filename}")
        queries[name] = body.strip()
    return queries
