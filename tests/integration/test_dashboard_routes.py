"""The dashboard's routes over a SQLite store with real jobs, workers and leases.

Each page answers with what the store holds; each action changes the store as asked,
once the guard lets it through; every refusal (a missing or wrong operator token, a
forged or cross-site form, a read-only dashboard, an unknown or malformed id) answers
with the right status and a readable page, and leaves the store exactly as it was.
"""

from __future__ import annotations

import asyncio
import html
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboard_state import (
    LEASE_KEY,
    SPOOF_KEY,
    SPOOF_OWNER,
    SPOOF_QUEUE,
    SPOOF_WORKER,
    SPOOFING,
    State,
    fingerprint,
    plant_spoofed,
    populate,
)
from tokenline.dashboard import create_app
from tokenline.stores import store_from_url

TOKEN = "s3cret-operator-token"
#: The name the test clients reach the dashboard under: allowed, as behind a proxy.
HOST = "dash.test"
BASE = f"http://{HOST}"


@pytest.fixture
def state(tmp_path: Path) -> State:
    """A store with jobs queued, running and dead, workers and a resource lease."""
    return populate(tmp_path, faulty=True)


def _client(
    state: State, token: str | None = TOKEN, base: str = BASE, **kwargs: Any
) -> httpx.AsyncClient:
    kwargs.setdefault("allowed_hosts", [HOST])
    web = create_app(state.app, operator_token=token, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=web), base_url=base)


@pytest.fixture
async def client(state: State) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a dashboard with actions enabled."""
    async with _client(state) as c:
        yield c


async def csrf_of(client: httpx.AsyncClient, path: str) -> str:
    """The CSRF token of the confirmation form at ``path``."""
    page = await client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found, page.text
    return found.group(1)


async def act(
    client: httpx.AsyncClient,
    action: str,
    fields: dict[str, Any],
    *,
    token: str | None = TOKEN,
    csrf: str | None = "fetch",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST ``action`` as the confirmation form would, with what is given."""
    form = {k: str(v) for k, v in fields.items()}
    if csrf == "fetch":
        csrf = await csrf_of(client, f"/actions/{action}?{httpx.QueryParams(form)}")
    if csrf is not None:
        form["csrf"] = csrf
    if token is not None:
        form["operator_token"] = token
    sent = {"sec-fetch-site": "same-origin", "origin": BASE} | (headers or {})
    return await client.post(f"/actions/{action}", data=form, headers=sent)


# -- pages ----------------------------------------------------------------------------------
async def test_overview_shows_queues_workers_by_state_channels_and_the_open_breaker(
    client: httpx.AsyncClient,
) -> None:
    """The overview names each queue with its depth, each worker under its state, each
    channel's health, the open breaker as the verdict, and the paused queue."""
    page = await client.get("/")
    assert page.status_code == 200
    html = page.text
    assert 'data-queue="default"' in html
    assert re.search(r'data-queue="emails">.*?paused', html, re.S)
    for group, worker in (("ready", "w-ready"), ("processing", "w-busy"), ("fenced", "w-fenced")):
        section = html.split(f'data-group="{group}"')[1].split('data-group="')[0]
        assert f'data-worker="{worker}"' in section, group
    for channel in ("broker", "leases", "ledger"):
        assert re.search(rf'data-channel="{channel}">.*?<span class="good">ok', html, re.S)
    assert "Dependency down" in html
    assert "breaker OPEN" in html


async def test_job_page_lists_attempts_with_tokens(client: httpx.AsyncClient, state: State) -> None:
    """A running job's page shows its owner and the token of its attempt."""
    page = await client.get(f"/jobs/{state.running[0]}")
    assert page.status_code == 200
    assert 'data-token="' in page.text
    assert "w-busy" in page.text


async def test_a_job_page_clips_huge_text_and_says_how_to_get_all_of_it(
    client: httpx.AsyncClient, state: State
) -> None:
    """A job whose arguments are huge (1 MB): the page shows their start, their full
    size, and the command that prints them whole; it stays small (its error, cut by
    the store to 2000 characters, included)."""
    from tokenline._jobs import NewJob

    args = '{"args": ["' + "a" * 1_000_000 + '"], "kwargs": {}}'
    store = store_from_url(state.url)
    await store.open()
    try:
        (jid,) = await store.jobs_enqueue(jobs=[NewJob(queue="big", task="t", args=args)])
        (claim,) = await store.jobs_claim(owner="w-busy", queues=["big"], limit=1, ttl=60)
        await store.job_dead(lease=claim.lease, error="E" * 100_000, error_class="permanent")
    finally:
        await store.close()
    page = await client.get(f"/jobs/{jid}")
    assert page.status_code == 200
    assert len(page.text) < 50_000
    assert f"of {len(args):,} characters" in page.text
    assert f"tokenline job {jid} --json" in page.text
    assert "a" * 1000 in page.text
    assert "a" * 2001 not in page.text


