"""The object encoding alone: every plain value round-trips exactly; bad bytes are one line."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradmesh.collectives.objects import decode, encode
from gradmesh.errors import GradmeshError

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
)
keys = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text() | st.binary()
hashable = keys | st.tuples(keys, keys)  # what a set holds
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(keys, inner, max_size=4)
        | st.sets(hashable, max_size=4)
        | st.frozensets(hashable, max_size=4)
    ),
    max_leaves=20,
)


def same(a: object, b: object) -> bool:
    """Equal with the same types all the way down (1 is not 1.0 or True; -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and a == b  # type: ignore[arg-type]
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, set | frozenset):  # items matched by value, their types compared too
        return a == b and all(any(same(x, y) for y in b) for x in a)  # type: ignore[union-attr]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[attr-defined,index]
    return a == b


@given(values)
def test_plain_values_round_trip_with_their_types(value: object) -> None:
    assert same(decode(encode(value, "t"), "t"), value)


def test_equal_sets_encode_alike_whatever_their_insertion_order() -> None:
    a, b = {3, "x", (1, 2), b"z"}, {b"z", (1, 2), "x", 3}
    assert encode(a, "t") == encode(b, "t")
    assert same(decode(encode({"s": frozenset(a)}, "t"), "t"), {"s": frozenset(a)})


@pytest.mark.parametrize("value", [{1.5j}, object(), [1, 2**64], {"a": {object()}}])
def test_other_values_are_refused_in_one_line(value: object) -> None:
    with pytest.raises(GradmeshError, match="^broadcast_object cannot send") as info:
        encode(value, "broadcast_object")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [b"\xc1", b"\xd4\x07\x00", b"\x92\x01", b""])
def test_bytes_that_are_not_an_object_are_one_line(data: bytes) -> None:
    with pytest.raises(GradmeshError, match="received bytes that are not an encoded object"):
        decode(data, "allgather_object")
