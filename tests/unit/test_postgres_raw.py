"""Long PostgreSQL statements converted once to ``$n`` form (``stores/postgres/_raw.py``)."""

from __future__ import annotations

import pytest

from tokenline._errors import StoreError
from tokenline.stores.postgres._raw import RawStatement, needs_raw
from tokenline.stores.postgres.store import PostgresStore


def test_names_become_numbers_in_order_of_first_use() -> None:
    """Each name is one parameter, numbered where it first appears; a doubled percent
    sign is a literal one, as psycopg reads it."""
    raw = RawStatement.convert("SELECT %(b)s, %(a)s, %(b)s::int WHERE x LIKE 'a%%' AND y = %(c)s")
    assert raw.text == b"SELECT $1, $2, $1::int WHERE x LIKE 'a%' AND y = $3"
    assert raw.names == ("b", "a", "c")
    assert raw.params({"a": 1, "b": 2, "c": 3, "unused": 4}) == [2, 1, 3]


def test_a_lone_percent_sign_and_a_missing_parameter_are_errors() -> None:
    """What psycopg would refuse is refused here too, with the offset or the name."""
    with pytest.raises(StoreError, match="offset 9"):
        RawStatement.convert("SELECT 1 % 2")
    with pytest.raises(StoreError, match="'a'"):
        RawStatement.convert("SELECT %(a)s").params({})


def test_the_fused_finish_and_claim_is_sent_raw_with_every_parameter() -> None:
    """The finish fused with a claim is too long for psycopg's cache of converted
    statements, so it goes raw; its names are exactly those the store passes."""
    store = PostgresStore("postgresql://u@localhost/db")
    text = store._claim_text(1, fused=True)
    assert needs_raw(text)
    raw = RawStatement.convert(text)
    assert b"%(" not in raw.text
    finish = store._finish_params([])
    claim = store._claim_params("w", ["q"], 1, 30.0, None)
    assert set(raw.names) <= {*finish, *claim}
    assert not needs_raw(store._q("finish"))


def test_the_length_limit_is_psycopgs() -> None:
    """The copy of psycopg's cache limit is the installed psycopg's own value."""
    import psycopg._queries

    from tokenline.stores.postgres import _raw

    assert psycopg._queries.MAX_CACHED_STATEMENT_LENGTH == _raw.MAX_CACHED_STATEMENT_LENGTH
