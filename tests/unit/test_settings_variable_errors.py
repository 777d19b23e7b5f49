"""An App setting read from a ``TOKENLINE_…`` variable is refused naming the variable
and its text, as the command line names it: that variable is what the reader fixes."""

from __future__ import annotations

import pytest

from tokenline import App, ConfigError
from tokenline._config import Settings, WorkerSettings, load_settings


@pytest.mark.parametrize(
    ("raw", "reason"),
    [("abc", "cannot read 'abc' as int"), ("0", "must be a whole number from 1 to")],
)
def test_app_names_the_variable_of_a_bad_setting(
    monkeypatch: pytest.MonkeyPatch, raw: str, reason: str
) -> None:
    """App() said only "invalid setting 'max_attempts': …", leaving the reader to guess
    where the value came from."""
    monkeypatch.setenv("TOKENLINE_MAX_ATTEMPTS", raw)
    with pytest.raises(ConfigError) as info:
        App("memory://")
    assert str(info.value).startswith(
        f"TOKENLINE_MAX_ATTEMPTS={raw!r} is invalid (setting max_attempts): {reason}"
    )
    assert info.value.setting == "max_attempts"
    assert info.value.reason.startswith(reason)


def test_a_setting_checked_against_another_names_its_variable() -> None:
    """A value refused for what another setting is (retry_cap under retry_base) names
    the variable it was read from."""
    with pytest.raises(ConfigError) as info:
        load_settings(Settings, environ={"TOKENLINE_RETRY_CAP": "0.5"})
    assert str(info.value) == (
        "TOKENLINE_RETRY_CAP='0.5' is invalid (setting retry_cap): must be >= retry_base"
    )


def test_worker_settings_name_their_variable_too() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={"TOKENLINE_CONCURRENCY": "0"})
    assert str(info.value).startswith("TOKENLINE_CONCURRENCY='0' is invalid (setting concurrency)")


def test_a_value_not_from_a_variable_names_no_variable() -> None:
    """An argument overrides the variable: the error is about the argument, so it names
    no variable."""
    with pytest.raises(ConfigError) as info:
        load_settings(Settings, {"max_attempts": 0}, environ={"TOKENLINE_MAX_ATTEMPTS": "3"})
    assert str(info.value).startswith("invalid setting 'max_attempts': must be a whole number")


def test_a_long_value_is_shown_cut() -> None:
    raw = "9" * 500
    with pytest.raises(ConfigError) as info:
        load_settings(Settings, environ={"TOKENLINE_MAX_ATTEMPTS": raw})
    assert str(info.value).startswith("TOKENLINE_MAX_ATTEMPTS='99999")
    assert len(str(info.value)) < 300
