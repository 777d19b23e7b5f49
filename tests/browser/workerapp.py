"""The app a real worker process runs in the browser tests (``--app workerapp:app``).

``billing.charge`` holds its job until the file named by ``WORKERAPP_RELEASE`` exists,
so a test sees the worker PROCESSING for as long as it needs, then lets it finish.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import tokenline

app = tokenline.App(os.environ["TOKENLINE_URL"])


@app.task(name="billing.charge")
def charge(ctx: Any, n: int) -> None:
    """Wait for the release file, checking the job is still ours between looks."""
    release = Path(os.environ["WORKERAPP_RELEASE"])
    while not release.exists():
        ctx.check()
        time.sleep(0.05)
