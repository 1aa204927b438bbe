"""A learner adds a pulled chain of updates into the Δ base it holds, in place, instead of
rebuilding the merged fragment beside it (learner/syncer_link.py, FragmentState.base_writer;
ARCHITECTURE.md, "A learner's memory"): the chain's checksum is computed first, a slice at a
time, without writing the base; only a chain that matches is added; a failed check, a
malformed chain or a revoked write leaves the base bit for bit as it was; a write that fails
half way leaves a base no push reads, until a full pull replaces it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.core.compress import SLICE
from diloco_trainer.core.fragments import split_fragments
from diloco_trainer.core.payloads import PulledUpdates
from diloco_trainer.core.published import (
    apply_updates,
    checksum_after_updates,
    publish_update,
    weights_checksum,
)
from diloco_trainer.learner.fragment_state import BASE_SPOILED, BaseSpoiled, FragmentState
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import HeldFragment, SyncerLink
from diloco_trainer.models.model import build_model
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync
from .test_syncer import run
from .test_syncer_pull import copy, merge_rounds, served_link

Tensors = dict[str, torch.Tensor]


def chain_for(base: Tensors, codec: str, versions: int = 2, seed: int = 0) -> PulledUpdates:
    """A chain of `versions` updates from `base` (version 0), made as the syncer makes them
    (published.publish_update on θ_pub = base)."""
    gen = torch.Generator().manual_seed(seed)
    published = {n: t.clone() for n, t in base.items()}
    names = sorted(base)
    updates = []
    for v in range(1, versions + 1):
        exact = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in published.items()}
        updates.append(publish_update(exact, published, names, codec, v))
    return PulledUpdates(
        fragment=0,
        version=versions,
        from_version=0,
        outer_step=versions,
        finished=False,
        codec=codec,
        checksum=updates[-1].checksum,
        updates=[u.encoded for u in updates],
    )


@pytest.fixture
def link() -> Iterator[SyncerLink]:
    """A learner's link whose syncer is never called (its _apply runs here, on this thread)."""
    made = SyncerLink(SyncerClient("http://127.0.0.1:9", "tok"), island="island-0", replicas=1)
    yield made
    made.close(leave=False)


def small_base() -> Tensors:
    """Tensors of one slice and less, of more than one (not a whole number of codec blocks),
    and an empty one."""
    gen = torch.Generator().manual_seed(1)
    return {
        "a": torch.randn(SLICE + 1000, generator=gen),
        "b": torch.randn(3, 50, generator=gen),
        "c": torch.empty(0),
    }


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4"])
def test_a_chain_s_checksum_is_its_rebuilt_weights_and_reads_the_base_only(codec: str) -> None:
    base = small_base()
    before = {n: t.clone() for n, t in base.items()}
    chain = chain_for(base, codec)
    got = checksum_after_updates(base, chain.updates, codec)
    assert got == weights_checksum(apply_updates(base, chain.updates, codec)) == chain.checksum
    assert all(torch.equal(base[n], before[n]) for n in base)
    # One value of the base changed: another checksum (the chain would not be added).
    base["a"].view(-1)[SLICE + 5] += 1e-3
    assert checksum_after_updates(base, chain.updates, codec) != chain.checksum


def allocation_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result and the most bytes torch's CPU allocator held for it at once (the
    profiler's running total of allocations made while it ran)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    totals: list[int] = []

    def walk(nodes: Any) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                totals.append(node.extra_fields.total_allocated)
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return out, max(totals, default=0)


