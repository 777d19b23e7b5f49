"""Backpressure: a worker that takes on less when its surroundings cannot keep up.

Pure pieces, each fed by job outcomes and told the time (nothing here sleeps, reads a
clock of its own or touches a store), so each is tested with a fake clock:

=========================  =====================================================
:class:`RetryBudget`       retries per queue at most a share of first attempts
                           over a sliding window; a refused retry is delayed,
                           not run at once, so failures cannot multiply load.
:class:`ErrorRateWindow`   the share of recent jobs that failed; past a
                           threshold (with enough samples) the worker pauses
                           consumption.
=========================  =====================================================

Every parameter is validated when the object is built; a bad one raises
:class:`~tokenline.ConfigError` naming it.
"""

from __future__ import annotations

from .errors_window import ErrorRateWindow
from .retry_budget import RetryBudget

__all__ = ["ErrorRateWindow", "RetryBudget"]
