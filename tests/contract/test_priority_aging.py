"""Priority aging in the claim: every store ranks runnable jobs by effective priority
(their own plus a point per ``priority_aging`` seconds waited, by the store's clock),
and reads a bounded number of rows to do it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pg_plans import blocks_touched, generic_plan, rows_read_from
from tokenline._clock import FakeClock
from tokenline._jobs import Finish, NewJob, Outcome, claim_key

Q = ["default"]


def new(priority: int = 0, queue: str = "default") -> NewJob:
    return NewJob(queue=queue, task="t", args="[]", priority=priority)


async def enqueue(store: Any, priority: int = 0, queue: str = "default") -> int:
    (jid,) = await store.jobs_enqueue(jobs=[new(priority, queue)])
    return int(jid)


async def claim(store: Any, limit: int, aging: float | None, queues: Any = Q) -> list[int]:
    got = await store.jobs_claim(
        owner="w", queues=queues, limit=limit, ttl=60, priority_aging=aging
    )
    return [c.job.id for c in got]


async def test_a_stream_of_high_priority_jobs_starves_an_old_job_without_aging_only(
    store: Any, clock: FakeClock
) -> None:
    """With aging of 1 s, a priority-0 job is claimed once it has waited 5 s, ahead of
    the priority-5 job enqueued that second (equal effective priority: the older
    first); without aging the same stream, one fresh job per claim, keeps it waiting
    for good."""
    for aging, queue in ((1.0, "aged"), (None, "strict")):
        old = await enqueue(store, 0, queue)
        order = []
        for _ in range(8):
            clock.advance(1)
            await enqueue(store, 5, queue)
            (got,) = await claim(store, 1, aging, [queue])
            order.append("old" if got == old else "high")
        if aging is None:
            assert order == ["high"] * 8
        else:
            assert order == ["high"] * 4 + ["old"] + ["high"] * 3


async def test_jobs_that_waited_less_than_the_aging_keep_their_priority_order(
    store: Any, clock: FakeClock
) -> None:
    """Aging changes nothing for jobs that have not waited ``priority_aging`` yet: the
    claim is by priority, then run_at, then id, exactly as without aging."""
    low = await enqueue(store, 0)
    clock.advance(59)
    high = await enqueue(store, 5)
    mid = await enqueue(store, 1)
    mid2 = await enqueue(store, 1)
    assert await claim(store, 10, 60.0) == [high, mid, mid2, low]


async def test_each_full_aging_period_is_one_priority_point(store: Any, clock: FakeClock) -> None:
    """A priority-1 job that waited two periods outranks a fresh priority-2 job; one that
    waited 1.9 periods only equals it, and then the older goes first; a priority-1 job
    that waited 0.9 of a period stays behind the priority-2 job."""
    two = await enqueue(store, 1)
    clock.advance(0.1)
    one_nine = await enqueue(store, 1)
    clock.advance(1.0)
    zero_nine = await enqueue(store, 1)
    clock.advance(0.9)
    fresh = await enqueue(store, 2)
    # effective now: two -> 3, one_nine -> 2, zero_nine -> 1, fresh -> 2
    assert await claim(store, 4, 1.0) == [two, one_nine, fresh, zero_nine]


async def test_an_aged_job_is_found_below_many_fresh_jobs_of_higher_priorities(
    store: Any, clock: FakeClock
) -> None:
    """The bounded read still finds the best jobs: an old job of a middle priority and
    an older one of the lowest priority rise above a crowd of fresh higher-priority jobs
    that alone would fill the claim."""
    mid_old = await enqueue(store, 5)
    low_old = await enqueue(store, 0)
    clock.advance(8.5)
    await store.jobs_enqueue(jobs=[new(5) for _ in range(20)])
    clock.advance(0.5)
    top = await store.jobs_enqueue(jobs=[new(10) for _ in range(3)])
    # effective: mid_old 5 + 9 = 14, top 10, low_old 9, the fresh fives 5
    assert await claim(store, 5, 1.0) == [mid_old, *top, low_old]


async def test_older_jobs_of_the_lowest_priority_read_first_count_too(
    store: Any, clock: FakeClock
) -> None:
    """When the jobs read by priority alone end inside a priority, the older jobs of
    that priority left out of that read can still outrank the ones above them."""
    first, second = await store.jobs_enqueue(jobs=[new(5), new(5)])
    clock.advance(9)
    top = await enqueue(store, 10)
    # by priority alone: top, first; effective: first 14, second 14, top 10
    assert await claim(store, 2, 1.0) == [first, second]
    assert await claim(store, 2, 1.0) == [top]


async def test_a_rescued_job_keeps_its_place_with_aging(store: Any, clock: FakeClock) -> None:
    """A job whose worker lost its lease goes back with its run_at: with aging, it is
    claimed before a job of its priority enqueued after it, and before a fresher job of
    a priority its wait has overtaken."""
    first = await enqueue(store, 0)
    (lost,) = await claim(store, 1, 1.0)
    assert lost == first
    clock.advance(61)
    report = await store.jobs_rescue()
    assert list(report.requeued) == [first]
    later = await enqueue(store, 0)
    higher = await enqueue(store, 30)
    assert await claim(store, 3, 1.0) == [first, higher, later]


async def test_aging_never_claims_from_a_paused_queue_or_an_unrequested_one(
    store: Any, clock: FakeClock
) -> None:
    """Aging ranks jobs, it does not widen the claim: a paused queue and a queue not
    asked for give nothing, however long their jobs have waited."""
    await enqueue(store, 0, "paused")
    await enqueue(store, 0, "other")
    await store.queue_pause(queue="paused")
    clock.advance(3600)
    assert await claim(store, 5, 1.0, ["paused"]) == []
    await store.queue_resume(queue="paused")
    assert len(await claim(store, 5, 1.0, ["paused"])) == 1


async def claims_follow_ranking(
    store: Any, clock: FakeClock, rng: random.Random, jobs: dict[int, tuple[int, float]],
    aging: float | None, queues: list[str], sizes: tuple[int, int], *, step: float,
) -> None:  # fmt: skip
    """Claim after claim of random sizes (``sizes``), the clock moved on by up to
    ``step`` seconds before each, until every job of ``jobs`` (id: priority, run_at) is
    claimed: each claim takes the best runnable jobs of a ranking of all, in order."""
    while jobs:
        clock.advance(rng.uniform(0, step))
        now = clock.now()
        limit = rng.randint(*sizes)
        ranked = sorted(
            (jid for jid, (_, at) in jobs.items() if at <= now),
            key=lambda jid: claim_key(jobs[jid][0], jobs[jid][1], jid, now, aging),
        )
        got = await claim(store, limit, aging, queues)
        assert got == ranked[:limit]
        for jid in got:
            del jobs[jid]


@pytest.mark.parametrize(
    ("seed", "sizes", "count"),
    [(0, (1, 7), 60), (1, (1, 7), 60), (2, (1, 7), 60), (3, (1, 7), 60),
     # Claims above 16 jobs, and across that bound (see with_claim_limit).
     (4, (17, 40), 300), (5, (14, 70), 300)],
)  # fmt: skip
async def test_claims_match_ranking_every_runnable_job(
    store: Any, clock: FakeClock, seed: int, sizes: tuple[int, int], count: int
) -> None:
    """Against a ranking of every runnable job by effective priority, claim after claim
    of random sizes over two queues, with a few priorities, ages and scheduled jobs: the
    stores' bounded reads pick the same jobs in the same order."""
    rng = random.Random(seed)
    aging = rng.choice([0.5, 1.0, 3.0])
    queues = ["a", "b"]
    jobs: dict[int, tuple[int, float]] = {}
    for _ in range(count):
        delay = rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 15)])
        job = NewJob(
            queue=rng.choice(queues), task="t", args="[]", priority=rng.randint(-3, 3),
            delay=delay or None,
        )  # fmt: skip
        (jid,) = await store.jobs_enqueue(jobs=[job])
        jobs[jid] = (job.priority, clock.now() + delay)
        clock.advance(rng.uniform(0, 0.7))
    await claims_follow_ranking(store, clock, rng, jobs, aging, queues, sizes, step=2.0)


