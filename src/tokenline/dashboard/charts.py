"""Depth and throughput over time: samples kept in memory, drawn as inline SVG.

The dashboard process samples the store whenever the overview is read (by a browser
or its auto-refresh), at most once per ``min_interval``; nothing is stored, so a
restarted dashboard starts with empty charts. Drawing is pure: a list of points in,
an SVG string out (escaped by the template engine's ``Markup`` only where it is safe:
every value in it is a number or a fixed word).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Sample", "Samples", "svg_chart"]


@dataclass(frozen=True, slots=True)
class Sample:
    """Totals over every queue at one moment of the store's clock."""

    at: float
    queued: int
    running: int
    #: Jobs finished so far (succeeded and dead): its growth is the throughput.
    finished: int
    #: The same, per queue.
    finished_by_queue: Mapping[str, int] = field(default_factory=dict)


class Samples:
    """A ring buffer of :class:`Sample`, safe to share between request threads."""

    def __init__(self, *, size: int = 360, min_interval: float = 1.0) -> None:
        self._items: deque[Sample] = deque(maxlen=size)
        self._min_interval = min_interval
        self._lock = threading.Lock()

    def add(self, sample: Sample) -> None:
        """Keep ``sample`` unless the last one is younger than the minimum interval (or
        from the future: the store's clock is the only one used, but stores change)."""
        with self._lock:
            if self._items and 0 <= sample.at - self._items[-1].at < self._min_interval:
                return
            if self._items and sample.at < self._items[-1].at:
                self._items.clear()
            self._items.append(sample)

    def items(self) -> list[Sample]:
        """The samples kept, oldest first."""
        with self._lock:
            return list(self._items)

    def depth(self) -> list[tuple[float, float]]:
        """(time, jobs queued) per sample."""
        return [(s.at, float(s.queued)) for s in self.items()]

    def throughput(self) -> list[tuple[float, float]]:
        """(time, jobs finished per second since the previous sample)."""
        items = self.items()
        out = []
        for a, b in itertools.pairwise(items):
            dt = b.at - a.at
            if dt > 0:
                out.append((b.at, max(b.finished - a.finished, 0) / dt))
        return out

    def rate(self, queue: str | None = None) -> float | None:
        """Jobs finished per second over the samples kept, in ``queue`` or in all
        (``None``: fewer than two samples, or none with the queue in both ends)."""
        items = self.items()
        if len(items) < 2 or items[-1].at <= items[0].at:
            return None
        first, last = items[0], items[-1]
        if queue is None:
            done = last.finished - first.finished
        elif queue in first.finished_by_queue and queue in last.finished_by_queue:
            done = last.finished_by_queue[queue] - first.finished_by_queue[queue]
        else:
            return None
        return max(done, 0) / (last.at - first.at)


def svg_chart(
    points: Sequence[tuple[float, float]],
    *,
    label: str,
    width: int = 320,
    height: int = 80,
) -> str:
    """A line chart of ``points`` (x: seconds, y: value) as an ``<svg>`` element, with
    its latest and highest values written in; a chart with fewer than two points says
    it is waiting for samples. ``label`` must be plain text (it is escaped here)."""
    from html import escape

    title = escape(label)
    head = (
        f'<svg class="chart" role="img" aria-label="{title}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{title}</title>"
    )
    if len(points) < 2:
        return (
            f'{head}<text x="8" y="{height // 2}" class="chart-note">'
            "collecting samples…</text></svg>"
        )
    x0, x1 = points[0][0], points[-1][0]
    top = max(max(y for _, y in points), 1e-9)
    pad = 4
    span_x = (x1 - x0) or 1.0

    def xy(x: float, y: float) -> str:
        px = pad + (x - x0) / span_x * (width - 2 * pad)
        py = height - pad - (y / top) * (height - 2 * pad - 12)
        return f"{px:.1f},{py:.1f}"

    line = " ".join(xy(x, y) for x, y in points)
    latest = points[-1][1]
    return (
        f'{head}<polyline class="chart-line" fill="none" points="{line}"/>'
        f'<text x="{pad}" y="11" class="chart-note">now {latest:.3g} · max {top:.3g} · '
        f"{x1 - x0:.0f}s</text></svg>"
    )
