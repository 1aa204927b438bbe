"""Where the learner's wall time goes (learner/step_costs.WindowCosts, and FragmentSync's count
of seconds blocked on the syncer): the split the progress line reports and bench/learner_overlap
reads."""

from __future__ import annotations

import threading
import time

import pytest
from diloco_trainer.learner.step_costs import (
    WAIT_HINT_SHARE,
    SyncPathPhases,
    WaitMeter,
    WindowCosts,
    timed_part,
    wait_hint,
)

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step
from .test_learner_step_cap import HeldLink, cap_spec, steps_in_thread, wait_for


def test_a_window_splits_training_sync_path_and_waiting() -> None:
    costs = WindowCosts()
    costs.add_step(0.5)
    costs.add_after(0.25, waited=0.0)  # a push: Δ and its encoding on the training thread
    costs.add_step(0.5)
    costs.add_after(2.0, waited=1.75)  # a blocking wait of 1.75 s inside 2 s after the step
    assert costs.steps == 2
    assert costs.training == pytest.approx(1.0)
    assert costs.sync_path == pytest.approx(0.25 + 0.25)
    assert costs.waiting == pytest.approx(1.75)
    assert costs.line() == (
        "2 steps: 1.000s training, 0.500s sync path, 1.750s waiting for the syncer; 0.00s cpu"
    )


def test_a_wait_never_counts_for_more_than_the_time_after_the_step() -> None:
    costs = WindowCosts()
    costs.add_after(0.5, waited=0.75)  # clocks read at different moments: clamp, never negative
    costs.add_after(0.25, waited=-0.1)
    assert costs.waiting == pytest.approx(0.5)
    assert costs.sync_path == pytest.approx(0.25)


def test_a_blocking_learner_counts_its_wait_for_the_merge() -> None:
    # K = M (quorum 2 of 2), H = 4, τ = 2: pushed after step 4, the merge is needed after step 6;
    # it is held back and released 0.5 s after the learner reached step 6.
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=2, overlapMode="fixed"), link)
    assert sync.blocking
    for _ in range(3):
        step(sync, w)
    assert sync.take_waited() == 0.0  # nothing awaited yet
    link.hold = True
    step(sync, w)  # step 4: the push, its merge held
    link.hold = False
    step(sync, w)  # step 5: in flight, nothing needed yet
    assert sync.take_waited() == 0.0
    started = time.monotonic()
    thread = threading.Thread(target=lambda: step(sync, w), daemon=True)
    thread.start()
    wait_for(lambda: sync.position == 6, "step 6")
    time.sleep(0.5)  # the merge's latency beyond the overlap (not synchronisation)
    link.release()
    thread.join(timeout=30)
    elapsed = time.monotonic() - started
    waited = sync.take_waited()
    assert 0.25 <= waited <= elapsed
    assert sync.take_waited() == 0.0  # taken once


def test_a_window_mostly_waiting_gets_the_hint_once_worded_for_its_rule() -> None:
    costs = WindowCosts()
    for _ in range(20):
        costs.add_step(0.05)  # 1.0 s training
    costs.add_after(0.30, 0.25)  # 0.05 s sync path, 0.25 s waiting: 0.25 / 1.30 = 19%
    assert costs.waiting_share() < WAIT_HINT_SHARE
    assert wait_hint(costs, merge_wait="overlap", overlap_mode="auto", tau=29) is None
    costs.add_after(0.05, 0.05)  # 0.30 / 1.35 = 22%
    hint = wait_hint(costs, merge_wait="overlap", overlap_mode="auto", tau=29)
    assert hint is not None and "22%" in hint and "the 29 steps" in hint and "nextPush" in hint
    assert "at most H − 1" in hint and "inner.steps" in hint
    # fixed: the cap is sync.overlapSteps, and auto is the remedy.
    fixed = wait_hint(costs, merge_wait="overlap", overlap_mode="fixed", tau=5)
    assert fixed is not None and "the 5 steps" in fixed and "overlapMode: auto" in fixed
    # no push yet fitted: no number is claimed
    assert "its steps" in (
        wait_hint(costs, merge_wait="overlap", overlap_mode="auto", tau=None) or ""
    )
    # nextPush already trains on: its waits are a syncer slower than a whole round.
    assert wait_hint(costs, merge_wait="nextPush", overlap_mode="auto", tau=29) is None
    assert WindowCosts().waiting_share() == 0.0


