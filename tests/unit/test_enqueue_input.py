"""Bad input at enqueue: every value either becomes a job that gives its arguments back
exactly, or is refused with a tokenline error naming the field; nothing else is stored.

The properties run over enqueue's whole input space (arguments, keyword arguments, task,
queue, key, delay, run_at, priority, max_attempts, unique) on the memory and SQLite
stores; a deterministic set of the bad cases runs on PostgreSQL too. The oracle here is
independent of tokenline's own checks: a value is acceptable when ``json`` gives it back
equal and of the same kind, within the documented limits.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import re
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenline import App, FakeClock, InvalidInputError, TokenlineError
from tokenline._jobs import (
    MAX_ATTEMPTS,
    MAX_DELAY,
    MAX_INT_DIGITS,
    MAX_PAYLOAD_DEPTH,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Finish,
    Lease,
    Outcome,
    finish_transition,
)
from tokenline._records import MAX_KEY_LENGTH
from tokenline.cli import main
from tokenline.worker.context import decode_args

NOW = 1_700_000_000.0
TASKS = {"t": "default", "mail.send": "mail"}
#: "." and ".." alone are path steps in a URL (the dashboard's /queues/<name>).
QUEUE_RE = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.:-]{1,64}")
FIELDS = (
    "task",
    "args",
    "kwargs",
    "idempotency_key",
    "queue",
    "when",
    "priority",
    "max_attempts",
    "unique",
)
PROPERTY = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Colour(enum.StrEnum):
    """A str subclass: accepted, and it arrives as its plain value."""

    RED = "red"


class Size(enum.IntEnum):
    """An int subclass: accepted, and it arrives as its plain value."""

    LARGE = 3


# -- the oracle ---------------------------------------------------------------------------------


def same(back: Any, sent: Any) -> bool:
    """Whether ``back`` (decoded from JSON) is ``sent``: equal and of the same kind,
    with str, int and float subclasses (enums) arriving as their plain type."""
    if sent is None or isinstance(sent, bool):
        return back is sent
    if isinstance(sent, int):
        return type(back) is int and back == sent
    if isinstance(sent, float):
        return (
            type(back) is float
            and back == sent
            and math.copysign(1.0, back) == math.copysign(1.0, sent)
        )
    if isinstance(sent, str):
        return type(back) is str and back == sent
    if isinstance(sent, list):
        return (
            type(back) is list
            and len(back) == len(sent)
            and all(same(b, s) for b, s in zip(back, sent, strict=True))
        )
    if isinstance(sent, dict):
        return (
            type(back) is dict
            and all(isinstance(k, str) for k in sent)
            and back.keys() == sent.keys()
            and all(same(back[k], sent[k]) for k in sent)
        )
    return False


def nesting(value: Any) -> int:
    """Lists and dicts nested in ``value``, counting itself."""
    if isinstance(value, list | tuple):
        return 1 + max((nesting(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((nesting(v) for v in value.values()), default=0)
    return 0


def too_long_int(value: Any) -> bool:
    """Whether ``value`` holds an integer of more than MAX_INT_DIGITS digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) >= 10**MAX_INT_DIGITS
    if isinstance(value, list | tuple):
        return any(too_long_int(v) for v in value)
    if isinstance(value, dict):
        return any(too_long_int(v) for v in value.values())
    return False


def exact(value: Any) -> bool:
    """Whether JSON gives ``value`` back as it is, within the documented limits."""
    if nesting(value) > MAX_PAYLOAD_DEPTH or too_long_int(value):
        return False
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return same(json.loads(text), value)


