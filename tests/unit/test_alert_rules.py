"""The shipped Prometheus alerting rules: valid, tested, built on exported metrics, and
each linked to its section of the runbook.

promtool (Debian's ``prometheus`` package) checks and unit-tests the rules; without it
these tests are skipped with the reason, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from prometheus_client import CollectorRegistry

from tokenline.cli import main
from tokenline.metrics import StoreCollector, WorkerMetrics
from tokenline.ops import alert_rules_path
from tokenline.stores import store_from_url

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "src" / "tokenline" / "ops" / "alerts.rules.yml"
RULE_TESTS = Path(__file__).with_name("alert_rules_test.yml")
RUNBOOK = ROOT / "docs" / "runbook.md"

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SEVERITIES = {"critical", "warning"}
#: Commands the runbook tells operators about before they exist in the CLI.
PENDING_COMMANDS: set[str] = set()
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass
class Rule:
    """What the tests need of one alerting rule."""

    alert: str
    fields: dict[str, str] = field(default_factory=dict)


def _block(lines: list[str], i: int, indent: int) -> tuple[str, int]:
    """The lines after ``i`` indented deeper than ``indent`` (a YAML block scalar)."""
    body = []
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
        body.append(lines[j].strip())
        j += 1
    return "\n".join(body).strip(), j


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def parse_rules(text: str) -> list[Rule]:
    """The alerting rules of ``text``, read line by line (the project has no YAML parser;
    promtool, which reads it as YAML, confirms the count in ``test_promtool_check``).

    Each ``key: value`` or ``key: |``/``key: >-`` block under an ``- alert:`` entry is
    kept by its key; nested maps (labels, annotations) are flattened.
    """
    lines = text.splitlines()
    rules: list[Rule] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^\s*- alert:\s*(\S+)\s*$", line)
        if m:
            rules.append(Rule(m.group(1)))
            i += 1
            continue
        m = re.match(r"^(\s*)([a-z_]+):\s*(.*)$", line)
        if rules and m and not line.lstrip().startswith("- "):
            key, value = m.group(2), m.group(3).strip()
            if value in ("|", ">-", ">", "|-"):
                value, i = _block(lines, i, len(m.group(1)))
                rules[-1].fields[key] = value
                continue
            if value:
                rules[-1].fields[key] = value.strip('"')
        elif re.match(r"^\s*- (record|name):", line) and rules:
            rules.append(Rule(""))  # a recording rule or a new group ends the alert
        i += 1
    return [r for r in rules if r.alert]


RULES_TEXT = RULES.read_text()
ALERTS = parse_rules(RULES_TEXT)


def promtool() -> str:
    """The promtool binary; skips without it (fails in CI)."""
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (Debian package prometheus)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def exported_metric_names() -> set[str]:
    """Every metric name the worker hook and the store collector export (a counter's
    family name gets its ``_total`` back; a histogram's is its base name)."""
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    families = list(registry.collect())
    collector = StoreCollector(store_from_url("memory://"))
    try:
        families += list(collector.describe())  # describes only: reads nothing
    finally:
        collector.close()
    return {f.name + ("_total" if f.type == "counter" else "") for f in families}


def metric_names_in(expr: str, exported: set[str]) -> set[str]:
    """The metric names an expression uses, histogram suffixes stripped."""
    names = set()
    for name in re.findall(r"\btokenline_[a-z_]+\b", expr):
        if name not in exported:
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix):
                    name = name.removesuffix(suffix)
                    break
        names.add(name)
    return names


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings: lower case, punctuation
    dropped, spaces as hyphens."""
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", markdown, re.MULTILINE):
        text = re.sub(r"[^\w\- ]", "", m.group(1).lower())
        anchors.add(text.replace(" ", "-"))
    return anchors


def test_the_package_ships_the_rules_file() -> None:
    """``tokenline.ops.alert_rules_path()`` finds the rules file of this source tree."""
    path = alert_rules_path()
    assert path.is_file()
    assert path.read_text() == RULES_TEXT


def test_the_rules_are_read_completely() -> None:
    """The line reader above found every alert, each with an expression."""
    assert len(ALERTS) == RULES_TEXT.count("- alert:") >= 7
    assert all(r.fields.get("expr") for r in ALERTS)
    assert len({r.alert for r in ALERTS}) == len(ALERTS)


def test_promtool_check() -> None:
    """``promtool check rules`` accepts the file and counts as many rules as we read."""
    out = run_promtool("check", "rules", str(alert_rules_path()))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests() -> None:
    """Each alert fires in its scenario and stays silent in a healthy one
    (tests/unit/alert_rules_test.yml)."""
    out = run_promtool("test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_scenario_that_fires_it() -> None:
    """The promtool tests expect each alert at least once, and check each at least once
    where it must not fire."""
    tests = RULE_TESTS.read_text()
    for rule in ALERTS:
        checks = re.findall(
            rf"alertname: {rule.alert}\n((?:        (?!- eval_time).*\n)*)", tests + "\n"
        )
        assert any("exp_alerts:" in c for c in checks), f"{rule.alert} never expected to fire"
        assert any("exp_alerts:" not in c for c in checks), f"{rule.alert} never checked silent"


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r.alert)
def test_every_alert_is_complete(rule: Rule) -> None:
    """A ``for:``, a severity, a summary and a description."""
    assert re.fullmatch(r"\d+[smh]", rule.fields.get("for", "")), rule.fields
    assert rule.fields.get("severity") in SEVERITIES
    assert rule.fields.get("summary")
    assert rule.fields.get("description")


def test_every_metric_used_is_exported() -> None:
    """An expression on a metric nobody exports never fires: each ``tokenline_*`` name in
    an expression is one the worker hook or the store collector exports."""
    exported = exported_metric_names()
    unknown = {
        rule.alert: sorted(metric_names_in(rule.fields["expr"], exported) - exported)
        for rule in ALERTS
    }
    assert {a: names for a, names in unknown.items() if names} == {}


def test_the_metric_name_reader_sees_histograms_and_unknown_names() -> None:
    """The name reader itself: suffixes of histograms are stripped, a misspelt name is
    kept as it is (and so reported)."""
    exported = {"tokenline_job_wait_seconds", "tokenline_jobs_finished_total"}
    expr = (
        "rate(tokenline_job_wait_seconds_bucket[5m]) and tokenline_jobs_finished_total"
        " or tokenline_jobs_finishd_total"
    )
    assert metric_names_in(expr, exported) == {
        "tokenline_job_wait_seconds",
        "tokenline_jobs_finished_total",
        "tokenline_jobs_finishd_total",
    }


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r.alert)
def test_every_alert_links_to_its_runbook_section(rule: Rule) -> None:
    """``runbook_url`` is ``docs/runbook.md#<alert name in lower case>``, and the runbook
    has that heading."""
    url = rule.fields.get("runbook_url", "")
    assert url == f"docs/runbook.md#{rule.alert.lower()}"
    assert rule.alert.lower() in heading_anchors(RUNBOOK.read_text())


def test_the_runbook_has_no_section_without_an_alert() -> None:
    """A section for an alert that was renamed or removed would mislead."""
    sections = re.findall(r"^## (Tokenline\w+)\s*$", RUNBOOK.read_text(), re.MULTILINE)
    assert sorted(sections) == sorted(r.alert for r in ALERTS)


def runbook_commands(markdown: str) -> list[str]:
    """The ``tokenline …`` command lines of the runbook: in code blocks (comments cut)
    and in inline code."""
    lines = []
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line.split("#", 1)[0])
    lines += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", markdown, flags=re.DOTALL))
    return [
        m.group(0).strip()
        for line in lines
        if (m := re.match(r"tokenline [a-z][a-z-]*(?=\s|$).*", line.strip()))
    ]


def test_the_runbook_names_only_commands_and_options_that_exist() -> None:
    """Each ``tokenline`` command of the runbook, and each ``--option`` given to it, is
    one the CLI has: an operator following it during an incident must not hit a typo."""
    commands = runbook_commands(RUNBOOK.read_text())
    assert len(commands) > 10
    wrong = []
    for text in commands:
        words = text.split()[1:]
        cmd: click.Command = main
        while isinstance(cmd, click.Group) and words and words[0] in cmd.commands:
            cmd = cmd.commands[words.pop(0)]
        if isinstance(cmd, click.Group):
            if not (words and words[0] in PENDING_COMMANDS):
                wrong.append(f"{text}: no such command")
            continue
        options = {o for p in cmd.params for o in getattr(p, "opts", [])}
        wrong += [
            f"{text}: {w} is not an option"
            for w in words
            if w.startswith("--") and w.split("=")[0] not in options
        ]
    assert wrong == []
