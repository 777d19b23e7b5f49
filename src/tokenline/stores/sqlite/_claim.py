"""Which rows a claim chooses from, per queue, with priority aging: a bounded read.

A claim ranks runnable jobs by :func:`tokenline._jobs.claim_key`: effective priority
(its own, plus a point per ``aging`` seconds since its ``run_at``), then ``run_at``,
then id. Ranking every runnable job by it would read the whole backlog on every
claim; this reads, per queue, at most ``limit`` rows per priority present in a narrow
band, each by an ordered index scan:

1. the best ``limit`` by priority alone (``tokenline_jobs_ready``, as without aging);
   with fewer, every runnable job of the queue is among them and nothing else is read;
2. the age of the queue's oldest ready job (``tokenline_jobs_ready_age``): no job has
   aged by more than ``reach`` points;
3. for each priority present from ``lowest`` (the lowest among step 1's rows) down to
   ``lowest - reach``: its ``limit`` oldest runnable jobs.

Why the best ``limit`` are always among these rows. Take a job J of priority p among
the best ``limit``. If p > ``lowest``, step 1 read every job of priority p. If p lies
in the band, step 3 read the ``limit`` oldest of priority p; within one priority the
older job ranks first, so had J been left out, ``limit`` jobs would rank above it. If
p < ``lowest - reach``, J's effective priority is below ``lowest``, and the ``limit``
rows of step 1 all have at least ``lowest``: J is not among the best. With no job old
enough to gain a point (``reach`` 0), step 1 alone is the answer, read as before.

PostgreSQL's ``claim`` query reads the same rows in one statement.
"""

from __future__ import annotations

import sqlite3

from ..._jobs import effective_priority
from .._sql import load_queries

__all__ = ["claim_candidates"]

Q = load_queries(__name__.rpartition(".")[0])


def claim_candidates(
    conn: sqlite3.Connection, *, queue: str, now: float, limit: int, aging: float | None
) -> list[sqlite3.Row]:
    """The rows ``(id, priority, run_at, lease_token)`` of ``queue`` that the best
    ``limit`` by effective priority are among (see the module docstring); none for a
    paused queue."""
    params = {"queue": queue, "now": now, "limit": limit}
    found: list[sqlite3.Row] = conn.execute(Q["claim_candidates"], params).fetchall()
    if aging is None or len(found) < limit:
        return found
    oldest = conn.execute(Q["claim_oldest"], params).fetchone()
    # More points than the whole range of priorities would reach no further.
    reach = 0 if oldest is None else min(effective_priority(0, oldest[0], now, aging), 2**32)
    if reach <= 0:
        return found
    level: int | None = found[-1][1]
    lowest = found[-1][1] - reach
    seen = {r[0] for r in found}
    while level is not None:
        for row in conn.execute(Q["claim_level"], {**params, "priority": level}):
            if row[0] not in seen:
                seen.add(row[0])
                found.append(row)
        below = {**params, "below": level, "lowest": lowest}
        nxt = conn.execute(Q["claim_next_level"], below).fetchone()
        level = None if nxt is None else nxt[0]
    return found
