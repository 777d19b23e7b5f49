"""Loads named queries from a dialect's ``queries.sql``.

Each query starts with a ``-- name: <name>`` line and runs to the next one, so SQL
lives in one data file per dialect, never in f-strings.

Whole-line comments and indentation are dropped from the loaded text: they are for the
reader of the file, and the driver's cache of parsed statements skips long ones
(psycopg's, past 4 KiB), which would cost every call a parse of the text. A comment at
the end of a line of code stays (the test tree's sabotage finds token checks by theirs).
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
        queries[name] = _compact(body)
    return queries


def _compact(body: str) -> str:
    lines = (line.strip() for line in body.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("--"))
