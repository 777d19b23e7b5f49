"""``tokenline dashboard``: serve the operator's web dashboard until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
from pathlib import Path

import click

from .._errors import ConfigError
from .._logging import configure as configure_logging
from ._common import Seconds, app_option, console, reporting_errors, resolve_app, url_option

__all__ = ["dashboard"]

#: The environment variable holding the operator token; unset: a read-only dashboard;
#: set, it must be a usable secret (see ``check_operator_token``), else no start.
TOKEN_ENV = "TOKENLINE_DASHBOARD_TOKEN"


def _bind(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _allowed_hosts(
    _ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    from ..dashboard.hosts import parse_authority

    for entry in value:
        parsed = parse_authority(entry.strip())
        if parsed is None or "*" in parsed[0]:
            raise click.BadParameter(
                f"{entry!r}: expected NAME or NAME:PORT, e.g. dash.example.com "
                "(an IPv6 address in brackets; no wildcards)"
            )
    return value


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; :class:`ConfigError` naming the address and
    why when it cannot be had (a port in use, an address not of this machine)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError("bind", f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        raise ConfigError("bind", f"cannot listen on {host}:{port}: {why}") from None
    return sock


@click.command()
@app_option
@url_option
@click.option(
    "--bind",
    default="127.0.0.1:8080",
    show_default=True,
    envvar="TOKENLINE_DASHBOARD_BIND",
    show_envvar=True,
    callback=_bind,
    help="HOST:PORT to listen on (0.0.0.0:PORT: every interface).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    envvar="TOKENLINE_DASHBOARD_ALLOWED_HOSTS",
    show_envvar=True,
    callback=_allowed_hosts,
    help="Also answer to this host name (NAME: any port, or NAME:PORT), as a reverse "
    "proxy passes it on; repeatable (the variable: space-separated). Requests naming "
    "any other host are refused (421), against DNS rebinding.",
)
@click.option(
    "--timeout",
    type=Seconds(0.1, 600),
    default=5.0,
    show_default=True,
    help="Longest each channel probe of the overview may take, seconds.",
)
@click.option(
    "--drill-results",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    envvar="TOKENLINE_DASHBOARD_DRILL_RESULTS",
    show_envvar=True,
    help="A file written by `tokenline drill --json`, shown on the drills page.",
)
def dashboard(
    app_spec: str | None,
    url: str | None,
    bind: tuple[str, int],
    allowed_hosts: tuple[str, ...],
    timeout: float,
    drill_results: Path | None,
) -> None:
    """Serve the operator's web dashboard until SIGINT or SIGTERM.

    Shows queues, workers by state, channel and breaker health, firing alert
    conditions, jobs, leases, dead letters, the duplicate audit and drill results.
    Actions (pause/resume, drain, retry/discard dead jobs, release a lease) need the
    operator token set in TOKENLINE_DASHBOARD_TOKEN (at least 16 characters; set but
    blank or short, the command refuses to start) and given with each action; without
    it the dashboard is read-only. Each action is logged on the tokenline.dashboard
    logger.

    The dashboard answers only to requests naming it: its --bind address (and, bound
    to loopback, localhost), or an --allowed-host; any other Host header is refused,
    so a web page cannot reach it through a name of its own (DNS rebinding).
    """
    import os

    from ..dashboard import INSTALL_HINT

    try:
        import uvicorn

        from ..dashboard import create_app
        from ..dashboard.serving import server_config
    except ImportError as exc:
        raise click.ClickException(f"{INSTALL_HINT} ({exc})") from None
    from ..dashboard.hosts import root_url
    from ..dashboard.security import check_operator_token

    token = os.environ.get(TOKEN_ENV)
    if token is not None:
        try:
            check_operator_token(token, name=TOKEN_ENV)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    configure_logging("info", "text")
    host, port = bind
    with reporting_errors():
        app = resolve_app(app_spec, url, existing=True, reports_outage=True)
        # Bound here, before saying it started: a port in use is an error, not a
        # "started" line followed by uvicorn's failure. uvicorn serves this socket.
        listening = _listen(host, port)
        port = listening.getsockname()[1]  # the one given, or the one picked for 0
        web = create_app(
            app,
            operator_token=token,
            timeout=timeout,
            drill_results=drill_results,
            bind=(host, port),  # the port bound: requests must name it in their Host
            allowed_hosts=allowed_hosts,
        )
        mode = "actions enabled" if token else f"read-only (set {TOKEN_ENV} to enable actions)"
        console.print(
            f"tokenline dashboard on {root_url(host, port)} : {mode}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        logging.getLogger("tokenline.dashboard").info("dashboard started: %s", mode)
        # uvicorn shuts down on SIGINT/SIGTERM, then raises the signal again for the
        # handler it found: this one, so the command ends like `exporter`, with status 0.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: None)
        try:
            server = uvicorn.Server(server_config(web))
            server.run(sockets=[listening])
        finally:
            listening.close()
            app.close()
    console.print("tokenline dashboard stopped", markup=False, highlight=False)
