"""The drill's scenarios: what runs, what is injected when, for how long, on whom.

Each :class:`Scenario` is a value: one :class:`Injection` at a share of the jobs done,
lasting some seconds (or lease TTLs), on one worker or all of them. How a fault reaches
a worker depends on the store:

* **PostgreSQL**: every worker process connects through its own
  :class:`~tokenline.drill.proxy.ThreadedFaultProxy`, so a network fault can hit one
  worker; faults that must pick a *role* (the lease store but not the broker) go through
  :class:`~tokenline.drill.faultstore.FaultStore`, since one connection pool serves all
  three roles and a proxy cannot tell them apart.
* **split topology** (broker and leases on Redis, the ledger on PostgreSQL): each
  worker reaches Redis through its own proxy, and PostgreSQL directly, so the network
  scenarios (``redis_partition_one``, ``redis_partition_all``) cut Redis only;
* **SQLite**: there is no network; every worker gets its own fault file, read by the
  FaultStore wrapping its store.

``redis_failover`` runs on two ``redis-server`` processes of the drill's own (a primary
and its replica, on free loopback ports, nothing on disk): the replica stops replicating
at the fault (its link is cut), the primary is killed with SIGKILL, the replica is
promoted, and every proxy sends new connections there. The writes of the last moment
are lost, as in a real asynchronous failover; the ledger keeps the business data right.

``pg_restart`` is *simulated at the proxy*: every connection is reset and new ones are
refused for a while, which is what clients see of a restart. The server itself keeps
running (the drill must not stop a server it does not own); a real restart also loses
prepared statements and in-memory state, which this does not exercise.

``partition_oneway`` on SQLite is approximated with ``fail_after`` on every role: each
call reaches the file and is applied, and its answer is lost — what a server→client drop
does to requests already sent.

Two scenarios inject nothing into the store's channels: ``clock_skew`` runs one worker an
hour ahead and another an hour behind (their wall clocks, not the store's) and kills the
one ahead mid-run; ``long_transaction`` has a few jobs keep their fenced transaction open
for longer than the lease TTL. In both, a lease rescued from a worker the drill did not
hit is an *early rescue*, and a violation.

``kill9_leader`` and ``sigstop_leader`` are ``kill9`` and ``sigstop`` with the
maintenance leader as the victim (whoever holds ``tokenline:maintenance`` when the fault
strikes): the others must elect a new leader, in a new term, and rescue the victim's
jobs within the same bound, and the resumed leader's maintenance writes are refused.

``periodic_kill9_leader`` and ``periodic_sigstop_leader`` are the same two faults with a
periodic task every second beside the jobs (six-field cron, ``catch_up="all"``), which
the maintenance leader enqueues: every instant from the first to the last one seen must
have run exactly once (one business row each, none twice, none skipped), and each must
have been enqueued within lease TTL + renew interval + the scheduler's period (+ slack)
of its time, however long the leader was gone (on SQLite a longer pause replaces the
TTL and renew interval: a paused writer holds the file's lock). They run on SQLite,
PostgreSQL and the split topology (whose schedules live in Redis, ``schedule.lua``).

``slow_dependency`` leaves the store alone too: its jobs call the drill's dependency
(:mod:`tokenline.drill.dependency`), which the fault makes time out for a while, for
every worker at once. With breakers on (the default) no job may be dead-lettered and
no job held back by the breaker may spend an attempt; with them off (a comparison the
runner offers) the same calls go out without a breaker, and the report shows what that
costs instead of failing on it.

**What ``tokenline status`` says.** On the split topology, each scenario also declares
(:attr:`Scenario.status`, a :class:`StatusExpectation`) what ``tokenline status`` must
say while its fault is on, run as the struck worker runs: with that worker's URL (Redis
through its proxy), app and fault file (:mod:`tokenline.drill.statusprobe`). A channel it
must name failing has to carry, in its error, the server that plays it as the store
spells it (``Redis at host:port/db`` for broker and leases, ``PostgreSQL database … on
host:port`` for the ledger); every channel not declared must be ok. So:

* ``redis_partition_one``, ``redis_partition_all``: broker and leases failing, naming
  Redis (the struck worker's proxy drops everything); the ledger ok.
* ``redis_failover``: broker and leases failing, naming Redis: the probe runs once the
  primary is dead, and the proxies move to the promoted replica once it has answered
  (the outage lasts about as long as the probe, a second or so, as clients see a
  failover before they are told where the new primary is).
* ``partition_leases``: the leases channel failing, naming Redis; broker and ledger ok.
* ``lost_ack``: the broker's faults hit only its finishes, which status never calls, so
  broker and leases must be ok; the ledger's strike at random (and answers only are
  lost), so status may name the ledger failing, and then PostgreSQL, or not.
* ``kill9``, ``sigstop`` and the ``periodic_*`` scenarios: a process is struck, no
  channel is: every channel must be ok, or status blames the network falsely.

A run whose probe says otherwise (or never ran) fails, with the reason.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass

from .proxy import Faults
from .storefaults import Role, RoleFaults, StoreFaults

__all__ = [
    "DRILL_SCENARIOS",
    "HELD_JOBS",
    "Action",
    "Injection",
    "Scenario",
    "Schedule",
    "StatusExpectation",
    "Target",
    "scenarios_for",
]


class Target(enum.StrEnum):
    """Whom an injection hits."""

    ONE = "one"
    ALL = "all"


class Action(enum.StrEnum):
    """What an injection does."""

    #: SIGKILL the worker process.
    KILL = "kill"
    #: SIGSTOP it until its jobs were taken over (or ``duration``), then SIGCONT.
    STOP = "stop"
    #: Switch faults on (FaultStore and/or proxy) for ``duration`` seconds.
    FAULT = "fault"
    #: Make the drill's dependency hang past its timeout for ``duration`` seconds.
    DEPENDENCY = "dependency"
    #: Split topology: kill the Redis primary, promote its replica (``REPLICAOF NO
    #: ONE``) and send every worker's proxy there. The drill runs its own two servers.
    FAILOVER = "failover"


@dataclass(frozen=True, slots=True)
class Injection:
    """One fault: when (``at_done``: share of the jobs finished), how long, on whom."""

    action: Action
    target: Target = Target.ONE
    at_done: float = 0.25
    #: Seconds the fault lasts, in lease TTLs (``0``: instantaneous).
    ttls: float = 0.0
    #: FaultStore faults: always on SQLite; on PostgreSQL when ``proxy`` is ``None``.
    store: StoreFaults | None = None
    #: Proxy faults (PostgreSQL only).
    proxy: Faults | None = None
    #: Reset the proxy's connections when the fault starts (PostgreSQL only).
    reset: bool = False
    #: Toggle the fault on and off every this many seconds while it lasts.
    flap: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.at_done < 1:
            raise ValueError(f"at_done must be in [0, 1), got {self.at_done}")
        if self.action is Action.FAULT and self.store is None and self.proxy is None:
            raise ValueError("a fault injection needs store or proxy faults")


@dataclass(frozen=True, slots=True)
class StatusExpectation:
    """What ``tokenline status``, run as the struck worker during the fault, must say on
    the split topology (see the module docstring): the channels it names failing, each
    naming its server; the others ok."""

    #: Channels (``broker``, ``leases``, ``ledger``) it must name failing.
    failing: frozenset[str] = frozenset()
    #: Channels it may name failing or not (a fault that strikes calls at random); if
    #: failing, naming their server all the same.
    maybe: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        known = {r.value for r in Role}
        for name in ("failing", "maybe"):
            channels = getattr(self, name)
            if isinstance(channels, str):
                raise ValueError(f"{name} must be a set of channel names, got {channels!r}")
            unknown = sorted(set(channels) - known)
            if unknown:
                raise ValueError(
                    f"{name}: unknown channel {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}"
                )
            object.__setattr__(self, name, frozenset(channels))
        both = sorted(self.failing & self.maybe)
        if both:
            raise ValueError(f"channel {', '.join(both)} is both failing and maybe failing")

    def to_json(self) -> dict[str, list[str]]:
        """A JSON-ready form (``tokenline drill --json``)."""
        return {"failing": sorted(self.failing), "maybe": sorted(self.maybe)}


#: No channel is faulted: status must say every one is ok.
_ALL_OK = StatusExpectation()
#: Redis is cut or gone: broker and leases fail, naming it.
_REDIS_DOWN = StatusExpectation(failing=frozenset({"broker", "leases"}))


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named drill scenario (see the module docstring)."""

    name: str
    description: str
    #: The fault, or ``None``: the scenario injects nothing into the store's channels.
    injection: Injection | None
    #: Store schemes it applies to.
    stores: frozenset[str] = frozenset({"sqlite", "postgresql"})
    #: Seconds the victim's wall clock runs ahead; the next worker's runs as far behind.
    skew: float = 0.0
    #: Lease TTLs that :data:`HELD_JOBS` jobs keep their fenced transaction open.
    hold_ttls: float = 0.0
    #: Every worker must run jobs (a worker that never claims one is a violation).
    every_worker_works: bool = False
    #: The jobs call the drill's dependency before their work.
    calls_dependency: bool = False
    #: The victim is the maintenance leader when the fault strikes, not a drawn worker.
    leader_victim: bool = False
    #: The workers also run the drill's periodic task (:data:`~.app.PERIODIC`), whose
    #: instants the checker holds to exactly once.
    periodic: bool = False
    #: What ``tokenline status`` must say during the fault on the split topology
    #: (``None``: the scenario does not run there).
    status: StatusExpectation | None = None

    def __post_init__(self) -> None:
        if "split" in self.stores and self.status is None:
            raise ValueError(f"scenario {self.name} runs on the split topology: declare its status")

    def applies_to(self, scheme: str) -> bool:
        """Whether the scenario runs on a store of this scheme."""
        return scheme in self.stores

    def faults_for(self, scheme: str) -> tuple[StoreFaults | None, Faults | None]:
        """(FaultStore faults, proxy faults) to switch on, for a store of ``scheme``."""
        inj = self.injection
        if inj is None:
            return None, None
        if scheme in ("postgresql", "split") and inj.proxy is not None:
            return None, inj.proxy
        return inj.store, None


