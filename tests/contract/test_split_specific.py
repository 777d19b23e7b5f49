"""The split topology's own guarantees: the ledger's job fence, the lost ack, and how
the topology is named (App, settings, URL)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from sabotage import number_trusting_ledger, without_fences
from tokenline import App
from tokenline._clock import FakeClock
from tokenline._config import Settings, load_settings
from tokenline._errors import ConfigError, StaleTokenError, StoreError, StoreUnavailableError
from tokenline._jobs import Finish, JobState, Lease, NewJob, Outcome
from tokenline._records import Fence
from tokenline.stores import split_url, store_from_url
from tokenline.stores.redis.store import LEDGER_DONE
from tokenline.stores.split.store import RolesUnavailableError, SplitStore

Q = ["default"]


async def _write(store: SplitStore, lease: Lease, value: str) -> None:
    """A business write through the ledger's fenced transaction (no broker around it)."""
    async with store.ledger.fenced_transaction(lease=lease) as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS biz (job bigint, value text)")
        await conn.execute("INSERT INTO biz VALUES (%s, %s)", (lease.job_id, value))


async def _biz(store: SplitStore) -> list[tuple[Any, ...]]:
    return list(await store.ledger._tuples("SELECT job, value FROM biz ORDER BY value", {}))


async def test_the_ledger_refuses_an_equal_token_from_another_owner(split: SplitStore) -> None:
    """A token number the ledger has accepted from one owner is refused from another —
    what a promoted Redis replica that lost the claim would hand out — while the first
    owner may go on writing with it, and a higher token takes over."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (first,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    lease = first.lease
    assert await split.ledger.effect_begin(lease=lease, key="k1") is not None
    reused = Lease(lease.job_id, "w2", lease.token, lease.expires_at)
    with pytest.raises(StaleTokenError):
        await _write(split, reused, "from the reused token")
    assert (await split.ledger.effect_begin(lease=reused, key="k2")).start.value == "stale"
    newer = Lease(lease.job_id, "w3", lease.token + 1, lease.expires_at)
    await _write(split, newer, "from the newer token")
    with pytest.raises(StaleTokenError):
        await _write(split, lease, "from the older token")
    assert await _biz(split) == [(lease.job_id, "from the newer token")]


async def test_without_the_owner_check_the_reused_token_writes(split: SplitStore) -> None:
    """Control experiment: with the ledger's owner check removed (tests/sabotage.py),
    the same reused token is accepted and both owners write: the check is what refuses
    it above."""
    number_trusting_ledger(split.ledger)
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (first,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    lease = first.lease
    await split.ledger.effect_begin(lease=lease, key="k1")
    reused = Lease(lease.job_id, "w2", lease.token, lease.expires_at)
    await _write(split, reused, "from the reused token")
    assert await _biz(split) == [(lease.job_id, "from the reused token")]


async def _lease_twice(split: SplitStore) -> tuple[list[Any], list[Fence]]:
    """Two jobs claimed by one worker, each given the token of the same resource lease:
    its Redis key lost in between (evicted, deleted by hand), the number is issued
    again. Returns the two claims and their fences."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")] * 2)
    claimed = await split.jobs_claim(owner="w1", queues=Q, limit=2, ttl=60)
    fences = []
    for c in claimed:
        owner = f"w1/job{c.job.id}/t{c.lease.token}"
        held = await split.resource_lease_acquire(resource="acct:2", owner=owner, ttl=60)
        assert held is not None
        fences.append(Fence("acct:2", held.token, "acct:2", owner))
        await split.redis._redis().delete(split.redis.prefix + "rl:acct:2")
    assert fences[0].token == fences[1].token  # the same number, to two holders
    return claimed, fences


async def _fenced_write(split: SplitStore, lease: Lease, fence: Fence, value: str) -> None:
    """A business write under ``fence``, through the ledger alone: as a sync handler's
    ``ctx.transaction(fence=…)``, which does not ask Redis first."""
    async with split.ledger.fenced_transaction(lease=lease, fences=[fence]) as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS biz (job bigint, value text)")
        await conn.execute("INSERT INTO biz VALUES (%s, %s)", (lease.job_id, value))


async def test_a_resource_token_issued_twice_writes_for_one_holder_only(
    split: SplitStore,
) -> None:
    """The ledger let an equal resource token through from any job of the same worker
    (the same holder writing again, it took it for): after the lease's key was lost,
    two jobs of one worker held token 1 of the same lease, and both wrote under it.
    The second holder's write is refused (the same holder writing again still passes:
    test_a_fence_keeps_the_highest_token_of_each_issuer)."""
    (a, b), (fence_a, fence_b) = await _lease_twice(split)
    await _fenced_write(split, b.lease, fence_b, "b")
    with pytest.raises(StaleTokenError):
        await _fenced_write(split, a.lease, fence_a, "a")
    assert await _biz(split) == [(b.job.id, "b")]


