"""App: the composition root — store URL, task registry, clock and settings.

``App`` offers a synchronous facade (``enqueue``) for ordinary code and async twins
(``enqueue_async``) for code already on an event loop. The facade runs the async core
on a private event loop thread, so it works from any thread, including a handler's.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, Self, TypeVar, overload

from ._clock import Clock, SystemClock
from ._config import DEFAULT_URL, Settings, load_settings, names_no_store
from ._errors import ConfigError, InvalidInputError, PayloadError, UnknownTaskError
from ._jobs import (
    MAX_INT_DIGITS,
    MAX_PAYLOAD_DEPTH,
    NewJob,
    Unique,
    attempts_problem,
    check_queue_name,
    describe,
    error_text,
    priority_problem,
    run_at_problem,
    seconds_problem,
)
from ._periodic import Periodic
from ._records import validate_key
from ._redact import redact
from ._tasks import Task, handler_problem
from .backpressure.breaker import (
    DEFAULT_BREAKER_WINDOW,
    DEFAULT_FAILURE_RATE,
    DEFAULT_OPEN_FOR,
    DEFAULT_PROBE_CALLS,
    MIN_CALLS,
)
from .classify import Classifier
from .dependencies import (
    DEFAULT_DEPENDENCY_TIMEOUT,
    Dependency,
    DependencyRegistry,
    dependency_names,
)
from .retry import RetryPolicy
from .stores import MemoryStore, Store, store_from_url
from .stores.base import MAX_JOB_ID, EventLoopNeeded, possible_job_id

__all__ = ["App"]

T = TypeVar("T")
_log = logging.getLogger("tokenline.app")

#: One encoder for every payload: json.dumps with options builds a new one per call.
_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _payload_encoder() -> Callable[[object], str]:
    """``_JSON.encode``, without the C encoder it builds again on every call (half its
    time for a small payload): that encoder, made once, where Python has it. It skips
    the check for circular references, which never runs here: ``_check_items`` has
    refused any payload nested deeper than ``MAX_PAYLOAD_DEPTH`` before it is encoded,
    and a circular one is nested without end."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _JSON.encode
    chunks = make(
        None, _JSON.default, json.encoder.encode_basestring_ascii, None,
        _JSON.key_separator, _JSON.item_separator, _JSON.sort_keys, _JSON.skipkeys,
        _JSON.allow_nan,
    )  # fmt: skip

    def encode(value: object) -> str:
        return "".join(chunks(value, 0))

    return encode


_encode_payload = _payload_encoder()
F = TypeVar("F", bound=Callable[..., Any])

#: How unique an enqueue is: ``True`` (for good), ``"active"`` (while the job is not
#: finished) or ``False``. See :class:`~tokenline._jobs.Unique`.
UniqueOption = bool | Literal["active"]


class _Loop:
    """One event loop of a portal, on its daemon thread, with the store opened on it and
    the calls under way on it (``users``, counted under the portal's lock)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self._serve, args=(self.loop,), name="tokenline-portal", daemon=True
        )
        #: The facade's open store; only touched on the loop, or once the loop is gone.
        self.store: Store | None = None
        #: Held on the loop while the store opens (see :meth:`_Portal.opened`).
        self.opening = asyncio.Lock()
        #: Opens that ended on this loop, and how the last one failed (None: it did not).
        self.tries = 0
        self.failure: Exception | None = None
        self.users = 0

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()


class _Portal:
    """A private event loop on a daemon thread, for the synchronous facade.

    It also holds the facade's store, which lives on that loop. A portal with an open
    store is closed at interpreter exit if its app was not (see :func:`_close_at_exit`).

    :meth:`close` may come while other threads call through the portal (a web server's
    threads enqueueing): calls that began on the loop being closed end there first, so
    none is left waiting for a loop that stopped, or finds its store closed under it;
    calls that begin after it get a new loop and store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Signalled when the last call under way on a loop ends (see :meth:`close`).
        self._idle = threading.Condition(self._lock)
        self._current: _Loop | None = None
        #: Every loop alive, by its asyncio loop: the current one, and those closing.
        self._by_loop: dict[asyncio.AbstractEventLoop, _Loop] = {}

    @property
    def store(self) -> Store | None:
        """The current loop's open store, if any."""
        current = self._current
        return None if current is None else current.store

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        current = self._current
        return None if current is None else current.loop

    @property
    def _thread(self) -> threading.Thread | None:
        current = self._current
        return None if current is None else current.thread

    def _enter(self, *, start: bool) -> _Loop | None:
        """The current loop, counted as used until :meth:`_leave`; a new one if there is
        none or its thread is gone (the process forked, say: its store with it), when
        ``start``, else ``None``."""
        with self._lock:
            current = self._current
            if current is not None and not current.thread.is_alive():
                self._by_loop.pop(current.loop, None)
                current = self._current = None
            if current is None:
                if not start:
                    return None
                current = self._current = _Loop()
                self._by_loop[current.loop] = current
                current.thread.start()
            current.users += 1
            return current

    def _leave(self, used: _Loop) -> None:
        with self._lock:
            used.users -= 1
            if used.users == 0:
                self._idle.notify_all()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the portal's loop and wait for its result."""
        used = self._enter(start=True)
        assert used is not None
        try:
            return asyncio.run_coroutine_threadsafe(coro, used.loop).result()
        finally:
            self._leave(used)

    async def opened(self, new_store: Callable[[], Store]) -> Store:
        """The facade's store, opened from ``new_store()`` by the first caller; on the loop.

        Callers that arrive while it opens (sync enqueues from several threads at once)
        wait for that store rather than each opening one: the portal keeps, and closes,
        only one, and any other would be left open, its pool's tasks destroyed at exit."""
        here = self._by_loop[asyncio.get_running_loop()]
        store = here.store
        if store is not None:
            return store
        tries = here.tries
        async with here.opening:
            store = here.store
            if store is not None:
                return store
            if here.tries != tries and here.failure is not None:
                # The open tried while this call waited for it failed: that is the
                # answer, not another wait as long (a store that does not answer would
                # hold the n-th of n callers n times its timeout).
                raise here.failure
            store = new_store()
            try:
                await store.open()
            except BaseException as exc:
                here.failure = exc if isinstance(exc, Exception) else None
                # A store that opened in part (one side of a split store, a pool) is
                # closed, or its connections and threads outlive the failed call.
                with contextlib.suppress(Exception):
                    await store.close()
                raise
            finally:
                # Counted once ended: a caller that came while it was under way sees
                # the count move, and takes its outcome.
                here.tries += 1
            here.store = store
            _opened(self)
            return store

    @contextlib.contextmanager
    def open_store(self) -> Iterator[Store | None]:
        """The facade's store, if it is open and its loop alive, for use on the caller's
        thread within the block (a :meth:`close` meanwhile waits for the block to end);
        ``None``: go through :meth:`run`, which opens it (again, after a fork)."""
        used = self._enter(start=False)
        if used is None:
            yield None
            return
        try:
            yield used.store
        finally:
            self._leave(used)

    def close(self, *, timeout: float | None = None) -> None:
        """Close the store, then stop the loop and end its thread, once the calls under
        way on it have ended. Safe to call twice, and when the thread is already gone;
        ``timeout`` bounds each of the three waits."""
        _open_portals.discard(self)
        with self._lock:
            closing, self._current = self._current, None
            if closing is None:
                return
            # The calls under way end on this loop and store: each is bounded by the
            # store's own timeouts.
            self._idle.wait_for(lambda: closing.users == 0, timeout)
        loop, thread, store = closing.loop, closing.thread, closing.store
        try:
            if thread.is_alive() and store is not None:
                asyncio.run_coroutine_threadsafe(store.close(), loop).result(timeout)
        finally:
            if thread.is_alive():
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout)
            with self._lock:
                self._by_loop.pop(loop, None)


