"""encode_fields must be injective: different field tuples never share an encoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import ValidationError
from common.crypto.encoding import encode_fields

fields = st.lists(
    st.one_of(st.binary(max_size=12), st.text(max_size=6), st.integers(0, 2**70)), max_size=5
)


def _typed(values: list[bytes | str | int]) -> list[tuple[str, bytes | str | int]]:
    return [(type(v).__name__, v) for v in values]


def test_concatenation_ambiguity_is_resolved() -> None:
    assert encode_fields("ab", "c") != encode_fields("a", "bc")
    assert encode_fields(b"ab", b"c") != encode_fields(b"a", b"bc")
    assert encode_fields("a") != encode_fields(b"a")
    assert encode_fields(1) != encode_fields(b"\x01")
    assert encode_fields() == b""


def test_layout_is_tag_length_payload() -> None:
    assert encode_fields(b"xy", "é", 256, 0) == (
        b"\x01\x00\x00\x00\x02xy"
        + b"\x02\x00\x00\x00\x02\xc3\xa9"
        + b"\x03\x00\x00\x00\x02\x01\x00"
        + b"\x03\x00\x00\x00\x00"
    )


@settings(max_examples=60, deadline=None)
@given(fields, fields)
def test_injective(first: list[bytes | str | int], second: list[bytes | str | int]) -> None:
    if _typed(first) != _typed(second):
        assert encode_fields(*first) != encode_fields(*second)
    else:
        assert encode_fields(*first) == encode_fields(*second)


@pytest.mark.parametrize("bad", [-1, True, 1.5, None, ["a"]])
def test_rejects_unencodable_fields(bad: object) -> None:
    with pytest.raises(ValidationError):
        encode_fields("ok", bad)  # type: ignore[arg-type]
