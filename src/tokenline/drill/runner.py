"""Run drill scenarios against real worker processes and check the invariants.

For each scenario, :class:`Drill` creates a fresh scratch store (a new SQLite file in a
temporary directory or beside the one ``url`` names, or a new PostgreSQL schema; the
directory, with the workers' logs, and the schema are removed afterwards unless
``keep``), starts the worker :class:`~._fleet.Fleet`, enqueues ``jobs`` jobs of
:mod:`tokenline.drill.app` once every worker has registered, injects the
scenario's fault on the seed's schedule, waits until every job is finished and the
fault is over, stops every process, and hands what the store says to
:func:`~.checker.check`.

In a periodic scenario the workers run :data:`~.app.PERIODIC`, whose leader enqueues a
task every second beside the jobs; the run then goes on after the fault until an instant
later than a new leader's election has run, so that the checker sees the schedule
across the failover.

On the split topology, while the fault is on, the controller also runs ``tokenline
status`` as the struck worker (:mod:`.statusprobe`) and does not end the fault before the
probe has answered; :func:`~.checker.check_status` holds its answer to the scenario's
expectation, and the result keeps it.

A scenario whose jobs call the drill's dependency (``slow_dependency``) runs them
behind its circuit breaker, or without one when ``breakers`` is off, and adds the
dependency's figures (:mod:`.dependency`) to its result.

Everything that can be refused is refused before a worker starts
(:meth:`Drill.preflight`): unknown scenarios, a store that cannot be reached, a proxy
port in use. Processes and proxies are stopped in ``finally`` blocks, so an exception or
a Ctrl-C (``KeyboardInterrupt``) leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import signal
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ConfigError, TokenlineError
from .._periodic import Periodic
from ..maintenance import MAINTENANCE_LEASE
from ..stores import refuse_sqlite_url_options, store_from_url
from ..stores.base import ResourceLease
from . import app as drill_app
from ._fleet import Fleet, WorkerSettings
from ._scratch import (
    ScratchStore,
    check_reusable,
    check_sqlite_dir,
    scratch_for,
    upstream_of,
)
from .checker import FaultWindow, Report, StatusSeen, check, check_status, read_snapshot
from .dependency import DIR_ENV, WORKER_ENV, DependencyFigures, Stub, measure
from .proxy import ThreadedFaultProxy
from .scenarios import (
    DRILL_SCENARIOS,
    HELD_JOBS,
    Action,
    Scenario,
    Schedule,
    StatusExpectation,
    Target,
    scenarios_for,
)
from .statusprobe import StatusProbe

__all__ = ["Drill", "DrillError", "ScenarioResult", "scheme_of"]

#: How often the controller looks at the store.
_TICK = 0.05
#: The workers' app unless a test swaps in another (see :attr:`Drill.app`).
_APP = "tokenline.drill.app:app"
#: Periodic instants that must have run before a periodic scenario's fault strikes.
_INSTANTS_BEFORE = 2


class DrillError(TokenlineError):
    """The drill cannot run as asked (bad input, unreachable store, port in use)."""


@dataclass
class ScenarioResult:
    """One scenario's run: its verdict and when its fault was on."""

    scenario: str
    store: str
    report: Report
    lease_ttl: float
    elapsed: float
    fault: FaultWindow | None = None
    log_tail: str = ""
    #: What the drill's dependency went through (scenarios whose jobs call it).
    dependency: DependencyFigures | None = None
    #: With the leader as victim: its maintenance term when struck, and the term at the
    #: end of the run (higher: another worker was elected).
    leader_terms: tuple[int, int] | None = None
    #: On the split topology: what ``tokenline status`` had to say during the fault,
    #: and what it said.
    status_expected: StatusExpectation | None = None
    status: StatusSeen | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (``tokenline drill --json``)."""
        r = self.report
        return {
            "scenario": self.scenario,
            "store": self.store,
            "ok": r.ok,
            "jobs": r.jobs,
            "lost": r.lost,
            "pending": r.pending,
            "duplicate_effects": r.duplicate_effects,
            "stale_writes_accepted": r.stale_writes,
            "states_backwards": r.backwards,
            "late_recoveries": r.late_recoveries,
            "early_rescues": r.early_rescues,
            "idle_workers": r.idle_workers,
            "dead_letters_behind_breaker": r.dead_letters,
            "attempts_spent_by_deferrals": r.spent_by_deferrals,
            "stale_commits_refused": r.stale_refused,
            "ledger_duplicates": r.ledger_duplicates,
            "reexecutions": r.reexecutions,
            "duplicate_executions": r.duplicate_executions,
            "affected_jobs": r.affected,
            "recovery_seconds": r.recovery,
            "rescue_lag_seconds": r.rescue_lag,
            "recovery_bound_seconds": r.recovery_bound,
            "lease_ttl_seconds": self.lease_ttl,
            "elapsed_seconds": round(self.elapsed, 2),
            "violations": r.violations,
            "dependency": None if self.dependency is None else self.dependency.to_json(),
            "leader_terms": None if self.leader_terms is None else list(self.leader_terms),
            "status": None
            if self.status is None or self.status_expected is None
            else {"expected": self.status_expected.to_json(), **self.status.to_json()},
            "periodic": None
            if r.periodic_instants is None
            else {
                "instants": r.periodic_instants,
                "doubled": r.periodic_doubled,
                "skipped": r.periodic_skipped,
                "late": r.periodic_late,
                "enqueue_lag_seconds": r.periodic_lag,
                "enqueue_bound_seconds": r.periodic_bound,
            },
        }


def _writable(directory: Path, what: str) -> None:
    """Refuse a directory the drill cannot create ``what`` in, found by creating a file
    there (removed at once): permissions, a read-only mount or a full disk all show."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise DrillError(
            f"cannot create {what} in {str(directory)!r}: {exc.strerror or exc}"
        ) from None


