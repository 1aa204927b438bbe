"""mixing.eager_start: where the overlapped steps start from with eager updates (issue 23)."""

from __future__ import annotations

import torch
from diloco_trainer.learner.mixing import eager_start, received_weights


def test_eager_start_extrapolates_the_last_update_once() -> None:
    # base 1.0 after previous 0.5: the last update was +0.5, so the guess is 1.5; likewise
    # 2.0 after 2.5 (update -0.5) gives 1.5, and an unchanged value stays where it is.
    base = {"w": torch.tensor([1.0, 2.0, 3.0])}
    previous = {"w": torch.tensor([0.5, 2.5, 3.0])}
    assert eager_start(base, previous)["w"].tolist() == [1.5, 1.5, 3.0]


def test_eager_start_is_fp32_whatever_the_inputs() -> None:
    out = eager_start({"w": torch.tensor([1.0], dtype=torch.bfloat16)}, {"w": torch.tensor([0.0])})
    assert out["w"].dtype == torch.float32
    assert out["w"].tolist() == [2.0]


def test_steps_taken_from_the_eager_start_are_kept_on_top_of_the_real_merge() -> None:
    # Pushed from the eager start 1.5, trained to 1.25 (-0.25 in the overlapped steps); the
    # merge came back at 1.4: the island continues from 1.4 - 0.25 = 1.15.
    start = eager_start({"w": torch.tensor([1.0])}, {"w": torch.tensor([0.5])})
    got = received_weights({"w": torch.tensor([1.4])}, {"w": torch.tensor([1.25])}, start)
    assert torch.allclose(got["w"], torch.tensor([1.15]))
