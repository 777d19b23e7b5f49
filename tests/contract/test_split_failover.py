"""A Redis failover under the split topology, on two real ``redis-server`` processes:
the replica is promoted (``REPLICAOF NO ONE``) after the primary is killed, having
missed the claim the primary made. The token number it hands out again is refused by
the ledger; with the ledger's epoch the new tokens rise above the old instead."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenline._clock import FakeClock
from tokenline._jobs import Lease, NewJob
from tokenline._records import Start
from tokenline.stores.base import EventLoopNeeded
from tokenline.stores.redis import RedisStore
from tokenline.stores.split import SplitStore

DEADLINE = 30.0
Q = ["default"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A ``redis-server`` on a loopback port, keeping nothing on disk."""

    def __init__(self, program: str, tmp: Path, name: str, replica_of: int | None = None) -> None:
        # The free port may be taken by another process before the server binds it (the
        # tests run in parallel): a server that could not bind exits, and a client on
        # that port would talk to someone else's server. Each try checks that the
        # server answering is this process.
        for _ in range(5):
            self.port = _free_port()
            args = [
                program,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(tmp),
                "--logfile", str(tmp / f"{name}.log"),
            ]  # fmt: skip
            if replica_of is not None:
                args += ["--replicaof", "127.0.0.1", str(replica_of)]
            self.proc = subprocess.Popen(args)
            if self._answers_as_itself():
                break
            self.stop()
        else:
            pytest.fail(f"redis-server {name} did not start on a free port in 5 tries")
        self.url = f"redis://127.0.0.1:{self.port}/0?prefix=failover"

    def _answers_as_itself(self) -> bool:
        """Whether the server on ``port`` is this process (False: it exited, or
        another process answers there)."""
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                pid = int(self.client().info("server")["process_id"])
            except redis.RedisError:
                time.sleep(0.05)
                continue
            return pid == self.proc.pid
        return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def _replicated(primary: RedisServer) -> bool:
    """Whether every write ``primary`` took so far reached its replica. WAIT counts the
    acknowledgements of the writes of the connection it is sent on alone (on a fresh
    one, it returns at once): a write of that connection goes first, and the replication
    stream, one and in order, carries the store's writes before it."""
    pipe = primary.client().pipeline(transaction=False)  # one connection for both
    pipe.set("test:replicated", "1")
    pipe.execute_command("WAIT", 1, 5000)
    return bool(pipe.execute()[1] == 1)


