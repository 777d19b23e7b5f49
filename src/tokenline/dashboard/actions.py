"""The operator's actions: what each takes, what it says it will do, and doing it.

Each action validates its fields first (a bad one: 400, nothing read or written), then
acts through the store's own conditional operations, as the command line does: a job
that is no longer dead is not retried, a lease whose token moved on is not released.
An action that does not apply answers 409 and changes nothing; an unknown id, 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from .._config import validate_queue_name
from .._errors import InvalidInputError, JobNotFoundError, QueueNameError
from .._jobs import JobState, describe
from .._records import validate_key
from ..health import alive, lease_mismatch
from ..stores import Store
from ..stores.base import MAX_JOB_ID, ResourceLease

__all__ = ["ACTIONS", "MAX_ID", "Action", "Outcome", "Params", "parse", "parse_id", "parse_name"]

#: The largest job id or token a store holds (a signed 64-bit integer); anything past it
#: names nothing, and must not reach a store that cannot even take it as a parameter.
MAX_ID = MAX_JOB_ID


class BadInput(ValueError):
    """A field of an action is missing or malformed."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an action did: an HTTP status (200 done, 404, 409) and a sentence."""

    status: int
    message: str

    @property
    def done(self) -> bool:
        """Whether the store changed."""
        return self.status == 200


#: An action's validated fields, by name.
Params = dict[str, str | int]


@dataclass(frozen=True, slots=True)
class Action:
    """An operator action: its fields, how it reads in a confirmation, and its effect."""

    name: str
    fields: tuple[str, ...]
    describe: Callable[[Params], str]
    run: Callable[[Store, Params], Awaitable[Outcome]]
    danger: bool = False


def parse_id(name: str, value: str, *, lowest: int = 1) -> int:
    """``value`` as a job id or a token: ASCII digits (no sign, no underscore, no other
    script's digits), from ``lowest`` to :data:`MAX_ID`; :class:`BadInput` otherwise."""
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise BadInput(f"{name} must be a whole number, got {describe(value)}")
    # The length first: int() of a huge string is slow, and the answer is known.
    if len(text.lstrip("0")) > len(str(MAX_ID)) or not lowest <= int(text) <= MAX_ID:
        raise BadInput(
            f"{name} {describe(text)} is out of range: it runs from {lowest} to {MAX_ID}"
        )
    return int(text)


def parse_name(name: str, value: str) -> str:
    """``value`` as a worker id, a resource key or an owner: what a store can hold (see
    :func:`tokenline._records.validate_key`); :class:`BadInput` otherwise."""
    try:
        return validate_key(value, name)
    except InvalidInputError as exc:
        raise BadInput(str(exc)) from None


def parse(action: Action, raw: Mapping[str, str]) -> Params:
    """``action``'s fields from a query string or form; :class:`BadInput` when one is
    missing or malformed."""
    out: Params = {}
    for name in action.fields:
        value = raw.get(name, "")
        if not value.strip():
            raise BadInput(f"{name} is missing")
        if name == "job":
            out[name] = parse_id(name, value)
        elif name == "lease_token":
            # 0 is no token a lease was given, but a well-formed one: refused as stale.
            out[name] = parse_id(name, value, lowest=0)
        elif name == "queue":
            try:
                out[name] = validate_queue_name(value)
            except QueueNameError as exc:
                raise BadInput(str(exc)) from None
        else:
            out[name] = parse_name(name, value)
    return out


async def _pause(store: Store, p: Params) -> Outcome:
    queue = str(p["queue"])
    stats = {s.queue: s for s in await store.queues_stats()}
    if queue in stats and stats[queue].paused:
        return Outcome(409, f"queue {queue!r} is already paused: nothing changed")
    await store.queue_pause(queue=queue)
    return Outcome(200, f"paused queue {queue!r}: workers claim none of its jobs until resumed")


async def _resume(store: Store, p: Params) -> Outcome:
    queue = str(p["queue"])
    stats = {s.queue: s for s in await store.queues_stats()}
    if queue not in stats or not stats[queue].paused:
        return Outcome(409, f"queue {queue!r} is not paused: nothing changed")
    await store.queue_resume(queue=queue)
    return Outcome(200, f"resumed queue {queue!r}: workers claim its jobs again")