def test_a_pulled_chain_is_added_into_the_held_base_with_a_tensor_s_memory_beside_it(
    link: SyncerLink,
) -> None:
    """A real model's fragment (gpt-small, F = 2: 22 MB, its largest tensor 2.4 MB) and a
    two-update int8 chain: in place, the most memory allocated at once is one tensor's
    decoded values and the slices' buffers; rebuilt into a copy (as before, and still when
    the write is revoked) it is the whole fragment and more."""
    torch.manual_seed(0)
    params = dict(build_model("gpt-small", 64).named_parameters())
    names = split_fragments({n: p.numel() for n, p in params.items()}, 2)[0]
    base = {n: params[n].detach().clone() for n in names}
    chain = chain_for(base, "int8")
    want = apply_updates(base, chain.updates, "int8")
    fragment = sum(t.numel() * 4 for t in base.values())
    largest = max(t.numel() * 4 for t in base.values())
    state = FragmentState(names=names, version=0, base=base)
    held = HeldFragment(0, base, None, state.base_writer())

    (on_device, tensors, checksum), peak = allocation_peak(lambda: link._apply(held, chain))

    assert on_device is None and checksum == chain.checksum
    assert all(tensors[n] is base[n] for n in names)  # the base's own tensors
    assert all(torch.equal(base[n], want[n]) for n in names)  # bit for bit
    assert state.rewritten_to == chain.version
    slices_buffers = (1 + len(chain.updates)) * SLICE * 4
    assert peak <= largest + slices_buffers < fragment / 3, (peak, largest, fragment)

    copied = {n: params[n].detach().clone() for n in names}
    (_, tensors, checksum), peak = allocation_peak(
        lambda: link._apply(HeldFragment(0, copied, None, None), chain)
    )
    assert checksum == chain.checksum and all(tensors[n] is not copied[n] for n in names)
    assert peak >= fragment  # what the profiler sees of the copy the old path made


def test_a_malformed_chain_and_a_revoked_write_leave_the_base_bit_identical(
    link: SyncerLink,
) -> None:
    base = small_base()
    before = {n: t.clone() for n, t in base.items()}
    chain = chain_for(base, "int8")
    state = FragmentState(names=list(base), version=0, base=base)
    # A chain whose last update holds a NaN scale: refused before anything is written.
    spoilt = [dict(u) for u in chain.updates]
    spoilt[-1]["b::scale"] = spoilt[-1]["b::scale"].clone()
    spoilt[-1]["b::scale"][0] = float("nan")
    malformed = dataclasses.replace(chain, updates=spoilt)
    with pytest.raises(ValueError, match="NaN"):
        link._apply(HeldFragment(0, base, None, state.base_writer()), malformed)
    assert all(torch.equal(base[n], before[n]) for n in base)
    assert state.rewritten_to is None
    # A push of the fragment again revokes the write (it reads the base): rebuilt into a copy.
    write = state.base_writer()
    assert not state.base_rewritten()
    _, tensors, checksum = link._apply(HeldFragment(0, base, None, write), chain)
    assert checksum == chain.checksum and all(tensors[n] is not base[n] for n in base)
    assert all(torch.equal(base[n], before[n]) for n in base)
    assert state.rewritten_to is None