async def test_without_the_holder_check_a_token_issued_twice_writes_twice(
    split: SplitStore,
) -> None:
    """Control experiment: with the holder check of fence_advance removed, both holders
    of the token issued twice write: that check is what refuses the second above."""
    split.ledger._queries["fence_advance"] = without_fences(split.ledger._queries["fence_advance"])
    (a, b), (fence_a, fence_b) = await _lease_twice(split)
    await _fenced_write(split, b.lease, fence_b, "b")
    await _fenced_write(split, a.lease, fence_a, "a")
    assert sorted(await _biz(split)) == sorted([(b.job.id, "b"), (a.job.id, "a")])


async def test_the_audit_lists_a_refused_write_whose_job_is_gone_from_redis(
    split: SplitStore,
) -> None:
    """`tokenline audit duplicates` failed with "no job with id N" once a job whose
    refused write Redis kept was gone (its hash evicted, deleted, a flushed prefix):
    the audit an operator needs after such an incident could not be read."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (c,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    stale = Lease(c.job.id, "w1", c.lease.token + 5, c.lease.expires_at)
    assert await split.jobs_finish(finishes=[Finish(stale, Outcome.SUCCEEDED)]) == [False]
    await split.redis._redis().delete(f"{split.redis.prefix}job:{c.job.id}")
    found = await split.duplicates_list()
    assert [(d.key, d.job_id, d.token) for d in found if d.kind.value == "stale"] == [
        (f"job:{c.job.id}", c.job.id, stale.token)
    ]


async def test_a_second_ledger_on_the_same_redis_prefix_is_refused(
    split: SplitStore, redis_url: str, postgres_url: str, postgres_server: str, clock: FakeClock
) -> None:
    """Two apps with ledgers of their own on one Redis prefix took each other's jobs,
    and each ledger issued the same epoch: a job paused past its lease ran again under
    the other app's ledger, its effect written twice. A store whose ledger is not the
    one the prefix serves is now refused at open, naming both; the prefix's own ledger
    opens as before."""
    import psycopg

    other_schema = f"tl_test_{uuid.uuid4().hex[:12]}"
    other = SplitStore(
        broker=redis_url, ledger=f"{postgres_server}?schema={other_schema}", clock=clock
    )
    try:
        with pytest.raises(ConfigError, match="already serves another ledger") as refused:
            await other.open()
        assert split.ledger.schema in str(refused.value)
        assert other_schema in str(refused.value)
        again = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
        await again.open()  # the prefix's own ledger, from another process
        await again.close()
        # Status with the other ledger said every channel was ok: it answers, and
        # Redis answers; the broker now fails, saying why.
        for ledger, ok in (
            (f"{postgres_server}?schema={other_schema}", False),
            (postgres_url, True),
        ):
            broker = await asyncio.to_thread(_status_broker, redis_url, ledger)
            assert broker["ok"] is ok, broker
            if not ok:
                assert "already serves another ledger" in broker["error"], broker
                assert other_schema in broker["error"], broker
    finally:
        await other.close()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {other_schema} CASCADE")  # type: ignore[arg-type]


async def test_migrate_refuses_a_ledger_the_redis_prefix_would_refuse(
    split: SplitStore, redis_url: str, postgres_url: str, postgres_server: str, clock: FakeClock
) -> None:
    """`tokenline migrate` with a broker whose prefix serves another ledger created the
    schema and said so, exit 0, while every process of that pair of URLs was then
    refused at open. It is now refused the same way, with nothing created; the
    prefix's own ledger still migrates (nothing to do)."""
    import psycopg

    other_schema = f"tl_test_{uuid.uuid4().hex[:12]}"
    other = SplitStore(
        broker=redis_url, ledger=f"{postgres_server}?schema={other_schema}", clock=clock
    )
    try:
        with pytest.raises(ConfigError, match="already serves another ledger"):
            await other.migrate()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (other_schema,)
            ).fetchone()
        assert found == (0,)  # nothing created
        own = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
        assert await own.migrate() is not None
        assert own.migrated is None  # up to date: nothing done
        assert not own.redis.connected  # the check's connection is closed
    finally:
        await other.close()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {other_schema} CASCADE")  # type: ignore[arg-type]


