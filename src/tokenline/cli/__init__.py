"""The ``tokenline`` command line.

Every option also reads a ``TOKENLINE_…`` environment variable (shown in ``--help``);
worker settings may also come from a TOML file (``--config``), lowest in precedence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from typing import Any

import click
from rich.markup import escape

from .._app import App
from .._config import (
    MAX_CLAIM_BATCH,
    MAX_CONCURRENCY,
    MAX_INTERVAL,
    MAX_LEASE_TTL,
    MAX_SECONDS,
    MIN_LEASE_TTL,
    Settings,
    WorkerSettings,
    load_settings,
    not_in_effect,
)
from .._errors import ConfigError, InvalidInputError
from .._jobs import MAX_DELAY, MAX_INT_DIGITS, MAX_PAYLOAD_DEPTH, MAX_PRIORITY, MIN_PRIORITY
from .._logging import configure as configure_logging
from .._records import validate_key
from .._redact import redact
from ..stores import Store, store_from_url
from ..worker import run_worker
from ..worker.worker import SignalLatch
from ._common import (
    CommandGroup,
    Prefetch,
    Seconds,
    Whole,
    app_option,
    console,
    err_console,
    log_level_option,
    opening,
    queue_name,
    refuse_memory_store,
    reporting_errors,
    resolve_app,
    url_option,
    with_store,
)
from .audit import audit
from .bench import bench
from .cancel import cancel
from .dashboard import dashboard
from .demo import demo
from .dlq import dlq
from .drill import drill
from .exporter import exporter
from .inspect import job, jobs, queues, workers
from .leases import drain, lease, leases
from .maintenance import maintenance, reconcile
from .scale import scale_hint_command
from .status import status

__all__ = ["main"]


@click.group(
    cls=CommandGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="tokenline")
def main() -> None:
    """tokenline: a job queue whose workers stay safe when coordination fails partly."""


def _env(name: str) -> dict[str, Any]:
    return {"envvar": f"TOKENLINE_{name}", "show_envvar": True, "default": None}


# The worker's duration options take the ranges WorkerSettings checks, from its own
# constants: a flag (or its variable) and a --config file must accept the same values.
def _above_zero(high: float) -> Seconds:
    """Seconds above 0 and at most ``high``, as a setting checked by ``_positive``."""
    return Seconds(0, high, low_open=True)


@main.command()
@app_option
@url_option
@click.option(
    "--queues", "-q", help="Comma-separated queues to consume [default: default].", **_env("QUEUES")
)
@click.option(
    "--concurrency",
    "-c",
    type=Whole(1, MAX_CONCURRENCY),
    help="Jobs run at once [default: 10].",
    **_env("CONCURRENCY"),
)
@click.option(
    "--lease-ttl",
    type=Seconds(MIN_LEASE_TTL, MAX_LEASE_TTL),
    help="Lease time-to-live, seconds [default: 30].",
    **_env("LEASE_TTL"),
)
@click.option(
    "--renew-interval",
    type=_above_zero(MAX_INTERVAL),
    help="Lease renewal period, <= TTL/3 [default: TTL/3, at most 10].",
    **_env("RENEW_INTERVAL"),
)
@click.option(
    "--lease-margin",
    type=_above_zero(MAX_SECONDS),
    help="Self-fencing margin under the TTL [default: TTL/10].",
    **_env("LEASE_MARGIN"),
)
@click.option(
    "--poll-interval",
    type=_above_zero(MAX_INTERVAL),
    help="Longest wait for new jobs, seconds [default: 1].",
    **_env("POLL_INTERVAL"),
)
@click.option(
    "--job-timeout",
    type=_above_zero(MAX_SECONDS),
    help="Hard limit per attempt when the task sets none [default: 300].",
    **_env("JOB_TIMEOUT"),
)
@click.option(
    "--drain-timeout",
    type=_above_zero(MAX_SECONDS),
    help="Time given to in-flight jobs on shutdown [default: 30].",
    **_env("DRAIN_TIMEOUT"),
)
@click.option(
    "--rescue-interval",
    type=_above_zero(MAX_INTERVAL),
    help="Period of the expired-lease rescue [default: 5].",
    **_env("RESCUE_INTERVAL"),
)
@click.option(
    "--reconcile-interval",
    type=_above_zero(MAX_INTERVAL),
    help="Period of the reconciler's pass [default: 30].",
    **_env("RECONCILE_INTERVAL"),
)
@click.option(
    "--effect-pending-deadline",
    type=_above_zero(MAX_SECONDS),
    help="Seconds an effect may stay pending after its lease is lost [default: 300].",
    **_env("EFFECT_PENDING_DEADLINE"),
)
@click.option(
    "--startup-wait",
    type=Seconds(0, MAX_INTERVAL),
    help="Seconds to keep trying an unavailable store at start-up, each try logged "
    "[default: 0, give up at once].",
    **_env("STARTUP_WAIT"),
)
@click.option(
    "--store-timeout",
    type=_above_zero(MAX_INTERVAL),
    help="Per-call store timeout [default: TTL/3].",
    **_env("STORE_TIMEOUT"),
)
@click.option(
    "--claim-batch",
    type=Whole(1, MAX_CLAIM_BATCH),
    help="Jobs claimed per round trip [default: free slots].",
    **_env("CLAIM_BATCH"),
)
@click.option(
    "--prefetch",
    type=Prefetch(),
    help="Jobs claimed ahead of free slots, held under lease; auto: as many as short "
    "handlers allow [default: auto].",
    **_env("PREFETCH"),
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    help="TOML file with a [tokenline.worker] table.",
    **_env("CONFIG"),
)
@log_level_option
@click.option(
    "--metrics-port",
    type=Whole(1, 65535),
    help="Serve /metrics, /healthz and /readyz on this port (needs tokenline[metrics]) "
    "[default: off].",
    **_env("METRICS_PORT"),
)
@click.option(
    "--metrics-host",
    help="Address the metrics port listens on [default: 127.0.0.1].",
    **_env("METRICS_HOST"),
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    help="text: prose lines; json: one object per line with worker, job, token, attempt, "
    "outcome and error class fields, and a line per job outcome [default: text].",
    **_env("LOG_FORMAT"),
)
def worker(
    app_spec: str | None,
    url: str | None,
    config: str | None,
    log_level: str | None,
    log_format: str | None,
    metrics_port: int | None,
    metrics_host: str | None,
    **options: Any,
) -> None:
    """Run a worker until SIGTERM (drain, then stop) or a second SIGTERM (stop now)."""
    configure_logging(log_level or "info", log_format or "text")
    if not app_spec:
        raise click.UsageError("--app (or TOKENLINE_APP) is required: the worker runs its tasks")
    with reporting_errors():
        app = resolve_app(app_spec, url)
        if options.get("queues"):
            queues = tuple(q.strip() for q in options["queues"].split(","))
            # An empty name (a,,b or a trailing comma) is a typo, not a list of two:
            # dropping it would run the worker without the queue that was meant there.
            if "" in queues:
                raise ConfigError(
                    "queues",
                    f"{options['queues']!r} has an empty queue name: give names separated "
                    "by single commas",
                )
            options["queues"] = queues
        settings = load_settings(WorkerSettings, options, file=config, section="tokenline.worker")
        if config is not None:
            _app_settings_in_effect(config, app, url)
        # Until the worker takes SIGTERM and SIGINT over, the latch keeps them for it (a
        # stop sent while the process starts is acted on); once the worker has stopped
        # and given them back, it ignores them: a late second SIGTERM must not kill,
        # with status 143, a process that stopped cleanly.
        latch = SignalLatch()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, latch)
        run_worker(
            app,
            settings,
            metrics_port=metrics_port,
            metrics_host=metrics_host or "127.0.0.1",
            # Said by run_worker: a process left with handler threads running ends there.
            report=lambda counters: console.print(
                f"worker stopped: {counters.summary()}", highlight=False, markup=False
            ),
        )
        # Ignored, not latched, from here: Python puts its own handlers back to the
        # defaults as the interpreter finalizes, and a signal then would kill it.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _app_settings_in_effect(config: str, app: App, url: str | None) -> None:
    """Refuse a ``--config`` whose ``[tokenline]`` table says what the app does not run
    with: the worker applies ``[tokenline.worker]``, and the app's settings come from
    the code that built it and the ``TOKENLINE_*`` variables, so such a key used to be
    checked and then silently ignored. Keys the app agrees with are in effect (the app
    may load this same file); ``--url`` and the variables win over the file."""
    overridden = {
        name
        for name in (f.name for f in dataclasses.fields(Settings))
        if os.environ.get(f"TOKENLINE_{name.upper()}")
    } | ({"url"} if url else set())
    differ = not_in_effect(config, app.settings, overridden=overridden)
    if differ:
        raise ConfigError(
            "config",
            f"[tokenline] in {config!r} is not in effect: {'; '.join(differ)}. A worker's "
            "--config applies [tokenline.worker] only; the app's settings come from the "
            "code that builds it (App(settings=load_settings(Settings, file=...)) reads "
            "this file) and TOKENLINE_* variables; the store's URL also from --url",
        )


class _LongInteger(Exception):
    """An integer in JSON text with more digits than an argument may have."""


def _json_int(digits: str) -> int:
    # Counted before int(): past Python's own limit (4300 digits unless the process
    # changed it) int() raises a bare ValueError naming neither the argument nor
    # tokenline's limit, which is MAX_INT_DIGITS in every process, as in the App.
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongInteger
    return int(digits)


def _decode_json(text: str, name: str) -> Any:
    """``text`` decoded as JSON, or an :class:`InvalidInputError` naming the argument
    (``name``: ``args`` or ``kwargs``, as the App's own refusals name them) and what is
    wrong with it."""
    try:
        return json.loads(text, parse_int=_json_int)
    except _LongInteger:
        problem = f"has an integer of more than {MAX_INT_DIGITS} digits (MAX_INT_DIGITS)"
    except RecursionError:
        problem = (
            f"is nested too deeply to decode (the limit is {MAX_PAYLOAD_DEPTH} levels per argument)"
        )
    except ValueError as exc:  # JSONDecodeError, and any limit of the decoder's own
        problem = f"is not valid JSON: {exc}"
    raise InvalidInputError(f"{name} {problem}")


def _idempotency_key(
    _ctx: click.Context | None, _param: click.Parameter | None, value: str | None
) -> str | None:
    """Callback of ``--key``: the key, checked as an enqueue checks it, or a usage error
    saying why it is none (``None``: not given)."""
    if value is None:
        return None
    try:
        return validate_key(value, "idempotency_key")
    except InvalidInputError as exc:
        raise click.BadParameter(str(exc)) from None


async def _nothing(store: Store) -> None:
    """Nothing, on an open store (:meth:`App.run` opens it first)."""


@main.command()
@app_option
@url_option
@click.argument("task")
@click.argument("args", required=False, default="[]")
@click.option("--kwargs", "kwargs_json", default=None, help="Keyword arguments as a JSON object.")
@click.option(
    "--key",
    "idempotency_key",
    default=None,
    callback=_idempotency_key,
    help="Idempotency key, e.g. invoice:42.",
)
@click.option(
    "--priority",
    type=Whole(MIN_PRIORITY, MAX_PRIORITY),
    default=None,
    help="Higher runs first.",
)
@click.option(
    "--delay", type=Seconds(0, MAX_DELAY), default=None, help="Seconds before the job may run."
)
@click.option("--queue", default=None, callback=queue_name, help="Override the task's queue.")
def enqueue(
    app_spec: str | None,
    url: str | None,
    task: str,
    args: str,
    kwargs_json: str | None,
    idempotency_key: str | None,
    priority: int | None,
    delay: float | None,
    queue: str | None,
) -> None:
    """Enqueue a job of TASK and print its id.

    ARGS is a JSON array of positional arguments, such as '[42, "eur"]' (default: none);
    --kwargs a JSON object of keyword arguments. The task must be registered by --app.
    Bad input (an unknown task, arguments the task does not take, an option out of
    range) exits with status 2, nothing stored; a store that fails, with 1.
    """
    if not app_spec:
        raise click.UsageError("--app (or TOKENLINE_APP) is required to check the task name")
    with reporting_errors(unsure="look for the job with `tokenline jobs` before enqueueing again"):
        try:
            parsed = _decode_json(args, "args")
            if not isinstance(parsed, list):
                raise InvalidInputError(f"ARGS must be a JSON array, got {args!r}")
            # Given, it must be an object, as ARGS must be an array: `null` was taken as
            # no keyword arguments, and an empty value was not read at all.
            kwargs = None if kwargs_json is None else _decode_json(kwargs_json, "kwargs")
            if kwargs_json is not None and not isinstance(kwargs, dict):
                raise InvalidInputError(f"--kwargs must be a JSON object, got {kwargs_json!r}")
            app = resolve_app(app_spec, url)
            try:
                refuse_memory_store(app, "enqueue")
                with opening():
                    app.run(_nothing)  # opens the store: its failure changed nothing
                jid = app.enqueue(
                    task,
                    *parsed,
                    kwargs=kwargs,
                    idempotency_key=idempotency_key,
                    priority=priority,
                    delay=delay,
                    queue=queue,
                )
            finally:
                app.close()
        except InvalidInputError as exc:
            # Bad input, like a bad option: status 2, as click gives a usage error.
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise SystemExit(2) from None
    console.print(jid)


def _warn(text: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)


def _listed(queues: set[str]) -> str:
    return ", ".join(sorted(queues)) or "none"


async def _queues_in_use(store: Store, app: App) -> set[str]:
    """The queues that hold jobs, were paused, are consumed by a worker or are those of
    the app's tasks: the ones a pause or resume is expected to name."""
    found = {s.queue for s in await store.queues_stats()}
    found.update(q for w in await store.workers_list() for q in w.queues)
    found.update(t.queue for t in app.tasks.values())
    return found


@main.command()
@app_option
@url_option
@click.argument("queue", callback=queue_name)
def pause(app_spec: str | None, url: str | None, queue: str) -> None:
    """Stop workers from claiming jobs of QUEUE (jobs stay queued).

    A queue that no job, worker or task of --app uses yet may be paused (before its
    first job), with a warning naming the queues in use: a misspelt name pauses
    nothing that runs. A queue already paused stays so, with a warning."""

    async def run(store: Store) -> tuple[set[str], bool]:
        known = await _queues_in_use(store, app)
        already = any(s.queue == queue and s.paused for s in await store.queues_stats())
        await store.queue_pause(queue=queue)
        return known, already

    with reporting_errors(unsure="see `tokenline queues`"):
        app = resolve_app(app_spec, url)
        refuse_memory_store(app, "pause")
        known, already = with_store(app, run, ledger=False)
    if already:
        # As resume says of a queue that was not paused: nothing on stdout, where a
        # script would read that this command paused it.
        _warn(f"queue {queue!r} was already paused; nothing changed")
        return
    if queue not in known:
        _warn(
            f"no job or worker uses queue {queue!r} (queues: {_listed(known)}); paused all the same"
        )
    console.print(f"paused {queue}", highlight=False, markup=False)


@main.command()
@app_option
@url_option
@click.argument("queue", callback=queue_name)
def resume(app_spec: str | None, url: str | None, queue: str) -> None:
    """Let workers claim jobs of QUEUE again. A queue that was not paused is left as it
    was, with a warning naming the paused ones."""

    async def run(store: Store) -> set[str]:
        paused = {s.queue for s in await store.queues_stats() if s.paused}
        await store.queue_resume(queue=queue)
        return paused

    with reporting_errors(unsure="see `tokenline queues`"):
        app = resolve_app(app_spec, url)
        refuse_memory_store(app, "resume")
        paused = with_store(app, run, ledger=False)
    if queue not in paused:
        # Nothing on stdout: a script reading it must not be told the queue was resumed.
        _warn(f"queue {queue!r} was not paused (paused queues: {_listed(paused)}); nothing changed")
        return
    console.print(f"resumed {queue}", highlight=False, markup=False)


@main.command()
@app_option
@url_option
@click.option(
    "--timeout",
    type=Seconds(0.1),
    default=120.0,
    show_default=True,
    help="Longest a migration statement may run, seconds.",
)
def migrate(app_spec: str | None, url: str | None, timeout: float) -> None:
    """Create or upgrade the store's schema (all pending steps in one transaction)."""
    with reporting_errors():
        app = resolve_app(app_spec, url)
        refuse_memory_store(app, "migrate")
        store = store_from_url(app.url, timeout=timeout, migrate=True)

        version = asyncio.run(store.migrate())
    done = store.migrated
    if version is None:
        said = "no schema to migrate"
    elif done is None:
        said = f"schema already up to date (schema version {version}), nothing done"
    elif done[0] == 0:
        said = f"schema created (schema version {version})"
    elif done[0] < done[1]:
        said = f"schema upgraded from version {done[0]} to {done[1]}"
    else:
        said = f"schema upgraded (schema version {version})"
    console.print(f"{escape(redact(app.url))}: {said}", highlight=False)


for command in (
    status,
    queues,
    workers,
    jobs,
    job,
    dlq,
    demo,
    bench,
    drill,
    exporter,
    dashboard,
    scale_hint_command,
):
    main.add_command(command)
main.add_command(audit)
for command in (leases, lease, drain, maintenance, reconcile, cancel):
    main.add_command(command)
