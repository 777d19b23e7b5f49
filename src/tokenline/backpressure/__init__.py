"""Backpressure: a worker that takes on less when its surroundings cannot keep up.

Three pure pieces, each fed by job outcomes and told the time (nothing here sleeps,
reads a clock of its own or touches a store), so each is tested with a fake clock:

=========================  =====================================================
:class:`AIMDLimiter`,      how many jobs to run at once: the limit falls on
:class:`GradientLimiter`   timeouts, transient and store errors (AIMD) or rising
                           latency (gradient), and grows back; never below a
                           floor nor above the configured concurrency.
                           Permanent errors are the job's fault and never
                           shrink it (:class:`FailureKind`).
:class:`RetryBudget`       retries per queue at most a share of first attempts
                           over a sliding window; a refused retry is delayed,
                           not run at once, so failures cannot multiply load.
:class:`ErrorRateWindow`   the share of recent jobs that failed; past a
                           threshold (with enough samples) the worker pauses
                           consumption.
:class:`CircuitBreaker`    per named dependency: closed, open or half-open from
                           the outcomes of recent calls to it; while open, jobs
                           that need it wait (see :mod:`tokenline.dependencies`,
                           which shares each breaker through the store).
=========================  =====================================================

A worker owns one limiter and one error window, and one retry budget for all its
queues. The integration points, in order of a job's life:

* fetch: ``limiter.claim_batch(free, in_flight=n)`` jobs, none while
  ``errors.exceeded(now)``;
* first attempt starts: ``budget.deposit(queue, now)``;
* success: ``limiter.on_success(latency, in_flight=n)``, ``errors.record(True, now)``;
* failure: ``limiter.on_failure(kind, started=t0)``,
  ``errors.record(not kind.is_overload, now)``, and for a retry
  ``budget.try_spend(queue, now)``: when refused, re-queue it with a longer delay.

Every parameter is validated when the object is built; a bad one raises
:class:`~tokenline.ConfigError` naming it.
"""

from __future__ import annotations

from .breaker import BreakerState, CallOutcome, CircuitBreaker, Permit
from .errors_window import ErrorRateWindow
from .limiter import (
    OVERLOAD_KINDS,
    AIMDLimiter,
    ConcurrencyLimiter,
    FailureKind,
    FixedLimiter,
    GradientLimiter,
    make_limiter,
)
from .retry_budget import RetryBudget

__all__ = [
    "OVERLOAD_KINDS",
    "AIMDLimiter",
    "BreakerState",
    "CallOutcome",
    "CircuitBreaker",
    "ConcurrencyLimiter",
    "ErrorRateWindow",
    "FailureKind",
    "FixedLimiter",
    "GradientLimiter",
    "Permit",
    "RetryBudget",
    "make_limiter",
]
