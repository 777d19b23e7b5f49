"""Settings: named defaults, validation naming the setting, and load precedence."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tokenline import DEFAULT_URL, ConfigError, Settings, WorkerSettings, load_settings
from tokenline._config import MAX_CLAIM_BATCH, MAX_CONCURRENCY, MAX_LEASE_TTL, MIN_LEASE_TTL


def test_default_settings_are_valid() -> None:
    """Settings() builds with the documented defaults, starting with the SQLite URL."""
    s = Settings()
    assert s.url == DEFAULT_URL == "sqlite:///tokenline.db"
    assert s.max_attempts >= 1
    assert 0 < s.retry_base <= s.retry_cap


def test_default_worker_settings_are_valid() -> None:
    """WorkerSettings() builds and its derived timeouts follow the TTL."""
    w = WorkerSettings()
    assert w.queues == ("default",)
    assert w.renew_period * 3 <= w.lease_ttl
    assert w.call_timeout == pytest.approx(w.lease_ttl / 3)
    assert w.margin == pytest.approx(w.lease_ttl / 10)
    assert w.local_fencing is True


def test_explicit_store_timeout_and_margin_are_used() -> None:
    """Explicit store_timeout and lease_margin replace the derived defaults."""
    w = WorkerSettings(lease_ttl=30, renew_interval=5, store_timeout=2.0, lease_margin=4.0)
    assert w.call_timeout == 2.0
    assert w.margin == 4.0


INVALID_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("url", {"url": ""}),
    ("url", {"url": None}),
    ("max_payload_bytes", {"max_payload_bytes": 0}),
    ("max_payload_bytes", {"max_payload_bytes": 1.5}),
    ("max_payload_bytes", {"max_payload_bytes": True}),
    ("max_attempts", {"max_attempts": 0}),
    ("max_attempts", {"max_attempts": -3}),
    ("max_attempts", {"max_attempts": True}),
    ("retry_base", {"retry_base": 0}),
    ("retry_base", {"retry_base": -1.0}),
    ("retry_base", {"retry_base": math.nan}),
    ("retry_base", {"retry_base": math.inf}),
    ("retry_base", {"retry_base": True}),
    ("retry_base", {"retry_base": "1"}),
    ("retry_cap", {"retry_cap": 0.5, "retry_base": 1.0}),
    ("retry_cap", {"retry_cap": math.nan}),
    ("store_timeout", {"store_timeout": 0}),
    ("store_timeout", {"store_timeout": math.nan}),
    ("store_timeout", {"store_timeout": False}),
]


@pytest.mark.parametrize(
    ("setting", "kwargs"), INVALID_SETTINGS, ids=[f"{s}={k}" for s, k in INVALID_SETTINGS]
)
def test_invalid_app_setting_names_the_setting(setting: str, kwargs: dict[str, Any]) -> None:
    """Each invalid Settings value raises ConfigError whose .setting and message name it."""
    with pytest.raises(ConfigError) as info:
        Settings(**kwargs)
    assert info.value.setting == setting
    assert repr(setting) in str(info.value)


INVALID_WORKER_SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("queues", {"queues": ()}),
    ("queues", {"queues": ""}),
    ("queues", {"queues": ("ok", "has space")}),
    ("queues", {"queues": ("x" * 65,)}),
    ("queues", {"queues": ("",)}),
    ("queues", {"queues": ("a/b",)}),
    ("queues", {"queues": (1,)}),
    ("concurrency", {"concurrency": 0}),
    ("concurrency", {"concurrency": 2.0}),
    ("concurrency", {"concurrency": True}),
    ("lease_ttl", {"lease_ttl": 0}),
    ("lease_ttl", {"lease_ttl": -30}),
    ("lease_ttl", {"lease_ttl": math.nan}),
    ("lease_ttl", {"lease_ttl": True}),
    ("renew_interval", {"renew_interval": 0}),
    ("renew_interval", {"renew_interval": math.nan}),
    ("renew_interval", {"lease_ttl": 30, "renew_interval": 10.5}),
    ("renew_interval", {"lease_ttl": 30, "renew_interval": 15}),
    ("poll_interval", {"poll_interval": 0}),
    ("poll_interval", {"poll_interval": True}),
    ("job_timeout", {"job_timeout": -1}),
    ("job_timeout", {"job_timeout": math.inf}),
    ("drain_timeout", {"drain_timeout": math.nan}),
    ("rescue_interval", {"rescue_interval": 0.0}),
    ("rescue_interval", {"rescue_interval": -5}),
    ("rescue_interval", {"rescue_interval": math.nan}),
    ("reconcile_interval", {"reconcile_interval": 0}),
    ("reconcile_interval", {"reconcile_interval": -1.0}),
    ("reconcile_interval", {"reconcile_interval": math.nan}),
    ("effect_pending_deadline", {"effect_pending_deadline": 0}),
    ("effect_pending_deadline", {"lease_ttl": 30, "effect_pending_deadline": 29}),
    ("lease_margin", {"lease_margin": 0}),
    ("lease_margin", {"lease_margin": math.nan}),
    ("lease_margin", {"lease_ttl": 30, "renew_interval": 10, "lease_margin": 20}),
    ("lease_margin", {"lease_ttl": 30, "renew_interval": 10, "lease_margin": 25}),
    ("store_timeout", {"store_timeout": 0}),
    ("store_timeout", {"lease_ttl": 30, "store_timeout": 30}),
    ("store_timeout", {"lease_ttl": 30, "store_timeout": 45}),
    ("claim_batch", {"claim_batch": 0}),
    ("claim_batch", {"claim_batch": True}),
    ("claim_batch", {"claim_batch": 2.5}),
    ("prefetch", {"prefetch": -1}),
    ("prefetch", {"prefetch": True}),
    ("prefetch", {"prefetch": 1.5}),
    ("prefetch", {"prefetch": 1001}),
    ("prefetch", {"prefetch": "Auto"}),
    ("prefetch", {"prefetch": "8"}),
    ("prefetch", {"prefetch": None}),
]


@pytest.mark.parametrize(
    ("setting", "kwargs"),
    INVALID_WORKER_SETTINGS,
    ids=[f"{s}={k}" for s, k in INVALID_WORKER_SETTINGS],
)
def test_invalid_worker_setting_names_the_setting(setting: str, kwargs: dict[str, Any]) -> None:
    """Each invalid WorkerSettings value raises ConfigError whose .setting names it."""
    with pytest.raises(ConfigError) as info:
        WorkerSettings(**kwargs)
    assert info.value.setting == setting
    assert repr(setting) in str(info.value)


@pytest.mark.parametrize(
    ("lease_ttl", "period"), [(30.0, 10.0), (3.0, 1.0), (0.6, 0.2), (60.0, 10.0), (300.0, 10.0)]
)
def test_renew_interval_left_out_follows_the_ttl(lease_ttl: float, period: float) -> None:
    """Without renew_interval, a TTL shorter than the default's three renewals builds:
    the period is a third of the TTL, and never longer than the default's 10 s."""
    w = WorkerSettings(lease_ttl=lease_ttl)
    assert w.renew_interval is None
    assert w.renew_period == pytest.approx(period)
    assert w.margin < w.lease_ttl - w.renew_period


