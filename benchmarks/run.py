"""Benchmarks: bulk enqueue rate and no-op throughput with worker processes.

Figures, not assertions: run with ``make bench``; pass ``--url postgresql://…`` to
measure another store. Prints the machine's core count with the figures.
"""

from __future__ import annotations

import sys

from tokenline.cli.bench import bench

if __name__ == "__main__":
    bench.main(args=sys.argv[1:] or ["--jobs", "20000", "--workers", "2"], standalone_mode=True)
