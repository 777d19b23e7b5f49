"""Values to and from the Lua scripts: numbers as exact text, nullable text as JSON,
hashes as dicts of text."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["fl", "fmt", "opt", "pairs", "text"]


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
