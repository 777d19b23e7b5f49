"""The dashboard in a real browser: each view against a store with real jobs and
workers, each action through its confirmation page (the store changes), a refusal
without the operator token (the store does not), refresh in place, pages that work
without JavaScript, and a real worker process drained from its page. A screenshot of
the overview during a fault is kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from browser.conftest import DEADLINE, TOKEN, Served, keep_screenshot
from dashboard_state import (
    LEASE_KEY,
    SPOOF_KEY,
    SPOOF_OWNER,
    SPOOFING,
    State,
    fingerprint,
    plant_spoofed,
    run_apart,
)
from tokenline._jobs import WorkerRecord

pytestmark = pytest.mark.timeout(300)

T = TypeVar("T")
HERE = Path(__file__).parent


def store_now(state: State) -> tuple[Any, ...]:
    """The store's fingerprint (what an action could change), read now."""
    return run_apart(lambda: fingerprint(state.url))


def job_states(state: State) -> dict[int, str]:
    """Each job's state now."""
    jobs, *_ = store_now(state)
    return {j: s for j, s, _ in jobs}


@pytest.mark.parametrize(
    ("path", "sees"),
    [
        ("/", "Dependency down"),
        ("/queues/default", "billing.charge"),
        ("/jobs/{dead}", "card declined"),
        ("/jobs/{running}", "running"),
        ("/workers/w-busy", "Jobs it holds"),
        ("/workers/w-fenced", "fenced"),
        ("/leases", LEASE_KEY),
        ("/dlq", "card declined"),
        ("/audit", "Duplicate audit"),
        ("/drills", "Recent drill results"),
    ],
)
def test_each_view_loads(page: Any, state: State, path: str, sees: str) -> None:
    """Every view renders in Chromium with what the store holds."""
    url = path.format(dead=state.dead, running=state.running[0])
    response = page.goto(url)
    assert response.status == 200
    assert sees in page.locator("main").inner_text()


def test_overview_groups_workers_by_state_with_charts(page: Any) -> None:
    """The overview puts each worker under its state and draws both charts."""
    page.goto("/")
    assert "w-fenced" in page.locator('[data-group="fenced"]').inner_text()
    assert "w-busy" in page.locator('[data-group="processing"]').inner_text()
    assert "w-gone" in page.locator('[data-group="stopped"]').inner_text()
    assert page.locator("svg.chart").count() == 2
    assert "paused" in page.locator('[data-queue="emails"]').inner_text()


def confirm(page: Any, start: str, action: str, token: str | None = TOKEN) -> Any:
    """From ``start``, click ``action``'s button, type the token, confirm."""
    page.goto(start)
    page.locator(f'button[data-action="{action}"]').first.click()
    page.wait_for_url(f"**/actions/{action}?**")
    if token is not None:
        page.fill('input[name="operator_token"]', token)
    with page.expect_navigation():
        page.click("#confirm")
    return page


def test_each_action_changes_the_store(page: Any, state: State) -> None:
    """Retry, discard, pause, resume, drain and release, each clicked and confirmed,
    change the store as they say."""
    confirm(page, "/dlq", "retry-job")
    assert "requeued dead job" in page.locator(".outcome").inner_text()
    assert job_states(state)[state.dead] == "queued"

    confirm(page, "/", "resume-queue")  # only emails is paused
    confirm(page, "/", "pause-queue")  # the first queue listed: default
    assert store_now(state)[1] == ["default"]

    confirm(page, "/workers/w-ready", "drain-worker")
    assert dict(store_now(state)[2])["w-ready"] is True

    confirm(page, "/leases", "release-lease")
    assert "released lease" in page.locator(".outcome").inner_text()
    assert (LEASE_KEY, "w-busy", state.lease_token, False) in store_now(state)[3]


def test_discard_through_the_browser(page: Any, state: State) -> None:
    """Discard, confirmed, cancels the dead job."""
    confirm(page, f"/jobs/{state.dead}", "discard-job")
    assert job_states(state)[state.dead] == "cancelled"


def test_an_action_without_the_token_is_refused(page: Any, state: State) -> None:
    """Confirming without typing the operator token shows a 401 page and changes
    nothing in the store."""
    before = store_now(state)
    page.goto("/dlq")
    page.locator('button[data-action="retry-job"]').first.click()
    with page.expect_navigation() as nav:
        page.click("#confirm")
    assert nav.value.status == 401
    assert "Operator token required" in page.locator("h1").inner_text()
    assert store_now(state) == before