def number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def bad_fields(i: Inputs) -> set[str]:
    """The fields of ``i`` that the documented rules refuse."""
    bad: set[str] = set()
    if not isinstance(i.task, str) or i.task not in TASKS:
        bad.add("task")
    if not all(exact(a) for a in i.args):
        bad.add("args")
    # Each keyword argument is one argument, as each positional one is: MAX_PAYLOAD_DEPTH
    # counts the lists and dicts inside it, not the mapping that names it.
    if i.kwargs is not None and (
        not isinstance(i.kwargs, Mapping)
        or not all(isinstance(k, str) for k in i.kwargs)
        or not all(exact(v) for v in i.kwargs.values())
    ):
        bad.add("kwargs")
    key = i.idempotency_key
    if key is not None and (
        not isinstance(key, str)
        or not 1 <= len(key) <= MAX_KEY_LENGTH
        or re.search("[\x00-\x1f\x7f-\x9f\ud800-\udfff]", key)
    ):
        bad.add("idempotency_key")
    if i.queue is not None and not (isinstance(i.queue, str) and QUEUE_RE.fullmatch(i.queue)):
        bad.add("queue")
    if i.delay is not None and not (number(i.delay) and 0 <= i.delay <= MAX_DELAY):
        bad.add("delay")
    if i.run_at is not None and not (number(i.run_at) and 0 <= i.run_at <= NOW + MAX_DELAY):
        bad.add("run_at")
    if i.delay is not None and i.run_at is not None:
        bad |= {"delay", "run_at"}
    p = i.priority
    if p is not None and not (
        isinstance(p, int) and not isinstance(p, bool) and MIN_PRIORITY <= p <= MAX_PRIORITY
    ):
        bad.add("priority")
    m = i.max_attempts
    if m is not None and not (
        isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= MAX_ATTEMPTS
    ):
        bad.add("max_attempts")
    if i.unique is False:
        if i.unique_for is not None:
            bad.add("unique_for")
    elif i.unique is not True and i.unique != "active":
        bad.add("unique")
    else:
        if key is None:
            bad |= {"unique", "idempotency_key"}
        u = i.unique_for
        if u is not None and not (number(u) and 0 < u <= MAX_DELAY):
            bad.add("unique_for")
    return bad


#: How an error message names each field (a word of its own: "args" is not "kwargs").
NAMES = {
    "task": r"\btask\b",
    "args": r"\bargs\b",
    "kwargs": r"\bkwargs\b",
    "idempotency_key": r"\bidempotency_key\b",
    "queue": r"\bqueue name\b",
    "delay": r"\bdelay\b",
    "run_at": r"\brun_at\b",
    "priority": r"\bpriority\b",
    "max_attempts": r"\bmax_attempts\b",
    "unique": r"\bunique\b",
    "unique_for": r"\bunique_for\b",
}


def names_a_bad_field(message: str, bad: set[str]) -> bool:
    # Every payload error says "of task …": it only counts for an unknown task.
    if "task" not in bad:
        message = re.sub(r"\bof task '[^']*'", "", message)
    return any(re.search(NAMES[f], message) for f in bad)


# -- the input space ---------------------------------------------------------------------------

any_text = st.text(st.characters(codec=None, categories=None), max_size=20)
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | any_text
    | st.sampled_from([Colour.RED, Size.LARGE, -0.0, 1e16, 2**63, -(2**64), 10**MAX_INT_DIGITS - 1])
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=12,
)
odd_leaves = (
    st.floats()
    | st.binary(max_size=4)
    | st.frozensets(st.integers(), max_size=2)
    | st.sets(st.integers(), max_size=2)
    | st.decimals(allow_nan=False, places=2, max_value=100, min_value=-100)
    | st.complex_numbers(max_magnitude=10)
    | st.builds(object)
    | st.dates()
    | st.sampled_from([math.nan, math.inf, -math.inf, 10**MAX_INT_DIGITS, Decimal("1.5")])
)
odd_keys = st.integers() | st.none() | st.booleans() | st.floats(allow_nan=False) | any_text
any_values = st.recursive(
    json_leaves | odd_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(odd_keys, inner, max_size=3)
    ),
    max_leaves=12,
)


def nest(depth: int, leaf: Any = 1) -> Any:
    """``leaf`` inside ``depth`` lists and dicts, alternating."""
    value = leaf
    for n in range(depth):
        value = [value] if n % 2 else {"k": value}
    return value


deep_values = st.integers(MAX_PAYLOAD_DEPTH - 2, MAX_PAYLOAD_DEPTH + 2).map(nest)
valid_queues = st.sampled_from(["default", "mail", "a.b:c-d_e", "Q" * 64, "0"])
numbers = st.floats() | st.integers(-(10**20), 10**20)
wild_delays = numbers | st.booleans() | any_text | st.sampled_from([MAX_DELAY + 1, 1e12, 1e308])
wild_run_ats = numbers | st.booleans() | any_text | st.sampled_from([-1, 1e12, 1e308, math.nan])

