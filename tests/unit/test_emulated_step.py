"""The emulated accelerator step (learner/emulated_step.py, DILOCO_EMULATE_STEP_SECONDS) and
bench/busy_emulated's memory rule: which values a step moves, by how much, what it reports, and
the variable's checks; the paced real step (DILOCO_PACE_STEP_SECONDS, learner/loop.step_sleep)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from diloco_trainer.api.contract import EMULATE_STEP, PACE_STEP, ContractError, LearnerEnv
from diloco_trainer.learner.emulated_step import DRIFT, EMULATED_LOSS, EmulatedStep, ring_slices
from diloco_trainer.learner.loop import step_sleep
from torch import nn

from bench.busy_emulated import memory_estimate


def test_ring_slices_cross_tensors_and_wrap_round() -> None:
    # Tensors of 3, 4 and 2 values at flat positions 0-2, 3-6, 7-8.
    assert ring_slices([3, 4, 2], 0, 4) == [(0, 0, 3), (1, 0, 1)]
    assert ring_slices([3, 4, 2], 4, 4) == [(1, 1, 4), (2, 0, 1)]
    # From position 8: the last value, then round to the first tensor.
    assert ring_slices([3, 4, 2], 8, 3) == [(2, 1, 2), (0, 0, 2)]
    # More than the total: each value once, from the start position round to it.
    assert ring_slices([3, 4, 2], 2, 20) == [(0, 2, 3), (1, 0, 4), (2, 0, 2), (0, 0, 2)]
    assert ring_slices([3], 0, 0) == []
    assert ring_slices([], 0, 5) == []


def test_a_round_of_emulated_steps_scales_every_value_once() -> None:
    a = nn.Parameter(torch.full((3,), 2.0))
    b = nn.Parameter(torch.full((2, 2), 4.0))
    # 7 values over 3 steps a round: ceil(7 / 3) = 3 values a step.
    step = EmulatedStep([a, b], seconds=0.0, steps_per_round=3, tokens_per_step=256)
    assert step.per_step == 3
    loss, tokens = step.run(None)  # type: ignore[arg-type]  # no batch is read
    assert (loss, tokens) == (EMULATED_LOSS, 256)
    assert a.detach().tolist() == pytest.approx([2 * (1 - DRIFT)] * 3)
    assert b.detach().flatten().tolist() == [4.0] * 4
    step.run(None)  # type: ignore[arg-type]
    step.run(None)  # type: ignore[arg-type]  # 9 values: b once, then a's first two again
    assert b.detach().flatten().tolist() == pytest.approx([4 * (1 - DRIFT)] * 4)
    twice = 2 * (1 - DRIFT) ** 2
    assert a.detach().tolist() == pytest.approx([twice, twice, 2 * (1 - DRIFT)])
    assert step.cursor == 2


def test_an_emulated_step_takes_its_wall_time() -> None:
    step = EmulatedStep(
        [nn.Parameter(torch.zeros(4))], seconds=0.05, steps_per_round=2, tokens_per_step=1
    )
    t0 = time.perf_counter()
    step.run(None)  # type: ignore[arg-type]
    assert time.perf_counter() - t0 >= 0.05


ENV = {"DILOCO_ISLAND": "island-0", "DILOCO_SYNCER_URL": "http://x:1"}


def learner_env(tmp_path: Path) -> dict[str, str]:
    """A learner's environment with a token file under tmp_path and no benchmark knob set."""
    token = tmp_path / "token"
    token.write_text("t")
    return {**ENV, "DILOCO_TOKEN_FILE": str(token), "DILOCO_CONFIG_FILE": "c"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [("fast", "is not a number"), ("-1", "must be in [0, 60]"), ("61", "must be in [0, 60]")],
)
def test_a_bad_emulated_step_names_the_variable(raw: str, message: str, tmp_path) -> None:
    env = {**learner_env(tmp_path), EMULATE_STEP: raw}
    with pytest.raises(ContractError, match=EMULATE_STEP) as err:
        LearnerEnv.from_env(env)
    assert message in str(err.value)


def test_the_emulated_step_is_read_and_refused_for_several_ranks(tmp_path) -> None:
    env = learner_env(tmp_path)
    assert LearnerEnv.from_env(env).emulate_step == 0.0
    assert LearnerEnv.from_env({**env, EMULATE_STEP: "0.25"}).emulate_step == 0.25
    with pytest.raises(ContractError, match="single-rank"):
        LearnerEnv.from_env({**env, EMULATE_STEP: "0.25", "WORLD_SIZE": "2"})


def test_memory_estimate_counts_the_copies() -> None:
    # P = 1000 values (4000 bytes a copy), 2 islands: learners 2 x 6 copies, syncer 5 + 1.
    assert memory_estimate(1000, 2) == 2 * 24000 + 24000


def test_a_paced_step_is_read_and_refused_beside_an_emulated_one(tmp_path) -> None:
    env = learner_env(tmp_path)
    assert LearnerEnv.from_env(env).pace_step == 0.0
    assert LearnerEnv.from_env({**env, PACE_STEP: "0.2"}).pace_step == 0.2
    with pytest.raises(ContractError, match=PACE_STEP) as err:
        LearnerEnv.from_env({**env, PACE_STEP: "-0.1"})
    assert "must be in [0, 60]" in str(err.value)
    with pytest.raises(ContractError, match="has its own pace"):
        LearnerEnv.from_env({**env, PACE_STEP: "0.2", EMULATE_STEP: "0.05"})


@pytest.mark.parametrize(
    ("compute", "slowdown", "pace", "expected"),
    [
        (0.05, 1.0, 0.0, 0.0),  # a plain step: no sleep
        (0.05, 3.0, 0.0, 0.10),  # a 3x straggler sleeps twice its compute
        (0.05, 1.0, 0.2, 0.15),  # paced: padded to 0.2 s
        (0.05, 3.0, 0.2, 0.55),  # a paced 3x island: padded to 0.6 s, whatever its compute
        (0.25, 1.0, 0.2, 0.0),  # a compute over the pace sleeps nothing (counted by the loop)
    ],
)
def test_step_sleep_pads_to_the_pace_or_slows_a_straggler(
    compute: float, slowdown: float, pace: float, expected: float
) -> None:
    assert step_sleep(compute, slowdown=slowdown, pace=pace) == pytest.approx(expected)
