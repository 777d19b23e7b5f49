"""Values to and from the Lua scripts: numbers as exact text, nullable text as JSON,
hashes as dicts of text."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..._errors import StoreError

if TYPE_CHECKING:
    from ..._jobs import NewJob

__all__ = ["fl", "fmt", "job_args", "opt", "pairs", "text"]


def fmt(x: float) -> str:
    """A number as text that converts back to the same float."""
    return repr(float(x))


def opt(v: str | None) -> str:
    """Nullable text as a script argument: JSON ``null`` or a string."""
    return json.dumps(v)


def text(v: Any) -> str:
    """A reply value as text."""
    return v.decode() if isinstance(v, bytes) else str(v)


def pairs(flat: Any) -> dict[str, str]:
    """A hash as a dict of text: scripts return it flat, HGETALL as a dict."""
    if isinstance(flat, dict):
        return {text(k): text(v) for k, v in flat.items()}
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


def fl(v: str | None) -> float | None:
    """An optional number field: ``None`` when absent or empty."""
    return None if v is None or v == "" else float(v)


def job_args(j: NewJob) -> list[Any]:
    """The 12 arguments of one job, as ``enqueue.lua`` (and ``schedule.lua``) take them."""
    if j.unique is not None and j.idempotency_key is None:
        raise StoreError("a unique job needs an idempotency key")
    return [
        j.queue,
        j.task,
        j.args,
        opt(j.idempotency_key),
        j.priority,
        "" if j.run_at is None else fmt(j.run_at),
        "" if j.delay is None else fmt(j.delay),
        j.max_attempts,
        "" if j.timeout is None else fmt(j.timeout),
        j.max_lease_expiries,
        "" if j.unique is None else j.unique.value,
        "" if j.unique_for is None else fmt(j.unique_for),
    ]