@pytest.mark.parametrize("first", ["running", "other"])
async def test_a_prefix_whose_keys_were_lost_stays_with_its_ledger(
    split: SplitStore,
    redis_url: str,
    postgres_server: str,
    clock: FakeClock,
    first: str,
) -> None:
    """The prefix's keys lost (a Redis restarted without its data, a FLUSHDB) took its
    ledger key with them, and only an open wrote it: the next process to open, with any
    ledger, took the prefix while this ledger's processes ran on, and the two ledgers
    shared it, a job's effect written twice. The running process claims the prefix
    again as it takes its new epoch. Whichever comes first keeps it: another ledger
    opening after that is refused; one that opened first refuses the running process
    every call that needs the new epoch, saying why."""
    import psycopg

    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    client = split.redis._redis()
    keys = [k async for k in client.scan_iter(match=split.redis.prefix + "*")]
    await client.delete(*keys)  # a FLUSHDB, for this prefix alone
    other_schema = f"tl_test_{uuid.uuid4().hex[:12]}"
    other = SplitStore(
        broker=redis_url, ledger=f"{postgres_server}?schema={other_schema}", clock=clock
    )
    try:
        if first == "running":
            await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
            with pytest.raises(ConfigError, match="already serves another ledger"):
                await other.open()
        else:
            await other.open()
            with pytest.raises(StoreError, match="already serves another ledger") as refused:
                await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
            assert other_schema in str(refused.value)
    finally:
        await other.close()
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {other_schema} CASCADE")  # type: ignore[arg-type]


def _status_broker(broker: str, ledger: str) -> dict[str, Any]:
    """`tokenline status --json`'s broker channel for the split store of the two URLs."""
    import json

    from click.testing import CliRunner

    from tokenline.cli import main

    args = ["status", "--json", "--timeout", "5", "--broker", broker, "--ledger", ledger]
    result = CliRunner().invoke(main, args)
    assert result.stdout, (result.output, result.exception)
    channels: dict[str, dict[str, Any]] = json.loads(result.stdout)["channels"]
    return channels["broker"]


