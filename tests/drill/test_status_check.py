"""The checker's hold on ``tokenline status`` during a fault, on hand-made reports: the
right server named passes; a wrong or missing name, a false blame, a cut channel called
ok and no report at all each fail the run, saying why."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from tokenline.cli.drill import results_table, status_table
from tokenline.drill.checker import Report, StatusSeen, check_status
from tokenline.drill.runner import ScenarioResult
from tokenline.drill.scenarios import DRILL_SCENARIOS, StatusExpectation
from tokenline.drill.statusprobe import servers_of, status_argv

REDIS = "Redis at 127.0.0.1:41000/0"
POSTGRES = "PostgreSQL database 'test' on 127.0.0.1:5432"
SERVERS = {"broker": REDIS, "leases": REDIS, "ledger": POSTGRES}

OK: dict[str, Any] = {"ok": True, "failure": None, "latency_ms": 1.0, "error": None}


def _failing(error: str, failure: str = "slow") -> dict[str, Any]:
    return {"ok": False, "failure": failure, "latency_ms": None, "error": error}


def _seen(**channels: dict[str, Any]) -> StatusSeen:
    """A status report as ``tokenline status --json`` prints it: unnamed channels ok."""
    report = {"store": "ok", "channels": {c: channels.get(c, OK) for c in SERVERS}}
    return StatusSeen.from_report(report, SERVERS)


def _check(expected: StatusExpectation, seen: StatusSeen) -> Report:
    report = Report(jobs=0)
    check_status(expected, seen, report)
    return report


REDIS_DOWN = DRILL_SCENARIOS["redis_partition_one"].status
ALL_OK = DRILL_SCENARIOS["kill9"].status
CUT = _failing(f"{REDIS} did not answer within 1.5s")


def test_redis_cut_named_on_broker_and_leases_passes() -> None:
    """Broker and leases failing, each error naming the Redis server, the ledger ok: the
    answer a Redis partition must get."""
    assert REDIS_DOWN is not None
    report = _check(REDIS_DOWN, _seen(broker=CUT, leases=CUT))
    assert report.ok, report.violations
    assert _seen(broker=CUT).named("broker") == REDIS


def test_a_failing_channel_that_names_no_server_fails() -> None:
    """Saying that a channel fails without saying where is not enough."""
    assert REDIS_DOWN is not None
    report = _check(REDIS_DOWN, _seen(broker=CUT, leases=_failing("no answer within 1.5s")))
    assert not report.ok
    assert report.status_wrong == 1
    assert report.violations == [
        f"status: leases failing (slow) without naming {REDIS}: no answer within 1.5s"
    ]


def test_a_failing_channel_that_names_the_wrong_server_fails() -> None:
    """Blaming PostgreSQL for a Redis channel is wrong, and the reason names both."""
    assert REDIS_DOWN is not None
    wrong = _failing(f"{POSTGRES} did not answer within 1.5s")
    report = _check(REDIS_DOWN, _seen(broker=CUT, leases=wrong))
    assert report.status_wrong == 1
    assert f"without naming {REDIS} (it names {POSTGRES})" in report.violations[0]


def test_a_server_at_another_address_is_not_named() -> None:
    """The server is the one the struck worker reaches: another Redis is not it."""
    assert REDIS_DOWN is not None
    elsewhere = _failing("Redis at 127.0.0.1:6379/0 did not answer within 1.5s")
    report = _check(REDIS_DOWN, _seen(broker=elsewhere, leases=CUT))
    assert report.status_wrong == 1
    assert report.violations[0].startswith(f"status: broker failing (slow) without naming {REDIS}")


def test_a_cut_channel_reported_ok_fails() -> None:
    """A channel whose server is cut must not look healthy."""
    assert REDIS_DOWN is not None
    report = _check(REDIS_DOWN, _seen(broker=CUT))
    assert report.status_wrong == 1
    assert report.violations == [
        f"status: leases reported ok while its server was cut; expected failing, naming {REDIS}"
    ]


def test_a_channel_blamed_when_only_a_process_was_struck_fails() -> None:
    """kill9 and sigstop fault no channel: a failing one is a false blame."""
    assert ALL_OK is not None
    blamed = _failing(f"cannot reach {POSTGRES}", "unreachable")
    report = _check(ALL_OK, _seen(ledger=blamed))
    assert report.status_wrong == 1
    assert report.violations[0].startswith("status: ledger blamed falsely, no fault was on it")
    assert _check(ALL_OK, _seen()).ok


def test_a_channel_that_may_fail_passes_either_way_but_must_name_its_server() -> None:
    """lost_ack's ledger faults strike at random: status may call the ledger ok or
    failing, but failing it names PostgreSQL; broker and leases stay ok."""
    maybe = DRILL_SCENARIOS["lost_ack"].status
    assert maybe == StatusExpectation(maybe=frozenset({"ledger"}))
    lost = _failing(f"drill fault: the ledger lost the answer ({POSTGRES})", "unreachable")
    assert _check(maybe, _seen()).ok
    assert _check(maybe, _seen(ledger=lost)).ok
    unnamed = _check(maybe, _seen(ledger=_failing("the ledger lost the answer")))
    assert unnamed.status_wrong == 1
    assert _check(maybe, _seen(broker=CUT)).status_wrong == 1


def test_no_report_fails_with_its_reason() -> None:
    """A probe that hung, crashed or printed no JSON proves nothing: the run fails, and
    says why."""
    assert ALL_OK is not None
    silent = StatusSeen({}, SERVERS, "tokenline status gave no answer within 30s")
    report = _check(ALL_OK, silent)
    assert report.status_wrong == 1
    assert report.violations == [
        "status: no report during the fault: tokenline status gave no answer within 30s"
    ]


@pytest.mark.parametrize(
    ("report", "why"),
    [
        ({"store": "ok"}, "no channels in the status report"),
        ({"channels": {"broker": {"ok": "yes"}}}, "channel 'broker' malformed"),
        ([], "no channels in the status report"),
    ],
)
def test_a_malformed_report_is_no_report(report: object, why: str) -> None:
    """Output that is not status's JSON is kept as an error naming what was wrong."""
    seen = StatusSeen.from_report(report, SERVERS)
    assert seen.error is not None
    assert why in seen.error
    assert not _check(StatusExpectation(), seen).ok


