"""An island's share of stopAfter at K = M (learner/drain.py), by hand: the inner steps it trains
before it drains."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.drain import DrainTrigger, share_steps


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
        # 1,000,000 / 2048 = 488.28...: 488 steps, so no merge passes the budget.
        ({"tokens": 1_000_000}, 512, 488),
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


def test_drain_trigger_at_the_share_counting_merged_steps_once() -> None:
    # A learner restarted with 100 steps of the island merged: 500 more to its share of 600.
    trigger = DrainTrigger(share=600, steps_before=100)
    assert not trigger.due(499, tokens=0, stop_at=None)
    assert trigger.due(500, tokens=0, stop_at=None)
    assert not trigger.due(501, tokens=0, stop_at=None)  # once: after it, it trains on


def test_drain_trigger_at_the_syncers_stop_target() -> None:
    trigger = DrainTrigger(share=None, steps_before=0)
    assert not trigger.due(10, tokens=5_000, stop_at=None)  # no target yet
    assert not trigger.due(11, tokens=5_500, stop_at=6_000)
    assert trigger.due(12, tokens=6_000, stop_at=6_000)
    assert not trigger.due(13, tokens=6_500, stop_at=6_000)


def test_drain_trigger_share_is_off_once_the_budget_is_split() -> None:
    """K = M, rounds differ (the syncer says split): a share of 600 steps with 100 merged
    before is not taken at 500 steps run; the stop target (6,000 tokens) ends the part."""
    trigger = DrainTrigger(share=600, steps_before=100)
    assert not trigger.due(500, tokens=5_000, stop_at=None, split=True)  # share off
    assert not trigger.due(510, tokens=5_900, stop_at=6_000, split=True)
    assert trigger.due(520, tokens=6_000, stop_at=6_000, split=True)
    # not split: the same trigger state drains at the share, 100 + 500 = 600, as fixed does
    same = DrainTrigger(share=600, steps_before=100)
    assert not same.due(499, tokens=0, stop_at=None, split=False)
    assert same.due(500, tokens=0, stop_at=None, split=False)


def test_drain_trigger_asks_for_its_target_past_the_share_once_split() -> None:
    """K = M, split: a share of 600 with 100 merged before. Past the share without a target
    the island heartbeats outside the timer, every FINISH_POLL_SECONDS (0.25 s), until its
    target comes; never before its share, unsplit, or once it has a target or drained."""
    trigger = DrainTrigger(share=600, steps_before=100)
    assert not trigger.asks_now(499, None, split=True, now=10.0)  # before the share
    assert not trigger.asks_now(500, None, split=False, now=10.0)  # unsplit: drains on it
    assert trigger.asks_now(500, None, split=True, now=10.0)
    assert not trigger.asks_now(501, None, split=True, now=10.2)  # 0.2 s later: not yet
    assert trigger.asks_now(502, None, split=True, now=10.25)
    assert not trigger.asks_now(503, 6_000, split=True, now=11.0)  # it has its target
    assert trigger.due(504, tokens=6_000, stop_at=6_000, split=True)
    assert not trigger.asks_now(505, None, split=True, now=12.0)  # drained
    assert not DrainTrigger(share=None, steps_before=0).asks_now(9, None, split=True, now=1.0)


def rounds_spec(inner: dict[str, Any], overrides: list[dict[str, Any]], **stop: Any) -> Any:
    return parse_spec(
        {
            "model": {"preset": "gpt-tiny"},
            "islands": {"count": 4, "overrides": overrides},
            "inner": {"steps": 30, "batchSize": 8, "seqLen": 64, **inner},
            "sync": {"quorum": 4},
            "stopAfter": stop,
        }
    )


def test_drain_token_share_with_auto_rounds_and_none_with_differing_pins() -> None:
    """inner.stepsPerIsland auto keeps the share of fixed (1,228,800 / (4 x 512) = 600 steps
    each): it counts while every round is H (DrainTrigger.due's split). A pinned H_i other than
    H: 1/M of the budget each assumed rounds of H, so the syncer's stop target ends the island's
    part instead."""
    auto = {"stepsPerIsland": "auto"}
    assert share_steps(rounds_spec(auto, [], tokens=1_228_800), tokens_per_step=512) == 600
    fixed = {"stepsPerIsland": "fixed"}
    assert share_steps(rounds_spec(fixed, [], tokens=1_228_800), tokens_per_step=512) == 600
    # stopAfter.outerSteps is counted in rounds (round_work), exact whatever H_i: 20 x 30.
    both = rounds_spec(auto, [], outerSteps=20, tokens=10**9)
    assert share_steps(both, tokens_per_step=512) == 600
    pinned = [{"islands": [3], "innerSteps": 10}]
    assert share_steps(rounds_spec({}, pinned, tokens=1_228_800), tokens_per_step=512) is None
    # a pin equal to H changes nothing: 1,228,800 / (4 x 512) = 600 steps each
    same = [{"islands": [3], "innerSteps": 30}]
    assert share_steps(rounds_spec({}, same, tokens=1_228_800), tokens_per_step=512) == 600
