"""Tasks: a handler function with its per-task options.

A handler takes the job context first, then the job's JSON arguments::

    @app.task(queue="billing", max_attempts=8, timeout=30)
    def send_invoice(ctx, order_id: int) -> None: ...

Async handlers run on the worker's event loop; sync handlers run in its thread pool.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._config import validate_queue_name
from ._errors import ConfigError, InvalidInputError
from .classify import Classifier
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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TASK_NAME_RE.match(self.name):
            raise InvalidInputError(
                f"invalid task name {self.name!r}: start with a letter or _, then up to "
                "199 of A-Z a-z 0-9 _ . : -"
            )
        validate_queue_name(self.queue)
        if self.max_attempts is not None and (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ConfigError("max_attempts", f"must be >= 1, got {self.max_attempts!r}")
        if self.max_lease_expiries is not None and (
            isinstance(self.max_lease_expiries, bool)
            or not isinstance(self.max_lease_expiries, int)
            or self.max_lease_expiries < 1
        ):
            raise ConfigError(
                "max_lease_expiries", f"must be >= 1, got {self.max_lease_expiries!r}"
            )
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not 0 < self.timeout < float("inf")
        ):
            raise ConfigError(
                "timeout", f"must be a finite number of seconds > 0, got {self.timeout!r}"
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError("priority", f"must be an integer, got {self.priority!r}")

    @property
    def is_async(self) -> bool:
        """Whether the handler is a coroutine function (runs on the event loop)."""
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the handler directly (useful in tests): ``task(ctx, *args)``."""
        return self.fn(*args, **kwargs)
