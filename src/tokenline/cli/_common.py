"""Shared pieces of the command line: app loading, store access, error reporting, and
how output is printed.

Anything that came from a user, a config file or the store (names, keys, errors,
arguments, URLs) is printed as plain text, never read as rich markup: a
``[tokenline.worker]`` in a message must reach the reader as written. Nor may it act on
the terminal: both consoles write control characters (an ESC in a stored error) as
escapes, ``\x1b``, in whatever they print. Tables go through :func:`show`, which fits
them to the terminal without cutting names.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import importlib
import logging
import math
import os
import re
import signal
import sys
import sysconfig
import threading
import traceback
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, cast

import click
from rich import box
from rich.cells import cell_len
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.segment import Segments
from rich.table import Table
from rich.text import Text

from .._app import App
from .._config import parse_prefetch, validate_queue_name
from .._errors import (
    ConfigError,
    OutcomeUnknownError,
    QueueNameError,
    StoreError,
    StoreUnavailableError,
    TokenlineError,
)
from .._logging import LEVELS, json_text, printable
from .._redact import redact
from ..stores import Store, refuse_sqlite_url_options, split_url
from ..stores.base import MAX_JOB_ID

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class SafeConsole(Console):
    """A console that prints control characters as escapes (see the module docstring):
    every string it renders, a message or a table's cell, goes through
    :func:`~tokenline._logging.printable` first."""

    def render_str(self, text: str, **options: Any) -> Text:
        """``text`` made printable, then rendered as rich renders it."""
        return super().render_str(printable(text), **options)


# soft_wrap: a message is never broken at the terminal's width, so a path, a URL or an
# id in it stays whole for whoever copies it or greps for it (tables lay out as before).
console = SafeConsole(soft_wrap=True)
err_console = SafeConsole(stderr=True, soft_wrap=True)


def load_app(spec: str) -> App:
    """Import ``module:attribute`` and return the :class:`App` it names; the attribute
    may be dotted (``myproject.jobs:registry.app``), and a missing one is named."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{spec!r}: expected module:attribute, e.g. myproject.jobs:app")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not exc.name or not _names_module(exc.name, module_name):
            raise click.BadParameter(_import_failed(module_name, exc)) from None
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}") from None
    except Exception as exc:  # the user's module: any error of its own, not an exit
        raise click.BadParameter(_import_failed(module_name, exc)) from None
    app: object = module
    done: list[str] = []
    for part in attr.split("."):
        if not part:
            raise click.BadParameter(f"{spec!r}: the attribute path {attr!r} has an empty name")
        # A missing name must be said so: getattr's default of None was reported as
        # "not a tokenline.App (got NoneType)", as if the name were set to None.
        if not hasattr(app, part):
            where = (
                f"{module_name}:{'.'.join(done)} ({type(app).__name__})"
                if done
                else f"module {module_name!r}"
            )
            raise click.BadParameter(f"{spec!r}: {where} has no attribute {part!r}")
        app = getattr(app, part)
        done.append(part)
    if not isinstance(app, App):
        raise click.BadParameter(f"{spec!r} is not a tokenline.App (got {type(app).__name__})")
    return app


def _names_module(missing: str, module_name: str) -> bool:
    """Whether ``missing`` (a :class:`ModuleNotFoundError`'s name) is ``module_name`` or
    one of its packages: the module asked for is not there, rather than failing on an
    import of its own."""
    return module_name == missing or module_name.startswith(missing + ".")


def _import_failed(module_name: str, exc: BaseException) -> str:
    """``importing 'mod' failed: KeyError: 'MISSING' (at mod.py, line 3)``: the error
    the user's module raised while it was imported, and where in the user's code."""
    # A syntax error's own text already ends in "(file, line N)", said below.
    text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    where = _where_raised(exc)
    return f"importing {module_name!r} failed: {what}" + (f" (at {where})" if where else "")


def _library_paths() -> tuple[str, ...]:
    """Where Python's own library and installed packages live."""
    paths = sysconfig.get_paths()
    found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.join(os.path.realpath(p), "") for p in found)