TAME: dict[str, st.SearchStrategy[Any]] = {
    "task": st.sampled_from(sorted(TASKS)),
    "args": st.lists(json_values, max_size=4),
    "kwargs": st.none() | st.dictionaries(any_text, json_values, max_size=3),
    "idempotency_key": st.none()
    | st.text(st.characters(exclude_categories=["Cc", "Cs"]), min_size=1, max_size=MAX_KEY_LENGTH),
    "queue": st.none() | valid_queues,
    "when": st.tuples(st.none(), st.none())
    | st.tuples(st.floats(0, MAX_DELAY) | st.sampled_from([0, MAX_DELAY]), st.none())
    | st.tuples(st.none(), st.floats(0, NOW + MAX_DELAY) | st.just(NOW + MAX_DELAY)),
    "priority": st.none() | st.integers(MIN_PRIORITY, MAX_PRIORITY),
    "max_attempts": st.none() | st.integers(1, MAX_ATTEMPTS),
    "unique": st.just((False, None)),
}
WILD: dict[str, st.SearchStrategy[Any]] = {
    "task": any_text | st.integers() | st.none() | st.builds(object) | st.just(print),
    "args": st.lists(any_values | deep_values, max_size=4),
    "kwargs": st.dictionaries(odd_keys, any_values | deep_values, max_size=3)
    | st.lists(st.integers(), max_size=2)
    | any_text
    | st.integers(),
    "idempotency_key": any_text
    | st.text(min_size=MAX_KEY_LENGTH - 1, max_size=MAX_KEY_LENGTH + 2)
    | st.integers()
    | st.binary(max_size=3),
    "queue": any_text
    | st.text("abcXYZ019_.:-", min_size=60, max_size=70)
    | st.sampled_from(["", "default\n", "\x00", "a b", "é", ".", "..", "..."])
    | st.integers(),
    "when": st.tuples(wild_delays, st.none())
    | st.tuples(st.none(), wild_run_ats)
    | st.tuples(wild_delays, wild_run_ats),
    "priority": st.integers()
    | st.integers(MAX_PRIORITY - 1, MAX_PRIORITY + 2)
    | st.integers(MIN_PRIORITY - 2, MIN_PRIORITY + 1)
    | st.sampled_from([2**70, True, False, 1.0, "1"]),
    "max_attempts": st.integers(-2, 3)
    | st.integers(MAX_ATTEMPTS - 1, 2**70)
    | st.sampled_from([True, 2.0, "3"]),
    "unique": st.tuples(
        st.sampled_from([True, "active", False, "always", 1, None]),
        st.none() | numbers | st.sampled_from([MAX_DELAY, MAX_DELAY + 1]),
    ),
}


@dataclass
class Inputs:
    """One enqueue's input."""

    task: Any
    args: list[Any]
    kwargs: Any
    idempotency_key: Any
    queue: Any
    delay: Any
    run_at: Any
    priority: Any
    max_attempts: Any
    unique: Any
    unique_for: Any
    wild: set[str] = field(default_factory=set)

    def options(self) -> dict[str, Any]:
        return {
            "idempotency_key": self.idempotency_key,
            "priority": self.priority,
            "delay": self.delay,
            "run_at": self.run_at,
            "queue": self.queue,
            "max_attempts": self.max_attempts,
            "unique": self.unique,
            "unique_for": self.unique_for,
        }


@st.composite
def inputs(draw: st.DrawFn) -> Inputs:
    """An enqueue whose fields are valid but for a few drawn from anywhere."""
    wild = set(draw(st.lists(st.sampled_from(FIELDS), max_size=2)))
    values = {f: draw(WILD[f] if f in wild else TAME[f]) for f in FIELDS}
    values["delay"], values["run_at"] = values.pop("when")
    unique, unique_for = values.pop("unique")
    if unique is not False and "unique" not in wild:
        unique = False
    return Inputs(**values, unique=unique, unique_for=unique_for, wild=wild)


# -- fixtures -----------------------------------------------------------------------------------


def _add_tasks(app: App) -> App:
    for name, queue in TASKS.items():
        app.task(name=name, queue=queue)(lambda ctx, *a, **k: None)
    return app


@pytest.fixture(params=["memory", "sqlite"])
def app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[App]:
    """An app with two tasks on the memory or SQLite store; its clock reads NOW."""
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'q.db'}"
    with App(url, clock=FakeClock(NOW)) as a:
        yield _add_tasks(a)


