"""How soon a killed worker's job runs again, with a backlog behind it.

The scenario: 20 jobs of 2 s each, 2 worker processes running one job at a time, lease
TTL 5 s, rescue every 1 s. Once both workers are busy, one is killed with SIGKILL; the
figure is the time from the kill until its job starts again (on the other worker, once
that one's current job is done: the rescued job keeps its place, ahead of the 16 or so
jobs queued after it). The bound to compare with: lease TTL + rescue interval + the
job the surviving worker is running (2 s) + 1 s.

Each job appends one line (job id, process id, start time) to a file, which is how the
starts are seen; every job must run, the killed one twice. A fresh store per round (a
SQLite file in a temporary directory, or a fresh schema on ``--url``), removed after.

    python benchmarks/rescue_bench.py [--url postgresql://…] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenline import App
from tokenline.drill._scratch import scratch_for

QUEUE = "rescue"
STARTS_ENV = "TOKENLINE_RESCUE_STARTS"
JOBS = 20
JOB_SECONDS = 2.0
LEASE_TTL = 5.0
RENEW = 1.6
RESCUE = 1.0


def rescue_app(url: str | None = None) -> App:
    """The app with the scenario's task: note the start, then sleep."""
    app = App(url)

    @app.task(name="rescue.sleep", queue=QUEUE, max_attempts=3)
    def sleep(ctx: Any, i: int) -> None:
        """Append this start to the starts file, then work for JOB_SECONDS."""
        with open(os.environ[STARTS_ENV], "a", encoding="utf-8") as f:
            f.write(f"{ctx.job_id} {os.getpid()} {time.time():.6f}\n")
        time.sleep(JOB_SECONDS)

    return app


#: The workers' app: the runner hands them the scratch store in TOKENLINE_URL.
app = rescue_app() if os.environ.get("TOKENLINE_URL") else None


def _starts(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return out


def _wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


def one_round(url: str | None) -> dict[str, Any]:
    """Run the scenario once on a fresh store; return its figures."""
    scratch = scratch_for(url, keep=False, prefix="tokenline_rescue")
    tmp = Path(tempfile.mkdtemp(prefix="tokenline_rescue_"))
    starts = tmp / "starts.txt"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        scratch.prepare({})
        a = rescue_app(scratch.url)
        a.run(lambda s: s.queue_pause(queue=QUEUE))  # both workers start before any job
        for i in range(JOBS):
            a.enqueue("rescue.sleep", i, queue=QUEUE)
        env = {
            **os.environ,
            "TOKENLINE_URL": scratch.url,
            STARTS_ENV: str(starts),
            # Ahead of the caller's own path, not instead of it: a run against another
            # checkout (PYTHONPATH=…/src) must have its workers run that code too.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p
            ),
        }
        cmd = [
            sys.executable, "-m", "tokenline", "worker", "--app", "rescue_bench:app",
            "--queues", QUEUE, "--concurrency", "1", "--lease-ttl", str(LEASE_TTL),
            "--renew-interval", str(RENEW), "--rescue-interval", str(RESCUE),
            "--poll-interval", "0.1", "--log-level", "warning",
        ]  # fmt: skip
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL) for _ in range(2)]
        _wait(
            "both workers to register",
            lambda: sum(w.state == "ready" for w in a.run(lambda s: s.workers_list())) >= 2,
            60,
        )
        a.run(lambda s: s.queue_resume(queue=QUEUE))
        by_pid = {p.pid: p for p in procs}
        # Both busy: strike the one that started its job last (mid-job, like the others).
        seen = _wait("both workers to start a job", lambda: _both_busy(starts, by_pid), 30)
        victim_job, victim_pid, _ = seen
        by_pid[victim_pid].send_signal(signal.SIGKILL)
        killed_at = time.time()
        by_pid[victim_pid].wait(timeout=10)

        def again() -> float | None:
            later = [t for j, _, t in _starts(starts) if j == victim_job and t > killed_at]
            return later[0] if later else None

        ran_again = _wait(f"job {victim_job} to run again", again, 120)
        # The rest must all run: nothing is lost while one worker carries the queue.
        _wait(
            "every job to start",
            lambda: len({j for j, _, _ in _starts(starts)}) >= JOBS,
            JOBS * JOB_SECONDS + 60,
        )
        queued_behind = sum(1 for j, _, t in _starts(starts) if t > ran_again)
        a.close()
        return {
            "store": "postgres" if scratch.url.startswith("postgres") else "sqlite",
            "rescued_after_s": round(ran_again - killed_at, 2),
            "jobs_started_after_it": queued_behind,
            "bound_s": LEASE_TTL + RESCUE + JOB_SECONDS + 1,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGTERM)  # the second stops at once
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        scratch.cleanup()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def _both_busy(
    starts: Path, procs: dict[int, subprocess.Popen[bytes]]
) -> tuple[int, int, float] | None:
    """The last start, once both worker processes have started a job."""
    rows = [r for r in _starts(starts) if r[1] in procs]
    if len({pid for _, pid, _ in rows}) < 2:
        return None
    return rows[-1]


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds, print each round and the median."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a postgresql:// server (default: SQLite)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = []
    for _ in range(args.rounds):
        r = one_round(args.url)
        print(json.dumps(r), flush=True)
        results.append(r)
    print(
        f"{results[0]['store']}: a killed worker's job ran again after "
        f"{statistics.median(r['rescued_after_s'] for r in results):.2f}s (median of "
        f"{len(results)}; bound {results[0]['bound_s']:g}s = TTL {LEASE_TTL:g} + rescue "
        f"{RESCUE:g} + the running job {JOB_SECONDS:g} + 1), with jobs queued behind it; "
        f"{os.cpu_count()} cores, load {load_before} before, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
    )


if __name__ == "__main__":
    main()
