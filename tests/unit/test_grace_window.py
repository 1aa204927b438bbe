"""The auto grace window and the push-time prediction (pure functions, values by hand)."""

from __future__ import annotations

import pytest
from diloco_trainer.core.grace import (
    expected_push_time,
    grace_window,
    in_flight_seconds,
    net_sync_time,
)


def window(**kw: float) -> float:
    args = {
        "step_time": 0.5,
        "overlap_steps": 20,
        "quorum_wait": 0.0,
        "sync_net": 0.0,
        "cap": 60.0,
        "default": 1.0,
    }
    return grace_window(**{**args, **kw})  # type: ignore[arg-type]


def test_grace_is_half_the_slack() -> None:
    # slack = 20·0.5 − (1 + 2) = 7 s; γ·slack = 3.5 s.
    assert window(quorum_wait=1.0, sync_net=2.0) == pytest.approx(3.5)


def test_grace_floor_is_one_step_and_cap_is_the_timeout() -> None:
    assert window(overlap_steps=0) == 0.5  # τ = 0: no slack, one step
    assert window(sync_net=100.0) == 0.5  # negative slack: one step
    assert window(overlap_steps=1000, cap=3.0) == 3.0


def test_grace_without_a_step_time_is_the_default_capped() -> None:
    assert window(step_time=None) == 1.0  # type: ignore[arg-type]
    assert window(step_time=None, cap=0.2) == 0.2  # type: ignore[arg-type]


def test_grace_refuses_bad_timings() -> None:
    with pytest.raises(ValueError, match="sync_net"):
        window(sync_net=-1.0)
    with pytest.raises(ValueError, match="overlap"):
        window(overlap_steps=-1)


def test_net_sync_time_subtracts_what_the_syncer_held() -> None:
    assert net_sync_time(6.5, 5.0) == 1.5
    assert net_sync_time(4.0, 5.0) == 0.0  # clocks disagree: never negative


def eta(**kw: object) -> float | None:
    args: dict[str, object] = {
        "inner_steps": 20,
        "offsets": (0, 10),
        "fragment": 0,
        "reported_step": 15,
        "reported_at": 100.0,
        "step_time": 0.5,
        "pushed_since_report": False,
        "now": 100.0,
    }
    return expected_push_time(**{**args, **kw})  # type: ignore[arg-type]


def test_expected_push_time_by_hand() -> None:
    assert eta() == 102.5  # step 15 -> 20: 5 steps of 0.5 s
    assert eta(fragment=1) == 107.5  # step 15 -> 30 (offset 10): 15 steps
    assert eta(reported_step=20) == 100.0  # at the sync point, push not seen yet: due now
    assert eta(reported_step=20, pushed_since_report=True) == 110.0  # the next one: 20 steps
    assert eta(now=200.0) == 200.0  # overdue: arriving now
    assert eta(inner_steps=0) is None
    assert eta(fragment=2) is None


def test_in_flight_steps_is_the_overlap_for_blocking_learners_and_h_otherwise() -> None:
    from diloco_trainer.core.grace import in_flight_steps

    assert in_flight_steps(learners_block=True, overlap_steps=5, inner_steps=30) == 5
    assert in_flight_steps(learners_block=False, overlap_steps=5, inner_steps=30) == 30
    assert in_flight_steps(learners_block=False, overlap_steps=40, inner_steps=30) == 40
    assert in_flight_steps(learners_block=False, overlap_steps=5, inner_steps=0) == 5


def test_share_of_slack_is_half_for_blocking_learners_and_all_of_it_otherwise() -> None:
    from diloco_trainer.core.grace import share_of_slack

    assert share_of_slack(learners_block=True) == 0.5
    assert share_of_slack(learners_block=False) == 1.0
    # The share scales the slack, not the floor or the cap: slack = 20·0.5 − 3 = 7 s.
    assert window(quorum_wait=1.0, sync_net=2.0, gamma=1.0) == pytest.approx(7.0)
    assert window(sync_net=100.0, gamma=1.0) == 0.5
    assert window(overlap_steps=1000, cap=3.0, gamma=1.0) == 3.0


