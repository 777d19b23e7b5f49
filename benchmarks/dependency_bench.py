"""What a circuit breaker saves a dependency that times out for a while, then heals.

Runs the drill's ``slow_dependency`` scenario (``tokenline drill``: real worker
processes on a fresh store, removed afterwards) with breakers on and off, interleaved,
``--rounds`` times (default 3): the jobs' dependency answers in 5 ms, then hangs past
its 0.2 s timeout for ``--fault-seconds`` (default 60), then answers again. Prints the
medians of: calls per second that reached the dependency during the fault, attempts
burned by its failures, jobs dead-lettered, and the time from the heal to full
throughput (to the first second finishing 90% as many jobs as the second before the
fault, or to the last job when too few were left for that) — with the machine's core
count and load average. Figures, not assertions; the drill's verdicts are printed too.

    python benchmarks/dependency_bench.py                        # SQLite, 60 s faults
    python benchmarks/dependency_bench.py --fault-seconds 20 --rounds 2
    python benchmarks/dependency_bench.py --url postgresql://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

from tokenline.drill.dependency import DependencyFigures
from tokenline.drill.runner import Drill, ScenarioResult
from tokenline.drill.scenarios import DRILL_SCENARIOS

SCENARIO = DRILL_SCENARIOS["slow_dependency"]


def run_once(
    url: str | None, *, jobs: int, workers: int, fault: float, breakers: bool, seed: int
) -> ScenarioResult:
    """One drill of ``slow_dependency`` whose fault lasts ``fault`` seconds."""
    drill = Drill(
        url=url, jobs=jobs, workers=workers, seed=seed, breakers=breakers, deadline=fault + 600
    )
    assert SCENARIO.injection is not None
    ttls = fault / drill.settings.lease_ttl
    scenario = dataclasses.replace(
        SCENARIO, injection=dataclasses.replace(SCENARIO.injection, ttls=ttls)
    )
    drill.preflight()
    (result,) = drill.run([scenario])
    return result


def _load() -> str:
    return " ".join(f"{n:.2f}" for n in os.getloadavg())


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _per_second(d: DependencyFigures) -> float:
    return d.calls_per_minute / 60


ROWS: list[tuple[str, Callable[[DependencyFigures], float | None], str]] = [
    ("calls/s to the dependency during the fault", _per_second, ".1f"),
    ("attempts burned by its failures", lambda d: d.attempts_burned, ".0f"),
    ("jobs dead-lettered", lambda d: d.dead_lettered, ".0f"),
    ("seconds from the heal to full throughput", lambda d: d.full_throughput_after, ".1f"),
]


def main() -> None:
    """Parse arguments, run both variants ``--rounds`` times, print the medians."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url",
        default=None,
        help="postgresql://… (a fresh schema per run, dropped after it); default: a SQLite "
        "file in a temporary directory, removed after it",
    )
    parser.add_argument(
        "--fault-seconds",
        type=float,
        default=60.0,
        help="how long the dependency times out (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each variant (default: %(default)s)"
    )
    parser.add_argument(
        "--jobs", type=int, default=3000, help="jobs per run (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=3, help="worker processes (default: %(default)s)"
    )
    args = parser.parse_args()
    load_before = _load()
    figures: dict[bool, list[DependencyFigures]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for breakers in (True, False):
            started = time.monotonic()
            result = run_once(
                args.url,
                jobs=args.jobs,
                workers=args.workers,
                fault=args.fault_seconds,
                breakers=breakers,
                seed=round_,
            )
            assert result.dependency is not None
            figures[breakers].append(result.dependency)
            verdict = "pass" if result.report.ok else "FAIL: " + "; ".join(result.report.violations)
            d = result.dependency
            print(
                f"round {round_ + 1}, breakers {'on ' if breakers else 'off'}: {verdict}; "
                f"{d.calls} calls, {_per_second(d):.1f}/s in a {d.fault_seconds:.1f}s fault, "
                f"{d.attempts_burned} attempts burned, {d.dead_lettered} dead, full "
                f"throughput {_cell(d.full_throughput_after, '.1f')}s after the heal "
                f"({time.monotonic() - started:.0f}s)",
                flush=True,
            )
    store = "SQLite" if args.url is None else "PostgreSQL"
    print(
        f"\n{store}, {args.jobs} jobs, {args.workers} workers x 4, a {args.fault_seconds:g}s "
        f"fault, {args.rounds} rounds; {os.cpu_count()} cores, load average (1/5/15 min) "
        f"{load_before} before, {_load()} after (medians):"
    )
    width = max(len(name) for name, _, _ in ROWS)
    print(f"  {'':{width}}  {'breakers on':>12}  {'breakers off':>12}")
    for name, get, fmt in ROWS:
        on = _cell(_median([get(d) for d in figures[True]]), fmt)
        off = _cell(_median([get(d) for d in figures[False]]), fmt)
        print(f"  {name:{width}}  {on:>12}  {off:>12}")


if __name__ == "__main__":
    main()