async def test_only_an_unfinished_job_page_refreshes(
    client: httpx.AsyncClient, state: State
) -> None:
    """A running job's page refreshes itself; a dead one's (it changes only by an
    operator's hand) does not, nor does it clip its short error."""
    running = await client.get(f"/jobs/{state.running[0]}")
    dead = await client.get(f"/jobs/{state.dead}")
    assert "data-refresh=" in running.text
    assert "data-refresh=" not in dead.text
    assert "card declined: permanent" in dead.text
    assert "--json" not in dead.text


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/queues/default", "billing.charge"),
        ("/workers/w-busy", "Jobs it holds"),
        ("/leases", LEASE_KEY),
        ("/dlq", "card declined"),
        ("/audit", "Stale commits refused"),
        ("/drills", "No results file given"),
    ],
)
async def test_each_page_shows_the_store(
    client: httpx.AsyncClient, path: str, expected: str
) -> None:
    """Every page answers 200 with what the store holds."""
    page = await client.get(path)
    assert page.status_code == 200
    assert expected in page.text


@pytest.mark.parametrize(
    "path", ["/", "/actions/retry-job?job=1", "/jobs/abc", "/static/dashboard.js"]
)
async def test_every_answer_forbids_framing_and_caching(
    client: httpx.AsyncClient, path: str
) -> None:
    """No page may be framed by another site (a confirm button under a decoy), nor
    kept in a cache (forms carry the CSRF token)."""
    answer = await client.get(path)
    assert answer.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
    assert answer.headers["cache-control"] == "no-store"


async def test_fragment_is_the_content_without_the_layout(client: httpx.AsyncClient) -> None:
    """What the refresh script swaps in: the page's content, no <html> around it."""
    fragment = await client.get("/?fragment=1")
    assert fragment.status_code == 200
    assert "<html" not in fragment.text
    assert 'id="verdict"' in fragment.text


async def test_drills_page_reads_a_drill_json_file(state: State, tmp_path: Path) -> None:
    """The drills page lists the scenarios of a `tokenline drill --json` file."""
    results = tmp_path / "drill.json"
    results.write_text('[{"scenario": "partition", "store": "sqlite", "ok": false, "lost": 0}]')
    async with _client(state, drill_results=results) as c:
        page = await c.get("/drills")
    assert "partition" in page.text
    assert "FAIL" in page.text


async def test_text_that_would_read_otherwise_is_shown_escaped(
    client: httpx.AsyncClient, state: State
) -> None:
    """A lease key ending in a right-to-left override was written into the leases page
    as it came, and read backwards there; a worker id, a task, arguments, a key or an
    error could hide or reorder characters the same way. Every page now shows them as
    escapes (``\\u202e``), as the command line does."""
    spoofed = await plant_spoofed(state.url)
    confirming = httpx.QueryParams(key=SPOOF_KEY, owner=SPOOF_OWNER, lease_token=1)
    shows = {
        "/": [r"w\u202eevil"],
        "/leases": [r"ключ\u202e", r"o\u2067wner\u2069", r"w\u202eevil", r"t\u200bask"],
        f"/jobs/{spoofed.dead}": [
            r"t\u200bask",
            r"a\u202eb\u200bc",
            r"k0\u2066",
            r"boom\x1b[2J\x9b31m\u202egnp.exe\ufeff",
            r"w\u202eevil",
        ],
        f"/jobs/{spoofed.running}": [r"w\u202eevil"],
        f"/workers/{SPOOF_WORKER}": [r"w\u202eevil", r"t\u200bask"],
        f"/queues/{SPOOF_QUEUE}": [r"t\u200bask", r"w\u202eevil", r"boom\x1b[2J\x9b31m"],
        "/dlq": [r"t\u200bask", r"boom\x1b[2J\x9b31m\u202egnp.exe"],
        f"/actions/release-lease?{confirming}": [r"ключ\u202e", r"o\u2067wner\u2069"],
    }
    for path, escaped in shows.items():
        page = await client.get(path)
        assert page.status_code == 200, (path, page.text)
        for raw in SPOOFING:
            assert raw not in page.text, (path, raw)
        for text in escaped:
            assert html.escape(text, quote=False) in page.text, (path, text)


def _forms(page: str, action: str) -> list[dict[str, str]]:
    """The fields of each form of ``page`` that goes to ``action``, as a browser reads
    them (character references decoded)."""
    forms = re.findall(rf'<form[^>]*action="/actions/{action}">(.*?)</form>', page, re.S)
    field = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)">')
    return [{k: html.unescape(v) for k, v in field.findall(f)} for f in forms]


