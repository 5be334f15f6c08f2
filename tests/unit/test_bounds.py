"""A completion's bounds (``bounds.COMPLETION_BOUNDS``) hold at every edge.

``check_completion`` accepts an in-range completion with one test written out beside the table
its refusals name fields from: the two must agree, or a number past a bound would be learned."""

from __future__ import annotations

import math

import pytest

from kvrouterd.bounds import COMPLETION_BOUNDS, check_completion
from kvrouterd.errors import InvalidRequest
from kvrouterd.protocols import Completion


def _past(value: float, up: bool) -> float:
    """The nearest number of ``value``'s kind beyond it (ints by one, floats by one ulp)."""
    if isinstance(value, int):
        return value + 1 if up else value - 1
    return math.nextafter(value, math.inf if up else -math.inf)


@pytest.mark.parametrize(("name", "low", "high"), COMPLETION_BOUNDS)
def test_each_bound_accepts_its_edges_and_refuses_just_past_them_naming_its_field(name, low, high):
    for edge in (low, high):
        check_completion(Completion("r", **{name: edge}))
    for beyond in (_past(low, up=False), _past(high, up=True), math.nan, math.inf):
        with pytest.raises(InvalidRequest, match=name):
            check_completion(Completion("r", **{name: beyond}))


def test_the_first_field_out_of_range_is_the_one_named():
    with pytest.raises(InvalidRequest, match="e2e_ms"):
        check_completion(Completion("r", e2e_ms=-1.0, cached_tokens=-7))
