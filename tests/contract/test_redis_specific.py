"""The Redis store's own rules: its scripts document themselves, a bad URL or an
unreachable server is a clear error, and each test's keys stay under its prefix."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenline._errors import ConfigError, StoreError, StoreUnavailableError
from tokenline._jobs import JobState, NewJob
from tokenline.stores.redis import RedisStore


def test_every_script_documents_its_keys_and_arguments() -> None:
    """Each Lua script opens with its name and a header naming KEYS[1] (the prefix),
    the keys it touches, its ARGV and what it returns."""
    folder = resources.files("tokenline.stores.redis").joinpath("scripts")
    scripts = [p for p in folder.iterdir() if p.name.endswith(".lua") and p.name != "_lib.lua"]
    assert len(scripts) >= 10
    for path in scripts:
        text = path.read_text(encoding="utf-8")
        header = text.split("\n\n", 1)[0]
        assert header.startswith(f"-- {path.name}:"), path.name
        for word in ("KEYS[1]", "ARGV[1]", "Returns"):
            assert word in text.split("local ", 1)[0], (path.name, word)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:6379", "redis://127.0.0.1:6379/0?prefix=a{b}", "redis://h/0?prefix="]
)
def test_a_bad_url_is_a_config_error(url: str) -> None:
    """A URL that is not Redis's, or a key prefix with braces or empty, is refused."""
    with pytest.raises(ConfigError) as bad:
        RedisStore(url)
    assert bad.value.setting == "url"


async def test_an_unreachable_server_is_store_unavailable() -> None:
    """Opening a store on a port nobody listens on says which server it could not reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout=2)
    with pytest.raises(StoreUnavailableError, match=f"Redis at 127.0.0.1:{port}"):
        await store.open()
    await store.close()


async def test_keys_stay_under_the_prefix(redis_url: str, redis_server: str) -> None:
    """Everything the store writes is under its own ``{prefix}:`` (one cluster slot)."""
    import redis

    store = RedisStore(redis_url)
    await store.open()
    try:
        await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="[]")])
        await store.jobs_claim(owner="w", queues=["q"], limit=1, ttl=5)
    finally:
        await store.close()
    name = redis_url.rpartition("prefix=")[2]
    client: Any = redis.Redis.from_url(redis_server)
    with client:
        mine = list(client.scan_iter(match=f"{{{name}}}:*"))
        assert mine
        assert all(k.decode().startswith(f"{{{name}}}:") for k in mine)


async def test_a_blocking_enqueue_needs_the_store_open_and_stops_with_it(
    redis_url: str, redis_server: str
) -> None:
    """The caller's-thread enqueue refuses before open and after close, clearly, and
    between them writes through the same script as the async one (same ids)."""
    import asyncio

    from tokenline._errors import StoreError

    store = RedisStore(redis_url)
    job = NewJob(queue="q", task="t", args="[]")
    with pytest.raises(StoreError, match="not open"):
        store.jobs_enqueue_blocking(jobs=[job])
    await store.open()
    try:
        (a,) = await store.jobs_enqueue(jobs=[job])
        (b,) = await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=[job])
        assert b == a + 1
        assert (await store.job_get(job_id=b)).task == "t"
    finally:
        await store.close()
    with pytest.raises(StoreError, match="not open"):
        store.jobs_enqueue_blocking(jobs=[job])


async def test_a_batch_over_the_limit_is_refused_before_it_holds_up_the_server(
    redis_url: str,
) -> None:
    """A batch of 200,000 jobs ran as one script for over 5 seconds, and every other
    client of the server, workers renewing their leases included, got ``BUSY`` until
    it ended. A batch over MAX_BATCH is now refused as bad input, with the limit and
    what to do, and nothing is written; one at the limit goes in whole."""
    import asyncio

    from tokenline._errors import InvalidInputError
    from tokenline.stores.redis.store import MAX_BATCH

    store = RedisStore(redis_url)
    await store.open()
    try:
        over = [NewJob(queue="q", task="t", args="[]")] * (MAX_BATCH + 1)
        said = rf"a batch of {MAX_BATCH + 1:,} jobs is over the Redis store's limit"
        with pytest.raises(InvalidInputError, match=said):
            await store.jobs_enqueue(jobs=over)
        with pytest.raises(InvalidInputError, match=rf"at most {MAX_BATCH:,} jobs at a time"):
            await asyncio.to_thread(store.jobs_enqueue_blocking, jobs=over)
        assert await store.jobs_list(limit=10) == []
        ids = await store.jobs_enqueue(jobs=over[1:])
        assert len(set(ids)) == MAX_BATCH
    finally:
        await store.close()


# -- a job hash missing or malformed (eviction, an operator's DEL) ------------------------


async def _damaged_store(
    redis_url: str, redis_server: str, n: int = 10
) -> tuple[Any, Any, list[int]]:
    """An open store on a fake clock with ``n`` queued jobs, and a client to damage it."""
    import redis

    from tokenline._clock import FakeClock

    store = RedisStore(redis_url, clock=FakeClock())
    await store.open()
    ids = await store.jobs_enqueue(
        jobs=[NewJob(queue="q", task="t", args=f"[{i}]") for i in range(n)]
    )
    client: Any = redis.Redis.from_url(redis_server, decode_responses=True)
    return store, client, ids


async def test_a_queued_job_whose_hash_is_gone_is_dropped_and_every_other_claimed(
    redis_url: str, redis_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With the hash of the third queued job deleted, claims hand out the nine others,
    each once and each as running: none is left half-claimed by a script that failed
    partway. The gone job leaves every index, is counted and named in a warning, and
    listings go on with the rest."""
    store, client, ids = await _damaged_store(redis_url, redis_server)
    p = store.prefix
    try:
        client.delete(f"{p}job:{ids[2]}")
        claimed: list[int] = []
        for _ in range(5):
            claimed += [
                c.job.id for c in await store.jobs_claim(owner="w", queues=["q"], limit=4, ttl=60)
            ]
        assert sorted(claimed) == sorted(i for i in ids if i != ids[2])
        running = await store.jobs_list(state=JobState.RUNNING)
        assert sorted(j.id for j in running) == sorted(claimed)
        assert await store.jobs_list(state=JobState.QUEUED) == []
        assert client.get(f"{p}dropped_n") == "1"
        assert f"{p}job:{ids[2]}" in caplog.text
        for key in (f"{p}all", f"{p}st:queued", f"{p}st:running"):
            assert client.zscore(key, ids[2]) is None, key
        stats = await store.queues_stats()
        assert stats[0].counts == {"running": 9}
    finally:
        await store.close()
        client.close()


