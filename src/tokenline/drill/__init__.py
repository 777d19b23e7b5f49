"""The drill's fault injection (DESIGN.md section 8).

* :class:`FaultProxy` / :class:`ThreadedFaultProxy` (:mod:`.proxy`): a TCP proxy on
  loopback between workers and a networked store (PostgreSQL, Redis) that adds latency,
  blackholes, resets, refusals, one-way loss and bandwidth caps while traffic flows.
"""

from __future__ import annotations

from .proxy import FaultProxy, Faults, ProxyListenError, ProxyStats, ThreadedFaultProxy

__all__ = ["FaultProxy", "Faults", "ProxyListenError", "ProxyStats", "ThreadedFaultProxy"]
