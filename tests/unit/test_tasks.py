"""Task registration: a handler or option that could not work is refused when the task
is registered, naming it, before any worker runs it."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tokenline import App, ConfigError, Task
from tokenline.classify import ErrorClass
from tokenline.retry import RetryPolicy


def handler(ctx: Any) -> None:
    """A plain handler."""


def gen_handler(ctx: Any) -> Iterator[int]:
    """A generator function: calling it runs none of its body."""
    yield 1


async def agen_handler(ctx: Any) -> AsyncIterator[int]:
    """An async generator function: likewise."""
    yield 1


class GeneratorCallable:
    """A callable object whose ``__call__`` yields."""

    def __call__(self, ctx: Any) -> Iterator[int]:
        yield 1


class AsyncCallable:
    """A callable object whose ``__call__`` is a coroutine function."""

    async def __call__(self, ctx: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (gen_handler, "is a generator function"),
        (agen_handler, "is an async generator function"),
        (functools.partial(gen_handler), "is a generator function"),
        (GeneratorCallable(), "is a generator function"),
        ("fast", "use @app.task\\(name=...\\)"),
        (42, "must be a function"),
    ],
)
def test_a_handler_that_cannot_run_is_refused(fn: Any, why: str) -> None:
    """A generator (its call runs none of its body: the job would succeed having done
    nothing) or something not callable is a ConfigError naming the handler."""
    app = App("memory://")
    with pytest.raises(ConfigError, match=why) as info:
        app.task(name="t.h")(fn)
    assert info.value.setting == "handler"
    assert app.tasks == {}
    with pytest.raises(ConfigError):
        Task(name="t.h", fn=fn)


def test_a_name_passed_as_the_handler_is_explained() -> None:
    """``@app.task("name")`` passes the name as the handler: the error says so."""
    app = App("memory://")
    with pytest.raises(ConfigError, match="name=") as info:
        app.task("t.name")  # type: ignore[call-overload]
    assert info.value.setting == "handler"


def test_a_generator_is_refused_by_periodic_too() -> None:
    """``@app.periodic`` registers its task the same way."""
    app = App("memory://")
    with pytest.raises(ConfigError, match="generator"):
        app.periodic(cron="* * * * *", name="gen")(gen_handler)
    assert app.tasks == {}
    assert app.periodics == {}


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("retry", "fast"),
        ("retry", 3),
        ("retry", {"base": 1.0}),
        ("classifier", "transient"),
        ("classifier", ErrorClass.TRANSIENT),
        ("timeout", float("nan")),
        ("timeout", float("inf")),
        ("timeout", "30"),
        ("priority", 1.5),
        ("priority", True),
        ("max_lease_expiries", 0),
        ("max_attempts", 2.0),
    ],
)
def test_a_bad_task_option_is_refused_by_name(option: str, value: Any) -> None:
    """Each option is checked for its type and range when the task is registered."""
    app = App("memory://")
    with pytest.raises(ConfigError) as info:
        app.task(name="t.opt", **{option: value})(handler)
    assert info.value.setting == option
    assert app.tasks == {}


def test_good_options_and_callables_are_accepted() -> None:
    """A policy, a classifier function, a callable object and a partial all register;
    an object with an async ``__call__`` runs on the event loop."""
    app = App("memory://")
    app.task(name="t.ok", retry=RetryPolicy(1.0, 2.0), classifier=lambda exc: None)(handler)
    app.task(name="t.partial")(functools.partial(handler))
    app.task(name="t.obj")(AsyncCallable())
    assert app.get_task("t.obj").is_async
    assert not app.get_task("t.partial").is_async


def test_an_unnamed_callable_object_gets_its_class_name() -> None:
    """Without a name, a callable object is named after its class, not refused."""
    app = App("memory://")
    app.task(AsyncCallable())
    assert [name.rsplit(".", 1)[-1] for name in app.tasks] == ["AsyncCallable"]


def test_an_app_classifier_must_be_callable() -> None:
    """``App(classifier=...)`` is checked like a task's."""
    with pytest.raises(ConfigError) as info:
        App("memory://", classifier="transient")  # type: ignore[arg-type]
    assert info.value.setting == "classifier"
