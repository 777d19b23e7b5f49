"""The drill's worker processes get a FaultStore from the environment: the drill's app
wraps the store it opens when the drill's variables are set (``store_from_url`` never
does), and a fault file switches the faults of a process while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenline._errors import ConfigError
from tokenline.drill import (
    FAULT_FILE_ENV,
    FAULTS_ENV,
    SEED_ENV,
    FaultStore,
    RoleFaults,
    StoreFaults,
    wrap_from_env,
    write_fault_file,
)
from tokenline.drill.app import DrillApp
from tokenline.stores import MemoryStore, store_from_url
from tokenline.stores.sqlite import SQLiteStore


def test_the_environment_wraps_the_drill_apps_store_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drill's app opens the plain store without the drill's variables, and a
    FaultStore with the faults of TOKENLINE_DRILL_FAULTS with them; store_from_url
    builds the plain store either way."""
    for name in (FAULTS_ENV, FAULT_FILE_ENV, SEED_ENV):
        monkeypatch.delenv(name, raising=False)
    url = f"sqlite:///{tmp_path / 'env.db'}"
    app = DrillApp(url)
    assert isinstance(app.open_store(), SQLiteStore)
    monkeypatch.setenv(FAULTS_ENV, '{"leases": {"error": true}}')
    monkeypatch.setenv(SEED_ENV, "3")
    store = app.open_store(timeout=2)
    assert isinstance(store, FaultStore)
    assert isinstance(store.inner, SQLiteStore)
    assert store.faults == StoreFaults(leases=RoleFaults(error=True))
    assert store.hang_limit == 2
    assert type(store_from_url(url)) is SQLiteStore
    monkeypatch.setenv(FAULTS_ENV, '{"leases": {"eror": true}}')
    with pytest.raises(ConfigError, match=FAULTS_ENV):
        app.open_store()
    with pytest.raises(ConfigError, match=SEED_ENV):
        wrap_from_env(MemoryStore(), {FAULTS_ENV: "{}", SEED_ENV: "x"})


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from tokenline._jobs import NewJob
    from tokenline.drill import FaultStore, InjectedFaultError
    from tokenline.drill.app import DrillApp

    async def main() -> None:
        store = DrillApp(sys.argv[1]).open_store(timeout=5)
        assert isinstance(store, FaultStore), type(store)
        await store.open()
        try:
            (job_id,) = await store.jobs_enqueue(jobs=[NewJob(queue="q", task="t", args="{}")])
            seen, last = [], None
            for _ in range(1000):  # about 20 s at most
                try:
                    await store.job_get(job_id=job_id)
                    state = "ok"
                except InjectedFaultError:
                    state = "fault"
                if state != last:
                    print(state, flush=True)
                    seen.append(state)
                    last = state
                if seen == ["ok", "fault", "ok"]:
                    return
                await asyncio.sleep(0.02)
        finally:
            await store.close()

    asyncio.run(main())
    """
)


def test_a_fault_file_switches_faults_in_a_running_worker_process(tmp_path: Path) -> None:
    """A process whose store came from the drill's app with TOKENLINE_DRILL_FAULT_FILE
    set follows the faults its controller writes into that file while it runs."""
    fault_file = tmp_path / "worker-1.json"
    env = {**os.environ, FAULT_FILE_ENV: str(fault_file)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"sqlite:///{tmp_path / 'child.db'}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ok"
        write_fault_file(fault_file, StoreFaults(broker=RoleFaults(error=True)))
        assert child.stdout.readline().strip() == "fault"
        fault_file.unlink()
        assert child.stdout.readline().strip() == "ok"
        _out, err = child.communicate(timeout=15)
        assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