def _stored(app: App) -> list[Any]:
    return list(app.run(lambda s: s.jobs_list(limit=1_000_000)))


def check_round_trip(app: App, i: Inputs, jid: int, seen: set[int]) -> None:
    """The stored job holds exactly what was enqueued, read back as the worker does."""
    job = app.run(lambda s: s.job_get(job_id=jid))
    if jid in seen:  # a unique key held by an earlier job: its id, nothing new stored
        assert i.unique is not False
        assert job.idempotency_key == i.idempotency_key
        return
    seen.add(jid)
    args, kwargs = decode_args(job.args)
    assert same(args, list(i.args))
    assert same(kwargs, dict(i.kwargs or {}))
    assert job.task == i.task
    assert job.queue == (TASKS[i.task] if i.queue is None else i.queue)
    assert job.priority == (0 if i.priority is None else i.priority)
    assert job.idempotency_key == i.idempotency_key
    assert job.max_attempts == (5 if i.max_attempts is None else i.max_attempts)
    if i.run_at is not None:
        # One already past by the app's clock (NOW) means now, the store's: the time
        # the job was enqueued. The store keeps its own clock (the real one here), so a
        # run_at between NOW and the store's now is stored as given.
        assert job.run_at == (job.created_at if i.run_at <= NOW else i.run_at)
    assert math.isfinite(job.run_at)


# -- properties ---------------------------------------------------------------------------------


@PROPERTY
@given(i=inputs())
def test_enqueue_stores_exactly_or_refuses_naming_the_field(app: App, i: Inputs) -> None:
    """Either a job that gives back every argument exactly, or a tokenline error whose
    message names a field that was wrong, with nothing stored."""
    bad = bad_fields(i)
    before = {j.id for j in _stored(app)}
    error, jid = _outcome(lambda: app.enqueue(i.task, *i.args, kwargs=i.kwargs, **i.options()))
    if error is not None:
        assert issubclass(error, InvalidInputError), jid
        assert bad, f"refused good input: {jid}"
        assert names_a_bad_field(jid, bad), f"{jid} names none of {sorted(bad)}"
        assert {j.id for j in _stored(app)} == before
        return
    assert not bad, f"accepted bad {sorted(bad)}"
    check_round_trip(app, i, jid, before)


def _outcome(fn: Callable[[], Any]) -> tuple[type[BaseException] | None, Any]:
    try:
        return None, fn()
    except TokenlineError as exc:
        return type(exc), str(exc)


@PROPERTY
@given(i=inputs())
def test_every_way_in_validates_alike(app: App, i: Inputs) -> None:
    """build_job, enqueue_async and enqueue_many / build_many accept and refuse the same
    input, with the same error class; each refusal names a bad field."""
    bad = bad_fields(i)
    job_error, job = _outcome(lambda: app.build_job(i.task, i.args, i.kwargs, **i.options()))
    assert (job_error is None) == (not bad)

    async def enqueue_async() -> int:
        return await app.enqueue_async(i.task, *i.args, kwargs=i.kwargs, **i.options())

    async_error, _ = _outcome(lambda: asyncio.run(enqueue_async()))
    assert async_error is job_error
    if i.kwargs is not None or i.run_at is not None or i.max_attempts is not None:
        return  # a batch takes none of these
    batch_options = {k: v for k, v in i.options().items() if k not in ("run_at", "max_attempts")}
    key = batch_options.pop("idempotency_key")
    many_error, many = _outcome(
        lambda: app.build_many(i.task, [list(i.args)], keys=[key], **batch_options)
    )
    assert many_error is job_error
    if many_error is not None:
        assert names_a_bad_field(many, bad), many
    else:
        assert many == [job]
    enqueue_many_error, _ = _outcome(
        lambda: app.enqueue_many(i.task, [list(i.args)], keys=[key], **batch_options)
    )
    assert enqueue_many_error is job_error


# -- the issue's cases, one by one --------------------------------------------------------------


