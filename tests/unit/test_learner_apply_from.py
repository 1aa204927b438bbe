"""sync.applyFrom: from when a learner applies the merge of its push. "overlap" (the default)
applies it from τ steps after the push; "arrival" from the step after the push, as soon as it has
arrived, with τ (or sync.mergeWait's deadline) still the step a blocking learner waits at
(learner/step_plan.poll_from_steps, plan_step's and plan_idle's poll_from). Schedules derived by
hand."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.learner.step_plan import plan_idle, plan_step, poll_from_steps

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step


def test_poll_from_is_the_overlap_or_the_step_after_the_push() -> None:
    assert poll_from_steps(apply_from="overlap", overlap=5) == 5
    assert poll_from_steps(apply_from="arrival", overlap=5) == 1
    assert poll_from_steps(apply_from="arrival", overlap=1) == 1
    # τ = 0: the push step itself is the wait step under both rules.
    assert poll_from_steps(apply_from="overlap", overlap=0) == 0
    assert poll_from_steps(apply_from="arrival", overlap=0) == 0


def test_an_unknown_rule_and_a_negative_overlap_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"sync\.applyFrom"):
        poll_from_steps(apply_from="soon", overlap=2)
    with pytest.raises(ValueError, match=r"sync\.overlapSteps"):
        poll_from_steps(apply_from="arrival", overlap=-1)


def plans(
    poll_from: int | None, *, overlap: int = 3, deadline: int | None = None
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(step, wait, poll) after steps 9..16 of one fragment (H = 8) pushed at step 8 whose merge
    never arrives (so it stays in flight)."""
    out = []
    for at in range(9, 17):
        p = plan_step(
            at,
            inner_steps=8,
            offsets=[0],
            overlap=overlap,
            pushed_at={0: 8},
            deadline=deadline,
            poll_from=poll_from,
        )
        out.append((at, p.wait, p.poll))
    return out


def test_overlap_touches_nothing_before_tau() -> None:
    # τ = 3: steps 9 and 10 leave the fragment alone, 11 waits, then it is polled.
    expected = [(9, (), ()), (10, (), ()), (11, (0,), ())] + [(s, (), (0,)) for s in range(12, 17)]
    assert plans(None) == expected
    assert plans(3) == expected  # poll_from τ is the default


def test_arrival_polls_from_the_step_after_the_push_and_still_waits_at_tau() -> None:
    expected = [
        (9, (), (0,)),  # the step after the push: applied if it is back, no wait
        (10, (), (0,)),
        (11, (0,), ()),  # 8 + τ: wait (bounded), as under overlap
        (12, (), (0,)),  # after a wait that ran out: polled, as under overlap
        (13, (), (0,)),
        (14, (), (0,)),
        (15, (), (0,)),
        (16, (), (0,)),
    ]
    assert plans(1) == expected


def test_arrival_with_next_push_polls_from_the_step_after_and_waits_at_h_minus_1() -> None:
    # τ = 2, mergeWait nextPush: deadline H - 1 = 7, so the wait is at 8 + 7 = 15.
    expected = [(s, (), (0,)) for s in range(9, 15)] + [(15, (0,), ()), (16, (), (0,))]
    assert plans(1, overlap=2, deadline=7) == expected
    # The same under overlap starts polling only at 8 + τ = 10.
    assert plans(None, overlap=2, deadline=7)[:2] == [(9, (), ()), (10, (), (0,))]


def test_no_overlap_is_the_same_under_both_rules() -> None:
    # τ = 0: pushed and waited for at step 8, polled from 9 if the wait ran out.
    for poll_from in (None, 0):
        at_8 = plan_step(
            8, inner_steps=8, offsets=[0], overlap=0, pushed_at={}, poll_from=poll_from
        )
        assert (at_8.push, at_8.wait, at_8.poll) == ((0,), (0,), ())
        assert plans(poll_from, overlap=0)[0] == (9, (), (0,))


