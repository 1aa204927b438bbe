"""core/fold.py: a merge folded one pseudo-gradient at a time equals the batch merge
(core/merge.py), by hand-derived values and against merge_pseudo_gradients."""

from __future__ import annotations

import math

import pytest
import torch
from diloco_trainer.core.fold import MergeFold
from diloco_trainer.core.merge import merge_pseudo_gradients


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_weighted_mean_by_hand() -> None:
    # weights 1 and 3, scales 1 and 0.5: (1·1·[4, 8] + 3·0.5·[2, -4]) / 4 = ([4, 8] + [3, -6]) / 4
    fold = MergeFold("tokens")
    fold.add({"w": t(4.0, 8.0)}, 1.0, 1.0)
    fold.add({"w": t(2.0, -4.0)}, 3.0, 0.5)
    assert torch.equal(fold.result()["w"], t(1.75, 0.5))


def test_weights_relative_to_the_first_keep_the_same_mean() -> None:
    # tokens² weights (1e12 and 3e12) give the mean of weights 1 and 3: no fp32 overflow either.
    fold = MergeFold("tokens")
    fold.add({"w": t(4.0, 8.0)}, 1e12, 1.0)
    fold.add({"w": t(2.0, -4.0)}, 3e12, 0.5)
    assert torch.allclose(fold.result()["w"], t(1.75, 0.5), rtol=1e-6)


def test_the_batch_merge_is_the_fold_in_the_same_order_bit_for_bit() -> None:
    # What makes a merge reproducible from merges.jsonl: replayed in the order the pushes came.
    gen = torch.Generator().manual_seed(1)
    vs = [{"w": torch.randn(1000, generator=gen)} for _ in range(3)]
    weights, scales = [22500.0, 2500.0, 7.0], [1.0, 0.5, 2.0]
    fold = MergeFold("tokens")
    for v, w, s in zip(vs, weights, scales, strict=True):
        fold.add(v, w, s)
    want = merge_pseudo_gradients(vs, weights, "tokens", scales=scales)
    assert torch.equal(fold.result()["w"], want["w"])


def test_zero_weight_counts_nothing_but_is_folded() -> None:
    fold = MergeFold("tokens")
    fold.add({"w": t(100.0)}, 0.0, 1.0)  # first, before any unit exists
    fold.add({"w": t(6.0)}, 2.0, 1.0)
    assert torch.equal(fold.result()["w"], t(6.0))


def test_rda_by_hand() -> None:
    # v1 = [3, 4] (|v1| = 5), v2 = [0, 2] (|v2| = 2), weights 1 and 1, scales 1 and 2.
    # direction ∝ [3, 4]/5 + [0, 1] = [0.6, 1.8]; radius = (1·1·5 + 1·2·2) / 2 = 4.5.
    fold = MergeFold("rda")
    fold.add({"w": t(3.0, 4.0)}, 1.0, 1.0)
    fold.add({"w": t(0.0, 2.0)}, 1.0, 2.0)
    got = fold.result()["w"]
    d = math.hypot(0.6, 1.8)
    assert torch.allclose(got, t(0.6 * 4.5 / d, 1.8 * 4.5 / d), rtol=1e-6)
    assert float(got.norm()) == pytest.approx(4.5, rel=1e-6)


def test_rda_plain_names_take_the_weighted_mean() -> None:
    fold = MergeFold("rda", frozenset({"emb"}))
    fold.add({"emb": t(2.0), "w": t(3.0, 4.0)}, 1.0, 1.0)
    fold.add({"emb": t(4.0), "w": t(3.0, 4.0)}, 1.0, 1.0)
    out = fold.result()
    assert torch.equal(out["emb"], t(3.0))
    assert torch.allclose(out["w"], t(3.0, 4.0), rtol=1e-6)


@pytest.mark.parametrize("rule", ["tokens", "mean", "rda"])
def test_fold_equals_the_batch_merge(rule: str) -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = [
        {"a": torch.randn(5, 3, generator=gen), "emb": torch.randn(7, generator=gen)}
        for _ in range(4)
    ]
    weights = [2.5e9, 1e9, 0.0, 4e9]
    scales = [1.0, 0.5, 1.0, 2.0]
    plain = frozenset({"emb"})
    want = merge_pseudo_gradients(deltas, weights, rule, plain, scales=scales)
    fold = MergeFold(rule, plain)
    for d, w, s in zip(deltas, weights, scales, strict=True):
        fold.add(d, w, s)
    got = fold.result()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name


