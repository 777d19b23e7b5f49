"""The dashboard's pure parts: samples and charts, the guard, alerts and the verdict."""

from __future__ import annotations

import html
from typing import Any

import pytest
from markupsafe import Markup

from tokenline import App
from tokenline._jobs import WorkerRecord
from tokenline._logging import printable
from tokenline.dashboard.app import CLIP_CHARS, _Dashboard, clip, exact, shown
from tokenline.dashboard.charts import Sample, Samples, svg_chart
from tokenline.dashboard.data import Overview, QueueRow, WorkerRow, firing_alerts
from tokenline.dashboard.hosts import HostPolicy, parse_authority, root_url
from tokenline.dashboard.security import Guard

OK = {"ok": True, "failure": None, "latency_ms": 1.0, "error": None}


def test_samples_keep_one_per_interval_and_derive_throughput() -> None:
    """Samples closer than the interval are dropped; throughput is finished jobs per
    second between kept samples; a clock that goes back starts over."""
    s = Samples(size=3, min_interval=1.0)
    for at, finished in ((0.0, 0), (0.5, 5), (2.0, 10), (4.0, 30), (6.0, 30)):
        s.add(Sample(at=at, queued=int(at), running=0, finished=finished))
    assert [x.at for x in s.items()] == [2.0, 4.0, 6.0]  # 0.5 dropped, 0.0 rotated out
    assert s.throughput() == [(4.0, 10.0), (6.0, 0.0)]
    assert s.rate() == pytest.approx(5.0)
    s.add(Sample(at=1.0, queued=0, running=0, finished=0))
    assert [x.at for x in s.items()] == [1.0]
    assert s.rate() is None


def test_per_queue_rate_needs_the_queue_at_both_ends() -> None:
    """A queue's rate is its own finished jobs over the samples' span; a queue missing
    from the first or last sample has none yet."""
    s = Samples(min_interval=0.0)
    s.add(Sample(at=0.0, queued=0, running=0, finished=0, finished_by_queue={"a": 0}))
    s.add(Sample(at=10.0, queued=0, running=0, finished=50, finished_by_queue={"a": 20, "b": 30}))
    assert s.rate() == pytest.approx(5.0)
    assert s.rate("a") == pytest.approx(2.0)
    assert s.rate("b") is None


def test_chart_draws_every_point_and_escapes_its_label() -> None:
    """The polyline has one vertex per point; the label cannot inject markup."""
    svg = svg_chart([(0, 1), (1, 3), (2, 2)], label="<script>x</script>")
    (points,) = svg.split('points="')[1:]
    assert len(points.split('"')[0].split()) == 3
    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg
    assert "collecting samples" in svg_chart([(0, 1)], label="one")


def test_guard_compares_tokens_and_is_read_only_without_one() -> None:
    """Only the exact operator token passes; without one configured nothing does."""
    g = Guard("right")
    assert g.check_operator("right") is None
    refusal = g.check_operator("righ")
    assert refusal is not None
    assert refusal.status == 401
    refusal = Guard(None).check_operator("right")
    assert refusal is not None
    assert refusal.status == 403
    assert g.check_csrf(g.csrf_token) is None
    assert g.check_csrf(Guard("right").csrf_token) is not None  # another process's form
    own = "http://127.0.0.1:8080"
    mine = {"own_origin": own, "is_own": lambda origin: origin == own}
    assert g.check_origin(origin=own, fetch_site="same-origin", **mine) is None
    assert g.check_origin(origin=None, fetch_site=None, **mine) is None
    assert g.check_origin(origin="http://127.0.0.1:9", fetch_site=None, **mine)


def test_long_text_is_clipped_on_a_page_with_its_size_and_the_command_for_all() -> None:
    """Arguments, results and errors longer than CLIP_CHARS show their start, their
    size and ``tokenline job ID --json``; shorter ones show whole, without a note."""
    assert clip(None) == clip("")
    assert not clip("x" * CLIP_CHARS).cut
    long_one = clip("y" * 5_000_000)
    assert long_one.cut
    assert long_one.text == "y" * CLIP_CHARS
    assert long_one.size == 5_000_000
    dash = _Dashboard(App("memory://"), None, None, timeout=1.0, drill_results=None)  # type: ignore[arg-type]
    macro = dash.templates.env.from_string(
        '{% from "_macros.html" import long %}{{ long(v, 7) }}|{{ long(w, 7, code=True) }}'
    )
    shown = macro.render(v="<b>" + "r" * 10_000, w="short")
    assert len(shown) < CLIP_CHARS + 500
    assert "of 10,003 characters" in shown
    assert "tokenline job 7 --json" in shown
    assert "<b>" not in shown  # escaped
    assert shown.endswith("|<code>short</code>")


