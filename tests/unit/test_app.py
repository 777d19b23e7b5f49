"""The App facade: URL resolution, task registration and validated, all-or-nothing enqueue."""

from __future__ import annotations

import functools
import gc
import json
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tokenline import (
    DEFAULT_URL,
    App,
    ConfigError,
    FakeClock,
    InvalidInputError,
    JobState,
    PayloadError,
    QueueNameError,
    Settings,
    StoreUnavailableError,
    Task,
    UnknownTaskError,
)
from tokenline.stores import MemoryStore


def sample_task(ctx: Any, x: int) -> int:
    """A module-level handler, for the default task name."""
    return x


def _dispose(app: App) -> None:
    """Close ``app`` and make sure its facade event loop is closed too.

    ``App.close()`` stops the facade's loop but does not close it (see
    ``test_close_closes_the_facade_event_loop``); closing it here keeps that one defect
    from surfacing as ResourceWarnings in whichever later test the collector runs in.
    """
    loop = getattr(getattr(app, "_portal", None), "_loop", None)
    app.close()
    if loop is None:
        return
    deadline = time.monotonic() + 5
    while loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not loop.is_closed():
        loop.close()


@pytest.fixture
def make_app() -> Iterator[Callable[..., App]]:
    """A factory of apps that are all disposed of after the test."""
    apps: list[App] = []

    def make(*args: Any, **kwargs: Any) -> App:
        a = App(*args, **kwargs)
        apps.append(a)
        return a

    try:
        yield make
    finally:
        for a in apps:
            _dispose(a)


@pytest.fixture
def app(make_app: Callable[..., App]) -> App:
    """An in-memory app with two tasks."""
    a = make_app("memory://")
    a.task(name="mail.send")(lambda ctx, to: None)
    a.task(name="billing.invoice", queue="billing", priority=3, max_attempts=7)(
        lambda ctx, order, **options: None
    )
    return a


def stored(app: App) -> list[Any]:
    """Every job in the app's store, newest first."""
    return app.run(lambda s: s.jobs_list())


# -- URL ------------------------------------------------------------------------------------


def test_default_url_is_local_sqlite() -> None:
    """Without a URL or TOKENLINE_URL, the app points at sqlite:///tokenline.db."""
    app = App()
    assert app.url == DEFAULT_URL == "sqlite:///tokenline.db"


def test_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a URL argument, TOKENLINE_URL decides."""
    monkeypatch.setenv("TOKENLINE_URL", "postgresql://db.example/jobs")
    assert App().url == "postgresql://db.example/jobs"


def test_explicit_url_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL passed to App() wins over TOKENLINE_URL."""
    monkeypatch.setenv("TOKENLINE_URL", "postgresql://db.example/jobs")
    assert App("sqlite:///other.db").url == "sqlite:///other.db"


