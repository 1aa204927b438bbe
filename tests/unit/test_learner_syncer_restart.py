"""A learner across a syncer restart at K = M (docs/algorithm.md, "A syncer restart"): a push
the restarted syncer lost is pushed again at once, on the syncer's version when its base is one
the syncer lost too; a push refused as ahead of a syncer behind its base is pushed again at once
the same way, on the syncer's version, its steps counted once; one refused by a syncer not behind
it is pushed again from the syncer's fragment and its merge taken at the next sync point, which
is pushed as usual (syncer_restart.resend_version says which); a fragment whose merges the syncer
lost is made up at once and that push stands for its next sync point; the steps the restart took
back are counted for the drain (MergedSteps).

Driven step by step against test_learner_fragment_sync's fake link (one fragment, H = 4, τ = 2,
the 'syncer' applies θ ← θ − 0.25·Δ per push); every inner step adds 1 to w."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any

import torch
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.core.payloads import PulledFragment
from diloco_trainer.learner.fragment_state import MergedSteps
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.step_plan import plan_step
from diloco_trainer.learner.syncer_link import PushLost, SyncResult
from diloco_trainer.learner.syncer_restart import AfterRestart, resend_version, sync_outcome
from torch import nn

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step


class RestartLink(FakeLink):
    """FakeLink whose syncer restarts: the pushes numbered in `lost` (0 = the first) end in
    PushLost (the syncer is then at `restored_to`), those in `ahead` are refused as ahead
    (the syncer's fragment, unchanged, comes back instead); `restored` is what versions()
    reads."""

    def __init__(self) -> None:
        super().__init__(outer_lr=0.25)
        self.lost: set[int] = set()
        self.ahead: set[int] = set()
        self.restored_to = 0
        self.restored: list[int] = [0]
        self.count = 0

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(asyncio.run(coro))
        except PushLost as err:
            future.set_exception(err)
        return future

    async def versions(self, num_fragments: int) -> list[int]:
        return list(self.restored)

    async def sync_fragment(
        self,
        f: int,
        encoded: dict[str, torch.Tensor],
        meta: PushMeta,
        held: Any,
        within: bool = False,
        ready: Any = None,
        prepare: Any = None,
    ) -> SyncResult:
        n, self.count = self.count, self.count + 1
        if n in self.lost:
            self.pushes.append((f, meta, {k: t.clone() for k, t in encoded.items()}))
            raise PushLost("the syncer restarted", self.restored_to)
        if n not in self.ahead:
            return await super().sync_fragment(f, encoded, meta, held, within, ready, prepare)
        self.pushes.append((f, meta, {k: t.clone() for k, t in encoded.items()}))
        pulled = PulledFragment(
            fragment=f,
            version=self.version,
            outer_step=self.version,
            finished=False,
            tensors={k: t.clone() for k, t in self.global_weights.items()},
        )
        return SyncResult(
            pulled=pulled, outcome="push refused (ahead)", seconds=0.01, restarted=True
        )


def k_equals_m() -> tuple[FragmentSync, nn.Parameter, RestartLink]:
    link = RestartLink()
    sync, w = make_sync(make_spec(quorum=2, overlapMode="fixed"), link)  # τ = 2, not fitted
    assert sync.blocking
    return sync, w, link


def pushed(link: FakeLink) -> list[tuple[int, int, float]]:
    """(base version, steps, Δ's first value) of each push."""
    return [(m.base_version, m.steps, float(e["w"][0])) for _, m, e in link.pushes]


def test_a_lost_push_is_pushed_again_at_once_and_applied_where_it_would_have_been() -> None:
    sync, w, link = k_equals_m()
    link.lost = {0}
    for _ in range(4):
        step(sync, w)  # pushed after step 4 (Δ = 0 − 4), lost with the syncer's restart
    assert step(sync, w) == {}  # step 5: pushed again at once: Δ = 0 − 5, steps 1..5
    assert pushed(link) == [(0, 4, -4.0), (0, 5, -5.0)]
    assert sync.inflight[0].step == 4  # the lost push's place: applied at 4 + τ
    assert step(sync, w) != {}  # step 6: global = 0 − 0.25·(−5) = 1.25, kept 6 − 5 = 1
    assert torch.equal(w.detach(), torch.full((2,), 2.25))
    for _ in range(2):
        step(sync, w)  # step 8: Δ = 1.25 − 4.25 = −3 over steps 6..8
    assert pushed(link)[2] == (1, 3, -3.0)
    assert sync.lost_work == 0  # nothing merged was taken back


def test_a_lost_push_on_a_version_the_syncer_lost_is_counted_on_its_version() -> None:
    sync, w, link = k_equals_m()
    link.lost = {1}
    link.restored_to = 0  # the syncer resumed from before the first merge
    for _ in range(9):
        step(sync, w)
    # Push 1 after step 8 (base 1: global 1, w = 3 + 2 = 5, Δ = −4) is lost; at step 9 it is
    # pushed again on version 0 with every step since the base: Δ = 1 − 6 = −5, steps 5..9.
    assert pushed(link) == [(0, 4, -4.0), (1, 4, -4.0), (0, 5, -5.0)]
    # The restart took back the merge of push 0: its 4 steps are trained again before the drain.
    assert sync.restart.lost == [4] and sync.lost_work == 4.0


def test_a_push_refused_by_a_syncer_not_behind_its_base_is_received_then_pushed_again() -> None:
    sync, w, link = k_equals_m()
    link.ahead = {0}  # refused, the syncer at the base's version (as one that forgot the island)
    for _ in range(6):
        step(sync, w)
    # Step 6: the syncer's fragment (0, unmerged) with the 2 steps since the push kept, w = 2,
    # then pushed again at once: Δ = 0 − 2 over steps 5..6.
    assert torch.equal(w.detach(), torch.full((2,), 2.0))
    assert pushed(link) == [(0, 4, -4.0), (0, 2, -2.0)]
    assert sync.inflight[0].again
    for _ in range(2):
        step(sync, w)
    # Step 8, the next sync point: the merge of the push made again is taken first (global
    # 0 − 0.25·(−2) = 0.5, w = 0.5 + 8 − 6 = 2.5), then the push due is made: Δ = 0.5 − 2.5.
    assert pushed(link) == [(0, 4, -4.0), (0, 2, -2.0), (1, 2, -2.0)]
    assert sync.fragments[0].version == 1
    # The refused push's 4 steps were lost with it.
    assert sync.restart.lost == [4]


def test_a_fragment_whose_merges_the_syncer_lost_is_made_up_for_its_next_sync_point() -> None:
    sync, w, link = k_equals_m()
    for _ in range(10):
        step(sync, w)  # merges of the pushes at 4 (v1) and 8 (v2) taken at 6 and 10: w = 4
    assert sync.fragments[0].version == 2 and not sync.inflight
    sync.restart.seen = True  # e.g. another fragment's push came back lost
    link.restored = [1]  # the syncer resumed at version 1
    step(sync, w)  # step 11: made up at once on version 1: Δ = 2 − 5 over steps 9..11
    assert pushed(link)[2] == (1, 3, -3.0)
    step(sync, w)  # step 12: that push stands for this sync point: nothing pushed
    assert len(link.pushes) == 3
    step(sync, w)  # step 13: its merge: global 2 + 0.75 = 2.75, w = 2.75 + 13 − 11
    assert torch.equal(w.detach(), torch.full((2,), 4.75))
    for _ in range(3):
        step(sync, w)  # step 16: Δ = 2.75 − 7.75 over steps 12..16
    assert pushed(link)[3] == (3, 5, -5.0)
    assert sync.restart.lost == [4]  # the merge of push 1 (4 steps) was taken back


def test_merged_steps_rolled_back_counts_the_steps_of_the_merges_taken_back() -> None:
    steps = MergedSteps(version=3)  # joined at version 3
    steps.merged(4, 5)
    steps.merged(5, 5)
    steps.merged(6, 7)
    assert steps.total == 17
    assert steps.rolled_back(6, held=6, round_steps=5) == 0  # not behind
    assert steps.rolled_back(4, held=6, round_steps=5) == 12  # versions 5 and 6: 5 + 7
    assert steps.total == 5 and steps.at == {3: 0, 4: 5}
    # Back past the join (version 3): the 5 steps merged since it, and a round of steps (5)
    # for each version before it.
    assert steps.rolled_back(2, held=4, round_steps=5) == 10
    assert steps.total == 0 and steps.at == {2: 0}


def test_plan_step_skips_a_sync_point_made_up_already() -> None:
    made_up = plan_step(
        8, inner_steps=4, offsets=[0], overlap=2, pushed_at={}, skip_once=frozenset({0})
    )
    assert made_up.push == () and made_up.skip == (0,)
    plain = plan_step(8, inner_steps=4, offsets=[0], overlap=2, pushed_at={})
    assert plain.push == (0,) and plain.wait == ()


def test_a_push_refused_as_ahead_of_a_syncer_behind_its_base_is_pushed_again_at_once() -> None:
    sync, w, link = k_equals_m()
    for _ in range(7):
        step(sync, w)  # push 0 after step 4 (Δ = −4) merged as version 1 (global 1); w = 1 + 3
    # The syncer restarts from its checkpoint at version 0 (global 0), which it is at when
    # push 1, after step 8 (base 1, w = 5: Δ = 1 − 5 = −4), comes: refused as ahead.
    link.version, link.global_weights = 0, {"w": torch.zeros(2)}
    link.ahead = {1}
    step(sync, w)
    assert pushed(link) == [(0, 4, -4.0), (1, 4, -4.0)]
    # Step 9, before its merge's poll (8 + τ): pushed again at once, on the syncer's version 0,
    # with every step since the base (5..9): Δ = 1 − 6 = −5; not received (w stays 6).
    assert step(sync, w) == {}
    assert pushed(link) == [(0, 4, -4.0), (1, 4, -4.0), (0, 5, -5.0)]
    assert sync.inflight[0].again and sync.inflight[0].step == 8  # the refused push's place
    assert torch.equal(w.detach(), torch.full((2,), 6.0))
    # Step 10 = 8 + τ: its merge, global 0 − 0.25·(−5) = 1.25, the step since it kept: 2.25.
    assert step(sync, w) != {}
    assert torch.equal(w.detach(), torch.full((2,), 2.25))
    assert sync.fragments[0].version == 1
    for _ in range(2):
        step(sync, w)  # step 12: Δ = 1.25 − 4.25 over steps 10..12
    assert pushed(link)[3] == (1, 3, -3.0)
    # Counted once: the restart took back the merge of push 0 (4 steps); the refused push's 4
    # steps went into the push made again (merged: 5 steps), so they are not lost.
    assert sync.restart.lost == [4] and sync.lost_work == 4.0
    assert sync.restart.merged[0].total == 5


def test_which_syncs_a_syncer_restart_has_pushed_again_at_once_and_on_which_version() -> None:
    def refused(version: int, restarted: bool = True) -> SyncResult:
        pulled = PulledFragment(
            fragment=0, version=version, outer_step=version, finished=False, tensors={}
        )
        return SyncResult(pulled=pulled, outcome="push refused", seconds=0.0, restarted=restarted)

    # Lost: on the syncer's version when it is behind the base, else on the base.
    assert resend_version(PushLost("lost", 2), base=4) == 2
    assert resend_version(PushLost("lost", 4), base=4) == 4
    assert resend_version(PushLost("lost", -1), base=4) == 4  # the syncer's version unknown
    # Refused as ahead: on the syncer's version, behind the base...
    assert resend_version(refused(2), base=4) == 2
    assert resend_version(refused(0), base=1) == 0
    # ...and not at once where the syncer is not behind (a 404 rejoin; merged past it).
    assert resend_version(refused(4), base=4) is None
    assert resend_version(refused(5), base=4) is None
    # Merged, refused for another reason, failed otherwise, or not ended: not pushed again.
    assert resend_version(refused(2, restarted=False), base=4) is None
    assert resend_version(RuntimeError("auth"), base=4) is None
    assert resend_version(None, base=4) is None


def test_a_sync_outcome_is_read_without_waiting() -> None:
    pending: concurrent.futures.Future[Any] = concurrent.futures.Future()
    assert sync_outcome(pending) is None
    cancelled: concurrent.futures.Future[Any] = concurrent.futures.Future()
    cancelled.cancel()
    assert sync_outcome(cancelled) is None
    lost: concurrent.futures.Future[Any] = concurrent.futures.Future()
    err = PushLost("lost", 3)
    lost.set_exception(err)
    assert sync_outcome(lost) is err
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result("result")
    assert sync_outcome(done) == "result"


def test_after_restart_counts_merges_and_what_restarts_took_back() -> None:
    def result(version: int, outcome: str, *, restarted: bool = False) -> SyncResult:
        pulled = PulledFragment(
            fragment=0, version=version, outer_step=version, finished=False, tensors={}
        )
        return SyncResult(pulled=pulled, outcome=outcome, seconds=0.0, restarted=restarted)

    restart = AfterRestart()
    # Before the join nothing is counted (a restart's roll-back has nothing to take).
    restart.count_merged(0, result(1, "merged"), held=0, carried=4, round_steps=4)
    restart.roll_back(0, 1, 0, round_steps=4)
    assert restart.merged == [] and restart.lost_work(1.0) == 0.0
    restart.joined([2, 2])  # two fragments, both at version 2
    assert restart.lost == [0, 0]
    restart.count_merged(0, result(3, "merged"), held=2, carried=4, round_steps=4)
    restart.count_merged(0, result(4, "merged"), held=3, carried=5, round_steps=4)
    restart.count_merged(1, result(3, "merged"), held=2, carried=4, round_steps=4)
    assert [m.total for m in restart.merged] == [9, 4]
    # Fragment 0's push on base 4 (6 steps) refused by a syncer restarted at version 3: the
    # merge of version 4 (5 steps) and the refused push's 6 steps are lost; nothing to push
    # again until the receipt says so (refused).
    restart.count_merged(
        0, result(3, "push refused (ahead)", restarted=True), held=4, carried=6, round_steps=4
    )
    assert restart.lost == [11, 0] and restart.merged[0].total == 4
    restart.refused(0)
    assert restart.seen and restart.push_again == {0}
    # Fragment 1 rolled back from version 3 to 1: its 4 merged steps since the join (version
    # 2) and a round of 4 steps for version 2 itself, before the join.
    restart.roll_back(1, 3, 1, round_steps=4)
    assert restart.lost == [11, 8]
    # The work lost is the fragment that lost the most, at the work per step given.
    assert restart.lost_work(0.5) == 5.5
    # An outcome neither merged nor restarted (a refused push of a syncer that forgot the
    # island) counts nothing.
    restart.count_merged(1, result(1, "push refused"), held=1, carried=3, round_steps=4)
    assert restart.lost == [11, 8] and restart.merged[1].total == 0
    # Receipts taken early are handed over once.
    restart.early[1] = {"w": torch.zeros(1)}
    assert set(restart.take_early()) == {1} and restart.take_early() == {}