def _prefix(scenario: Scenario) -> str:
    """What a scenario's schema, key prefix and directory are named after."""
    return f"tokenline_drill_{scenario.name}"


def scheme_of(url: str) -> str:
    """``sqlite``, ``postgresql`` or ``split`` for a store URL; :class:`DrillError`
    otherwise."""
    if url.startswith("sqlite:///"):
        return "sqlite"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql"
    if url.startswith("split:"):
        return "split"
    raise DrillError(
        f"the drill runs on sqlite:///…, postgresql://… or the split topology, not {url!r}"
    )


@dataclass
class Drill:
    """The drill's settings; :meth:`run` runs scenarios one after the other."""

    #: ``None``: SQLite files in a temporary directory.
    url: str | None = None
    jobs: int = 2000
    workers: int = 3
    seed: int = 0
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    #: First port of the per-worker proxies (PostgreSQL); 0: any free port.
    proxy_port: int = 0
    #: Extra environment for the workers (tests use it to switch fencing off).
    worker_env: Mapping[str, str] = field(default_factory=dict)
    #: Longest a scenario may take once its workers run (seconds).
    deadline: float = 300.0
    keep: bool = False
    #: Delete and recreate named SQLite files that hold data the drill did not put there
    #: (``--overwrite``); without it such a file is refused before anything starts.
    overwrite: bool = False
    #: What the last :meth:`run` left behind (with ``keep``, or a named SQLite file),
    #: each with why.
    kept: list[str] = field(default_factory=list, init=False)
    #: The workers' app (``module:attribute``), with the tasks of
    #: :mod:`tokenline.drill.app`; tests swap in a sabotaged one to show the drill fails.
    #: Scenarios whose jobs call the dependency run :data:`~.app.GUARDED` or
    #: :data:`~.app.UNGUARDED` instead, periodic ones :data:`~.app.PERIODIC` (unless
    #: swapped too).
    app: str = _APP
    #: Whether jobs that call the drill's dependency do it behind its circuit breaker;
    #: off, for comparison, dead-lettered jobs and spent attempts are only reported.
    breakers: bool = True

    @property
    def scheme(self) -> str:
        """The store's scheme."""
        return "sqlite" if self.url is None else scheme_of(self.url)

    def select(self, names: Sequence[str]) -> list[Scenario]:
        """The scenarios named (all that apply when none is); unknown names refused."""
        if not names:
            return scenarios_for(self.scheme)
        unknown = [n for n in names if n not in DRILL_SCENARIOS]
        if unknown:
            raise DrillError(
                f"unknown {'scenario' if len(unknown) == 1 else 'scenarios'} "
                f"{', '.join(unknown)}; known: {', '.join(DRILL_SCENARIOS)}"
            )
        chosen = [DRILL_SCENARIOS[n] for n in dict.fromkeys(names)]
        wrong = [s for s in chosen if not s.applies_to(self.scheme)]
        if wrong:
            raise DrillError(
                "; ".join(
                    f"scenario {s.name} does not apply to {self.scheme}: {_why_not(s, self.scheme)}"
                    for s in wrong
                )
            )
        return chosen

    def preflight(self, scenarios: Sequence[Scenario] = ()) -> None:
        """Refuse, before any worker starts, a store or proxy port that cannot work, and
        a named SQLite file of ``scenarios`` that holds data (unless ``overwrite``)."""
        if self.workers < 2:
            raise DrillError("the drill needs at least 2 workers: one is the victim")
        if self.jobs < 10:
            raise DrillError("the drill needs at least 10 jobs")
        # The apps read the TOKENLINE_* environment: a bad variable is reported now (a
        # ConfigError names it), not by every worker process once they are started.
        try:
            drill_app.app  # noqa: B018 - built on first use
        except ConfigError:
            raise
        except TokenlineError as exc:
            raise DrillError(f"the drill's apps cannot be built here: {exc}") from None
        _writable(Path(tempfile.gettempdir()), "the drill's scratch directories")
        if self.url is None:
            return
        if self.scheme == "sqlite":
            # The URL as given: each scenario's file is named after it, and an error
            # about one of those would name a URL the user never typed.
            try:
                refuse_sqlite_url_options(self.url)
                check_sqlite_dir(Path(self.url[len("sqlite:///") :]))
            except ConfigError as exc:
                raise DrillError(exc.reason) from None
            if not self.overwrite:
                for scenario in scenarios:
                    try:
                        check_reusable(self._sqlite_file(scenario), _prefix(scenario))
                    except ConfigError as exc:
                        raise DrillError(exc.reason) from None
            return
        self._preflight_ports()
        if self.scheme == "split":
            self._preflight_split()
            return
        if "schema=" in self.url:
            raise DrillError("the drill picks a fresh schema per scenario: leave ?schema= out")
        try:
            import psycopg
        except ModuleNotFoundError:
            raise DrillError(
                "the PostgreSQL drill needs psycopg: pip install 'tokenline[postgres]'"
            ) from None
        try:
            with psycopg.connect(self.url, connect_timeout=5):
                pass
        except psycopg.Error as exc:
            raise DrillError(f"cannot reach PostgreSQL at {self.url}: {exc}".strip()) from None

    def _preflight_ports(self) -> None:
        """The proxies' ports (``proxy_port`` and the next ``workers - 1``): all of them
        ports, and free, by a trial listen on each, released at once."""
        if not self.proxy_port:
            return
        assert self.url is not None
        last = self.proxy_port + self.workers - 1
        if last > 65535:
            raise DrillError(
                f"--proxy-port {self.proxy_port}: {self.workers} workers need ports "
                f"{self.proxy_port} to {last}, past the last port, 65535"
            )
        upstream = _upstream(self.scheme, self.url)
        assert upstream is not None
        for port in range(self.proxy_port, last + 1):
            try:
                with ThreadedFaultProxy(upstream, port=port):
                    pass
            except (OSError, OverflowError) as exc:
                raise DrillError(f"--proxy-port: cannot listen on port {port}: {exc}") from None

    def _preflight_split(self) -> None:
        """The split topology: both servers reachable, no prefix or schema given."""
        assert self.url is not None
        try:
            # Built to check the URL only: its empty working directory goes at once.
            scratch_for(self.url).discard()
        except TokenlineError as exc:
            raise DrillError(str(exc)) from None
        from ..stores import _split_parts

        broker, _, ledger = _split_parts(self.url)
        try:
            import psycopg
            import redis
        except ModuleNotFoundError:
            raise DrillError(
                "the split drill needs redis-py and psycopg: "
                "pip install 'tokenline[redis,postgres]'"
            ) from None
        try:
            with redis.Redis.from_url(broker, socket_connect_timeout=5) as client:
                client.ping()
        except redis.RedisError as exc:
            raise DrillError(f"cannot reach Redis at {broker}: {exc}".strip()) from None
        try:
            with psycopg.connect(ledger, connect_timeout=5):
                pass
        except psycopg.Error as exc:
            raise DrillError(f"cannot reach PostgreSQL at {ledger}: {exc}".strip()) from None

    def run(
        self,
        scenarios: Sequence[Scenario],
        on_result: Callable[[ScenarioResult], None] | None = None,
    ) -> list[ScenarioResult]:
        """Run ``scenarios`` in order; ``on_result`` hears each as it finishes."""
        results = []
        self.kept = []
        for scenario in scenarios:
            result = self.run_one(scenario)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    def _sqlite_file(self, scenario: Scenario) -> Path:
        """The SQLite file of ``scenario``, beside the one ``url`` names."""
        assert self.url is not None
        base = Path(self.url[len("sqlite:///") :])
        return base.with_name(f"{base.stem}-{scenario.name}{base.suffix or '.db'}")

    def _scratch(self, scenario: Scenario) -> ScratchStore:
        prefix = _prefix(scenario)
        url = self.url
        if url is not None and self.scheme == "sqlite":
            url = f"sqlite:///{self._sqlite_file(scenario)}"
        try:
            return scratch_for(url, keep=self.keep, prefix=prefix, overwrite=self.overwrite)
        except ConfigError as exc:
            raise DrillError(exc.reason) from None
        except OSError as exc:  # the scratch directory (the checks above passed earlier)
            raise DrillError(f"cannot create the scenario's scratch directory: {exc}") from None

    def run_one(self, scenario: Scenario) -> ScenarioResult:
        """Run one scenario on a fresh store."""
        schedule = Schedule.draw(scenario, jobs=self.jobs, workers=self.workers, seed=self.seed)
        scratch = self._scratch(scenario)
        stub = None
        app = self.app
        try:
            failover = scenario.injection is not None and (
                scenario.injection.action is Action.FAILOVER
            )
            if failover:
                scratch.start_servers()
            scratch.prepare({"drill_effects": drill_app.COLUMNS})
            env = {**self.worker_env, drill_app.TABLE_ENV: scratch.tables["drill_effects"]}
            if scenario.calls_dependency:
                stub = Stub(scratch.work_dir / "dependency").create()
                env = {**WORKER_ENV, **env, DIR_ENV: str(stub.directory)}
                app = drill_app.GUARDED if self.breakers else drill_app.UNGUARDED
            elif scenario.periodic and app == _APP:
                app = drill_app.PERIODIC
            fleet = Fleet(
                url=scratch.url,
                workers=self.workers,
                settings=self.settings,
                work_dir=scratch.work_dir,
                env=env,
                upstream=_upstream(self.scheme, scratch.url),
                proxy_port=self.proxy_port,
                seed=schedule.seed,
                run_id=f"{uuid.uuid4().hex}",
            )
            started = time.monotonic()
            with fleet:
                fleet.spawn(app, drill_app.QUEUE, self._clocks(scenario, schedule))
                # Jobs only once every worker is up: a worker still starting while the
                # others ran the jobs out would neither work nor be the fault's victim
                # (seen on a slow machine).
                _await_workers(scratch.url, fleet)
                keys = self._enqueue(scratch, scenario, schedule)
                if failover:
                    scratch.wait_replicated()  # the jobs themselves are not what is lost
                controller = _Controller(self, scenario, schedule, scratch, fleet, stub)
                window = controller.run()
                schedule = controller.schedule  # the victim, if chosen when it struck
                terms = None
                if controller.victim_term is not None:
                    last = asyncio.run(_maintenance_lease(scratch.url))
                    terms = (controller.victim_term, last.token if last else 0)
                ended = time.time()
                seen = controller.seen
                tail = fleet.log_tail()
                pids = [fleet.pid(i) for i in range(self.workers)]
            elapsed = time.monotonic() - started
            report = check(
                read_snapshot(scratch, periodic=scenario.periodic),
                keys=keys,
                lease_ttl=self.settings.lease_ttl,
                rescue_interval=self.settings.rescue_interval,
                fault=window,
                hit=_hit(scenario, schedule, pids),
                workers=pids if scenario.every_worker_works else None,
                stall=_stall(self.scheme, scenario, window),
                guarded=scenario.calls_dependency and self.breakers,
                renew_interval=self.settings.renew_interval if scenario.leader_victim else None,
                schedule=_schedule(scenario),
                periodic_interval=self.settings.periodic_interval,
                ended=ended,
            )
            expected = scenario.status if self.scheme == "split" else None
            if expected is not None:
                if seen is None:
                    seen = StatusSeen({}, error="it never ran: the fault never struck")
                check_status(expected, seen, report)
            figures = None
            if stub is not None:
                figures = measure(stub, scratch, window, breakers=self.breakers)
        finally:
            self.kept.extend(scratch.cleanup())
        return ScenarioResult(
            scenario.name,
            self.scheme,
            report,
            self.settings.lease_ttl,
            elapsed,
            window,
            "" if report.ok else tail,
            figures,
            terms,
            expected,
            seen if expected is not None else None,
        )

    def _clocks(self, scenario: Scenario, schedule: Schedule) -> dict[int, dict[str, str]]:
        """Wall-clock offsets of the skewed workers: the victim ahead, the next behind."""
        if not scenario.skew:
            return {}
        behind = (schedule.victim + 1) % self.workers
        return {
            schedule.victim: {drill_app.CLOCK_OFFSET_ENV: str(scenario.skew)},
            behind: {drill_app.CLOCK_OFFSET_ENV: str(-scenario.skew)},
        }

    def _enqueue(self, scratch: ScratchStore, scenario: Scenario, schedule: Schedule) -> list[str]:
        """Enqueue the jobs (see :meth:`_items`)."""
        from .._app import App

        keys = [f"drill:{scenario.name}:{i}" for i in range(self.jobs)]
        task, items = self._items(keys, scenario, schedule)
        app = App(scratch.url)
        for t in [*drill_app.app.tasks.values(), *drill_app.guarded.tasks.values()]:
            app.task(name=t.name, queue=t.queue, max_attempts=t.max_attempts)(t.fn)
        try:
            for first in range(0, len(items), 5000):
                app.enqueue_many(task, items[first : first + 5000], keys=keys[first : first + 5000])
        finally:
            app.close()
        return keys

    def _items(
        self, keys: Sequence[str], scenario: Scenario, schedule: Schedule
    ) -> tuple[str, list[tuple[Any, ...]]]:
        """The jobs' task and arguments. Those around the fault's moment outlive a lease
        TTL, so the fault catches some job mid-flight however fast the others are. A
        scenario that holds transactions open has a few jobs, spread from that moment,
        hold theirs. Jobs that call the dependency have neither, and a re-run works as
        long as the first run: a job deferred or retried is no zombie's victim. In a
        periodic scenario, whose fault waits for the schedule's first instants, half as
        many work longer by that wait, and leave slots free for the instants meanwhile."""
        rng = random.Random(schedule.seed)
        if scenario.calls_dependency:
            return drill_app.CALL_TASK, [(key, rng.uniform(2, 12)) for key in keys]
        ttl = self.settings.lease_ttl
        slots = self.workers * self.settings.concurrency
        first_long = max(0, schedule.at_jobs - slots)
        long_ms = ttl * 1500
        long_jobs = set(range(first_long, first_long + 3 * slots, 3))
        if scenario.periodic:
            long_jobs = set(range(first_long, first_long + 3 * slots, 6))
            # The schedule starts at the leader's first pass, its first instant is due
            # one period later, and _INSTANTS_BEFORE of them must have run.
            warm_up = (_INSTANTS_BEFORE + 2) * self.settings.periodic_interval
            long_ms += (warm_up + self.settings.renew_interval) * 1000
        held: set[int] = set()
        if scenario.hold_ttls:
            long_jobs = set()
            held = {min(self.jobs - 1, schedule.at_jobs + k * slots) for k in range(HELD_JOBS)}
        items = [
            (
                key,
                long_ms if i in long_jobs else rng.uniform(2, 12),
                # A re-run works longer, so that a zombie resumed once its jobs were taken
                # over finds them still running under the newer token.
                ttl * 1.5,
                scenario.hold_ttls * ttl * 1000 if i in held else 0.0,
            )
            for i, key in enumerate(keys)
        ]
        return "drill.work", items


