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


def test_merge_offset_then_added_into_is_the_received_weights_rule() -> None:
    from diloco_trainer.learner.mixing import added_into, merge_offset_into

    # θ_global = [1, 2], θ_push = [0.5, 0.5], θ_now = [0.75, 1]: the kept steps moved the
    # weights by [0.25, 0.5], so the new weights are θ_global + that = [1.25, 2.5].
    at_push = {"w": t(0.5, 0.5)}
    merge_offset_into({"w": t(1.0, 2.0)}, at_push)
    assert torch.equal(at_push["w"], t(0.5, 1.5))  # θ_global − θ_push
    now = {"w": t(0.75, 1.0)}
    out = added_into(now, at_push)
    assert torch.equal(now["w"], t(1.25, 2.5)) and out["w"] is now["w"]  # in place


def big_state(seed: int) -> tuple[FragmentState, dict[str, torch.Tensor], torch.Generator]:
    from diloco_trainer.learner.push_encoding import ONE_PASS_FROM

    g = torch.Generator().manual_seed(seed)
    params = {"a": torch.randn(ONE_PASS_FROM + 300, generator=g), "b": torch.randn(7, generator=g)}
    state = FragmentState(names=list(params))
    state.take_global(
        {n: p + 0.1 * torch.randn(p.shape, generator=g) for n, p in params.items()}, 1
    )
    return state, params, g


def test_a_prepared_host_receipt_writes_the_weights_in_place_as_the_rule_gives() -> None:
    """issue 45: the link's thread turns the push's copies into θ_global − θ_push once the
    merge is pulled; the receipt then adds it to the weights in place (one pass), the same
    weights as the unprepared receipt up to rounding."""
    for prepared in (True, False):
        state, params, g = big_state(7)
        _, ready = state.encode_push(params, "int8", None)
        ready()
        at_push = {n: c.clone() for n, c in state.at_push.items()}  # type: ignore[union-attr]
        for p in params.values():
            p.add_(0.01)  # the overlapped steps
        merged = {n: p + 0.2 * torch.randn(p.shape, generator=g) for n, p in params.items()}
        want = {n: merged[n] + (params[n] - at_push[n]) for n in params}
        prepare = state.receipt_preparer()
        assert prepare is not None
        if prepared:
            prepare(merged)
            assert state.prepared is state.at_push
        got = state.receive(merged, 2, params, 0.0)
        for n in params:
            assert torch.allclose(got[n], want[n], atol=1e-6), n
            # prepared: the parameters themselves were written; not: a new tensor to copy in
            assert (got[n].data_ptr() == params[n].data_ptr()) == prepared, n
        assert state.prepared is None and state.at_push is None and state.version == 2


def test_a_preparer_does_nothing_for_another_push_or_other_shapes() -> None:
    state, params, _ = big_state(8)
    state.encode_push(params, "int8", None)[1]()
    stale = state.receipt_preparer()
    assert stale is not None
    state.encode_push(params, "int8", None)[1]()  # pushed again (overdue): a new at_push
    stale({n: p.clone() for n, p in params.items()})
    assert state.prepared is None
    fresh = state.receipt_preparer()
    assert fresh is not None
    fresh({"a": torch.zeros(3), "b": torch.zeros(7)})  # not the fragment's shapes
    assert state.prepared is None
    # Not deferred (defer_host_encoding off): no preparer.
    kept = FragmentState(names=["w"], defer_host_encoding=False)
    kept.take_global({"w": t(1.0, 2.0)}, 1)
    kept.encode_push({"w": t(0.0, 0.0)}, "int8", None)[1]()
    assert kept.receipt_preparer() is None