def test_pages_escape_what_the_command_line_escapes_and_forms_keep_it() -> None:
    """Shown text has the command line's escapes, HTML built by a template keeps its
    markup; a form's value is the text itself once a browser decodes it, in printable
    ASCII that the page's escaping leaves alone."""
    text = "ключ\u202e \u2066a\u2069 \u200b\ufeff\xad \x1b[2J\x9b\x7f <b>&\"'"
    assert shown(text) == printable(text)
    assert r"ключ\u202e \u2066a\u2069 \u200b\ufeff\xad \x1b[2J\x9b\x7f" in str(shown(text))
    assert shown(Markup("<b>\u202e</b>")) == Markup(r"<b>\u202e</b>")
    assert shown(None) is None
    key = "ключ\u202e \u2066a\u2069 \u200b\ufeff\xad\u2028 😀 <b>&\"'"  # no control: a key
    field = exact(key)
    assert isinstance(field, Markup)
    assert field.isascii()
    assert field.isprintable()
    assert shown(field) == field
    assert html.unescape(field) == key
    assert "<" not in field
    assert '"' not in field


@pytest.mark.parametrize(
    ("host", "port", "url"),
    [("::1", 8080, "http://[::1]:8080/"), ("127.0.0.1", 80, "http://127.0.0.1:80/"),
     ("fe80::1", 1, "http://[fe80::1]:1/"), ("dash.lan", 8080, "http://dash.lan:8080/")],
)  # fmt: skip
def test_urls_put_an_ipv6_host_in_brackets(host: str, port: int, url: str) -> None:
    """Every address the dashboard writes is a URL a browser takes."""
    assert root_url(host, port) == url
    assert HostPolicy.of((host, port)).root() == url
    assert HostPolicy.of((f"[{host}]", port)).root() == url


def test_parse_authority_reads_host_headers_as_browsers_send_them() -> None:
    """Host and port, lowercased, an IPv6 address in brackets; anything else is None."""
    assert parse_authority("LocalHost:8080") == ("localhost", 8080)
    assert parse_authority("[::1]:8080") == ("::1", 8080)
    assert parse_authority("[0:0::1]") == ("::1", None)
    assert parse_authority("example.com") == ("example.com", None)
    for bad in ("::1:8080", "[::1", "[nothost]:1", "a:b", "a:99999", "a:", "", "a b", "a@b"):
        assert parse_authority(bad) is None, bad


def _worker(wid: str, state: str, skew: float | None = None) -> WorkerRow:
    rec = WorkerRecord(wid, "h", 1, ("default",), 4, state, 1, 0.0, 99.0, 1e12, clock_skew=skew)
    return WorkerRow(rec, alive=True, heartbeat_gap=1.0)


def _overview(**kw: Any) -> Overview:
    channels = {"broker": dict(OK), "leases": dict(OK), "ledger": dict(OK)}
    return Overview(store="ok", error=None, channels=channels, now=100.0, **kw)


def test_alerts_fire_on_queued_jobs_without_workers_old_jobs_and_skew() -> None:
    """The conditions of the alert rules hold when their figures say so, and only then."""
    q = QueueRow("default", 3, 0, 0, 0, 0, 400.0, False)
    o = _overview(queues=[q], workers=[_worker("w1", "draining", skew=5.0)])
    names = {a.name for a in firing_alerts(o)}
    assert names == {
        "TokenlineJobsQueuedWithoutWorkers",
        "TokenlineJobAgeOverSLA",
        "TokenlineClockSkewPastLeaseMargin",
    }
    calm = _overview(queues=[QueueRow("default", 3, 0, 0, 0, 0, 1.0, False)],
                     workers=[_worker("w1", "ready")])  # fmt: skip
    assert firing_alerts(calm) == []


@pytest.mark.parametrize(
    ("change", "headline"),
    [
        ({}, "All channels healthy"),
        ({"failing": "leases"}, "Coordination problem"),
        ({"breaker": "open"}, "Dependency down"),
        ({"worker": "fenced"}, "Coordination problem"),
    ],
)
def test_verdict_tells_coordination_from_compute(change: dict[str, str], headline: str) -> None:
    """A failing channel, an open breaker or a fenced worker is a coordination problem;
    otherwise a backlog is a question of compute."""
    o = _overview(workers=[_worker("w1", change.get("worker", "processing"))])
    if "failing" in change:
        o.channels[change["failing"]] = {**OK, "ok": False, "failure": "slow"}
    if "breaker" in change:
        o.dependencies = {"payments": {"state": "open", "open_until": 200.0, "prober": None}}
    level, title, findings = o.verdict()
    assert title == headline
    assert (level == "ok") == (headline == "All channels healthy")
    assert ("Adding workers will not help." in findings) == (level == "bad")


def test_verdict_names_every_finding_gravest_first() -> None:
    """An open breaker heads the verdict; the fenced worker and the paused queue are
    still named under it."""
    o = _overview(
        workers=[_worker("w1", "fenced")],
        queues=[QueueRow("mail", 0, 0, 0, 0, 0, None, True)],
    )
    o.dependencies = {"payments": {"state": "open", "open_until": 200.0, "prober": None}}
    _, title, findings = o.verdict()
    assert title == "Dependency down"
    assert findings[:3] == ["circuit breaker open: payments", "fenced: w1", "queue paused: mail"]