def test_settings_given_whole_with_a_url_variable_naming_another_store_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``App(settings=Settings(retry_base=2))`` read no environment and used the default
    store while TOKENLINE_URL named the one the workers consume: jobs went to a local
    file. It is refused naming the variable; a URL given, or settings built with
    load_settings, decide."""
    from tokenline import Settings, load_settings

    monkeypatch.setenv("TOKENLINE_URL", "postgresql://db.example/jobs")
    with pytest.raises(ConfigError, match=r"TOKENLINE_URL='postgresql://db.example/jobs'"):
        App(settings=Settings(retry_base=2.0))
    assert App("sqlite:///other.db", settings=Settings(retry_base=2.0)).url == "sqlite:///other.db"
    merged = App(settings=load_settings(Settings, {"retry_base": 2.0}))
    assert (merged.url, merged.settings.retry_base) == ("postgresql://db.example/jobs", 2.0)
    monkeypatch.setenv("TOKENLINE_URL", DEFAULT_URL)  # naming the default: nothing lost
    assert App(settings=Settings(retry_base=2.0)).url == DEFAULT_URL
    # The default written out is a store named: taken as given.
    monkeypatch.setenv("TOKENLINE_URL", "postgresql://db.example/jobs")
    assert App(settings=Settings(url="sqlite:///tokenline.db")).url == DEFAULT_URL
    # The split topology's variables name a store too.
    monkeypatch.delenv("TOKENLINE_URL")
    monkeypatch.setenv("TOKENLINE_BROKER", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("TOKENLINE_LEDGER", "postgresql://db.example/jobs")
    with pytest.raises(ConfigError, match=r"TOKENLINE_BROKER='redis://127.0.0.1:6379/0'"):
        App(settings=Settings())


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_url_variable_is_refused_not_read_as_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """TOKENLINE_URL set but empty is a ConfigError naming it, as in the CLI: read as
    unset, the app would have used sqlite:///tokenline.db, the wrong store, silently.
    A URL given to App() or a split topology from the environment still decides."""
    monkeypatch.setenv("TOKENLINE_URL", value)
    with pytest.raises(ConfigError, match=r"TOKENLINE_URL.*is set but empty") as info:
        App()
    assert info.value.setting == "TOKENLINE_URL"
    assert App("memory://").url == "memory://"
    monkeypatch.setenv("TOKENLINE_BROKER", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("TOKENLINE_LEDGER", "postgresql://db.example/jobs")
    assert App().url.startswith("split:")


def test_explicit_url_keeps_other_settings() -> None:
    """App(url, settings=...) replaces only the URL of the given settings."""
    app = App("memory://", settings=Settings(max_attempts=9, url="sqlite:///x.db"))
    assert app.url == "memory://"
    assert app.settings.max_attempts == 9


def test_bad_env_setting_fails_app_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """A malformed TOKENLINE_* variable stops App() with ConfigError naming it."""
    monkeypatch.setenv("TOKENLINE_MAX_ATTEMPTS", "lots")
    with pytest.raises(ConfigError) as info:
        App()
    assert info.value.setting == "max_attempts"


def test_memory_app_shares_one_store(clock: FakeClock) -> None:
    """Every store handle of a memory:// app is the same MemoryStore, on the app's clock."""
    app = App("memory://", clock=clock)
    store = app.open_store()
    assert isinstance(store, MemoryStore)
    assert app.open_store() is store
    assert store.clock is clock


# -- tasks ----------------------------------------------------------------------------------


def test_bare_decorator_names_task_module_dot_qualname() -> None:
    """@app.task without a name registers module.qualname and returns the function unchanged."""
    app = App("memory://")
    assert app.task(sample_task) is sample_task
    name = f"{sample_task.__module__}.sample_task"
    assert list(app.tasks) == [name]
    assert app.get_task(name).fn is sample_task


def test_task_options_are_kept() -> None:
    """Options given to @app.task end up on the registered Task."""
    app = App("memory://")
    app.task(name="t.opts", queue="q1", max_attempts=3, timeout=2.5, priority=-1)(sample_task)
    t = app.get_task("t.opts")
    assert (t.queue, t.max_attempts, t.timeout, t.priority) == ("q1", 3, 2.5, -1)
    assert not t.is_async


def test_async_handler_is_detected() -> None:
    """A coroutine function is registered as an async task."""
    app = App("memory://")

    async def handler(ctx: Any) -> None:
        return None

    app.task(name="t.async")(handler)
    assert app.get_task("t.async").is_async


@pytest.mark.parametrize("queue", ["", "has space", "x" * 65, "a/b", "é"])
def test_bad_queue_name_is_refused_at_registration(queue: str) -> None:
    """A task whose queue name is invalid is refused with QueueNameError, and not registered."""
    app = App("memory://")
    with pytest.raises(QueueNameError):
        app.task(name="t.q", queue=queue)(sample_task)
    assert "t.q" not in app.tasks


@pytest.mark.parametrize("name", ["1starts.with.digit", "has space", "x" * 201, "a/b"])
def test_bad_task_name_is_refused(name: str) -> None:
    """A task name outside the allowed pattern raises InvalidInputError naming it."""
    app = App("memory://")
    with pytest.raises(InvalidInputError, match="invalid task name"):
        app.task(name=name)(sample_task)
    assert app.tasks == {}


def test_empty_task_name_is_refused_not_replaced() -> None:
    """name="" is refused like any invalid name instead of silently becoming module.qualname."""
    app = App("memory://")
    with pytest.raises(InvalidInputError, match="invalid task name"):
        app.task(name="")(sample_task)
    assert app.tasks == {}


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_attempts", 0), ("max_attempts", True), ("timeout", 0), ("timeout", -1.0)],
)
def test_bad_task_option_is_a_config_error(option: str, value: Any) -> None:
    """Invalid per-task max_attempts or timeout raise ConfigError naming the option."""
    app = App("memory://")
    with pytest.raises(ConfigError) as info:
        app.task(name="t.bad", **{option: value})(sample_task)
    assert info.value.setting == option


