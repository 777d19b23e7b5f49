"""Operator commands on the split topology while the ledger's PostgreSQL is down.

The broker (Redis) keeps queues, jobs, workers and leases: pausing a queue, draining a
worker, cancelling a job or listing jobs needs nothing of the ledger. They used to open
the whole store and fail with the ledger, which is when an operator needs them most.
A command that reads the ledger (``job``, with its effects) still says that it is down.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from tokenline import App
from tokenline.cli import main
from tokenline.stores import split_url

#: A PostgreSQL address nothing listens on: the ledger is down.
LEDGER_DOWN = "postgresql://postgres@127.0.0.1:1/test"


@pytest.fixture
def urls(postgres_server: str, redis_url: str) -> Iterator[tuple[str, str]]:
    """The split topology with its ledger up, and the same broker with the ledger down."""
    schema = f"tl_split_down_{secrets.token_hex(4)}"
    up = split_url(broker=redis_url, ledger=f"{postgres_server}?schema={schema}")
    yield up, split_url(broker=redis_url, ledger=LEDGER_DOWN)
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_broker_commands_work_while_the_ledger_is_down(urls: tuple[str, str]) -> None:
    up, down = urls
    app = App(up)

    @app.task(name="t")
    def t(ctx: Any) -> None:
        """Never runs here."""

    ids = [app.enqueue("t") for _ in range(3)]
    app.close()

    code, out = run("pause", "--url", down, "default")
    assert (code, out.strip()) == (0, "paused default"), out
    code, out = run("queues", "--url", down, "--json")
    assert code == 0, out
    (row,) = [q for q in json.loads(out) if q["queue"] == "default"]
    assert row["paused"] is True
    code, out = run("jobs", "--url", down, "--json")
    assert code == 0, out
    assert sorted(j["id"] for j in json.loads(out)) == sorted(ids)
    code, out = run("cancel", "--url", down, str(ids[0]))
    assert code == 0, out
    assert f"cancelled 1 job: {ids[0]}" in out
    for command in (["workers"], ["leases"], ["dlq", "list"], ["dlq", "retry", "--all"]):
        code, out = run(*command, "--url", down)
        assert code == 0, (command, out)
    # Redis answers for these two: a worker it does not know, a lease nobody holds.
    code, out = run("drain", "--url", down, "no-such-worker")
    assert "no worker with id 'no-such-worker'" in out, out
    # A release checks the token's epoch, which the ledger issues: it says the ledger is down.
    code, out = run("lease", "release", "--url", down, "k", "--owner", "o", "--token", "1")
    assert code == 1, out
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in out, out
    code, out = run("resume", "--url", down, "default")
    assert (code, out.strip()) == (0, "resumed default"), out

    # What the broker holds changed, as it would have with the ledger up.
    app = App(up)
    states = {j.id: j.state.value for j in app.run(lambda s: s.jobs_list())}
    paused = [q.paused for q in app.run(lambda s: s.queues_stats()) if q.queue == "default"]
    app.close()
    assert states == {ids[0]: "cancelled", ids[1]: "queued", ids[2]: "queued"}
    assert paused == [False]


def test_scale_hint_blames_only_the_ledger(urls: tuple[str, str]) -> None:
    """With the ledger down, scale-hint names the ledger alone as failing: the broker's
    depth and the leases are read from Redis, which answers (it used to call broker and
    leases failing too, with an exception's class name)."""
    _, down = urls
    result = CliRunner().invoke(main, ["scale-hint", "--url", down, "--interval", "0", "--json"])
    assert result.exit_code == 0, result.output
    hint = json.loads(result.stdout)  # stderr may hold a note (a prefix not used yet)
    assert hint["advice"] == "hold"
    assert set(hint["failing_channels"]) == {"ledger"}, hint


def test_a_command_that_reads_the_ledger_says_it_is_down(urls: tuple[str, str]) -> None:
    up, down = urls
    app = App(up)

    @app.task(name="t")
    def t(ctx: Any) -> None:
        """Never runs here."""

    job_id = app.enqueue("t")
    app.close()
    code, out = run("job", "--url", down, str(job_id))
    assert code == 1
    assert "cannot reach PostgreSQL at 127.0.0.1:1" in out, out
    assert "Traceback" not in out


def test_broker_commands_never_connect_to_a_ledger_that_does_not_answer(
    postgres_server: str, redis_url: str
) -> None:
    """A ledger host that accepts connections and never answers: the commands that need
    only Redis make no connection to it at all (they used to look for its schema
    first, and waited out the connection timeout, about 10 s each)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:  # closed: the test is over
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    port = silent.getsockname()[1]
    down = split_url(broker=redis_url, ledger=f"postgresql://postgres@127.0.0.1:{port}/test")
    try:
        for command in (["queues"], ["jobs"], ["workers"], ["leases"], ["dlq", "list"]):
            code, out = run(*command, "--url", down)
            assert code == 0, (command, out)
        assert run("pause", "--url", down, "default")[0] == 0
        assert run("resume", "--url", down, "default")[0] == 0
        assert accepted == []
    finally:
        silent.close()
        for conn in accepted:
            conn.close()


@pytest.mark.parametrize("silent", ["ledger", "redis"])
def test_status_waits_once_for_a_silent_role(
    postgres_server: str, redis_url: str, silent: str
) -> None:
    """``status --timeout T`` took about 2T with one role silent: the ledger's schema
    check and then its open each waited T, or Redis's open and then its probes did. A
    role that did not answer is now said from that one wait, and not asked again."""
    from tokenline.drill import ThreadedFaultProxy

    schema = f"tl_split_silent_{secrets.token_hex(4)}"
    direct = split_url(broker=redis_url, ledger=f"{postgres_server}?schema={schema}")
    assert run("migrate", "--url", direct)[0] == 0  # a silent role is the only fault
    if silent == "ledger":
        upstream = ("127.0.0.1", 5432)
    else:
        host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        upstream = (host, int(port))
    with ThreadedFaultProxy(upstream=upstream) as proxy:
        proxy.set_faults(blackhole=True)
        here = f"127.0.0.1:{proxy.port}"
        if silent == "ledger":
            ledger = postgres_server.replace("127.0.0.1:5432", here) + f"?schema={schema}"
            url = split_url(broker=redis_url, ledger=ledger)
        else:
            broker = redis_url.replace(f"{upstream[0]}:{upstream[1]}", here)
            url = split_url(broker=broker, ledger=f"{postgres_server}?schema={schema}")
        code, out = run("status", "--url", url, "--timeout", "2", "--json")
        assert proxy.stats.accepted == 1, proxy.stats  # one wait, not two
    assert code == 1, out
    report = json.loads(out)
    failing = {name for name, ch in report["channels"].items() if ch["ok"] is False}
    assert failing == ({"ledger"} if silent == "ledger" else {"broker", "leases"}), report
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
