"""Merge plans: work shares, the staleness discount beyond one round, and the work fraction a
merge carries (expected values derived by hand in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core.contributions import (
    Contributor,
    momentum_share,
    plan_merge,
    staleness_discount,
    work_share,
)
from diloco_trainer.core.merge import merge_pseudo_gradients


def test_work_share_is_steps_over_h() -> None:
    assert work_share(5, 10) == 0.5
    assert work_share(20, 10) == 2.0
    with pytest.raises(ValueError, match=r"inner\.steps"):
        work_share(1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        work_share(-1, 10)


def test_staleness_discount_spares_one_round_then_decays_as_inverse_sqrt() -> None:
    assert staleness_discount(0.0) == 1.0
    assert staleness_discount(0.75) == 1.0  # K=1, four islands out of phase: 3/4 of a round
    assert staleness_discount(1.0) == 1.0
    assert staleness_discount(2.0) == pytest.approx(1 / math.sqrt(2))  # (1 + 1)^-1/2
    assert staleness_discount(4.0) == pytest.approx(0.5)  # (1 + 3)^-1/2
    with pytest.raises(ValueError, match="lag"):
        staleness_discount(-0.5)


def test_plan_of_a_full_synchronous_round_is_one_round_of_plain_weights() -> None:
    cs = [Contributor(tokens=100, steps=10)] * 4
    plan = plan_merge(cs, rule="mean", inner_steps=10, islands=4)
    assert plan.fraction == 1.0
    assert plan.weights == [1.0] * 4 and plan.scales == [1.0] * 4
    assert plan.shares == [0.25] * 4


def test_plan_of_one_island_is_a_quarter_round_at_full_weight() -> None:
    plan = plan_merge([Contributor(100, 10)], rule="tokens", inner_steps=10, islands=4)
    assert plan.fraction == 0.25
    assert plan.shares == [1.0]
    assert not plan.complete


def test_plan_of_every_island_says_complete_whatever_its_work() -> None:
    cs = [Contributor(tokens=90, steps=9)] * 4  # each 9 of H = 10 steps
    plan = plan_merge(cs, rule="mean", inner_steps=10, islands=4, complete=True)
    assert plan.fraction == pytest.approx(0.9)
    assert plan.complete


def test_lone_stale_push_is_discounted_not_renormalised() -> None:
    # 3 rounds behind: excess 2, discount 3^-1/2; a lone push keeps share 1 but the merge
    # carries only 3^-1/2 of its quarter round.
    stale = Contributor(100, 10, lag_rounds=3.0)
    plan = plan_merge([stale], rule="mean", inner_steps=10, islands=4)
    assert plan.discounts == [pytest.approx(3**-0.5)]
    assert plan.fraction == pytest.approx(0.25 * 3**-0.5)


def test_plan_tokens_rule_by_hand() -> None:
    # H=4, M=3. a: 300 tokens / 4 steps (w=1), fresh: weight 300·75 = 22500.
    # b: 100 tokens / 2 steps (w=0.5), 3 rounds stale: weight 100·50·3^-1/2, scale 2.
    plan = plan_merge(
        [Contributor(300, 4), Contributor(100, 2, lag_rounds=3.0)],
        rule="tokens",
        inner_steps=4,
        islands=3,
    )
    assert plan.work == [1.0, 0.5]
    assert plan.weights == pytest.approx([22500.0, 5000.0 * 3**-0.5])
    assert plan.scales == [1.0, 2.0]
    assert plan.fraction == pytest.approx((1.0 + 0.5 * 3**-0.5) / 3)


def test_plan_mean_rule_weighs_by_work() -> None:
    plan = plan_merge([Contributor(1, 8), Contributor(1, 2)], rule="mean", inner_steps=4, islands=2)
    assert plan.weights == [2.0, 0.5] and plan.scales == [0.5, 2.0]
    assert plan.fraction == pytest.approx(1.25)


def test_planned_merge_moves_by_every_discounted_pseudo_gradient_once() -> None:
    """φ·g = Σ d_i·Δ_i / M with equal batches, however much work each push holds."""
    da = {"w": torch.tensor([2.0, 0.0])}  # 2 rounds of work (a replaced push), fresh
    db = {"w": torch.tensor([0.0, 1.0])}  # half a round, 4 rounds stale: d = 0.5
    cs = [Contributor(256, 8), Contributor(64, 2, lag_rounds=4.0)]  # 32 tokens per step
    plan = plan_merge(cs, rule="tokens", inner_steps=4, islands=4)
    g = merge_pseudo_gradients([da, db], plan.weights, "tokens", scales=plan.scales)
    moved = plan.fraction * g["w"]
    torch.testing.assert_close(moved, (da["w"] + 0.5 * db["w"]) / 4)


def test_plan_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="median"):
        plan_merge([Contributor(1, 1)], rule="median", inner_steps=1, islands=1)
    with pytest.raises(ValueError, match="at least one island"):
        plan_merge([Contributor(1, 1)], rule="mean", inner_steps=1, islands=0)


def test_staleness_bound_auto_is_four_versions_per_island_of_the_job() -> None:
    assert parse_spec({"islands": {"count": 3}}).staleness_bound() == 12
    # Multi-region: every region's islands count (totalShards).
    assert parse_spec({"islands": {"count": 2, "totalShards": 5}}).staleness_bound() == 20
    assert parse_spec({"sync": {"maxStaleness": 2}}).staleness_bound() == 2


def test_momentum_share_is_inverse_square_of_one_plus_the_lag() -> None:
    assert momentum_share(0.0) == 1.0  # fresh: all of it (K = M's merges unchanged)
    assert momentum_share(0.5) == pytest.approx(1 / 2.25)  # (1 + 0.5)^-2
    assert momentum_share(1.0) == 0.25  # (1 + 1)^-2
    assert momentum_share(3.0) == 1 / 16  # (1 + 3)^-2
    with pytest.raises(ValueError, match=">= 0"):
        momentum_share(-0.1)
    with pytest.raises(ValueError, match="finite"):
        momentum_share(math.inf)


def test_plan_merge_momentum_share_is_the_contributors_weighted_by_rho() -> None:
    fresh = [Contributor(300, 30), Contributor(300, 30)]
    assert plan_merge(fresh, rule="tokens", inner_steps=30, islands=4).momentum == 1.0
    # One island's push a round stale, alone (K = 1): (1 + 1)^-2; its discount is 1 (the first
    # round of lag is free), so φ is still 30/30 / 4.
    lone = plan_merge([Contributor(300, 30, 1.0)], rule="tokens", inner_steps=30, islands=4)
    assert lone.momentum == 0.25
    assert lone.fraction == 0.25
    # Two equal pushes (ρ alike: same tokens and steps, discount 1 at lags 0 and 1):
    # (1 + 0.25) / 2.
    mixed = [Contributor(300, 30, 0.0), Contributor(300, 30, 1.0)]
    assert plan_merge(mixed, rule="tokens", inner_steps=30, islands=4).momentum == 0.625
    # Lag 3 rounds: discount (1 + 2)^-1/2 = 0.577 in ρ; shares 1 and 1/16:
    # (1 + 0.5774 / 16) / (1 + 0.5774) = 0.6569.
    old = [Contributor(300, 30, 0.0), Contributor(300, 30, 3.0)]
    d = 3**-0.5
    expected = (1 + d / 16) / (1 + d)
    assert plan_merge(old, rule="tokens", inner_steps=30, islands=4).momentum == pytest.approx(
        expected
    )
    assert expected == pytest.approx(0.6569, abs=1e-4)