def test_a_key_that_reads_backwards_is_shown_escaped_and_released_as_stored(
    page: Any, state: State
) -> None:
    """Chromium showed a lease key ending in a right-to-left override reordered; it now
    shows the override as ``\\u202e``, and the release clicked on that row still names
    the stored key: the store releases that lease."""
    spoofed = run_apart(lambda: plant_spoofed(state.url))
    page.goto("/leases")
    shown = page.locator("main").inner_text()
    assert not [c for c in SPOOFING if c in shown]
    row = page.locator("#resource-leases tr", has_text=r"ключ\u202e")
    assert r"o\u2067wner\u2069" in row.inner_text()
    row.locator('button[data-action="release-lease"]').click()
    page.wait_for_url("**/actions/release-lease?**")
    assert r"Release resource lease 'ключ\u202e'" in page.locator(".what").inner_text()
    page.fill('input[name="operator_token"]', TOKEN)
    with page.expect_navigation():
        page.click("#confirm")
    assert r"released lease 'ключ\u202e'" in page.locator(".outcome").inner_text()
    assert (SPOOF_KEY, SPOOF_OWNER, spoofed.lease_token, False) in store_now(state)[3]


def test_overview_refreshes_in_place(page: Any, state: State) -> None:
    """A change in the store reaches the open overview without a page load."""
    page.goto("/")
    page.evaluate("window.notReloaded = true")
    assert "active" in page.locator('[data-queue="default"]').inner_text()

    async def pause() -> None:
        from tokenline.stores import store_from_url

        store = store_from_url(state.url)
        await store.open()
        try:
            await store.queue_pause(queue="default")
        finally:
            await store.close()

    run_apart(pause)
    row = page.locator('[data-queue="default"]')
    row.get_by_text("paused").wait_for(timeout=DEADLINE * 1000)
    assert page.evaluate("window.notReloaded") is True


def test_pages_and_actions_work_without_javascript(browser: Any, served: Served) -> None:
    """With JavaScript off, the overview renders and an action completes."""
    context = browser.new_context(base_url=served.url, java_script_enabled=False)
    try:
        page = context.new_page()
        page.set_default_timeout(DEADLINE * 1000)
        confirm(page, "/", "pause-queue")
        assert "paused queue 'default'" in page.locator(".outcome").inner_text()
    finally:
        context.close()
    assert store_now(served.state)[1] == ["default", "emails"]


def test_screenshot_of_the_overview_during_a_fault(
    page: Any, state: State, screenshot_dir: Path
) -> None:
    """The overview during a fault (a worker fenced, a breaker open, a queue paused, a
    dead letter) says so, and is kept as a screenshot."""
    page.goto("/")
    # A second look a moment later gives the charts two samples to draw (not checked).
    page.wait_for_timeout(1100)
    page.reload()
    verdict = page.locator("#verdict").inner_text()
    assert "Dependency down" in verdict
    findings = ("payments", "fenced: w-fenced", "draining: w-draining", "paused: emails")
    for finding in (*findings, "dead letters: 1 in default"):
        assert finding in verdict
    assert "FAILING" not in page.locator("#channels").inner_text()
    path = screenshot_dir / "overview-during-fault.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    keep_screenshot(path)
    print(f"screenshot: {path}")


def wait_for(what: str, probe: Callable[[], T | None]) -> T:
    """``probe()``'s first answer that is not ``None``, polled until the deadline."""
    deadline = time.monotonic() + DEADLINE
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def test_a_real_worker_is_seen_processing_and_drained_from_the_browser(
    page: Any, state: State, tmp_path: Path
) -> None:
    """A worker process (the real CLI) claims a job and shows under PROCESSING; drained
    from its page, it turns DRAINING at its next heartbeat, finishes the job once let go,
    and stops: the overview then lists it under STOPPED."""
    release = tmp_path / "release"
    env = {
        **os.environ,
        "TOKENLINE_URL": state.url,
        "WORKERAPP_RELEASE": str(release),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable, "-m", "tokenline", "worker", "--app", "workerapp:app",
        "--queues", "default", "--concurrency", "1", "--lease-ttl", "6",
        "--renew-interval", "0.5", "--poll-interval", "0.05", "--drain-timeout", "120",
    ]  # fmt: skip
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
    try:

        def worker(states: tuple[str, ...]) -> WorkerRecord | None:
            records = run_apart(lambda: _workers(state.url))
            return next(
                (w for w in records if w.id not in state.workers and w.state in states), None
            )

        wid = wait_for("the worker to process a job", lambda: worker(("processing",))).id
        page.goto("/")
        assert wid in page.locator('[data-group="processing"]').inner_text()

        confirm(page, f"/workers/{wid}", "drain-worker")
        assert "asked worker" in page.locator(".outcome").inner_text()
        wait_for("the worker to drain", lambda: worker(("draining",)))
        release.touch()
        assert proc.wait(DEADLINE) == 0, log.read_text(errors="replace")
        page.goto("/")
        assert wid in page.locator('[data-group="stopped"]').inner_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE)


async def _workers(url: str) -> list[WorkerRecord]:
    from tokenline.stores import store_from_url

    store = store_from_url(url)
    await store.open()
    try:
        return await store.workers_list()
    finally:
        await store.close()
