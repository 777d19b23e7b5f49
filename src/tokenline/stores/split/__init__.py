"""The split topology: broker and leases on Redis, the ledger on PostgreSQL."""

from .ledger import SplitLedger
from .store import SplitStore

__all__ = ["SplitLedger", "SplitStore"]
