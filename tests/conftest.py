"""Shared fixtures: the fake clock and store factories for every backend."""

from __future__ import annotations

import os

import pytest

from tokenline._clock import FakeClock

#: In CI a missing service is a failure, never a skip.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test advances it."""
    return FakeClock()
