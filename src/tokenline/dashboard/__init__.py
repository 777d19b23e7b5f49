"""``tokenline dashboard``: a small web app for operators, over the store's read API.

Pages (server-rendered, usable without JavaScript, refreshed in place with it): the
overview (verdict, channels and breakers, firing alert conditions, queues, workers by
state, depth and throughput charts), a queue, a job with its attempts and tokens, a
worker, leases, dead letters, the duplicate audit and recent drill results.

Actions (pause/resume a queue, drain a worker, retry or discard a dead job, release a
resource lease) go through a confirmation page and the checks of :mod:`.security`, and
are logged on the ``tokenline.dashboard`` logger. Needs ``tokenline[dashboard]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app

__all__ = ["INSTALL_HINT", "create_app"]

#: What to install when the dashboard's dependencies are missing.
INSTALL_HINT = "the dashboard needs its extra: pip install 'tokenline[dashboard]'"


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that `import tokenline.dashboard` names what is missing.
    if name == "create_app":
        try:
            from .app import create_app
        except ImportError as exc:
            raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
        return create_app
    raise AttributeError(name)