def test_duplicate_task_name_is_refused() -> None:
    """Registering a second function under a taken name raises, keeping the first."""
    app = App("memory://")
    app.task(name="t.dup")(sample_task)
    with pytest.raises(InvalidInputError, match="already registered"):
        app.task(name="t.dup")(lambda ctx: None)
    assert app.get_task("t.dup").fn is sample_task


def test_registering_the_same_function_twice_is_harmless() -> None:
    """Re-registering the same function under the same name (a re-import) is accepted."""
    app = App("memory://")
    app.task(name="t.same")(sample_task)
    app.task(name="t.same")(sample_task)
    assert list(app.tasks) == ["t.same"]


def test_a_function_registered_as_two_tasks_is_enqueued_by_name_only() -> None:
    """One function under two names (two queues, say): ``enqueue(fn)`` took the first
    silently. It is refused naming both; each name still works."""
    app = App("memory://")
    app.task(name="resize_fast", queue="fast")(sample_task)
    app.task(name="resize_bulk", queue="bulk")(sample_task)
    with pytest.raises(InvalidInputError, match="'resize_fast', 'resize_bulk'"):
        app.build_job(sample_task)
    assert app.build_job("resize_bulk", (1,)).queue == "bulk"
    assert app.build_job(app.get_task("resize_fast"), (1,)).queue == "fast"


def test_a_bound_method_registered_as_a_task_is_enqueued_by_it() -> None:
    """``obj.method`` is a new object at each access: enqueue(obj.method) said the task
    was not registered."""

    class Mailer:
        def send(self, ctx: Any, to: str) -> None:
            """Never runs here."""

    mailer = Mailer()
    app = App("memory://")
    app.task(name="mail.send")(mailer.send)
    assert app.build_job(mailer.send, ("a@example.com",)).task == "mail.send"


def test_get_unknown_task_lists_registered_ones(app: App) -> None:
    """get_task on an unknown name raises UnknownTaskError listing the registered names."""
    with pytest.raises(UnknownTaskError) as info:
        app.get_task("mail.sned")
    msg = str(info.value)
    assert "mail.sned" in msg
    assert "mail.send" in msg
    assert "billing.invoice" in msg


def test_unknown_task_on_empty_app_says_none() -> None:
    """With no tasks registered, the error says so instead of listing nothing."""
    with pytest.raises(UnknownTaskError, match=r"registered: none"):
        App("memory://").get_task("x")


# -- build_job ------------------------------------------------------------------------------


def test_build_job_encodes_args_and_defaults(app: App) -> None:
    """build_job encodes args as JSON and takes queue, priority and attempts from the task."""
    job = app.build_job("billing.invoice", [42], {"currency": "EUR"})
    assert json.loads(job.args) == {"args": [42], "kwargs": {"currency": "EUR"}}
    assert (job.queue, job.task, job.priority, job.max_attempts) == (
        "billing",
        "billing.invoice",
        3,
        7,
    )
    assert job.run_at is None


def test_build_job_falls_back_to_app_max_attempts() -> None:
    """A task without max_attempts uses the app's max_attempts setting."""
    app = App("memory://", settings=Settings(max_attempts=4))
    app.task(name="t.x")(sample_task)
    assert app.build_job("t.x", [1]).max_attempts == 4


def _plain(ctx: object, a: int, b: int = 1) -> None:
    """A handler of plain parameters."""


def _keyword_only(ctx: object, a: int, *, k: int) -> None:
    """A handler with a keyword-only parameter."""


def _anything(ctx: object, *args: object, **kwargs: object) -> None:
    """A handler that takes whatever it is given."""


