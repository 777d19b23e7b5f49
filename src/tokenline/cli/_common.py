"""Shared pieces of the command line: app loading, store access, error reporting."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from .._app import App
from .._errors import TokenlineError
from ..stores import Store

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True)


def load_app(spec: str) -> App:
    """Import ``module:attribute`` and return the :class:`App` it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{spec!r}: expected module:attribute, e.g. myproject.jobs:app")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}") from None
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise click.BadParameter(f"{spec!r} is not a tokenline.App (got {type(app).__name__})")
    return app


def resolve_app(app_spec: str | None, url: str | None) -> App:
    """The app named by ``--app``, else a bare app on ``--url`` / ``TOKENLINE_URL``.

    With both, and a URL other than the one the app was built with, the result is the
    app's tasks and settings on the given store: a worker started that way must run the
    app's jobs there, not dead-letter them all as unknown. It is said on stderr, naming
    both URLs, because an exported ``TOKENLINE_URL`` can be the reason.
    """
    if not app_spec:
        return App(url)
    app = load_app(app_spec)
    if not url or url == app.url:
        return app
    moved = App(url, settings=app.settings, clock=app.clock, classifier=app.classifier)
    for t in app.tasks.values():
        moved.task(
            name=t.name,
            queue=t.queue,
            max_attempts=t.max_attempts,
            timeout=t.timeout,
            priority=t.priority,
            retry=t.retry,
            classifier=t.classifier,
            max_lease_expiries=t.max_lease_expiries,
        )(t.fn)
    err_console.print(
        f"note: {app_spec} was built for {app.url}; using {url} (from --url or TOKENLINE_URL)",
        highlight=False,
        markup=False,
    )
    return moved


def with_store(app: App, fn: Callable[[Store], Coroutine[Any, Any, T]]) -> T:
    """Open a store for ``app``, run ``fn`` on it and close it."""

    async def run() -> T:
        store = app.open_store()
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


@contextlib.contextmanager
def reporting_errors() -> Iterator[None]:
    """Turn tokenline errors into a one-line message and exit status 1."""
    try:
        yield
    except TokenlineError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise SystemExit(1) from None


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


url_option = click.option(
    "--url",
    envvar="TOKENLINE_URL",
    show_envvar=True,
    default=None,
    help="Store URL (default: the app's, else sqlite:///tokenline.db).",
)
app_option = click.option(
    "--app",
    "app_spec",
    envvar="TOKENLINE_APP",
    show_envvar=True,
    default=None,
    help="The application as module:attribute, e.g. myproject.jobs:app.",
)
