"""bench/studies/link_interference on the CPU, small: every host kind is timed against the loop
alone, and the pulled update it applies is a real one (the rebuild moves every value)."""

from __future__ import annotations

import torch
from diloco_trainer.core.published import apply_updates

from bench.studies import link_interference


def test_the_host_kinds_run_and_are_read_against_the_loop_alone() -> None:
    args = link_interference.parse_args(
        ["--steps", "3", "--rounds", "1", "--warmup", "1", "--fragment-values", "4000"]
    )
    result = link_interference.run(args)
    kinds = result["kinds"]
    assert list(kinds) == ["none", "python", "host-rebuild"]  # no GPU kinds on the CPU
    assert kinds["none"]["ratio"] == 1.0 and kinds["none"]["work_s_per_op"] == 0.0
    for k in ("python", "host-rebuild"):
        assert kinds[k]["step_s_median"] > 0 and kinds[k]["work_s_per_op"] > 0, k
    assert "host-rebuild" in link_interference.report(result)


def test_the_background_update_is_a_pulled_body_that_moves_every_value() -> None:
    held = link_interference.fragment(1000, 4)
    (update,) = link_interference.pulled_update(held)
    rebuilt = apply_updates(held, [update], "int8")
    for n, t in held.items():
        assert torch.all(rebuilt[n] != t), n
