"""Histogram's construction and minus: the fast forms answer what the plain
ones answer, on the inputs where they could differ (NaN, -0.0, negative and
empty buckets)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwatch.snapshot import Histogram

values = st.sampled_from([0.0, -0.0, 1.0, 3.0, -1.0, 0.5, -2.5, 1e300, math.inf, -math.inf, math.nan])


def plain_minus(later: Histogram, earlier: Histogram) -> Histogram | None:
    """Histogram.minus written out one bucket at a time."""
    if earlier.bounds != later.bounds or later.count < earlier.count or later.sum < earlier.sum:
        return None
    cumulative = tuple(a - b for a, b in zip(later.cumulative, earlier.cumulative))
    if any(c < 0 for c in cumulative):
        return None
    return Histogram(later.bounds, cumulative, later.sum - earlier.sum, later.count - earlier.count)


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@given(st.integers(0, 4).flatmap(lambda n: st.tuples(st.lists(values, min_size=n, max_size=n),
                                                      st.lists(values, min_size=n, max_size=n))))
def test_minus_finds_a_bucket_that_fell_as_comparing_each_does(buckets):
    later, earlier = buckets
    bounds = tuple(float(i) for i in range(len(later)))
    fast = Histogram(bounds, tuple(later), 2.0, 2.0).minus(Histogram(bounds, tuple(earlier), 1.0, 1.0))
    plain = plain_minus(Histogram(bounds, tuple(later), 2.0, 2.0), Histogram(bounds, tuple(earlier), 1.0, 1.0))
    assert (fast is None) == (plain is None)
    if fast is not None:
        assert all(map(same, fast.cumulative, plain.cumulative))
        assert [math.copysign(1, c) for c in fast.cumulative] == [math.copysign(1, c) for c in plain.cumulative]


def test_a_nan_bucket_does_not_hide_one_that_fell():
    bounds = (1.0, 2.0, math.inf)
    earlier = Histogram(bounds, (0.0, 5.0, 5.0), 0.0, 5.0)
    # min() of (nan, -1.0, 0.0) is nan: the bucket that fell must still count.
    assert Histogram(bounds, (math.nan, 4.0, 5.0), 1.0, 5.0).minus(earlier) is None


def test_construction_sets_every_field_and_stays_frozen():
    histogram = Histogram((1.0, math.inf), (2.0, 3.0), 0.5, 3.0)
    assert (histogram.bounds, histogram.cumulative, histogram.sum, histogram.count) == ((1.0, math.inf), (2.0, 3.0), 0.5, 3.0)
    assert histogram == Histogram(bounds=(1.0, math.inf), cumulative=(2.0, 3.0), sum=0.5, count=3.0)
    assert hash(histogram) == hash(Histogram((1.0, math.inf), (2.0, 3.0), 0.5, 3.0))
    assert dataclasses.replace(histogram, sum=1.5) == Histogram((1.0, math.inf), (2.0, 3.0), 1.5, 3.0)
    assert pickle.loads(pickle.dumps(histogram)) == histogram
    assert repr(histogram) == "Histogram(bounds=(1.0, inf), cumulative=(2.0, 3.0), sum=0.5, count=3.0)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        histogram.sum = 2.0
    with pytest.raises(TypeError):
        Histogram((1.0,), (1.0,), 1.0)
