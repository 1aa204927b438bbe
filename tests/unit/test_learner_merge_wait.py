"""sync.mergeWait: when a learner that blocks for its merge (K = M, or τ = 0) waits for a late
one. "overlap" (the default) waits τ steps after the push; "nextPush" only polls from τ on and
waits at the last step before the fragment is due again, H - 1 steps after the push
(core/grace.merge_wait_steps, learner/step_plan.plan_step's deadline). Schedules derived by hand."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.core.grace import merge_wait_steps
from diloco_trainer.learner.step_plan import plan_step

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step


def test_merge_wait_steps_is_the_overlap_or_the_step_before_the_next_push() -> None:
    assert merge_wait_steps(merge_wait="overlap", overlap=2, inner_steps=8) == 2
    assert merge_wait_steps(merge_wait="nextPush", overlap=2, inner_steps=8) == 7  # 8 - 1
    # An overlap already past H - 1 is kept: nextPush never waits earlier than τ.
    assert merge_wait_steps(merge_wait="nextPush", overlap=10, inner_steps=8) == 10
    # τ = 0 (plain DiLoCo, blocking): nextPush still waits only before the next push.
    assert merge_wait_steps(merge_wait="nextPush", overlap=0, inner_steps=8) == 7
    assert merge_wait_steps(merge_wait="nextPush", overlap=0, inner_steps=1) == 0


def test_an_unknown_rule_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"sync\.mergeWait"):
        merge_wait_steps(merge_wait="never", overlap=2, inner_steps=8)


def plans(deadline: int | None) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(step, wait, poll) after steps 9..16 of one fragment (H = 8, τ = 2) pushed at step 8 whose
    merge never arrives (so it stays in flight)."""
    out = []
    for at in range(9, 17):
        p = plan_step(
            at, inner_steps=8, offsets=[0], overlap=2, pushed_at={0: 8}, deadline=deadline
        )
        out.append((at, p.wait, p.poll))
    return out


def test_overlap_waits_tau_steps_after_the_push_then_polls() -> None:
    expected = [(9, (), ()), (10, (0,), ())] + [(s, (), (0,)) for s in range(11, 17)]
    assert plans(None) == expected
    assert plans(2) == expected  # the default deadline is the overlap


def test_next_push_polls_from_tau_and_waits_just_before_the_fragment_is_due_again() -> None:
    expected = [
        (9, (), ()),  # inside the overlap: nothing
        (10, (), (0,)),  # τ after the push: applied if it is there, no wait
        (11, (), (0,)),
        (12, (), (0,)),
        (13, (), (0,)),
        (14, (), (0,)),
        (15, (0,), ()),  # H - 1 after the push: wait (bounded) so the push at 16 carries it
        (16, (), (0,)),  # still missing after the budget: skipped at 16 (below), polled on
    ]
    assert plans(7) == expected
    at_16 = plan_step(16, inner_steps=8, offsets=[0], overlap=2, pushed_at={0: 8}, deadline=7)
    assert at_16.skip == (0,) and at_16.push == ()


def test_a_deadline_before_the_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match="deadline"):
        plan_step(10, inner_steps=8, offsets=[0], overlap=2, pushed_at={0: 8}, deadline=1)


def test_the_spec_knob_defaults_to_overlap_and_refuses_a_wrong_value_by_name() -> None:
    assert make_spec().sync.merge_wait == "overlap"
    assert make_spec(mergeWait="nextPush").sync.merge_wait == "nextPush"
    with pytest.raises(ConfigError, match=r"sync\.mergeWait"):
        make_spec(mergeWait="later")


def test_the_learner_uses_the_deadline_only_when_it_blocks() -> None:
    # make_spec: 2 islands, H = 4, τ = 2. K = M = 2 blocks: nextPush waits at H - 1 = 3.
    blocking, _ = make_sync(make_spec(quorum=2, mergeWait="nextPush"), FakeLink(outer_lr=1.0))
    assert blocking.blocking and blocking.deadline == 3
    default, _ = make_sync(make_spec(quorum=2), FakeLink(outer_lr=1.0))
    assert default.blocking and default.deadline == 2
    # K < M never blocks: the rule has nothing to move, it polls from τ as before.
    decoupled, _ = make_sync(make_spec(quorum=1, mergeWait="nextPush"), FakeLink(outer_lr=1.0))
    assert not decoupled.blocking and decoupled.deadline == 2


def test_the_ablation_installs_a_late_merge_where_each_rule_says() -> None:
    from bench.studies.ablation_sim import Knobs, install_after

    # H = 30, τ = 5 (decoupled_quality's setup).
    assert install_after(Knobs(overlap=5), 30) == 5  # on time
    assert install_after(Knobs(overlap=5, late=20), 30) == 5  # blocks at τ: wall time, not steps
    assert install_after(Knobs(overlap=5, late=3, merge_wait="nextPush"), 30) == 5
    assert install_after(Knobs(overlap=5, late=20, merge_wait="nextPush"), 30) == 20
    assert install_after(Knobs(overlap=5, late=40, merge_wait="nextPush"), 30) == 29  # H - 1


def test_a_blocking_learner_with_next_push_trains_past_tau_and_applies_before_next_push() -> None:
    # K = M (2 of 2), H = 4, τ = 2, nextPush: the merge of the push after step 4 is held back.
    # Under "overlap" step 6 would block (up to the 2 s budget); here steps 5 and 6 only check.
    link = FakeLink(outer_lr=0.25)
    spec = make_spec(quorum=2, mergeWait="nextPush", heartbeatTimeoutSeconds=2)
    sync, w = make_sync(spec, link)
    assert sync.blocking and sync.deadline == 3
    for _ in range(3):
        step(sync, w)
    link.hold = True
    assert step(sync, w) == {}  # step 4: pushed (w = 4, Δ = -4: global 0 - 0.25 x -4 = 1)
    assert step(sync, w) == {}  # step 5
    assert step(sync, w) == {}  # step 6 = 4 + τ: checked, not there, no wait
    assert sync.take_waited() == 0.0
    assert 0 in sync.inflight
    link.release()
    assert step(sync, w) != {}  # step 7 = 4 + H - 1: there, applied before the push at 8
    # global 1 + the 3 steps since the push at 4: w = 1 + (7 - 4) = 4.
    assert torch.equal(w.detach(), torch.full((2,), 4.0))
    assert sync.fragments[0].counters.steps == 3
    step(sync, w)  # step 8: the fragment is due again and idle: pushed, not skipped
    assert len(link.pushes) == 2