def test_renew_interval_left_out_of_every_source_follows_the_ttl() -> None:
    """The same through load_settings, as the worker command builds its settings."""
    w = load_settings(WorkerSettings, {"lease_ttl": 4.5, "renew_interval": None}, environ={})
    assert w.renew_period == pytest.approx(1.5)
    env = {"TOKENLINE_LEASE_TTL": "6", "TOKENLINE_RENEW_INTERVAL": "1.5"}
    assert load_settings(WorkerSettings, environ=env).renew_period == 1.5


def test_renew_interval_error_explains_the_rule() -> None:
    """The renew_interval error states the lease_ttl / 3 limit and the value given."""
    with pytest.raises(ConfigError, match=r"lease_ttl / 3 \(10s\).*got 12s"):
        WorkerSettings(lease_ttl=30, renew_interval=12)


@pytest.mark.parametrize(
    ("lease_ttl", "renew_interval"),
    [(30.0, 10.0), (3.0, 1.0), (0.9, 0.3), (0.6, 0.2), (3.3, 1.1)],
)
def test_renew_interval_of_exactly_a_third_of_the_ttl_is_accepted(
    lease_ttl: float, renew_interval: float
) -> None:
    """renew_interval == lease_ttl / 3 is allowed ("at most"), also for decimal fractions."""
    w = WorkerSettings(lease_ttl=lease_ttl, renew_interval=renew_interval)
    assert w.renew_interval == w.renew_period == renew_interval