def test_a_small_host_fragments_receipt_is_prepared_too() -> None:
    """issue 45: gpt-tiny's receipt was a fixed cost of its few-ms steps; a small host
    fragment's is prepared on the link's thread too, and the receipt adds θ_global − θ_push to
    the weights in place: θ_now + (θ_global − θ_push), by hand 0.75 + (1.0 − 0.5) = 1.25 and
    1.0 + (2.0 − 0.5) = 2.5 (the push's copies 0.5, 0.5)."""
    small = FragmentState(names=["w"])
    small.take_global({"w": t(0.0, 0.0)}, 1)
    small.encode_push({"w": t(0.5, 0.5)}, "int8", None)[1]()
    prepare = small.receipt_preparer()
    assert prepare is not None
    prepare({"w": t(1.0, 2.0)})
    now = {"w": t(0.75, 1.0)}
    got = small.receive({"w": t(1.0, 2.0)}, 2, now, 0.0)
    assert torch.equal(got["w"], t(1.25, 2.5)) and got["w"].data_ptr() == now["w"].data_ptr()
    assert torch.equal(small.base["w"], t(1.0, 2.0)) and small.version == 2


def test_a_prepared_receipt_keeps_the_push_copy_for_the_next_push_which_copies_into_it() -> None:
    """issue 45 (emu11): a host learner's large push copies its weights into the buffer its last
    prepared receipt gave up (FragmentState.spare), not a new one: the same memory, the weights'
    values exactly, and the same encoded bytes as a push into a new buffer. An unprepared
    receipt's buffer is the weights it returns (the loop copies them in): not kept."""
    state, params, g = big_state(9)
    _, ready = state.encode_push(params, "int8", None)
    ready()
    first = state.at_push
    assert first is not None and state.spare is None
    ptr = first["a"].data_ptr()
    merged = {n: p + 0.2 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    prepare = state.receipt_preparer()
    assert prepare is not None
    prepare(merged)
    state.receive(merged, 2, params, 0.0)
    assert state.spare is first and state.at_push is None
    for p in params.values():
        p.add_(0.03)  # the steps of the next round
    twin = FragmentState(names=list(params))  # the same base, a new buffer at its push
    twin.take_global({n: t.clone() for n, t in state.base.items()}, 2)
    encoded, ready = state.encode_push(params, "int8", None)
    ready()
    want, twin_ready = twin.encode_push(params, "int8", None)
    twin_ready()
    assert state.spare is None and state.at_push is not None
    assert state.at_push["a"].data_ptr() == ptr  # the kept buffer, written over
    assert twin.at_push is not None and twin.at_push["a"].data_ptr() != ptr
    for n in params:
        assert torch.equal(state.at_push[n], params[n]), n
    assert encoded.keys() == want.keys() and encoded
    for k in want:
        assert torch.equal(encoded[k], want[k]), k
    # Unprepared: the receipt writes the new weights over the push's copies and returns them.
    state.receive(merged, 3, params, 0.0)
    assert state.spare is None


def test_a_pushs_kept_steps_are_those_trained_before_its_base_was_installed() -> None:
    """Three rounds of 4 steps, each push's merge installed 2 steps after it (keep): the first
    push carries 4 steps, none kept (from the joined base); the next two carry 6 each, of which
    the 2 trained between the push and the install of its merge are kept (keptSteps 0, 2, 2).
    A join starts over: none kept."""
    state = joined(t(0.0))
    w, carried, kept = 0.0, [], []
    for _ in range(3):
        for _ in range(4):
            w -= 1.0
            state.counters.add(1, 0.0, 0.0)
        kept.append(state.kept_steps)
        carried.append(state.counters.steps)
        delta = state.begin_push({"w": t(w)})
        for _ in range(2):  # trained while the merge is out, kept on top of it
            w -= 1.0
            state.counters.add(1, 0.0, 0.0)
        merged = state.base["w"] - delta["w"]
        w = float(state.receive({"w": merged}, state.version + 1, {"w": t(w)}, 0.0)["w"])
    assert carried == [4, 6, 6]
    assert kept == [0, 2, 2]
    assert state.kept_steps == 2  # the next push's
    state.take_global({"w": t(1.0)}, 9)
    assert state.kept_steps == 0
