"""Which rows a claim chooses from, per queue, with priority aging: a bounded read.

A claim ranks runnable jobs by :func:`tokenline._jobs.claim_key`: effective priority
(its own, plus a point per ``aging`` seconds since its ``run_at``), then ``run_at``,
then id. Ranking every runnable job by it would read the whole backlog on every
claim; this reads, per queue, at most ``limit`` rows per priority present in a narrow
band, each by an ordered index scan:

1. the best ``limit`` by priority alone (``tokenline_jobs_ready``, as without aging);
   with fewer, every runnable job of the queue is among them and nothing else is read.
   The index is read in order, runnable or not, for a window of ``2 * limit + 32``
   entries; when the window holds fewer than ``limit`` runnable jobs and the queue goes
   on past it, jobs not yet runnable (delayed, or backing off) fill the top of the
   index, and the read goes on a priority at a time: the rest of the window's last
   priority, then each lower priority present (one seek), each read as one index range
   of its runnable jobs. A backlog of jobs not yet runnable at a higher priority is
   stepped over a priority at a time, never a job at a time;
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

PostgreSQL's ``claim`` query reads the same runnable rows in one statement. Its step 1
(``runnable_jobs``, migration 0012) reads a priority at a time: a seek per priority
present, then that priority's runnable jobs as one index range, with no window first.
"""

from __future__ import annotations

import sqlite3

from ..._jobs import effective_priority
from .._sql import load_queries

__all__ = ["claim_candidates"]

Q = load_queries(__name__.rpartition(".")[0])


#: Below any priority, and before any run_at and id: the start of a priority's range.
_BOTTOM = float("-inf")


def _window(limit: int) -> int:
    """Entries of the ready index claim_candidates reads before it goes on a priority at
    a time: room for the runnable jobs wanted and a few not yet runnable among them."""
    return 2 * limit + 32


def _best_by_priority(
    conn: sqlite3.Connection, params: dict[str, object], limit: int
) -> list[sqlite3.Row]:
    """The best ``limit`` runnable jobs of the queue by priority alone, in order (step 1
    of the module docstring)."""
    window = _window(limit)
    found: list[sqlite3.Row] = conn.execute(
        Q["claim_candidates"], {**params, "window": window}
    ).fetchall()
    if len(found) >= limit:
        return found
    end = conn.execute(Q["claim_window_end"], {**params, "window": window}).fetchone()
    if end is None:
        return found  # the window held the whole queue (or the queue is paused)
    level: int | None = end[0]
    after = (end[1], end[2])
    while level is not None and len(found) < limit:
        found += conn.execute(
            Q["claim_level"],
            {
                **params,
                "priority": level,
                "after_run_at": after[0],
                "after_id": after[1],
                "limit": limit - len(found),
            },
        ).fetchall()
        after = (_BOTTOM, _BOTTOM)
        below = {**params, "below": level, "lowest": _BOTTOM}
        nxt = conn.execute(Q["claim_next_level"], below).fetchone()
        level = None if nxt is None else nxt[0]
    return found


def claim_candidates(
    conn: sqlite3.Connection, *, queue: str, now: float, limit: int, aging: float | None
) -> list[sqlite3.Row]:
    """The rows ``(id, priority, run_at, lease_token)`` of ``queue`` that the best
    ``limit`` by effective priority are among (see the module docstring); none for a
    paused queue."""
    params: dict[str, object] = {"queue": queue, "now": now, "limit": limit}
    found = _best_by_priority(conn, params, limit)
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
    start = {"after_run_at": _BOTTOM, "after_id": _BOTTOM}
    while level is not None:
        for row in conn.execute(Q["claim_level"], {**params, **start, "priority": level}):
            if row[0] not in seen:
                seen.add(row[0])
                found.append(row)
        below = {**params, "below": level, "lowest": lowest}
        nxt = conn.execute(Q["claim_next_level"], below).fetchone()
        level = None if nxt is None else nxt[0]
    return found