async def _drain(store: Store, p: Params) -> Outcome:
    worker = str(p["worker"])
    if await store.worker_drain(worker_id=worker):
        return Outcome(
            200,
            f"asked worker {worker!r} to drain: it stops claiming at its next heartbeat, "
            "finishes its jobs within its drain timeout, then stops",
        )
    found = [w for w in await store.workers_list() if w.id == worker]
    if not found:
        return Outcome(404, f"no worker with id {worker!r}: nothing changed")
    (w,) = found
    if w.state == "stopped":
        why = "it has stopped"
    elif not alive(w, await store.store_time()):
        why = "its membership has expired (it is gone, or cut off from the store)"
    else:
        why = "it re-registered meanwhile; ask again"
    return Outcome(409, f"worker {worker!r} not asked to drain: {why}; nothing changed")


def _on_dead(
    verb: str, act: Callable[[Store, int], Awaitable[int]]
) -> Callable[[Store, Params], Awaitable[Outcome]]:
    """An action on one dead job: refused unless the job is dead."""

    async def run(store: Store, p: Params) -> Outcome:
        jid = int(p["job"])
        try:
            state = (await store.job_get(job_id=jid)).state
        except JobNotFoundError:
            return Outcome(404, f"no job with id {jid}: nothing changed")
        if state is not JobState.DEAD:
            return Outcome(409, f"job {jid} is not dead (it is {state.value}): nothing changed")
        if not await act(store, jid):
            return Outcome(409, f"job {jid} left the dead-letter queue meanwhile: nothing changed")
        return Outcome(200, f"{verb} dead job {jid}")

    return run


async def _release(store: Store, p: Params) -> Outcome:
    key, owner, token = str(p["key"]), str(p["owner"]), int(p["lease_token"])
    found = [r for r in await store.resource_leases_list() if r.resource == key]
    if not found:
        return Outcome(404, f"no resource lease named {key!r}: nothing changed")
    (current,) = found
    wrong = lease_mismatch(current, owner, token)
    if wrong is not None:
        return Outcome(409, f"lease {key!r} not released: {wrong}; nothing changed")
    if current.expires_at <= await store.store_time():
        return Outcome(409, f"lease {key!r} has already expired: nothing to release")
    # The store decides, on the owner and token the operator gave (the check above only
    # words the refusal): a lease renewed under a new token, or taken over, since it was
    # read is refused, never released blindly.
    claimed = ResourceLease(resource=key, owner=owner, token=token, expires_at=current.expires_at)
    if not await store.resource_lease_release(lease=claimed):
        return Outcome(409, f"lease {key!r} changed hands meanwhile: nothing changed")
    return Outcome(200, f"released lease {key!r} (owner {owner!r}, token {token})")


#: Every action, by the name in its URL (``/actions/<name>``).
ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action(
            "pause-queue",
            ("queue",),
            lambda p: (
                f"Pause queue {p['queue']!r}: workers stop claiming its jobs (they stay queued)."
            ),
            _pause,
        ),
        Action(
            "resume-queue",
            ("queue",),
            lambda p: f"Resume queue {p['queue']!r}: workers claim its jobs again.",
            _resume,
        ),
        Action(
            "drain-worker",
            ("worker",),
            lambda p: (
                f"Drain worker {p['worker']!r}: it finishes its jobs, claims no more, then stops."
            ),
            _drain,
            danger=True,
        ),
        Action(
            "retry-job",
            ("job",),
            lambda p: f"Retry dead job {p['job']} with a fresh attempt budget.",
            _on_dead("requeued", lambda s, j: s.jobs_retry_dead(job_ids=[j])),
        ),
        Action(
            "discard-job",
            ("job",),
            lambda p: f"Discard dead job {p['job']}: kept for the record, never run again.",
            _on_dead(
                "discarded",
                lambda s, j: s.jobs_cancel(
                    job_ids=[j], reason="discarded from the dead-letter queue (dashboard)"
                ),
            ),
            danger=True,
        ),
        Action(
            "release-lease",
            ("key", "owner", "lease_token"),
            lambda p: (
                f"Release resource lease {p['key']!r} held by {p['owner']!r} under token "
                f"{p['lease_token']}: the store refuses it if either no longer matches."
            ),
            _release,
            danger=True,
        ),
    )
}
