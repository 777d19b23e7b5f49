"""``tokenline maintenance`` (a dedicated leader candidate) and ``tokenline reconcile``
(one reconciler pass, or a dry run)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import uuid
from collections.abc import Iterator

import click
from rich.markup import escape

from .._app import App
from .._clock import Clock
from .._config import WorkerSettings, load_settings
from .._errors import ConfigError
from .._logging import configure as configure_logging
from ..maintenance import (
    MAINTENANCE_LEASE,
    Leadership,
    MaintenanceRunner,
    Reconciler,
    ServiceReport,
    standard_services,
)
from ..stores.base import ResourceLease, Store
from ._common import (
    Whole,
    app_option,
    console,
    err_console,
    json_option,
    log_level_option,
    print_json,
    reporting_errors,
    resolve_app,
    url_option,
)

__all__ = ["current_leader", "maintenance", "reconcile"]

#: ``tokenline reconcile`` exit codes.
EXIT_CLEAN, EXIT_REPAIRED, EXIT_CANNOT_ACT = 0, 1, 2


def _owner(kind: str) -> str:
    # Identity per process start, as a worker's.
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _settings(config: str | None) -> WorkerSettings:
    return load_settings(WorkerSettings, {}, file=config, section="tokenline.worker")


async def current_leader(store: Store) -> tuple[ResourceLease | None, float]:
    """The maintenance lease if someone holds it now (by the store's clock), and now.

    The clock is read after the leases, as everywhere a listing ages what it read: on a
    slow link the other order dated the rows before they were read, and showed
    negative ages and expiries beyond the TTL."""
    leases = await store.resource_leases_list()
    now = await store.store_time()
    for lease in leases:
        if lease.resource == MAINTENANCE_LEASE and lease.expires_at > now:
            return lease, now
    return None, now


config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False),
    envvar="TOKENLINE_CONFIG",
    show_envvar=True,
    help="TOML file with a [tokenline.worker] table (lease_ttl, rescue_interval, …).",
)


@click.command()
@app_option
@url_option
@config_option
@log_level_option
@click.option(
    "--metrics-port",
    type=Whole(0, 65535),
    default=None,
    envvar="TOKENLINE_METRICS_PORT",
    show_envvar=True,
    help="Serve /metrics (repairs by service and kind, the leader term) on this port "
    "(0: any free port); its URL is printed.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar="TOKENLINE_METRICS_HOST",
    show_envvar=True,
    help="Address the metrics port listens on.",
)
def maintenance(
    app_spec: str | None,
    url: str | None,
    config: str | None,
    log_level: str | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run the maintenance services alone: stand for leadership and, while leader, run
    the rescuer, the reconciler, the pruner and the app's periodic jobs, each on its
    interval. Stops on SIGTERM or SIGINT, giving the lease back. Its settings come from
    --config and TOKENLINE_* as the worker's: lease_ttl, renew_interval, lease_margin,
    store_timeout, rescue_interval, reconcile_interval, effect_pending_deadline,
    retention_finished, retention_dead, retention_audit, prune_interval, prune_batch
    and periodic_interval."""
    configure_logging(log_level or "info", "text")
    with reporting_errors():
        settings = _settings(config)
        app = resolve_app(app_spec, url)
        owner = _owner("maintenance")
        console.print(f"maintenance {owner} standing for leadership", highlight=False)
        if not app.periodics:
            # While it leads, the workers' own schedulers stand idle: their schedules
            # would silently not run (the workers say so in their logs too).
            err_console.print(
                "note: this process runs no periodic schedule (no --app, or an app "
                "without one): while it leads maintenance, the periodic jobs of the "
                "workers' apps are not enqueued; give it --app",
                highlight=False,
                markup=False,
            )
        store = app.open_store(timeout=settings.call_timeout)
        with contextlib.ExitStack() as stack:
            if metrics_port is not None:
                stack.enter_context(_metrics(metrics_port, metrics_host))
            asyncio.run(_serve(app, store, settings, owner))
    console.print("maintenance stopped", highlight=False)


@contextlib.contextmanager
def _metrics(port: int, host: str) -> Iterator[None]:
    """Serve the maintenance metrics on ``host:port`` while the block runs."""
    try:
        import prometheus_client as prom

        from .. import events, metrics
    except ImportError as exc:
        raise ConfigError("metrics_port", str(exc)) from None
    registry = prom.CollectorRegistry()
    hook = metrics.WorkerMetrics(registry)
    server = metrics.serve(port, host=host, registry=registry)
    # The port bound, which with --metrics-port 0 only the server knows.
    console.print(f"maintenance metrics on {server.url}/metrics", markup=False, highlight=False)
    events.add_hook(hook)
    try:
        yield
    finally:
        events.remove_hook(hook)
        server.close()


async def _serve(app: App, store: Store, settings: WorkerSettings, owner: str) -> None:
    await store.open()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    leadership = Leadership(
        store, owner=owner, ttl=settings.lease_ttl, margin=settings.margin, clock=app.clock
    )
    runner = MaintenanceRunner(
        leadership,
        standard_services(store, settings, app),
        renew_interval=settings.renew_period,
    )
    task = asyncio.create_task(runner.run())
    try:
        await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await store.close()


@click.command()
@app_option
@url_option
@config_option
@click.option("--dry-run", is_flag=True, help="Print what would be repaired; change nothing.")
@json_option
def reconcile(
    app_spec: str | None, url: str | None, config: str | None, dry_run: bool, as_json: bool
) -> None:
    """One reconciler pass: find where the queue, the leases and the ledger disagree and
    repair it, printing each repair and the counts by kind.

    Without --dry-run it takes the maintenance leadership for the pass (its repairs are
    fenced by that term), and cannot act while another process leads.

    Exit code: 0 nothing to repair, 1 something was (with --dry-run: would be)
    repaired, 2 it could not act (another process leads, a newer term refused it, or
    the store could not be opened or failed during the pass: the error on stderr,
    nothing on stdout, --json too).
    A leader that died keeps its lease until the lease expires: the refusal says when
    (by the store's clock), and reconcile can act from then on.

    --json: {dry_run, leader (owner or null), term (or null), leader_expires_in
    (seconds until the lease of the leader that refused this pass expires, by the
    store's clock, else null), refused, counts: {kind: n}, repairs: [line],
    lost_from_broker: [{job_id, at}]}. On the split topology it also lists the jobs
    found gone from Redis by this pass or an earlier one (a worker's, usually), newest
    first: the ledger had seen them, and nothing else lists them.
    """
    # Not 1 for an outage: 1 says that something was repaired.
    with reporting_errors(failed=EXIT_CANNOT_ACT):
        settings = _settings(config)
        app = resolve_app(app_spec, url, existing=True)
        store = app.open_store(timeout=settings.call_timeout)
        report, lease, busy, now, lost = asyncio.run(
            _reconcile(store, settings, dry_run, app.clock)
        )
    expires_in = None if busy is None else max(0.0, busy.expires_at - now)
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "leader": lease.owner if lease else (busy.owner if busy else None),
                "term": lease.token if lease else (busy.token if busy else None),
                "leader_expires_in": None if expires_in is None else round(expires_in, 3),
                "refused": report.refused,
                "counts": dict(sorted(report.counts.items())),
                "repairs": report.lines,
                "lost_from_broker": [{"job_id": j, "at": at} for j, at in lost],
            }
        )
    elif busy is not None and expires_in is not None:
        err_console.print(
            f"[bold red]error:[/] {escape(busy.owner)} leads maintenance (term {busy.token}); "
            f"its lease expires in {math.ceil(expires_in):,} s by the store's clock unless "
            "it renews it, so a leader that died frees it then: wait and run this again, "
            "stop the leader, or run `tokenline reconcile --dry-run`",
            highlight=False,
        )
    else:
        _show(report)
        _show_lost(lost)
    if busy is not None or report.refused:
        raise SystemExit(EXIT_CANNOT_ACT)
    raise SystemExit(EXIT_REPAIRED if report.total else EXIT_CLEAN)


