"""Log set-up for the command line: readable text by default, or one JSON object per line.

The worker logs each state transition and each job outcome with structured fields
(``worker_id``, ``job_id``, ``task``, ``queue``, ``attempt``, ``token``, ``outcome``,
``error_class``, ``error``; ``old_state``/``new_state`` for transitions) passed as
``extra``. The JSON format writes them as keys; the text format reads as prose and
leaves out the one line per succeeded job, which only a machine reader wants.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

__all__ = ["FIELDS", "LEVELS", "SUCCESS_LOGGER", "JsonFormatter", "configure"]

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
        return json.dumps(out, default=str, ensure_ascii=False)


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
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    # The line per succeeded job (its own logger, so that a worker does not even build
    # it unless asked): in JSON, and in text at debug.
    quiet = fmt == "text" and level.lower() != "debug"
    logging.getLogger(SUCCESS_LOGGER).setLevel(logging.WARNING if quiet else logging.NOTSET)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