#: Portals with an open store, closed at interpreter exit unless closed before.
_open_portals: set[_Portal] = set()
_exit_hook = threading.Lock()
_exit_hook_registered = False

#: Longest wait for a store to close at interpreter exit, and again for its loop.
_EXIT_TIMEOUT = 10.0


def _close_at_exit() -> None:
    """Close every portal whose app was not closed: a store left open (its connection
    pool's tasks still pending) is torn down mid-flight when the interpreter exits."""
    for portal in list(_open_portals):
        try:
            portal.close(timeout=_EXIT_TIMEOUT)
        except Exception as exc:  # the process is exiting: say so, never raise
            _log.warning("could not close a tokenline store at exit: %r", exc)


def _opened(portal: _Portal) -> None:
    """Note that ``portal`` holds an open store, to be closed at exit."""
    global _exit_hook_registered
    with _exit_hook:
        if not _exit_hook_registered:
            _register_exit_hook()
            _exit_hook_registered = True
        _open_portals.add(portal)


def _register_exit_hook() -> None:
    # Run before the interpreter joins its threads, where concurrent.futures stops every
    # thread pool (a SQLite store closes through its own): an atexit function would come
    # too late. Registered after concurrent.futures' own hook, so it runs before it.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading exit hooks on this Python")
        register(_close_at_exit)
    except RuntimeError:  # the interpreter is already shutting down its threads
        atexit.register(_close_at_exit)


def _refuse_empty_url_variable(settings: Settings) -> None:
    """Raise if ``TOKENLINE_URL`` is set but empty and nothing else names the store.

    The settings read an empty variable as unset, so the app would fall back to its
    default store (``sqlite:///tokenline.db``): the wrong store, silently, where a
    deployment meant to name its own (the CLI refuses the same)."""
    if settings.broker is None and os.environ.get("TOKENLINE_URL", "unset").strip() == "":
        raise ConfigError(
            "TOKENLINE_URL",
            "is set but empty: set it to a store URL, unset it to use the default "
            f"({DEFAULT_URL}), or pass App(url=...)",
        )


def _refuse_url_variable_ignored(settings: Settings) -> None:
    """Raise if ``App(settings=...)`` would use the default store while ``TOKENLINE_URL``
    names another: settings given whole do not read the environment, so the app would
    enqueue into ``sqlite:///tokenline.db`` while workers started with the variable
    consume the store it names."""
    if settings.broker is not None or not names_no_store(settings.url):
        return
    for variable in ("TOKENLINE_URL", "TOKENLINE_BROKER", "TOKENLINE_LEDGER"):
        named = os.environ.get(variable, "").strip()
        if named and named != DEFAULT_URL:
            raise ConfigError(
                "url",
                f"App(settings=...) names no store, and {variable}={named!r} does: "
                "settings given whole do not read the environment. Pass App(url=...) or "
                "Settings(url=...), or build them with tokenline.load_settings(Settings, "
                "{...}) to take the environment's",
            )


