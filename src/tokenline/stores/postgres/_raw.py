"""Long statements sent in PostgreSQL's own ``$n`` form, converted once.

psycopg turns a statement's ``%(name)s`` placeholders into ``$1, $2, …`` on every
execution, and keeps the result only for statements of up to 4,096 characters
(``MAX_CACHED_STATEMENT_LENGTH``). The finish fused with a claim is longer: its text
was parsed again on every call, a tenth of a one-job worker's time per job on the
client. :class:`RawStatement` does that conversion once, and the store sends the result
through a raw cursor, which takes it as it is (and still prepares it on the server).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._errors import StoreError

__all__ = ["RawStatement", "needs_raw"]

#: The longest statement psycopg keeps converted (its ``MAX_CACHED_STATEMENT_LENGTH``,
#: which lives in a private module: a copy here, so that a psycopg release moving it
#: cannot break the import; were psycopg's limit to grow, a longer statement sent raw
#: would still be right, only converted by us instead of by psycopg).
MAX_CACHED_STATEMENT_LENGTH = 4096

#: A named placeholder, a doubled percent sign (a literal one), or any other percent
#: sign (an error: psycopg would refuse it too).
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%")


def needs_raw(text: str) -> bool:
    """Whether psycopg would convert ``text`` afresh on every execution."""
    return len(text) > MAX_CACHED_STATEMENT_LENGTH


@dataclass(frozen=True, slots=True)
class RawStatement:
    """A statement with named placeholders, in ``$n`` form, and the names in order."""

    text: bytes
    names: tuple[str, ...]

    @classmethod
    def convert(cls, text: str) -> RawStatement:
        """``text`` (``%(name)s`` placeholders, ``%%`` for a percent sign) in ``$n``
        form: a name used twice is one parameter."""
        names: list[str] = []

        def swap(match: re.Match[str]) -> str:
            name = match.group(1)
            if name is None:
                if match.group(0) == "%%":
                    return "%"
                raise StoreError(f"a lone '%' at offset {match.start()} of a statement")
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"

        return cls(_PLACEHOLDER.sub(swap, text).encode(), tuple(names))

    def params(self, given: Mapping[str, Any]) -> list[Any]:
        """The parameters in ``$n`` order; a name missing from ``given`` is a bug."""
        try:
            return [given[name] for name in self.names]
        except KeyError as exc:
            raise StoreError(f"statement parameter {exc} not given; this is a bug") from None
