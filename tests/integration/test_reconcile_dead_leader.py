"""``tokenline reconcile`` refused by a maintenance leader whose process may be dead:
the refusal says when the leader's lease expires, by the store's clock, so an operator
knows to wait rather than look for a process that is gone."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from click.testing import CliRunner

from tokenline.cli import main
from tokenline.maintenance import MAINTENANCE_LEASE
from tokenline.stores import store_from_url

TTL = 40


def run(*args: str) -> tuple[int, str]:
    env = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def test_refusal_says_when_the_leaders_lease_expires(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"

    async def lead_then_vanish() -> None:
        # Takes the lease and never renews nor releases it, as a SIGKILLed leader.
        store = store_from_url(url)
        await store.open()
        await store.resource_lease_acquire(resource=MAINTENANCE_LEASE, owner="gone", ttl=TTL)
        await store.close()

    asyncio.run(lead_then_vanish())
    code, out = run("reconcile", "--url", url)
    assert code == 2
    flat = " ".join(out.split())
    assert "gone leads maintenance (term 1)" in flat
    found = re.search(r"its lease expires in (\d+) s by the store's clock", flat)
    assert found is not None, flat
    assert 0 < int(found.group(1)) <= TTL
    assert "a leader that died frees it then" in flat

    code, out = run("reconcile", "--url", url, "--json")
    assert code == 2
    data = json.loads(out)
    assert (data["leader"], data["term"], data["refused"]) == ("gone", 1, True)
    assert 0 < data["leader_expires_in"] <= TTL


def test_no_expiry_is_reported_when_nobody_refused_the_pass(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert run("migrate", "--url", url)[0] == 0
    code, out = run("reconcile", "--url", url, "--json")
    assert code == 0
    assert json.loads(out)["leader_expires_in"] is None