async def test_an_action_on_a_key_shown_escaped_acts_on_the_stored_key(
    client: httpx.AsyncClient, state: State
) -> None:
    """The escapes are for the eye only: the release button of a key holding a
    right-to-left override, its confirmation form, and the release itself carry the
    key as stored, and the store releases that very lease."""
    spoofed = await plant_spoofed(state.url)
    leases = await client.get("/leases")
    (button,) = [f for f in _forms(leases.text, "release-lease") if f["key"] == SPOOF_KEY]
    assert button == {
        "key": SPOOF_KEY,
        "owner": SPOOF_OWNER,
        "lease_token": str(spoofed.lease_token),
    }
    confirm = await client.get("/actions/release-lease", params=button)
    (form,) = _forms(confirm.text, "release-lease")
    assert {k: form[k] for k in button} == button
    answer = await client.post(
        "/actions/release-lease",
        data=form | {"operator_token": TOKEN},
        headers={"sec-fetch-site": "same-origin", "origin": BASE},
    )
    assert answer.status_code == 200, answer.text
    assert r"released lease &#39;ключ\u202e&#39;" in answer.text
    leases_now = (await fingerprint(state.url))[3]
    assert (SPOOF_KEY, SPOOF_OWNER, spoofed.lease_token, False) in leases_now


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/jobs/abc", 400, "not a job id"),
        ("/jobs/-1", 400, "not a job id"),
        ("/jobs/99999", 404, "no job with id 99999"),
        ("/workers/nobody", 404, "no worker has id"),
        ("/queues/nothing-here", 404, "no queue named"),
        ("/actions/explode", 404, "no action"),
        ("/actions/retry-job?job=abc", 400, "job must be a whole number"),
        ("/actions/pause-queue", 400, "queue is missing"),
        ("/no/such/page", 404, "nothing here"),
        # Ids as far as a store's 64-bit integers go, and no further.
        ("/jobs/9223372036854775807", 404, "no job with id 9223372036854775807"),
        ("/jobs/9223372036854775808", 400, "out of range"),
        ("/jobs/" + "9" * 5000, 400, "out of range"),
        ("/jobs/0", 400, "out of range"),
        ("/jobs/%D9%A3", 400, "not a job id"),  # an Arabic-Indic digit
        ("/queues/a%20b", 400, "invalid queue name"),
        ("/queues/" + "q" * 65, 400, "invalid queue name"),
        ("/workers/w%00", 400, "control characters"),
        ("/workers/" + "w" * 300, 400, "at most 255 characters"),
        ("/actions/retry-job?job=-3", 400, "job must be a whole number"),
        ("/actions/retry-job?job=1_0", 400, "job must be a whole number"),
        ("/actions/retry-job?job=99999999999999999999999", 400, "out of range"),
        ("/actions/drain-worker?worker=w%00", 400, "control characters"),
        ("/actions/release-lease?key=k&owner=o&lease_token=-1", 400, "whole number"),
    ],
)
async def test_bad_urls_get_a_readable_page(
    client: httpx.AsyncClient, path: str, status: int, says: str
) -> None:
    """An unknown or malformed id answers 400 or 404 with a page saying what was wrong."""
    page = await client.get(path)
    assert page.status_code == status
    assert says in page.text
    assert "<h1>" in page.text
    assert len(page.text) < 5000  # what was given is not echoed whole


async def test_an_unknown_long_path_is_not_echoed_whole(client: httpx.AsyncClient) -> None:
    """A 404 names the path it did not find, shortened."""
    page = await client.get("/no/" + "x" * 10_000)
    assert page.status_code == 404
    assert "(10004 characters)" in page.text
    assert len(page.text) < 5000


# -- actions ------------------------------------------------------------------------------
async def test_each_action_changes_the_store(client: httpx.AsyncClient, state: State) -> None:
    """Retry, discard, pause, resume, drain and release each do what they say."""
    before = await fingerprint(state.url)
    assert (await act(client, "retry-job", {"job": state.dead})).status_code == 200
    assert (await act(client, "pause-queue", {"queue": "default"})).status_code == 200
    assert (await act(client, "resume-queue", {"queue": "emails"})).status_code == 200
    assert (await act(client, "drain-worker", {"worker": "w-ready"})).status_code == 200
    released = await act(
        client,
        "release-lease",
        {"key": LEASE_KEY, "owner": "w-busy", "lease_token": state.lease_token},
    )
    assert released.status_code == 200, released.text
    jobs, paused, drains, leases = await fingerprint(state.url)
    assert {j: s for j, s, _ in jobs}[state.dead] == "queued"
    assert paused == ["default"]
    assert dict(drains)["w-ready"] is True
    assert (LEASE_KEY, "w-busy", state.lease_token, True) in before[3]
    assert (LEASE_KEY, "w-busy", state.lease_token, False) in leases
    # The retried job is no longer dead: discarding it does not apply.
    assert (await act(client, "discard-job", {"job": state.dead})).status_code == 409


async def test_discard_cancels_a_dead_job(client: httpx.AsyncClient, state: State) -> None:
    """Discard moves a dead job to cancelled."""
    assert (await act(client, "discard-job", {"job": state.dead})).status_code == 200
    jobs, *_ = await fingerprint(state.url)
    assert {j: s for j, s, _ in jobs}[state.dead] == "cancelled"