def test_a_channel_missing_from_the_report_fails() -> None:
    """Each of the three channels must be in the report."""
    seen = StatusSeen.from_report({"channels": {"broker": OK, "leases": OK}}, SERVERS)
    report = _check(StatusExpectation(), seen)
    assert report.violations == ["status: ledger missing from the report"]


def test_the_json_form_keeps_how_each_channel_failed_and_the_server_named() -> None:
    """``tokenline drill --json`` shows which channels failed, how, and where."""
    assert _seen(broker=CUT).to_json() == {
        "error": None,
        "channels": {
            "broker": {"ok": False, "failure": "slow", "server": REDIS, "error": CUT["error"]},
            "leases": {"ok": True, "failure": None, "server": None, "error": None},
            "ledger": {"ok": True, "failure": None, "server": None, "error": None},
        },
    }


def test_the_servers_are_those_the_split_store_names() -> None:
    """The expected names come from the store itself, for the URL the worker uses; a
    store on one server has none to name."""
    from tokenline.stores import split_url

    url = split_url("redis://127.0.0.1:41000/0", "postgresql://postgres@127.0.0.1:5432/test")
    assert servers_of(url) == SERVERS
    assert servers_of("sqlite:///nowhere.db") == {}


def test_the_probe_is_the_status_command_with_a_short_timeout() -> None:
    """The probe runs ``tokenline status --json`` as an operator does, with the
    worker's app and URL."""
    argv = status_argv("tokenline.drill.app:app", "split:?broker=redis://h/0&ledger=x")
    assert argv[1:5] == ["-m", "tokenline", "status", "--app"]
    assert argv[argv.index("--url") + 1] == "split:?broker=redis://h/0&ledger=x"
    assert "--json" in argv
    assert float(argv[argv.index("--timeout") + 1]) <= 2.0


def test_an_expectation_names_known_channels_only() -> None:
    """A misspelt channel would make the expectation check nothing."""
    with pytest.raises(ValueError, match="unknown channel lease"):
        StatusExpectation(failing=frozenset({"lease"}))
    with pytest.raises(ValueError, match="both failing and maybe failing"):
        StatusExpectation(failing=frozenset({"ledger"}), maybe=frozenset({"ledger"}))


def _render(renderable: object) -> str:
    out = Console(width=250, color_system=None, force_terminal=False)
    with out.capture() as captured:
        out.print(renderable)
    return captured.get()


def test_the_drill_table_shows_what_status_said_and_the_verdict() -> None:
    """``tokenline drill`` prints, per scenario that probed status, each channel's answer
    with the server named, and says WRONG when the checker found it wrong."""
    assert REDIS_DOWN is not None
    right = _seen(broker=CUT, leases=CUT)
    wrong = _seen(broker=CUT, leases=_failing("no answer"))
    results = []
    for name, seen in (("redis_partition_one", right), ("redis_partition_all", wrong)):
        report = Report(jobs=10)
        check_status(REDIS_DOWN, seen, report)
        results.append(
            ScenarioResult(name, "split", report, 2.0, 3.0, status_expected=REDIS_DOWN, status=seen)
        )
    out = _render(status_table(results))
    first, second = (line for line in out.splitlines() if "redis_partition" in line)
    assert "broker, leases" in first
    assert f"slow: {REDIS}" in first
    assert "right" in first
    assert "no server named" in second
    assert "WRONG (1)" in second
    assert "(status wrong)" in _render(results_table(results, title="drill"))
    assert results[1].to_json()["status"]["expected"] == {
        "failing": ["broker", "leases"],
        "maybe": [],
    }
    no_probe = ScenarioResult("kill9", "sqlite", Report(jobs=10), 2.0, 3.0)
    assert status_table([no_probe]) is None
    assert no_probe.to_json()["status"] is None
