"""``tokenline drill``: inject partial failures into real workers and check the invariants.

See :mod:`tokenline.drill.runner` for how a scenario runs and
:mod:`tokenline.drill.checker` for what is checked. Exit status: 0 when every invariant
held in every scenario, 1 when one broke, 2 for bad input (nothing was started).
"""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from ..drill.dependency import NAME as DEPENDENCY
from ..drill.dependency import TIMEOUT
from ..drill.runner import Drill, DrillError, ScenarioResult
from ..drill.scenarios import DRILL_SCENARIOS
from ..stores.base import Role
from ._common import (
    Whole,
    console,
    err_console,
    interrupt_on_sigterm,
    plural,
    print_json,
    print_table,
)

__all__ = ["dependency_table", "drill", "periodic_table", "results_table", "status_table"]


def _count(n: int, bad: bool = True) -> str:
    return f"[bold red]{n}[/]" if n and bad else str(n)


def results_table(results: list[ScenarioResult], *, title: str) -> Table:
    """The drill's report: one row per scenario.

    "rescued": the longest time from a lease owner's last chance to renew (the fault, or
    the attempt's start) to the rescue of its lease, against the bound the checker holds
    it to; "running again": from the fault to the last affected job running again, which
    includes waiting for a free worker."""
    table = Table(title=title)
    for name in ("scenario", "jobs", "lost", "dup. effects", "stale writes", "early rescues"):
        table.add_column(name, justify="right" if name != "scenario" else "left")
    for name in ("stale refused", "dup. executions", "rescued (bound)", "running again"):
        table.add_column(name, justify="right")
    for name in ("verdict",):
        table.add_column(name, justify="right" if name != "verdict" else "left")
    for res in results:
        r = res.report
        recovery = "—" if r.recovery is None else f"{r.recovery:.1f}s ({plural(r.affected, 'job')})"
        rescued = "—" if r.rescue_lag is None else f"{r.rescue_lag:.1f}s"
        rescued += f" ({r.recovery_bound:.1f}s)"
        verdict = "[green]PASS[/]" if r.ok else "[bold red]FAIL[/]"
        if r.pending:
            verdict += f" ({r.pending} unfinished)"
        if r.backwards or r.late_recoveries:
            verdict += f" ({r.backwards} backwards, {r.late_recoveries} late)"
        if r.idle_workers:
            verdict += f" ({plural(r.idle_workers, 'idle worker')})"
        if r.dead_letters or r.spent_by_deferrals:
            verdict += (
                f" ({r.dead_letters} dead-lettered, "
                f"{plural(r.spent_by_deferrals, 'attempt')} spent held back)"
            )
        if r.status_wrong:
            verdict += " (status wrong)"
        table.add_row(
            res.scenario,
            str(r.jobs),
            _count(r.lost),
            _count(r.duplicate_effects),
            _count(r.stale_writes),
            _count(r.early_rescues),
            str(r.stale_refused),
            str(r.duplicate_executions),
            rescued,
            recovery,
            verdict,
        )
    return table


def dependency_table(results: list[ScenarioResult]) -> Table | None:
    """What the drill's dependency went through, for the scenarios whose jobs call it
    (``None``: none ran). "full throughput": from the heal to the first second that
    finished 90% as many jobs as the second before the fault, or to the last job when
    too few were left for that."""
    rows = [r for r in results if r.dependency is not None]
    if not rows:
        return None
    table = Table(title=f"dependency {DEPENDENCY} (timeout {TIMEOUT:g}s)")
    table.add_column("scenario")
    table.add_column("breakers")
    for name in ("fault", "calls", "calls/min in fault", "attempts burned", "dead-lettered"):
        table.add_column(name, justify="right")
    table.add_column("full throughput after heal", justify="right")
    for res in rows:
        d = res.dependency
        assert d is not None
        after = "—" if d.full_throughput_after is None else f"{d.full_throughput_after:.1f}s"
        table.add_row(
            res.scenario,
            "on" if d.breakers else "[yellow]off[/]",
            f"{d.fault_seconds:.1f}s",
            str(d.calls),
            f"{d.calls_per_minute:,.0f}",
            str(d.attempts_burned),
            _count(d.dead_lettered, bad=d.breakers),
            after,
        )
    return table


def periodic_table(results: list[ScenarioResult]) -> Table | None:
    """The periodic schedule's figures, for the scenarios that ran one (``None``: none
    did): the instants judged (from the first to the last finished), those run twice,
    those never run, those enqueued late, and the longest delay from an instant to its
    enqueue against the bound it was held to."""
    rows = [r for r in results if r.report.periodic_instants is not None]
    if not rows:
        return None
    table = Table(title="periodic schedule (every second, catch_up=all)")
    table.add_column("scenario")
    for name in ("instants", "doubled", "skipped", "late", "enqueued after (bound)"):
        table.add_column(name, justify="right")
    for res in rows:
        r = res.report
        lag = "—" if r.periodic_lag is None else f"{r.periodic_lag:.1f}s"
        table.add_row(
            res.scenario,
            str(r.periodic_instants),
            _count(r.periodic_doubled),
            _count(r.periodic_skipped),
            _count(r.periodic_late),
            f"{lag} ({r.periodic_bound:.1f}s)",
        )
    return table


