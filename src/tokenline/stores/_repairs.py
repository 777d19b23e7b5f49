"""What the reconciler's repairs write, the same in every store."""

from __future__ import annotations

__all__ = ["ABANDONED", "ACKNOWLEDGED", "ACKNOWLEDGED_ERROR", "LOST", "LOST_ERROR"]

#: The outcome and error of an attempt the reconciler closes.
LOST = "lost"
LOST_ERROR = "closed by the reconciler: the job moved on without this attempt's outcome"
#: The outcome and error of the open attempt of a job the reconciler acknowledges.
ACKNOWLEDGED = "acknowledged"
ACKNOWLEDGED_ERROR = "acknowledged by the reconciler: its work had already committed"
#: The error of a pending effect the reconciler marks failed.
ABANDONED = "abandoned: pending past the deadline after its attempt lost its lease"
