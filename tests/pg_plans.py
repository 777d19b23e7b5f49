"""The plan PostgreSQL keeps for a statement of tokenline's, for the plan tests."""

from __future__ import annotations

import re
from typing import Any

#: The parameter types of the statements whose plans the tests read.
_PARAM_TYPES = {
    "owner": "text", "queues": "text[]", "limit": "integer", "ttl": "double precision",
    "aging": "double precision", "now": "double precision", "job_id": "bigint[]",
    "token": "bigint[]", "lease_owner": "text[]", "outcome": "text[]", "state": "text[]",
    "delay": "double precision[]", "refund": "integer[]", "final": "boolean[]",
    "error": "text[]", "error_class": "text[]", "operation": "text",
}  # fmt: skip


async def generic_plan(admin: Any, text: str) -> str:
    """The plan PostgreSQL keeps for ``text`` once it plans it without parameter values
    (EXPLAIN EXECUTE of a server-side prepared statement, generic plans forced)."""
    names: list[str] = []
    # A batch statement written for one row takes each array's one element.
    scalar = set(re.findall(r"ARRAY\[%\((\w+)\)s::", text))

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    body = re.sub(r"%\((\w+)\)s", number, text)
    types = ", ".join(
        _PARAM_TYPES[n].removesuffix("[]") if n in scalar else _PARAM_TYPES[n] for n in names
    )
    await admin.execute("DEALLOCATE ALL")
    await admin.execute(f"PREPARE generic_plan ({types}) AS {body}")
    await admin.execute("SET plan_cache_mode = force_generic_plan")
    try:
        args = ", ".join("NULL" for _ in names)
        cur = await admin.execute(f"EXPLAIN EXECUTE generic_plan({args})")
        return "\n".join(row[0] for row in await cur.fetchall())
    finally:
        await admin.execute("RESET plan_cache_mode")
        await admin.execute("DEALLOCATE generic_plan")
