"""The worker state machine: the transition table is the whole truth."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.worker.state import (
    TRANSITIONS,
    InvalidTransitionError,
    WorkerEvent,
    WorkerState,
    next_state,
)

ALL_PAIRS = list(itertools.product(WorkerState, WorkerEvent))
INVALID_PAIRS = [pair for pair in ALL_PAIRS if pair not in TRANSITIONS]


def _pair_id(pair: tuple[WorkerState, WorkerEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


@pytest.mark.parametrize(
    ("pair", "target"), list(TRANSITIONS.items()), ids=[_pair_id(p) for p in TRANSITIONS]
)
def test_allowed_transition_leads_where_the_table_says(
    pair: tuple[WorkerState, WorkerEvent], target: WorkerState
) -> None:
    """Each (state, event) pair in the table moves the worker to the listed state."""
    state, event = pair
    assert next_state(state, event) is target


@pytest.mark.parametrize("pair", INVALID_PAIRS, ids=[_pair_id(p) for p in INVALID_PAIRS])
def test_pair_outside_the_table_is_rejected(pair: tuple[WorkerState, WorkerEvent]) -> None:
    """An event the table does not list for a state raises InvalidTransitionError naming both."""
    state, event = pair
    with pytest.raises(InvalidTransitionError) as info:
        next_state(state, event)
    assert event.value in str(info.value)
    assert state.value in str(info.value)


def test_table_and_complement_cover_every_pair() -> None:
    """The valid and invalid pairs partition the full product, so no pair goes untested."""
    assert len(TRANSITIONS) + len(INVALID_PAIRS) == len(ALL_PAIRS)
    assert INVALID_PAIRS, "some pairs must be invalid, or the table guards nothing"


def test_every_state_can_be_force_stopped() -> None:
    """FORCE_STOP reaches STOPPED from any state: a second shutdown always ends the worker."""
    for state in WorkerState:
        assert next_state(state, WorkerEvent.FORCE_STOP) is WorkerState.STOPPED


@pytest.mark.parametrize("state", list(WorkerState), ids=[s.value for s in WorkerState])
def test_may_fetch_only_when_ready_or_processing(state: WorkerState) -> None:
    """Only READY and PROCESSING workers may claim new jobs."""
    expected = state in (WorkerState.READY, WorkerState.PROCESSING)
    assert state.may_fetch is expected


def _walk(start: WorkerState, events: list[WorkerEvent]) -> list[tuple[WorkerEvent, WorkerState]]:
    """Apply ``events`` from ``start``, skipping invalid ones; return the accepted steps."""
    state = start
    steps = []
    for event in events:
        try:
            state = next_state(state, event)
        except InvalidTransitionError:
            continue
        steps.append((event, state))
    return steps


@given(
    start=st.sampled_from(list(WorkerState)),
    events=st.lists(st.sampled_from(list(WorkerEvent)), max_size=60),
)
def test_stopped_is_absorbing(start: WorkerState, events: list[WorkerEvent]) -> None:
    """Once a worker reaches STOPPED, no sequence of events takes it anywhere else."""
    seen_stopped = start is WorkerState.STOPPED
    for _event, state in _walk(start, events):
        if seen_stopped:
            assert state is WorkerState.STOPPED
        seen_stopped = seen_stopped or state is WorkerState.STOPPED


@given(
    start=st.sampled_from(list(WorkerState)),
    events=st.lists(st.sampled_from(list(WorkerEvent)), max_size=60),
)
def test_fenced_worker_returns_to_ready_only_by_reregistering(
    start: WorkerState, events: list[WorkerEvent]
) -> None:
    """A FENCED worker becomes READY again only through REREGISTERED, never any other event."""
    state = start
    for event in events:
        try:
            new = next_state(state, event)
        except InvalidTransitionError:
            continue
        if state is WorkerState.FENCED and new is WorkerState.READY:
            assert event is WorkerEvent.REREGISTERED
        if state is WorkerState.FENCED:
            assert new in (WorkerState.FENCED, WorkerState.READY, WorkerState.STOPPED)
        state = new


def test_fenced_worker_can_fetch_again_after_reregistering() -> None:
    """The documented recovery path exists: FENCED --REREGISTERED--> READY, which may fetch."""
    state = next_state(WorkerState.PROCESSING, WorkerEvent.LEASE_LOST)
    assert state is WorkerState.FENCED
    assert not state.may_fetch
    state = next_state(state, WorkerEvent.REREGISTERED)
    assert state is WorkerState.READY
    assert state.may_fetch