#: Where tokenline's own modules live (this package's parent).
_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")


def _where_raised(exc: BaseException) -> str | None:
    """``file, line N`` of the user's code that raised ``exc`` while being imported: the
    last frame past the import machinery outside tokenline, Python's library and
    installed packages (``os.environ[…]`` fails inside os.py, and a task's bad queue
    name inside tokenline's check, called from the user's line), else the first one
    outside tokenline, the imported module's own line, else the last one (the module
    imported is tokenline's). A syntax error names its own file and line."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{exc.filename}, line {exc.lineno}"
    frames = list(traceback.extract_tb(exc.__traceback__))
    machinery = (__file__, importlib.__file__ or "")
    while frames and (frames[0].filename in machinery or frames[0].filename.startswith("<frozen ")):
        del frames[0]
    frames = [f for f in frames if not f.filename.startswith("<frozen ")]
    if not frames:
        return None
    # tokenline is not always among the installed packages (a source checkout on
    # PYTHONPATH, an editable install): its own frames are looked past by name, and so
    # is code it generated (a dataclass's __init__, in "<string>"), which is no file.
    outside = [
        f
        for f in frames
        if not f.filename.startswith("<") and not os.path.realpath(f.filename).startswith(_PACKAGE)
    ]
    library = _library_paths()
    own = [f for f in outside if not os.path.realpath(f.filename).startswith(library)]
    frame = own[-1] if own else outside[0] if outside else frames[-1]
    return f"{frame.filename}, line {frame.lineno}"


def resolve_app(
    app_spec: str | None,
    url: str | None,
    *,
    existing: bool = False,
    ledger: bool = True,
    reports_outage: bool = False,
    timeout: float | None = None,
    migrate: bool | None = None,
) -> App:
    """The app named by ``--app``, else a bare app on ``--url`` / ``TOKENLINE_URL``.

    ``existing``: the command only reads the store, or acts on what is in it, so a
    SQLite file or a PostgreSQL schema that is not there is refused (see
    :func:`require_store`) rather than created empty where a path or a name was
    mistyped. ``ledger=False``: the command uses only the broker and lease roles (see
    :func:`with_store`), so on the split topology the ledger's schema is not looked
    for either: Redis has none, and a ledger that does not answer would hold the
    command up for its connection timeout. ``reports_outage``: the command shows an
    outage itself (the dashboard, serving through it; ``scale-hint``, whose answer to
    it is hold), so a server that does not answer is not an error here. ``timeout``:
    the store timeout for these checks (default: the app's). ``migrate``: whether
    opening the store may upgrade its schema (default: not for a command that reads or
    acts on what is there, so that diagnosing with a newer tokenline never upgrades a
    production schema behind the operator's back; ``tokenline migrate`` does that).

    With both, and a URL other than the one the app was built with, the result is the
    app's tasks and settings on the given store: a worker started that way must run the
    app's jobs there, not dead-letter them all as unknown. It is said on stderr, naming
    both URLs, because an exported ``TOKENLINE_URL`` can be the reason.
    """
    if not app_spec:
        app = App(url)
    else:
        app = load_app(app_spec)
        # An empty --url is refused (by App) as it is without --app: never taken as
        # "the app's own", which would act on a store nobody named.
        if url is not None and url != app.url:
            moved = app.on(url)
            err_console.print(
                f"note: {app_spec} was built for {redact(app.url)}; using {redact(url)} "
                "(from --url or TOKENLINE_URL)",
                highlight=False,
                markup=False,
            )
            app = moved
    check_sqlite_url(app.url)
    may_migrate = not existing if migrate is None else migrate
    if not may_migrate:
        app.settings = dataclasses.replace(app.settings, migrate=False)
    if existing:
        # An unopened handle, asked before anything is done.
        store = app.open_store(timeout=timeout)
        if ledger or broker_opener(store) is None:
            require_store(store, reports_outage=reports_outage)
        note_unused(store, reports_outage=reports_outage)
    return app


def note_unused(store: Store, *, reports_outage: bool = False) -> None:
    """Say on stderr when ``store`` has no trace of ever being used where that is not
    refused (a Redis key prefix: see :meth:`RedisStore.unused`). A server that does
    not answer is reported at once, as :func:`require_store` does."""
    note = _ask_first(store, "unused", reports_outage=reports_outage)
    if note is not None:
        err_console.print(f"note: {note}", highlight=False, markup=False)


def _ask_first(store: Store, question: str, *, reports_outage: bool) -> str | None:
    """The answer of ``store``'s method ``question`` (``missing``, ``unused``: a store
    without it has nothing to say), asked before the command does anything, so an
    error here changed nothing. A server that does not answer raises, unless the
    command reports the outage itself (``reports_outage``)."""
    ask = getattr(store, question, None)
    if ask is None:
        return None
    try:
        with opening():
            answer: str | None = asyncio.run(ask())
    except StoreUnavailableError:
        if not reports_outage:
            raise
        return None
    return answer


def check_sqlite_url(url: str) -> None:
    """Refuse a ``sqlite:`` URL that names no file (``sqlite://relative.db``,
    ``sqlite:///``) as a bad setting, exit status 2 like every other malformed URL;
    the store itself says so only when opened, as a store error (exit status 1). So is
    one with a query string or a fragment (see :func:`refuse_sqlite_url_options`)."""
    if url.split(":", 1)[0].strip().lower() != "sqlite":
        return
    from ..stores.sqlite.store import path_from_url

    refuse_sqlite_url_options(url)

    try:
        path_from_url(url)
    except StoreError as exc:
        raise ConfigError("url", str(exc)) from None


def require_store(store: Store, *, reports_outage: bool = False) -> None:
    """Exit with status 2 when ``store`` (unopened) is not there, naming what is
    missing: a SQLite file ("no tokenline store at PATH") or a PostgreSQL schema ("the
    tokenline schema 'x' of database 'y' on host:port is not installed"). Nothing is
    created. A server that does not answer is reported at once, as opening the store
    would report it after waiting as long again (``reports_outage``: left to the
    command, which shows the outage); one that refuses the question is left to opening
    the store, which says why."""
    what = _ask_first(store, "missing", reports_outage=reports_outage)
    if what is not None:
        err_console.print(
            f"[bold red]error:[/] {escape(what)} (nothing was created; check --url or "
            "TOKENLINE_URL, or create one with `tokenline migrate`)",
            highlight=False,
        )
        raise SystemExit(2)


def refuse_memory_store(app: App, command: str) -> None:
    """Refuse, as a usage error, a ``command`` that would store something on a
    ``memory://`` store: that store lives only inside one process, so a job, a pause or
    a schema written there would be gone as this command exits, after reporting
    success."""
    if app.url.split(":", 1)[0].strip().lower() == "memory":
        raise click.UsageError(
            f"{command} on {redact(app.url)}: the memory store lives only inside one process, so "
            "what this command stores would be gone when it exits; give a sqlite:/// or "
            "postgresql:// URL (--url or TOKENLINE_URL)"
        )


def broker_opener(store: Store) -> Callable[[], Coroutine[Any, Any, None]] | None:
    """How to open ``store``'s broker and leases alone, for a command that needs nothing
    else; ``None`` when they are not apart from the rest (only the split topology has
    its ledger elsewhere: :meth:`SplitStore.open_broker`)."""
    opener: Callable[[], Coroutine[Any, Any, None]] | None = getattr(store, "open_broker", None)
    return opener


def with_store(
    app: App, fn: Callable[[Store], Coroutine[Any, Any, T]], *, ledger: bool = True
) -> T:
    """Open a store for ``app``, run ``fn`` on it and close it; closed also when opening
    it failed part way (a pool opened before the failure is not left to the loop's end).

    ``ledger=False``: ``fn`` uses only the broker and lease roles (queues, jobs,
    workers, leases), so on the split topology only Redis is opened, and the command
    works while the ledger's PostgreSQL is down."""

    async def run() -> T:
        store = app.open_store()
        try:
            open_broker = None if ledger else broker_opener(store)
            with opening():
                if open_broker is not None:
                    await open_broker()
                else:
                    await store.open()
            return await fn(store)
        finally:
            with contextlib.suppress(TokenlineError):
                await store.close()

    return asyncio.run(run())


def config_problem(exc: ConfigError) -> str:
    """What is wrong with a setting, naming its ``TOKENLINE_…`` variable and value when
    that is where it came from: the reader fixes the variable, not a setting name."""
    variable = f"TOKENLINE_{exc.setting.upper()}"
    raw = os.environ.get(variable)
    if raw is None or _given_on_command_line(exc.setting):
        return str(exc)
    return f"{variable}={raw!r} is invalid (setting {exc.setting}): {exc.reason}"


def _given_on_command_line(setting: str) -> bool:
    """Whether the running command's option for ``setting`` was given on its command
    line, which wins over the variable: the variable is then not what was wrong."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.get_parameter_source(setting) is click.core.ParameterSource.COMMANDLINE:
            return True
        ctx = ctx.parent
    return False


def report_error(exc: TokenlineError, *, unsure: str | None = None, failed: int = 1) -> NoReturn:
    """Print ``exc`` as one line on stderr and exit: status 2 for a bad setting (nothing
    was done), ``failed`` (1 unless the command gives 1 a meaning of its own) for any
    other tokenline error. ``unsure``: what to look at when the store was lost during a
    change (it may have made the change before its answer was lost), said after the
    error; given, a change the store is known to have refused whole is said not to have
    been made."""
    if isinstance(exc, ConfigError):
        err_console.print(f"[bold red]error:[/] {escape(config_problem(exc))}", highlight=False)
        raise SystemExit(2) from None
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    if unsure is not None and isinstance(exc, StoreUnavailableError) and exc not in _UNOPENED:
        if exc.changed_nothing:
            # The store refused the change whole (a write lock it never got, a server
            # that takes no writes): saying it may have been made sent the operator
            # looking for a change that nobody made.
            note = (
                "the store did not take this change at all, so nothing was changed; "
                "`tokenline status` says what keeps it from writing (a write lock held "
                "elsewhere, a server that takes no writes)"
            )
        elif isinstance(exc, OutcomeUnknownError):
            # It says itself that the change may have been made.
            note = unsure
        else:
            note = f"the store may have made the change before its answer was lost; {unsure}"
        err_console.print(f"note: {note}", highlight=False, markup=False)
    raise SystemExit(failed) from None


#: Errors of opening a store (see :func:`opening`): nothing was asked of it yet, so no
#: change can have been made.
_UNOPENED: weakref.WeakSet[BaseException] = weakref.WeakSet()


@contextlib.contextmanager
def opening() -> Iterator[None]:
    """Around opening a store: a store error raised here is known to have changed
    nothing (:func:`report_error` then adds no note that it may have)."""
    try:
        yield
    except TokenlineError as exc:
        _UNOPENED.add(exc)
        raise


#: Libraries whose own warnings an operator command keeps off the terminal: the store's
#: error, said once on one line, tells what failed ("discarding closed connection" and
#: the like would come before it, as raw log lines).
_QUIET_LIBRARIES = ("psycopg", "redis")


@contextlib.contextmanager
def reporting_errors(*, unsure: str | None = None, failed: int = 1) -> Iterator[None]:
    """Turn tokenline errors into a one-line message: exit status 2 for a bad setting,
    ``failed`` for the others (see :func:`report_error`, and its ``unsure``). Where logging is
    not configured (every command but the long-running ones), the drivers' warnings
    are not printed."""
    if not logging.getLogger().handlers:
        for name in _QUIET_LIBRARIES:
            quiet = logging.getLogger(name)
            if not any(isinstance(h, logging.NullHandler) for h in quiet.handlers):
                quiet.addHandler(logging.NullHandler())
    try:
        yield
    except TokenlineError as exc:
        report_error(exc, unsure=unsure, failed=failed)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` with its noun in the number it takes: ``1 job``, ``0 jobs``, ``2 keys``."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def when(ts: float | None) -> str:
    """A UTC timestamp for tables; any stored value prints, however far off its date."""
    if ts is None:
        return "-"
    try:
        seconds = float(ts)
    except (OverflowError, ValueError, TypeError):
        return "?"
    try:
        t = dt.datetime.fromtimestamp(seconds, dt.UTC)
    except (OverflowError, OSError, ValueError):  # NaN, infinite, or past 1-9999 AD
        return f"{seconds:.6g} (epoch seconds)"
    return (
        f"{t.year:04d}-{t.month:02d}-{t.day:02d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d}.{t.microsecond // 1000:03d}"
    )


def ago(seconds: float | None) -> str:
    """A short age such as ``3.2s``, ``4m10s``, ``5h02m`` or ``12d03h``; any value prints."""
    if seconds is None:
        return "-"
    try:
        x = float(seconds)
    except (OverflowError, ValueError, TypeError):
        return "?"
    if x != x or abs(x) == float("inf"):
        return str(x)
    if x < 0:
        return f"-{ago(-x)}"
    if x < 60:
        return f"{x:.1f}s"
    if x >= 1e9:  # over 31 years: only the order of magnitude tells anything
        return f"{x:.3g}s"
    minutes, secs = divmod(int(x), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


#: The longest duration any option takes (seconds): a day. Beyond it a timeout or a
#: period means "never", which none of them is for.
DAY = 86_400.0


if TYPE_CHECKING:
    _FloatType = click.ParamType[float]
else:  # generic only from click 8.2 on; the dependency allows 8.1
    _FloatType = click.ParamType


class Seconds(_FloatType):
    """A finite number of seconds from ``low`` to ``high``, for every float option.

    ``float`` let ``nan``, ``inf`` and ``1e-9`` through (from the option or its
    ``TOKENLINE_…`` variable) to fail later in a traceback or be misreported; this
    refuses them as a usage error naming the option, exit status 2. ``low_open``: the
    low end itself is excluded (a period of 0 would spin).
    """

    name = "seconds"

    def __init__(self, low: float, high: float = DAY, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def _range(self) -> str:
        return f"{self.low:g} {'<' if self.low_open else '<='} x <= {self.high:g}"

    def get_metavar(self, param: click.Parameter, *args: Any, **kwargs: Any) -> str:
        """How the option's value shows in --help."""
        return "SECONDS"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        """The value as a float, or a usage error saying why it is none."""
        if isinstance(value, float | int) and not isinstance(value, bool):
            number = float(value)
        else:
            text = str(value).strip()
            try:
                number = float(text)
            except ValueError:
                self.fail(f"{value!r} is not a number of seconds", param, ctx)
            # float() also reads "1_0" and other scripts' digits ("٣" as 3).
            if math.isfinite(number) and not _DECIMAL_TEXT.fullmatch(text):
                self.fail(f"{value!r} is not a number of seconds in digits 0-9", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        below = number <= self.low if self.low_open else number < self.low
        if below or number > self.high:
            self.fail(f"{value!r} is not in the range {self._range()} (seconds)", param, ctx)
        return number


if TYPE_CHECKING:
    _PrefetchType = click.ParamType[int | str]
else:
    _PrefetchType = click.ParamType


class Prefetch(_PrefetchType):
    """``--prefetch``: ``auto`` or a whole number of jobs (its range is the setting's)."""

    name = "prefetch"

    def get_metavar(self, param: click.Parameter, *args: Any, **kwargs: Any) -> str:
        """How the option's value shows in --help."""
        return "auto|N"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | str:
        """``"auto"`` or the number, or a usage error saying why it is neither."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_prefetch(str(value))
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor a whole number of jobs", param, ctx)


def queue_name(
    _ctx: click.Context | None, _param: click.Parameter | None, value: str | None
) -> str | None:
    """Callback of every option or argument naming one queue: the name, checked as an
    enqueue checks it, or a usage error saying why it is none (``None``: not given)."""
    if value is None:
        return None
    try:
        return validate_queue_name(value)
    except QueueNameError as exc:
        raise click.BadParameter(str(exc)) from None


#: A whole number as typed: ASCII digits, a minus sign first for a negative one.
_WHOLE_TEXT = re.compile(r"-?[0-9]+")
#: A number of seconds as typed: ASCII digits, a point, an exponent.
_DECIMAL_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class Whole(click.IntRange):
    """A whole number in a range, written in ASCII digits, for every integer option and
    argument: ``int()`` also reads ``1_0`` as 10 and other scripts' digits (``٣`` as 3),
    which would name a job, or set a priority, nobody typed."""

    def _describe_range(self) -> str:
        # Unbounded: nothing to say (click would print "x<=None" in the help).
        if self.min is None and self.max is None:
            return ""
        return super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number, or a usage error naming the text that is not one."""
        if isinstance(value, str) and not _WHOLE_TEXT.fullmatch(value.strip()):
            self.fail(f"{value!r} is not a whole number in digits 0-9", param, ctx)
        return super().convert(value, param, ctx)


#: A job id given on the command line: every store's ids are 1 to 2**63 - 1, so anything
#: else is refused naming the argument, before the store is asked (a batch with one
#: impossible id must not leave the others undone, nor fail halfway).
ID = Whole(1, MAX_JOB_ID)
#: A token given on the command line: 64-bit like the ids (0 names none held yet).
TOKEN = Whole(0, MAX_JOB_ID)


_url = click.option(
    "--url",
    envvar="TOKENLINE_URL",
    show_envvar=True,
    default=None,
    help="Store URL (default: the app's, else sqlite:///tokenline.db).",
)
_ROLE_HELP = {
    "broker": "Split topology: the broker's Redis URL (with --ledger; replaces --url).",
    "leases": "Split topology: the lease store's Redis URL [default: the broker's].",
    "ledger": "Split topology: the ledger's PostgreSQL URL (with --broker).",
}

#: What each role the split topology cannot do without takes.
_ROLE_NEEDS = {
    "broker": "the broker's redis://host:port/db URL",
    "ledger": "the ledger's postgresql://… URL",
}


def interrupt_on_sigterm(fn: F) -> F:
    """Run the command with SIGTERM taken as Ctrl-C (``KeyboardInterrupt``).

    For the commands that start worker processes of their own (demo, bench, drill):
    their clean-up for an interrupt stops, wakes (a worker the demo paused) and reaps
    every one of them and says what was left behind. SIGTERM, which a supervisor, a
    CI timeout or ``timeout`` sends, killed the command alone, leaving its workers
    running for ever, one of them stopped."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, interrupt)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return cast(F, wrapper)


def url_option(fn: F) -> F:
    """``--url``, and the split topology's ``--broker`` / ``--leases`` / ``--ledger``
    (``TOKENLINE_BROKER`` …), which together stand for one URL: the command gets ``url``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        roles = {role: kwargs.pop(role) for role in _ROLE_HELP}
        # Click reads an empty variable as unset, and the app would fall back to its own
        # URL (sqlite:///tokenline.db): the wrong store, silently.
        empty = os.environ.get("TOKENLINE_URL", "unset").strip() == ""
        if empty and not kwargs.get("url") and not any(roles.values()):
            raise click.UsageError(
                "TOKENLINE_URL is set but empty: set it to a store URL, or unset it "
                "to use the app's"
            )
        if any(roles.values()):
            if kwargs.get("url"):
                raise click.UsageError(
                    "give --url (TOKENLINE_URL) or the split topology's --broker, --leases "
                    "and --ledger (TOKENLINE_BROKER …), not both"
                )
            # A role left out is missing, not a URL of the wrong kind: split_url would
            # say that the split topology needs postgresql://… here, "got ''".
            for role in ("broker", "ledger"):
                if not roles[role]:
                    given = " and ".join(f"--{r}" for r, v in roles.items() if v)
                    raise click.UsageError(
                        f"--{role} (TOKENLINE_{role.upper()}) is missing: with {given}, "
                        f"the split topology also needs {_ROLE_NEEDS[role]}"
                    )
            try:
                kwargs["url"] = split_url(
                    roles["broker"] or "", roles["ledger"] or "", roles["leases"]
                )
            except ConfigError as exc:
                raise click.BadParameter(exc.reason, param_hint=f"--{exc.setting}") from None
        return fn(*args, **kwargs)

    decorated: Any = wrapper
    for role in reversed(tuple(_ROLE_HELP)):
        decorated = click.option(
            f"--{role}",
            envvar=f"TOKENLINE_{role.upper()}",
            show_envvar=True,
            default=None,
            help=_ROLE_HELP[role],
        )(decorated)
    return cast(F, _url(decorated))


#: ``--log-level`` (``TOKENLINE_LOG_LEVEL``) of every command that logs: one of
#: :data:`~tokenline._logging.LEVELS`, any case, checked before the command runs (an
#: unknown level used to reach the logging set-up and end in a traceback).
log_level_option = click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    envvar="TOKENLINE_LOG_LEVEL",
    show_envvar=True,
    default=None,
    help="Log verbosity [default: info].",
)


app_option = click.option(
    "--app",
    "app_spec",
    envvar="TOKENLINE_APP",
    show_envvar=True,
    default=None,
    help="The application as module:attribute (the attribute may be dotted), e.g. "
    "myproject.jobs:app.",
)


class CommandGroup(click.Group):
    """A command group whose listing shows each command's first sentence whole.

    Click cuts a summary to fit one line at the terminal's width; here it wraps
    instead, so no summary ends in "...". A tokenline error no command caught (a bad
    ``TOKENLINE_…`` variable met while building an app, say) is one line, not a
    traceback. A command interrupted by Ctrl-C exits with status 130, as the shell
    reports a process ended by SIGINT (click's own "Aborted!" exits 1, as a failure
    would); the services that stop gracefully on SIGINT (worker, maintenance, exporter,
    dashboard) still exit 0.
    """

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; an uncaught tokenline error is reported in one line."""
        try:
            return super().invoke(ctx)
        except TokenlineError as exc:
            report_error(exc)
        except KeyboardInterrupt:
            err_console.print("interrupted", highlight=False, markup=False)
            raise SystemExit(130) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands with their summaries, wrapped rather than cut."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=sys.maxsize)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON instead (keys listed above; times in epoch seconds).",
)


def bytes_text(data: bytes | bytearray | memoryview) -> str:
    """How bytes read where the store keeps text are shown, in tables and in JSON:
    ``<bytes: fffe00>``, their hex. Only a row written by something other than
    tokenline holds them (a BLOB in a SQLite text column); shown so, they cannot be
    taken for the text they might decode to, nor stop a listing."""
    return f"<bytes: {bytes(data).hex()}>"


def _json_default(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes_text(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout, with nothing else around it; valid UTF-8
    whatever the stored text holds (see :func:`~tokenline._logging.json_text`), and
    bytes written as :func:`bytes_text` says."""
    click.echo(json_text(data, indent=2, default=_json_default))


#: Free text in a table (errors, arguments) shows at most this many columns, then "…".
TEXT_WIDTH = 60
#: Free text gives up columns to the rest down to this width, then "…".
TEXT_MIN = 10
#: Columns between two cells: a cell's padding and the separator.
_GAP = 2


@dataclass(frozen=True, slots=True)
class Col:
    """A column of a listing, and how its values may bend to fit a narrow terminal.

    ``key``: never cut nor wrapped (ids, names, states, keys, numbers). ``wrap``: may
    wrap at spaces, never cut (times, lists). ``text``: free text on one line, cut with
    "…" (errors, arguments). ``optional`` columns (1, 2, …: the order they go in) are
    left out when the terminal cannot hold the others whole; a line under the table
    says so. ``0``: always shown.
    """

    header: str
    kind: Literal["key", "wrap", "text"] = "key"
    optional: int = 0
    justify: JustifyMethod = "left"


def output_width() -> int | None:
    """Columns the output must fit: ``COLUMNS`` when set, else the terminal's; ``None``
    when it goes to a pipe or a file, where nothing is narrowed."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return console.width if console.is_terminal else None


def _cell(value: str | Text, kind: str) -> Text:
    if isinstance(value, Text):
        return value
    if isinstance(value, bytes | bytearray | memoryview):  # a stored value, see bytes_text
        value = bytes_text(value)
    # Free text is shown on one line; a traceback's newlines would break the row. Built
    # as Text, it bypasses the console's render_str: made printable here.
    return Text(printable(" ".join(value.split()) if kind == "text" else value))


def _widest(texts: Iterable[Text], words: bool = False) -> int:
    parts = (p for t in texts for p in (t.plain.split() if words else t.plain.splitlines()))
    return max((cell_len(p) for p in parts), default=0)


def _widths(col: Col, texts: list[Text]) -> tuple[int, int]:
    """The column's natural width and the least it may be given."""
    if col.kind == "text":
        natural = min(_widest(texts), TEXT_WIDTH)
        return natural, min(natural, TEXT_MIN)
    natural = _widest(texts)
    return natural, _widest(texts, words=True) if col.kind == "wrap" else natural


def _print_at(table: Table, width: int) -> None:
    """Print ``table`` ``width`` columns wide: wider than the console, every line whole,
    not cropped at its edge."""
    if width <= console.width:
        console.print(table)
        return
    lines = console.render_lines(table, console.options.update_width(width), new_lines=True)
    console.print(Segments(list(chain.from_iterable(lines))), crop=False, soft_wrap=True)


#: Widest a table printed to a pipe or a file is measured at (columns).
_UNBOUNDED = 10_000


def print_table(table: Table) -> None:
    """Print a table as wide as it needs to a pipe or a file, where nothing is narrowed
    (see :func:`output_width`); to a terminal, as wide as it is."""
    if output_width() is not None:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(_UNBOUNDED))
    _print_at(table, natural.maximum)


def show(title: str, cols: Sequence[Col], rows: Iterable[Sequence[str | Text]]) -> None:
    """Print a listing that keeps every key whole.

    Free text shrinks first, then wrapping columns wrap, then optional columns are left
    out; a table still wider than the terminal is printed wider rather than cut. Cells
    given as ``str`` are plain text (never markup); pass :class:`Text` to style one.
    """
    data = [[_cell(v, c.kind) for v, c in zip(row, cols, strict=True)] for row in rows]
    headers = [Text(c.header) for c in cols]
    natural, least = zip(
        *(_widths(c, [headers[i], *(r[i] for r in data)]) for i, c in enumerate(cols)),
        strict=True,
    )
    shown = list(range(len(cols)))
    limit = output_width()

    def needed(widths: Sequence[int]) -> int:
        return sum(widths[i] for i in shown) + _GAP * (len(shown) - 1)

    left_out: list[str] = []
    while limit is not None and needed(least) > limit:
        optional = [i for i in shown if cols[i].optional]
        if not optional:
            break
        first = min(optional, key=lambda i: cols[i].optional)
        shown.remove(first)
        left_out.append(cols[first].header)
    widths = list(natural)
    for kind in ("text", "wrap"):
        while limit is not None and needed(widths) > limit:
            able = [i for i in shown if cols[i].kind == kind and widths[i] > least[i]]
            if not able:
                break
            widths[max(able, key=lambda i: widths[i])] -= 1
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for i in shown:
        c = cols[i]
        table.add_column(
            headers[i],
            width=max(widths[i], 1),
            justify=c.justify,
            no_wrap=c.kind != "wrap",
            overflow="ellipsis" if c.kind == "text" else "fold",
        )
    for row in data:
        table.add_row(*(row[i] for i in shown))
    _print_at(table, needed(widths))
    if left_out:
        console.print(
            f"(not shown, too narrow: {', '.join(left_out)}; see --json)",
            highlight=False,
            markup=False,
        )