@pytest.mark.parametrize("aging", [None, 2.0])
@pytest.mark.parametrize("seed", [10, 11, 12])
async def test_claims_match_ranking_under_later_jobs_of_higher_priority(
    store: Any, clock: FakeClock, seed: int, aging: float | None
) -> None:
    """Jobs not yet runnable (delayed), many and of higher priorities than the runnable
    ones, fill the top of the ready index: claim after claim of random sizes, as they
    come due, every store still picks the runnable jobs in ranking order (SQLite steps
    over the later ones a priority at a time, past a window of the index)."""
    rng = random.Random(seed)
    queues = ["a", "b"]
    batch = []
    for _ in range(400):
        later = rng.random() < 0.7
        batch.append(
            NewJob(
                queue=rng.choice(queues), task="t", args="[]",
                priority=rng.randint(3, 8) if later else rng.randint(-2, 4),
                delay=rng.uniform(20, 60) if later else rng.choice([None, rng.uniform(0, 5)]),
            )
        )  # fmt: skip
    now = clock.now()
    ids = await store.jobs_enqueue(jobs=batch)
    jobs = {jid: (j.priority, now + (j.delay or 0.0)) for jid, j in zip(ids, batch, strict=True)}
    await claims_follow_ranking(store, clock, rng, jobs, aging, queues, (1, 30), step=3.0)