def deep_list(depth: int) -> list[Any]:
    """A list nested ``depth`` deep, built without recursion."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


#: (case, enqueue arguments, the field the refusal must name).
BAD_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("10000-deep list", {"args": [deep_list(10_000)]}, "args"),
    ("101-deep value", {"args": [nest(MAX_PAYLOAD_DEPTH + 1)]}, "args"),
    ("tuple", {"args": [(1, 2)]}, "args"),
    ("set", {"args": [{1, 2}]}, "args"),
    ("bytes", {"args": [b"x"]}, "args"),
    ("nan", {"args": [math.nan]}, "args"),
    ("integer of 4001 digits", {"args": [10**MAX_INT_DIGITS]}, "args"),
    ("nested int key", {"args": [{"a": {2: "b"}}]}, "args"),
    # Two code points JSON reads back as one character (U+10000, U+10FFFF, U+1F600).
    ("surrogate pair", {"args": ["\ud800\udc00"]}, "args"),
    ("nested surrogate pair", {"args": [{"a": ["x\udbff\udfff"]}]}, "args"),
    ("surrogate pair in a key", {"args": [{"\ud800\udc00": 1}]}, "args"),
    ("kwargs surrogate pair", {"kwargs": {"k": "\ud83d\ude00"}}, "kwargs"),
    ("kwargs int key", {"kwargs": {1: "x"}}, "kwargs"),
    ("kwargs not a mapping", {"kwargs": ["x"]}, "kwargs"),
    ("delay 1e12", {"delay": 1e12}, "delay"),
    ("delay 1e308", {"delay": 1e308}, "delay"),
    ("delay over the maximum", {"delay": MAX_DELAY + 1}, "delay"),
    ("delay huge int", {"delay": 10**400}, "delay"),
    ("delay nan", {"delay": math.nan}, "delay"),
    ("delay inf", {"delay": math.inf}, "delay"),
    ("delay negative", {"delay": -1}, "delay"),
    ("run_at 1e12", {"run_at": 1e12}, "run_at"),
    ("run_at 1e308", {"run_at": 1e308}, "run_at"),
    ("run_at negative", {"run_at": -1.0}, "run_at"),
    ("run_at nan", {"run_at": math.nan}, "run_at"),
    ("priority 2**70", {"priority": 2**70}, "priority"),
    ("priority above int32", {"priority": MAX_PRIORITY + 1}, "priority"),
    ("priority below int32", {"priority": MIN_PRIORITY - 1}, "priority"),
    ("priority bool", {"priority": True}, "priority"),
    ("max_attempts 2**40", {"max_attempts": 2**40}, "max_attempts"),
    ("key lone surrogate", {"idempotency_key": "a\udc80"}, "idempotency_key"),
    ("key NUL", {"idempotency_key": "a\x00b"}, "idempotency_key"),
    ("key newline", {"idempotency_key": "a\n"}, "idempotency_key"),
    ("key too long", {"idempotency_key": "k" * (MAX_KEY_LENGTH + 1)}, "idempotency_key"),
    ("queue empty", {"queue": ""}, "queue"),
    ("queue trailing newline", {"queue": "default\n"}, "queue"),
    ("queue '.'", {"queue": "."}, "queue"),
    ("queue '..'", {"queue": ".."}, "queue"),
    ("queue control character", {"queue": "a\x01"}, "queue"),
    ("queue too long", {"queue": "q" * 65}, "queue"),
    ("unique_for 1e12", {"unique": True, "idempotency_key": "u", "unique_for": 1e12}, "unique_for"),
    ("unknown task", {"task": "t\n"}, "task"),
]


def enqueue_case(app: App, case: dict[str, Any]) -> int:
    options = dict(case)
    task = options.pop("task", "t")
    args = options.pop("args", [])
    return app.enqueue(task, *args, **options)


@pytest.mark.parametrize(
    ("case", "field_"), [(c[1], c[2]) for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_case_is_refused_naming_the_field(app: App, case: dict[str, Any], field_: str) -> None:
    """Each case of the issue raises a tokenline error naming its field; nothing stored."""
    with pytest.raises(InvalidInputError) as info:
        enqueue_case(app, case)
    assert re.search(NAMES[field_], str(info.value)), info.value
    assert _stored(app) == []


def test_bad_batch_item_is_named_and_nothing_is_stored(app: App) -> None:
    """enqueue_many names the item and the key at fault, and stores none of the batch."""
    with pytest.raises(InvalidInputError, match=r"items\[2\]: args\[0\]\['x'\]"):
        app.enqueue_many("t", [[1], [2], [{"x": (1,)}]])
    with pytest.raises(InvalidInputError, match=r"keys\[1\] \(idempotency_key\)"):
        app.enqueue_many("t", [[1], [2]], keys=["a", "b\x00"])
    with pytest.raises(InvalidInputError, match=r"items\[0\]"):
        app.enqueue_many("t", [{"not": "a row"}])
    with pytest.raises(InvalidInputError, match="keys must be"):
        app.enqueue_many("t", [[1], [2]], keys="ab")
    # A unique batch with a job without a key: which one was not said.
    for unique, keys in ((True, ["a", None]), ("active", [None, "b"])):
        with pytest.raises(InvalidInputError, match=rf"keys\[{keys.index(None)}\] is None"):
            app.enqueue_many("t", [[1], [2]], keys=keys, unique=unique)
    assert _stored(app) == []


def test_a_payload_that_contains_itself_is_refused_naming_the_field(app: App) -> None:
    """A list or dict inside itself is nested without end: refused as too deep, by
    enqueue and enqueue_many alike (the encoder checks no circular references)."""
    loop: list[Any] = [1]
    loop.append(loop)
    ring: dict[str, Any] = {}
    ring["again"] = ring
    deep = r"nests lists and dicts more than \d+ deep \(MAX_PAYLOAD_DEPTH\)$"
    with pytest.raises(InvalidInputError, match=r"^args\[0\]\[1\]\[1\].* " + deep):
        app.enqueue("t", loop)
    with pytest.raises(InvalidInputError, match=r"^kwargs\['ring'\]\['again'\].* " + deep):
        app.enqueue("t", kwargs={"ring": ring})
    with pytest.raises(InvalidInputError, match=r"^items\[1\]: args\[0\]\['again'\].* " + deep):
        app.enqueue_many("t", [[1], [ring]])
    assert _stored(app) == []


@pytest.mark.parametrize("args", ["abc", b"ab", {"a": 1}, 5, None], ids=repr)
def test_build_job_takes_a_list_or_tuple_of_arguments(app: App, args: Any) -> None:
    """build_job's args is the argument list: a string is not spread into characters,
    nor a dict into its keys."""
    with pytest.raises(InvalidInputError, match=r"^args of task 't' must be a list or tuple"):
        app.build_job("t", args)


def test_task_options_are_limited_at_registration() -> None:
    """A task's own priority and timeout are held to the same limits, as ConfigErrors."""
    from tokenline import ConfigError

    app = App("memory://")
    for option, value in [("priority", 2**31), ("timeout", MAX_DELAY + 1), ("timeout", 1e308)]:
        with pytest.raises(ConfigError) as info:
            app.task(name="t.limits", **{option: value})(lambda ctx: None)
        assert info.value.setting == option
    with pytest.raises(InvalidInputError, match="invalid task name"):
        app.task(name="t\n")(lambda ctx: None)


