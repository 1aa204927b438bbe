"""Merge rules and weights: token weighting, mean, RDA, per-island scales (staleness and work
fractions: test_contributions.py)."""

from __future__ import annotations

import math

import pytest
import torch
from diloco_trainer.core.merge import contribution_weight, merge_pseudo_gradients


def test_contribution_weight_is_quantity_times_quality() -> None:
    assert contribution_weight(1000, 10, "tokens") == 1000 * 100
    assert contribution_weight(1000, 10, "rda") == 1000 * 100
    # Same tokens in twice the steps (smaller batches) weigh half.
    assert contribution_weight(1000, 20, "tokens") == 0.5 * contribution_weight(1000, 10, "tokens")
    assert contribution_weight(1000, 10, "mean") == 1.0
    assert contribution_weight(0, 0, "tokens") == 0.0


def test_contribution_weight_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="0 inner steps"):
        contribution_weight(10, 0, "tokens")
    with pytest.raises(ValueError, match=">= 0"):
        contribution_weight(-1, 1, "tokens")
    with pytest.raises(ValueError, match=r"sync\.merge 'median'"):
        contribution_weight(1, 1, "median")


def test_merge_tokens_rule_weights_numerically() -> None:
    a, b = {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}
    # Island a: 3000 tokens in 3 steps; island b: 1000 tokens in 2 steps (smaller batches).
    wa, wb = contribution_weight(3000, 3, "tokens"), contribution_weight(1000, 2, "tokens")
    assert (wa, wb) == (3_000_000.0, 500_000.0)
    out = merge_pseudo_gradients([a, b], [wa, wb], "tokens")
    assert torch.allclose(out["w"], torch.tensor([6 / 7, 1 / 7]))


def test_merge_mean_rule_is_plain_average() -> None:
    deltas = [{"w": torch.tensor([float(i), 2.0 * i])} for i in range(1, 5)]
    out = merge_pseudo_gradients(deltas, [1.0] * 4, "mean")
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))


def test_merge_accumulates_low_precision_inputs_in_fp32() -> None:
    deltas = [{"w": torch.full((4,), 1.0 + 2**-7, dtype=torch.bfloat16)} for _ in range(3)]
    deltas.append({"w": torch.full((4,), 1.0, dtype=torch.bfloat16)})
    out = merge_pseudo_gradients(deltas, [1.0] * 4, "mean")
    assert out["w"].dtype == torch.float32
    assert torch.allclose(out["w"], torch.full((4,), 1.0 + 3 * 2**-7 / 4), atol=1e-7)


def test_merge_rda_keeps_norm_of_nearly_orthogonal_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    m, dim, radius = 8, 4096, 3.0
    deltas = []
    for _ in range(m):
        v = torch.randn(dim, generator=g)
        deltas.append({"w": v / v.norm() * radius})
    mean = merge_pseudo_gradients(deltas, [1.0] * m, "mean")["w"].norm()
    rda = merge_pseudo_gradients(deltas, [1.0] * m, "rda")
    assert abs(float(mean) - radius / math.sqrt(m)) < 0.1 * radius / math.sqrt(m)
    assert float(rda["w"].norm()) == pytest.approx(radius, rel=1e-5)
    # Its direction is the mean's direction.
    mean_vec = merge_pseudo_gradients(deltas, [1.0] * m, "mean")["w"]
    cos = torch.nn.functional.cosine_similarity(rda["w"], mean_vec, dim=0)
    assert float(cos) == pytest.approx(1.0, abs=1e-5)


def test_merge_rda_of_identical_vectors_is_the_vector() -> None:
    v = torch.tensor([[0.3, -1.2], [2.0, 0.01]])
    out = merge_pseudo_gradients([{"w": v}] * 3, [1.0, 5.0, 2.0], "rda")
    assert torch.allclose(out["w"], v, atol=1e-6)


def test_merge_rda_radius_is_weighted_mean_norm() -> None:
    a = {"w": torch.tensor([2.0, 0.0])}
    b = {"w": torch.tensor([0.0, 5.0])}
    out = merge_pseudo_gradients([a, b], [3.0, 1.0], "rda")["w"]
    assert float(out.norm()) == pytest.approx((3 * 2 + 1 * 5) / 4)
    # Direction: normalize(3*(1,0) + 1*(0,1)).
    assert torch.allclose(out / out.norm(), torch.tensor([3.0, 1.0]) / math.sqrt(10))