def test_auto_grace_of_a_decoupled_job_is_sized_from_h_steps() -> None:
    """K=1 of 4 with τ=5, H=30, steps of 0.05 s, no quorum wait, 0.1 s net sync: learners do not
    block, so slack = 30·0.05 − 0.1 = 1.4 s and the window is all of it (γ = 1): 1.4 s; at K = M
    (blocking) slack = 5·0.05 − 0.1 = 0.15 s and the window ½·0.15 = 0.075 s."""
    from diloco_trainer.api.spec import parse_spec
    from diloco_trainer.syncer.state.records import round_policy

    def policy(quorum: int):  # type: ignore[no-untyped-def]
        spec = parse_spec(
            {
                "islands": {"count": 4},
                "inner": {"steps": 30},
                "sync": {"quorum": quorum, "overlapSteps": 5, "fragments": 1},
            }
        )
        return round_policy(spec, 1)

    from diloco_trainer.core.grace import in_flight_steps, share_of_slack

    for quorum, blocks, expected in ((1, False, 1.4), (2, False, 1.4), (4, True, 0.075)):
        p = policy(quorum)
        assert p.learners_block is blocks
        tau = in_flight_steps(
            learners_block=p.learners_block, overlap_steps=p.overlap_steps, inner_steps=30
        )
        gamma = share_of_slack(learners_block=p.learners_block)
        assert window(
            step_time=0.05, overlap_steps=tau, sync_net=0.1, gamma=gamma
        ) == pytest.approx(expected)


def test_in_flight_seconds_per_island_round() -> None:
    """τ·t_step island by island (inner.stepsPerIsland), the median of τ_i·t_i."""
    # K < M, τ = 5: islands at 0.1 s on H = 20 and one at 0.3 s on H_i = 6: spans 20·0.1 = 2 s
    # (x3) and 6·0.3 = 1.8 s; the median (of 1.8, 2, 2, 2) is 2 s. τ = H = 20 of the median
    # step time (0.1) gives the same here, but with two slow islands of four: spans 1.8, 1.8, 2,
    # 2 -> 1.9 s, where 20 x the median step time (0.2) would claim 4 s.
    rounds = [(20, 0.1), (20, 0.1), (20, 0.1), (6, 0.3)]
    assert in_flight_seconds(learners_block=False, overlap_steps=5, rounds=rounds) == pytest.approx(
        2.0
    )
    two_slow = [(20, 0.1), (20, 0.1), (6, 0.3), (6, 0.3)]
    assert in_flight_seconds(
        learners_block=False, overlap_steps=5, rounds=two_slow
    ) == pytest.approx(1.9)
    # Blocking learners: τ = the overlap, 5 steps each: 0.5, 0.5, 1.5, 1.5 -> 1.0 s (5 x 0.2).
    assert in_flight_seconds(
        learners_block=True, overlap_steps=5, rounds=two_slow
    ) == pytest.approx(1.0)
    # An island's τ is never below the overlap: H_i = 3 < τ = 5 -> 5 steps of 0.3 = 1.5 s.
    assert in_flight_seconds(
        learners_block=False, overlap_steps=5, rounds=[(3, 0.3)]
    ) == pytest.approx(1.5)
    assert in_flight_seconds(learners_block=False, overlap_steps=5, rounds=[]) is None


def test_grace_window_takes_the_per_island_span() -> None:
    # span 1.9 s − (0.1 + 0.3) = 1.5 s of slack, all of it (γ = 1): 1.5 s, whatever τ·t_step.
    assert window(in_flight=1.9, quorum_wait=0.1, sync_net=0.3, gamma=1.0) == pytest.approx(1.5)


def test_round_in_flight_doctests_pass() -> None:
    """A round's span is no longer than its pushers' hold (H_i − 1 of their t_i at K < M): the
    hand-worked examples of core/grace.round_in_flight (3 x 0.8 s = 2.4 s against the job's 4 s;
    19 x 0.2 = 3.8 s; the job's with nobody known; the overlap's 5 x 0.5 s without a schedule)."""
    import doctest

    from diloco_trainer.core import grace

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(grace.round_in_flight):
        runner.run(test)
    assert (runner.failures, runner.tries) == (0, 4)
