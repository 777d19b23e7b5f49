"""Passwords in store URLs never reach tokenline's output (``_redact.py``)."""

from __future__ import annotations

import pytest

from tokenline import App, ConfigError, StoreError
from tokenline._redact import redact


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://app:S3cret@db:5432/prod", "postgresql://app:***@db:5432/prod"),
        ("redis://:S3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("postgresql://app:p%40ss@db/prod", "postgresql://app:***@db/prod"),
        (
            "postgresql://db/prod?sslmode=require&password=S3cret",
            "postgresql://db/prod?sslmode=require&password=***",
        ),
        (
            "split:?broker=redis://default:R3dis@r:6379/0%3Fprefix%3Dx"
            "&ledger=postgresql://app:S3cret@db/prod",
            "split:?broker=redis://default:***@r:6379/0%3Fprefix%3Dx"
            "&ledger=postgresql://app:***@db/prod",
        ),
        (
            "split:?ledger=postgresql%3A%2F%2Fapp%3AS3c%2540ret%40db%2Fprod",
            "split:?ledger=postgresql%3A%2F%2Fapp%3A***%40db%2Fprod",
        ),
        # Nothing to hide: left as it is.
        ("postgresql://app@db/prod", "postgresql://app@db/prod"),
        ("sqlite:///var/lib/q.db", "sqlite:///var/lib/q.db"),
        ("write to ops@example.com", "write to ops@example.com"),
    ],
)
def test_a_url_password_is_shown_as_stars(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert "S3c" not in redact(text)
    assert "R3dis" not in redact(text)


def test_no_tokenline_error_shows_a_password() -> None:
    """An error quoting the URL it refuses printed the password with it (the dashboard
    given a Redis URL, a bad split URL)."""
    with pytest.raises(ConfigError) as refused:
        App("redis://default:R3dis@127.0.0.1:6379/13?prefix=x").open_store()
    assert "R3dis" not in str(refused.value)
    assert "redis://default:***@127.0.0.1:6379/13" in str(refused.value)
    assert "R3dis" not in str(StoreError("cannot reach postgresql://app:R3dis@db/prod"))
    assert "R3dis" not in repr(App("postgresql://app:R3dis@db/prod"))
