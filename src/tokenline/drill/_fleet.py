"""The drill's worker processes, their fault proxies and fault files, and their end.

A :class:`Fleet` starts every proxy before any worker (so a port in use fails the run
before a process exists), starts each worker in a session of its own (a Ctrl-C at the
terminal reaches the drill, which then stops them, rather than killing workers behind
its back), and in :meth:`Fleet.close` — run from ``finally`` — resumes, terminates and
then kills every process group and stops every proxy, whatever happened before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from .._config import WorkerSettings as _Config
from .faultstore import FAULT_FILE_ENV, SEED_ENV
from .proxy import Faults, ThreadedFaultProxy
from .storefaults import StoreFaults, write_fault_file

__all__ = ["Fleet", "WorkerSettings"]

#: Marks every process of one drill run, so tests can prove none survives it.
RUN_ENV = "TOKENLINE_DRILL_RUN"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How the drill's workers run (the lease TTL is the yardstick of every report)."""

    lease_ttl: float = 2.0
    rescue_interval: float = 0.5
    #: The reconciler runs often, so a drift a fault leaves is repaired (and counted)
    #: within the run, and a false repair would show in the checker's verdict.
    reconcile_interval: float = 1.0
    concurrency: int = 4
    poll_interval: float = 0.05
    drain_timeout: float = 2.0

    @property
    def renew_interval(self) -> float:
        """The workers' renewal and election period: a quarter of the lease TTL."""
        return self.lease_ttl / 4

    @property
    def periodic_interval(self) -> float:
        """The period of the leader's periodic-job scheduler: tokenline's default, which
        the drill's workers keep."""
        return _Config().periodic_interval

    def argv(self, app: str, queue: str) -> list[str]:
        """The ``tokenline worker`` command line."""
        return [
            sys.executable, "-m", "tokenline", "worker", "--app", app, "--queues", queue,
            "--concurrency", str(self.concurrency), "--lease-ttl", str(self.lease_ttl),
            "--renew-interval", str(self.renew_interval),
            "--rescue-interval", str(self.rescue_interval),
            "--reconcile-interval", str(self.reconcile_interval),
            "--poll-interval", str(self.poll_interval),
            "--drain-timeout", str(self.drain_timeout),
        ]  # fmt: skip


class Fleet:
    """Worker processes, each with its own fault file and (networked stores) proxy."""

    def __init__(
        self,
        *,
        url: str,
        workers: int,
        settings: WorkerSettings,
        work_dir: Path,
        env: Mapping[str, str],
        upstream: tuple[str, int] | None,
        proxy_port: int = 0,
        seed: int = 0,
        run_id: str = "",
    ) -> None:
        self.url = url
        self.count = workers
        self.settings = settings
        self.work_dir = work_dir
        self.env = dict(env)
        self.upstream = upstream
        self.proxy_port = proxy_port
        self.seed = seed
        self.run_id = run_id
        self.proxies: list[ThreadedFaultProxy] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        #: The app the workers run, and each worker's environment (once spawned).
        self.app = ""
        self.envs: list[dict[str, str]] = []
        self.fault_files = [work_dir / f"faults-{i}.json" for i in range(workers)]
        self.logs = [work_dir / f"worker-{i}.log" for i in range(workers)]

    def __enter__(self) -> Self:
        try:
            self.start_proxies()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start_proxies(self) -> None:
        """One proxy per worker in front of the store (networked stores only)."""
        if self.upstream is None:
            return
        for i in range(self.count):
            port = self.proxy_port + i if self.proxy_port else 0
            proxy = ThreadedFaultProxy(self.upstream, port=port, seed=self.seed + i)
            proxy.start()  # ProxyListenError names the port in use
            self.proxies.append(proxy)

    def worker_url(self, i: int) -> str:
        """The store URL worker ``i`` uses: through its proxy when there is one."""
        if not self.proxies:
            return self.url
        from ._scratch import through

        if self.url.startswith("split:"):
            # Only Redis is behind the proxy: the ledger is reached directly.
            from ..stores import _split_parts, split_url

            broker, _, ledger = _split_parts(self.url)
            return split_url(through(broker, *self.proxies[i].address), ledger)
        return through(self.url, *self.proxies[i].address)

    def spawn(
        self, app: str, queue: str, per_worker: Mapping[int, Mapping[str, str]] | None = None
    ) -> None:
        """Start every worker process; ``per_worker`` adds environment to some."""
        argv = self.settings.argv(app, queue)
        self.app = app
        for i in range(self.count):
            env = {
                **os.environ,
                **self.env,
                **(per_worker or {}).get(i, {}),
                "TOKENLINE_URL": self.worker_url(i),
                FAULT_FILE_ENV: str(self.fault_files[i]),
                SEED_ENV: str(self.seed + i),
                RUN_ENV: self.run_id,
            }
            self.envs.append(env)
            with self.logs[i].open("wb") as log:
                self.procs.append(
                    subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
                )

    def pid(self, i: int) -> int:
        """Process id of worker ``i``."""
        return self.procs[i].pid

    def returncode(self, i: int) -> int | None:
        """Worker ``i``'s exit status, or ``None`` while it runs."""
        return self.procs[i].poll()

    def signal(self, i: int, sig: signal.Signals) -> None:
        """Send ``sig`` to worker ``i``'s process group (gone already: ignored)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.procs[i].pid, sig)

    def set_faults(
        self,
        targets: Sequence[int],
        store: StoreFaults | None,
        proxy: Faults | None,
        *,
        reset: bool = False,
    ) -> None:
        """Switch faults on for ``targets`` (``None`` leaves that kind alone)."""
        for i in targets:
            if store is not None:
                write_fault_file(self.fault_files[i], store)
            if proxy is not None and self.proxies:
                self.proxies[i].set_faults(proxy)
            if reset and self.proxies:
                self.proxies[i].reset()

    def clear_faults(self, targets: Sequence[int]) -> None:
        """Switch every fault off for ``targets``."""
        for i in targets:
            write_fault_file(self.fault_files[i], StoreFaults())
            if self.proxies:
                self.proxies[i].clear()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of every worker's log, for a report that something went wrong."""
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}"
            for log in self.logs
            if log.exists()
        )

    def stop_workers(self, grace: float | None = None) -> None:
        """SIGCONT and SIGTERM every worker, then SIGKILL what is left after ``grace``."""
        grace = self.settings.drain_timeout + 2 if grace is None else grace
        try:
            for i in range(len(self.procs)):
                self.signal(i, signal.SIGCONT)
                self.signal(i, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for i, proc in enumerate(self.procs):
                # The whole group, even if the worker is gone: nothing may outlive us.
                self.signal(i, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)

    def close(self, grace: float | None = None) -> None:
        """Stop every worker and proxy. Idempotent; called from ``finally``.

        A second Ctrl-C during the clean-up is ignored: it would leave processes behind.
        """
        with _sigint_ignored():
            try:
                self.stop_workers(grace)
            finally:
                proxies, self.proxies = self.proxies, []
                for proxy in proxies:
                    with contextlib.suppress(RuntimeError):
                        proxy.stop()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