def test_arrival_with_two_fragments_polls_each_from_the_step_after_its_own_push() -> None:
    # H = 8, offsets 0 and 4, τ = 3: fragment 1 pushed at 12, fragment 0 at 8 (still in flight).
    def at(s: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        p = plan_step(
            s, inner_steps=8, offsets=[0, 4], overlap=3, pushed_at={0: 8, 1: 12}, poll_from=1
        )
        return p.push, p.wait, p.poll

    assert at(12) == ((), (), (0,))  # fragment 1 pushed at 12 is not polled at its push step
    assert at(13) == ((), (), (0, 1))
    assert at(15) == ((), (1,), (0,))  # 12 + τ: fragment 1 is waited for, 0 polled
    # Fragment 0 due again while in flight: skipped (not pushed twice on one base), still polled.
    assert at(16) == ((), (), (0, 1))
    assert plan_step(
        16, inner_steps=8, offsets=[0, 4], overlap=3, pushed_at={0: 8, 1: 12}, poll_from=1
    ).skip == (0,)


def test_a_first_poll_past_the_overlap_or_negative_is_refused() -> None:
    for poll_from in (4, -1):
        with pytest.raises(ValueError, match="first poll"):
            plan_step(
                9, inner_steps=8, offsets=[0], overlap=3, pushed_at={0: 8}, poll_from=poll_from
            )


def test_plan_idle_polls_from_the_first_poll() -> None:
    # A phase delay at positions 8 and 9 of a fragment pushed at 8 (τ = 3).
    assert plan_idle(8, overlap=3, pushed_at={0: 8}, poll_from=1).poll == ()
    assert plan_idle(9, overlap=3, pushed_at={0: 8}, poll_from=1).poll == (0,)
    assert plan_idle(9, overlap=3, pushed_at={0: 8}).poll == ()  # overlap: from 11
    assert plan_idle(11, overlap=3, pushed_at={0: 8}).poll == (0,)


def test_the_spec_knob_defaults_to_overlap_and_refuses_a_wrong_value_by_name() -> None:
    assert make_spec().sync.apply_from == "overlap"
    assert make_spec(applyFrom="arrival").sync.apply_from == "arrival"
    with pytest.raises(ConfigError, match=r"sync\.applyFrom"):
        make_spec(applyFrom="early")


def test_the_learner_polls_from_the_rule_whether_or_not_it_blocks() -> None:
    # make_spec: 2 islands, H = 4, τ = 2.
    for quorum in (1, 2):
        arrival, _ = make_sync(make_spec(quorum=quorum, applyFrom="arrival"), FakeLink(1.0))
        assert arrival.poll_from == 1 and arrival.deadline == 2
        default, _ = make_sync(make_spec(quorum=quorum), FakeLink(1.0))
        assert default.poll_from == 2


def test_a_blocking_learner_applies_a_merge_back_at_once_the_step_after_its_push() -> None:
    # K = M (2 of 2), H = 4, τ = 2, arrival; the fake syncer merges at once (outer lr 0.25).
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=2, applyFrom="arrival", overlapMode="fixed"), link)
    assert sync.blocking
    for _ in range(3):
        assert step(sync, w) == {}
    assert step(sync, w) == {}  # step 4: pushed (w = 4, Δ = -4: global 0 - 0.25 x -4 = 1)
    assert step(sync, w) != {}  # step 5 = 4 + 1, before τ: applied (overlap: at step 6)
    # global 1 + the one step since the push: w = 1 + (5 - 4) = 2 (overlap would give 3 at 6).
    assert torch.equal(w.detach(), torch.full((2,), 2.0))
    assert sync.fragments[0].version == 1 and sync.fragments[0].counters.steps == 1
    assert sync.take_waited() == 0.0
    for _ in range(3):
        step(sync, w)  # steps 6-8: w = 5 at the push after step 8
    # Δ = global 1 - local 5 = -4, carrying the kept step and steps 6-8.
    _, meta, encoded = link.pushes[1]
    assert torch.equal(encoded["w"], torch.full((2,), -4.0))
    assert (meta.base_version, meta.steps, meta.tokens) == (1, 4, 40)


def test_a_merge_back_after_two_steps_is_applied_then_not_at_tau() -> None:
    # K = M (2 of 2), H = 4, τ = 3, arrival: the merge of the push after step 4 is held back
    # over step 5 and released before step 6, one step before the wait at 4 + τ = 7.
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(
        make_spec(quorum=2, overlapSteps=3, applyFrom="arrival", overlapMode="fixed"), link
    )
    for _ in range(3):
        step(sync, w)
    link.hold = True
    assert step(sync, w) == {}  # step 4: pushed
    assert step(sync, w) == {}  # step 5: checked, not back, no wait
    assert sync.take_waited() == 0.0 and 0 in sync.inflight
    link.release()
    assert step(sync, w) != {}  # step 6: back, applied
    # global 1 + the 2 steps since the push: w = 1 + (6 - 4) = 3.
    assert torch.equal(w.detach(), torch.full((2,), 3.0))
    assert sync.fragments[0].counters.steps == 2
    assert step(sync, w) == {}  # step 7 (the old apply step): nothing left to apply


def test_a_decoupled_learner_applies_at_arrival_too() -> None:
    # K = 1 of 2 (does not block), H = 4, τ = 2, arrival: the merge back at once is applied at 5.
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, applyFrom="arrival"), link)
    assert not sync.blocking
    for _ in range(4):
        step(sync, w)
    assert step(sync, w) != {}
    assert torch.equal(w.detach(), torch.full((2,), 2.0))
