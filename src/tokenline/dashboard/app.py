"""The dashboard's web application: pages over the store's read API, and actions.

Every page is rendered on the server and works without JavaScript; with it, a page
marked for refresh fetches itself again as a fragment (``?fragment=1``: the page's
content without the surrounding layout) every few seconds and swaps it in.

Every request must name the dashboard in its ``Host`` header (see :mod:`.hosts`: the
bound address, or an allowed name), else it answers 421 before reading anything.

Text from the store (names, keys, arguments, errors, worker ids) is shown with its
control and invisible characters written as escapes, as the command line shows it
(:func:`shown`); a form field naming what to act on carries it exactly (:func:`exact`).

Status codes: 400 for a malformed id or field (ids run from 1 to 2**63-1), 404 for an
unknown job, worker, queue or action, 401/403 for a refused action (see
:mod:`.security`), 409 for an action that does not apply, 503 when the store cannot
be read; each with a readable page.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._app import App
from .._config import validate_queue_name
from .._errors import JobNotFoundError, QueueNameError, StoreError, StoreUnavailableError
from .._jobs import JobState, describe
from .._logging import printable
from ..cli._common import ago, when
from ..health import CHANNELS, alive, worker_state
from . import data
from .actions import ACTIONS, Action, BadInput, Outcome, parse, parse_id, parse_name
from .charts import Sample, Samples, svg_chart
from .hosts import HostPolicy
from .security import Guard, Refusal, check_operator_token

__all__ = ["create_app"]

logger = logging.getLogger("tokenline.dashboard")

_HERE = Path(__file__).parent
#: Seconds between two refreshes of a page, in the browser.
REFRESH_SECONDS = 5
#: The most of a job's arguments, result or error text a page shows (characters): they
#: may run to megabytes, which no page should carry, least of all every few seconds.
CLIP_CHARS = 2000


@dataclass(frozen=True, slots=True)
class Clipped:
    """A text cut to :data:`CLIP_CHARS` for a page: what is shown, and how long it was."""

    text: str
    size: int

    @property
    def cut(self) -> bool:
        """Whether part of the text is left out."""
        return len(self.text) < self.size


def clip(value: object, limit: int = CLIP_CHARS) -> Clipped:
    """``value`` as text, its first ``limit`` characters when it is longer."""
    text = "" if value is None else str(value)
    return Clipped(text[:limit], len(text))


def shown(value: object) -> object:
    """``value`` as a page shows it: every ``{{ … }}`` of the templates goes through
    here (Jinja's ``finalize``), so text from the store has its control characters, its
    bidirectional overrides and its invisible characters written as escapes
    (``\\u202e``), as :func:`~tokenline._logging.printable` writes them for the command
    line: a key cannot be made to read backwards, or to look like another."""
    if value is None:
        return value
    if isinstance(value, Markup):
        # HTML built here (a macro's output, a chart) or escaped by a filter (join): the
        # escapes printable writes are ASCII letters, digits and backslashes, safe in it.
        # A form field in it, written by `exact`, holds no character printable changes.
        return Markup(printable(str(value)))
    return printable(str(value))


#: What :func:`exact` writes as a character reference: all but printable ASCII.
_REFERENCED = re.compile("[^\x20-\x7e]")


def exact(value: object) -> Markup:
    """``value`` for an attribute the server reads back (a hidden form field naming the
    key to act on): escaped for HTML, and every character outside printable ASCII
    written as a character reference (``&#x202e;``). The browser reads it back to the
    very character, so the action names the stored key; and the page's text holds no
    character :func:`shown` would change, nor one that reorders what is shown. (A C0
    or C1 control comes back otherwise, as HTML reads it; no name or key holds one.)"""
    text = str(escape(value))
    return Markup(_REFERENCED.sub(lambda m: f"&#x{ord(m.group()):x};", text))


class _Dashboard:
    """The state one dashboard process keeps: the app, the guard, the samples."""

    def __init__(
        self,
        app: App,
        guard: Guard,
        hosts: HostPolicy,
        *,
        timeout: float,
        drill_results: Path | None,
    ) -> None:
        self.app = app
        self.guard = guard
        self.hosts = hosts
        self.timeout = timeout
        self.drill_results = drill_results
        self.samples = Samples()
        self.templates = Jinja2Templates(directory=str(_HERE / "templates"))
        env = self.templates.env
        env.finalize = shown
        env.filters["exact"] = exact
        env.globals.update(
            ago=ago,
            when=when,
            clip=clip,
            channels=CHANNELS,
            refresh_seconds=REFRESH_SECONDS,
            worker_state=worker_state,
        )

    # -- rendering ------------------------------------------------------------------------
    def page(
        self,
        request: Request,
        name: str,
        context: Mapping[str, Any],
        *,
        status: int = 200,
        refresh: bool = False,
    ) -> Response:
        """``name`` rendered whole, or as a fragment when the refresh script asks."""
        fragment = request.query_params.get("fragment") == "1"
        ctx = {
            "layout": "fragment.html" if fragment else "base.html",
            "refresh": refresh,
            "read_only": self.guard.read_only,
            **context,
        }
        return self.templates.TemplateResponse(request, name, ctx, status_code=status)

    def problem(self, request: Request, status: int, title: str, why: str) -> Response:
        """A readable error page."""
        return self.page(request, "problem.html", {"title": title, "why": why}, status=status)

    def refused(self, request: Request, r: Refusal) -> Response:
        """An action refused by the guard."""
        response = self.problem(request, r.status, r.title, r.why)
        if r.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="tokenline dashboard"'
        return response


def _store_guard(
    view: Callable[[_Dashboard, Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``view`` as a route; a store that cannot be read gives a 503 page, not a trace."""

    async def endpoint(request: Request) -> Response:
        dash: _Dashboard = request.app.state.dashboard
        try:
            return await view(dash, request)
        except (StoreError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            return dash.problem(request, 503, "The store cannot be read", why)

    return endpoint


# -- views --------------------------------------------------------------------------------
async def overview(dash: _Dashboard, request: Request) -> Response:
    """Queues, workers by state, channels, breakers, firing alerts, charts."""
    o = await data.read_overview(dash.app, dash.timeout)
    if o.now is not None:
        dash.samples.add(
            Sample(
                at=o.now,
                queued=sum(q.queued for q in o.queues),
                running=sum(q.running for q in o.queues),
                finished=sum(q.succeeded + q.dead for q in o.queues),
                finished_by_queue={q.name: q.succeeded + q.dead for q in o.queues},
            )
        )
    charts = {
        "depth": svg_chart(dash.samples.depth(), label="jobs queued, all queues"),
        "throughput": svg_chart(dash.samples.throughput(), label="jobs finished per second"),
    }
    context = {
        "o": o,
        "charts": charts,
        "rate": dash.samples.rate(),
        "rates": {q.name: dash.samples.rate(q.name) for q in o.queues},
        "groups": o.workers_by_state(),
    }
    return dash.page(request, "overview.html", context, refresh=True)


async def queue_view(dash: _Dashboard, request: Request) -> Response:
    """One queue: its counts and its newest jobs."""
    name = request.path_params["name"]
    try:
        validate_queue_name(name)
    except QueueNameError as exc:
        return dash.problem(request, 400, "Not a queue name", str(exc))
    async with data.opened(dash.app) as store:
        stats = [s for s in await store.queues_stats() if s.queue == name]
        jobs = await store.jobs_list(queue=name, limit=50, args_limit=0)
    if not stats and not jobs:
        return dash.problem(request, 404, "No such queue", f"no queue named {name!r} has jobs")
    row = data.queue_row(stats[0]) if stats else None
    return dash.page(request, "queue.html", {"name": name, "q": row, "jobs": jobs}, refresh=True)


async def job_view(dash: _Dashboard, request: Request) -> Response:
    """One job: its fields, every attempt with its token, its effects."""
    raw = request.path_params["job_id"]
    try:
        jid = parse_id("job id", raw)
    except BadInput as exc:
        return dash.problem(request, 400, "Not a job id", f"not a job id: {exc}")
    async with data.opened(dash.app) as store:
        try:
            job = await store.job_get(job_id=jid)
        except JobNotFoundError:
            return dash.problem(request, 404, "No such job", f"there is no job with id {jid}")
        attempts = await store.job_attempts(job_id=jid)
        effects = await store.effects_list(job_id=jid) if store.capabilities.ledger else []
    context = {"job": job, "attempts": attempts, "effects": effects, "dead": JobState.DEAD}
    # A finished job changes only by an operator's hand: no refresh to fetch it again.
    return dash.page(request, "job.html", context, refresh=not job.state.finished)


async def worker_view(dash: _Dashboard, request: Request) -> Response:
    """One worker's membership and the jobs it holds leases on."""
    try:
        wid = parse_name("worker id", request.path_params["worker_id"])
    except BadInput as exc:
        return dash.problem(request, 400, "Not a worker id", str(exc))
    async with data.opened(dash.app) as store:
        found = [w for w in await store.workers_list() if w.id == wid]
        if not found:
            return dash.problem(request, 404, "No such worker", f"no worker has id {wid!r}")
        running = await store.jobs_list(state=JobState.RUNNING, limit=1000, args_limit=0)
        now = await store.store_time()  # after the rows it ages (a slow link)
    w = found[0]
    held = [j for j in running if j.lease_owner == wid]
    context = {"w": w, "now": now, "alive": alive(w, now), "held": held}
    return dash.page(request, "worker.html", context, refresh=True)


async def leases_view(dash: _Dashboard, request: Request) -> Response:
    """Job leases (running jobs) and resource leases, by the store's clock."""
    async with data.opened(dash.app) as store:
        running = await store.jobs_list(state=JobState.RUNNING, limit=1000, args_limit=0)
        named = await store.resource_leases_list()
        now = await store.store_time()  # after the rows it ages (a slow link)
    context = {"now": now, "running": running, "named": named}
    return dash.page(request, "leases.html", context, refresh=True)


async def dlq_view(dash: _Dashboard, request: Request) -> Response:
    """Dead jobs, newest first, with their reasons."""
    async with data.opened(dash.app) as store:
        dead = await store.jobs_list(state=JobState.DEAD, limit=200, args_limit=0)
    return dash.page(request, "dlq.html", {"dead": dead}, refresh=True)


async def audit_view(dash: _Dashboard, request: Request) -> Response:
    """Recorded duplicates and stale commits the store refused."""
    async with data.opened(dash.app) as store:
        dups = await store.duplicates_list(limit=200) if store.capabilities.ledger else []
        stale_total, stale = await store.stale_commits(limit=50)
    context = {"dups": dups, "stale_total": stale_total, "stale": stale}
    return dash.page(request, "audit.html", context, refresh=True)


async def drills_view(dash: _Dashboard, request: Request) -> Response:
    """The scenarios of the last ``tokenline drill --json`` written to the results file."""
    results, problem = data.read_drill_results(dash.drill_results)
    context = {"results": results, "problem": problem, "path": dash.drill_results}
    return dash.page(request, "drills.html", context, refresh=True)


# -- actions ------------------------------------------------------------------------------
def _action(dash: _Dashboard, request: Request) -> Action | Response:
    found = ACTIONS.get(request.path_params["action"])
    if found is None:
        name = describe(request.path_params["action"])
        return dash.problem(request, 404, "No such action", f"there is no action {name}")
    return found


async def confirm(dash: _Dashboard, request: Request) -> Response:
    """The confirmation form of an action (a GET: it changes nothing)."""
    action = _action(dash, request)
    if isinstance(action, Response):
        return action
    why = _given_twice(request.query_params.multi_items(), "URL")
    if why is not None:
        # The confirmation would name one value and the form carry it on: neither is
        # the server's to guess, as for the form itself.
        return dash.problem(request, 400, "Bad request", why)
    try:
        params = parse(action, request.query_params)
    except BadInput as exc:
        return dash.problem(request, 400, "Bad request", str(exc))
    context = {
        "action": action,
        "params": params,
        "text": action.describe(params),
        "csrf": dash.guard.csrf_token,
    }
    return dash.page(request, "confirm.html", context)


def _given_twice(items: Iterable[tuple[str, object]], where: str) -> str | None:
    """What is wrong when a field appears more than once in ``items`` (a form's or a
    URL's): which of two values counts would be the server's guess, so none does."""
    counts = collections.Counter(k for k, _ in items)
    repeated = sorted(k for k, n in counts.items() if n > 1)
    if not repeated:
        return None
    return f"the {where} gives {', '.join(map(repr, repeated))} more than once"


#: An action's form: a handful of short fields (what to act on, the CSRF token, the
#: operator's token) and no file. Starlette's own limits (1,000 fields of up to 1 MB,
#: and files without end, spooled to disk) let one request make the dashboard hold or
#: write a gigabyte before any check.
FORM_MAX_FIELDS = 32
FORM_MAX_FIELD_BYTES = 64 * 1024


def _parser_says(exc: HTTPException | MultiPartException) -> str:
    """What the form parser found wrong, in its words (``Too many fields. …``)."""
    said = exc.detail if isinstance(exc, HTTPException) else exc.message
    return str(said).strip() or "the form is malformed"


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "unknown client"


def _server(request: Request) -> tuple[str, int | None] | None:
    server = request.scope.get("server")
    return (str(server[0]), server[1]) if server else None


def _operator(dash: _Dashboard, request: Request, in_form: str | None) -> Refusal | None:
    """The operator token's check: the form's field, or ``Authorization: Bearer``;
    given both, they must be the same (a wrong one is never covered by a right one),
    and the header's token is taken as sent, never trimmed."""
    header = request.headers.get("authorization")
    bearer: str | None = None
    if header is not None:
        scheme, _, bearer = header.partition(" ")
        if scheme != "Bearer" or not bearer:
            why = "the Authorization header is not `Bearer <token>`"
            return Refusal(401, "Operator token refused", why)
    if in_form and bearer is not None and in_form != bearer:
        why = "the form and the Authorization header give different tokens"
        return Refusal(401, "Operator token refused", why)
    return dash.guard.check_operator(in_form or bearer or None)


async def act(dash: _Dashboard, request: Request) -> Response:
    """Carry an action out, once the guard lets it through; every attempt is logged."""
    action = _action(dash, request)
    if isinstance(action, Response):
        return action
    who = _client(request)
    server = _server(request)
    refusal = dash.guard.check_origin(
        origin=request.headers.get("origin"),
        fetch_site=request.headers.get("sec-fetch-site"),
        is_own=lambda origin: dash.hosts.accepts_origin(origin, server),
        own_origin=dash.hosts.root().rstrip("/"),
    )
    if refusal is None and dash.guard.read_only:
        refusal = dash.guard.check_operator(None)  # says how to enable actions
    form: dict[str, str] = {}
    if refusal is None:
        try:
            raw = await request.form(
                max_files=0, max_fields=FORM_MAX_FIELDS, max_part_size=FORM_MAX_FIELD_BYTES
            )
        except (HTTPException, MultiPartException) as exc:
            # A form past the parser's limits (a field too long, too many fields, a file)
            # or malformed: the parser stops reading there, and Starlette would answer a
            # plain-text 400 of its own, logged nowhere. Refused like any other form.
            why = f"the form cannot be read: {_parser_says(exc)}"
            logger.warning("action %s by %s refused: %s", action.name, who, why)
            return dash.problem(request, 400, "Bad request", why)
        twice = _given_twice(raw.multi_items(), "form")
        if twice is not None:
            logger.warning("action %s by %s refused: %s", action.name, who, twice)
            return dash.problem(request, 400, "Bad request", twice)
        form = {k: v for k, v in raw.items() if isinstance(v, str)}
        refusal = dash.guard.check_csrf(form.get("csrf"))
    if refusal is None:
        refusal = _operator(dash, request, form.get("operator_token"))
    if refusal is not None:
        logger.warning("action %s by %s refused: %s", action.name, who, refusal.why)
        return dash.refused(request, refusal)
    try:
        params = parse(action, form)
    except BadInput as exc:
        logger.warning("action %s by %s refused: %s", action.name, who, exc)
        return dash.problem(request, 400, "Bad request", str(exc))
    asked = False
    try:
        async with data.opened(dash.app) as store:
            asked = True
            outcome: Outcome = await action.run(store, params)
    except (StoreError, TimeoutError) as exc:  # answered 503 by the route's guard
        logger.warning("action %s %s by %s failed: store error: %s", action.name, params, who, exc)
        if asked and isinstance(exc, StoreUnavailableError | TimeoutError):
            # The store was asked, and its answer lost: the change may have been made,
            # as the command line says too. Said so, not "cannot be read". Unless it
            # refused the change whole (a write lock it never got, a server that takes
            # no writes): then nothing was made, and saying it may have been sends the
            # operator looking for it.
            if getattr(exc, "changed_nothing", False):
                why = (
                    f"{str(exc) or type(exc).__name__}. The store did not take this change "
                    "at all, so nothing was changed; `tokenline status` says what keeps it "
                    "from writing"
                )
            else:
                why = (
                    f"{str(exc) or type(exc).__name__}. The store may have made the change "
                    "before its answer was lost: look before trying again"
                )
            return dash.problem(request, 503, "The store did not answer the action", why)
        raise
    log = logger.info if outcome.done else logger.warning
    log("action %s %s by %s: %s %s", action.name, params, who, outcome.status, outcome.message)
    context = {"action": action, "outcome": outcome}
    return dash.page(request, "done.html", context, status=outcome.status)


async def not_found(request: Request, exc: Exception) -> Response:
    """A readable page for a path that names nothing."""
    dash: _Dashboard = request.app.state.dashboard
    path = describe(request.url.path, 200)
    return dash.problem(request, 404, "Not found", f"nothing here: {path}")


#: Sent with every answer: no framing (a confirm button under a hidden frame), no script
#: or style from elsewhere, no page kept in a cache (forms carry the CSRF token), no
#: URL leaked to another site ("no-referrer" would make Chromium send "Origin: null" on
#: our own forms, which the origin check refuses).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class _SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, with_headers)


class _HostCheck:
    """ASGI middleware refusing a request whose ``Host`` does not name this dashboard
    (a DNS rebinding attack names the attacker's domain): 400 without exactly one
    well-formed ``Host``, 421 for a host it does not answer to."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        server = scope.get("server")
        if len(given) != 1:
            answer = PlainTextResponse("Bad request: exactly one Host header is needed\n", 400)
        elif not self.hosts.accepts(given[0], server):
            shown = given[0] if len(given[0]) <= 100 else given[0][:100] + "..."
            answer = PlainTextResponse(
                f"Misdirected request: this dashboard does not answer to host {shown!r}; "
                f"it listens on {self.hosts.root()} (name more hosts with --allowed-host)\n",
                421,
            )
        else:
            await self.app(scope, receive, send)
            return
        await answer(scope, receive, send)


def create_app(
    app: App,
    *,
    operator_token: str | None = None,
    timeout: float = 5.0,
    drill_results: Path | None = None,
    bind: tuple[str, int] = ("127.0.0.1", 8080),
    allowed_hosts: Iterable[str] = (),
) -> Starlette:
    """The dashboard of ``app``'s store as an ASGI application.

    ``operator_token``: the secret actions need (``None``: read-only); a blank, padded
    or short one is a :class:`ValueError` (see :func:`.security.check_operator_token`).
    ``timeout``: how long each channel probe of the overview may take, seconds.
    ``drill_results``: a file ``tokenline drill --json`` wrote, for the drills page.
    ``bind``: the address and port the server listens on; with ``allowed_hosts``
    (``NAME`` or ``NAME:PORT``), the hosts a request may name (see :mod:`.hosts`);
    :class:`ValueError` for a malformed one.
    """
    hosts = HostPolicy.of(bind, allowed_hosts)
    if operator_token is not None:
        check_operator_token(operator_token)
    dash = _Dashboard(
        app,
        Guard(operator_token),
        hosts,
        timeout=timeout,
        drill_results=drill_results,
    )
    routes = [
        Route("/", _store_guard(overview)),
        Route("/queues/{name}", _store_guard(queue_view)),
        Route("/jobs/{job_id}", _store_guard(job_view)),
        Route("/workers/{worker_id:path}", _store_guard(worker_view)),
        Route("/leases", _store_guard(leases_view)),
        Route("/dlq", _store_guard(dlq_view)),
        Route("/audit", _store_guard(audit_view)),
        Route("/drills", _store_guard(drills_view)),
        Route("/actions/{action}", _store_guard(confirm), methods=["GET"]),
        Route("/actions/{action}", _store_guard(act), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static"),
    ]
    web = Starlette(
        routes=routes,
        exception_handlers={404: not_found},
        # The headers go on every answer, the host check's refusals included.
        middleware=[Middleware(_SecurityHeaders), Middleware(_HostCheck, hosts=hosts)],
    )
    web.state.dashboard = dash
    return web
