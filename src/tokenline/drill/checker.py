"""The drill's invariant checker: the guarantees, read back from the store alone.

After a run, :func:`read_snapshot` reads the jobs, their attempts, the stale commits the
store refused, the ledger's duplicates and the drill's business rows (one per effect,
with the key and the writing token); :func:`check` then verifies, without trusting
anything the workers said:

1. **no lost job**: every enqueued key has a job that is ``succeeded``, ``dead`` with a
   reason, ``cancelled`` or still visibly pending; a ``succeeded`` job has its effect.
2. **once per key**: at most one business row per key (extras are duplicate effects).
3. **fenced commits**: the business row was written by the job's newest token, which is
   the token of its one succeeded attempt; no job has two succeeded attempts.
4. **monotonic states**: attempt tokens increase with their start times, and no attempt
   starts after the job's success.
5. **ownership expires**: every attempt whose lease expired was rescued within lease TTL
   + rescue period + :data:`SLACK` of the moment its owner stopped renewing (its start
   or the fault, whichever is later; the fault's end when it hit every worker, since no
   one can rescue during it).
6. **no early rescue**: only a worker the fault hit may lose a lease. A lease rescued
   from any other worker was taken from a live owner — by a rescuer whose clock ran
   ahead, say — and is a violation (checked when the runner names the workers hit).
7. In scenarios that ask for it (``clock_skew``), **every worker works**: a worker that
   never started an attempt (one whose clock ran behind, say) is a violation.
8. When the jobs call a dependency behind its circuit breaker (``slow_dependency``),
   **no job is dead-lettered**, and **a job held back spends no attempt**: each job's
   attempt count is at most the number of its attempts that ran (those not given back).

9. When the workers run a periodic schedule (the ``periodic_*`` scenarios), **every
   instant runs exactly once**: from the first instant enqueued to the last one whose job
   (and every earlier one's) is finished, each instant of the schedule has exactly one
   job and one business row — none twice (*doubled*), none without (*skipped*); and
   **the schedule keeps up**: each instant was enqueued within the leader's election
   bound + the scheduler's period + :data:`SLACK` of its time, and every instant due
   that long before the run ended was enqueued (else *late*).

10. On the split topology, :func:`check_status` holds what ``tokenline status`` said
    during the fault, run as the struck worker, to what the scenario declares
    (:class:`~.scenarios.StatusExpectation`): each channel expected failing is named
    failing, with the server that plays it in its error (``Redis at …``, ``PostgreSQL
    …``); a channel that may fail names its server if it does; every other channel is
    ok. A channel blamed falsely, one not blamed, a server not named, or no report at
    all is a violation (*status wrong*).

It also measures the **recovery time** (fault injection → the affected jobs running
again, from attempt timestamps) and counts **duplicate executions**, which are allowed:
re-runs, stale commits the store refused, duplicates the ledger recorded.
"""

from __future__ import annotations

import collections
import datetime as dt
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..stores.base import Role

if TYPE_CHECKING:
    from .._periodic import Periodic
    from ._scratch import ScratchStore
    from .scenarios import StatusExpectation

__all__ = [
    "SLACK",
    "Attempt",
    "ChannelSeen",
    "FaultWindow",
    "Report",
    "Snapshot",
    "StatusSeen",
    "check",
    "check_status",
    "read_snapshot",
]

#: Seconds allowed on top of TTL + rescue period: the leadership lease may sit with the
#: faulted worker and expire first (one more TTL is added for that), polling periods,
#: store timeouts and scheduling on a busy machine.
SLACK = 2.0