def _lease(owner: str, token: Any) -> dict[str, Any]:
    return {"key": LEASE_KEY, "owner": owner, "lease_token": token}


@pytest.mark.parametrize(
    ("action", "fields", "status", "says"),
    [
        ("retry-job", {"job": "running"}, 409, "is not dead"),
        ("retry-job", {"job": 99999}, 404, "no job with id 99999"),
        ("retry-job", {"job": "1x"}, 400, "whole number"),
        ("pause-queue", {"queue": "emails"}, 409, "already paused"),
        ("resume-queue", {"queue": "default"}, 409, "not paused"),
        ("drain-worker", {"worker": "nobody"}, 404, "no worker with id"),
        ("drain-worker", {"worker": "w-gone"}, 409, "it has stopped"),
        (
            "release-lease",
            {"key": LEASE_KEY, "owner": "w-busy", "lease_token": "stale"},
            409,
            "stale",
        ),
        (
            "release-lease",
            {"key": LEASE_KEY, "owner": "w-other", "lease_token": "current"},
            409,
            "owner",
        ),
        (
            "release-lease",
            {"key": "nothing", "owner": "w-busy", "lease_token": 1},
            404,
            "no resource",
        ),
        ("release-lease", {"key": LEASE_KEY, "owner": "w-busy", "lease_token": "x"}, 400, "whole"),
        ("retry-job", {"job": "99999999999999999999999"}, 400, "out of range"),
        ("retry-job", {"job": str(2**63)}, 400, "out of range"),
        ("retry-job", {"job": "-3"}, 400, "whole number"),
        ("retry-job", {"job": "\u0663"}, 400, "whole number"),
        ("drain-worker", {"worker": "w\x00"}, 400, "control characters"),
        ("drain-worker", {"worker": "w" * 1000}, 400, "at most 255 characters"),
        (
            "release-lease",
            {"key": LEASE_KEY, "owner": "w-busy", "lease_token": str(2**64)},
            400,
            "out of range",
        ),
        ("release-lease", {"key": "k\x00", "owner": "w-busy", "lease_token": 1}, 400, "control"),
    ],
)
async def test_an_action_that_does_not_apply_changes_nothing(
    client: httpx.AsyncClient,
    state: State,
    action: str,
    fields: dict[str, Any],
    status: int,
    says: str,
) -> None:
    """A job not dead, an unknown id, a paused queue paused again, a lease under a stale
    token or another owner: refused with 409, 404 or 400, and the store is unchanged."""
    fields = dict(fields)
    if fields.get("job") == "running":
        fields["job"] = state.running[0]
    if fields.get("lease_token") == "current":
        fields["lease_token"] = state.lease_token
    elif fields.get("lease_token") == "stale":
        fields["lease_token"] = state.lease_token - 1
    before = await fingerprint(state.url)
    form = {k: str(v) for k, v in fields.items()}
    csrf = await csrf_of(client, "/actions/pause-queue?queue=default")
    answer = await act(client, action, form, csrf=csrf)
    assert answer.status_code == status, answer.text
    assert says in answer.text
    assert await fingerprint(state.url) == before


@pytest.mark.parametrize(
    ("token", "csrf", "headers", "status", "says"),
    [
        (None, "fetch", {}, 401, "no operator token"),
        ("wrong", "fetch", {}, 401, "operator token is wrong"),
        (TOKEN[:-1], "fetch", {}, 401, "operator token is wrong"),
        (TOKEN, None, {}, 403, "CSRF token is missing"),
        (TOKEN, "forged-token", {}, 403, "CSRF token is missing"),
        (TOKEN, "fetch", {"sec-fetch-site": "cross-site"}, 403, "cross-site page"),
        (TOKEN, "fetch", {"sec-fetch-site": "same-site"}, 403, "same-site page"),
        (TOKEN, "fetch", {"origin": "http://evil.test"}, 403, "evil.test"),
        (TOKEN, "fetch", {"origin": "null"}, 403, "not from this dashboard"),
    ],
)
async def test_a_refused_action_changes_nothing(
    client: httpx.AsyncClient,
    state: State,
    token: str | None,
    csrf: str | None,
    headers: dict[str, str],
    status: int,
    says: str,
) -> None:
    """A missing or wrong operator token (401), a missing or forged CSRF token, a
    cross-site or foreign-origin request (403): a readable refusal, nothing changed."""
    before = await fingerprint(state.url)
    answer = await act(
        client, "retry-job", {"job": state.dead}, token=token, csrf=csrf, headers=headers
    )
    assert answer.status_code == status
    assert says in answer.text
    assert "<h1>" in answer.text
    assert await fingerprint(state.url) == before


async def test_a_forged_cross_site_form_is_refused(client: httpx.AsyncClient, state: State) -> None:
    """A form posted from another site, as a browser sends it (Origin and Sec-Fetch-Site
    of that site, no CSRF token of ours, even with the right operator token): 403."""
    before = await fingerprint(state.url)
    answer = await client.post(
        "/actions/pause-queue",
        data={"queue": "default", "operator_token": TOKEN, "csrf": "guess"},
        headers={"origin": "https://attacker.example", "sec-fetch-site": "cross-site"},
    )
    assert answer.status_code == 403
    assert await fingerprint(state.url) == before