def test_queues_from_a_comma_separated_string() -> None:
    """A queues string is split on commas, empty parts dropped."""
    assert WorkerSettings(queues="a,b,,c").queues == ("a", "b", "c")  # type: ignore[arg-type]


def test_settings_are_frozen() -> None:
    """Settings cannot be changed after validation."""
    s = WorkerSettings()
    with pytest.raises(AttributeError):
        s.lease_ttl = 1.0  # type: ignore[misc]


# -- load_settings --------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokenline.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_load_settings_without_sources_gives_defaults() -> None:
    """With no file, an empty environment and no overrides, load_settings gives the defaults."""
    assert load_settings(WorkerSettings, environ={}) == WorkerSettings()
    assert load_settings(Settings, environ={}) == Settings()


def test_precedence_overrides_then_env_then_file(tmp_path: Path) -> None:
    """Overrides beat TOKENLINE_* variables, which beat the TOML file, which beats defaults."""
    path = _toml(
        tmp_path,
        '[tokenline]\nconcurrency = 2\npoll_interval = 0.5\njob_timeout = 9.0\nqueues = ["f"]\n',
    )
    env = {"TOKENLINE_CONCURRENCY": "3", "TOKENLINE_POLL_INTERVAL": "0.25"}
    w = load_settings(WorkerSettings, {"concurrency": 4}, environ=env, file=path)
    assert w.concurrency == 4  # override > env > file
    assert w.poll_interval == 0.25  # env > file
    assert w.job_timeout == 9.0  # file > default
    assert w.queues == ("f",)  # TOML list becomes a tuple
    assert w.drain_timeout == WorkerSettings().drain_timeout  # default


def test_env_beats_file_without_overrides(tmp_path: Path) -> None:
    """Without an override, the environment value wins over the file's."""
    path = _toml(tmp_path, "[tokenline]\nconcurrency = 2\n")
    w = load_settings(WorkerSettings, environ={"TOKENLINE_CONCURRENCY": "3"}, file=path)
    assert w.concurrency == 3


def test_none_override_does_not_mask_lower_sources() -> None:
    """An override of None (an unset CLI option) leaves the environment value in place."""
    w = load_settings(WorkerSettings, {"concurrency": None}, environ={"TOKENLINE_CONCURRENCY": "7"})
    assert w.concurrency == 7


def test_empty_env_value_is_ignored() -> None:
    """TOKENLINE_X set to an empty string counts as unset."""
    w = load_settings(WorkerSettings, environ={"TOKENLINE_CONCURRENCY": ""})
    assert w.concurrency == WorkerSettings().concurrency


def test_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without environ=, load_settings reads os.environ."""
    monkeypatch.setenv("TOKENLINE_MAX_ATTEMPTS", "11")
    assert load_settings(Settings).max_attempts == 11


def test_unknown_override_is_an_error() -> None:
    """An override key that is no setting raises ConfigError naming the key."""
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, {"concurrencyy": 3}, environ={})
    assert info.value.setting == "concurrencyy"


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    """An unknown key in the file's [tokenline] table raises ConfigError naming it and the file."""
    path = _toml(tmp_path, "[tokenline]\nconcurrency = 2\nlease_tll = 30\n")
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={}, file=path)
    assert info.value.setting == "lease_tll"
    assert str(path) in str(info.value)


def test_key_of_the_other_settings_class_is_unknown(tmp_path: Path) -> None:
    """A worker setting in the table read for Settings is refused, not silently dropped."""
    path = _toml(tmp_path, "[tokenline]\nconcurrency = 2\n")
    with pytest.raises(ConfigError) as info:
        load_settings(Settings, environ={}, file=path)
    assert info.value.setting == "concurrency"