async def test_lost_redis_keys_are_said_when_the_new_epoch_is_taken(
    split: SplitStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A FLUSHDB took the queued jobs with it and nothing said so: the only trace was
    a refused renewal. The process that takes the new epoch now warns that the prefix's
    keys were lost, and which jobs the reconciler can and cannot report."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    client = split.redis._redis()
    keys = [k async for k in client.scan_iter(match=split.redis.prefix + "*")]
    await client.delete(*keys)  # a FLUSHDB, for this prefix alone
    with caplog.at_level(logging.WARNING, logger="tokenline.store.split"):
        await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    said = [r.getMessage() for r in caplog.records if "new identity" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "this prefix's keys were lost" in said[0]
    assert "job_lost_from_broker" in said[0]


async def test_a_second_prefix_of_one_ledger_is_not_said_to_have_lost_its_keys(
    split: SplitStore,
    redis_server: str,
    postgres_url: str,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ledger serving a second Redis prefix took a new epoch for it, and its process
    warned that the prefix's keys were lost and its jobs gone, of a prefix that had
    never held a job. The epoch follows only the earlier epochs of its own prefix: a
    new prefix takes one without a warning, and a prefix whose keys go is still told."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    name = f"tl_test_{uuid.uuid4().hex[:12]}"
    sep = "&" if "?" in redis_server else "?"
    second = SplitStore(
        broker=f"{redis_server}{sep}prefix={name}", ledger=postgres_url, clock=clock
    )
    client = split.redis._redis()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenline.store.split"):
            await second.open()
            await second.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        assert "new identity" not in caplog.text
        assert second.redis.epoch > split.redis.epoch
        keys = [k async for k in client.scan_iter(match=second.redis.prefix + "*")]
        await client.delete(*keys)  # the second prefix's keys lost: that is still said
        with caplog.at_level(logging.WARNING, logger="tokenline.store.split"):
            await second.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        said = [r.getMessage() for r in caplog.records if "new identity" in r.getMessage()]
        assert len(said) == 1, caplog.text
        assert "this prefix's keys were lost" in said[0]
    finally:
        await second.close()
        keys = [k async for k in client.scan_iter(match=f"{{{name}}}:*")]
        if keys:
            await client.delete(*keys)


async def test_a_ledger_from_before_the_epochs_prefixes_gains_the_column(
    split: SplitStore,
    redis_server: str,
    redis_url: str,
    postgres_url: str,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ledger made before the epochs named their prefix is brought up to date at
    open, its epochs kept, the prefix's current one labelled with it. An epoch that
    names no prefix (the ledger's history, or one an older release's process takes
    later) could be any prefix's, and is no one's previous: a new prefix on the
    upgraded ledger is not told its keys were lost, and this prefix's loss still is."""
    schema = split.ledger.schema
    (before,) = await split.ledger._tuples(f"SELECT epoch FROM {schema}.redis_epochs", {})
    await _ddl(postgres_url, f"ALTER TABLE {schema}.redis_epochs DROP COLUMN prefix")
    again = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
    name = f"tl_test_{uuid.uuid4().hex[:12]}"
    sep = "&" if "?" in redis_server else "?"
    other = SplitStore(broker=f"{redis_server}{sep}prefix={name}", ledger=postgres_url, clock=clock)
    client = split.redis._redis()

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "new identity" in r.getMessage()]

    try:
        await again.open()
        rows = await again.ledger._tuples(
            f"SELECT epoch, prefix FROM {schema}.redis_epochs ORDER BY epoch", {}
        )
        assert rows == [(before[0], again.redis.prefix)]
        # An older release's process, on a prefix of another server, takes an epoch.
        await _ddl(
            postgres_url,
            f"INSERT INTO {schema}.redis_epochs (replid, epoch, first_seen) "
            f"VALUES ('elsewhere/abc', nextval('{schema}.redis_epoch_seq'), 0)",
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenline.store.split"):
            await other.open()
            await other.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        assert told() == [], caplog.text
        keys = [k async for k in client.scan_iter(match=again.redis.prefix + "*")]
        await client.delete(*keys)
        with caplog.at_level(logging.WARNING, logger="tokenline.store.split"):
            await again.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        (said,) = told()
        assert "this prefix's keys were lost" in said
    finally:
        await again.close()
        await other.close()
        keys = [k async for k in client.scan_iter(match=f"{{{name}}}:*")]
        if keys:
            await client.delete(*keys)


async def _ddl(url: str, statement: str) -> None:
    """``statement`` on a connection of its own to the ledger's database."""
    import psycopg

    base = url.split("?")[0]
    async with await psycopg.AsyncConnection.connect(base, autocommit=True) as conn:
        await conn.execute(statement)  # type: ignore[arg-type]


@pytest.mark.parametrize("dropped", ["job_fences", "redis_epochs"])
async def test_a_split_ledger_missing_a_table_is_refused_not_made_again_empty(
    split: SplitStore, redis_url: str, postgres_url: str, clock: FakeClock, dropped: str
) -> None:
    """A dropped job_fences was made again, empty, by the next open: the ledger forgot
    which jobs were done and which tokens stale, and status, migrate and enqueue all
    said nothing. The next open now refuses it, naming what it lacks."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (c,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    await _write(split, c.lease, "done once")
    await _ddl(postgres_url, f"DROP TABLE {split.ledger.schema}.{dropped} CASCADE")
    again = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
    try:
        with pytest.raises(RolesUnavailableError, match=f"damaged: it lacks {dropped}"):
            await again.open()
    finally:
        await again.close()
    rows = await split.ledger._tuples(
        "SELECT count(*) FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %(s)s AND c.relname = %(t)s",
        {"s": split.ledger.schema, "t": dropped},
    )
    assert rows == [(0,)]  # not made again


async def test_a_ledger_whose_identity_changed_is_told_so(
    split: SplitStore, redis_url: str, postgres_url: str, clock: FakeClock
) -> None:
    """A ledger_identity table dropped and made again gave the ledger a new identity,
    and the refusal named the same ledger twice as "another ledger"."""
    await _ddl(postgres_url, f"DROP TABLE {split.ledger.schema}.ledger_identity")
    again = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
    try:
        with pytest.raises(ConfigError, match="same name whose identity differs"):
            await again.open()
    finally:
        await again.close()


class _LostAck(SplitStore):
    """A split store whose Redis loses the next acknowledgements (the ack after the
    ledger commit): they raise as a connection cut mid-call would."""

    lose = 0

    async def jobs_finish(self, *, finishes: Any) -> list[bool]:
        if self.lose:
            self.lose -= 1
            raise StoreUnavailableError("the acknowledgement was lost on its way to Redis")
        return await super().jobs_finish(finishes=finishes)


async def test_a_lost_ack_never_runs_the_effect_again(
    redis_url: str, postgres_url: str, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The fenced transaction commits the business write and the job's completion in
    PostgreSQL; its acknowledgement to Redis is lost, so Redis redelivers the job once
    the lease expires. The claim asks the ledger, acknowledges the job as succeeded and
    hands it to nobody; a write from the redelivered attempt would be refused."""
    store = _LostAck(broker=redis_url, ledger=postgres_url, clock=clock)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
        (claimed,) = await store.jobs_claim(owner="w1", queues=Q, limit=1, ttl=10)
        store.lose = 2
        tx = store.fenced_transaction(lease=claimed.lease)
        async with tx as conn:
            await conn.execute("CREATE TABLE biz (job bigint, value text)")
            await conn.execute("INSERT INTO biz VALUES (%s, 'paid')", (claimed.job.id,))
        assert (tx.wrote, tx.committed) == (True, False)
        with pytest.raises(StoreUnavailableError):
            # The worker's own acknowledgement is lost too.
            await store.jobs_finish(finishes=[Finish(claimed.lease, Outcome.SUCCEEDED)])
        assert (await store.job_get(job_id=claimed.job.id)).state is JobState.RUNNING
        clock.advance(11)
        assert (await store.jobs_rescue()).requeued == [claimed.job.id]
        assert await store.jobs_claim(owner="w2", queues=Q, limit=10, ttl=10) == []
        job = await store.job_get(job_id=claimed.job.id)
        assert (job.state, store.acknowledged_from_ledger) == (JobState.SUCCEEDED, 1)
        assert "the ledger had completed them" in caplog.text  # a repair is said
        # The history says which attempt did the work: not the one acknowledged.
        outcomes = [a.outcome for a in await store.job_attempts(job_id=claimed.job.id)]
        assert outcomes == ["lease_expired", LEDGER_DONE]
        again = Lease(claimed.job.id, "w2", claimed.lease.token + 1, 0.0)
        with pytest.raises(StaleTokenError):
            await _write(store, again, "paid twice")
        assert await _biz(store) == [(claimed.job.id, "paid")]
    finally:
        await store.close()


async def test_a_ledger_that_cannot_answer_releases_the_claimed_jobs(
    split: SplitStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim whose ledger check fails gives the jobs back at once, attempt refunded,
    and raises: no job runs without the ledger's word, none waits for a lease to
    expire."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])

    async def down(*, job_ids: Any) -> set[int]:
        raise StoreUnavailableError("PostgreSQL is unreachable")

    monkeypatch.setattr(split.ledger, "jobs_done", down)
    with pytest.raises(StoreUnavailableError):
        await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    (job,) = await split.jobs_list()
    assert (job.state, job.attempt, job.lease_owner) == (JobState.QUEUED, 0, None)


async def test_a_ledger_too_slow_for_the_lease_releases_the_claimed_jobs_in_time(
    split: SplitStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger check that took longer than the lease (4.7 s against a 4 s lease) let
    the leases expire first: the rescue took the jobs back, never run, and charged each
    a lease expiry, and the claim's release was refused as stale. The check now gives
    up at half the lease and releases the jobs while their leases hold."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    gave_up = asyncio.Event()

    async def slow(*, job_ids: Any) -> set[int]:
        try:
            await asyncio.sleep(60)
        finally:
            gave_up.set()
        return set()

    monkeypatch.setattr(split.ledger, "jobs_done", slow)
    with pytest.raises(StoreUnavailableError, match=r"did not say within 0\.5s"):
        await asyncio.wait_for(split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=1.0), timeout=30)
    assert gave_up.is_set()
    (job,) = await split.jobs_list()
    assert (job.state, job.attempt, job.lease_owner) == (JobState.QUEUED, 0, None)
    assert job.lease_expiries == 0
    assert await split.stale_commits() == (0, [])


def test_the_split_topology_is_named_by_role_urls() -> None:
    """App(broker=, leases=, ledger=) and TOKENLINE_BROKER / _LEASES / _LEDGER name the
    split topology as one URL; a wrong URL for a role is a ConfigError naming the role;
    Redis alone is refused as a store, with the reason."""
    broker, ledger = "redis://127.0.0.1:6379/0?prefix=x", "postgresql://u@h/db"
    app = App(broker=broker, leases=broker, ledger=ledger)
    assert app.url == split_url(broker, ledger)
    assert isinstance(store_from_url(app.url), SplitStore)
    env = {"TOKENLINE_BROKER": broker, "TOKENLINE_LEDGER": ledger}
    settings = load_settings(Settings, environ=env)
    assert App(settings=settings).url == app.url
    assert App("sqlite:///other.db", settings=settings).url == "sqlite:///other.db"
    with pytest.raises(ConfigError) as bad:
        App(broker="postgresql://u@h/db", ledger=ledger)
    assert bad.value.setting == "broker"
    with pytest.raises(ConfigError) as bad:
        App(broker=broker, leases="redis://elsewhere:6379/0", ledger=ledger)
    assert bad.value.setting == "leases"
    with pytest.raises(ConfigError) as bad:
        App(broker=broker)
    assert bad.value.setting == "ledger"
    with pytest.raises(ConfigError, match="broker and leases roles only"):
        store_from_url(broker)


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _install_ledger(postgres_url: str) -> None:
    """Install the ledger's schema, as a worker or `tokenline migrate` would have: status
    creates no store, and a schema not installed would fail every channel."""
    import asyncio

    from tokenline.stores.postgres import PostgresStore

    asyncio.run(PostgresStore(postgres_url).migrate())


@pytest.mark.parametrize("down", ["redis", "postgresql"])
def test_status_names_the_failing_side_of_the_split(
    down: str, redis_url: str, postgres_url: str
) -> None:
    """With Redis unreachable, status says broker and leases fail, naming Redis, and the
    ledger answers, and the queues, workers and stale commits Redis carries are null
    (they were empty lists, as from a healthy empty store); with PostgreSQL
    unreachable, the ledger fails, naming PostgreSQL, and broker and leases answer."""
    import json

    from click.testing import CliRunner

    from tokenline.cli import main

    _install_ledger(postgres_url)
    port = _dead_port()
    broker = f"redis://127.0.0.1:{port}/0" if down == "redis" else redis_url
    ledger = f"postgresql://postgres@127.0.0.1:{port}/test" if down != "redis" else postgres_url
    args = ["status", "--json", "--timeout", "5", "--broker", broker, "--ledger", ledger]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    channels = report["channels"]
    failing = {name for name, c in channels.items() if c["ok"] is False}
    named = "Redis" if down == "redis" else "PostgreSQL"
    expected = {"broker", "leases"} if down == "redis" else {"ledger"}
    assert failing == expected, channels
    assert all(named in channels[name]["error"] for name in failing), channels
    assert all(channels[name]["ok"] for name in set(channels) - failing), channels
    data = [report[k] for k in ("queues", "workers", "stale_commits")]
    if down == "redis":
        assert data == [None, None, None], report
    else:
        assert None not in data, report


def test_status_names_redis_when_the_drill_proxy_cuts_it_off(
    redis_url: str, postgres_url: str
) -> None:
    """As in the drill's Redis partitions: Redis behind a fault proxy that blackholes.
    Status says broker and leases are slow, naming Redis, and the ledger answers."""
    import json
    import urllib.parse

    from click.testing import CliRunner

    from tokenline.cli import main
    from tokenline.drill._scratch import through
    from tokenline.drill.proxy import Faults, ThreadedFaultProxy

    _install_ledger(postgres_url)
    server = urllib.parse.urlsplit(redis_url)
    with ThreadedFaultProxy((server.hostname or "127.0.0.1", server.port or 6379)) as proxy:
        broker = through(redis_url, *proxy.address)
        args = ["status", "--json", "--timeout", "2", "--broker", broker, "--ledger", postgres_url]
        healthy = json.loads(CliRunner().invoke(main, args).stdout)["channels"]
        assert all(c["ok"] for c in healthy.values()), healthy
        proxy.set_faults(Faults(blackhole=True))
        channels = json.loads(CliRunner().invoke(main, args).stdout)["channels"]
    assert {n: c["failure"] for n, c in channels.items()} == {
        "broker": "slow",
        "leases": "slow",
        "ledger": None,
    }, channels
    assert "Redis at" in channels["broker"]["error"], channels


async def test_a_ledger_from_before_the_later_columns_is_brought_up_to_date(
    split: SplitStore, redis_url: str, postgres_url: str, clock: FakeClock
) -> None:
    """A ledger whose job_fences lacks the columns and index added later gets them when
    a store opens it (and one that has them is left alone: see the held-fence test)."""
    schema = split.ledger.schema

    async def drop(conn: Any) -> None:
        await conn.execute(f'DROP INDEX "{schema}".job_fences_unsettled')
        await conn.execute(f'ALTER TABLE "{schema}".job_fences DROP COLUMN lost_at')
        await conn.execute(f'ALTER TABLE "{schema}".job_fences DROP COLUMN pruned_at')

    await split.ledger._call(drop)
    again = SplitStore(broker=redis_url, ledger=postgres_url, clock=clock)
    await again.open()
    try:

        async def columns(conn: Any) -> list[Any]:
            cur = await conn.execute(again.ledger._q("split_schema_current"), {"schema": schema})
            return list(await cur.fetchall())

        assert await again.ledger._call(columns) == [(True,)]
    finally:
        await again.close()


async def test_a_failed_open_closes_the_side_that_opened(postgres_url: str) -> None:
    """With Redis down, open() used to leave the ledger's connection pool open; a caller
    that gave up on the store (``tokenline enqueue``) then printed the pool's tasks dying
    with its event loop, some forty lines of tracebacks."""
    store = SplitStore(broker="redis://127.0.0.1:1/0", ledger=postgres_url, timeout=5)
    with pytest.raises(StoreUnavailableError, match="Redis"):
        await store.open()
    assert store.ledger._pool is None
    assert set(store.roles_down) == {"broker", "leases"}


async def test_ledgers_opened_at_once_on_a_fresh_schema_all_open(postgres_url: str) -> None:
    """Workers and enqueuers starting together on a new split topology each open the
    ledger, which creates its tables: unserialised, all but one of them failed on
    PostgreSQL's catalogue (duplicate key in ``pg_type_typname_nsp_index``)."""
    import asyncio

    from tokenline.stores.postgres import PostgresStore
    from tokenline.stores.split.ledger import SplitLedger

    # The PostgreSQL store's own migrations are already serialised: install them first,
    # so that every ledger reaches its split tables at the same moment.
    await PostgresStore(postgres_url).migrate()
    ledgers = [SplitLedger(postgres_url) for _ in range(8)]
    results = await asyncio.gather(*(ledger.open() for ledger in ledgers), return_exceptions=True)
    try:
        assert [r for r in results if r is not None] == []

        async def current(conn: Any) -> list[Any]:
            params = {"schema": ledgers[0].schema}
            cur = await conn.execute(ledgers[0]._q("split_schema_current"), params)
            return list(await cur.fetchall())

        assert await ledgers[0]._call(current) == [(True,)]
    finally:
        for ledger in ledgers:
            await ledger.close()


async def _forget(split: SplitStore, *only: str) -> None:
    """Delete the store's keys in Redis (``only``: those keys alone), as a FLUSHDB, an
    operator's mistake or an eviction would, on a server whose replication id stays."""
    prefix = split.redis.prefix
    client = split.redis._redis()
    keys = [prefix + k for k in only] if only else await client.keys(prefix + "*")
    await client.delete(*keys)


@pytest.mark.parametrize("lost", ["every key", "the id sequence"])
async def test_redis_keys_lost_on_the_same_server_never_reuse_ids_or_tokens(
    split: SplitStore, clock: FakeClock, lost: str
) -> None:
    """Job ids and tokens issued before the store's keys were lost from a Redis server
    that kept its replication id are never handed out again: the next epoch is a new
    one. Before, the same epoch came back, the sequence restarted at its floor, and a
    new job took the id of one the ledger had seen completed: it was acknowledged as
    done without running. A resource lease's new holder got a token already used."""
    (done,) = await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (claimed,) = await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    await _write(split, claimed.lease, "done before the loss")
    assert await split.ledger.jobs_done(job_ids=[done]) == {done}
    held = await split.resource_lease_acquire(resource="acct", owner="w1", ttl=60)
    assert held is not None
    epoch = split.redis.epoch

    await _forget(split, *(() if lost == "every key" else ("seq",)))

    (new,) = await split.jobs_enqueue(jobs=[NewJob(queue="default", task="new", args="[]")])
    assert new > done
    assert split.redis.epoch > epoch
    got = await split.jobs_claim(owner="w2", queues=Q, limit=10, ttl=60)
    assert [(c.job.id, c.job.task) for c in got] == [(new, "new")]
    if lost == "every key":
        clock.advance(61)
        again = await split.resource_lease_acquire(resource="acct", owner="w2", ttl=60)
        assert again is not None
        assert again.token > held.token


async def test_a_job_hash_gone_from_redis_stops_only_that_job(split: SplitStore) -> None:
    """Eviction or a DEL takes job hashes out of Redis: a queued one, and one running
    that had begun its work in the ledger. Every other job is still claimed, listed and,
    once its lease expires, rescued; the queued one is dropped from the queue and the
    running one, which the ledger saw and never completed, is reported lost by the
    reconciler (its payload cannot be run again)."""
    import redis

    from tokenline.stores.base import Drift

    ids = await split.jobs_enqueue(
        jobs=[NewJob(queue="default", task="t", args=f"[{i}]") for i in range(6)]
    )
    p = split.redis.prefix
    client: Any = redis.Redis.from_url(split.redis.url.partition("?")[0])
    try:
        client.delete(f"{p}job:{ids[2]}")
        claimed = await split.jobs_claim(owner="w1", queues=Q, limit=3, ttl=5)
        claimed += await split.jobs_claim(owner="w1", queues=Q, limit=3, ttl=5)
        assert sorted(c.job.id for c in claimed) == [i for i in ids if i != ids[2]]
        first = next(c for c in claimed if c.job.id == ids[0])
        assert await split.ledger.effect_begin(lease=first.lease, key="k") is not None
        client.delete(f"{p}job:{ids[0]}")
        running = await split.jobs_list(state=JobState.RUNNING)
        assert sorted(j.id for j in running) == [ids[1], *ids[3:]]
        split.redis.clock.advance(10)
        report = await split.jobs_rescue()
        assert sorted(report.requeued) == [ids[1], *ids[3:]]
        assert client.get(f"{p}dropped_n") == b"2"
        found = await split.reconcile_find(pending_deadline=3600)
        assert [(f.kind, f.job_id) for f in found if f.kind is Drift.JOB_LOST] == [
            (Drift.JOB_LOST, ids[0])
        ]
    finally:
        client.close()


async def test_a_ledger_block_leaves_nothing_on_its_session_for_the_next_job(
    redis_url: str, postgres_url: str
) -> None:
    """The split topology's fenced transactions run on the ledger's lent connections:
    a block that changes its session (search path, an advisory lock, a 1 ms timeout)
    still completes, and the next job's block on the same connection finds the session
    as a fresh one (see the PostgreSQL store's test of the same)."""
    store = SplitStore(broker=redis_url, ledger=postgres_url)
    store.ledger.max_connections = 1  # every block on the one lent connection
    await store.open()
    probe = (
        "SELECT current_setting('search_path'), pg_backend_pid(), "
        "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND pid = pg_backend_pid())"
    )
    try:
        await store.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")] * 3)
        seen = []
        for n in range(3):
            (claimed,) = await store.jobs_claim(owner="w", queues=Q, limit=1, ttl=30)
            async with store.fenced_transaction(lease=claimed.lease) as conn:
                seen.append(await (await conn.execute(probe)).fetchone())
                if n == 1:
                    await conn.execute("SET search_path TO pg_catalog")
                    await conn.execute("SELECT pg_advisory_lock(5)")
                    await conn.execute("SET statement_timeout = 1")
        assert seen[0] == seen[1] == seen[2]
        assert seen[0][2] == 0
    finally:
        await store.close()


async def test_the_rescue_ends_the_ledger_sessions_of_the_attempts_it_rescued(
    split: SplitStore, clock: FakeClock
) -> None:
    """A worker paused inside its fenced transaction keeps that ledger session open,
    holding the job's ledger row. The rescue on Redis used to leave it: the job's next
    attempt waited for that row until the session's idle limit (up to the attempt's
    hard timeout), failing as "did not answer". The rescue now ends it, as the
    PostgreSQL store's own rescue does."""
    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])
    (first,) = await split.jobs_claim(owner="paused", queues=Q, limit=1, ttl=30)
    session = split.ledger.session_name(first.lease)

    async def open_sessions() -> list[Any]:
        return list(
            await split.ledger._tuples(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %(name)s",
                {"name": session},
            )
        )

    held = split.fenced_transaction(lease=first.lease)
    conn = await held.__aenter__()
    await conn.execute("SELECT 1")  # the paused worker's transaction, left open
    assert len(await open_sessions()) == 1
    clock.advance(60)
    report = await split.jobs_rescue()
    assert report.requeued == [first.lease.job_id]
    assert report.attempts == [(first.lease.job_id, first.lease.token)]
    assert await open_sessions() == []
    with pytest.raises(StoreUnavailableError):  # its session is gone
        await held.__aexit__(None, None, None)
    (second,) = await split.jobs_claim(owner="healthy", queues=Q, limit=1, ttl=30)
    async with asyncio.timeout(10):  # its row is free: no wait for the paused session
        async with split.fenced_transaction(lease=second.lease) as conn:
            await conn.execute("SELECT 1")
    assert (await split.job_get(job_id=second.lease.job_id)).state is JobState.SUCCEEDED


async def test_a_failure_is_put_on_the_role_whose_server_failed(
    split: SplitStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim failing in its ledger check was counted as the broker's failure, and a
    handler's effect failing on Redis's token check as the ledger's: the metric blamed
    the server that answered. PostgreSQL's errors are the ledger's, and a Redis error
    under a ledger call the broker's."""
    from tokenline.stores.postgres._errors import map_postgres_errors
    from tokenline.stores.redis._errors import map_redis_errors

    await split.jobs_enqueue(jobs=[NewJob(queue="default", task="t", args="[]")])

    async def silent(*, job_ids: Any) -> set[int]:
        with map_postgres_errors(split.ledger.target, 1.0):
            raise TimeoutError

    monkeypatch.setattr(split.ledger, "jobs_done", silent)
    with pytest.raises(StoreUnavailableError) as from_ledger:
        await split.jobs_claim(owner="w1", queues=Q, limit=1, ttl=60)
    assert from_ledger.value.server == "PostgreSQL"
    assert split.channel_of(from_ledger.value, "broker") == "ledger"
    with pytest.raises(StoreUnavailableError) as from_redis, map_redis_errors("r", "held.lua"):
        raise TimeoutError
    assert from_redis.value.server == "Redis"
    assert split.channel_of(from_redis.value, "ledger") == "broker"
    assert split.channel_of(from_redis.value, "leases") == "leases"