@dataclass(frozen=True, slots=True)
class Schedule:
    """A scenario's fault schedule for one run, fixed by the seed."""

    #: Jobs finished when the fault starts.
    at_jobs: int
    #: The worker hit when the target is one worker.
    victim: int
    #: Seed handed to the FaultStores and proxies (probability and jitter draws).
    seed: int

    @classmethod
    def draw(cls, scenario: Scenario, *, jobs: int, workers: int, seed: int) -> Schedule:
        """The schedule of ``scenario`` for ``seed``: the same seed, the same schedule."""
        rng = random.Random(f"{seed}:{scenario.name}")
        at_done = scenario.injection.at_done if scenario.injection is not None else 0.3
        share = at_done + rng.uniform(-0.05, 0.05)
        at_jobs = max(1, min(jobs - 1, round(jobs * share)))
        return cls(at_jobs=at_jobs, victim=rng.randrange(workers), seed=rng.randrange(2**31))


#: Jobs that keep their transaction open in ``long_transaction``.
HELD_JOBS = 3

_ALL_ERROR = StoreFaults(
    broker=RoleFaults(error=True), leases=RoleFaults(error=True), ledger=RoleFaults(error=True)
)
_ALL_LOST = StoreFaults(
    broker=RoleFaults(fail_after=True),
    leases=RoleFaults(fail_after=True),
    ledger=RoleFaults(fail_after=True),
)

