"""Acceptance: an ack lost after the effect is redelivered, and the effect is not
applied twice (real worker processes through the CLI, SQLite store)."""

from __future__ import annotations

import json

import pytest

from .conftest import Cluster

pytestmark = pytest.mark.acceptance


def test_lost_ack_redelivers_the_job_without_applying_the_effect_twice(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker charges through ctx.effect, then its success commit is lost: the lease
    expires, the job is rescued and run again, ctx.effect returns the stored receipt
    without charging again, and one duplicate execution is recorded and audited."""
    marker = cluster.tmp / "ack-lost"
    cluster.worker("a", FAULTAPP_LOSE_ACK=str(marker))
    out = cluster.cli("enqueue", "--app", "faultapp:app", "charge_once", json.dumps(["charge:7"]))
    assert out.returncode == 0, out.stderr
    jid = int(out.stdout.strip())
    cluster.wait_for("the job to succeed", lambda: cluster.job(jid)["state"] == "succeeded")

    assert marker.read_text() == str(jid), "the success commit was not dropped"
    attempts = cluster.query(
        "SELECT token, outcome FROM tokenline_attempts WHERE job_id = ? ORDER BY token", jid
    )
    # The lost ack: the lease expired and the rescuer took the job back (a new token).
    assert [r["outcome"] for r in attempts] == ["lease_expired", "succeeded"]
    first, second = (r["token"] for r in attempts)
    charges = cluster.query("SELECT token FROM effects WHERE key = 'charge:7'")
    assert [r["token"] for r in charges] == [first]
    (effect,) = cluster.query("SELECT * FROM tokenline_effects WHERE key = 'charge:7'")
    assert (effect["status"], effect["token"], effect["runs"]) == ("completed", first, 1)
    assert json.loads(effect["result"]) == {"charged": "charge:7", "token": first}
    dups = cluster.query("SELECT * FROM tokenline_duplicates WHERE key = 'charge:7'")
    assert [(d["kind"], d["operation"], d["job_id"], d["token"]) for d in dups] == [
        ("repeat", "effect", jid, second)
    ]

    monkeypatch.setenv("COLUMNS", "250")  # rich tables: no wrapped cells to search in
    audit = cluster.cli("audit", "duplicates", "--since", "1h")
    assert audit.returncode == 0, audit.stderr
    assert "charge:7" in audit.stdout
    assert (
        "1 duplicate execution, 0 reruns after an unknown outcome, 0 stale writes refused, 1 key"
        in audit.stdout
    )
    shown = cluster.cli("job", str(jid))
    assert shown.returncode == 0, shown.stderr
    assert "lease_expired" in shown.stdout
    assert f"repeat effect on 'charge:7' by token {second}" in shown.stdout
