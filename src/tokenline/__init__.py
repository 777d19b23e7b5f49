"""tokenline: a job queue whose workers stay safe when coordination fails partially.

Leases with monotonic fencing tokens checked by the store on every commit, a worker
state machine, error classification and exactly-once business effects::

    import tokenline

    app = tokenline.App()  # sqlite:///tokenline.db, or TOKENLINE_URL

    @app.task(queue="billing", max_attempts=8)
    def send_invoice(ctx: tokenline.JobContext, order_id: int) -> None:
        with ctx.transaction() as conn:  # token checked first; commits with the job
            conn.execute("INSERT INTO invoices (order_id) VALUES (?)", (order_id,))

    app.enqueue(send_invoice, 42, idempotency_key="invoice:42")
"""

from __future__ import annotations

from ._app import App
from ._clock import Clock, FakeClock, SystemClock
from ._config import DEFAULT_URL, Settings, WorkerSettings, load_settings
from ._errors import (
    ConfigError,
    DependencyOpenError,
    EffectPendingError,
    FencedError,
    InvalidInputError,
    JobCancelled,
    JobNotFoundError,
    LeaseBusyError,
    LeaseExpiredError,
    NotSupportedError,
    OutcomeUnknownError,
    PayloadError,
    Permanent,
    QueueNameError,
    Retry,
    SchemaVersionError,
    StaleTokenError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
    TokenlineError,
    UnknownTaskError,
)
from ._jobs import (
    MAX_ATTEMPTS,
    MAX_DELAY,
    MAX_INT_DIGITS,
    MAX_PAYLOAD_DEPTH,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Attempt,
    Job,
    JobState,
    Lease,
    QueueStats,
)
from ._records import MAX_KEY_LENGTH
from ._tasks import Task
from .classify import Decision, ErrorClass, classify
from .dependencies import Dependency
from .effects import EffectCall, current_effect, require_fenced
from .retry import RetryPolicy
from .worker import JobContext, Worker, WorkerState, run_worker

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_URL",
    "MAX_ATTEMPTS",
    "MAX_DELAY",
    "MAX_INT_DIGITS",
    "MAX_KEY_LENGTH",
    "MAX_PAYLOAD_DEPTH",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "App",
    "Attempt",
    "Clock",
    "ConfigError",
    "Decision",
    "Dependency",
    "DependencyOpenError",
    "EffectCall",
    "EffectPendingError",
    "ErrorClass",
    "FakeClock",
    "FencedError",
    "InvalidInputError",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobNotFoundError",
    "JobState",
    "Lease",
    "LeaseBusyError",
    "LeaseExpiredError",
    "NotSupportedError",
    "OutcomeUnknownError",
    "PayloadError",
    "Permanent",
    "QueueNameError",
    "QueueStats",
    "Retry",
    "RetryPolicy",
    "SchemaVersionError",
    "Settings",
    "StaleTokenError",
    "StoreCorruptError",
    "StoreError",
    "StoreUnavailableError",
    "SystemClock",
    "Task",
    "TokenlineError",
    "UnknownTaskError",
    "Worker",
    "WorkerSettings",
    "WorkerState",
    "__version__",
    "classify",
    "current_effect",
    "load_settings",
    "require_fenced",
    "run_worker",
]
