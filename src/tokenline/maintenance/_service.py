"""What every maintenance service looks like to the leader that runs it.

A service is small: a name, an interval, counters, and :meth:`Service.run_once`, which
tests call directly. The leader (see ``leader.py``) runs each service on its own interval
while it holds the maintenance lease, and passes that lease in: every write a service
makes is fenced by it (the store checks, in the same transaction, that ``leader`` still
holds the maintenance lease with the same token), so a deposed leader's write is refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..stores.base import ResourceLease

__all__ = ["Service", "ServiceReport"]


@dataclass(slots=True)
class ServiceReport:
    """What one ``run_once`` found and did (or, with ``dry_run``, would do).

    ``counts``: how many of each kind (``rescued``, ``effect_pending_expired``,
    ``jobs_pruned``, …); ``lines``: one human-readable line per repair, for logs (as
    warnings) and the CLI; ``routine``: one line per piece of expected work (a periodic
    job enqueued, old rows pruned), logged as information; ``refused``: the run stopped
    because a newer leader exists.
    """

    service: str
    dry_run: bool = False
    counts: Counter[str] = field(default_factory=Counter)
    lines: list[str] = field(default_factory=list)
    routine: list[str] = field(default_factory=list)
    refused: bool = False

    @property
    def total(self) -> int:
        """How many repairs (or would-be repairs) of every kind."""
        return sum(self.counts.values())


@runtime_checkable
class Service(Protocol):
    """A maintenance service: run by the leader every ``interval`` seconds."""

    #: Short and stable: used in logs, metrics labels and ``tokenline maintenance``.
    name: str
    #: Seconds between two runs (validated > 0 where the service is configured).
    interval: float
    #: Totals since the service was made, per kind, for metrics and status.
    counters: Counter[str]

    async def run_once(
        self, *, leader: ResourceLease | None, dry_run: bool = False
    ) -> ServiceReport:
        """One pass. ``leader`` fences every write; ``None`` only with ``dry_run``,
        which reads and reports but changes nothing."""
        ...
