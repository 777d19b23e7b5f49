"""Tasks: a handler function with its per-task options.

A handler takes the job context first, then the job's JSON arguments::

    @app.task(queue="billing", max_attempts=8, timeout=30, depends_on=["payments-api"])
    def send_invoice(ctx, order_id: int) -> None: ...

``depends_on`` names dependencies registered with ``app.dependency``: while one's circuit
breaker is open, the task's jobs wait instead of running (see ``dependencies.py``).

Async handlers run on the worker's event loop; sync handlers run in its thread pool.
A handler is a function (or any callable); a generator function is refused when it is
registered, since calling one runs none of its body: its job would be recorded as
succeeded without having done anything.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigError, InvalidInputError
from ._jobs import (
    attempts_problem,
    check_queue_name,
    describe,
    priority_problem,
    seconds_problem,
)
from .classify import Classifier
from .dependencies import dependency_names
from .retry import RetryPolicy

__all__ = ["TASK_NAME_RE", "Task", "handler_problem"]

TASK_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")


def _code_of(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What runs when ``fn`` is called: its ``__call__`` for a callable object (whose
    own flags say nothing), else ``fn`` (``inspect`` sees through methods and partials)."""
    if inspect.isroutine(fn) or isinstance(fn, functools.partial):
        return fn
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself is wanted
    return call if call is not None else fn


def handler_problem(fn: object) -> str | None:
    """Why ``fn`` cannot be a task's handler, or ``None``: it must be callable, and not
    a generator function (sync or async), whose call would run none of its body."""
    if not callable(fn):
        hint = " (to name the task, use @app.task(name=...))" if isinstance(fn, str) else ""
        return f"must be a function taking the job context first, got {describe(fn)}{hint}"
    code = _code_of(fn)
    if inspect.isasyncgenfunction(code):
        return (
            f"{describe(fn)} is an async generator function (async def with yield): "
            "calling it runs none of its body; use async def without yield, and return "
            "the result"
        )
    if inspect.isgeneratorfunction(code):
        return (
            f"{describe(fn)} is a generator function (it yields): calling it runs none "
            "of its body; return the result instead of yielding it"
        )
    try:
        params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin, say: its signature says too little to refuse it
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    if not params or params[0].kind not in positional:
        return (
            f"{describe(fn)} takes no positional parameter for the job context: the "
            "worker calls it as fn(ctx, *args, **kwargs)"
        )
    return None


class _Shape:
    """The arguments a handler takes after ``ctx``, checked against a job's.

    The common handler, with plain parameters only, is checked by counting (a job's
    arguments are checked on every enqueue, and ``inspect.Signature.bind`` costs more
    than encoding them); any other, with ``*args``, ``**kwargs``, keyword-only or
    positional-only parameters, by binding.
    """

    __slots__ = ("_names", "_required", "_signature", "_text")

    def __init__(self, signature: inspect.Signature, plain: bool) -> None:
        params = list(signature.parameters.values())[1:]
        self._signature = None if plain else signature
        self._names = tuple(p.name for p in params)
        self._required = sum(1 for p in params if p.default is inspect.Parameter.empty)
        rest = str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))
        self._text = f"(ctx, {rest[1:]}" if params else "(ctx)"

    def problem(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """Why ``ctx, *args, **kwargs`` does not fit, or ``None``."""
        if (
            not kwargs
            and self._signature is None
            and self._required <= len(args) <= len(self._names)
        ):
            return None  # the common case, at the cost of a comparison
        why = self._counted(args, kwargs) if self._signature is None else self._bound(args, kwargs)
        return None if why is None else f"do not fit its handler {self._text}: {why}"

    def _bound(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        assert self._signature is not None
        try:
            self._signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            return str(exc)
        return None

    def _counted(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        names, given = self._names, len(args)
        if given > len(names):
            return f"{given} positional arguments given, at most {len(names)} taken"
        for name in kwargs:
            if name not in names:
                return f"unexpected keyword argument {name!r}"
            if names.index(name) < given:
                return f"{name!r} given both by position and by keyword"
        missing = [n for n in names[given : self._required] if n not in kwargs]
        if missing:
            return f"missing required argument{'s' if len(missing) > 1 else ''} " + ", ".join(
                repr(n) for n in missing
            )
        return None


def _shape_of(fn: Callable[..., Any]) -> _Shape | None:
    """``fn``'s :class:`_Shape`, or ``None`` when its signature cannot be read (a
    builtin, say) or takes no ``ctx``: such a handler is not checked."""
    try:
        # The function that is called, not the one a functools.wraps decorator names:
        # a wrapper that supplies or drops arguments takes what it takes.
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return None  # no ctx of its own (``*args`` only, say): left to the worker
    plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[1:])
    return _Shape(signature, plain)


@dataclass(frozen=True, slots=True)
class Task:
    """A registered handler and its options."""

    name: str
    fn: Callable[..., Any]
    queue: str = "default"
    max_attempts: int | None = None
    #: Times the job's worker may lose its lease before the job goes dead; ``None``:
    #: the app's setting.
    max_lease_expiries: int | None = None
    timeout: float | None = None
    priority: int = 0
    retry: RetryPolicy | None = None
    classifier: Classifier | None = None
    #: Dependencies whose open circuit breaker defers the task's jobs (checked for
    #: existence when a worker starts).
    depends_on: tuple[str, ...] = ()
    #: What the handler accepts after ``ctx`` (see :func:`_shape_of`), read once.
    _shape: _Shape | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # fullmatch: ``$`` alone would let a name end in a newline.
        if not isinstance(self.name, str) or not TASK_NAME_RE.fullmatch(self.name):
            raise InvalidInputError(
                f"invalid task name {describe(self.name)}: start with a letter or _, then "
                "up to 199 of A-Z a-z 0-9 _ . : -"
            )
        if (problem := handler_problem(self.fn)) is not None:
            raise ConfigError("handler", problem)
        check_queue_name(self.queue)
        for setting in ("max_attempts", "max_lease_expiries"):
            value = getattr(self, setting)
            if value is not None and (problem := attempts_problem(value)) is not None:
                raise ConfigError(setting, problem)
        if (
            self.timeout is not None
            and (problem := seconds_problem(self.timeout, zero=False)) is not None
        ):
            raise ConfigError("timeout", problem)
        if (problem := priority_problem(self.priority)) is not None:
            raise ConfigError("priority", problem)
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ConfigError(
                "retry",
                f"must be a RetryPolicy (tokenline.retry.RetryPolicy(base=..., cap=...)) "
                f"or None, got {describe(self.retry)}",
            )
        if self.classifier is not None and not callable(self.classifier):
            raise ConfigError(
                "classifier",
                "must be a function of the exception returning an ErrorClass, a Decision "
                f"or None; got {describe(self.classifier)}",
            )
        object.__setattr__(self, "depends_on", dependency_names(self.depends_on))
        object.__setattr__(self, "_shape", _shape_of(self.fn))

    def args_problem(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """Why the handler cannot be called with ``ctx, *args, **kwargs``, or ``None``
        (also when its signature cannot be read): a job that could never run is
        refused when it is enqueued, not dead-lettered by the worker."""
        shape = self._shape
        return None if shape is None else shape.problem(args, kwargs)

    @property
    def is_async(self) -> bool:
        """Whether the handler is a coroutine function (runs on the event loop); for a
        callable object, whether its ``__call__`` is one."""
        return inspect.iscoroutinefunction(_code_of(self.fn))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler directly (useful in tests): ``task(ctx, *args)``."""
        return self.fn(*args, **kwargs)