#: Values at the limits, accepted and given back exactly.
EDGE_ARGS = [
    "a\x00\udc80\n",
    "é" * 100,
    10**MAX_INT_DIGITS - 1,
    -(2**63),
    1e16,
    -0.0,
    5e-324,
    nest(MAX_PAYLOAD_DEPTH),
    {"": None, "\x00": [True, False]},
    Colour.RED,
    Size.LARGE,
]
EDGE_OPTIONS: list[dict[str, Any]] = [
    {"priority": MIN_PRIORITY},
    {"priority": MAX_PRIORITY, "idempotency_key": "é" * MAX_KEY_LENGTH},
    {"delay": MAX_DELAY, "max_attempts": MAX_ATTEMPTS},
    {"delay": 0, "queue": "q" * 64},
    {"unique": True, "idempotency_key": "edge:1", "unique_for": MAX_DELAY},
]


def check_edges(app: App, now: float) -> None:
    kw = {f"k{n}": value for n, value in enumerate(EDGE_ARGS)}
    for options in [*EDGE_OPTIONS, {"run_at": now + MAX_DELAY - 60}, {"run_at": 0}]:
        jid = app.enqueue("t", *EDGE_ARGS, kwargs=kw, **options)
        job = app.run(lambda s, jid=jid: s.job_get(job_id=jid))
        args, kwargs = decode_args(job.args)
        assert same(args, EDGE_ARGS)
        assert same(kwargs, kw)
        assert job.priority == options.get("priority", 0)
        assert job.idempotency_key == options.get("idempotency_key")


def test_values_at_the_limits_round_trip(app: App) -> None:
    """Every limit is inclusive: values on it are stored and given back exactly."""
    check_edges(app, NOW)


