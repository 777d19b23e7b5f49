"""Tasks: a handler function with its per-task options.

A handler takes the job context first, then the job's JSON arguments::

    @app.task(queue="billing", max_attempts=8, timeout=30, depends_on=["payments-api"])
    def send_invoice(ctx, order_id: int) -> None: ...

``depends_on`` names dependencies registered with ``app.dependency``: while one's circuit
breaker is open, the task's jobs wait instead of running (see ``dependencies.py``).

Async handlers run on the worker's event loop; sync handlers run in its thread pool.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
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

__all__ = ["TASK_NAME_RE", "Task"]

TASK_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")


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

    def __post_init__(self) -> None:
        # fullmatch: ``$`` alone would let a name end in a newline.
        if not isinstance(self.name, str) or not TASK_NAME_RE.fullmatch(self.name):
            raise InvalidInputError(
                f"invalid task name {describe(self.name)}: start with a letter or _, then "
                "up to 199 of A-Z a-z 0-9 _ . : -"
            )
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
        object.__setattr__(self, "depends_on", dependency_names(self.depends_on))

    @property
    def is_async(self) -> bool:
        """Whether the handler is a coroutine function (runs on the event loop)."""
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler directly (useful in tests): ``task(ctx, *args)``."""
        return self.fn(*args, **kwargs)
