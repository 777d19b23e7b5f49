"""An app whose stores pass through the drill's FaultStore, for `tokenline status` tests.

``STATUSFAULTAPP_URL`` names the store; ``STATUSFAULTAPP_FAULT_FILE`` the fault file
the test writes with ``write_fault_file`` (re-read while the process runs; no file: no
faults). Only this test module wraps a store in faults: nothing in tokenline's own code
can be switched to do it.
"""

from __future__ import annotations

import os

import tokenline
from tokenline.drill.faultstore import FaultStore
from tokenline.stores import Store

URL_ENV = "STATUSFAULTAPP_URL"
FAULT_FILE_ENV = "STATUSFAULTAPP_FAULT_FILE"


class StatusFaultApp(tokenline.App):
    """Opens its store wrapped in the faults of the test's fault file."""

    def open_store(self, *, timeout: float | None = None) -> Store:
        """The app's store, failing calls by role as the fault file says."""
        return FaultStore(
            super().open_store(timeout=timeout), fault_file=os.environ[FAULT_FILE_ENV]
        )


app = StatusFaultApp(os.environ[URL_ENV])
