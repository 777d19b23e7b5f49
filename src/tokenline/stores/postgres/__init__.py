"""The PostgreSQL store: any number of worker machines on one database.

``postgresql://user@host:5432/db?schema=tokenline`` — needs ``tokenline[postgres]``
(psycopg 3 and psycopg_pool). :func:`libpq_url` turns such a URL into one that
``psycopg.connect`` takes, for your own connections (the outbox).
"""

from ._migrations import SCHEMA_VERSION
from ._target import libpq_url
from ._transaction import PostgresFencedTransaction
from .store import PostgresStore

__all__ = ["SCHEMA_VERSION", "PostgresFencedTransaction", "PostgresStore", "libpq_url"]
