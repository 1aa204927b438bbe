"""bench/studies/eval_sets' pure parts: the held-out windows split into disjoint sets, and the
spread of a loss ratio over them."""

from __future__ import annotations

import doctest

import pytest

import bench.studies.eval_sets as eval_sets
from bench.studies.eval_sets import ratio_spread, set_means


def test_sets_take_every_sets_th_window_so_each_spans_the_split() -> None:
    # Windows 0..7 in 4 sets: {0, 4}, {1, 5}, {2, 6}, {3, 7}.
    assert set_means([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 4) == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="3 windows cannot make 4 sets"):
        set_means([1.0, 2.0, 3.0], 4)


def test_ratio_spread_is_the_sd_and_range_of_the_per_set_ratios() -> None:
    # Ratios 1.01, 0.99, 1.00: sd 0.01, range 0.99-1.01.
    sd, low, high = ratio_spread([2.02, 1.98, 2.0], [2.0, 2.0, 2.0])
    assert (sd, low, high) == pytest.approx((0.01, 0.99, 1.01))


def test_eval_sets_doctests_pass() -> None:
    result = doctest.testmod(eval_sets)
    assert (result.failed, result.attempted) == (0, 2)