async def test_a_bearer_token_is_accepted_in_place_of_the_form_field(
    client: httpx.AsyncClient, state: State
) -> None:
    """A script may give the operator token as ``Authorization: Bearer``."""
    answer = await act(
        client,
        "pause-queue",
        {"queue": "default"},
        token=None,
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert answer.status_code == 200
    assert (await fingerprint(state.url))[1] == ["default", "emails"]


async def test_a_read_only_dashboard_refuses_every_action_and_says_how_to_enable(
    state: State,
) -> None:
    """Started without an operator token, the dashboard shows no action form and refuses
    an action with 403, naming TOKENLINE_DASHBOARD_TOKEN; nothing changes."""
    before = await fingerprint(state.url)
    async with _client(state, token=None) as c:
        confirm = await c.get(f"/actions/retry-job?job={state.dead}")
        assert "TOKENLINE_DASHBOARD_TOKEN" in confirm.text
        assert 'name="csrf"' not in confirm.text
        csrf = c._transport.app.state.dashboard.guard.csrf_token  # type: ignore[attr-defined]
        for token in (None, "", "anything"):
            for form_csrf in (csrf, None):  # a script never shown a form has no token
                answer = await act(c, "retry-job", {"job": state.dead}, token=token, csrf=form_csrf)
                assert answer.status_code == 403
                assert "TOKENLINE_DASHBOARD_TOKEN" in answer.text
    assert await fingerprint(state.url) == before


async def test_a_confirmation_url_giving_a_field_twice_is_refused(
    client: httpx.AsyncClient, state: State
) -> None:
    """`GET /actions/retry-job?job=1&job=2` showed "Retry dead job 2" and carried 2 on,
    where a log or a link's reader sees 1. It answers 400 naming the field, as the
    form itself does."""
    answer = await client.get(f"/actions/retry-job?job={state.dead}&job={state.dead + 1}")
    assert answer.status_code == 400, answer.text
    assert "the URL gives &#39;job&#39; more than once" in answer.text
    once = await client.get(f"/actions/retry-job?job={state.dead}")
    assert once.status_code == 200, once.text


@pytest.mark.parametrize("field", ["queue", "csrf", "operator_token"])
async def test_a_form_giving_a_field_twice_is_refused(
    client: httpx.AsyncClient, state: State, field: str
) -> None:
    """``queue=zz&queue=xq`` paused the queue xq: the last value counted, where a
    proxy or a log would show the first. A field given twice is now refused with 400,
    naming it, and nothing changes."""
    before = await fingerprint(state.url)
    csrf = await csrf_of(client, "/actions/pause-queue?queue=default")
    form = [("queue", "default"), ("csrf", csrf), ("operator_token", TOKEN)]
    form.append((field, "emails" if field == "queue" else dict(form)[field]))
    answer = await client.post(
        "/actions/pause-queue",
        content=str(httpx.QueryParams(form)),
        headers={
            "sec-fetch-site": "same-origin",
            "origin": BASE,
            "content-type": "application/x-www-form-urlencoded",
        },
    )
    assert answer.status_code == 400, answer.text
    assert f"the form gives &#39;{field}&#39; more than once" in answer.text
    assert await fingerprint(state.url) == before


#: The size of each chunk of a body sent in pieces.
CHUNK = 64 * 1024


def _oversize(kind: str) -> tuple[str, Iterator[bytes]]:
    """A form no parser reads whole, as its content type and its body in chunks of
    :data:`CHUNK` bytes, made as it is sent (the test holds none of it either)."""
    if kind == "field over 64 KiB":  # 30 MB in one field
        head = b"queue=default&x="
        return "application/x-www-form-urlencoded", iter([head] + [b"a" * CHUNK] * 480)
    if kind == "200,000 fields":  # 2.2 MB
        fields = b"&field=1234" * (CHUNK // 11)
        return "application/x-www-form-urlencoded", iter([b"queue=default"] + [fields] * 34)
    if kind == "a file":  # 30 MB, which Starlette would spool to disk
        part = b'--B\r\nContent-Disposition: form-data; name="x"; filename="f"\r\n\r\n'
        return "multipart/form-data; boundary=B", iter([part] + [b"a" * CHUNK] * 480)
    part = b'--B\r\nContent-Disposition: form-data; name="x"\r\n\r\n'
    return "multipart/form-data; boundary=B", iter([part] + [b"a" * CHUNK] * 480)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("field over 64 KiB", "Field exceeded maximum size of 64KB."),
        ("200,000 fields", "Too many fields. Maximum number of fields is 32."),
        ("multipart part over 64 KiB", "Part exceeded maximum size of 64KB."),
        ("a file", "Too many files. Maximum number of files is 0."),
    ],
)
async def test_a_form_past_the_parsers_limits_is_a_logged_refusal(
    client: httpx.AsyncClient,
    state: State,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    says: str,
) -> None:
    """A form with a 30 MB field or 200,000 fields got Starlette's own plain-text 400,
    and no line in the log, after up to 1,000 fields of 1 MB each were read (and files
    without end spooled to disk). It is now refused as any form is: the dashboard's
    page, 400, a log line naming the action, why and the client; an action's form has
    a few short fields and no file, so the body is read no further than 64 KiB past
    what an action needs, and nothing changes."""
    caplog.set_level(logging.INFO, logger="tokenline.dashboard")
    before = await fingerprint(state.url)
    content_type, chunks = _oversize(kind)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for chunk in chunks:
            sent += len(chunk)
            yield chunk

    answer = await client.post(
        "/actions/pause-queue",
        content=body(),
        headers={"sec-fetch-site": "same-origin", "origin": BASE, "content-type": content_type},
    )
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    assert "<h1>Bad request</h1>" in answer.text
    assert f"the form cannot be read: {says}" in answer.text
    assert sent <= 64 * 1024 + 2 * CHUNK  # not the whole body: up to the limit broken
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenline.dashboard"]
    assert f"action pause-queue by 127.0.0.1:123 refused: the form cannot be read: {says}" in lines
    assert await fingerprint(state.url) == before


