"""bench/hetero's judged figures (bench/harness/hetero_figures.py): compute shares from measured
step times, measured speed ratios, and the fast islands' utilisation against interleaved
equal-speed baselines with the 95% interval of the ratio (hand-derived values)."""

from __future__ import annotations

import math

import pytest

from bench.harness.hetero_figures import (
    KEPT_TARGET,
    Kept,
    compute_shares,
    kept_utilisation,
    repeats_to_resolve,
    speed_ratios,
)


def test_compute_share_is_each_islands_speed_over_the_sum() -> None:
    # 1,1,1,3 nominal, but the slow island measured 5x (0.5 s against 0.1 s): speeds 10, 10,
    # 10, 2 steps/s of 32: 10/32 = 0.3125 each and 2/32 = 0.0625 (the nominal share 1/10 would
    # overstate it by 60%)
    assert compute_shares([0.1, 0.1, 0.1, 0.5]) == pytest.approx([0.3125] * 3 + [0.0625])
    assert compute_shares([2.0, 2.0]) == [0.5, 0.5]


def test_compute_share_needs_every_islands_step_time() -> None:
    assert all(math.isnan(s) for s in compute_shares([0.1, 0.0, 0.2]))
    assert all(math.isnan(s) for s in compute_shares([0.1, math.inf]))
    assert compute_shares([]) == []


def test_speed_ratio_is_the_step_time_over_the_fast_islands_mean() -> None:
    # fast islands 0.1 and 0.3 s (mean 0.2), the 3x island measured 0.9 s: 4.5x
    assert speed_ratios([0.1, 0.3, 0.9], [1, 1, 3]) == pytest.approx([0.5, 1.5, 4.5])
    # a fast island without a step time leaves no reference
    assert all(math.isnan(x) for x in speed_ratios([0.0, 0.2, 0.9], [1, 1, 3]))
    assert all(math.isnan(x) for x in speed_ratios([0.5, 0.9], [2, 3]))


def test_kept_utilisation_ratio_and_interval() -> None:
    """Baselines 0.96, 1.00, 1.04 (mean 1.00, relative deviations -0.04, 0, 0.04); mixed 0.97,
    0.99, 0.98 (mean 0.98, deviations -0.01/0.98, +0.01/0.98, 0). Pooled variance over 3 + 3 - 2
    = 4 degrees of freedom: (0.0032 + 2 x (0.01/0.98)^2) / 4 = 0.000852; s = 0.029190; relative
    se = s x sqrt(1/3 + 1/3) = 0.023834; half-width 0.98 x t(4) = 2.776 x 0.023834 = 0.064838."""
    k = kept_utilisation([0.97, 0.99, 0.98], [0.96, 1.00, 1.04])
    assert k.ratio == pytest.approx(0.98)
    assert k.half_width == pytest.approx(0.064838, abs=1e-6)
    assert k.per_run == pytest.approx((0.97, 0.99, 0.98))
    assert k.baselines == pytest.approx((0.96, 1.00, 1.04))
    assert k.verdict == "not resolved"  # 0.915 .. 1.045 straddles 0.97


def test_kept_verdict_reads_the_whole_interval() -> None:
    assert KEPT_TARGET == 0.97
    assert Kept(1.0, 0.03, (), ()).verdict == "met"  # 0.97 .. 1.03: at or above
    assert Kept(1.0, 0.031, (), ()).verdict == "not resolved"
    assert Kept(0.9, 0.069, (), ()).verdict == "MISSED"  # 0.831 .. 0.969: all below
    assert Kept(0.9, 0.07, (), ()).verdict == "not resolved"  # reaches 0.97
    assert Kept(1.2, math.nan, (), ()).verdict == "not resolved"  # no noise estimate


def test_kept_with_one_run_a_side_has_no_interval() -> None:
    k = kept_utilisation([0.95], [1.0])
    assert k.ratio == pytest.approx(0.95)
    assert math.isnan(k.half_width)
    assert k.verdict == "not resolved"
    assert k.describe() == "0.950x (runs 0.950; baselines 1.000)"


def test_kept_with_one_mixed_run_pools_the_baselines_noise() -> None:
    # baselines 0.9, 1.1 (mean 1.0, deviations +-0.1); the one mixed run adds no deviation:
    # s^2 = 0.02 / 1, relative se = 0.141421 x sqrt(1 + 1/2) = 0.173205, t(1) = 12.706
    k = kept_utilisation([0.9], [0.9, 1.1])
    assert k.half_width == pytest.approx(0.9 * 12.706 * 0.173205, rel=1e-5)
    assert k.describe() == "0.900x ± 1.981 (runs 0.900; baselines 0.900, 1.100)"


def test_kept_refuses_no_runs() -> None:
    with pytest.raises(ValueError, match="at least one"):
        kept_utilisation([], [1.0])
    with pytest.raises(ValueError, match="positive"):
        kept_utilisation([0.5], [0.0])


def test_repeats_to_resolve_reads_the_noise_back_from_the_interval() -> None:
    """One run's relative noise s = 0.05 over 3 + 3 runs: half-width 1.0 x t(4) = 2.776 x 0.05 x
    sqrt(2/3) = 0.113329. At ratio 1.0 the margin to 0.97 is 0.03: t(2n - 2) x 0.05 x sqrt(2/n)
    < 0.03, i.e. t x sqrt(2/n) < 0.6; past 10 degrees of freedom t is taken as 2.228: n = 27
    gives 2.228 x 0.27217 = 0.6064 (no), n = 28 gives 2.228 x 0.26726 = 0.5955 (yes)."""
    half = 2.776 * 0.05 * math.sqrt(2 / 3)
    assert repeats_to_resolve(Kept(1.0, half, (1.0,) * 3, (1.0,) * 3)) == 28
    # s = 0.02 at ratio 1.02 (margin 0.05): n = 2, t(2) = 4.303 x 0.02 x 1 x 1.02 = 0.0878 (no);
    # n = 3, 2.776 x 0.02 x 0.8165 x 1.02 = 0.0462 (yes)
    half = 1.02 * 2.776 * 0.02 * math.sqrt(2 / 3)
    assert repeats_to_resolve(Kept(1.02, half, (1.0,) * 3, (1.0,) * 3)) == 3
    assert repeats_to_resolve(Kept(1.0, math.nan, (1.0,), (1.0,))) is None
    assert repeats_to_resolve(Kept(0.97, 0.01, (1.0,) * 3, (1.0,) * 3)) is None  # on the target
    assert repeats_to_resolve(Kept(1.0, half * 10, (1.0,) * 3, (1.0,) * 3), most=5) is None