@pytest.mark.parametrize(
    ("fn", "args", "kwargs", "why"),
    [
        (_plain, [1, 2, 3], None, "3 positional arguments given, at most 2 taken"),
        (_plain, [], None, "missing required argument 'a'"),
        (_plain, [1], {"ctx": 1}, "unexpected keyword argument 'ctx'"),
        (_plain, [1], {"c": 1}, "unexpected keyword argument 'c'"),
        (_plain, [1], {"a": 2}, "'a' given both by position and by keyword"),
        (_keyword_only, [1], None, "missing a required argument: 'k'"),
        (_keyword_only, [1, 2], None, "too many positional arguments"),
    ],
)
def test_args_the_handler_cannot_take_are_refused_when_enqueued(
    fn: Any, args: list[Any], kwargs: dict[str, Any] | None, why: str
) -> None:
    """A job its handler could never run used to be stored, then dead-lettered by the
    worker (TypeError). Refused before anything is stored, naming the task, the
    handler's parameters and what does not fit."""
    app = App("memory://")
    app.task(name="t.fit")(fn)
    with pytest.raises(PayloadError) as caught:
        app.enqueue("t.fit", *args, kwargs=kwargs)
    message = str(caught.value)
    assert message.startswith("args of task 't.fit' do not fit its handler (ctx, a")
    assert why in message
    assert app.run(lambda s: s.jobs_list()) == []
    app.close()


def test_a_wrapper_is_checked_for_what_it_takes_not_what_it_wraps() -> None:
    """A functools.wraps decorator that supplies an argument (a connection, say) takes
    one fewer than the function it names: its jobs were refused as missing that one."""
    db = object()

    def with_db(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(ctx: object, *args: Any) -> Any:
            return fn(ctx, db, *args)

        return wrapper

    app = App("memory://")

    @app.task(name="t.inject")
    @with_db
    def inject(ctx: object, conn: object, order_id: int) -> None:
        """Needs a connection its decorator gives it."""

    assert json.loads(app.build_job("t.inject", [42]).args) == {"args": [42], "kwargs": {}}


@pytest.mark.parametrize("fn", [lambda: None, lambda *, ctx: None], ids=["none", "keyword"])
def test_a_handler_that_cannot_take_the_context_is_refused_when_registered(fn: Any) -> None:
    """The worker calls fn(ctx, *args, **kwargs): a handler with no positional
    parameter could never run, and no enqueue could fit it."""
    with pytest.raises(ConfigError, match="takes no positional parameter for the job context"):
        App("memory://").task(name="t.bad")(fn)


def test_enqueue_many_names_the_item_whose_args_do_not_fit() -> None:
    app = App("memory://")
    app.task(name="t.fit")(_plain)
    with pytest.raises(PayloadError) as caught:
        app.enqueue_many("t.fit", [(1,), (1, 2, 3)])
    assert str(caught.value).startswith("items[1]: args of task 't.fit' do not fit its handler")
    assert app.run(lambda s: s.jobs_list()) == []
    app.close()


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [
        (_plain, [1], None),
        (_plain, [1, 2], None),
        (_plain, [], {"a": 1, "b": 2}),
        (_keyword_only, [1], {"k": 2}),
        (_anything, [1, 2, 3], {"x": 1}),
        (print, [1, 2], {"sep": ""}),  # a builtin: its signature says too little to check
    ],
)
def test_args_the_handler_takes_are_enqueued(
    fn: Any, args: list[Any], kwargs: dict[str, Any] | None
) -> None:
    app = App("memory://")
    app.task(name="t.fit")(fn)
    job = app.build_job("t.fit", args, kwargs)
    assert json.loads(job.args) == {"args": args, "kwargs": kwargs or {}}


def test_build_job_accepts_the_function_itself() -> None:
    """A registered handler function may be passed instead of its name."""
    a = App("memory://")
    a.task(name="t.fn")(sample_task)
    assert a.build_job(sample_task, [1]).task == "t.fn"


def test_build_job_with_unregistered_function_is_unknown(app: App) -> None:
    """Passing a function that is not registered raises UnknownTaskError."""
    with pytest.raises(UnknownTaskError):
        app.build_job(sample_task, [1])


def test_delay_travels_as_a_duration_not_as_the_app_clocks_time(clock: FakeClock) -> None:
    """delay=N reaches the store as a duration: the enqueuer's wall clock (however
    wrong) never sets the job's run_at; the store adds N to its own now."""
    app = App("memory://", clock=clock)
    app.task(name="t.d")(sample_task)
    job = app.build_job("t.d", [1], delay=30)
    assert (job.delay, job.run_at) == (30, None)


def test_explicit_run_at_is_kept(app: App) -> None:
    """A run_at to come is passed through unchanged."""
    later = time.time() + 3600
    assert app.build_job("mail.send", ["a@b"], run_at=later).run_at == later