async def _maintenance_lease(url: str, *, held: bool = False) -> ResourceLease | None:
    """The maintenance lease's record (with ``held``: only if held now, by the store's
    clock)."""
    store = store_from_url(url)
    await store.open()
    try:
        now = await store.store_time()
        for lease in await store.resource_leases_list():
            if lease.resource == MAINTENANCE_LEASE and (lease.expires_at > now or not held):
                return lease
        return None
    finally:
        await store.close()


#: How long the workers may take to start before the run is refused.
_START_TIMEOUT = 60.0


async def _registered_pids(url: str) -> set[int]:
    """The process ids of the workers registered in the store at ``url``."""
    store = store_from_url(url)
    await store.open()
    try:
        return {record.pid for record in await store.workers_list()}
    finally:
        await store.close()


def _await_workers(url: str, fleet: Fleet) -> None:
    """Return once every worker of ``fleet`` has registered; raise :class:`DrillError`
    if one exits first or they take longer than :data:`_START_TIMEOUT`."""
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        registered = asyncio.run(_registered_pids(url))
        missing = [i for i in range(fleet.count) if fleet.pid(i) not in registered]
        if not missing:
            return
        exited = [i for i in missing if fleet.returncode(i) is not None]
        if exited or time.monotonic() > deadline:
            what = "exited" if exited else f"did not register within {_START_TIMEOUT:g}s"
            names = ", ".join(f"worker-{i}" for i in exited or missing)
            raise DrillError(f"{names} {what} before any job\n{fleet.log_tail()}")
        time.sleep(_TICK)