@pytest.mark.parametrize(
    "token",
    [
        "",
        " ",
        "\t\n  ",
        "short",
        " padded-operator-token ",
        "pässwörd-geheim-1234",  # refused as a header: not ASCII
        "two-line\noperator-token",  # no password field holds it
        "spaced operator token",
    ],
)
def test_a_blank_or_weak_operator_token_is_refused_at_creation(state: State, token: str) -> None:
    """A blank token never enables actions (nor silently leaves them off): the app is
    not created; nor with a short or padded one, nor with one that cannot be sent as
    a Bearer header or typed (not printable ASCII)."""
    with pytest.raises(ValueError, match=r"blank|whitespace|characters long|printable ASCII"):
        create_app(state.app, operator_token=token)


@pytest.mark.parametrize(
    ("form_token", "header"),
    [
        (None, f"Bearer  {TOKEN}"),  # padded: taken as sent, so wrong
        (None, f"bearer {TOKEN}"),  # not the scheme
        (None, TOKEN),  # no scheme
        (TOKEN, "Bearer wrong-operator-token"),  # a right form does not cover a wrong header
        ("wrong-operator-token", f"Bearer {TOKEN}"),
    ],
)
async def test_an_operator_token_given_two_ways_must_be_right_both_ways(
    client: httpx.AsyncClient, state: State, form_token: str | None, header: str
) -> None:
    """A wrong Bearer token beside the right form field was accepted, and a padded
    Bearer token was trimmed into the right one. The header is taken as sent, and when
    both are given they must agree; nothing changes otherwise."""
    before = await fingerprint(state.url)
    answer = await act(
        client,
        "pause-queue",
        {"queue": "default"},
        token=form_token,
        headers={"authorization": header},
    )
    assert answer.status_code == 401, answer.text
    assert await fingerprint(state.url) == before


async def test_an_action_whose_answer_was_lost_says_it_may_have_been_made(
    client: httpx.AsyncClient, state: State, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store made the change and its answer was lost: the page said "The store
    cannot be read", and an operator took it that nothing had happened. It now says the
    change may have been made, as the command line does."""
    from tokenline import StoreUnavailableError
    from tokenline.stores.sqlite import SQLiteStore

    made = SQLiteStore.queue_pause

    async def lost(self: SQLiteStore, **kwargs: Any) -> Any:
        await made(self, **kwargs)
        raise StoreUnavailableError("the connection was reset")

    monkeypatch.setattr(SQLiteStore, "queue_pause", lost)
    answer = await act(client, "pause-queue", {"queue": "default"})
    assert answer.status_code == 503
    assert "The store did not answer the action" in answer.text
    assert "may have made the change before its answer was lost" in answer.text
    assert (await fingerprint(state.url))[1] == ["default", "emails"]  # it was made


async def test_an_action_the_store_refused_whole_says_nothing_was_changed(
    client: httpx.AsyncClient, state: State, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store never took the change (a write lock it never got): the page said the
    change may have been made, and sent the operator looking for it. It now says
    nothing was changed, as the command line does."""
    from tokenline import StoreUnavailableError
    from tokenline.stores.sqlite import SQLiteStore

    before = await fingerprint(state.url)

    async def busy(self: SQLiteStore, **kwargs: Any) -> Any:
        refused = StoreUnavailableError("database is locked")
        refused.changed_nothing = True
        raise refused

    monkeypatch.setattr(SQLiteStore, "queue_pause", busy)
    answer = await act(client, "pause-queue", {"queue": "default"})
    assert answer.status_code == 503
    assert "did not take this change at all, so nothing was changed" in answer.text
    assert "may have made the change" not in answer.text
    assert await fingerprint(state.url) == before


async def test_get_never_acts(client: httpx.AsyncClient, state: State) -> None:
    """The confirmation page is a GET and changes nothing, even with every field."""
    before = await fingerprint(state.url)
    page = await client.get(f"/actions/retry-job?job={state.dead}&operator_token={TOKEN}")
    assert page.status_code == 200
    assert await fingerprint(state.url) == before


async def test_actions_and_refusals_are_logged(
    client: httpx.AsyncClient, state: State, caplog: pytest.LogCaptureFixture
) -> None:
    """Each action is logged on tokenline.dashboard: who, what, and the result."""
    caplog.set_level(logging.INFO, logger="tokenline.dashboard")
    await act(client, "pause-queue", {"queue": "default"})
    await act(client, "pause-queue", {"queue": "default"}, token="wrong")
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenline.dashboard"]
    assert any("pause-queue" in m and "200 paused queue 'default'" in m for m in lines), lines
    assert any("pause-queue" in m and "refused" in m and "wrong" in m for m in lines), lines


async def test_an_unreadable_store_gives_a_503_page(tmp_path: Path) -> None:
    """A store that cannot be opened answers 503 with the store's error, not a trace."""
    from tokenline import App

    (tmp_path / "dir.db").mkdir()
    app = App(f"sqlite:///{tmp_path / 'dir.db'}")
    web = create_app(app, allowed_hosts=[HOST])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=web), base_url=BASE) as c:
        page = await c.get("/leases")
        overview = await c.get("/")
    assert page.status_code == 503
    assert "cannot be read" in page.text
    assert overview.status_code == 200
    assert "FAILING" in overview.text


