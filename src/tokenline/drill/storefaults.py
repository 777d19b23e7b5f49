"""What the drill injects into a store, per role: the fault descriptions.

:class:`StoreFaults` holds a :class:`RoleFaults` for each :class:`Role`; :data:`ROLES`
says which role each store method belongs to. They are immutable values, built in
Python or read from JSON (an environment variable, or a fault file a drill controller
rewrites with :func:`write_fault_file` while workers run, re-read by
:class:`FaultFile`). How they are applied: :mod:`tokenline.drill.faultstore`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._errors import ConfigError, StoreUnavailableError
from ..stores.base import ROLES as SEAM_ROLES
from ..stores.base import Role
from ._spec import check_flag, check_number, from_mapping, to_mapping

__all__ = [
    "ROLES",
    "UNFAULTED",
    "FaultFile",
    "InjectedFaultError",
    "Role",
    "RoleFaults",
    "StoreFaults",
    "role_of",
    "write_fault_file",
]

log = logging.getLogger("tokenline.drill.faultstore")


#: Never faulted: the life cycle, and ``wait_for_jobs`` (a wait, not an operation: real
#: stores do not fail it).
UNFAULTED = frozenset({"open", "close", "migrate", "wait_for_jobs"})

#: Every store method and the role whose faults it takes (as the seam declares it, in
#: :mod:`tokenline.stores.base`); ``None``: never faulted.
ROLES: Mapping[str, Role | None] = {
    **{name: role for name, role in SEAM_ROLES.items() if name not in UNFAULTED},
    **dict.fromkeys(UNFAULTED),
}


_LEDGER_PREFIXES = ("ledger", "effect", "fence", "duplicate", "idempotency")
_LEASES_PREFIXES = ("lease", "worker")


def role_of(method: str) -> Role | None:
    """The role of a store method: as the seam declares it (``None`` for those never
    faulted); for a store's own extra method, off the seam, guessed from its name."""
    if method in ROLES:
        return ROLES[method]
    if method.startswith(_LEDGER_PREFIXES):
        return Role.LEDGER
    if method.startswith(_LEASES_PREFIXES):
        return Role.LEASES
    return Role.BROKER


class InjectedFaultError(StoreUnavailableError):
    """A store call failed because the drill injected a fault, not the store itself."""

    def __init__(self, message: str, *, role: Role, method: str, kind: str) -> None:
        self.role = role
        self.method = method
        self.kind = kind
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class RoleFaults:
    """The faults of one role; the default value injects nothing."""

    #: Raise instead of running the call.
    error: bool = False
    #: Seconds to wait before the call.
    delay: float = 0.0
    #: Block until cleared (or the store's timeout, or the caller's).
    hang: bool = False
    #: Run the call, then raise: the operation is applied, its answer lost.
    fail_after: bool = False
    #: Share of calls that ``error`` and ``fail_after`` hit, from 0 to 1.
    probability: float = 1.0
    #: Only these methods of the role (``None``: all of them).
    methods: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("error", "hang", "fail_after"):
            check_flag(name, getattr(self, name))
        check_number("delay", self.delay)
        if check_number("probability", self.probability) > 1:
            raise ConfigError("probability", f"must be at most 1, got {self.probability!r}")
        if self.methods is not None:
            if isinstance(self.methods, str) or not all(isinstance(m, str) for m in self.methods):
                raise ConfigError("methods", f"must be a list of names, got {self.methods!r}")
            if not self.methods:
                # An empty list would silently fault nothing: a drill that proves nothing.
                raise ConfigError("methods", "must name at least one method (or be left out)")
            # JSON gives a list; keep the value hashable and order-free.
            object.__setattr__(self, "methods", frozenset(self.methods))

    @property
    def active(self) -> bool:
        """Whether this injects anything at all."""
        return self.error or self.hang or self.fail_after or self.delay > 0

    def applies_to(self, method: str) -> bool:
        """Whether these faults hit ``method`` (of their role)."""
        return self.active and (self.methods is None or method in self.methods)


