"""Unit-test fixtures: isolate every test from the caller's ``TOKENLINE_*`` environment."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_tokenline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove ``TOKENLINE_*`` variables so settings come only from what a test sets."""
    for name in list(os.environ):
        if name.startswith("TOKENLINE_"):
            monkeypatch.delenv(name)
