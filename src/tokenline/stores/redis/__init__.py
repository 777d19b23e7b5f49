"""The Redis store: the broker and leases roles on Redis (``redis://…``).

It plays no ledger: business truth lives in a transactional database. Used alone it is
a broker and lease store for :class:`~tokenline.stores.split.SplitStore`, which adds a
PostgreSQL ledger.
"""

from .store import RedisStore

__all__ = ["RedisStore"]