@dataclass(frozen=True, slots=True)
class StoreFaults:
    """The faults of every role at once; the default value injects nothing."""

    broker: RoleFaults = RoleFaults()
    leases: RoleFaults = RoleFaults()
    ledger: RoleFaults = RoleFaults()

    def __post_init__(self) -> None:
        for role in Role:
            faults = self.for_role(role)
            if not isinstance(faults, RoleFaults):
                raise ConfigError(role.value, f"must be RoleFaults, got {faults!r}")
            for method in sorted(faults.methods or ()):
                if role_of(method) is not role:
                    raise ConfigError(
                        f"{role.value}.methods",
                        f"{method!r} is not a {role.value} method "
                        f"(its role: {role_of(method) or 'never faulted'})",
                    )

    def for_role(self, role: Role) -> RoleFaults:
        """The faults of ``role``."""
        faults: RoleFaults = getattr(self, role.value)
        return faults

    @classmethod
    def from_mapping(cls, data: object, where: str = "faults") -> StoreFaults:
        """From a JSON object ``{"broker": {...}, ...}``; unknown keys are refused."""
        if not isinstance(data, Mapping):
            raise ConfigError(where, f"must be an object, got {type(data).__name__}")
        roles = {r.value for r in Role}
        unknown = sorted(str(k) for k in data if k not in roles)
        if unknown:
            raise ConfigError(
                where,
                f"unknown {'role' if len(unknown) == 1 else 'roles'} {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(roles))}",
            )
        by_role = {}
        for role, value in data.items():
            try:
                by_role[str(role)] = from_mapping(RoleFaults, value, f"{where}.{role}")
            except ConfigError as exc:
                if exc.setting.startswith(where):
                    raise
                # RoleFaults names only its own field: say which role it belongs to.
                raise ConfigError(f"{where}.{role}.{exc.setting}", exc.reason) from None
        return cls(**by_role)

    @classmethod
    def from_json(cls, text: str, where: str = "faults") -> StoreFaults:
        """From JSON text; a :class:`ConfigError` names ``where`` when it is not valid."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(where, f"is not valid JSON: {exc}") from None
        return cls.from_mapping(data, where)

    def to_json(self) -> str:
        """JSON that :meth:`from_json` reads back; roles without faults are left out."""
        data = {r.value: to_mapping(self.for_role(r)) for r in Role}
        return json.dumps({k: v for k, v in data.items() if v}, sort_keys=True)


def write_fault_file(path: str | os.PathLike[str], faults: StoreFaults) -> None:
    """Replace the fault file at ``path`` atomically, so no reader sees half of it."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(faults.to_json(), encoding="utf-8")
    os.replace(tmp, target)


class FaultFile:
    """Re-reads a fault file when its identity (inode, size, mtime) changes."""

    def __init__(self, path: Path, interval: float) -> None:
        self.path = path
        self.interval = interval
        self._next_check = 0.0
        self._seen: tuple[int, int, int] | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def load(self) -> StoreFaults | None:
        """The file's faults now (``None`` if it does not exist); strict, for start-up."""
        self._seen = self._signature()
        self._next_check = time.monotonic() + self.interval
        if self._seen is None:
            return None
        return StoreFaults.from_json(self.path.read_text(encoding="utf-8"), str(self.path))

    def poll(self, current: StoreFaults) -> StoreFaults:
        """The faults to apply: ``current`` unless the file changed since last read."""
        # Real time on purpose: faults act on the real world, as a network would.
        now = time.monotonic()
        if now < self._next_check:
            return current
        self._next_check = now + self.interval
        signature = self._signature()
        if signature == self._seen:
            return current
        self._seen = signature
        if signature is None:
            return StoreFaults()
        try:
            return StoreFaults.from_json(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, ConfigError) as exc:
            log.warning("ignoring fault file %s, keeping the current faults: %s", self.path, exc)
            return current