async def _reconcile(
    store: Store, settings: WorkerSettings, dry_run: bool, clock: Clock
) -> tuple[
    ServiceReport, ResourceLease | None, ResourceLease | None, float, list[tuple[int, float]]
]:
    """The pass's report, the lease it ran under, the lease of the leader that refused
    it, the store's time when it was refused (else 0), and the jobs found gone from
    the broker by this pass or an earlier one (split topology)."""
    await store.open()
    try:
        report, lease, busy, now = await _reconcile_pass(store, settings, dry_run, clock)
        return report, lease, busy, now, await _flagged_lost(store)
    finally:
        await store.close()


async def _flagged_lost(store: Store) -> list[tuple[int, float]]:
    """The jobs a reconciler flagged lost from the broker, on a split store (their
    Redis hash is gone, so nothing else lists them); else none."""
    flagged = getattr(store, "jobs_flagged_lost", None)
    return [] if flagged is None else list(await flagged(limit=_LOST_SHOWN))


#: How many jobs flagged lost from the broker `tokenline reconcile` lists, newest first.
_LOST_SHOWN = 100


async def _reconcile_pass(
    store: Store, settings: WorkerSettings, dry_run: bool, clock: Clock
) -> tuple[ServiceReport, ResourceLease | None, ResourceLease | None, float]:
    """The pass's report, the lease it ran under, the lease of the leader that refused
    it, and the store's time when it was refused (else 0), on the open ``store``."""
    service = Reconciler(
        store,
        interval=settings.reconcile_interval,
        pending_deadline=settings.effect_pending_deadline,
    )
    if dry_run:
        return await service.run_once(leader=None, dry_run=True), None, None, 0.0
    leadership = Leadership(
        store,
        owner=_owner("reconcile"),
        ttl=settings.lease_ttl,
        margin=settings.margin,
        clock=clock,
    )
    lease = await leadership.elect()
    if lease is None:
        holder, now = await current_leader(store)
        return ServiceReport(service.name, refused=True), None, holder, now
    try:
        return await service.run_once(leader=lease), lease, None, 0.0
    finally:
        await leadership.resign()


def _show_lost(lost: list[tuple[int, float]]) -> None:
    """The jobs flagged lost from the broker, by this pass or an earlier one."""
    if not lost:
        return
    ids = ", ".join(str(job_id) for job_id, _ in lost)
    more = f" (the {_LOST_SHOWN} newest)" if len(lost) >= _LOST_SHOWN else ""
    console.print(
        f"jobs found gone from the broker (job_lost_from_broker){more}: {ids}; the "
        "ledger had seen them, not completed: enqueue them again if they must run",
        highlight=False,
    )


def _show(report: ServiceReport) -> None:
    for line in report.lines:
        console.print(escape(line), highlight=False)
    verb = "would repair" if report.dry_run else "repaired"
    if report.refused:
        console.print("refused: a newer maintenance term exists; nothing repaired")
    elif not report.total:
        console.print("nothing to repair", highlight=False)
    else:
        counts = ", ".join(f"{k} {n}" for k, n in sorted(report.counts.items()))
        console.print(f"{verb} {report.total}: {counts}", highlight=False)
