"""What the reconciler's repairs write, the same in every store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Inconsistency

__all__ = [
    "ABANDONED",
    "ACKNOWLEDGED",
    "ACKNOWLEDGED_ERROR",
    "LOST",
    "LOST_ERROR",
    "RERUN",
    "repair_params",
    "reruns",
]

#: The outcome and error of an attempt the reconciler closes.
LOST = "lost"
LOST_ERROR = "closed by the reconciler: the job moved on without this attempt's outcome"
#: The outcome and error of the open attempt of a job the reconciler acknowledges.
ACKNOWLEDGED = "acknowledged"
ACKNOWLEDGED_ERROR = "acknowledged by the reconciler: its work had already committed"
#: The error of a pending effect the reconciler marks failed.
ABANDONED = "abandoned: pending past the deadline after its attempt lost its lease"
#: The operation of the duplicate recorded when an effect's callee starts again under a
#: key whose earlier run has no known outcome: its attempt lost its lease while the
#: callee ran (or the reconciler gave the key up, ABANDONED). That run may have had its
#: effect: the effect may have happened twice. Recorded as a repeat, in the audit.
RERUN = "effect_rerun"


def reruns(prior_status: str | None, prior_error: str | None) -> bool:
    """Whether taking a key whose row was ``prior_status`` (``None``: no row) with
    ``prior_error`` starts its callee again after a run of unknown outcome (see
    :data:`RERUN`); a run that failed on its own said how it ended."""
    return prior_status == "pending" or (prior_status == "failed" and prior_error == ABANDONED)


def repair_params(item: Inconsistency, now: float | None) -> dict[str, Any]:
    """The named parameters of one repair statement: what the reconciler saw of
    ``item`` (the repair applies only if it is still so), and the store's ``now``."""
    return {
        "job_id": item.job_id,
        "token": item.token,
        "key": item.key,
        "owner": item.owner,
        "state": item.state,
        "now": now,
    }
