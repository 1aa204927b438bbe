"""Rank 0's per-fragment bookkeeping: Δ at a push, the weights and counters after a receipt."""

from __future__ import annotations

import torch
from diloco_trainer.learner.fragment_state import FragmentCounters, FragmentState


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def joined(base: torch.Tensor, version: int = 3) -> FragmentState:
    state = FragmentState(names=["w"])
    state.take_global({"w": base}, version)
    return state


def test_counters_since_subtract_a_snapshot() -> None:
    c = FragmentCounters(tokens=100, steps=4, loss_sum=8.0, time_sum=0.5)
    earlier = FragmentCounters(tokens=60, steps=3, loss_sum=6.0, time_sum=0.25)
    assert c.since(earlier) == FragmentCounters(tokens=40, steps=1, loss_sum=2.0, time_sum=0.25)


def test_counters_means() -> None:
    c = FragmentCounters()
    c.add(10, 2.0, 0.5)
    c.add(10, 4.0, 1.5)
    assert (c.tokens, c.steps, c.mean_loss, c.mean_step_time) == (20, 2, 3.0, 1.0)


def test_take_global_overwrites_and_zeroes_the_counters() -> None:
    state = joined(t(1.0, 1.0))
    state.counters.add(10, 1.0, 0.1)
    out = state.take_global({"w": t(7.0, 8.0)}, 9)
    assert torch.equal(out["w"], t(7.0, 8.0))
    assert state.version == 9
    assert state.counters == FragmentCounters()


def test_push_gives_delta_against_the_base_and_snapshots_the_counters() -> None:
    state = joined(t(1.0, 1.0))
    state.counters.add(10, 1.0, 0.1)
    state.counters.add(10, 1.0, 0.1)
    delta = state.begin_push({"w": t(0.0, 2.0)})
    assert torch.equal(delta["w"], t(1.0, -1.0))
    snapshot = FragmentCounters(tokens=20, steps=2, loss_sum=2.0, time_sum=0.2)
    assert state.counters_at_push == snapshot
    state.counters.add(10, 1.0, 0.1)  # the snapshot is a copy, not the live counters
    assert state.counters_at_push.steps == 2


def test_receive_keeps_overlap_steps_and_only_their_counters() -> None:
    state = joined(t(1.0, 1.0))
    for _ in range(4):
        state.counters.add(10, 2.0, 0.1)
    state.begin_push({"w": t(0.0, 2.0)})
    state.counters.add(7, 4.0, 0.5)  # one overlapped step after the push
    out = state.receive({"w": t(5.0, 5.0)}, 4, {"w": t(0.5, 2.5)}, alpha=0.0)
    # 5 + (0.5 - 0) = 5.5 and 5 + (2.5 - 2) = 5.5
    assert torch.equal(out["w"], t(5.5, 5.5))
    assert torch.equal(state.base["w"], t(5.0, 5.0))
    assert state.version == 4
    assert state.counters == FragmentCounters(tokens=7, steps=1, loss_sum=4.0, time_sum=0.5)
    assert state.at_push is None and state.counters_at_push is None


def test_receive_without_a_push_overwrites_and_zeroes_the_counters() -> None:
    state = joined(t(1.0))
    state.counters.add(10, 2.0, 0.1)
    out = state.receive({"w": t(5.0)}, 4, {"w": t(0.5)}, alpha=0.0)
    assert torch.equal(out["w"], t(5.0))
    assert state.counters == FragmentCounters()


def test_every_step_lands_in_exactly_one_push() -> None:
    """Three rounds with 2 overlapped steps each: the pushes' step counts and Δs add up to every
    step taken, none twice (the next Δ covers the kept overlap steps)."""
    state = joined(t(0.0))
    w, pushed_steps, pushed_delta = 0.0, 0, 0.0
    for _ in range(3):
        for _ in range(4):  # steps before the push: each moves w by -1
            w -= 1.0
            state.counters.add(1, 0.0, 0.0)
        delta = state.begin_push({"w": t(w)})
        pushed_steps += state.counters.steps
        pushed_delta += float(delta["w"])
        for _ in range(2):  # overlapped steps
            w -= 1.0
            state.counters.add(1, 0.0, 0.0)
        # The syncer hands back exactly what was pushed (one island, outer SGD lr 1).
        merged = state.base["w"] - delta["w"]
        w = float(state.receive({"w": merged}, state.version + 1, {"w": t(w)}, 0.0)["w"])
    # 3 pushes carried 4, 6, 6 steps; the last 2 overlapped steps are still counted, unpushed.
    assert pushed_steps == 16
    assert state.counters.steps == 2
    assert pushed_delta == 16.0
    assert w == -18.0


def test_receive_computes_from_the_staged_weights_and_keeps_the_host_ones_as_base() -> None:
    """A GPU learner's link stages the merged fragment on the device (device_copies): the new
    weights come from those staged tensors, and the host ones become the base (what compressed
    pulls are applied to). Told apart here by giving the two different values."""
    state = joined(t(1.0, 1.0))
    state.begin_push({"w": t(0.0, 2.0)})
    staged = {"w": t(9.0, 9.0)}
    out = state.receive({"w": t(5.0, 5.0)}, 4, {"w": t(0.5, 2.5)}, alpha=0.0, here=staged)
    # 9 + (0.5 - 0) and 9 + (2.5 - 2), from the staged weights
    assert torch.equal(out["w"], t(9.5, 9.5))
    assert torch.equal(state.base["w"], t(5.0, 5.0))