#: Scenarios that also run on the split topology: their faults hit processes or, through
#: the FaultStore, roles; the network ones there are the Redis partitions below.
_WITH_SPLIT = frozenset({"sqlite", "postgresql", "split"})


_SCENARIOS = (
    Scenario(
        "kill9",
        "kill -9 a worker mid-job; its jobs come back after the lease TTL",
        Injection(Action.KILL, at_done=0.3),
        stores=_WITH_SPLIT,
        status=_ALL_OK,
    ),
    Scenario(
        "sigstop",
        "SIGSTOP a worker past its lease; SIGCONT once its jobs were re-leased",
        Injection(Action.STOP, at_done=0.3, ttls=4.0),
        stores=_WITH_SPLIT,
        status=_ALL_OK,
    ),
    Scenario(
        "kill9_leader",
        "kill -9 the maintenance leader mid-job; another is elected and rescues its jobs",
        Injection(Action.KILL, at_done=0.3),
        leader_victim=True,
    ),
    Scenario(
        "sigstop_leader",
        "SIGSTOP the maintenance leader past its lease; another leads; SIGCONT later",
        Injection(Action.STOP, at_done=0.3, ttls=4.0),
        leader_victim=True,
    ),
    Scenario(
        "periodic_kill9_leader",
        "a periodic task every second; kill -9 the leader that enqueues it: every instant "
        "runs once",
        Injection(Action.KILL, at_done=0.3),
        stores=_WITH_SPLIT,
        leader_victim=True,
        periodic=True,
        status=_ALL_OK,
    ),
    Scenario(
        "periodic_sigstop_leader",
        "a periodic task every second; SIGSTOP its leader past the lease, SIGCONT later: "
        "every instant runs once",
        Injection(Action.STOP, at_done=0.3, ttls=4.0),
        stores=_WITH_SPLIT,
        leader_victim=True,
        periodic=True,
        status=_ALL_OK,
    ),
    Scenario(
        "lost_ack",
        "one worker's completion commits are applied but their answer is lost",
        Injection(
            Action.FAULT,
            at_done=0.2,
            ttls=1.5,
            # The drill's handler completes its job inside ctx.transaction, so the
            # completion commit is the fenced transaction (ledger role); jobs_finish
            # and jobs_finish_and_claim (broker) carry the retries and releases, the
            # latter with the next claim, whose jobs are then lost to their worker too.
            store=StoreFaults(
                broker=RoleFaults(
                    fail_after=True,
                    probability=0.3,
                    methods=frozenset({"jobs_finish", "jobs_finish_and_claim"}),
                ),
                ledger=RoleFaults(fail_after=True, probability=0.3),
            ),
        ),
        stores=_WITH_SPLIT,
        status=StatusExpectation(maybe=frozenset({"ledger"})),
    ),
    Scenario(
        "redis_partition_one",
        "split topology: one worker loses Redis (proxy blackhole); PostgreSQL still answers",
        Injection(Action.FAULT, at_done=0.2, ttls=2.0, proxy=Faults(blackhole=True)),
        stores=frozenset({"split"}),
        status=_REDIS_DOWN,
    ),
    Scenario(
        "redis_partition_all",
        "split topology: every worker loses Redis for 2 lease TTLs; PostgreSQL still answers",
        Injection(
            Action.FAULT,
            Target.ALL,
            at_done=0.2,
            ttls=2.0,
            proxy=Faults(blackhole=True),
            reset=True,
        ),
        stores=frozenset({"split"}),
        status=_REDIS_DOWN,
    ),
    Scenario(
        "redis_failover",
        "split topology: the Redis primary is killed and its replica promoted, having "
        "missed the last writes; every worker's proxy moves to it",
        Injection(Action.FAILOVER, Target.ALL, at_done=0.3),
        stores=frozenset({"split"}),
        status=_REDIS_DOWN,
    ),
    Scenario(
        "partition_leases",
        "one worker can read the queue and write the ledger but not renew (zombie)",
        Injection(
            Action.FAULT, at_done=0.2, ttls=2.5, store=StoreFaults(leases=RoleFaults(error=True))
        ),
        stores=_WITH_SPLIT,
        status=StatusExpectation(failing=frozenset({"leases"})),
    ),
    Scenario(
        "partition_total",
        "one worker loses the store entirely (proxy blackhole / every role fails)",
        Injection(
            Action.FAULT, at_done=0.2, ttls=2.0, store=_ALL_ERROR, proxy=Faults(blackhole=True)
        ),
    ),
    Scenario(
        "partition_oneway",
        "one worker's requests arrive, the answers do not (server→client loss)",
        Injection(
            Action.FAULT, at_done=0.2, ttls=2.0, store=_ALL_LOST, proxy=Faults(drop_to_client=True)
        ),
    ),
    Scenario(
        "slow_store",
        "every call of every worker is slower than the store timeout",
        Injection(
            Action.FAULT,
            Target.ALL,
            at_done=0.2,
            ttls=1.5,
            store=StoreFaults(
                broker=RoleFaults(delay=1.0),
                leases=RoleFaults(delay=1.0),
                ledger=RoleFaults(delay=1.0),
            ),
            proxy=Faults(latency=0.5, jitter=0.1),
        ),
    ),
    Scenario(
        "flapping",
        "every worker's connection goes down and up every 300 ms",
        Injection(
            Action.FAULT,
            Target.ALL,
            at_done=0.2,
            ttls=1.5,
            store=_ALL_ERROR,
            proxy=Faults(refuse=True),
            reset=True,
            flap=0.3,
        ),
    ),
    Scenario(
        "clock_skew",
        "one worker's wall clock an hour ahead (killed mid-run), another's an hour behind",
        Injection(Action.KILL, at_done=0.3),
        skew=3600.0,
        every_worker_works=True,
    ),
    Scenario(
        "long_transaction",
        f"{HELD_JOBS} jobs keep their fenced transaction open for 1.5 lease TTLs",
        None,
        hold_ttls=1.5,
    ),
    Scenario(
        "slow_dependency",
        "the jobs' dependency times out for every worker for 2.5 lease TTLs, then heals",
        # Longer than the breaker's window (1 TTL), so that it opens during the fault
        # however many calls succeeded just before.
        Injection(Action.DEPENDENCY, Target.ALL, at_done=0.3, ttls=2.5),
        calls_dependency=True,
    ),
    Scenario(
        "pg_restart",
        "PostgreSQL restarts under load (simulated at the proxy: reset, refuse ~2 s)",
        Injection(
            Action.FAULT, Target.ALL, at_done=0.3, ttls=1.0, proxy=Faults(refuse=True), reset=True
        ),
        stores=frozenset({"postgresql"}),
    ),
)

#: Every scenario by name, in the order the drill runs them.
DRILL_SCENARIOS: Mapping[str, Scenario] = {s.name: s for s in _SCENARIOS}


def scenarios_for(scheme: str) -> list[Scenario]:
    """The scenarios that apply to a store of ``scheme`` (``sqlite``, ``postgresql``,
    ``split``)."""
    return [s for s in _SCENARIOS if s.applies_to(scheme)]
