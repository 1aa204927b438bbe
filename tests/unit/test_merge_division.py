"""The merge's division left to the outer step's slices (core/fold.result_undivided,
core/outer's `before`, syncer/global_model.PreparedMerge.divide): θ_exact, the momentum, θ_pub
and its encoded update are bit for bit those of the merge divided first (fold.result)."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.core.compress import SLICE
from diloco_trainer.core.fold import MergeFold
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.core.published import UpdateWriter
from diloco_trainer.syncer.merging.global_model import PreparedMerge

SHAPES = {"a": (2 * SLICE + 1000,), "b": (300, 129), "c": (3,)}  # several slices, odd tails


def _fold(gen_seed: int) -> MergeFold:
    gen = torch.Generator().manual_seed(gen_seed)
    fold = MergeFold("tokens")
    for w, s in [(3.0, 1.0), (5.0, 0.37), (7.0, 2.1)]:  # Σρ = 15: the division rounds
        fold.add({n: torch.randn(sh, generator=gen) * 1e-2 for n, sh in SHAPES.items()}, w, s)
    return fold


def _merge(lazy: bool, fraction: float, complete: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    exact = {n: torch.randn(sh, generator=gen) for n, sh in SHAPES.items()}
    pub = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in exact.items()}
    opt = OuterOptimizer(exact, lr=0.7, momentum=0.9, nesterov=True)
    names = list(SHAPES)
    got: list[torch.Tensor] = []
    for rnd in range(2):  # the second merge has a momentum (and an open buffer when partial)
        fold = _fold(10 + rnd)
        if lazy:
            merged, divisors = fold.result_undivided()
            prepared = PreparedMerge(plan=None, merged=merged, divisors=divisors)  # type: ignore[arg-type]
            before = prepared.divide
        else:
            merged, before = fold.result(), None
        out = {n: torch.empty_like(t) for n, t in pub.items()}
        writer = UpdateWriter(exact, pub, names, "int8", rnd + 1, out)
        opt.step(merged, fraction, complete=complete, each=writer.slice, before=before)
        update = writer.finish()
        pub = out
        got += [*exact.values(), *out.values(), *update.encoded.values()]
        got += list(opt.state_tensors().values())
        got.append(torch.tensor([ord(ch) for ch in update.checksum]))
    return got


@pytest.mark.parametrize(("fraction", "complete"), [(1.0, True), (0.5, False), (0.75, True)])
def test_division_in_the_step_is_the_division_first_bit_for_bit(
    fraction: float, complete: bool
) -> None:
    eager, lazy = _merge(False, fraction, complete), _merge(True, fraction, complete)
    assert len(eager) == len(lazy)
    for a, b in zip(eager, lazy, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_finish_divides_once() -> None:
    # acc = [7, 2], Σρ = 4 (weights 1 and 3, scales 1 and 0.5): the merge [1.75, 0.5]; a second
    # finish() divides nothing more.
    fold = MergeFold("tokens")
    fold.add({"w": torch.tensor([4.0, 8.0])}, 1.0, 1.0)
    fold.add({"w": torch.tensor([2.0, -4.0])}, 3.0, 0.5)
    merged, divisors = fold.result_undivided()
    prepared = PreparedMerge(plan=None, merged=merged, divisors=divisors)  # type: ignore[arg-type]
    assert torch.equal(prepared.finish()["w"], torch.tensor([1.75, 0.5]))
    assert torch.equal(prepared.finish()["w"], torch.tensor([1.75, 0.5]))
