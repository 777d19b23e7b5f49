"""The dashboard over PostgreSQL: the same pages and actions as over SQLite (the
route tests), on a store in a schema of its own."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from dashboard_state import LEASE_KEY, State, fingerprint, populate_url
from integration.test_dashboard_routes import BASE, HOST, TOKEN, act
from tokenline.dashboard import create_app

pytestmark = pytest.mark.postgres


@pytest.fixture
def state(postgres_server: str) -> Iterator[State]:
    """A PostgreSQL store, in a fresh schema dropped afterwards, filled as over SQLite."""
    import psycopg

    schema = f"tl_dash_{uuid.uuid4().hex[:8]}"
    try:
        yield populate_url(f"{postgres_server}?schema={schema}", faulty=True)
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
async def client(state: State) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the dashboard of ``state``'s store, actions enabled."""
    web = create_app(state.app, operator_token=TOKEN, allowed_hosts=[HOST])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=web), base_url=BASE) as c:
        yield c


async def test_every_page_reads_a_postgres_store(client: httpx.AsyncClient, state: State) -> None:
    """Each view answers 200 with what the PostgreSQL store holds."""
    expected = {
        "/": "Dependency down",
        "/queues/default": "billing.charge",
        f"/jobs/{state.dead}": "card declined",
        "/workers/w-fenced": "fenced",
        "/leases": LEASE_KEY,
        "/dlq": "card declined",
        "/audit": "Stale commits refused",
    }
    for path, sees in expected.items():
        page = await client.get(path)
        assert page.status_code == 200, path
        assert sees in page.text, path


async def test_actions_change_a_postgres_store_and_refusals_do_not(
    client: httpx.AsyncClient, state: State
) -> None:
    """Retry, pause, drain and release change the store; without the token, nothing."""
    before = await fingerprint(state.url)
    refused = await act(client, "retry-job", {"job": state.dead}, token=None)
    assert refused.status_code == 401
    assert await fingerprint(state.url) == before
    assert (await act(client, "retry-job", {"job": state.dead})).status_code == 200
    assert (await act(client, "pause-queue", {"queue": "default"})).status_code == 200
    assert (await act(client, "drain-worker", {"worker": "w-ready"})).status_code == 200
    lease = {"key": LEASE_KEY, "owner": "w-busy", "lease_token": state.lease_token}
    assert (await act(client, "release-lease", lease)).status_code == 200
    jobs, paused, drains, leases = await fingerprint(state.url)
    assert {j: s for j, s, _ in jobs}[state.dead] == "queued"
    assert paused == ["default", "emails"]
    assert dict(drains)["w-ready"] is True
    assert (LEASE_KEY, "w-busy", state.lease_token, False) in leases


async def test_ids_past_64_bits_are_refused_before_the_store(
    client: httpx.AsyncClient, state: State
) -> None:
    """The largest id PostgreSQL's bigint holds is looked up (404); one past it is a
    400 from the dashboard, never the driver's overflow as a 500; nothing changes."""
    before = await fingerprint(state.url)
    assert (await client.get("/jobs/9223372036854775807")).status_code == 404
    assert (await client.get("/jobs/9223372036854775808")).status_code == 400
    token_page = await client.get(f"/actions/retry-job?job={state.dead}")
    csrf = token_page.text.split('name="csrf" value="')[1].split('"')[0]
    answer = await act(client, "retry-job", {"job": str(2**63)}, csrf=csrf)
    assert answer.status_code == 400
    assert "out of range" in answer.text
    assert await fingerprint(state.url) == before