async def test_a_running_job_whose_hash_is_gone_does_not_stop_the_rescue(
    redis_url: str, redis_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The hash of a running job deleted, its lease and every other's expire: the rescue
    returns the others to the queue and drops the gone one, and listings of running
    jobs (``tokenline leases``) go on."""
    store, client, ids = await _damaged_store(redis_url, redis_server, n=4)
    p = store.prefix
    try:
        await store.jobs_claim(owner="w", queues=["q"], limit=4, ttl=5)
        client.delete(f"{p}job:{ids[0]}")
        assert sorted(j.id for j in await store.jobs_list(state=JobState.RUNNING)) == ids[1:]
        store.clock.advance(10)
        report = await store.jobs_rescue()
        assert sorted(report.requeued) == ids[1:]
        assert client.zscore(f"{p}running", f"{ids[0]:015d}") is None
        assert client.get(f"{p}dropped_n") == "1"
        assert f"{p}job:{ids[0]}" in caplog.text
        again = await store.jobs_claim(owner="w2", queues=["q"], limit=10, ttl=5)
        assert sorted(c.job.id for c in again) == ids[1:]
    finally:
        await store.close()
        client.close()


@pytest.mark.parametrize(
    ("field", "value"), [("attempt", "x"), ("lease_token", ""), ("state", "lost")]
)
async def test_a_job_hash_with_one_field_corrupted_is_moved_aside(
    redis_url: str, redis_server: str, field: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One field of one queued job's hash overwritten: listings skip that job with a
    warning naming its key, claims hand out every other job (the damaged one is moved
    to ``bad:<id>`` for inspection, never half-claimed), and job_get says what is wrong."""
    from tokenline._errors import JobNotFoundError

    store, client, ids = await _damaged_store(redis_url, redis_server, n=5)
    p = store.prefix
    bad = ids[0]
    try:
        client.hset(f"{p}job:{bad}", field, value)
        listed = await store.jobs_list()
        assert sorted(j.id for j in listed) == ids[1:]
        assert f"{p}job:{bad}" in caplog.text
        with pytest.raises(JobNotFoundError, match="malformed"):
            await store.job_get(job_id=bad)
        claimed = await store.jobs_claim(owner="w", queues=["q"], limit=5, ttl=60)
        claimed += await store.jobs_claim(owner="w", queues=["q"], limit=5, ttl=60)
        assert sorted(c.job.id for c in claimed) == ids[1:]
        assert client.exists(f"{p}bad:{bad}")
        assert not client.exists(f"{p}job:{bad}")
        assert client.hget(f"{p}bad:{bad}", field) == value
        assert client.get(f"{p}dropped_n") == "1"
    finally:
        await store.close()
        client.close()


async def test_a_running_job_with_a_corrupted_token_does_not_stop_the_rescue(
    redis_url: str, redis_server: str
) -> None:
    """A running job's token overwritten with text: the rescue of every other expired
    job goes on (it used to raise on int('') on every pass)."""
    store, client, ids = await _damaged_store(redis_url, redis_server, n=3)
    p = store.prefix
    try:
        await store.jobs_claim(owner="w", queues=["q"], limit=3, ttl=5)
        client.hset(f"{p}job:{ids[1]}", "lease_token", "")
        store.clock.advance(10)
        report = await store.jobs_rescue()
        assert sorted(report.requeued) == [ids[0], ids[2]]
        assert client.exists(f"{p}bad:{ids[1]}")
        assert await store.jobs_rescue() == type(report)()
    finally:
        await store.close()
        client.close()


async def test_a_unique_key_held_by_a_job_whose_hash_is_gone_is_released(
    redis_url: str, redis_server: str
) -> None:
    """An ``active`` unique key whose job hash vanished keeps no new job out."""
    import redis

    from tokenline._jobs import Unique

    store = RedisStore(redis_url)
    await store.open()
    client: Any = redis.Redis.from_url(redis_server)
    try:
        job = NewJob(queue="q", task="t", args="[]", idempotency_key="k", unique=Unique.ACTIVE)
        (first,) = await store.jobs_enqueue(jobs=[job])
        assert await store.jobs_enqueue(jobs=[job]) == [first]
        client.delete(f"{store.prefix}job:{first}")
        (second,) = await store.jobs_enqueue(jobs=[job])
        assert second != first
    finally:
        await store.close()
        client.close()


@pytest.fixture
def own_redis(redis_server_binary: str, tmp_path: Path) -> Iterator[int]:
    """A ``redis-server`` of this test's own on a free loopback port (its memory
    settings are the test's to change); killed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    args = [
        redis_server_binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(tmp_path),
        "--logfile", str(tmp_path / "redis.log"),
    ]  # fmt: skip
    proc = subprocess.Popen(args)
    try:
        client = redis.Redis(port=port, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_an_evicting_memory_policy_is_warned_of_and_fails_the_status_probe(
    own_redis: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis with a maxmemory and an evicting policy deleted job hashes and a whole
    queue's index under pressure, and nothing said so: its workers sat idle beside
    a full queue. Connecting now warns, and status's broker probe fails, naming the
    policy; without a maxmemory the policy never applies and nothing is said."""
    client = redis.Redis(port=own_redis, socket_timeout=5)
    store = RedisStore(f"redis://127.0.0.1:{own_redis}/0")
    client.config_set("maxmemory-policy", "allkeys-lru")
    await store.connect()
    try:
        await store.broker_write_probe(1.0)  # no maxmemory: nothing to say
        client.config_set("maxmemory", str(64 * 1024 * 1024))
        with caplog.at_level(logging.WARNING, logger="tokenline.store.redis"):
            await store.close()
            await store.connect()
        assert "maxmemory-policy allkeys-lru" in caplog.text
        with pytest.raises(StoreError, match="evicts keys under memory pressure"):
            await store.broker_write_probe(1.0)
        client.config_set("maxmemory-policy", "noeviction")
        await store.broker_write_probe(1.0)
    finally:
        await store.close()


async def test_a_full_redis_fails_the_status_probe_though_reads_answer(own_redis: int) -> None:
    """With noeviction, a Redis at its maxmemory refuses every write while reads
    answer: status said the broker was ok while claims and renewals failed."""
    client = redis.Redis(port=own_redis, socket_timeout=5)
    client.config_set("maxmemory-policy", "noeviction")
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 256 * 1024))
    with contextlib.suppress(redis.ResponseError):  # fill it: OOM ends the loop
        for i in range(10_000):
            client.set(f"filler:{i}", b"x" * 4096)
    store = RedisStore(f"redis://127.0.0.1:{own_redis}/0?prefix=full")
    await store.connect()
    try:
        assert await store.queues_stats() == []  # a read answers
        with pytest.raises(StoreError, match="is full"):
            await store.broker_write_probe(1.0)
    finally:
        await store.close()


async def test_a_tls_url_to_a_plain_server_suggests_tls(redis_server: str) -> None:
    """rediss:// against a server without TLS never completes the handshake: the
    error said only that the server did not answer, with no hint of TLS."""
    host, _, port = redis_server.partition("//")[2].partition("/")[0].rpartition(":")
    store = RedisStore(f"rediss://{host}:{port}/0?socket_connect_timeout=1&socket_timeout=1")
    with pytest.raises(StoreUnavailableError, match=r"with TLS on \(the URL is rediss://\)"):
        await store.connect()
    await store.close()