def test_fingerprint_sees_a_change(state: State) -> None:
    """The store comparison above can fail: pausing a queue changes the fingerprint."""

    async def run() -> bool:
        before = await fingerprint(state.url)
        store = store_from_url(state.url)
        await store.open()
        try:
            await store.queue_pause(queue="default")
        finally:
            await store.close()
        return await fingerprint(state.url) != before

    assert asyncio.run(run())


async def test_the_store_refuses_a_release_whose_token_moved_on_after_the_read(
    client: httpx.AsyncClient, state: State, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the lease changes hands between the dashboard's read and its release (here:
    the read's verdict forced to "matches"), the store itself refuses the stale owner
    and token: 409, the lease still held by its holder."""
    from tokenline.dashboard import actions

    monkeypatch.setattr(actions, "lease_mismatch", lambda *args: None)
    before = await fingerprint(state.url)
    for lease in (_lease("w-busy", state.lease_token - 1), _lease("w-other", state.lease_token)):
        answer = await act(client, "release-lease", lease)
        assert answer.status_code == 409
        assert "changed hands meanwhile" in answer.text
    assert await fingerprint(state.url) == before


async def test_an_action_on_an_unreadable_store_is_a_logged_503(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An action whose store cannot be opened answers 503 and is logged as failed."""
    from tokenline import App

    (tmp_path / "dir.db").mkdir()
    web = create_app(
        App(f"sqlite:///{tmp_path / 'dir.db'}"), operator_token=TOKEN, allowed_hosts=[HOST]
    )
    caplog.set_level(logging.INFO, logger="tokenline.dashboard")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=web), base_url=BASE) as c:
        answer = await act(c, "pause-queue", {"queue": "default"})
    assert answer.status_code == 503
    assert any("failed: store error" in r.getMessage() for r in caplog.records)


# -- DNS rebinding: the Host a request names ------------------------------------------------
LOOPBACK = "http://127.0.0.1:8080"


@pytest.mark.parametrize(
    "host",
    [
        "rebind.attacker.example:8080",  # a name resolved to 127.0.0.1 by its owner
        "rebind.attacker.example",
        "localhost.attacker.example:8080",
        "127.0.0.1:9999",  # the right address, another port
        "127.0.0.1",  # port 80 implied
        "[::2]:8080",
        "0.0.0.0:8080",
    ],
)
async def test_a_request_naming_another_host_is_refused_before_anything(
    state: State, host: str
) -> None:
    """Bound to 127.0.0.1:8080, the dashboard refuses (421, a plain sentence) a page,
    the confirmation form that carries the CSRF token, and an action whose Host and
    Origin both name another host, as a page served from a rebinding domain sends
    them; nothing changes."""
    before = await fingerprint(state.url)
    async with _client(state, base=LOOPBACK, bind=("127.0.0.1", 8080), allowed_hosts=()) as c:
        sent = {"host": host}
        csrf = c._transport.app.state.dashboard.guard.csrf_token  # type: ignore[attr-defined]
        for answer in (
            await c.get("/", headers=sent),
            await c.get(f"/actions/retry-job?job={state.dead}", headers=sent),
            await act(
                c,
                "retry-job",
                {"job": state.dead},
                csrf=csrf,
                headers=sent | {"origin": f"http://{host}", "sec-fetch-site": "same-origin"},
            ),
        ):
            assert answer.status_code == 421
            assert answer.headers["content-type"].startswith("text/plain")
            assert "does not answer to host" in answer.text
            assert csrf not in answer.text
    assert await fingerprint(state.url) == before


