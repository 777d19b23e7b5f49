"""Benchmarks: bulk enqueue rate and no-op throughput with worker processes.

Figures, not assertions: run with ``make bench``; pass ``--url postgresql://…`` to
measure another store (any option of ``tokenline bench``). Each run measures only its
own jobs on a store of its own (a SQLite file in a fresh temporary directory, or a fresh
schema) and removes it afterwards unless ``--keep``. Prints the machine's core count and
load average with the figures.
"""

from __future__ import annotations

import sys

from tokenline.cli.bench import bench

if __name__ == "__main__":
    bench.main(args=sys.argv[1:] or ["--jobs", "20000", "--workers", "2"], standalone_mode=True)