def test_the_sync_path_by_part_sums_each_part_and_names_the_per_step_cost() -> None:
    """SyncPathPhases (issue 45): seconds and calls per part; the line gives each part's total,
    calls and milliseconds a call, and the whole per step, by hand: push 2 calls of 3 and 5 ms
    = 8 ms, 4.00 ms each; plan 1 ms; all 9 ms over 3 steps = 3.00 ms a step."""
    phases = SyncPathPhases()
    phases.add("push", 0.003)
    phases.add("push", 0.005)
    phases.add("plan", 0.001)
    phases.add("apply", -0.5)  # a clock going back counts as nothing
    assert phases.seconds["push"] == pytest.approx(0.008) and phases.calls["push"] == 2
    assert phases.total() == pytest.approx(0.009)
    line = phases.line(3)
    assert "push 0.008s (2 calls, 4.00 ms each)" in line
    assert "plan 0.001s (1 calls, 1.00 ms each)" in line
    assert "apply 0.000s (1 calls, 0.00 ms each)" in line
    assert "receipt" not in line  # parts never called are left out
    assert line.endswith("in all 0.009s (3.00 ms a step)")
    with pytest.raises(ValueError, match="no sync path phase 'pull'"):
        phases.add("pull", 0.1)


def test_a_timed_part_counts_each_call_returned_or_raised() -> None:
    class Holder:
        def __init__(self) -> None:
            self.phases = SyncPathPhases()

        @timed_part("receipt")
        def receive(self, fail: bool) -> int:
            if fail:
                raise ValueError("refused")
            return 7

    h = Holder()
    assert h.receive(False) == 7
    with pytest.raises(ValueError, match="refused"):
        h.receive(True)
    assert h.phases.calls["receipt"] == 2 and h.phases.calls["push"] == 0
    assert h.phases.seconds["receipt"] >= 0.0


def test_the_wait_meter_gives_each_reader_the_share_since_its_previous_read() -> None:
    """The heartbeats' `waiting` (issue 45), by hand: each reader (a syncer shard's heartbeats)
    gets the waited share of the wall time since its own previous read, a wait in progress
    counted up to the read."""
    meter = WaitMeter(now=100.0)
    meter.begin(101.0)
    meter.end(103.0)  # 2 s waited
    assert meter.share_since(0, 105.0) == 0.4  # 100..105: 2 of 5 s
    meter.begin(106.0)  # in progress at the next reads
    assert meter.waited(110.0) == 6.0
    assert meter.share_since(0, 110.0) == 0.8  # 105..110: 106..110, 4 of 5 s
    assert meter.share_since(1, 110.0) == 0.6  # reader 1's first: 100..110, 2 + 4 of 10 s
    meter.end(111.0)
    assert meter.share_since(0, 115.0) == 0.2  # 110..115: 110..111, 1 of 5 s
    assert meter.share_since(0, 115.0) is None  # no time since: no share
    meter.begin(120.0)
    meter.begin(121.0)  # waits do not nest: still the one from 120
    meter.end(122.0)
    meter.end(123.0)  # none in progress: nothing
    assert meter.share_since(0, 125.0) == 0.2  # 115..125: 120..122, 2 of 10 s
    assert meter.share_since(1, 140.0) == 0.1  # 110..140: 110..111 and 120..122, 3 of 30 s
    assert meter.share_since(2, 140.0) == 0.225  # reader 2's first: 100..140, 2 + 5 + 2 of 40 s
    meter.begin(140.0)
    assert meter.share_since(0, 150.0) == 0.4  # 125..150: 140..150, 10 of 25 s
    assert meter.share_since(0, 151.0) == 1.0  # all of it
    assert meter.share_since(3, 151.0) == 0.3922  # 100..151: 2 + 5 + 2 + 11 of 51 s, 4 places


def test_a_hold_at_the_step_cap_is_waiting_in_the_meter_while_it_lasts() -> None:
    """FragmentSync.collect marks its waits: an island held at the step cap reports a share
    near 1 in a heartbeat sent during the hold (not only once it ended)."""
    link = HeldLink(outer_lr=0.25)
    link.hold = True
    sync, w = make_sync(cap_spec(), link)
    thread = steps_in_thread(sync, w, 22)
    wait_for(lambda: sync.held_since is not None, "the learner to hold")
    link.waits.share_since(0, time.monotonic())  # the heartbeat before: the window starts
    began = link.waits.waited(time.monotonic())
    wait_for(lambda: link.waits.waited(time.monotonic()) > began + 0.3, "0.3 s of the hold")
    share = link.waits.share_since(0, time.monotonic())
    assert share is not None and share >= 0.5, share
    link.hold = False
    link.release()
    thread.join(timeout=30)
    assert not thread.is_alive()
    stepping = link.waits.waited(time.monotonic())
    assert link.waits.waited(time.monotonic() + 5.0) == stepping  # no wait in progress