def test_a_chain_that_fails_its_check_over_http_leaves_the_base_and_pulls_the_full_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As a learner's rank 0 pulls from a real syncer: a base that differs in one value from
    the syncer's version 1 gets a chain whose result fails the checksum (the check after
    decoding); the base is left bit for bit, and the full fragment comes in new memory."""
    caplog.set_level(logging.WARNING, logger="diloco.learner")

    async def scenario() -> tuple[Any, ...]:
        async with served_link(tmp_path) as (syncer, link):
            held: list[Tensors] = [copy(syncer.model.published, syncer.fragments[0])]
            await merge_rounds(syncer, 2, held)
            base = copy(held[1], list(held[1]))
            next(iter(base.values())).view(-1)[0] += 1e-3
            before = copy(base, list(base))
            state = FragmentState(names=list(base), version=1, base=base)
            write = state.base_writer()
            future = link.submit(link._pull_newer(0, 1, HeldFragment(1, base, None, write)))
            got, _ = await asyncio.wrap_future(future)
            return syncer, got, base, before, state, dict(link.pull_counts)

    syncer, got, base, before, state, counts = run(scenario())
    assert counts == {"updates": 0, "rebuildFailed": 1}
    assert all(torch.equal(base[n], before[n]) for n in base)
    assert state.rewritten_to is None and state.write_token is not None  # never written
    assert got.version == 2 and all(got.tensors[n] is not base[n] for n in base)
    assert all(torch.equal(t, syncer.model.published[n]) for n, t in got.tensors.items())


def test_a_write_runs_under_the_fragment_s_lock_and_one_failed_half_way_blocks_pushes() -> None:
    state = FragmentState(names=["w"], version=0, base={"w": torch.zeros(4)})
    seen: list[bool] = []

    def add() -> None:
        # Another thread (the training thread's base_rewritten) cannot take the lock now.
        probe = threading.Thread(target=lambda: seen.append(state.lock.acquire(blocking=False)))
        probe.start()
        probe.join()
        state.base["w"].add_(1.0)

    write = state.base_writer()
    assert write is not None and write(1, add) and seen == [False]
    assert state.rewritten_to == 1 and state.base_rewritten()  # a push again must wait for it
    assert not write(2, add)  # once only
    merged = dict(state.base)
    state.receive(merged, 1, {"w": torch.zeros(4)}, 0.0)
    assert state.base["w"] is merged["w"] and state.rewritten_to is None
    assert not state.base_rewritten()

    def fail_half_way() -> None:
        state.base["w"][:2] = 7.0
        raise RuntimeError("out of memory")

    write = state.base_writer()
    assert write is not None
    with pytest.raises(BaseSpoiled):  # not a ValueError: the sync fails and resyncs
        write(2, fail_half_way)
    assert state.rewritten_to == BASE_SPOILED and state.base_rewritten()
    full = {"w": torch.full((4,), 3.0)}  # the resync's full pull replaces it
    state.receive(full, 2, {"w": torch.zeros(4)}, 0.0)
    assert torch.equal(state.base["w"], full["w"]) and not state.base_rewritten()
    # Eager keeps the old base for its last update: never written in place.
    assert (
        FragmentState(names=["w"], base={"w": torch.zeros(1)}, track_update=True).base_writer()
        is None
    )


class HeldLink(FakeLink):
    """FakeLink that keeps each sync's HeldFragment (what the real link would write)."""

    def __init__(self, outer_lr: float) -> None:
        super().__init__(outer_lr)
        self.helds: list[HeldFragment] = []

    async def sync_fragment(self, f: int, encoded: Any, meta: Any, held: Any, **kw: Any) -> Any:
        self.helds.append(held)
        return await super().sync_fragment(f, encoded, meta, held, **kw)


def test_an_overdue_fragment_whose_merge_was_written_into_its_base_is_not_pushed_again() -> None:
    link = HeldLink(outer_lr=0.5)
    sync, w = make_sync(make_spec(compression="none"), link)
    link.hold = True  # the merge is not handed over yet
    with torch.no_grad():
        w.add_(1.0)
    sync.count(10, 1.0, 0.1)
    sync.push(0, 4, (2, 2))
    flight = sync.inflight[0]
    (held,) = link.helds
    assert held.write is not None
    # The link adds the merge's chain into the base in place...
    assert held.write(1, lambda: held.tensors["w"].fill_(-0.5))
    # ...and only then the step finds the sync overdue: a push now would read that base.
    sync.push(0, 40, (2, 2))
    assert len(link.pushes) == 1 and sync.inflight[0] is flight and not flight.future.cancelled()
    link.release()
    assert sync.collect(0, block=0.0)
    target = sync.receive(0)
    assert torch.equal(target["w"], torch.full((2,), 0.5))  # the merge: 0 − 0.5 · (0 − 1)
    assert not sync.fragments[0].base_rewritten()
    # An overdue sync that wrote nothing is revoked and pushed again, as before.
    link.hold = True
    sync.count(10, 1.0, 0.1)
    sync.push(0, 44, (2, 2))
    first = link.helds[-1]
    sync.push(0, 80, (2, 2))
    assert first.write is not None and not first.write(3, lambda: None)  # revoked
    assert len(link.pushes) == 3