@pytest.mark.parametrize(
    "text",
    # Built with chr: surrogates written as literals look alike to some tools.
    [
        chr(0xDCFF),
        chr(0xD800),
        "a" + chr(0xD800),
        chr(0xDC00) + chr(0xD800),
        chr(0xD800) + "x" + chr(0xDC00),
        chr(0x1F600),
    ],
)
def test_surrogates_that_form_no_pair_round_trip(app: App, text: str) -> None:
    """A surrogate pair is refused (JSON would read it back as one character: see
    BAD_CASES), but lone surrogates, a low one before a high one, and a character above
    U+FFFF reach the handler exactly as they were enqueued."""
    jid = app.enqueue("t", text, {"k": [text]})
    args, _ = decode_args(next(j for j in _stored(app) if j.id == jid).args)
    assert args == [text, {"k": [text]}]


# -- the command line ---------------------------------------------------------------------------


@pytest.fixture
def cli_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """An importable module with an app of two tasks on a SQLite file: (--app, --url)."""
    from tokenline.cli import _common

    monkeypatch.setattr(_common.console, "width", 250)
    name = f"enqueue_input_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from tokenline import App\n\napp = App()\n"
        + "".join(
            f"app.task(name={n!r}, queue={q!r})(lambda ctx, *a, **k: None)\n"
            for n, q in TASKS.items()
        )
    )
    monkeypatch.chdir(tmp_path)
    return f"{name}:app", f"sqlite:///{tmp_path / 'cli.db'}"


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


# --delay out of range or not finite is refused by the option itself (exit status 2):
# see test_every_float_option_refuses_what_is_no_finite_number_in_range.
CLI_BAD = [
    (["--priority", str(2**70)], "priority"),
    (["--queue", ""], "queue"),
    (["--queue", "default\n"], "queue"),
    (["--key", "a\x01"], "idempotency_key"),
    (["--key", "k" * (MAX_KEY_LENGTH + 1)], "idempotency_key"),
    (["--kwargs", '{"a": NaN}'], "kwargs"),
    (["--kwargs", "[1]"], "kwargs"),
]


@pytest.mark.parametrize(("options", "field_"), CLI_BAD, ids=[" ".join(o) for o, _ in CLI_BAD])
def test_cli_enqueue_refuses_like_the_app(
    cli_app: tuple[str, str], options: list[str], field_: str
) -> None:
    """`tokenline enqueue` builds its job through the App: the same refusals, as a
    one-line error (an option's by the option) and exit status 2 for bad input, and
    nothing stored."""
    spec, url = cli_app
    result = cli("enqueue", "--app", spec, "--url", url, "t", "[1]", *options)
    assert result.exit_code == 2, result.output
    assert re.search(NAMES[field_], result.output), result.output
    with App(url) as app:
        assert _stored(app) == []


def test_cli_enqueue_refuses_arguments_that_are_not_exact_json(cli_app: tuple[str, str]) -> None:
    """Arguments given as JSON text are held to the same rules."""
    spec, url = cli_app
    result = cli("enqueue", "--app", spec, "--url", url, "t", "[NaN]")
    assert result.exit_code == 2, result.output
    assert "args" in result.output
    result = cli("enqueue", "--app", spec, "--url", url, "t", "[1]", "--priority", "7")
    assert result.exit_code == 0, result.output


def test_cli_enqueue_refuses_deeply_nested_args(cli_app: tuple[str, str]) -> None:
    """ARGS nested 10,000 deep is a one-line error, not a traceback."""
    spec, url = cli_app
    result = cli("enqueue", "--app", spec, "--url", url, "t", "[" * 10_000 + "]" * 10_000)
    assert result.exit_code == 2, result.output
    assert "args" in result.output


def listings_render(url: str, job_id: int) -> None:
    """Every listing of the store prints, and shows the job."""
    for command in (["jobs"], ["job", str(job_id)], ["dlq", "list"]):
        result = cli(*command, "--url", url)
        assert result.exception is None, (command, result.output, result.exception)
        assert result.exit_code == 0, (command, result.output)
        assert str(job_id) in result.output, (command, result.output)