async def _until(what: str, check: Any) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while asyncio.get_running_loop().time() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def servers(redis_server_binary: str, tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica on free loopback ports; both killed afterwards."""
    primary = RedisServer(redis_server_binary, tmp_path, "primary")
    replica = RedisServer(redis_server_binary, tmp_path, "replica", replica_of=primary.port)
    try:
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


async def test_a_token_reused_by_a_promoted_replica_is_refused_by_the_ledger(
    servers: tuple[RedisServer, RedisServer], postgres_url: str, clock: FakeClock
) -> None:
    """The primary's claim (token t, owner w1) never reaches the replica; after the
    failover the promoted replica hands t out again, to w2. The ledger refuses w2's
    write with t (same number, another owner). A store with the ledger's epoch then
    gets tokens above t from the promoted server, takes the job over, and w1's late
    write is refused."""
    primary, replica = servers
    await _until("the replica to sync", lambda: replica.client().info("replication")
                 ["master_link_status"] == "up")  # fmt: skip
    before = SplitStore(broker=primary.url, ledger=postgres_url, clock=clock)
    await before.open()
    await before.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    assert _replicated(primary)  # the enqueue reached the replica
    # The replica misses everything from here: stopped, and its link cut, so that not
    # even bytes left in a socket buffer reach it.
    os.kill(replica.proc.pid, signal.SIGSTOP)
    primary.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
    (w1,) = await before.jobs_claim(owner="w1", queues=Q, limit=1, ttl=30)
    assert (await before.effect_begin(lease=w1.lease, key="charge:1")).start is Start.RUN
    await before.close()
    primary.proc.kill()
    primary.proc.wait(timeout=10)
    os.kill(replica.proc.pid, signal.SIGCONT)
    await _until("the replica to answer", lambda: replica.client().ping())
    replica.client().execute_command("REPLICAOF", "NO", "ONE")

    # Without an epoch, the promoted replica hands the same token number out again.
    bare = RedisStore(replica.url, clock=clock)
    await bare.open()
    (w2,) = await bare.jobs_claim(owner="w2", queues=Q, limit=1, ttl=30)
    assert w2.lease.token == w1.lease.token
    after = SplitStore(broker=replica.url, ledger=postgres_url, clock=clock)
    await after.open()
    try:
        refused = await after.ledger.effect_begin(lease=w2.lease, key="charge:1")
        assert refused.start is Start.STALE
        reused = Lease(w1.job.id, "w2", w1.lease.token, w1.lease.expires_at)
        assert refused.start is (await after.ledger.effect_begin(lease=reused, key="x")).start

        # With the ledger's epoch: the promoted server's tokens rise above the old ones.
        assert after.redis.epoch > before.redis.epoch
        clock.advance(31)
        assert (await after.jobs_rescue()).requeued == [w1.job.id]
        (w3,) = await after.jobs_claim(owner="w3", queues=Q, limit=1, ttl=30)
        assert w3.lease.token > w1.lease.token
        assert (await after.effect_begin(lease=w3.lease, key="charge:1")).start is Start.RUN
        assert not await after.effect_finish(lease=w1.lease, key="charge:1", result="1")
        assert await after.effect_finish(lease=w3.lease, key="charge:1", result="3")
    finally:
        await after.close()
        await bare.close()


async def test_a_job_id_lost_in_a_failover_is_never_handed_out_again(
    servers: tuple[RedisServer, RedisServer], postgres_url: str, clock: FakeClock
) -> None:
    """The primary issues job id b, a worker completes b in the ledger, and the replica
    never hears of b. The promoted server must not give b to a new job: the ledger
    holds b's completion, so the new job would be acknowledged unrun — lost. The new
    epoch raises the id sequence above every id issued before; an enqueue from sync
    code meeting a server whose epoch it has not taken sends the call through the loop."""
    primary, replica = servers
    await _until("the replica to sync", lambda: replica.client().info("replication")
                 ["master_link_status"] == "up")  # fmt: skip
    before = SplitStore(broker=primary.url, ledger=postgres_url, clock=clock)
    await before.open()
    (a,) = await before.jobs_enqueue(jobs=[NewJob(queue="default", task="kept", args="[]")])
    assert _replicated(primary)
    os.kill(replica.proc.pid, signal.SIGSTOP)
    primary.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
    (b,) = await before.jobs_enqueue(jobs=[NewJob(queue="default", task="lost", args="[]")])
    claimed = await before.jobs_claim(owner="w1", queues=Q, limit=2, ttl=30)
    (done,) = [c for c in claimed if c.job.id == b]
    async with before.fenced_transaction(lease=done.lease):
        pass  # the job's completion commits in the ledger
    assert await before.ledger.jobs_done(job_ids=[b]) == {b}
    await before.close()
    primary.proc.kill()
    primary.proc.wait(timeout=10)
    os.kill(replica.proc.pid, signal.SIGCONT)
    await _until("the replica to answer", lambda: replica.client().ping())
    replica.client().execute_command("REPLICAOF", "NO", "ONE")

    after = SplitStore(broker=replica.url, ledger=postgres_url, clock=clock)
    await after.open()
    try:
        (c,) = await after.jobs_enqueue(jobs=[NewJob(queue="default", task="new", args="[]")])
        assert c > b
        got = await after.jobs_claim(owner="w2", queues=Q, limit=10, ttl=30)
        assert sorted((j.job.id, j.job.task) for j in got) == [(a, "kept"), (c, "new")]

        # A store whose epoch is not the server's (here: the server's record changed)
        # writes nothing from a thread and asks for the loop, which takes it again.
        replica.client().set("{failover}:epoch", "0")
        new = NewJob(queue="default", task="new", args="[]")
        with pytest.raises(EventLoopNeeded):
            await asyncio.to_thread(after.jobs_enqueue_blocking, jobs=[new])
        (d,) = await after.jobs_enqueue(jobs=[new])
        (e,) = await asyncio.to_thread(after.jobs_enqueue_blocking, jobs=[new])
        assert d == c + 1
        assert e == d + 1
    finally:
        await after.close()
