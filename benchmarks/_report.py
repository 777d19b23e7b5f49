"""What the PostgreSQL benchmarks share: the server they default to, and how they print
their rounds, medians and the machine they ran on."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence

#: The server a benchmark runs on unless ``--url`` names another.
POSTGRES_URL = os.environ.get(
    "TOKENLINE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def load() -> str:
    """The load average (1, 5, 15 minutes), as printed."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_medians(rounds: Mapping[str, Sequence[float]], shown: Callable[[float], str]) -> None:
    """One line per measurement: its median, then every round, each ``shown``."""
    for name, got in rounds.items():
        each = ", ".join(shown(r) for r in got)
        print(f"{name}: {shown(statistics.median(got))} (median; rounds {each})")


def print_machine(load_before: str) -> None:
    """The core count and the load average before and after the rounds."""
    print(f"{os.cpu_count()} cores, load {load_before} before, {load()} after")
