"""The command line's log formats: readable text, or one JSON object per line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from tokenline import _logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    """Put the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def _outcome(outcome: str) -> None:
    fields = {"worker_id": "w-1", "job_id": 7, "token": 3, "attempt": 2, "outcome": outcome}
    fields["error_class"] = None if outcome == "succeeded" else "transient"
    # As the worker does: the line per succeeded job has a logger of its own.
    name = _logging.SUCCESS_LOGGER if outcome == "succeeded" else "tokenline.worker"
    logging.getLogger(name).info("job 7 %s", outcome, extra=fields)


@pytest.mark.usefixtures("restore_root")
def test_json_lines_carry_the_structured_fields(capsys: pytest.CaptureFixture[str]) -> None:
    """Each record is one JSON object with time, level, logger, message and the job's
    worker id, job id, token, attempt, outcome and error class."""
    _logging.configure("info", "json")
    _outcome("retry")
    _outcome("succeeded")
    lines = capsys.readouterr().err.strip().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "job 7 retry"
    assert (first["worker_id"], first["job_id"], first["token"], first["attempt"]) == (
        "w-1",
        7,
        3,
        2,
    )
    assert (first["outcome"], first["error_class"], first["level"]) == (
        "retry",
        "transient",
        "info",
    )
    assert first["time"].endswith("+00:00")
    assert second["outcome"] == "succeeded"
    assert "error_class" not in second  # absent fields are left out, not null


@pytest.mark.usefixtures("restore_root")
def test_text_leaves_out_success_lines_unless_debug(capsys: pytest.CaptureFixture[str]) -> None:
    """Text at info: retries yes, a line per succeeded job no; at debug, both."""
    _logging.configure("info", "text")
    _outcome("retry")
    _outcome("succeeded")
    err = capsys.readouterr().err
    assert "job 7 retry" in err
    assert "job 7 succeeded" not in err
    _logging.configure("debug", "text")
    _outcome("succeeded")
    assert "job 7 succeeded" in capsys.readouterr().err


def test_an_unknown_format_is_refused() -> None:
    """Only text and json exist."""
    with pytest.raises(ValueError, match="text or json"):
        _logging.configure("info", "xml")


def test_an_unknown_level_is_refused_by_name() -> None:
    """The log set-up names the levels it takes instead of failing inside logging."""
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error"):
        _logging.configure("bogus")


EVIL_TEXT = "boom\x1b]0;owned\x07\x1b[2J\u202egnp"


def test_a_log_line_escapes_control_characters(
    restore_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The text log wrote a job's error as it came, control sequences and all; now
    escaped, line breaks too (a message's line break started a line that read as the
    log's own), while the line breaks of a traceback are kept."""
    _logging.configure("info", "text")
    log = logging.getLogger("tokenline.test")
    log.warning("job failed: %s\n2026-01-01 00:00:00,000 INFO forged: line", EVIL_TEXT)
    try:
        raise ValueError("inside")
    except ValueError:
        log.exception("with a traceback")
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert "\u202e" not in err
    assert "job failed: boom\\x1b]0;owned\\x07" in err
    assert "\\x0a2026-01-01 00:00:00,000 INFO forged: line" in err
    assert not any(line.startswith("2026-01-01") for line in err.splitlines())
    assert "with a traceback\nTraceback (most recent call last):\n" in err


def test_a_json_log_line_is_valid_utf8_with_a_lone_surrogate() -> None:
    """A lone surrogate in a logged value is written as its escape, so the line encodes
    to UTF-8 and reads back to the same text."""
    record = logging.LogRecord("tokenline", logging.WARNING, __file__, 1, "%s", ("a\udcffé",), None)
    line = _logging.JsonFormatter().format(record)
    line.encode("utf-8")  # strict: raises on a lone surrogate
    assert json.loads(line)["message"] == "a\udcffé"
    assert "é" in line