_FINAL = frozenset({"succeeded", "dead", "cancelled"})
_PENDING = frozenset({"scheduled", "queued", "running"})
#: How many violations a report keeps verbatim (the counts are always complete).
_KEEP = 10


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt row: who ran the job with which token, when, and how it ended."""

    job_id: int
    token: int
    started_at: float
    finished_at: float | None
    outcome: str | None
    owner: str = ""

    @property
    def pid(self) -> int | None:
        """The process id in the owner's name (``host-pid-suffix``), if it has one."""
        parts = self.owner.rsplit("-", 2)
        return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the store says after a run; the checker's only input."""

    #: job id → (idempotency key, state, newest token, last error)
    jobs: dict[int, tuple[str | None, str, int, str | None]]
    attempts: list[Attempt]
    #: (key, job id, token) of every business row
    effects: list[tuple[str, int, int]]
    stale_refused: int
    ledger_duplicates: int
    #: job id → attempts spent, as the job's row counts them (given-back ones refunded)
    spent: dict[int, int] = field(default_factory=dict)
    #: (job id, idempotency key, state, enqueued at) of every periodic schedule's job
    periodic: list[tuple[int, str, str, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FaultWindow:
    """When the fault of a run was on (epoch seconds), and whether it hit every worker."""

    start: float
    end: float
    all_workers: bool = False


@dataclass
class Report:
    """The verdict on one run, with the figures behind it."""

    jobs: int
    lost: int = 0
    duplicate_effects: int = 0
    stale_writes: int = 0
    backwards: int = 0
    late_recoveries: int = 0
    #: Leases rescued from workers the fault did not hit.
    early_rescues: int = 0
    #: Workers (that had to work) which never started an attempt.
    idle_workers: int = 0
    #: Jobs dead-lettered where none may be (behind a dependency's breaker).
    dead_letters: int = 0
    #: Attempts spent by jobs a dependency's breaker held back.
    spent_by_deferrals: int = 0
    pending: int = 0
    stale_refused: int = 0
    ledger_duplicates: int = 0
    reexecutions: int = 0
    #: Jobs whose attempt the fault cut short.
    affected: int = 0
    #: Longest fault → running-again delay over the affected jobs (``None``: none).
    recovery: float | None = None
    #: The bound expired leases were held to.
    recovery_bound: float = 0.0
    #: Longest delay from an owner's last chance to renew to the rescue of its lease.
    rescue_lag: float | None = None
    #: A periodic schedule's instants judged (first to last finished; ``None``: the run
    #: had no schedule), those run twice, those never run, those enqueued late.
    periodic_instants: int | None = None
    periodic_doubled: int = 0
    periodic_skipped: int = 0
    periodic_late: int = 0
    #: Longest delay from an instant to its enqueue, and the bound it was held to.
    periodic_lag: float | None = None
    periodic_bound: float = 0.0
    #: Channels ``tokenline status`` got wrong during the fault (blamed falsely, not
    #: blamed, its server not named), or 1 when it gave no report.
    status_wrong: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No invariant broken and every job finished."""
        return not (
            self.lost
            or self.duplicate_effects
            or self.stale_writes
            or self.backwards
            or self.late_recoveries
            or self.early_rescues
            or self.idle_workers
            or self.dead_letters
            or self.spent_by_deferrals
            or self.pending
            or self.periodic_instants == 0
            or self.periodic_doubled
            or self.periodic_skipped
            or self.periodic_late
            or self.status_wrong
        )

    @property
    def duplicate_executions(self) -> int:
        """Executions that did not count: re-runs, refused stale commits, ledger repeats."""
        return self.reexecutions + self.stale_refused + self.ledger_duplicates

    def note(self, text: str) -> None:
        """Keep the first few violations verbatim."""
        if len(self.violations) < _KEEP:
            self.violations.append(text)


@dataclass(frozen=True, slots=True)
class ChannelSeen:
    """One channel as ``tokenline status --json`` reported it."""

    #: ``None``: the store does not provide the channel.
    ok: bool | None
    #: How it fails (``unreachable``, ``slow``, ``refusing``, ``not migrated``).
    failure: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StatusSeen:
    """What ``tokenline status`` said during a fault, run as the struck worker."""

    #: Each channel as reported (empty when the probe gave no report).
    channels: Mapping[str, ChannelSeen]
    #: The server that plays each channel, as the store spells it (``Redis at …``).
    servers: Mapping[str, str] = field(default_factory=dict)
    #: Why there is no report (the probe failed, hung or printed no JSON), else ``None``.
    error: str | None = None

    @classmethod
    def from_report(cls, report: object, servers: Mapping[str, str]) -> StatusSeen:
        """From the parsed output of ``tokenline status --json``; one without its
        channels is kept as an error naming what was missing."""
        raw = report.get("channels") if isinstance(report, Mapping) else None
        if not isinstance(raw, Mapping):
            return cls({}, servers, f"no channels in the status report: {report!r:.300}")
        channels = {}
        for name, c in raw.items():
            ok = c.get("ok") if isinstance(c, Mapping) else False
            if not isinstance(c, Mapping) or not (ok is None or isinstance(ok, bool)):
                return cls({}, servers, f"channel {name!r} malformed in the report: {c!r:.300}")
            channels[str(name)] = ChannelSeen(ok, c.get("failure"), c.get("error"))
        return cls(channels, servers)

    def named(self, channel: str) -> str | None:
        """The server a failing channel's error names (its own first), if any."""
        seen = self.channels.get(channel)
        error = seen.error if seen is not None else None
        if not error:
            return None
        own = self.servers.get(channel)
        if own is not None and own in error:
            return own
        return next((s for s in self.servers.values() if s in error), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form (``tokenline drill --json``)."""
        return {
            "error": self.error,
            "channels": {
                name: {
                    "ok": c.ok,
                    "failure": c.failure,
                    "server": self.named(name) if c.ok is False else None,
                    "error": c.error,
                }
                for name, c in self.channels.items()
            },
        }


def check_status(expected: StatusExpectation, seen: StatusSeen | None, report: Report) -> None:
    """Hold what ``tokenline status`` said during the fault to ``expected`` (10.);
    ``seen`` is ``None`` when it never ran."""
    if seen is None or seen.error is not None:
        report.status_wrong += 1
        why = "it never ran (the fault never struck)" if seen is None else seen.error
        report.note(f"status: no report during the fault: {why}")
        return
    for role in Role:
        channel = role.value
        got = seen.channels.get(channel)
        server = seen.servers.get(channel)
        naming = f", naming {server}" if server else ""
        problem = None
        if got is None:
            problem = "missing from the report"
        elif got.ok is not False:
            if channel in expected.failing:
                said = "not provided" if got.ok is None else "ok"
                problem = f"reported {said} while its server was cut; expected failing{naming}"
        elif channel not in expected.failing | expected.maybe:
            problem = f"blamed falsely, no fault was on it: {got.failure}: {got.error}"
        elif server is not None and seen.named(channel) != server:
            other = seen.named(channel)
            instead = f" (it names {other})" if other else ""
            problem = f"failing ({got.failure}) without naming {server}{instead}: {got.error}"
        if problem is not None:
            report.status_wrong += 1
            report.note(f"status: {channel} {problem}")


def read_snapshot(scratch: ScratchStore, *, periodic: bool = False) -> Snapshot:
    """Read what the checker needs from the store and the business table, nothing else
    (``periodic``: the periodic schedules' jobs too)."""
    t = scratch.tables
    rows = scratch.job_rows()
    jobs = {int(r[0]): (r[1], str(r[2]), int(r[3]), r[4]) for r in rows}
    attempts = [
        Attempt(
            int(r[0]),
            int(r[1]),
            float(r[2]),
            None if r[3] is None else float(r[3]),
            r[4],
            str(r[5]),
        )
        for r in scratch.attempt_rows()
    ]
    effects = [
        (str(r[0]), int(r[1]), int(r[2]))
        for r in scratch.rows(f"SELECT job_key, job_id, token FROM {t['drill_effects']}")
    ]
    return Snapshot(
        jobs=jobs,
        attempts=attempts,
        effects=effects,
        stale_refused=scratch.stale_refused(),
        ledger_duplicates=scratch.scalar(f"SELECT count(*) FROM {t['duplicates']}"),
        spent={int(r[0]): int(r[5]) for r in rows},
        periodic=[
            (int(r[0]), str(r[1]), str(r[2]), float(r[3]))
            for r in (scratch.periodic_rows() if periodic else ())
        ],
    )


def check(
    snap: Snapshot,
    *,
    keys: Sequence[str],
    lease_ttl: float,
    rescue_interval: float,
    fault: FaultWindow | None = None,
    hit: frozenset[int] | None = None,
    workers: Sequence[int] | None = None,
    stall: float = 0.0,
    guarded: bool = False,
    renew_interval: float | None = None,
    schedule: Periodic | None = None,
    periodic_interval: float = 1.0,
    ended: float | None = None,
) -> Report:
    """Verify the invariants over ``snap`` for the jobs enqueued with ``keys``.

    ``hit``: process ids of the workers the fault hit (``None``: any may have been);
    ``workers``: process ids that must each have started an attempt. ``stall``: how
    long the fault may keep *every* worker from writing to the store (a paused process
    holding SQLite's single write lock: the pause); rescues may wait that long, then one
    rescue period. ``guarded``: the jobs call a dependency behind its breaker (8.).
    ``renew_interval``: given when the fault is known to have hit the maintenance
    leader, whose successor is elected within ``lease_ttl + renew_interval`` of it and
    rescues within one rescue period (the README's bound); without it, a whole second
    lease TTL is allowed for a leader the fault may have hit.

    ``schedule``: the periodic schedule the workers ran (9.), its scheduler passing every
    ``periodic_interval`` seconds; ``ended``: when the run stopped (epoch seconds), the
    instants due a bound before it must all have been enqueued.
    """
    election = 2 * lease_ttl if renew_interval is None else lease_ttl + renew_interval
    report = Report(
        jobs=len(keys),
        stale_refused=snap.stale_refused,
        ledger_duplicates=snap.ledger_duplicates,
        recovery_bound=max(election, stall) + rescue_interval + SLACK,
    )
    by_job: dict[int, list[Attempt]] = collections.defaultdict(list)
    for a in snap.attempts:
        by_job[a.job_id].append(a)
    effects_by_key: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for key, job_id, token in snap.effects:
        effects_by_key[key].append((job_id, token))
    _check_lost(snap, keys, effects_by_key, report)
    _check_effects(snap, effects_by_key, by_job, report)
    _check_attempts(snap, by_job, report)
    _check_recovery(by_job, fault, report)
    _check_rescued_owners(snap.attempts, hit, report)
    _check_every_worker_works(snap.attempts, workers, report)
    if guarded:
        _check_guarded(snap, by_job, report)
    if schedule is not None:
        report.periodic_bound = max(election, stall) + periodic_interval + SLACK
        _check_periodic(snap, schedule, ended, report)
    return report


def _instant_of(key: str, prefix: str) -> float | None:
    """The instant (epoch seconds) of a periodic job's key, ``None`` if another's."""
    if not key.startswith(prefix):
        return None
    try:
        when = dt.datetime.strptime(key[len(prefix) :], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return when.replace(tzinfo=dt.UTC).timestamp()


def _check_periodic(
    snap: Snapshot, schedule: Periodic, ended: float | None, report: Report
) -> None:
    prefix = f"periodic:{schedule.name}:"
    jobs: dict[float, list[tuple[int, str, float]]] = collections.defaultdict(list)
    for job_id, key, state, enqueued in snap.periodic:
        if (t := _instant_of(key, prefix)) is not None:
            jobs[t].append((job_id, state, enqueued))
    ran: collections.Counter[float] = collections.Counter()
    for key, _, _ in snap.effects:
        if (t := _instant_of(key, prefix)) is not None:
            ran[t] += 1
    report.periodic_instants = 0
    if not jobs:
        report.note(f"periodic: no instant of {schedule.name} was ever enqueued")
        return
    for t, found in sorted(jobs.items()):
        if len(found) > 1 or ran[t] > 1:
            report.periodic_doubled += 1
            report.note(
                f"periodic: instant {schedule.key(t)} enqueued {len(found)} times "
                f"(jobs {sorted(j for j, _, _ in found)}), ran {ran[t]} times"
            )
        lag = max(0.0, min(e for _, _, e in found) - t)
        report.periodic_lag = max(report.periodic_lag or 0.0, lag)
        if lag > report.periodic_bound:
            report.periodic_late += 1
            report.note(
                f"periodic: instant {schedule.key(t)} enqueued {lag:.1f}s after its time "
                f"(bound {report.periodic_bound:.1f}s)"
            )
    first, last = min(jobs), max(jobs)
    span = [first, *schedule.instants(first, last, limit=1_000_000)]
    for t in span:
        # The span ends before the first instant still pending when the workers stopped.
        if any(state not in _FINAL for _, state, _ in jobs.get(t, ())):
            break
        report.periodic_instants += 1
        if ran[t] == 0:
            report.periodic_skipped += 1
            how = "never enqueued" if t not in jobs else f"jobs {[j[:2] for j in jobs[t]]}"
            report.note(f"periodic: instant {schedule.key(t)} never ran ({how})")
            if any(state == "succeeded" for _, state, _ in jobs.get(t, ())):
                report.lost += 1
    if ended is not None:
        # Due a whole bound before the end, and never enqueued: the schedule fell behind.
        missing = schedule.instants(last, ended - report.periodic_bound, limit=1_000_000)
        if missing:
            report.periodic_late += len(missing)
            report.note(
                f"periodic: {len(missing)} instant(s) from {schedule.key(missing[0])} never "
                f"enqueued, due more than {report.periodic_bound:.1f}s before the run ended"
            )


def _check_guarded(snap: Snapshot, by_job: dict[int, list[Attempt]], report: Report) -> None:
    for job_id, (key, state, _, error) in snap.jobs.items():
        if state == "dead":
            report.dead_letters += 1
            report.note(f"dead-lettered behind a breaker: job {job_id} ({key}): {error}")
        ran = sum(1 for a in by_job.get(job_id, ()) if a.outcome != "release")
        extra = snap.spent.get(job_id, 0) - ran
        if extra > 0:
            report.spent_by_deferrals += extra
            report.note(
                f"attempts spent while held back: job {job_id} ({key}) spent "
                f"{snap.spent[job_id]}, ran {ran}"
            )


def _check_rescued_owners(
    attempts: Sequence[Attempt], hit: frozenset[int] | None, report: Report
) -> None:
    if hit is None:
        return
    for a in attempts:
        if a.outcome == "lease_expired" and a.pid not in hit:
            report.early_rescues += 1
            report.note(
                f"early rescue: job {a.job_id} token {a.token} was taken from {a.owner}, "
                "a worker the fault did not hit"
            )


def _check_every_worker_works(
    attempts: Sequence[Attempt], workers: Sequence[int] | None, report: Report
) -> None:
    if workers is None:
        return
    busy = {a.pid for a in attempts}
    for pid in workers:
        if pid not in busy:
            report.idle_workers += 1
            report.note(f"idle worker: process {pid} never started a job")


def _check_lost(
    snap: Snapshot,
    keys: Sequence[str],
    effects_by_key: dict[str, list[tuple[int, int]]],
    report: Report,
) -> None:
    by_key = {key: (job_id, state, err) for job_id, (key, state, _, err) in snap.jobs.items()}
    for key in keys:
        if key not in by_key:
            report.lost += 1
            report.note(f"lost: no job for key {key!r}")
            continue
        job_id, state, error = by_key[key]
        if state in _PENDING:
            report.pending += 1
            report.note(f"unfinished: job {job_id} ({key}) still {state}")
        elif state == "dead" and not error:
            report.lost += 1
            report.note(f"lost: job {job_id} ({key}) dead without a reason")
        elif state == "succeeded" and not effects_by_key.get(key):
            report.lost += 1
            report.note(f"lost: job {job_id} ({key}) succeeded without its effect")
        elif state not in _FINAL | _PENDING:
            report.lost += 1
            report.note(f"lost: job {job_id} ({key}) in unknown state {state!r}")


def _check_effects(
    snap: Snapshot,
    effects_by_key: dict[str, list[tuple[int, int]]],
    by_job: dict[int, list[Attempt]],
    report: Report,
) -> None:
    for key, rows in effects_by_key.items():
        if len(rows) > 1:
            report.duplicate_effects += len(rows) - 1
            tokens = sorted(token for _, token in rows)
            report.note(f"duplicate effect: {key} written {len(rows)} times (tokens {tokens})")
        for job_id, token in rows:
            job = snap.jobs.get(job_id)
            newest = job[2] if job else None
            won = [a.token for a in by_job.get(job_id, ()) if a.outcome == "succeeded"]
            if token != newest or (won and token not in won):
                report.stale_writes += 1
                attempts = "attempt" if len(won) == 1 else "attempts"
                report.note(
                    f"stale write accepted: {key} written by token {token}, "
                    f"job {job_id}'s newest token is {newest}, succeeded {attempts} {won}"
                )


def _check_attempts(snap: Snapshot, by_job: dict[int, list[Attempt]], report: Report) -> None:
    for job_id, attempts in by_job.items():
        attempts.sort(key=lambda a: (a.started_at, a.token))
        report.reexecutions += max(0, len(attempts) - 1)
        tokens = [a.token for a in attempts]
        won = [a for a in attempts if a.outcome == "succeeded"]
        problem = None
        if any(b <= a for a, b in itertools.pairwise(tokens)):
            problem = f"tokens not increasing with start time: {tokens}"
        elif len(won) > 1:
            problem = f"{len(won)} succeeded attempts (tokens {[a.token for a in won]})"
        elif won and any(
            a.started_at > (won[0].finished_at or won[0].started_at) for a in attempts
        ):
            problem = f"an attempt started after its success (token {won[0].token})"
        elif won and snap.jobs.get(job_id, (None, "succeeded"))[1] != "succeeded":
            problem = f"succeeded attempt but state {snap.jobs[job_id][1]}"
        if problem:
            report.backwards += 1
            report.note(f"state moved backwards: job {job_id}: {problem}")


def _check_recovery(
    by_job: dict[int, list[Attempt]], fault: FaultWindow | None, report: Report
) -> None:
    for job_id, attempts in by_job.items():
        for prev, nxt in zip(attempts, [*attempts[1:], None], strict=True):
            if prev.outcome == "lease_expired" and prev.finished_at is not None:
                origin = prev.started_at
                if fault is not None and fault.start <= prev.finished_at:
                    origin = max(origin, fault.end if fault.all_workers else fault.start)
                lag = max(0.0, prev.finished_at - origin)
                report.rescue_lag = max(report.rescue_lag or 0.0, lag)
                if lag > report.recovery_bound:
                    report.late_recoveries += 1
                    report.note(
                        f"late recovery: job {job_id} token {prev.token} rescued {lag:.1f}s "
                        f"after its owner stopped renewing (bound {report.recovery_bound:.1f}s)"
                    )
            if fault is None or nxt is None or prev.outcome == "succeeded":
                continue
            # Cut short by the fault: it was running when the fault began, or started
            # during it, and ended without success.
            ended = prev.finished_at if prev.finished_at is not None else nxt.started_at
            if ended >= fault.start and prev.started_at <= fault.end:
                report.affected += 1
                delay = max(0.0, nxt.started_at - fault.start)
                report.recovery = max(report.recovery or 0.0, delay)
