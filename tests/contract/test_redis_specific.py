"""The Redis store's own rules: its scripts document themselves, a bad URL or an
unreachable server is a clear error, and each test's keys stay under its prefix."""

from __future__ import annotations

import socket
from importlib import resources
from typing import Any

import pytest

from tokenline._errors import ConfigError, StoreUnavailableError
from tokenline._jobs import NewJob
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
