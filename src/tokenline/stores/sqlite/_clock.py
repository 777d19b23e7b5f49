"""The SQLite store's clock: one clock for every process on the machine, immune to steps
of the wall clock.

SQLite has no server whose clock every worker could read. The processes that share a
file share a machine, and the kernel's boot-time counter (``CLOCK_BOOTTIME``) is
system-wide, never steps and keeps counting through a suspend. The store's time is::

    now = anchor_wall + (uptime() - anchor_uptime)

The anchor — the wall clock and the counter, read together once — is written to the
coordination file by the first process that opens the store after a boot, with the
boot id. Every process of that boot reads the same anchor and so computes the same
``now``, whatever its own wall clock says; a later step of the wall clock (an NTP
correction, an operator's ``date -s``, a VM resumed from a snapshot) moves nothing.
The counter is read from ``/proc/uptime``, not through libc, so that a process whose
``time()`` is faked or shifted (``faketime``, a wrong time namespace) reads what
every other process reads.

A lease written in an earlier boot means nothing in this one: the first opener after
a reboot expires every lease, then writes the new anchor (see ``store.py``).

What a wrong wall clock can still do: if it is wrong at the moment the anchor is
written (a machine that opens the store before NTP has set its time), the store's
clock carries that error for the rest of the boot. Leases are unaffected — they are
durations on the counter — but absolute ``run_at`` times given by users and displayed
timestamps are off by it; every worker reports its skew against the store's clock
(``tokenline workers``), which shows it. On a platform without ``/proc/uptime`` and a
boot id, the store's clock is the wall clock, and a step of it moves lease expiry.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["Anchor", "MachineClock", "Uptime", "WallClock", "boot_id"]

_UPTIME = "/proc/uptime"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This boot's id (Linux), or ``None`` where the platform has none."""
    try:
        with open(_BOOT_ID, encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


class Uptime:
    """Seconds since boot, suspend included, read from the kernel (``/proc/uptime``)."""

    def __init__(self) -> None:
        self._fd: int | None = os.open(_UPTIME, os.O_RDONLY)

    def __call__(self) -> float:
        fd = self._fd
        if fd is None:
            raise RuntimeError("the uptime reader is closed")
        return float(os.pread(fd, 64, 0).split()[0])

    def close(self) -> None:
        """Release the file descriptor."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @staticmethod
    def available() -> bool:
        """Whether this platform has the kernel's counter and a boot id."""
        return os.path.exists(_UPTIME) and boot_id() is not None


@dataclass(frozen=True, slots=True)
class Anchor:
    """The wall clock and the boot-time counter, read together, for one boot."""

    boot_id: str
    wall: float
    uptime: float


class MachineClock:
    """The store's clock for one boot: ``anchor.wall + (uptime() - anchor.uptime)``.

    ``offset`` (seconds, default 0) shifts it, for tests that need the store's clock
    to move apart from the machine's.
    """

    def __init__(self, anchor: Anchor, uptime: Uptime) -> None:
        self.anchor = anchor
        self._uptime = uptime
        self.offset = 0.0

    def now(self) -> float:
        """The store's time, as epoch seconds."""
        return self.anchor.wall + (self._uptime() - self.anchor.uptime) + self.offset

    def monotonic(self) -> float:
        """The boot-time counter (never used for leases: ``now`` is)."""
        return self._uptime()


class WallClock:
    """The fallback store clock where the kernel's counter is unavailable."""

    offset = 0.0

    def now(self) -> float:
        """The wall clock, as epoch seconds."""
        return time.time() + self.offset

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()