def test_file_section_can_be_nested(tmp_path: Path) -> None:
    """A dotted section name reads a nested table such as [tool.tokenline]."""
    path = _toml(tmp_path, "[tool.tokenline]\nmax_attempts = 9\n")
    s = load_settings(Settings, environ={}, file=path, section="tool.tokenline")
    assert s.max_attempts == 9


def test_missing_section_gives_defaults(tmp_path: Path) -> None:
    """A tokenline file without the section contributes nothing."""
    path = _toml(tmp_path, "[tokenline]\nmax_attempts = 3\n")
    assert load_settings(WorkerSettings, environ={}, file=path, section="tokenline.worker") == (
        WorkerSettings()
    )


def test_a_file_with_no_tokenline_table_is_an_error(tmp_path: Path) -> None:
    """A file holding only other tables would take no effect: it is refused, saying so."""
    path = _toml(tmp_path, "[other]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"has no \[tokenline\] table") as info:
        load_settings(Settings, environ={}, file=path)
    assert info.value.setting == "config"


def test_invalid_value_in_file_names_the_setting(tmp_path: Path) -> None:
    """A value of the wrong type in the file fails validation naming the setting."""
    path = _toml(tmp_path, '[tokenline]\nconcurrency = "four"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={}, file=path)
    assert info.value.setting == "concurrency"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A config file that does not exist raises ConfigError naming the path."""
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_settings(Settings, environ={}, file=missing)
    assert info.value.setting == "config"
    assert str(missing) in str(info.value)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    """A file that is not valid TOML raises ConfigError, not a tomllib exception."""
    path = _toml(tmp_path, "[tokenline\nconcurrency = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_settings(Settings, environ={}, file=path)
    assert info.value.setting == "config"


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("concurrency", "abc"),
        ("concurrency", "2.5"),
        ("lease_ttl", "thirty"),
        ("local_fencing", "maybe"),
        ("lease_margin", "soon"),
    ],
)
def test_bad_env_value_names_the_setting(name: str, raw: str) -> None:
    """A TOKENLINE_* value that cannot be read raises ConfigError naming the setting and value."""
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={f"TOKENLINE_{name.upper()}": raw})
    assert info.value.setting == name
    assert repr(raw) in str(info.value)


def test_bad_env_value_for_app_settings_names_the_setting() -> None:
    """TOKENLINE_MAX_PAYLOAD_BYTES=big raises ConfigError naming max_payload_bytes."""
    with pytest.raises(ConfigError) as info:
        load_settings(Settings, environ={"TOKENLINE_MAX_PAYLOAD_BYTES": "big"})
    assert info.value.setting == "max_payload_bytes"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ],
)
def test_env_bool_parsing(raw: str, expected: bool) -> None:
    """Boolean settings accept 1/0, true/false, yes/no, on/off in any case."""
    w = load_settings(WorkerSettings, environ={"TOKENLINE_LOCAL_FENCING": raw})
    assert w.local_fencing is expected


def test_env_queues_from_comma_list() -> None:
    """TOKENLINE_QUEUES is a comma list; spaces around names and empty parts are dropped."""
    w = load_settings(WorkerSettings, environ={"TOKENLINE_QUEUES": " billing, mail ,,reports"})
    assert w.queues == ("billing", "mail", "reports")


def test_env_queues_with_bad_name_is_a_config_error() -> None:
    """An invalid queue name in TOKENLINE_QUEUES raises ConfigError naming queues."""
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={"TOKENLINE_QUEUES": "ok,not ok"})
    assert info.value.setting == "queues"


def test_env_optional_float_setting_is_read() -> None:
    """Settings whose default is None (lease_margin, store_timeout) are read as numbers."""
    w = load_settings(
        WorkerSettings,
        environ={"TOKENLINE_LEASE_MARGIN": "1.5", "TOKENLINE_STORE_TIMEOUT": "2"},
    )
    assert w.lease_margin == 1.5
    assert w.store_timeout == 2.0


def test_env_claim_batch_is_read_as_an_integer() -> None:
    """TOKENLINE_CLAIM_BATCH=5 sets claim_batch to the whole number 5."""
    w = load_settings(WorkerSettings, environ={"TOKENLINE_CLAIM_BATCH": "5"})
    assert w.claim_batch == 5
    assert isinstance(w.claim_batch, int)


def test_prefetch_is_auto_by_default() -> None:
    """A worker follows its handlers' run times unless told a number of jobs."""
    assert WorkerSettings().prefetch == "auto"
    assert load_settings(WorkerSettings, environ={}).prefetch == "auto"


@pytest.mark.parametrize(("raw", "expected"), [("auto", "auto"), (" AUTO ", "auto"), ("8", 8)])
def test_env_prefetch_is_auto_or_a_whole_number(raw: str, expected: object) -> None:
    """TOKENLINE_PREFETCH reads as ``"auto"`` (any case) or a whole number."""
    assert load_settings(WorkerSettings, environ={"TOKENLINE_PREFETCH": raw}).prefetch == expected


@pytest.mark.parametrize("raw", ["eight", "2.5", "-1", "1001"])
def test_bad_env_prefetch_names_the_setting_and_what_it_takes(raw: str) -> None:
    """An unreadable or out-of-range TOKENLINE_PREFETCH names the setting and the value."""
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={"TOKENLINE_PREFETCH": raw})
    assert info.value.setting == "prefetch"
    assert raw in str(info.value)


def test_prefetch_from_a_file_is_auto_or_a_number(tmp_path: Path) -> None:
    """``prefetch = "auto"`` and ``prefetch = 4`` in the TOML file are both taken."""
    for text, expected in (('"auto"', "auto"), ("4", 4)):
        path = tmp_path / "w.toml"
        path.write_text(f"[tokenline.worker]\nprefetch = {text}\n", encoding="utf-8")
        assert load_settings(WorkerSettings, file=path, section="tokenline.worker").prefetch == (
            expected
        )


def test_env_url_is_read_as_text() -> None:
    """TOKENLINE_URL is taken verbatim."""
    s = load_settings(Settings, environ={"TOKENLINE_URL": "postgresql://db/jobs"})
    assert s.url == "postgresql://db/jobs"


def test_bad_env_value_for_optional_setting_says_what_was_expected() -> None:
    """An unreadable value for a setting defaulting to None says a number was expected."""
    with pytest.raises(ConfigError) as info:
        load_settings(WorkerSettings, environ={"TOKENLINE_LEASE_MARGIN": "soon"})
    assert "NoneType" not in str(info.value)
    assert "float" in str(info.value) or "number" in str(info.value)


#: Values out of each setting's range: the constructor's value, and the same as a
#: TOKENLINE_* environment variable's text (None: no text reads as that value).
OUT_OF_RANGE: list[tuple[type[Any], str, Any, str | None]] = [
    (WorkerSettings, "lease_ttl", 0.001, "0.001"),
    (WorkerSettings, "lease_ttl", 1e6, "1e6"),
    (WorkerSettings, "concurrency", 10**9, "1000000000"),
    (WorkerSettings, "claim_batch", 10**6, "1000000"),
    (WorkerSettings, "queues", ("a", "b", "a"), "a,b,a"),
    (WorkerSettings, "queues", 5, None),
    (WorkerSettings, "local_fencing", 1, None),
    (WorkerSettings, "local_fencing", "no", None),
    (WorkerSettings, "poll_interval", 1e7, "1e7"),
    (WorkerSettings, "rescue_interval", math.inf, "inf"),
    (WorkerSettings, "job_timeout", 1e300, "1e300"),
    (WorkerSettings, "job_timeout", 10**400, None),
    (WorkerSettings, "prune_batch", 10**7, "10000000"),
    (WorkerSettings, "pause_min_jobs", 10**7, "10000000"),
    (WorkerSettings, "periodic_interval", math.nan, "nan"),
    (Settings, "migrate", 0, None),
    (Settings, "migrate", "no", None),
    (Settings, "max_payload_bytes", 10**12, "1000000000000"),
    (Settings, "max_attempts", 2**31, "2147483648"),
    (Settings, "retry_cap", 1e300, "1e300"),
    (Settings, "store_timeout", 1e6, "1e6"),
    (Settings, "broker", 5, None),
]


@pytest.mark.parametrize(
    ("cls", "setting", "value", "text"),
    OUT_OF_RANGE,
    ids=[f"{c.__name__}.{s}={v!r:.20}" for c, s, v, _ in OUT_OF_RANGE],
)
def test_a_value_out_of_range_is_refused_naming_the_setting(
    cls: type[Any], setting: str, value: Any, text: str | None
) -> None:
    """Types and ranges are checked: a TTL of a millisecond, a concurrency of a billion,
    a queue listed twice or 1 for a flag is a ConfigError naming the setting."""
    with pytest.raises(ConfigError) as info:
        cls(**{setting: value})
    assert info.value.setting == setting


@pytest.mark.parametrize(
    ("cls", "setting", "value", "text"),
    [case for case in OUT_OF_RANGE if case[3] is not None],
    ids=[f"{c.__name__}.{s}={t}" for c, s, _, t in OUT_OF_RANGE if t is not None],
)
def test_the_same_value_from_the_environment_is_refused(
    cls: type[Any], setting: str, value: Any, text: str
) -> None:
    """TOKENLINE_* variables go through the same checks as the constructor."""
    with pytest.raises(ConfigError) as info:
        load_settings(cls, environ={f"TOKENLINE_{setting.upper()}": text})
    assert info.value.setting == setting


def test_a_range_error_says_the_range() -> None:
    """The message gives the allowed range, so the fix is obvious."""
    with pytest.raises(ConfigError, match=r"from 0\.5 to 86400, got 0\.001"):
        WorkerSettings(lease_ttl=0.001)
    with pytest.raises(ConfigError, match=f"from 1 to {MAX_CONCURRENCY}"):
        WorkerSettings(concurrency=10**9)
    with pytest.raises(ConfigError, match="'a' more than once"):
        WorkerSettings(queues=("a", "b", "a"))


def test_the_limits_themselves_are_accepted() -> None:
    """Each range includes its ends; a list of queues is kept as a tuple."""
    w = WorkerSettings(
        lease_ttl=MIN_LEASE_TTL,
        concurrency=MAX_CONCURRENCY,
        claim_batch=MAX_CLAIM_BATCH,
        queues=["a", "b"],  # type: ignore[arg-type]
    )
    assert w.queues == ("a", "b")
    longest = WorkerSettings(lease_ttl=MAX_LEASE_TTL, effect_pending_deadline=MAX_LEASE_TTL)
    assert longest.lease_ttl == MAX_LEASE_TTL
    assert Settings(migrate=False).migrate is False


def test_a_misspelt_variable_is_warned_of_once_and_others_are_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``TOKENLINE_MAX_ATTEMTPS=3`` left max_attempts at its default without a word. A
    variable close to one tokenline reads is now named with the one meant, once per
    process; every variable tokenline reads, and others of the environment's own under
    the prefix, are left alone."""
    import logging

    env = {
        "TOKENLINE_RETRY_BASE": "1",
        "TOKENLINE_DASHBOARD_TOKEN": "secret",
        "TOKENLINE_EXPORTER_PORT": "9000",
        "TOKENLINE_DRILL_SEED": "7",
        "TOKENLINE_MAX_ATTEMPTTS": "3",
        "TOKENLINE_TEST_POSTGRES_URL": "postgresql://db/test",
        "TOKENLINE_OUR_OWN_FLAG": "1",
    }
    with caplog.at_level(logging.WARNING, logger="tokenline.config"):
        for _ in range(2):
            assert load_settings(Settings, environ=env).max_attempts == Settings().max_attempts
            load_settings(WorkerSettings, environ=env)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == (
        "environment variable TOKENLINE_MAX_ATTEMPTTS is not one tokenline reads, and is "
        "ignored: did you mean TOKENLINE_MAX_ATTEMPTS?"
    )
