"""Log set-up for the command line: readable text by default, or one JSON object per line.

The worker logs each state transition and each job outcome with structured fields
(``worker_id``, ``job_id``, ``task``, ``queue``, ``attempt``, ``token``, ``outcome``,
``error_class``, ``error``; ``old_state``/``new_state`` for transitions) passed as
``extra``. The JSON format writes them as keys; the text format reads as prose and
leaves out the one line per succeeded job, which only a machine reader wants.

Log lines carry text from jobs (errors, arguments, keys), which may hold terminal
control characters: the text format writes them escaped (:func:`printable`), so a
stored ``\x1b[2J`` cannot clear or rewrite the reader's terminal. JSON escapes them
itself.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from typing import Any

__all__ = [
    "FIELDS",
    "LEVELS",
    "SUCCESS_LOGGER",
    "JsonFormatter",
    "TextFormatter",
    "configure",
    "json_text",
    "printable",
]

#: Structured fields a record may carry, in the order the JSON line shows them.
FIELDS = (
    "worker_id",
    "job_id",
    "task",
    "queue",
    "attempt",
    "token",
    "outcome",
    "error_class",
    "error",
    "old_state",
    "new_state",
)

#: The log levels a command takes, least to most severe.
LEVELS = ("debug", "info", "warning", "error")

#: The worker's logger of succeeded jobs.
SUCCESS_LOGGER = "tokenline.worker.succeeded"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Characters a terminal may act on rather than show: the C0 controls but tab and
#: newline, DEL, the C1 controls (``\x9b`` is a one-byte CSI), and the bidirectional
#: overrides, isolates and marks, which reorder what is shown; and those that show as
#: nothing or as a line break (the line and paragraph separators, which split a table's
#: cell, the soft hyphen, zero-width space, word joiner and byte-order mark), so that two
#: keys that differ never look the same.
_CONTROLS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u061c\u200b\u200e\u200f\u2028-\u202e"
    "\u2060-\u2064\u2066-\u2069\ufeff]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newlines: bool = True) -> str:
    """``text`` with every control character written as an escape (``\x1b``,
    ``\u202e``); tabs stay, and newlines unless ``newlines`` is false (then ``\x0a``)."""
    out = _CONTROLS.sub(_escaped, text)
    return out if newlines else out.replace("\n", "\\x0a")


_SURROGATES = re.compile("[\ud800-\udfff]")


def json_text(data: Any, **options: Any) -> str:
    """``data`` as JSON text that encodes to valid UTF-8: non-ASCII text stays as it
    is, but a lone surrogate (stored text may hold one; no UTF-8 can) is written as its
    ``\\udcff`` escape, which JSON allows. ``options`` go to :func:`json.dumps`."""
    text = json.dumps(data, ensure_ascii=False, **options)
    return _SURROGATES.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class TextFormatter(logging.Formatter):
    """Prose lines (:data:`TEXT_FORMAT`) with control characters escaped; the line
    breaks of a traceback stay, a message's do not: a job's error holding a line break
    would otherwise start a line of its own, one that reads as the log's."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line, with the message's own line breaks written as ``\x0a``."""
        return printable(super().formatMessage(record), newlines=False)

    def format(self, record: logging.LogRecord) -> str:
        """The record as text a terminal shows as written."""
        return printable(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, and the
    structured fields the record carries."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json_text(out, default=str)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send tokenline's (and everything else's) logs to stderr at ``level``, as ``text``
    or ``json``. At ``debug`` the text log keeps the success lines too."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    # The line per succeeded job (its own logger, so that a worker does not even build
    # it unless asked): in JSON, and in text at debug.
    quiet = fmt == "text" and level.lower() != "debug"
    logging.getLogger(SUCCESS_LOGGER).setLevel(logging.WARNING if quiet else logging.NOTSET)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
