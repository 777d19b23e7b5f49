"""SIGTERM to a command that runs worker processes of its own (demo, bench, drill):
the command stops them all, as on Ctrl-C, instead of dying alone.

Before, SIGTERM (what a supervisor, a CI timeout or ``timeout`` sends) ended the
command and left its workers running for ever, re-parented, one of them stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEADLINE = 60.0


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "command",
    [["demo", "--jobs", "2000"], ["bench", "--jobs", "200000"], ["drill", "--jobs", "300"]],
    ids=["demo", "bench", "drill"],
)
def test_sigterm_stops_every_worker_the_command_started(tmp_path: Path, command: list[str]) -> None:
    """Once the command has workers running, SIGTERM ends it and every one of them."""
    url = f"sqlite:///{tmp_path / 'scratch.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLINE_")}
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenline", *command, "--url", url],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + DEADLINE
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            workers |= _children(proc.pid)
        assert len(workers) >= 2, log.read_text(errors="replace")
        time.sleep(0.5)
        workers |= _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(DEADLINE)
        end = time.monotonic() + DEADLINE
        while any(_alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGCONT)
                os.kill(w, signal.SIGKILL)
