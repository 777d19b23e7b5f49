"""Passwords out of what tokenline prints: a store URL may carry one.

``postgresql://app:secret@db/prod`` and ``redis://default:secret@cache/0`` (alone, or
inside a split URL's ``broker=``/``ledger=``), and libpq's ``password=`` parameter,
are shown with ``***`` in its place wherever tokenline prints a URL or an error that
quotes one: ``status``, ``migrate``, the notes of the command line, every tokenline
error's text. An operator pastes that output into tickets and chats.
"""

from __future__ import annotations

import re

__all__ = ["redact"]

#: ``scheme://user:password@`` — the user part may be empty (``redis://:pw@host``); a
#: raw ``@`` cannot be in the password (it is written ``%40``), so it ends there.
_USERINFO = re.compile(r"(?P<head>://[^\s/@?&#:]*:)(?P<secret>[^\s/@?&#]*)(?P<at>@)")
#: The same, percent-encoded inside a split URL's parameter: there the password ends
#: at the first ``%40`` (one of its own would be ``%2540``).
_ENCODED = re.compile(
    r"(?P<head>%3A%2F%2F(?:(?!%3A)[^\s/@?&#])*%3A)(?P<secret>(?:(?!%40)[^\s/@?&#])*)(?P<at>%40)",
    re.IGNORECASE,
)
#: ``password=…`` as a query parameter (libpq's), plain or percent-encoded.
_PARAMETER = re.compile(r"(?P<head>password(?:=|%3D))(?P<secret>[^\s&#'\"]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every URL password replaced by ``***``."""
    if "@" not in text and "%40" not in text and "assword" not in text:
        return text  # the common case, quickly
    text = _USERINFO.sub(r"\g<head>***\g<at>", text)
    text = _ENCODED.sub(r"\g<head>***\g<at>", text)
    return _PARAMETER.sub(r"\g<head>***", text)
