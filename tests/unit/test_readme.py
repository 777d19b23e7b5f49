"""The README documents every setting and every command a user can reach."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

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