@pytest.mark.parametrize("run_at", [0, 1.5, 1_000_000_000.0])
def test_a_run_at_already_past_means_now_and_earns_no_aging(
    make_app: Callable[..., App], run_at: float
) -> None:
    """A priority-0 job enqueued with run_at=0 was claimed before a priority-1,000,000
    one: aging counts from run_at, and 56 years of it outranked every priority. A past
    run_at now means now: the job is stored runnable from its enqueue, and priorities
    keep their order."""
    app = make_app("memory://")
    app.task(name="t")(lambda ctx: None)
    assert app.build_job("t", run_at=run_at).run_at is None
    low = app.enqueue("t", run_at=run_at, priority=0)
    high = app.enqueue("t", priority=1_000_000)

    async def first(store: Any) -> list[int]:
        got = await store.jobs_claim(
            owner="w", queues=["default"], limit=1, ttl=30, priority_aging=60.0
        )
        return [c.job.id for c in got]

    assert app.run(first) == [high]
    assert app.run(first) == [low]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ([object()], None),
        ([b"bytes"], None),
        ([{1, 2}], None),
        ([math.nan], None),
        ([math.inf], None),
        ([], {"x": math.nan}),
        ([], ["not", "a", "mapping"]),
    ],
    ids=["object", "bytes", "set", "nan", "inf", "nan-kwarg", "kwargs-list"],
)
def test_non_json_arguments_are_a_payload_error(app: App, args: Any, kwargs: Any) -> None:
    """Arguments that are not strict JSON raise PayloadError naming the task; nothing is stored."""
    with pytest.raises(PayloadError, match=r"mail\.send"):
        app.enqueue("mail.send", *args, kwargs=kwargs)
    assert stored(app) == []


def test_oversized_payload_names_the_limit(make_app: Callable[..., App]) -> None:
    """A payload over max_payload_bytes raises PayloadError naming the size, limit and setting."""
    app = make_app("memory://", settings=Settings(max_payload_bytes=100))
    app.task(name="t.big")(sample_task)
    app.build_job("t.big", ["x" * 50])  # under the limit
    with pytest.raises(PayloadError) as info:
        app.enqueue("t.big", "x" * 200)
    msg = str(info.value)
    assert "100" in msg
    assert "max_payload_bytes" in msg
    assert stored(app) == []


@pytest.mark.parametrize(
    "key", ["", "k" * 256, 123, b"bytes"], ids=["empty", "long", "int", "bytes"]
)
def test_bad_idempotency_key_is_refused(app: App, key: Any) -> None:
    """An empty, over-255-character or non-string idempotency key raises InvalidInputError."""
    with pytest.raises(InvalidInputError, match="idempotency_key"):
        app.enqueue("mail.send", "a@b", idempotency_key=key)
    assert stored(app) == []


def test_idempotency_key_of_max_length_is_accepted(app: App) -> None:
    """A 255-character key is the longest accepted."""
    assert app.build_job("mail.send", ["a@b"], idempotency_key="k" * 255).idempotency_key


@pytest.mark.parametrize("delay", [-1, -0.001, "5"], ids=repr)
def test_bad_delay_is_refused(app: App, delay: Any) -> None:
    """A negative or non-numeric delay raises InvalidInputError; nothing is stored."""
    with pytest.raises(InvalidInputError, match="delay"):
        app.enqueue("mail.send", "a@b", delay=delay)
    assert stored(app) == []


@pytest.mark.parametrize("delay", [math.nan, math.inf], ids=repr)
def test_non_finite_delay_is_refused(app: App, delay: float) -> None:
    """A NaN or infinite delay is refused: such a job could never become ready."""
    with pytest.raises(InvalidInputError, match="delay"):
        app.build_job("mail.send", ["a@b"], delay=delay)


@pytest.mark.parametrize("run_at", ["tomorrow", math.nan], ids=repr)
def test_bad_run_at_is_refused(app: App, run_at: Any) -> None:
    """A run_at that is not a finite number raises InvalidInputError before anything is stored."""
    with pytest.raises(InvalidInputError, match="run_at"):
        app.build_job("mail.send", ["a@b"], run_at=run_at)


def test_delay_and_run_at_together_are_refused(app: App) -> None:
    """Giving both delay and run_at is ambiguous and raises InvalidInputError."""
    with pytest.raises(InvalidInputError, match="not both"):
        app.enqueue("mail.send", "a@b", delay=5, run_at=1_800_000_000.0)
    assert stored(app) == []


