"""The drill: real workers, real stores, injected faults, invariants checked after.

* :class:`FaultProxy` / :class:`ThreadedFaultProxy` (:mod:`.proxy`): a TCP proxy on
  loopback between workers and a networked store (PostgreSQL, Redis) that adds latency,
  blackholes, resets, refusals, one-way loss and bandwidth caps while traffic flows.
* :class:`FaultStore` (:mod:`.faultstore`): a store wrapper that fails calls by role
  (broker, leases, ledger) with errors, delays, hangs and lost acks, for stores without
  a network (SQLite); worker processes pick it up from the environment
  (:func:`wrap_from_env`), so a controller can switch faults while they run
  (:func:`write_fault_file`).

On top of them, ``tokenline drill``: :mod:`.scenarios` (what is injected when, on whom),
:mod:`.runner` (real worker processes on a fresh store, faults on a seeded schedule),
:mod:`.checker` (the invariants of the README's "Guarantees, precisely", read back
from the store alone), :mod:`.app` (the jobs: one fenced business row each) and
:mod:`.dependency` (the dependency some jobs call, which a scenario makes time out).
"""

from __future__ import annotations

from .faultstore import FAULT_FILE_ENV, FAULTS_ENV, SEED_ENV, FaultStore, wrap_from_env
from .proxy import FaultProxy, Faults, ProxyListenError, ProxyStats, ThreadedFaultProxy
from .storefaults import (
    ROLES,
    InjectedFaultError,
    Role,
    RoleFaults,
    StoreFaults,
    role_of,
    write_fault_file,
)

__all__ = [
    "FAULTS_ENV",
    "FAULT_FILE_ENV",
    "ROLES",
    "SEED_ENV",
    "FaultProxy",
    "FaultStore",
    "Faults",
    "InjectedFaultError",
    "ProxyListenError",
    "ProxyStats",
    "Role",
    "RoleFaults",
    "StoreFaults",
    "ThreadedFaultProxy",
    "role_of",
    "wrap_from_env",
    "write_fault_file",
]