def test_refusals() -> None:
    fold = MergeFold("tokens")
    with pytest.raises(ValueError, match="nothing to merge"):
        fold.result()
    with pytest.raises(ValueError, match="weight must be finite"):
        fold.add({"w": t(1.0)}, math.inf, 1.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        fold.add({"w": t(1.0)}, 1.0, -1.0)
    fold.add({"w": t(1.0)}, 0.0, 1.0)
    with pytest.raises(ValueError, match="different tensor names"):
        fold.add({"v": t(1.0)}, 1.0, 1.0)
    with pytest.raises(ValueError, match="has shape"):
        fold.add({"w": t(1.0, 2.0)}, 1.0, 1.0)
    with pytest.raises(ValueError, match="sum to zero"):
        fold.result()


def test_result_uses_the_fold_up() -> None:
    fold = MergeFold("tokens")
    fold.add({"w": t(2.0)}, 1.0, 1.0)
    assert torch.equal(fold.result()["w"], t(2.0))
    with pytest.raises(ValueError, match="nothing to merge"):
        fold.result()


def test_result_undivided_leaves_the_division_to_its_reader_by_hand() -> None:
    # weights 1 and 3, scales 1 and 0.5: acc = [4, 8] + [3, -6] = [7, 2], Σρ = 4; the merge is
    # acc / 4 = [1.75, 0.5], its largest |x| 1.75 = max|acc| / 4, found before any division.
    fold = MergeFold("tokens")
    fold.add({"w": t(4.0, 8.0)}, 1.0, 1.0)
    fold.add({"w": t(2.0, -4.0)}, 3.0, 0.5)
    out, divisors = fold.result_undivided()
    assert torch.equal(out["w"], t(7.0, 2.0))
    assert divisors == {"w": 4.0}
    assert (fold.amax, fold.amax_name) == (1.75, "w")


def test_result_undivided_then_divided_by_slices_is_result_bit_for_bit() -> None:
    # Slices of another size than the fold's own, across several tensors, weights that make
    # Σρ no power of two (division rounds); the largest |x| and its tensor the same too.
    gen = torch.Generator().manual_seed(7)
    shapes = {"a": (300_001,), "b": (517, 1031), "c": (5,)}
    vs = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(3)]
    vs[2]["b"][3, 7] = -40.0  # the largest |x|, negative, in the second tensor

    def folded() -> MergeFold:
        fold = MergeFold("tokens")
        for v, w, s in zip(vs, [3.0, 5.0, 7.0], [1.0, 0.37, 2.1], strict=True):
            fold.add(v, w, s)
        return fold

    eager = folded()
    want = eager.result()
    lazy = folded()
    got, divisors = lazy.result_undivided()
    assert set(divisors) == set(shapes)
    for name, d in divisors.items():
        flat = got[name].view(-1)
        for start in range(0, flat.numel(), 100_000):
            flat[start : start + 100_000].div_(d)
        assert torch.equal(got[name], want[name])
    assert (lazy.amax, lazy.amax_name) == (eager.amax, eager.amax_name) and lazy.amax_name == "b"


def test_result_undivided_finds_a_nan_before_any_division() -> None:
    fold = MergeFold("tokens")
    fold.add({"a": t(1.0), "b": t(float("nan"), 2.0)}, 1.0, 1.0)
    _, divisors = fold.result_undivided()
    assert math.isnan(fold.amax) and fold.amax_name == "b" and divisors == {"a": 1.0, "b": 1.0}


def test_rda_is_finished_at_once() -> None:
    # RDA's scale needs the whole direction's norm: nothing of it is left to the reader.
    fold = MergeFold("rda")
    fold.add({"w": t(3.0, 4.0)}, 1.0, 1.0)
    out, divisors = fold.result_undivided()
    assert divisors == {} and torch.allclose(out["w"], t(3.0, 4.0))