def kill(url: str, job_id: int, error: str) -> None:
    """Make the job dead, with ``error`` as its reason, whatever its state and run_at."""
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:  # along the state machine: through running
        conn.execute("UPDATE tokenline_jobs SET state = 'running' WHERE id = ?", (job_id,))
        conn.execute(
            "UPDATE tokenline_jobs SET state = 'dead', last_error = ?, error_class = 'X', "
            "finished_at = ? WHERE id = ?",
            (error, time.time(), job_id),
        )
    conn.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(i=inputs(), error=st.text(max_size=80))
def test_cli_listings_render_every_accepted_job(tmp_path: Path, i: Inputs, error: str) -> None:
    """`tokenline jobs`, `tokenline job ID` and `tokenline dlq list` print every job the
    app accepted, dead with any reason, without crashing."""
    url = f"sqlite:///{tmp_path / f'{uuid.uuid4().hex[:8]}.db'}"
    with App(url, clock=FakeClock(NOW)) as app:
        _add_tasks(app)
        error_type, jid = _outcome(
            lambda: app.enqueue(i.task, *i.args, kwargs=i.kwargs, **i.options())
        )
    if error_type is not None:
        return  # refused: nothing stored, nothing to list
    kill(url, jid, error)
    listings_render(url, jid)


@pytest.mark.parametrize("ts", [1e12, 1e308, -1e12, -1e308, 253402300800.0])
def test_cli_listings_render_stored_times_out_of_range(tmp_path: Path, ts: float) -> None:
    """A store written before the limits (run_at 1e12 was accepted) still lists: times
    outside the calendar print as numbers; a key or reason that looks like markup prints
    as written."""
    url = f"sqlite:///{tmp_path / 'legacy.db'}"
    with App(url) as app:
        _add_tasks(app)
        jid = app.enqueue("t", "[/]", idempotency_key="legacy [/]")
    kill(url, jid, "gone [bold]")
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        conn.execute(
            "UPDATE tokenline_jobs SET run_at = ?, created_at = ?, finished_at = ?, "
            "lease_expires_at = ?, priority = ? WHERE id = ?",
            (ts, ts, ts, ts, 2**62, jid),
        )
    conn.close()
    listings_render(url, jid)


# -- PostgreSQL ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_app(postgres_server: str) -> Iterator[App]:
    """An app with two tasks on a fresh PostgreSQL schema, dropped afterwards."""
    import psycopg

    schema = f"tl_input_{uuid.uuid4().hex[:8]}"
    try:
        with App(f"{postgres_server}?schema={schema}") as app:
            yield _add_tasks(app)
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("case", "field_"), [(c[1], c[2]) for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_case_is_refused_on_postgres(pg_app: App, case: dict[str, Any], field_: str) -> None:
    """The same refusals on PostgreSQL: a tokenline error naming the field, not the
    server's 'integer out of range' or a driver error; nothing stored."""
    before = {j.id for j in _stored(pg_app)}
    with pytest.raises(InvalidInputError) as info:
        enqueue_case(pg_app, case)
    assert re.search(NAMES[field_], str(info.value)), info.value
    assert {j.id for j in _stored(pg_app)} == before


@pytest.mark.postgres
def test_values_at_the_limits_round_trip_on_postgres(pg_app: App) -> None:
    """PostgreSQL holds every value on the limits and gives it back exactly."""
    check_edges(pg_app, time.time())


@pytest.mark.postgres
def test_bad_batch_is_refused_on_postgres(pg_app: App) -> None:
    """A batch with one bad item stores nothing on PostgreSQL either."""
    before = {j.id for j in _stored(pg_app)}
    with pytest.raises(InvalidInputError, match=r"keys\[1\]"):
        pg_app.enqueue_many("t", [[1], [2]], keys=["ok", "a\x00"], priority=1)
    with pytest.raises(InvalidInputError, match="priority"):
        pg_app.enqueue_many("t", [[1], [2]], priority=2**40)
    assert {j.id for j in _stored(pg_app)} == before


@pytest.mark.parametrize("outcome", [Outcome.RETRY, Outcome.RELEASE])
@pytest.mark.parametrize("delay", [1e12, 1e308, MAX_DELAY + 1])
def test_a_retry_waits_at_most_max_delay(outcome: Outcome, delay: float) -> None:
    """A retry or release delay is held to the enqueue's limit, whatever built it: no
    store is asked to keep a time more than MAX_DELAY ahead."""
    move = finish_transition(Finish(Lease(1, "w", 1, 0.0), outcome, delay))
    assert move.delay == MAX_DELAY
