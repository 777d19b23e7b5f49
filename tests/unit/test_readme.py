"""The README documents every setting and every command a user can reach."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
from click.testing import CliRunner

from tokenline import Settings
from tokenline._config import WorkerSettings
from tokenline.cli import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readmes_tables() -> None:
    """An undocumented setting is one a user cannot find: each app and worker setting
    has a row of its own (its name in backticks at the start of a table row)."""
    missing = [
        f.name
        for cls in (Settings, WorkerSettings)
        for f in dataclasses.fields(cls)
        if f"| `{f.name}` |" not in README
    ]
    assert missing == []


def _commands(group: click.Group, prefix: str = "") -> list[str]:
    names = []
    for name, cmd in group.commands.items():
        full = f"{prefix}{name}"
        names.append(full)
        if isinstance(cmd, click.Group):
            names.extend(_commands(cmd, f"{full} "))
    return names


def test_every_command_is_in_the_readme() -> None:
    """Each CLI command (and subcommand) appears in the README as ``tokenline <name>``."""
    missing = [c for c in _commands(main) if f"tokenline {c}" not in README]
    assert missing == []


def test_the_readme_refers_to_no_document_it_does_not_ship() -> None:
    """References to a design document outside the repository lead nowhere."""
    assert "DESIGN.md" not in README


def test_the_quick_starts_cli_enqueue_is_a_new_order() -> None:
    """The quick start's ``tokenline enqueue … --key invoice:N`` named an order that
    ``python jobs.py`` had already enqueued (keys alone do not keep a second job out):
    following the README wrote a duplicate invoice."""
    start = README[README.index("## Quick start") :]
    enqueued = int(re.search(r"range\((\d+)\)\]", start)[1])  # type: ignore[index]
    line = next(x for x in start.splitlines() if x.startswith("tokenline enqueue"))
    found = re.search(r"send_invoice '\[(\d+)\]' --key invoice:(\d+)", line)
    assert found, line
    order, key = int(found[1]), int(found[2])
    assert order == key
    assert order not in range(enqueued)


def test_the_readme_and_drill_help_agree_on_a_named_sqlite_file() -> None:
    """The README said the drill removes everything unless --keep; its --help said the
    files beside --url sqlite:///file are left in place, which is what it does."""
    result = CliRunner().invoke(main, ["drill", "--help"], terminal_width=200)
    helptext = " ".join(result.output.split())
    drill = " ".join(README[README.index("## The drill") :].split())[:1500]
    for text in (helptext, drill):
        assert "left in place" in text
        assert "--overwrite" in text