async def fill_under_later_jobs(store: Any, later: int, *, runnable_among: int = 0) -> None:
    """``later`` jobs of priority 5 delayed an hour, ``runnable_among`` runnable ones of
    priority 5 (as retries that came due), then 200 runnable of priorities 0-2."""
    for _ in range(later // 1000):
        await store.jobs_enqueue(
            jobs=[NewJob("default", "t", "[]", priority=5, delay=3600) for _ in range(1000)]
        )
    if runnable_among:
        await store.jobs_enqueue(jobs=[new(5) for _ in range(runnable_among)])
    await store.jobs_enqueue(jobs=[new(p % 3) for p in range(200)])


@pytest.mark.parametrize("runnable_among", [0, 1])
async def test_a_sqlite_claim_steps_over_later_jobs_a_priority_at_a_time(
    tmp_path: Any, runnable_among: int
) -> None:
    """The work of a SQLite claim (the database engine's steps) stays nearly the same
    whether 1,000 or 20,000 delayed jobs of a higher priority sit above the runnable
    ones, with or without a runnable one among them: they are stepped over a priority
    at a time, not a job at a time."""
    import sqlite3

    from tokenline.stores.sqlite import SQLiteStore
    from tokenline.stores.sqlite._claim import claim_candidates

    steps = {}
    for later in (1_000, 20_000):
        path = tmp_path / f"later-{later}.db"
        clock = FakeClock()
        store = SQLiteStore(f"sqlite:///{path}", clock=clock)
        await store.open()
        try:
            await fill_under_later_jobs(store, later, runnable_among=runnable_among)
        finally:
            await store.close()
        conn = sqlite3.connect(path)
        try:
            count = [0]

            def tick(count: list[int] = count) -> int:
                count[0] += 1
                return 0

            conn.set_progress_handler(tick, 100)
            for aging in (None, 60.0):
                rows = claim_candidates(
                    conn, queue="default", now=clock.now(), limit=50, aging=aging
                )
                assert len(rows) == 50
                assert all(r[2] <= clock.now() for r in rows)
            steps[later] = count[0]
        finally:
            conn.close()
    assert steps[20_000] < 2 * steps[1_000], steps


@pytest.mark.postgres
@pytest.mark.parametrize("runnable_among", [0, 1])
async def test_a_postgres_claim_steps_over_later_jobs_a_priority_at_a_time(
    postgres_server: str, admin: Any, clock: FakeClock, runnable_among: int
) -> None:
    """The blocks a PostgreSQL claim of two jobs touches stay nearly the same whether
    1,000 or 20,000 delayed jobs of a higher priority sit above the runnable ones: they
    are stepped over a priority at a time, not a job at a time. Also with a runnable
    job among them, which the claim takes before reading on below them. With one
    among them, a scan that stepped over each delayed job of the priorities it read
    touched 45 blocks under 1,000 and 163 under 20,000 (49 and 52 now)."""
    import secrets

    from psycopg import sql

    from tokenline.stores.postgres import PostgresStore

    touched = {}
    for later in (1_000, 20_000):
        schema = f"tl_test_{secrets.token_hex(6)}"
        store = PostgresStore(f"{postgres_server}?schema={schema}", clock=clock)
        await store.open()
        try:
            await fill_under_later_jobs(store, later, runnable_among=runnable_among)
            await admin.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
            for aging in (None, 60.0):
                params = store._claim_params("w", ["default"], 2, 60.0, aging)
                # The second run: the first also reads the catalogs for the session.
                for _ in range(2):
                    touched[later, aging] = await blocks_touched(
                        admin, store._claim_text(2), params
                    )
        finally:
            await store.close()
            await admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
    for aging in (None, 60.0):
        assert touched[20_000, aging] < 2 * touched[1_000, aging], touched


# -- the claim stays an index read ------------------------------------------------------------
@pytest.mark.postgres
async def test_postgres_claim_with_aging_reads_jobs_only_through_indexes(
    postgres_url: str, admin: Any, postgres_schema: str, clock: FakeClock
) -> None:
    """With 10,000 queued jobs of five priorities in one queue, old enough that aging
    walks every priority, the claim's plan reads the jobs table through its indexes
    only: no sequential scan of jobs, whatever the backlog."""
    from tokenline.stores.postgres import PostgresStore

    store = PostgresStore(postgres_url, clock=clock)
    await store.open()
    try:
        for _ in range(10):
            await store.jobs_enqueue(jobs=[new(i % 5) for i in range(1000)])
            clock.advance(30)
        await admin.execute(f'ANALYZE "{postgres_schema}".jobs')
        params = {
            "owner": "w",
            "queues": ["default"],
            "limit": 10,
            "ttl": 60,
            "aging": 1.0,
            "now": clock.now(),
        }
        cur = await admin.execute("EXPLAIN " + store._claim_text(10), params)
        plan = "\n".join(row[0] for row in await cur.fetchall())
        assert "Seq Scan on jobs" not in plan, plan
        # In the order of the indexes: by priority, and by age for the oldest job.
        assert "Index Scan using jobs_ready on jobs" in plan, plan
        assert "jobs_ready_age on jobs" in plan, plan
        # The plan the server keeps for every call of a small claim (a generic plan,
        # made without the parameters' values), alone and fused with a finish.
        for limit, fused in ((1, False), (10, False), (10, True)):
            plan = await generic_plan(admin, store._claim_text(limit, fused=fused))
            assert "Seq Scan on jobs" not in plan, (limit, fused, plan)
            assert "Index Scan using jobs_ready on jobs" in plan, (limit, fused, plan)
        assert len(await claim(store, 10, 1.0)) == 10
    finally:
        await store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("statistics", ["never analyzed", "analyzed while the queue was empty"])
@pytest.mark.parametrize("aging", [None, 1.0])
async def test_postgres_claim_reads_its_limit_not_a_burst_the_statistics_miss(
    postgres_url: str, admin: Any, postgres_schema: str, clock: FakeClock,
    statistics: str, aging: float | None,
) -> None:  # fmt: skip
    """A burst of 40,000 jobs lands on a table whose statistics say the queue is empty:
    every read of the jobs table in the claim's plan, the one made for the call and the
    one the server keeps, returns at most the claim's limit of rows. The index on age
    alone, smaller than jobs_ready and so costed cheaper once jobs_ready has grown a
    level, made the claim read and sort the whole burst on every call."""
    from tokenline.stores.postgres import PostgresStore

    store = PostgresStore(postgres_url, clock=clock)
    await store.open()
    try:
        if statistics != "never analyzed":
            await store.jobs_enqueue(jobs=[new() for _ in range(500)])
            done = await store.jobs_claim(owner="w", queues=Q, limit=500, ttl=60)
            await store.jobs_finish(finishes=[Finish(c.lease, Outcome.SUCCEEDED) for c in done])
            await admin.execute(f'ANALYZE "{postgres_schema}".jobs')
        for _ in range(4):
            await store.jobs_enqueue(jobs=[new(i % 3) for i in range(10_000)])
            clock.advance(30)
        limit = 10
        params = {
            "owner": "w", "queues": Q, "limit": limit, "ttl": 60, "aging": aging,
            "now": clock.now(),
        }  # fmt: skip
        for text in (store._claim_text(limit), store._claim_text(100)):
            for generic in (False, True):
                reads = await rows_read_from(admin, text, params, table="jobs", generic=generic)
                assert reads, (generic, text)
                assert all(rows <= limit for _, rows in reads), (generic, reads)
        assert len(await claim(store, limit, aging)) == limit
    finally:
        await store.close()


async def test_sqlite_claim_queries_read_jobs_only_through_indexes(tmp_path: Any) -> None:
    """Each query of the SQLite claim searches the jobs table by an index, in the
    index's order (its query plan has no full scan and no sort), so aging adds seeks,
    never a pass over the backlog."""
    import sqlite3

    from tokenline.stores.sqlite import SQLiteStore
    from tokenline.stores.sqlite._claim import Q as CLAIM_Q

    path = tmp_path / "plan.db"
    store = SQLiteStore(f"sqlite:///{path}", clock=FakeClock())
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    try:
        params = {
            "queue": "q", "now": 0.0, "limit": 5, "priority": 1, "below": 1, "lowest": 0,
            "window": 42, "after_run_at": 0.0, "after_id": 0,
        }  # fmt: skip
        names = (
            "claim_candidates", "claim_window_end", "claim_oldest", "claim_next_level",
            "claim_level",
        )  # fmt: skip
        for name in names:
            plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + CLAIM_Q[name], params)]
            on_jobs = [step for step in plan if "tokenline_jobs " in f"{step} "]
            assert on_jobs, (name, plan)
            assert all(step.startswith("SEARCH") and "INDEX" in step for step in on_jobs), (
                name,
                plan,
            )
            # A sort would mean reading every match before the first row.
            assert not any("TEMP B-TREE" in step for step in plan), (name, plan)
    finally:
        conn.close()
