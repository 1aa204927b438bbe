"""An island's share of stopAfter at K = M (learner/drain.py), by hand: the inner steps it trains
before it drains."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.drain import share_steps


def spec_of(*, islands: int = 4, quorum: int = 4, **stop: Any) -> Any:
    return parse_spec(
        {
            "model": {"preset": "gpt-tiny"},
            "islands": {"count": islands},
            "inner": {"steps": 30, "batchSize": 8, "seqLen": 64},
            "sync": {"quorum": quorum},
            "stopAfter": stop,
        }
    )


@pytest.mark.parametrize(
    ("stop", "tokens_per_step", "expected"),
    [
        # 20 rounds of H = 30 steps each.
        ({"outerSteps": 20}, 512, 600),
        # 1,228,800 tokens / (4 islands x 512 a step) = 600 steps exactly.
        ({"tokens": 1_228_800}, 512, 600),
        # 1,000,000 / 2048 = 488.28...: 489 steps, so the islands reach the budget.
        ({"tokens": 1_000_000}, 512, 489),
        # Two replicas: 1024 tokens an island step, half the steps.
        ({"tokens": 1_228_800}, 1024, 300),
        # Both set: the fewer steps (10 x 30 = 300 before 600).
        ({"outerSteps": 10, "tokens": 1_228_800}, 512, 300),
    ],
)
def test_drain_share_at_k_equal_m(
    stop: dict[str, int], tokens_per_step: int, expected: int
) -> None:
    assert share_steps(spec_of(**stop), tokens_per_step=tokens_per_step) == expected


def test_drain_no_share_below_k_equal_m() -> None:
    # K < M: islands run at their own pace; an equal share would idle the fast ones.
    assert share_steps(spec_of(quorum=2, outerSteps=20), tokens_per_step=512) is None