@pytest.mark.parametrize("host", ["::1:8080", "[::1", "a b:8080", "127.0.0.1:8080x", ""])
async def test_a_malformed_host_is_refused(state: State, host: str) -> None:
    """A Host that is not NAME[:PORT] (an IPv6 address without brackets, ...): 400 or
    421, never a page."""
    async with _client(state, base=LOOPBACK, bind=("127.0.0.1", 8080), allowed_hosts=()) as c:
        answer = await c.get("/", headers={"host": host})
    assert answer.status_code in (400, 421)
    assert "<html" not in answer.text


@pytest.mark.parametrize(
    ("bind", "host"),
    [
        (("127.0.0.1", 8080), "127.0.0.1:8080"),
        (("127.0.0.1", 8080), "localhost:8080"),
        (("127.0.0.1", 8080), "LocalHost:8080"),
        (("127.0.0.1", 8080), "[::1]:8080"),
        (("::1", 8080), "[::1]:8080"),
        (("::1", 8080), "[0:0:0:0:0:0:0:1]:8080"),
        (("::1", 8080), "localhost:8080"),
        (("localhost", 8080), "127.0.0.1:8080"),
        (("127.0.0.1", 80), "127.0.0.1"),
        (("192.0.2.7", 8080), "192.0.2.7:8080"),
        (("Dash.Lan", 8080), "dash.lan:8080"),
    ],
)
async def test_the_bound_address_and_loopback_names_are_answered(
    state: State, bind: tuple[str, int], host: str
) -> None:
    """The bound address and port (any case, IPv6 in brackets or spelt out), and on a
    loopback bind the loopback names, are this dashboard."""
    async with _client(state, base=LOOPBACK, bind=bind, allowed_hosts=()) as c:
        answer = await c.get("/leases", headers={"host": host})
    assert answer.status_code == 200, answer.text


async def test_a_wildcard_bind_answers_to_the_address_the_connection_came_in_on(
    state: State,
) -> None:
    """Bound to 0.0.0.0, the dashboard answers to the IP address it was reached on (a
    rebinding attack needs a name), and to no name it was not given."""
    async with _client(
        state, base="http://192.0.2.7:8080", bind=("0.0.0.0", 8080), allowed_hosts=()
    ) as c:
        assert (await c.get("/leases")).status_code == 200
        assert (await c.get("/leases", headers={"host": "192.0.2.8:8080"})).status_code == 421
        refused = await c.get("/leases", headers={"host": "myhost.example:8080"})
        assert refused.status_code == 421


async def test_an_allowed_host_is_answered_and_is_the_origin_actions_come_from(
    state: State,
) -> None:
    """Behind a TLS proxy passing Host on: an --allowed-host is answered on any port
    (or the one given), and an action posted from its https origin goes through; the
    origin check follows the configuration, not the request's Host."""
    async with _client(
        state, base="https://dash.example.com", allowed_hosts=["dash.example.com", "b.test:9"]
    ) as c:
        assert (await c.get("/leases")).status_code == 200
        assert (await c.get("/leases", headers={"host": "b.test:9"})).status_code == 200
        assert (await c.get("/leases", headers={"host": "b.test:10"})).status_code == 421
        origin = {"origin": "https://dash.example.com"}
        done = await act(c, "pause-queue", {"queue": "default"}, headers=origin)
        assert done.status_code == 200, done.text
        foreign = {"origin": "https://b.test:10"}
        refused = await act(c, "resume-queue", {"queue": "default"}, headers=foreign)
        assert refused.status_code == 403
        assert "not from this dashboard" in refused.text
    assert (await fingerprint(state.url))[1] == ["default", "emails"]


def test_a_malformed_allowed_host_is_refused_at_creation(state: State) -> None:
    """An allowed host that is not NAME[:PORT] is a configuration error, not a hole."""
    for bad in ("*.example.com", "http://x.test", "x.test:99999", "::1"):
        with pytest.raises(ValueError, match="not a host name"):
            create_app(state.app, allowed_hosts=[bad])


async def test_a_worker_whose_id_holds_a_slash_has_its_page(
    client: httpx.AsyncClient, state: State
) -> None:
    """A worker id may hold "/" (``team/w-1``): the overview linked to a page that
    answered 404."""
    from dashboard_state import TTL, _record

    store = store_from_url(state.url)
    await store.open()
    try:
        await store.worker_register(record=_record("team/w-1"), ttl=TTL)
    finally:
        await store.close()
    overview = await client.get("/")
    assert 'href="/workers/team/w-1"' in overview.text
    page = await client.get("/workers/team/w-1")
    assert page.status_code == 200, page.text
    assert "team/w-1" in page.text
