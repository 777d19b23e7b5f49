"""Ledger value objects: effect records, fences, duplicates, and key validation.

The ledger is where business truth lives (DESIGN.md, sections 2-4). Three kinds of rows:

* **effects** — one per effect key: ``pending`` while an attempt runs it, then
  ``completed`` (with its JSON result) or ``failed``; with the job, token and worker
  that wrote it last.
* **fences** — per ``(key, issuer)`` the highest token that has written. The issuer is
  the job (``job:<id>``: tokens of its attempts) or a resource lease
  (``lease:<resource>``): tokens are only comparable when one counter issued them.
* **duplicates** — every execution of an already completed key (``repeat``) and every
  ledger write refused for a stale token (``stale``), for the duplicate audit.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ._errors import InvalidInputError
from ._jobs import Lease, describe

__all__ = [
    "MAX_KEY_LENGTH",
    "Duplicate",
    "DuplicateKind",
    "EffectBegin",
    "EffectRecord",
    "EffectStatus",
    "Fence",
    "Start",
    "by_attempt",
    "validate_key",
]

#: Longest accepted key (idempotency key, effect key, fence key, resource), in characters.
MAX_KEY_LENGTH = 255

#: Characters no key may hold: control characters (NUL among them, which PostgreSQL
#: cannot store) and lone surrogates (which no store can encode).
_FORBIDDEN_IN_KEY = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def validate_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a non-empty string of at most :data:`MAX_KEY_LENGTH`
    characters, with no control characters or lone surrogates; raise
    :class:`InvalidInputError` naming ``what`` otherwise."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidInputError(
            f"{what} must be a non-empty string of at most {MAX_KEY_LENGTH} characters, "
            f"got {describe(key)}"
        )
    bad = _FORBIDDEN_IN_KEY.search(key)
    if bad is not None:
        raise InvalidInputError(
            f"{what} must not contain control characters or lone surrogates, got "
            f"{describe(key)} ({bad.group()!r} at position {bad.start()})"
        )
    return key


class EffectStatus(enum.StrEnum):
    """Where an effect key is: being run, done, or failed (and so free to run again)."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """The ledger row of one effect key."""

    key: str
    status: EffectStatus
    result: str | None  # JSON text of the callee's return value, once completed
    error: str | None
    job_id: int
    token: int
    owner: str
    runs: int  # how many times an attempt took the key to run it
    created_at: float
    updated_at: float
    completed_at: float | None


class Start(enum.StrEnum):
    """The store's answer to an attempt that wants to run an effect."""

    RUN = "run"  # the key is now pending under this attempt: run the effect
    DONE = "done"  # completed earlier: use the stored result (recorded as a repeat)
    BUSY = "busy"  # pending under another attempt whose lease is live: try later
    STALE = "stale"  # refused: the job's lease is gone or a newer token holds the key


@dataclass(frozen=True, slots=True)
class EffectBegin:
    """What :meth:`Store.effect_begin` decided, with the key's record after it."""

    start: Start
    record: EffectRecord | None


@dataclass(frozen=True, slots=True)
class Fence:
    """A fenced write on ``key`` with ``token``.

    ``resource``/``owner`` name the resource lease that issued the token; both ``None``
    mean the job's own token. The store also checks that such a lease is still held.
    """

    key: str
    token: int
    resource: str | None = None
    owner: str | None = None

    def issuer(self, job_id: int) -> str:
        """The counter that issued the token: ``lease:<resource>`` or ``job:<id>``."""
        return f"lease:{self.resource}" if self.resource is not None else f"job:{job_id}"


class DuplicateKind(enum.StrEnum):
    """Why a duplicate was recorded."""

    REPEAT = "repeat"  # an execution of a key that had already completed
    STALE = "stale"  # a write refused because its token was stale


@dataclass(frozen=True, slots=True)
class Duplicate:
    """One recorded duplicate, for ``tokenline audit duplicates``."""

    key: str
    kind: DuplicateKind
    operation: str
    job_id: int | None
    token: int
    owner: str
    at: float


def by_attempt(key: str, kind: DuplicateKind, operation: str, lease: Lease, at: float) -> Duplicate:
    """A duplicate written by the attempt holding ``lease``."""
    return Duplicate(key, kind, operation, lease.job_id, lease.token, lease.owner, at)
