"""The learner's arithmetic on a fragment (learner/mixing.py), with hand-derived values."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.core.compress import SLICE
from diloco_trainer.learner.mixing import pseudo_gradient, received_weights, received_weights_into


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_pseudo_gradient_is_global_minus_local() -> None:
    # base (θ_global) 1, 2; the island trained to 0.5, 2.5: Δ = 0.5, -0.5.
    delta = pseudo_gradient({"w": t(1.0, 2.0)}, {"w": t(0.5, 2.5)})
    assert torch.equal(delta["w"], t(0.5, -0.5))


def test_pseudo_gradient_sign_makes_an_outer_sgd_step_of_lr_1_land_on_the_local_weights() -> None:
    base, local = {"w": t(3.0, -1.0)}, {"w": t(2.0, 1.0)}
    delta = pseudo_gradient(base, local)
    # θ ← θ − lr·Δ with lr 1 (what the outer optimizer does with one island and no momentum).
    assert torch.equal(base["w"] - 1.0 * delta["w"], local["w"])


def test_pseudo_gradient_is_fp32_whatever_the_parameter_dtype() -> None:
    delta = pseudo_gradient({"w": t(1.0)}, {"w": torch.tensor([0.5], dtype=torch.bfloat16)})
    assert delta["w"].dtype == torch.float32
    assert delta["w"].item() == 0.5


def test_received_weights_keep_the_steps_taken_since_the_push() -> None:
    # Pushed at 1, trained on to 3 during the overlap, merged global 10: 10 + (3 - 1) = 12.
    out = received_weights({"w": t(10.0)}, {"w": t(3.0)}, {"w": t(1.0)})
    assert torch.equal(out["w"], t(12.0))


def test_received_weights_without_a_push_overwrite() -> None:
    out = received_weights({"w": t(10.0, -2.0)}, {"w": t(3.0, 4.0)}, None)
    assert torch.equal(out["w"], t(10.0, -2.0))


def test_received_weights_with_no_overlap_steps_are_the_global_weights() -> None:
    # τ = 0: the island is still where it pushed from, so it continues from θ_global exactly.
    out = received_weights({"w": t(10.0)}, {"w": t(1.0)}, {"w": t(1.0)})
    assert torch.equal(out["w"], t(10.0))


def test_received_weights_mix_alpha_keeps_a_share_of_the_local_weights() -> None:
    # α = 0.25: 0.25·3 + 0.75·(10 + 3 - 1) = 0.75 + 9 = 9.75.
    out = received_weights({"w": t(10.0)}, {"w": t(3.0)}, {"w": t(1.0)}, alpha=0.25)
    assert torch.equal(out["w"], t(9.75))


def test_received_weights_refuse_alpha_outside_0_1() -> None:
    with pytest.raises(ValueError, match="mixAlpha"):
        received_weights({"w": t(1.0)}, {"w": t(1.0)}, None, alpha=1.0)


def test_received_weights_do_not_write_to_their_inputs() -> None:
    merged, now, at_push = {"w": t(10.0)}, {"w": t(3.0)}, {"w": t(1.0)}
    received_weights(merged, now, at_push, alpha=0.5)
    assert (merged["w"].item(), now["w"].item(), at_push["w"].item()) == (10.0, 3.0, 1.0)


def test_received_weights_batched_are_the_per_tensor_rule_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (3, 5), "b": (7,), "c": (1,)}
    merged, now, at = ({n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in "abc")
    for alpha in (0.0, 0.3):
        out = received_weights(merged, now, at, alpha)
        for n in shapes:
            want = merged[n] + (now[n] - at[n])
            want = alpha * now[n] + (1.0 - alpha) * want if alpha else want
            assert torch.equal(out[n].view(torch.int32), want.view(torch.int32)), (n, alpha)


def test_received_weights_into_the_push_copies_are_the_batched_rule_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(5)
    # Two slices and a short last one (compress.SLICE), and tensors under one slice.
    shapes = {"big": (SLICE + 300,), "a": (3, 5), "c": (1,)}
    for alpha in (0.0, 0.3):
        merged, now, at = (
            {n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in "abc"
        )
        want = received_weights(merged, now, at, alpha)
        kept = {n: x.clone() for n, x in merged.items()}, {n: x.clone() for n, x in now.items()}
        out = received_weights_into(merged, now, at, alpha)
        for n in shapes:
            assert torch.equal(out[n].view(torch.int32), want[n].view(torch.int32)), (n, alpha)
            # Written over at_push's memory; merged and now only read.
            assert out[n].data_ptr() == at[n].data_ptr()
            assert torch.equal(merged[n], kept[0][n]) and torch.equal(now[n], kept[1][n])


def test_received_weights_into_refuse_alpha_outside_0_1() -> None:
    with pytest.raises(ValueError, match="mixAlpha"):
        received_weights_into({"w": t(1.0)}, {"w": t(1.0)}, {"w": t(1.0)}, alpha=-0.1)