@pytest.mark.parametrize("priority", [1.5, True, "high"], ids=repr)
def test_bad_priority_is_refused(app: App, priority: Any) -> None:
    """A priority that is not a plain int raises InvalidInputError; nothing is stored."""
    with pytest.raises(InvalidInputError, match="priority"):
        app.enqueue("mail.send", "a@b", priority=priority)
    assert stored(app) == []


@pytest.mark.parametrize("max_attempts", [0, -1, True, 2.0], ids=repr)
def test_bad_max_attempts_at_enqueue_is_refused(app: App, max_attempts: Any) -> None:
    """An enqueue-time max_attempts below 1 or not an int raises instead of being replaced."""
    with pytest.raises(InvalidInputError, match="max_attempts"):
        app.build_job("mail.send", ["a@b"], max_attempts=max_attempts)


def test_bad_queue_override_is_refused(app: App) -> None:
    """A queue override with an invalid name raises QueueNameError; nothing is stored."""
    with pytest.raises(QueueNameError):
        app.enqueue("mail.send", "a@b", queue="no spaces please")
    assert stored(app) == []


def test_enqueue_unknown_task_lists_registered_and_stores_nothing(app: App) -> None:
    """Enqueueing an unknown task names the registered ones and stores nothing."""
    with pytest.raises(UnknownTaskError, match=r"billing\.invoice, mail\.send"):
        app.enqueue("mail.sendd", "a@b")
    assert stored(app) == []


# -- enqueue --------------------------------------------------------------------------------


def test_enqueue_stores_the_job(app: App) -> None:
    """enqueue returns the id of a queued job carrying task, queue, args, key and priority."""
    jid = app.enqueue(
        "billing.invoice", 42, kwargs={"c": "EUR"}, idempotency_key="invoice:42", priority=5
    )
    (job,) = stored(app)
    assert job.id == jid
    assert job.task == "billing.invoice"
    assert job.queue == "billing"
    assert json.loads(job.args) == {"args": [42], "kwargs": {"c": "EUR"}}
    assert job.idempotency_key == "invoice:42"
    assert job.priority == 5
    assert job.max_attempts == 7
    assert job.state is JobState.QUEUED
    assert job.attempt == 0


def test_enqueue_with_delay_is_scheduled(make_app: Callable[..., App], clock: FakeClock) -> None:
    """A delayed job is stored as scheduled at now + delay."""
    app = make_app("memory://", clock=clock)
    app.task(name="t.later")(sample_task)
    app.enqueue("t.later", 1, delay=60)
    (job,) = stored(app)
    assert job.state is JobState.SCHEDULED
    assert job.run_at == clock.now() + 60


async def test_enqueue_async_into_a_given_store(app: App) -> None:
    """enqueue_async(store=...) inserts through that store on the caller's loop."""
    store = app.open_store()
    jid = await app.enqueue_async("mail.send", "a@b", store=store)
    job = await store.job_get(job_id=jid)
    assert job.task == "mail.send"


def test_enqueue_many_stores_all_in_order(app: App) -> None:
    """enqueue_many stores one job per item, ids in order, keys matched by position."""
    ids = app.enqueue_many("mail.send", [("a@x",), ["b@x"], ("c@x",)], keys=["k1", None, "k3"])
    assert len(ids) == 3
    assert ids == sorted(ids)
    jobs = {j.id: j for j in stored(app)}
    assert [json.loads(jobs[i].args)["args"] for i in ids] == [["a@x"], ["b@x"], ["c@x"]]
    assert [jobs[i].idempotency_key for i in ids] == ["k1", None, "k3"]


def test_failing_batch_stores_nothing(app: App) -> None:
    """One bad item in enqueue_many fails the whole batch before anything is stored."""
    with pytest.raises(PayloadError):
        app.enqueue_many("mail.send", [("a@x",), (object(),), ("c@x",)])
    assert stored(app) == []


@pytest.mark.parametrize("item", ["c@x", b"c@x"])
def test_a_bare_string_item_is_refused_naming_its_index(app: App, item: Any) -> None:
    """A string where a row of arguments belongs is refused, naming the item: it is as
    likely a row written without its parentheses as one argument."""
    with pytest.raises(PayloadError, match=r"items\[2\] is a bare") as info:
        app.enqueue_many("mail.send", [("a@x",), ("b@x",), item])
    assert "list or tuple" in str(info.value)
    assert stored(app) == []