def status_table(results: list[ScenarioResult]) -> Table | None:
    """What ``tokenline status`` said during each fault, run as the struck worker, for
    the scenarios that probed it (the split topology; ``None``: none did): each channel
    ok, or how it failed and the server its error named. "expected failing": the
    channels that had to fail (``?``: that may)."""
    rows = [r for r in results if r.status is not None and r.status_expected is not None]
    if not rows:
        return None
    table = Table(title="tokenline status during the fault, as the struck worker sees the store")
    table.add_column("scenario")
    table.add_column("expected failing")
    for role in Role:
        table.add_column(role.value)
    table.add_column("verdict")
    for res in rows:
        seen, expected = res.status, res.status_expected
        assert seen is not None
        assert expected is not None
        wanted = [*sorted(expected.failing), *(f"{c}?" for c in sorted(expected.maybe))]
        cells = []
        for role in Role:
            c = seen.channels.get(role.value)
            if c is None:
                cells.append("[bold red]no report[/]")
            elif c.ok is None:
                cells.append("—")
            elif c.ok:
                cells.append("[green]ok[/]")
            else:
                named = seen.named(role.value)
                where = escape(named) if named else "[bold red]no server named[/]"
                cells.append(f"[red]{escape(str(c.failure))}[/]: {where}")
        wrong = res.report.status_wrong
        verdict = "[green]right[/]" if not wrong else f"[bold red]WRONG[/] ({wrong})"
        table.add_row(res.scenario, ", ".join(wanted) or "none", *cells, verdict)
    return table


@click.command(short_help="Inject partial failures into real workers; check the invariants.")
@click.option(
    "--url",
    default=None,
    help="postgresql://… (a fresh schema per scenario, dropped afterwards), "
    "sqlite:///file (files beside it, one per scenario, created and left in place; a file "
    "that already holds data is refused unless --overwrite) or "
    "the split topology, split:?broker=redis://…&ledger=postgresql://… (a fresh key "
    "prefix and schema per scenario, removed afterwards). Default: SQLite files in "
    "temporary directories, removed afterwards. TOKENLINE_URL is not read.",
)
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    metavar="NAME",
    help=f"Scenario to run (repeatable; default: all that apply). One of: "
    f"{', '.join(DRILL_SCENARIOS)}.",
)
@click.option(
    "--jobs",
    type=Whole(10, 1_000_000),
    default=2000,
    show_default=True,
    help="Jobs enqueued in each scenario.",
)
@click.option(
    "--workers",
    type=Whole(2, 32),
    default=3,
    show_default=True,
    help="Worker processes in each scenario.",
)
@click.option(
    "--seed", type=Whole(), default=0, show_default=True, help="Fixes the fault schedule."
)
@click.option(
    "--proxy-port",
    type=Whole(0, 65535),
    default=0,
    help="First port of the per-worker fault proxies (PostgreSQL); 0: any free port.",
)
@click.option(
    "--breakers",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="Whether slow_dependency's jobs call their dependency behind its circuit breaker; "
    "off, for comparison, they call it without one, and dead-lettered jobs and spent "
    "attempts are reported, not failed on. Other scenarios are not affected.",
)
@click.option("--keep", is_flag=True, help="Keep the stores (schemas, files) for inspection.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Delete and recreate the SQLite files of --url even when they hold data the drill "
    "did not put there (without it, such a file is refused and nothing is touched).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@interrupt_on_sigterm
def drill(
    url: str | None,
    scenarios: tuple[str, ...],
    jobs: int,
    workers: int,
    seed: int,
    proxy_port: int,
    breakers: str,
    keep: bool,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Kill, pause, partition and slow real workers; check no job is lost or done twice."""
    runner = Drill(
        url=url,
        jobs=jobs,
        workers=workers,
        seed=seed,
        proxy_port=proxy_port,
        keep=keep,
        overwrite=overwrite,
        breakers=breakers == "on",
    )
    try:
        chosen = runner.select(scenarios)
        runner.preflight(chosen)
    except DrillError as exc:
        err_console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        raise SystemExit(2) from None
    ttl = runner.settings.lease_ttl
    if not as_json:
        console.print(
            f"{plural(len(chosen), 'scenario')} on {runner.scheme}, {plural(jobs, 'job')} "
            f"each, {plural(workers, 'worker')}, lease TTL {ttl:g}s, "
            f"rescue every {runner.settings.rescue_interval:g}s, seed {seed}",
            highlight=False,
            markup=False,
        )

    def progress(result: ScenarioResult) -> None:
        if not as_json:
            verdict = "pass" if result.report.ok else "FAIL"
            console.print(
                f"  {result.scenario}: {verdict} in {result.elapsed:.1f}s", highlight=False
            )

    def left_behind() -> None:
        for line in runner.kept:
            (err_console if as_json else console).print(
                f"left behind: {line}", highlight=False, markup=False, soft_wrap=True
            )

    try:
        results = runner.run(chosen, progress)
    except DrillError as exc:
        left_behind()
        err_console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        raise SystemExit(2) from None
    except BaseException:
        left_behind()
        raise
    failed = [r for r in results if not r.report.ok]
    if as_json:
        print_json([r.to_json() for r in results])
    else:
        title = f"tokenline drill — {runner.scheme}, lease TTL {ttl:g}s, seed {seed}"
        if not runner.breakers:
            title += ", breakers off"
        print_table(results_table(results, title=title))
        dependency = dependency_table(results)
        if dependency is not None:
            print_table(dependency)
        periodic = periodic_table(results)
        if periodic is not None:
            print_table(periodic)
        statuses = status_table(results)
        if statuses is not None:
            print_table(statuses)
        for res in failed:
            console.print(f"[bold red]{res.scenario}[/]:", highlight=False)
            for line in res.report.violations:
                console.print(f"  {line}", highlight=False, markup=False)
    left_behind()
    if failed:
        raise SystemExit(1)
