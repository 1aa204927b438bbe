"""The learner's step cap (learner/fragment_state.at_step_cap, FragmentSync._hold): an island
whose merges do not come back stops stepping once a fragment holds as many steps since its base
as one push may carry (core/push_bounds.max_push_steps, the bound the syncer refuses by), instead
of stepping on and pushing work the syncer refuses as steps_out_of_range (issue 22).

Driven step by step against test_learner_fragment_sync's fake link, whose merges are held back
(hold=True) until the test releases them: the fault is "no answer from the syncer"."""

from __future__ import annotations

import threading
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core.push_bounds import STEP_ROUNDS, max_push_steps
from diloco_trainer.learner.fragment_state import FragmentCounters, FragmentState, at_step_cap
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.syncer.intake import guards
from torch import nn

from .test_learner_fragment_sync import FakeLink, make_sync, step

H, TAU = 4, 2
MOST = 4 * H + TAU  # STEP_ROUNDS x H + τ, written out: 18 steps


def cap_spec(**sync: Any) -> JobSpec:
    """H = 4, τ = 2, K = 1 of 2 islands: a decoupled learner never blocks for a merge."""
    return parse_spec(
        {
            "islands": {"count": 2},
            "inner": {"steps": H},
            "sync": {
                "fragments": 1,
                "overlapSteps": TAU,
                "quorum": 1,
                "compression": "none",
                # The step cap's hold alone: a late merge's hold at ceil(H / 2)
                # (sync.lateMergeHold auto) is tests/unit/test_learner_late_hold.py's.
                "lateMergeHold": "off",
                **sync,
            },
        }
    )


class HeldLink(FakeLink):
    """FakeLink whose merges wait for release(); a push the learner cancelled (it pushed the
    fragment again) is never answered."""

    def release(self) -> None:
        for future, result in self.held:
            if not future.cancelled():
                future.set_result(result)
        self.held.clear()


def steps_in_thread(sync: FragmentSync, w: nn.Parameter, count: int) -> threading.Thread:
    thread = threading.Thread(target=lambda: [step(sync, w) for _ in range(count)], daemon=True)
    thread.start()
    return thread


def wait_for(condition: Any, what: str, timeout: float = 30.0) -> None:
    """Poll (a bounded join of nothing: no bare sleep) until `condition()` holds."""
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_max_push_steps_is_one_rule_for_learner_and_syncer() -> None:
    spec = cap_spec()
    assert STEP_ROUNDS == 4
    assert max_push_steps(spec) == MOST == 18
    # The syncer's guard refuses by the very same function (re-exported, not a copy).
    assert guards.max_push_steps is max_push_steps
    assert guards.WorkBounds.from_spec(spec).max_steps == MOST


def test_at_step_cap_lists_fragments_at_or_over_the_bound() -> None:
    states = [FragmentState(names=["a"]), FragmentState(names=["b"]), FragmentState(names=["c"])]
    states[0].counters = FragmentCounters(steps=17)  # one more step is still a push of 18
    states[1].counters = FragmentCounters(steps=18)  # a push now carries 18: the most accepted
    states[2].counters = FragmentCounters(steps=25)  # (only after a fault: over the bound)
    assert at_step_cap(states, 18) == [1, 2]
    assert at_step_cap(states, 26) == []


def test_an_unanswered_island_holds_at_the_cap_and_steps_on_after_the_merge() -> None:
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(cap_spec(), link)
    thread = steps_in_thread(sync, w, 22)
    # Pushed after step 4 (4 steps), skipped at 8, 12, 16 (still in flight); after step 18 the
    # fragment holds 18 steps since its base: the learner takes no step 19.
    wait_for(lambda: sync.held_since is not None, "the learner to hold")
    assert thread.is_alive()
    assert link.progress["holding"] is True  # what its heartbeats tell the syncer
    assert sync.fragments[0].counters.steps == MOST
    assert sync.position == MOST
    assert torch.equal(w.detach(), torch.full((2,), float(MOST)))  # w += 1 per step taken
    assert [meta.steps for _, meta, _ in link.pushes] == [4]
    link.hold = False
    link.release()  # the merge of the push at step 4 arrives
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert sync.held_since is None and link.progress["holding"] is False
    assert sync.take_waited() > 0  # the hold is counted as time waiting for the syncer
    # Steps 19..22 were taken; the next push (due at 20) carries steps 5..20: 16 <= 18.
    assert sync.position == 22
    assert [meta.steps for _, meta, _ in link.pushes] == [4, 16]


def test_a_lost_push_is_pushed_again_at_the_cap_never_over_it() -> None:
    # The merge of the push at step 4 never comes (a syncer that lost it). Once the wait budget
    # (heartbeatTimeoutSeconds 0.3 here + τ x step time 0.2 s) has passed, the held learner
    # pushes the fragment again with exactly 18 steps, the most the syncer accepts, and steps
    # on once that push is merged.
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(cap_spec(heartbeatTimeoutSeconds=0.3), link)
    thread = steps_in_thread(sync, w, 20)
    wait_for(lambda: len(link.pushes) == 2, "the push again")
    assert [meta.steps for _, meta, _ in link.pushes] == [4, MOST]
    assert thread.is_alive() and sync.position == MOST
    link.hold = False
    link.release()  # the first push was cancelled and stays unanswered; the second is merged
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert sync.position == 20
    assert all(meta.steps <= MOST for _, meta, _ in link.pushes)