def test_a_string_of_items_is_refused(app: App) -> None:
    """A string is no batch: it would enqueue one job per character."""
    with pytest.raises(PayloadError, match="items must be"):
        app.enqueue_many("mail.send", "abc")
    assert stored(app) == []


def test_batch_with_bad_key_stores_nothing(app: App) -> None:
    """An invalid key for one item of a batch stores none of the batch."""
    with pytest.raises(InvalidInputError):
        app.enqueue_many("mail.send", [("a@x",), ("b@x",)], keys=["ok", ""])
    assert stored(app) == []


def test_batch_with_wrong_number_of_keys_is_refused(app: App) -> None:
    """A keys list whose length differs from the items raises InvalidInputError."""
    with pytest.raises(InvalidInputError, match="2 keys given for 3 jobs"):
        app.enqueue_many("mail.send", [("a",), ("b",), ("c",)], keys=["k1", "k2"])
    assert stored(app) == []


def test_close_closes_the_facade_event_loop() -> None:
    """close() (twice, after using the facade) ends the portal thread and closes its loop."""
    app = App("memory://")
    app.task(name="t.close")(sample_task)
    app.enqueue("t.close", 1)
    portals = [t for t in threading.enumerate() if t.name == "tokenline-portal"]
    assert portals, "the sync facade runs on a portal thread"
    app.close()
    app.close()
    for t in portals:
        t.join(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del app
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []


def test_task_repr_in_app_repr(app: App) -> None:
    """The app's repr shows its URL and task names, for debugging."""
    assert "memory://" in repr(app)
    assert "mail.send" in repr(app)


def test_task_is_directly_callable() -> None:
    """A Task object calls through to its handler (useful in tests)."""
    t = Task(name="t.call", fn=sample_task)
    assert t(None, 5) == 5


@pytest.mark.parametrize("url", ["sqlite", "memory://"])
def test_a_sync_enqueue_on_an_open_store_skips_the_event_loop(
    url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ordinary code, once the store is open, a store that can enqueue on the
    caller's thread does (no hop to the facade's loop and back); one that cannot goes
    through the loop. Either way the jobs are there, in order."""
    app = App(f"sqlite:///{tmp_path / 'fast.db'}" if url == "sqlite" else url)

    @app.task(name="t.fast")
    def handler(ctx: object, n: int) -> None:
        """Never runs here."""

    first = app.enqueue("t.fast", 0)  # opens the store, through the loop
    through_loop: list[object] = []
    real_run = app.run

    def counting_run(fn: Any) -> Any:
        through_loop.append(fn)
        return real_run(fn)

    monkeypatch.setattr(app, "run", counting_run)
    ids = [app.enqueue("t.fast", n) for n in (1, 2)] + app.enqueue_many("t.fast", [(3,), (4,)])
    fast = app.open_store().capabilities.blocking_enqueue
    assert len(through_loop) == (0 if fast else 3)
    assert url != "sqlite" or fast
    assert [first, *ids] == sorted({first, *ids})
    monkeypatch.undo()
    jobs = app.run(lambda s: s.jobs_list(limit=10))
    assert sorted(j.id for j in jobs) == [first, *ids]
    app.close()
    # Closed, the app opens its store again on the next enqueue.
    assert app.enqueue("t.fast", 5) > ids[-1]
    app.close()


class _OpensInPart(MemoryStore):
    """A store whose open() fails after taking resources (a pool, one side of a split
    store), and which records whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def open(self) -> None:
        await super().open()
        raise StoreUnavailableError("the second side is down")

    async def close(self) -> None:
        self.closed += 1
        await super().close()


def test_a_store_whose_open_fails_is_closed_not_leaked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync facade opens its store on first use; an open that fails part way closes
    what did open (else a pool's connections and threads outlive the failed call)."""
    app = App("memory://")
    opened: list[_OpensInPart] = []

    def failing(**_: Any) -> _OpensInPart:
        opened.append(_OpensInPart())
        return opened[-1]

    monkeypatch.setattr(app, "open_store", failing)
    with pytest.raises(StoreUnavailableError, match="second side"):
        app.run(lambda store: store.queues_stats())
    assert [s.closed for s in opened] == [1]
    app.close()