def test_merge_rda_handles_zero_vectors() -> None:
    zero = {"w": torch.zeros(3)}
    v = {"w": torch.tensor([0.0, 4.0, 0.0])}
    out = merge_pseudo_gradients([zero, v], [1.0, 1.0], "rda")["w"]
    # The zero vector has no direction but counts in the radius: (0 + 4) / 2 along v.
    assert torch.allclose(out, torch.tensor([0.0, 2.0, 0.0]))
    both_zero = merge_pseudo_gradients([zero, zero], [1.0, 1.0], "rda")["w"]
    assert torch.equal(both_zero, torch.zeros(3))


def test_merge_rda_uses_plain_mean_for_plain_names() -> None:
    a = {"emb": torch.tensor([2.0, 0.0]), "w": torch.tensor([2.0, 0.0])}
    b = {"emb": torch.tensor([0.0, 2.0]), "w": torch.tensor([0.0, 2.0])}
    out = merge_pseudo_gradients([a, b], [1.0, 1.0], "rda", plain_names=frozenset({"emb"}))
    assert torch.allclose(out["emb"], torch.tensor([1.0, 1.0]))
    assert float(out["w"].norm()) == pytest.approx(2.0)


def test_merge_rejects_zero_total_weight_and_bad_inputs() -> None:
    d = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="sum to zero"):
        merge_pseudo_gradients([d, d], [0.0, 0.0], "tokens")
    with pytest.raises(ValueError, match=">= 0"):
        merge_pseudo_gradients([d, d], [1.0, -1.0], "tokens")
    with pytest.raises(ValueError, match="2 pseudo-gradients but 1 weights"):
        merge_pseudo_gradients([d, d], [1.0], "tokens")
    with pytest.raises(ValueError, match="different tensor names"):
        merge_pseudo_gradients([d, {"v": torch.ones(2)}], [1.0, 1.0], "tokens")
    with pytest.raises(ValueError, match="shape"):
        merge_pseudo_gradients([d, {"w": torch.ones(3)}], [1.0, 1.0], "tokens")
    with pytest.raises(ValueError, match="no pseudo-gradients"):
        merge_pseudo_gradients([], [], "tokens")


def test_merge_does_not_modify_inputs() -> None:
    a, b = {"w": torch.ones(3)}, {"w": torch.full((3,), 3.0)}
    out = merge_pseudo_gradients([a, b], [1.0, 1.0], "rda")
    out["w"].add_(100)
    assert torch.equal(a["w"], torch.ones(3)) and torch.equal(b["w"], torch.full((3,), 3.0))
    single = merge_pseudo_gradients([a], [2.0], "tokens")
    single["w"].add_(1)
    assert torch.equal(a["w"], torch.ones(3))


def test_merge_scales_each_vector_before_the_weighted_mean() -> None:
    a, b = {"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}
    # weights 3:1, scales 0.5 and 0.25: (0.75·[1, 0] + 0.25·[0, 1]).
    out = merge_pseudo_gradients([a, b], [3.0, 1.0], "mean", scales=[0.5, 0.25])
    assert torch.allclose(out["w"], torch.tensor([0.75, 0.25]))
    with pytest.raises(ValueError, match="scales"):
        merge_pseudo_gradients([a, b], [1.0, 1.0], "mean", scales=[1.0])
    with pytest.raises(ValueError, match="scales"):
        merge_pseudo_gradients([a, b], [1.0, 1.0], "mean", scales=[1.0, -1.0])


def test_merge_rda_radius_uses_the_scaled_norms() -> None:
    a, b = {"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}
    # Scaled norms 1 and 1: radius 1; direction (e1 + e2)/2 normalised.
    out = merge_pseudo_gradients([a, b], [1.0, 1.0], "rda", scales=[0.5, 0.25])
    assert torch.allclose(out["w"], torch.tensor([1.0, 1.0]) / math.sqrt(2))
