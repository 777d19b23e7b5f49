"""The in-memory reference store: the contract in its plainest form (``memory://``)."""

from .store import MemoryStore

__all__ = ["MemoryStore"]
