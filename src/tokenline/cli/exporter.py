"""``tokenline exporter``: the store's metrics for Prometheus, from one process.

Every worker exports what it saw itself; what the store holds (queue depth, dead jobs,
live workers, orphaned leases) is read here instead, once per scrape at most, so a
fleet of workers does not query the store for the same numbers. The metrics are listed
in :mod:`tokenline.metrics`.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import click

from ._common import Seconds, Whole, app_option, console, reporting_errors, resolve_app, url_option
from .scale import ScaleHinter

__all__ = ["exporter"]


@click.command()
@app_option
@url_option
@click.option(
    "--port",
    type=Whole(0, 65535),
    default=9464,
    show_default=True,
    envvar="TOKENLINE_EXPORTER_PORT",
    show_envvar=True,
    help="Port to serve /metrics, /healthz and /readyz on.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    envvar="TOKENLINE_EXPORTER_HOST",
    show_envvar=True,
    help="Address to listen on (0.0.0.0: every interface).",
)
@click.option(
    "--max-age",
    type=Seconds(0),
    default=5.0,
    show_default=True,
    envvar="TOKENLINE_EXPORTER_MAX_AGE",
    show_envvar=True,
    help="Seconds a read of the store is served before the next scrape reads again.",
)
def exporter(app_spec: str | None, url: str | None, port: int, host: str, max_age: float) -> None:
    """Serve the store's metrics for Prometheus until SIGINT or SIGTERM.

    /readyz answers 200 while the store can be read, /healthz while the process runs,
    /scale-hint whether adding workers would help (JSON, as `tokenline scale-hint
    --json`; it compares the store with its previous look, at least a second old).
    """
    try:
        from prometheus_client import CollectorRegistry

        from ..metrics import StoreCollector, serve
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    with reporting_errors():
        # It only reads the store: an older schema is reported, never upgraded.
        app = resolve_app(app_spec, url, migrate=False)
        collector = StoreCollector(app, max_age=max_age)
        try:
            registry = CollectorRegistry()
            registry.register(collector)
            hinter = ScaleHinter(app.open_store)
            server = serve(
                port,
                host=host,
                registry=registry,
                ready=collector.ready,
                routes={"/scale-hint": hinter.answer},
            )
            try:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(signum, on_signal)
                # The URL's scheme only: a PostgreSQL URL may carry a password.
                store = app.url.partition(":")[0]
                console.print(
                    f"tokenline exporter: the {store} store's metrics on {server.url}/metrics",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
                # A timed wait: the signal handler runs between waits, on this thread.
                while not stop.wait(0.5):
                    pass
            finally:
                server.close()
        finally:
            collector.close()
            app.close()
