"""The port of a store URL, checked where the URL is parsed.

A port out of range or not a number is a mistake in the setting, and said as one
(:class:`ConfigError`, exit status 2 on the command line, as for any other malformed
URL), before anything connects: libpq let it through to the connection, which failed
as an outage ("invalid port number"), and a Redis URL's port 0 was taken as 6379.
"""

from __future__ import annotations

import re

from .._errors import ConfigError

__all__ = ["MAX_PORT", "check_port"]

#: The highest TCP port; the lowest is 1 (0 names none).
MAX_PORT = 65535

#: A port as written: ASCII digits only (``int()`` also reads ``+80`` and ``٨٠``).
_DIGITS = re.compile(r"[0-9]+")


def check_port(text: str, server: str, *, setting: str = "url") -> int:
    """``text``, a port as written in a ``server`` URL (``"PostgreSQL"``, ``"Redis"``),
    as a number from 1 to :data:`MAX_PORT`; else a :class:`ConfigError` of ``setting``
    naming it and what a port must be."""
    if _DIGITS.fullmatch(text) and 1 <= int(text) <= MAX_PORT:
        return int(text)
    raise ConfigError(
        setting,
        f"the {server} URL's port {text!r} is not a port number: give a whole number "
        f"from 1 to {MAX_PORT} in digits 0-9, or leave it out for the default",
    )