def _why_not(scenario: Scenario, scheme: str) -> str:
    """Why ``scenario`` does not run on a store of ``scheme``, for the error."""
    return f"it runs on {', '.join(sorted(scenario.stores))}"


def _schedule(scenario: Scenario) -> Periodic | None:
    """The periodic schedule the scenario's workers run, if any."""
    return drill_app.periodic.periodics[drill_app.TICK_TASK] if scenario.periodic else None


def _upstream(scheme: str, url: str) -> tuple[str, int] | None:
    """What the workers' proxies stand in front of: PostgreSQL, or the split topology's
    Redis (its ledger is reached directly); SQLite has no network."""
    if scheme == "postgresql":
        return upstream_of(url)
    if scheme == "split":
        from ..stores import _split_parts

        parts = urllib.parse.urlsplit(_split_parts(url)[0])
        return parts.hostname or "127.0.0.1", parts.port or 6379
    return None


def _hit(scenario: Scenario, schedule: Schedule, pids: Sequence[int]) -> frozenset[int] | None:
    """The process ids the scenario's fault hits (``None``: every worker may be hit)."""
    inj = scenario.injection
    if inj is None:
        return frozenset()
    if inj.target is Target.ALL:
        return None
    return frozenset({pids[schedule.victim]})


class _Controller:
    """Watches the store and injects one scenario's fault on its schedule."""

    def __init__(
        self,
        drill: Drill,
        scenario: Scenario,
        schedule: Schedule,
        scratch: ScratchStore,
        fleet: Fleet,
        stub: Stub | None = None,
    ) -> None:
        self.drill = drill
        self.scenario = scenario
        self.inj = scenario.injection
        self.schedule = schedule
        self.scratch = scratch
        self.fleet = fleet
        self.stub = stub
        inj = self.inj
        self.duration = inj.ttls * drill.settings.lease_ttl if inj is not None else 0.0
        self.targets = (
            list(range(drill.workers))
            if inj is not None and inj.target is Target.ALL
            else [schedule.victim]
        )
        self.store_faults, self.proxy_faults = scenario.faults_for(drill.scheme)
        self.started: float | None = None
        self.ended: float | None = None
        self._on = False
        self._held: list[tuple[int, int]] = []
        self.stop_tries = 0
        #: The victim's maintenance term when struck (leader-victim scenarios).
        self.victim_term: int | None = None
        #: ``tokenline status`` run as the victim while the fault is on (split only),
        #: and what it said.
        self.probes_status = drill.scheme == "split" and scenario.status is not None
        self.probe: StatusProbe | None = None
        self.seen: StatusSeen | None = None

    def done(self) -> int:
        """The drill's own jobs finished (a periodic schedule's are not counted)."""
        finished = self.scratch.finished_jobs()
        if not self.scenario.periodic:
            return finished
        # Read second: an instant finishing in between is subtracted, never added.
        final = ("succeeded", "dead", "cancelled")
        return finished - sum(1 for r in self.scratch.periodic_rows() if r[2] in final)

    def _instants_run(self) -> list[str]:
        """The keys of the periodic instants whose job succeeded."""
        return [str(r[1]) for r in self.scratch.periodic_rows() if r[2] == "succeeded"]

    def schedule_running(self) -> bool:
        """Whether the fault may strike: in a periodic scenario, once a few instants ran
        (the leader to strike is the one enqueueing them)."""
        return not self.scenario.periodic or len(self._instants_run()) >= _INSTANTS_BEFORE

    def settled(self) -> bool:
        """Whether the run may end once its jobs are done: the fault is over (or never
        began), and in a periodic scenario it began and an instant later than a new
        leader's first scheduler pass has run."""
        if not self.scenario.periodic:
            return self.started is None or self.ended is not None
        if self.ended is None:
            return False
        settings = self.drill.settings
        after = self.ended + settings.lease_ttl + settings.renew_interval
        after += settings.periodic_interval
        schedule = _schedule(self.scenario)
        assert schedule is not None
        # Keys name their instant to the second, in an order that sorts as time does.
        later = schedule.key(after)
        return any(key > later for key in self._instants_run())

    def run(self) -> FaultWindow | None:
        """Drive the run to its end; the fault's window, or ``None`` if it never began."""
        deadline = time.monotonic() + self.drill.deadline
        try:
            while time.monotonic() < deadline:
                done = self.done()
                if self.inj is None:
                    pass  # nothing to inject: run to the end
                elif self.started is None and done >= self.schedule.at_jobs:
                    if self.schedule_running():
                        self._start()
                elif self.started is not None and self.ended is None:
                    self._tick()
                if done >= self.drill.jobs and self.settled():
                    break
                time.sleep(_TICK)
        except BaseException:
            if self.probe is not None:
                self.probe.stop()  # not waited for: the run is being abandoned
            raise
        finally:
            try:
                if self.started is not None and self.ended is None:
                    self._end()
            finally:
                self._status_result()
        if self.started is None or self.inj is None:
            return None
        assert self.ended is not None
        return FaultWindow(self.started, self.ended, self.inj.target is Target.ALL)

    def _leader(self) -> int:
        """The fleet index of the worker holding the maintenance lease now."""
        pids = [self.fleet.pid(i) for i in range(self.drill.workers)]
        deadline = time.monotonic() + max(10.0, 3 * self.drill.settings.lease_ttl)
        while time.monotonic() < deadline:
            lease = asyncio.run(_maintenance_lease(self.scratch.url, held=True))
            for i, pid in enumerate(pids):
                if lease is not None and f"-{pid}-" in lease.owner:
                    self.victim_term = lease.token
                    return i
            time.sleep(_TICK)
        raise DrillError("no worker of the drill became maintenance leader")

    def _start(self) -> None:
        assert self.inj is not None
        action = self.inj.action
        if self.scenario.leader_victim:
            self.schedule = dataclasses.replace(self.schedule, victim=self._leader())
            self.targets = [self.schedule.victim]
        victim = self.schedule.victim
        if action is Action.KILL:
            self.fleet.signal(victim, signal.SIGKILL)
            self.started = self.ended = time.time()
        elif action is Action.STOP:
            self._stop(victim)
        elif action is Action.FAILOVER:
            self.started = time.time()
            # A quarter TTL of writes the replica never sees: claims, renewals, finishes.
            address = self.scratch.fail_over(self.drill.settings.lease_ttl / 4)
            # The primary is dead and the proxies still lead to it: the outage, which
            # status must see before they move.
            self._status_probe()
            self._status_result()
            for proxy in self.fleet.proxies:
                proxy.switch_upstream(address)
            self.ended = time.time()
        elif action is Action.DEPENDENCY:
            assert self.stub is not None, "a dependency fault needs the dependency"
            self.stub.hang(True)
            self.started = time.time()
        else:
            self._switch(on=True)
            self.started = time.time()
        self._status_probe()

    def _status_probe(self) -> None:
        """Start ``tokenline status`` as the victim, once per run (split only)."""
        if self.probes_status and self.probe is None:
            self.probe = StatusProbe.start(self.fleet, self.schedule.victim)

    def _probing(self) -> bool:
        """Whether the status probe still runs: the fault lasts until it has answered."""
        return self.probe is not None and self.probe.running()

    def _status_result(self) -> None:
        """Keep what the probe said (waiting for it, up to its deadline)."""
        if self.probe is not None and self.seen is None:
            self.seen = self.probe.result()

    def _stop(self, victim: int) -> None:
        # A worker paused inside a transaction would hold a lock the rescue needs (the
        # whole file on SQLite): resume it and try again a moment later. So would one
        # paused between jobs, holding none: nothing of it would then wait for the
        # rescue, and the run would prove nothing of a zombie (seen on a slow machine).
        pid = self.fleet.pid(victim)
        for _ in range(20):
            self.fleet.signal(victim, signal.SIGSTOP)
            time.sleep(0.05)
            holds = self.scenario.leader_victim or bool(self.scratch.running_of(pid))
            if holds and not self.scratch.lock_held():
                break
            self.fleet.signal(victim, signal.SIGCONT)
            time.sleep(random.uniform(0.005, 0.03))
        else:
            # Never caught outside a transaction: pause it anyway (the rescue waits).
            self.fleet.signal(victim, signal.SIGSTOP)
        self.stop_tries = _ + 1
        self.started = time.time()
        self._held = self.scratch.running_of(pid)

    def _released(self) -> bool:
        """Whether every job the paused worker held runs again under a newer token (or
        is already finished): requeued is not enough, the new owner must be at work."""
        if not self._held:
            return True
        now = self.scratch.tokens_and_states([j for j, _ in self._held])
        return all(
            j in now
            and (
                now[j][1] in ("succeeded", "dead", "cancelled")
                or (now[j][1] == "running" and now[j][0] > t)
            )
            for j, t in self._held
        )

    def _tick(self) -> None:
        assert self.started is not None
        assert self.inj is not None
        since = time.time() - self.started
        if self.inj.action is Action.STOP:
            ttl = self.drill.settings.lease_ttl
            # Resume as soon as the jobs were taken over, while their new owners still
            # work: the moment a zombie's commit is most dangerous.
            over = (since >= ttl and self._released()) or since >= self.duration
            if over and not self._probing():
                self._end()
            return
        if since >= self.duration and not self._probing():
            self._end()
            return
        if self.inj.flap:
            want = int(since / self.inj.flap) % 2 == 0
            if want != self._on:
                self._switch(on=want)

    def _switch(self, *, on: bool) -> None:
        assert self.inj is not None
        if on:
            self.fleet.set_faults(
                self.targets, self.store_faults, self.proxy_faults, reset=self.inj.reset
            )
        else:
            self.fleet.clear_faults(self.targets)
        self._on = on

    def _end(self) -> None:
        assert self.inj is not None
        if self.inj.action is Action.STOP:
            self.fleet.signal(self.schedule.victim, signal.SIGCONT)
        elif self.inj.action is Action.FAULT:
            with contextlib.suppress(RuntimeError):  # proxies already stopped
                self._switch(on=False)
        elif self.inj.action is Action.DEPENDENCY and self.stub is not None:
            self.stub.hang(False)
        self.ended = time.time()


def _stall(scheme: str, scenario: Scenario, window: FaultWindow | None) -> float:
    """How long the fault may keep every worker from writing: on SQLite, a worker
    paused (SIGSTOP) in the middle of a write keeps the file's one write lock for the
    whole pause, and nobody can claim, complete or rescue until it resumes (then it
    fences itself and rolls back). PostgreSQL has no such lock: its rescue ends the
    paused attempt's session."""
    stopped = scenario.injection is not None and scenario.injection.action is Action.STOP
    if scheme != "sqlite" or not stopped or window is None:
        return 0.0
    return window.end - window.start