class App:
    """A tokenline application: where jobs are stored and which tasks exist.

    ``url`` defaults to ``TOKENLINE_URL``, then ``sqlite:///tokenline.db``. The split
    topology gives one URL per role instead: ``broker`` and ``leases`` on Redis, the
    ``ledger`` on PostgreSQL (or ``TOKENLINE_BROKER`` / ``_LEASES`` / ``_LEDGER``). ``clock`` is
    this process's clock: its monotonic reading decides when a worker stops trusting
    its leases, its wall reading is only compared with the store's to report skew.
    Every time a store compares or stores comes from the store's own clock (the
    in-memory store, living in this process, uses this one).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        broker: str | None = None,
        leases: str | None = None,
        ledger: str | None = None,
        settings: Settings | None = None,
        clock: Clock | None = None,
        classifier: Classifier | None = None,
    ) -> None:
        base = settings or load_settings(Settings)
        roles = {"broker": broker, "leases": leases, "ledger": ledger}
        if url is None and all(v is None for v in roles.values()):
            if settings is None:
                _refuse_empty_url_variable(base)
            else:
                _refuse_url_variable_ignored(base)
        if any(v is not None for v in roles.values()):
            if url is not None:
                raise ConfigError(
                    "url", "give a store URL or the split topology's role URLs, not both"
                )
            base = Settings(**{**_as_dict(base), **roles})
        elif url is not None:
            base = Settings(**{**_as_dict(base), "url": url, **dict.fromkeys(roles)})
        if base.broker is not None:
            # One URL names the whole topology from here on: workers and commands get it.
            base = Settings(**{**_as_dict(base), "url": base.store_url, **dict.fromkeys(roles)})
        self.settings = base
        self.clock: Clock = clock or SystemClock()
        if classifier is not None and not callable(classifier):
            raise ConfigError(
                "classifier",
                "must be a function of the exception returning an ErrorClass, a Decision "
                f"or None; got {describe(classifier)}",
            )
        self.classifier = classifier
        self.retry = RetryPolicy(base.retry_base, base.retry_cap)
        self._tasks: dict[str, Task] = {}
        self._periodic: dict[str, Periodic] = {}
        #: Named dependencies, each behind a circuit breaker (:meth:`dependency`).
        self.dependencies = DependencyRegistry()
        self._portal = _Portal()
        # One in-memory store is shared by everything in the process: it *is* the data,
        # and this process's clock is its store clock.
        self._memory = MemoryStore(clock=self.clock) if base.url.startswith("memory:") else None

    @property
    def url(self) -> str:
        """The store URL."""
        return self.settings.url

    def __repr__(self) -> str:
        return f"<tokenline.App url={redact(self.url)!r} tasks={sorted(self._tasks)}>"

    # -- tasks ----------------------------------------------------------------------------
    @overload
    def task(self, fn: F) -> F: ...

    @overload
    def task(
        self,
        fn: None = None,
        *,
        name: str | None = None,
        queue: str = "default",
        max_attempts: int | None = None,
        timeout: float | None = None,
        priority: int = 0,
        retry: RetryPolicy | None = None,
        classifier: Classifier | None = None,
        max_lease_expiries: int | None = None,
        depends_on: Iterable[str] = (),
    ) -> Callable[[F], F]: ...

    def task(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        queue: str = "default",
        max_attempts: int | None = None,
        timeout: float | None = None,
        priority: int = 0,
        retry: RetryPolicy | None = None,
        classifier: Classifier | None = None,
        max_lease_expiries: int | None = None,
        depends_on: Iterable[str] = (),
    ) -> F | Callable[[F], F]:
        """Register a handler. Used bare (``@app.task``) or with options.

        ``max_attempts`` bounds the attempts that fail; ``max_lease_expiries`` the times
        a worker running the job may lose its lease (default: the app's, 3).
        ``depends_on``: names of :meth:`dependency` registrations; while one's circuit
        breaker is open, the task's jobs wait, no attempt spent. The names are checked
        when a worker starts, so they may be registered after the task.
        """
        needs = dependency_names(depends_on)

        def register(func: F) -> F:
            # Before the name is read from it: a string here is a name passed as ``fn``.
            if (problem := handler_problem(func)) is not None:
                raise ConfigError("handler", problem)
            task = Task(
                name=_default_name(func) if name is None else name,
                fn=func,
                queue=queue,
                max_attempts=max_attempts,
                timeout=timeout,
                priority=priority,
                retry=retry,
                classifier=classifier,
                max_lease_expiries=max_lease_expiries,
                depends_on=needs,
            )
            if task.name in self._tasks and self._tasks[task.name].fn is not func:
                raise InvalidInputError(f"a task named {task.name!r} is already registered")
            self._tasks[task.name] = task
            return func

        return register(fn) if fn is not None else register

    def periodic(
        self,
        *,
        cron: str,
        timezone: str = "UTC",
        catch_up: str = "latest",
        queue: str | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> Callable[[F], F]:
        """Register a function as a task that the maintenance leader enqueues at every
        instant of ``cron`` in ``timezone`` (an IANA name; never the machine's zone).

        ``catch_up``: instants missed while no leader ran — ``"all"`` enqueues each,
        ``"latest"`` the most recent only, ``"skip"`` none. ``args``/``kwargs`` are the
        job's arguments, checked now like an enqueue's; ``queue`` overrides the task's.
        ``name`` names the task and the schedule (default: the task's name). A function
        already registered with :meth:`task` keeps its options. Each instant is
        enqueued at most once, whatever happens to the leader (``scheduler.py``); a bad
        cron, zone or mode is a :class:`ConfigError` naming it, here, as are arguments
        that could not make a job (setting ``args``, for ``kwargs`` too: the message
        says which does not fit).
        """

        def register(func: F) -> F:
            known = next((t for t in self._tasks.values() if t.fn is func), None)
            task_name = known.name if known is not None else name
            if task_name is None:
                if (problem := handler_problem(func)) is not None:
                    raise ConfigError("handler", problem)
                task_name = _default_name(func)
            # The schedule first: a bad one registers nothing, not even the task.
            schedule = Periodic(
                name=name or task_name,
                task=task_name,
                cron=cron,
                timezone=timezone,
                catch_up=catch_up,
                queue=queue,
                args=tuple(args),
                kwargs=dict(kwargs or {}),
            )
            if schedule.name in self._periodic and self._periodic[schedule.name] != schedule:
                raise ConfigError("name", f"a periodic schedule named {schedule.name!r} exists")
            task = known
            if task is None:
                self.task(name=task_name)(func)
                task = self._tasks[task_name]
            try:
                # The arguments must make a valid job: better now than at every instant.
                self.build_job(task, schedule.args, schedule.kwargs, queue=queue)
            except InvalidInputError as exc:
                if known is None:
                    del self._tasks[task_name]
                # A ConfigError like the schedule's other options: the decorator's
                # arguments are at fault, not a job's; the message says which of them.
                raise ConfigError("args", f"periodic {schedule.name!r}: {exc}") from None
            self._periodic[schedule.name] = schedule
            return func

        return register

    @property
    def periodics(self) -> Mapping[str, Periodic]:
        """Registered periodic schedules by name."""
        return dict(self._periodic)

    def dependency(
        self,
        name: str,
        *,
        timeout: float = DEFAULT_DEPENDENCY_TIMEOUT,
        failure_rate: float = DEFAULT_FAILURE_RATE,
        slow_call: float | None = None,
        window: float = DEFAULT_BREAKER_WINDOW,
        min_calls: int = MIN_CALLS,
        open_for: float = DEFAULT_OPEN_FOR,
        probe_calls: int = DEFAULT_PROBE_CALLS,
    ) -> Dependency:
        """Register a named dependency with its circuit breaker and return it.

        ``timeout``: seconds a call may take (``ctx.dependency(name)`` cancels an async
        one, counts a sync one). The breaker opens when ``failure_rate`` of the calls
        over the last ``window`` seconds were bad (failed, timed out, or slower than
        ``slow_call``), with at least ``min_calls`` of them; it stays open ``open_for``
        seconds, then lets ``probe_calls`` trial calls through, one worker at a time.
        Each setting is validated here (:class:`ConfigError` naming it). A name can be
        registered once, as a task's: a second registration is refused
        (:class:`InvalidInputError`), whatever its settings.
        """
        return self.dependencies.add(
            Dependency(
                name=name,
                timeout=timeout,
                failure_rate=failure_rate,
                slow_call=slow_call,
                window=window,
                min_calls=min_calls,
                open_for=open_for,
                probe_calls=probe_calls,
            )
        )

    def on(self, url: str) -> App:
        """This app — its settings, clock, classifier, tasks and dependencies — on the
        store at ``url`` (``tokenline worker --app … --url …``). The tasks are the same
        objects, with every option they were registered with."""
        moved = App(url, settings=self.settings, clock=self.clock, classifier=self.classifier)
        moved._tasks.update(self._tasks)
        moved._periodic.update(self._periodic)
        for dependency in self.dependencies.values():
            moved.dependencies.add(dependency)
        return moved

    @property
    def tasks(self) -> Mapping[str, Task]:
        """Registered tasks by name."""
        return dict(self._tasks)

    def get_task(self, name: str) -> Task:
        """The task registered as ``name``; :class:`UnknownTaskError` otherwise."""
        try:
            return self._tasks[name]
        except KeyError:
            known = ", ".join(sorted(self._tasks)) or "none"
            raise UnknownTaskError(f"unknown task {describe(name)} (registered: {known})") from None

    def _resolve(self, task: Task | str | Callable[..., Any]) -> Task:
        if isinstance(task, Task):
            return task
        if isinstance(task, str):
            return self.get_task(task)
        # ==, not only is: a bound method is a new object at each access (obj.method).
        found = [t for t in self._tasks.values() if t.fn is task or t.fn == task]
        if len(found) > 1:
            # Which one was meant cannot be told: each may have its queue, retries...
            names = ", ".join(repr(t.name) for t in found)
            raise InvalidInputError(
                f"function {describe(task)} is registered as several tasks ({names}): "
                "enqueue one by its name"
            )
        if found:
            return found[0]
        raise UnknownTaskError(f"task {describe(task)} is not a registered task of this app")

    # -- building jobs --------------------------------------------------------------------
    def build_job(
        self,
        task: Task | str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        run_at: float | None = None,
        queue: str | None = None,
        max_attempts: int | None = None,
        unique: UniqueOption = False,
        unique_for: float | None = None,
    ) -> NewJob:
        """Validate one job's input and encode it; raises before anything is stored.

        Every enqueue (``enqueue``, ``enqueue_async``, ``enqueue_many``, the command
        line) goes through here, so every store gets the same checks; the limits are in
        :mod:`tokenline._jobs` (``MAX_DELAY``, ``MIN_PRIORITY`` … ``MAX_PAYLOAD_DEPTH``).
        """
        t = self._resolve(task)
        payload = self._encode(t, args, kwargs)
        if idempotency_key is not None:
            validate_key(idempotency_key, "idempotency_key")
        uniqueness = _uniqueness(unique, unique_for, idempotency_key)
        if delay is not None and run_at is not None:
            raise InvalidInputError("give delay or run_at, not both")
        if delay is not None:
            _refuse("delay", seconds_problem(delay, zero=True))
        elif run_at is not None:
            now = self.clock.now()
            _refuse("run_at", run_at_problem(run_at, now))
            if run_at <= now:
                # Past means now, by the store's clock: aging counts from run_at, so a
                # run_at years back would outrank every priority from its first claim.
                run_at = None
        prio = t.priority if priority is None else priority
        _refuse("priority", priority_problem(prio))
        attempts = next(
            a for a in (max_attempts, t.max_attempts, self.settings.max_attempts) if a is not None
        )
        expiries = next(
            e for e in (t.max_lease_expiries, self.settings.max_lease_expiries) if e is not None
        )
        _refuse("max_attempts", attempts_problem(attempts))
        _refuse("max_lease_expiries", attempts_problem(expiries))
        return NewJob(
            # Only None means "the task's queue": an empty name is an invalid name.
            queue=check_queue_name(t.queue if queue is None else queue),
            task=t.name,
            args=payload,
            idempotency_key=idempotency_key,
            priority=prio,
            run_at=run_at,
            delay=delay,
            max_attempts=attempts,
            timeout=t.timeout,
            max_lease_expiries=expiries,
            unique=uniqueness,
            unique_for=unique_for,
        )

    def _encode(self, t: Task, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> str:
        """The JSON payload of one job, checked against the size limit.

        Only values that come back from JSON as they went in are accepted: ``None``,
        bool, int, finite float, str, list, and dict with str keys (subclasses, such as
        enums, arrive as their plain value), nested at most ``MAX_PAYLOAD_DEPTH`` deep.
        A tuple, a set, bytes or a non-string key would reach the handler changed, so
        it is refused rather than converted.
        """
        if not isinstance(args, list | tuple):
            raise PayloadError(
                f"args of task {t.name!r} must be a list or tuple of arguments, "
                f"got {describe(args)}"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise PayloadError(
                f"kwargs of task {t.name!r} must be a mapping, got {describe(kwargs)}"
            )
        kw = dict(kwargs or {})
        for field, values in (("args", args), ("kwargs", kw)):
            if not values:
                continue
            try:
                _check_items(values, 0)
            except _NotJson as exc:
                raise PayloadError(
                    f"{field}{exc.where()} of task {t.name!r} {exc.problem}"
                ) from None
            except RecursionError:  # the caller's own stack was nearly full
                raise PayloadError(f"{field} of task {t.name!r} nest too deep") from None
        # After the values' own checks, which name the field at fault.
        if (unfit := t.args_problem(args, kw)) is not None:
            raise PayloadError(f"args of task {t.name!r} {unfit}")
        try:
            payload = _encode_payload({"args": list(args), "kwargs": kw})
        except (TypeError, ValueError, RecursionError) as exc:
            raise PayloadError(f"args or kwargs of task {t.name!r} are not JSON: {exc}") from None
        # Characters bound bytes from below (at most 4 bytes each): encode only when needed.
        if len(payload) * 4 > self.settings.max_payload_bytes:
            size = len(payload.encode("utf-8"))
            if size > self.settings.max_payload_bytes:
                raise PayloadError(
                    f"args and kwargs of task {t.name!r} are {size} bytes, over the limit of "
                    f"{self.settings.max_payload_bytes} (setting max_payload_bytes)"
                )
        return payload

    # -- stores ---------------------------------------------------------------------------
    def open_store(self, *, timeout: float | None = None) -> Store:
        """A new, unopened store handle for this app's URL (one per event loop)."""
        if self._memory is not None:
            return self._memory
        # Never the app's clock: every time a store compares or stores is its own.
        return store_from_url(
            self.url,
            timeout=timeout or self.settings.store_timeout,
            migrate=self.settings.migrate,
        )

    async def _store(self) -> Store:
        return await self._portal.opened(self.open_store)

    def run(self, coro_fn: Callable[[Store], Coroutine[Any, Any, T]]) -> T:
        """Run ``coro_fn(store)`` on the facade's loop and store; for sync callers."""

        async def call() -> T:
            return await coro_fn(await self._store())

        return self._portal.run(call())

    def close(self) -> None:
        """Close the facade's store and loop. Safe to call twice; the app opens them
        again if used after. Calls under way in other threads (enqueues from a web
        server's threads) end first, on the store being closed; those that begin
        meanwhile open a new one. An app not closed is closed at interpreter exit."""
        self._portal.close()

    def __enter__(self) -> Self:
        """``with App(...) as app:`` closes the app at the end of the block."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- enqueue --------------------------------------------------------------------------
    async def enqueue_async(
        self,
        task: Task | str | Callable[..., Any],
        *args: Any,
        kwargs: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        run_at: float | None = None,
        queue: str | None = None,
        max_attempts: int | None = None,
        unique: UniqueOption = False,
        unique_for: float | None = None,
        connection: Any = None,
        store: Store | None = None,
    ) -> int:
        """Enqueue one job from async code and return its id (see :meth:`enqueue`).

        ``connection``: a driver connection in an open transaction; the job then exists
        if and only if that transaction commits.
        """
        job = self.build_job(
            task,
            args,
            kwargs,
            idempotency_key=idempotency_key,
            priority=priority,
            delay=delay,
            run_at=run_at,
            queue=queue,
            max_attempts=max_attempts,
            unique=unique,
            unique_for=unique_for,
        )
        target: _Enqueuer
        if store is not None:
            target = store
        elif connection is not None:
            # Only the caller's connection is used, on the caller's loop: no pool needed.
            target = self.open_store()
        else:
            # The facade's store lives on the portal loop; hop over to it. Refused first
            # where the caller's own open transaction holds the lock it would wait for.
            self._refuse_own_sqlite_lock()
            target = _PortalStore(self)
        (jid,) = await target.jobs_enqueue(jobs=[job], connection=connection)
        return jid

    def _refuse_own_sqlite_lock(self, what: str = "enqueue") -> None:
        """Raise when this thread (a sync handler's) or task (an async handler's) holds
        the write lock of the app's SQLite file in an open ``ctx.transaction()``: a write
        (``what``) on the facade's store would wait for it until the store's timeout,
        and fail as a coordination error, attempt after attempt (see
        ``stores/sqlite/_callers.py``)."""
        if self.url.split(":", 1)[0].strip().lower() != "sqlite":
            return
        from .stores.sqlite._callers import (
            held_by_this_task,
            held_by_this_thread,
            own_lock_refused,
        )
        from .stores.sqlite.store import path_from_url

        held = held_by_this_task() | held_by_this_thread()
        if held and str(path_from_url(self.url).resolve()) in held:
            raise own_lock_refused(path_from_url(self.url), what)

    def enqueue(
        self,
        task: Task | str | Callable[..., Any],
        *args: Any,
        kwargs: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        run_at: float | None = None,
        queue: str | None = None,
        max_attempts: int | None = None,
        unique: UniqueOption = False,
        unique_for: float | None = None,
        connection: Any = None,
    ) -> int:
        """Enqueue one job and return its id. Bad input raises before anything is stored.

        ``unique=True`` (with an ``idempotency_key``) makes the key keep a second job
        out for good: while an earlier unique job holds the key, the enqueue inserts
        nothing and returns *that* job's id. ``unique="active"`` holds the key only until
        the job is finished (succeeded, dead or cancelled); ``unique_for=seconds`` ends
        the hold that long after the holder was enqueued. The store decides atomically
        (one ``INSERT … ON CONFLICT`` on its key table), so concurrent enqueues of one key
        from any number of processes yield one job.
        """
        job = self.build_job(
            task,
            args,
            kwargs,
            idempotency_key=idempotency_key,
            priority=priority,
            delay=delay,
            run_at=run_at,
            queue=queue,
            max_attempts=max_attempts,
            unique=unique,
            unique_for=unique_for,
        )
        if connection is not None:
            # A driver connection belongs to the caller's thread: insert right here.
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                store = self.open_store()
                (jid,) = asyncio.run(store.jobs_enqueue(jobs=[job], connection=connection))
                return jid
            raise InvalidInputError(
                "enqueue(connection=...) called on a running event loop: "
                "use `await app.enqueue_async(..., connection=conn)`"
            )
        (jid,) = self._enqueue_now([job])
        return jid

    def cancel(self, *job_ids: int, reason: str = "cancelled") -> int:
        """Cancel jobs that have not run yet (queued or scheduled) or are dead: they
        never run (again), and keep ``reason`` as their last error. Return how many
        were cancelled. A running job is left to finish its attempt, and a finished
        one as it is: ``tokenline cancel`` names each id it did not cancel, and why."""
        ids, why = cancel_input(job_ids, reason)
        if not ids:
            return 0
        self._refuse_own_sqlite_lock("cancel")
        return self.run(lambda s: s.jobs_cancel(job_ids=ids, reason=why))

    async def cancel_async(self, *job_ids: int, reason: str = "cancelled") -> int:
        """:meth:`cancel` from async code."""
        ids, why = cancel_input(job_ids, reason)
        if not ids:
            return 0
        self._refuse_own_sqlite_lock("cancel")  # here, in the caller's task
        return await asyncio.to_thread(self.run, lambda s: s.jobs_cancel(job_ids=ids, reason=why))

    def build_many(
        self,
        task: Task | str | Callable[..., Any],
        items: Iterable[Sequence[Any]],
        *,
        keys: Iterable[str | None] | None = None,
        priority: int | None = None,
        delay: float | None = None,
        queue: str | None = None,
        unique: UniqueOption = False,
        unique_for: float | None = None,
    ) -> list[NewJob]:
        """Validate a batch: one job per argument tuple in ``items``, keys matched by order."""
        if isinstance(items, str | bytes | Mapping):
            raise PayloadError(
                "items must be an iterable of argument lists or tuples, one per job, "
                f"got {describe(items)}"
            )
        rows = [_row(n, i) for n, i in enumerate(items)]
        if isinstance(keys, str | bytes):
            raise InvalidInputError(
                f"keys must be an iterable of idempotency keys, one per job, got {describe(keys)}"
            )
        key_list = list(keys) if keys is not None else [None] * len(rows)
        if len(key_list) != len(rows):
            raise InvalidInputError(f"{len(key_list)} keys given for {len(rows)} jobs")
        if not rows:
            return []
        t = self._resolve(task)

        def encode(n: int, row: tuple[Any, ...], key: str | None) -> str:
            # In build_job's order: the arguments, then the key.
            try:
                args = self._encode(t, row, None)
            except PayloadError as exc:
                raise PayloadError(f"items[{n}]: {exc}") from None
            if key is not None:
                validate_key(key, f"keys[{n}] (idempotency_key)")
            elif unique is True or unique == "active":
                raise InvalidInputError(
                    f"keys[{n}] is None: with unique={unique!r} every job of the batch "
                    "needs an idempotency key (the key is what is unique)"
                )
            return args

        encode(0, rows[0], key_list[0])
        # The options are the same for every job: validate them once, with the first
        # job, then check and encode only what differs (arguments and key).
        first = self.build_job(
            t,
            rows[0],
            None,
            idempotency_key=key_list[0],
            priority=priority,
            delay=delay,
            queue=queue,
            unique=unique,
            unique_for=unique_for,
        )
        jobs = [first]
        for n, (row, key) in enumerate(zip(rows[1:], key_list[1:], strict=True), 1):
            args = encode(n, row, key)
            jobs.append(
                NewJob(  # not dataclasses.replace: it costs more than all the rest here
                    queue=first.queue,
                    task=first.task,
                    args=args,
                    idempotency_key=key,
                    priority=first.priority,
                    run_at=first.run_at,
                    delay=first.delay,
                    max_attempts=first.max_attempts,
                    timeout=first.timeout,
                    max_lease_expiries=first.max_lease_expiries,
                    unique=_uniqueness(unique, unique_for, key),
                    unique_for=first.unique_for,
                )
            )
        return jobs

    def enqueue_many(
        self,
        task: Task | str | Callable[..., Any],
        items: Iterable[Sequence[Any]],
        *,
        keys: Iterable[str | None] | None = None,
        priority: int | None = None,
        delay: float | None = None,
        queue: str | None = None,
        unique: UniqueOption = False,
        unique_for: float | None = None,
    ) -> list[int]:
        """Enqueue a batch atomically (all or none) and return the ids in order.

        With ``unique`` every job needs a key; a job whose key is held (by an earlier
        job, or by an earlier job of this batch) gets the holder's id.
        """
        jobs = self.build_many(
            task,
            items,
            keys=keys,
            priority=priority,
            delay=delay,
            queue=queue,
            unique=unique,
            unique_for=unique_for,
        )
        return self._enqueue_now(jobs)

    def _enqueue_now(self, jobs: list[NewJob]) -> list[int]:
        """Insert ``jobs`` for a synchronous caller: on the caller's own thread where the
        open store can (no hop to the facade's loop and back: most of a single
        enqueue's cost), else through the loop."""
        for first in (True, False):
            with self._portal.open_store() as store:
                if store is not None:
                    if store.capabilities.blocking_enqueue:
                        try:
                            return store.jobs_enqueue_blocking(jobs=jobs)
                        except EventLoopNeeded:
                            pass  # nothing written: the async path takes what it needs first
                    break
            if first:
                # Opened on the facade's loop, then used from here like every later call:
                # the first enqueue of a process is checked and written as the next ones.
                self.run(_itself)
        return self.run(lambda s: s.jobs_enqueue(jobs=jobs))


async def _itself(store: Store) -> Store:
    return store


class _Enqueuer(Protocol):
    async def jobs_enqueue(
        self, *, jobs: Sequence[NewJob], connection: Any = None
    ) -> list[int]: ...


class _PortalStore:
    """Forwards ``jobs_enqueue`` to the facade's loop from any other loop."""

    def __init__(self, app: App) -> None:
        self._app = app

    async def jobs_enqueue(self, *, jobs: Sequence[NewJob], connection: Any = None) -> list[int]:
        return await asyncio.to_thread(
            self._app.run, lambda s: s.jobs_enqueue(jobs=jobs, connection=connection)
        )


#: Longest reason a cancel may give (a job's error is cut past 2,000 characters anyway).
_MAX_CANCEL_REASON = 2_000


def cancel_input(job_ids: Sequence[object], reason: object) -> tuple[list[int], str]:
    """The ids and reason of a cancel, checked: each id a job id, the reason text."""
    for job_id in job_ids:
        if not possible_job_id(job_id):
            raise InvalidInputError(
                f"job ids are whole numbers from 1 to {MAX_JOB_ID}, got {describe(job_id)}"
            )
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInputError(f"reason must be a non-empty string, got {describe(reason)}")
    if len(reason) > _MAX_CANCEL_REASON:
        raise InvalidInputError(
            f"reason is {len(reason)} characters, over the limit of {_MAX_CANCEL_REASON}"
        )
    # Kept as the jobs' error: NULs and lone surrogates escaped, as every store can keep.
    return [j for j in dict.fromkeys(job_ids) if isinstance(j, int)], error_text(reason)


def _uniqueness(unique: UniqueOption, unique_for: float | None, key: str | None) -> Unique | None:
    """The store's :class:`Unique` mode for the enqueue options, validated."""
    if unique is False:
        if unique_for is not None:
            raise InvalidInputError("unique_for needs unique=True or unique='active'")
        return None
    if unique is not True and unique != "active":
        raise InvalidInputError(f"unique must be True, False or 'active', got {describe(unique)}")
    if key is None:
        raise InvalidInputError("a unique job needs an idempotency_key: the key is what is unique")
    if unique_for is not None:
        _refuse("unique_for", seconds_problem(unique_for, zero=False))
    return Unique.ACTIVE if unique == "active" else Unique.ALWAYS


def _row(n: int, item: object) -> tuple[Any, ...]:
    """The arguments of the ``n``-th item of a batch: a list or tuple of them.

    A bare string is refused rather than taken as one argument: it is as likely a row
    whose parentheses were forgotten (``("a", "b")`` written ``"ab"``), which would
    enqueue a job with the wrong arguments that fails only when it runs."""
    if isinstance(item, str | bytes):
        raise PayloadError(
            f"items[{n}] is a bare {type(item).__name__} ({describe(item)}); each item is a "
            f"list or tuple of one job's arguments: write ({describe(item)},) for one argument"
        )
    if isinstance(item, list | tuple):
        return tuple(item)
    raise PayloadError(
        f"items[{n}] must be a list or tuple of one job's arguments, got {describe(item)}"
    )


def _refuse(option: str, problem: str | None) -> None:
    """Raise :class:`InvalidInputError` naming ``option`` if there is a ``problem``."""
    if problem is not None:
        raise InvalidInputError(f"{option} {problem}")


#: Integers with fewer bits than this have fewer than MAX_INT_DIGITS digits.
_SHORT_INT_BITS = int(MAX_INT_DIGITS * math.log2(10)) - 8
_INT_LIMIT = 10**MAX_INT_DIGITS


class _NotJson(Exception):
    """A value JSON would not give back as it is: why, and where (innermost first)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []

    def where(self) -> str:
        """The path to the value, such as ``[0]['when']``, its middle elided if long."""
        path = self.path[::-1]
        if len(path) > 8:
            path = [*path[:4], f"[… {len(path) - 6} more …]", *path[-2:]]
        return "".join(path)


def _check_items(container: Sequence[Any] | Mapping[Any, Any], depth: int) -> None:
    """Check each item of a list or dict that is ``depth`` containers deep."""
    if isinstance(container, Mapping):
        for key, item in container.items():
            if not isinstance(key, str):
                raise _NotJson(
                    f"has the key {describe(key)} ({type(key).__name__}): "
                    "JSON object keys and keyword names are strings"
                )
            if (paired := _pair_problem(key)) is not None:
                raise _NotJson(f"has the key {describe(key)}, which {paired}")
            try:
                _check_json(item, depth)
            except _NotJson as exc:
                exc.path.append(f"[{describe(key)}]")
                raise
    else:
        for i, item in enumerate(container):
            kind = type(item)
            # The usual plain values first, without a call (a batch checks many).
            if (
                (kind is str and (item.isascii() or _SURROGATE_PAIR.search(item) is None))
                or item is None
                or kind is bool
                or (kind is int and item.bit_length() <= _SHORT_INT_BITS)
                or (kind is float and item - item == 0.0)  # finite: inf - inf is nan
            ):
                continue
            try:
                _check_json(item, depth)
            except _NotJson as exc:
                exc.path.append(f"[{i}]")
                raise


#: A high surrogate followed by a low one. JSON writes a character above U+FFFF as such
#: a pair of escapes, and reads any such pair back as that one character: two code points
#: of a Python string would reach the handler as one.
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _pair_problem(text: str) -> str | None:
    """Why JSON would not give ``text`` back as it is (a surrogate pair), or None."""
    if text.isascii():  # a flag of the string: no search for the usual case
        return None
    found = _SURROGATE_PAIR.search(text)
    if found is None:
        return None
    joined = found.group().encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    return (
        f"holds the surrogates {found.group()!r} at position {found.start()}, which JSON "
        f"reads back as the one character {joined!r} (U+{ord(joined):X}): pass that "
        "character itself"
    )


def _check_json(value: object, depth: int) -> None:
    """Raise :class:`_NotJson` unless JSON gives ``value`` back equal and of the same
    kind; ``depth``: the lists and dicts around it inside its argument."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if (paired := _pair_problem(value)) is not None:
            raise _NotJson(paired)
        return
    if isinstance(value, int):
        if value.bit_length() > _SHORT_INT_BITS and abs(value) >= _INT_LIMIT:
            raise _NotJson(f"is an integer of more than {MAX_INT_DIGITS} digits (MAX_INT_DIGITS)")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NotJson(f"is {value!r}: JSON has no NaN or infinity")
        return
    if isinstance(value, list | dict):
        if depth >= MAX_PAYLOAD_DEPTH:
            raise _NotJson(
                f"nests lists and dicts more than {MAX_PAYLOAD_DEPTH} deep (MAX_PAYLOAD_DEPTH)"
            )
        _check_items(value, depth + 1)
        return
    if isinstance(value, tuple):
        raise _NotJson("is a tuple: JSON has no tuples (it would arrive as a list); pass a list")
    raise _NotJson(
        f"is a {type(value).__name__}, which JSON cannot hold: use None, bool, int, float, "
        "str, list, or dict with str keys"
    )


def _default_name(func: Callable[..., Any]) -> str:
    """The name of a task registered without one: ``module.qualname`` (a callable
    object's are its class's)."""
    module = getattr(func, "__module__", None) or type(func).__module__
    qualname = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{module}.{qualname}"


def _as_dict(settings: Settings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in Settings.__dataclass_fields__}
