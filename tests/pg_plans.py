"""The plan PostgreSQL keeps for a statement of tokenline's, for the plan tests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg

#: The parameter types of the statements whose plans the tests read.
_PARAM_TYPES = {
    "owner": "text", "queues": "text[]", "limit": "integer", "ttl": "double precision",
    "aging": "double precision", "now": "double precision", "job_id": "bigint[]",
    "token": "bigint[]", "lease_owner": "text[]", "outcome": "text[]", "state": "text[]",
    "delay": "double precision[]", "refund": "integer[]", "final": "boolean[]",
    "error": "text[]", "error_class": "text[]", "operation": "text",
}  # fmt: skip


def _numbered(text: str) -> tuple[str, list[str], list[str]]:
    """``text`` with ``$n`` placeholders, its parameter names in order, and their types."""
    names: list[str] = []
    # A batch statement written for one row takes each array's one element.
    scalar = set(re.findall(r"ARRAY\[%\((\w+)\)s::", text))

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    body = re.sub(r"%\((\w+)\)s", number, text)
    types = [_PARAM_TYPES[n].removesuffix("[]") if n in scalar else _PARAM_TYPES[n] for n in names]
    return body, names, types


async def generic_plan(admin: Any, text: str) -> str:
    """The plan PostgreSQL keeps for ``text`` once it plans it without parameter values
    (EXPLAIN EXECUTE of a server-side prepared statement, generic plans forced)."""
    body, names, types = _numbered(text)
    await admin.execute("DEALLOCATE ALL")
    await admin.execute(f"PREPARE generic_plan ({', '.join(types)}) AS {body}")
    await admin.execute("SET plan_cache_mode = force_generic_plan")
    try:
        args = ", ".join("NULL" for _ in names)
        cur = await admin.execute(f"EXPLAIN EXECUTE generic_plan({args})")
        return "\n".join(row[0] for row in await cur.fetchall())
    finally:
        await admin.execute("RESET plan_cache_mode")
        await admin.execute("DEALLOCATE generic_plan")


def _nodes(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


async def rows_read_from(
    admin: Any, text: str, params: Mapping[str, Any], *, table: str, generic: bool
) -> list[tuple[str, int]]:
    """Runs ``text`` once under EXPLAIN ANALYZE, in a transaction rolled back, and returns
    each read of ``table`` in its plan: the index (or scan) and the rows it returned per
    loop. ``generic``: the plan made without the parameters' values, the one the server
    keeps for a statement prepared and run again and again."""
    async with admin.transaction(force_rollback=True):
        if generic:
            body, names, types = _numbered(text)
            await admin.execute("DEALLOCATE ALL")
            await admin.execute(f"PREPARE rows_read ({', '.join(types)}) AS {body}")
            await admin.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            # Bound on the client: the server infers no parameter types for a utility
            # statement's arguments.
            marks = ", ".join(f"%s::{t}" for t in types)
            cur = psycopg.AsyncClientCursor(admin)
            await cur.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE rows_read({marks})",
                [params[n] for n in names],
            )
            (plan,) = await cur.fetchone()
            await admin.execute("DEALLOCATE rows_read")
        else:
            cur = await admin.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params)
            (plan,) = await cur.fetchone()
    if isinstance(plan, str):
        plan = json.loads(plan)
    return [
        (node.get("Index Name") or node["Node Type"], int(node["Actual Rows"]))
        for node in _nodes(plan[0]["Plan"])
        if node.get("Relation Name") == table
    ]


async def blocks_touched(admin: Any, text: str, params: Mapping[str, Any]) -> int:
    """Runs ``text`` once under EXPLAIN (ANALYZE, BUFFERS), in a transaction rolled back,
    and returns the shared blocks it touched (hit or read), functions it called
    included: a measure of the work of a read that does not depend on timing."""
    async with admin.transaction(force_rollback=True):
        cur = await admin.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + text, params)
        (plan,) = await cur.fetchone()
    if isinstance(plan, str):
        plan = json.loads(plan)
    top = plan[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])
