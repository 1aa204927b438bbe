"""Rank 0's syncing (learner/fragment_sync.py) driven step by step against a fake syncer link:
when Δ is pushed, what it carries, the weights after a receipt with overlap, and phase shifts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core import compress
from diloco_trainer.core.payloads import PulledFragment
from diloco_trainer.learner.drain import drain
from diloco_trainer.learner.fragment_state import FragmentState
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.step_costs import WaitMeter
from diloco_trainer.learner.syncer_link import SyncResult
from torch import nn


class FakeLink:
    """Runs the learner's coroutines at once; the 'syncer' applies an outer SGD step of
    `outer_lr` to each pushed Δ (one island: θ ← θ − lr·Δ)."""

    def __init__(
        self, outer_lr: float, lateness: float | None = None, latency: float | None = None
    ) -> None:
        self.finished = threading.Event()
        self.outer_lr = outer_lr
        self.lateness = lateness
        self.latency = latency  # each sync's SyncResult.latency (sync.overlapMode auto)
        self.pushes: list[tuple[int, PushMeta, dict[str, torch.Tensor]]] = []
        self.within: list[bool] = []  # the within flag of each push (merge_lateness)
        self.lateness_within = False
        self.global_weights: dict[str, torch.Tensor] = {}
        self.version = 0
        self.hold = False
        self.held: list[tuple[concurrent.futures.Future[Any], Any]] = []
        self.progress: dict[str, Any] = {"holding": False}  # what heartbeats would carry
        self.waits = WaitMeter(time.monotonic())  # the waits heartbeats would report
        self.refuse = False  # answer each push as the syncer answers a malformed one
        self.inner_steps: int | None = None  # the island's H_i the syncer names (stepsPerIsland)
        self.stop_at: int | None = None  # the drain's stop target the syncer names (K = M)
        self.beats: list[dict[str, Any]] = []  # the progress each heartbeat carried
        # As the syncer merges a round crossed with a holding island's (crossed.py): a
        # heartbeat that says holding hands over the merges held back.
        self.release_when_holding = False

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        result = asyncio.run(coro)
        if self.hold:  # the merge is not back yet: release() hands it over
            self.held.append((future, result))
        else:
            future.set_result(result)
        return future

    def submit_later(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """A push's hand-over: here at once (the real link's deferral to the next backward pass
        is tests/unit/test_learner_deferred_push.py's)."""
        return self.submit(coro)

    def start_deferred(self) -> None:
        """Nothing is deferred here."""

    async def report_now(self) -> None:
        """A heartbeat now (the drain's 'holding' and 'drained'): recorded, not sent."""
        self.beats.append(dict(self.progress))
        if self.release_when_holding and self.progress["holding"]:
            self.hold = False
            self.release()

    def release(self) -> None:
        for future, result in self.held:
            future.set_result(result)
        self.held.clear()

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
        if ready is not None:  # the real link waits for the host copies before reading them
            ready()
        self.pushes.append((f, meta, {n: t.clone() for n, t in encoded.items()}))
        self.within.append(within)
        shapes = {n: t.shape for n, t in self.global_weights.items()}
        if not self.refuse:
            for n, d in compress.decode_tensors(encoded, meta.codec, shapes).items():
                self.global_weights[n] = self.global_weights[n] - self.outer_lr * d
            self.version += 1
        pulled = PulledFragment(
            fragment=f,
            version=self.version,
            outer_step=self.version,
            finished=False,
            tensors={n: t.clone() for n, t in self.global_weights.items()},
        )
        if prepare is not None:  # as the real link: on the pulled tensors, before handing back
            prepare(pulled.tensors)
        return SyncResult(
            pulled=pulled,
            outcome="push refused (400 malformed)" if self.refuse else "merged",
            seconds=0.01,
            lateness=self.lateness,
            lateness_within=self.lateness_within,
            latency=self.latency,
        )


def make_spec(**sync: Any) -> JobSpec:
    return parse_spec(
        {
            "islands": {"count": 2},
            "inner": {"steps": 4},
            "sync": {"fragments": 1, "overlapSteps": 2, "compression": "none", **sync},
        }
    )


def make_sync(
    spec: JobSpec, link: FakeLink, *, version: int = 0
) -> tuple[FragmentSync, nn.Parameter]:
    """A learner joined at `version` (0: a fresh job; more: a running job's merges)."""
    w = nn.Parameter(torch.zeros(2))
    link.global_weights = {"w": torch.zeros(2)}
    link.version = version
    sync = FragmentSync(spec, "island-0", link, {"w": w}, threading.Event())  # type: ignore[arg-type]
    pulled = PulledFragment(
        fragment=0,
        version=version,
        outer_step=version,
        finished=False,
        tensors={"w": torch.zeros(2)},
    )
    sync.fragments = [FragmentState(names=["w"])]
    sync.arrived[0] = SyncResult(pulled=pulled, outcome="joined", seconds=0.0)
    sync.offsets = [0]
    sync.step_time = 0.1
    ticks = iter(range(10**6))
    sync.clock = lambda: 0.1 * next(ticks)  # every step takes 0.1 s of wall time
    sync.take_joined()
    return sync, w


def step(sync: FragmentSync, w: nn.Parameter, tokens: int = 10) -> dict[int, Any]:
    """One 'inner step' (w += 1), then rank 0's bookkeeping; applies what comes back."""
    with torch.no_grad():
        w.add_(1.0)
    sync.count(tokens, 1.0, 0.1)
    targets = sync.after_step()
    with torch.no_grad():
        for f, weights in targets.items():
            assert f == 0
            w.copy_(weights["w"])
    return targets


def test_push_at_h_then_apply_after_overlap_keeping_the_overlap_steps() -> None:
    # τ pinned at overlapSteps (fixed): since issue 47 a K < M learner fits it too
    # (test_learner_overlap_fit's).
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(overlapMode="fixed"), link)
    for _ in range(4):
        assert step(sync, w) == {}
    # Pushed after step 4: Δ = 0 - 4 = -4 (global minus local), with 4 steps and 40 tokens.
    assert len(link.pushes) == 1
    _, meta, encoded = link.pushes[0]
    assert torch.equal(encoded["w"], torch.full((2,), -4.0))
    assert (meta.base_version, meta.steps, meta.tokens) == (0, 4, 40)
    assert step(sync, w) == {}  # step 5: overlapping
    assert step(sync, w) != {}  # step 6 = 4 + τ: applied
    # global = 0 - 0.25 * (-4) = 1; kept overlap: 1 + (6 - 4) = 3 (overwrite would give 1).
    assert torch.equal(w.detach(), torch.full((2,), 3.0))
    assert sync.fragments[0].version == 1
    assert torch.equal(sync.fragments[0].base["w"], torch.full((2,), 1.0))


def test_next_push_carries_the_overlap_steps_and_their_counters() -> None:
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(), link)
    for _ in range(8):
        step(sync, w)
    # Second push after step 8: w = 3 + 2 = 5, base 1: Δ = -4, counting steps 5..8 (4 steps),
    # not only the 2 since the receipt at step 6.
    assert len(link.pushes) == 2
    _, meta, encoded = link.pushes[1]
    assert torch.equal(encoded["w"], torch.full((2,), -4.0))
    assert (meta.base_version, meta.steps, meta.tokens) == (1, 4, 40)


def test_mix_alpha_keeps_a_share_of_the_local_weights_on_receipt() -> None:
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(mixAlpha=0.5), link)
    for _ in range(6):
        step(sync, w)
    # 0.5 * 6 + 0.5 * (1 + 2) = 4.5
    assert torch.equal(w.detach(), torch.full((2,), 4.5))


def test_a_late_push_shifts_the_schedule_earlier() -> None:
    # Pushed 0.15 s after a leader's merge, at 0.1 s/step and H = 4 (a 0.4 s round): 1.5 steps
    # late, so the schedule moves earlier by the cap of H // 4 = 1 step.
    link = FakeLink(outer_lr=1.0, lateness=0.15)
    sync, w = make_sync(make_spec(overlapSteps=1), link)
    for _ in range(5):  # push after 4, applied (and the shift decided) after 5
        step(sync, w)
    assert sync.phase_pending == -1
    link.lateness = None
    for _ in range(2):  # steps 6 and 7 take positions 6..8: the push due at 8 comes at step 7
        step(sync, w)
    assert len(link.pushes) == 2
    assert sync.position == 8
    assert link.pushes[1][1].steps == 3


def test_an_early_push_delays_the_schedule() -> None:
    # 2.5 s after the leader's merge with a round of 4 x 1 s is 1.5 s before its next one: delay
    # by 1.5 steps, capped at H // 4 = 1 step.
    link = FakeLink(outer_lr=1.0, lateness=2.5)
    sync, w = make_sync(make_spec(overlapSteps=1), link)
    ticks = iter(range(10**6))
    sync.clock = lambda: float(next(ticks))  # 1 s of wall time per step
    for _ in range(5):
        step(sync, w)
    assert sync.phase_pending == 1
    link.lateness = None
    for _ in range(4):  # one step does not move the schedule: the push due at 8 is at step 9
        step(sync, w)
    assert sync.position == 8
    assert len(link.pushes) == 2
    assert link.pushes[1][1].steps == 5


def test_a_reading_within_a_merge_is_taken_once_per_shift() -> None:
    # K = 1 of 2 (decoupled), H = 4, steps of 0.1 s. Every result says our previous push came
    # 0.1 s (one step) after the leader's: the first one that measures a push shifts the
    # schedule one step earlier; the next, of a push made before that shift, is skipped (it
    # would correct the same offset twice); the one after, of a push made after it, is taken.
    link = FakeLink(outer_lr=0.25, lateness=0.1)
    link.lateness_within = True
    sync, w = make_sync(make_spec(quorum=1, overlapSteps=1), link)
    shifts: list[int] = []  # pushes made when each shift began
    seen = sync.shifted_at
    while len(link.pushes) < 5:
        step(sync, w)
        if sync.shifted_at != seen:
            seen = sync.shifted_at
            shifts.append(len(link.pushes))
    # Push 1 measures nothing; push 2's result (of push 1) shifts; push 3's (of push 2, before
    # the shift) is skipped; push 4's (of push 3, after it) shifts again.
    assert shifts == [2, 4]
    assert link.within == [True] * 5


def test_a_reading_within_a_merge_under_an_eighth_of_a_round_moves_nothing() -> None:
    # H = 16 at 0.1 s a step is a 1.6 s round; its eighth is 0.2 s, its quarter 4 steps. Within
    # a merge, 0.15 s late is noise and moves nothing; 0.3 s moves the schedule 3 steps earlier.
    # A missed merge's reading (not within) of the same 0.15 s moves it round(-1.5) = -2 steps.
    spec = parse_spec(
        {
            "islands": {"count": 2},
            "inner": {"steps": 16},
            "sync": {"fragments": 1, "overlapSteps": 1, "compression": "none", "quorum": 1},
        }
    )
    sync, _ = make_sync(spec, FakeLink(outer_lr=1.0))
    sync.wall_step = 0.1
    sync._align(0, 0.15, within=True)
    assert sync.phase_pending == 0
    sync._align(0, 0.3, within=True)
    assert sync.phase_pending == -3
    sync.phase_pending = 0
    sync._align(0, 0.15)
    assert sync.phase_pending == -2


def test_no_shift_while_one_is_in_progress() -> None:
    link = FakeLink(outer_lr=1.0, lateness=0.4)
    sync, _ = make_sync(make_spec(overlapSteps=1), link)
    sync.phase_pending = 1
    sync._align(0, 0.4)
    assert sync.phase_pending == 1


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_delta_pushed_decodes_to_global_minus_local(codec: str) -> None:
    link = FakeLink(outer_lr=0.0)
    sync, w = make_sync(make_spec(compression=codec), link)
    for _ in range(4):
        step(sync, w)
    _, _, encoded = link.pushes[0]
    decoded = compress.decode_tensors(encoded, codec, {"w": torch.Size([2])})
    assert torch.allclose(decoded["w"], torch.full((2,), -4.0), rtol=0.01)


def test_decoupled_learner_trains_on_until_its_merge_arrives_then_keeps_those_steps() -> None:
    # K = 1 of 2 with τ = 2: after step 6 the merge of the push at 4 is due but not back.
    link = FakeLink(outer_lr=0.25)
    # (lateMergeHold off: the hold at ceil(H / 2) is tests/unit/test_learner_late_hold.py's.)
    sync, w = make_sync(make_spec(quorum=1, lateMergeHold="off"), link)
    assert not sync.blocking
    link.hold = True
    for _ in range(7):
        assert step(sync, w) == {}  # no wait at step 6: the wait budget would be 30 s
    assert 0 in sync.inflight
    link.release()
    assert step(sync, w) != {}  # step 8: arrived, applied (and the push due at 8 skipped)
    # global 1 (as before) + the 4 steps since the push at 4: w = 1 + (8 - 4) = 5.
    assert torch.equal(w.detach(), torch.full((2,), 5.0))
    assert len(link.pushes) == 1
    assert sync.fragments[0].counters.steps == 4
    assert link.within == [True]  # does not block: aligns its phase within merges too


def test_drain_pushes_only_the_steps_since_the_merge_it_takes_first() -> None:
    """The drain takes the merge in flight, then pushes what the fragment holds: its Δ is the
    steps since the push that merge answers, measured from the weights after the receipt. It
    used to be measured from the weights before it (the receipt's weights were not in the
    parameters yet), so it also held the merge's own move, θ_global − θ_push, with the counters
    of one step (issue 46: a drain's push of one step was 3.4x over the movement cap)."""
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1), link)
    link.hold = True
    for _ in range(5):
        step(sync, w)  # the push at 4 (Δ = -4) in flight, one step on: w = 5
    link.hold = False
    link.release()
    link.finished.set()  # the job ends with the drain: no wait for the finish
    out = drain(sync)
    # The merge: global = 0 - 0.25 x (-4) = 1; the receipt keeps the step since the push,
    # w = 1 + (5 - 4) = 2; the drain's push Δ = 1 - 2 = -1 with its one step (not 1 - 5 = -4).
    assert len(link.pushes) == 2
    _, meta, encoded = link.pushes[1]
    assert (meta.base_version, meta.steps, meta.tokens) == (1, 1, 10)
    assert torch.equal(encoded["w"], torch.full((2,), -1.0))
    # Its merge: global = 1 - 0.25 x (-1) = 1.25, nothing kept on top (no step since).
    assert torch.equal(out[0]["w"], torch.full((2,), 1.25))


def test_the_drain_says_it_holds_before_it_waits_for_its_merges() -> None:
    """Two islands that drain together may each hold a push in flight that the other's next
    push completes (rounds crossed): each waited out the budget, then pushed again on the same
    base (CI rehearsal of a821ac3). The drain says in a heartbeat that it holds before it waits,
    which the syncer's crossed rule needs to merge such a round; here the 'syncer' hands the
    merge over on that heartbeat. It says it holds no more once its merges are in."""
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, heartbeatTimeoutSeconds=30), link)
    link.hold = True
    for _ in range(5):
        step(sync, w)  # the push at 4 (Δ = -4) held, one step on: w = 5
    link.release_when_holding = True
    link.finished.set()
    started = time.monotonic()
    out = drain(sync)
    assert time.monotonic() - started < 10  # not the 30 s budget
    assert [(b["holding"], b.get("drained", False)) for b in link.beats] == [
        (True, False),
        (False, True),
    ]
    # As in the test above: the merge in flight, then the one step since its push.
    assert [(m.base_version, m.steps) for _, m, _ in link.pushes] == [(0, 4), (1, 1)]
    assert torch.equal(out[0]["w"], torch.full((2,), 1.25))


def test_the_drain_does_not_push_again_a_fragment_whose_merge_is_late() -> None:
    """A merge that does not come within the drain's wait: its push may still merge, so the
    drain does not push the fragment again on the same base (both pushes merged: its steps
    twice, the job past its budget). It does not say drained either (its steps are not all
    merged) and trains on."""
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, heartbeatTimeoutSeconds=0.2), link)
    link.hold = True
    for _ in range(5):
        step(sync, w)  # the push at 4 held for good
    drain(sync)
    assert [(m.base_version, m.steps) for _, m, _ in link.pushes] == [(0, 4)]
    assert [b.get("drained", False) for b in link.beats] == [False]
    assert link.progress["holding"] is False and not link.progress.get("drained")
    assert list(sync.inflight) == [0]  # still waited for, by the training that follows


def test_synchronous_learner_blocks_at_the_apply_step() -> None:
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=2), link)
    assert sync.blocking
    for _ in range(4):
        step(sync, w)
    assert link.within == [False]  # K = M: in lock step, no alignment within merges
    sync, _ = make_sync(make_spec(quorum=1, overlapSteps=0), FakeLink(outer_lr=0.25))
    assert sync.blocking


@pytest.mark.parametrize("refuse", [False, True])
def test_a_push_not_merged_leaves_no_residual_behind(refuse: bool) -> None:
    link = FakeLink(outer_lr=0.0)
    link.refuse = refuse
    spec = make_spec(compression="int8", errorFeedback=True)
    sync, w = make_sync(spec, link)
    assert sync.error_feedback is not None
    for _ in range(4):
        step(sync, w)  # the push at H = 4
    assert "w" in sync.error_feedback.residuals  # what int8 dropped of it, kept for the next
    for _ in range(2):
        step(sync, w)  # its merge (or the refusal) is received after τ = 2 steps
    # Merged: the residual goes into the next push. Refused: it is forgotten with its push.
    assert ("w" in sync.error_feedback.residuals) is not refuse


def auto_rounds_spec() -> JobSpec:
    """Two islands, H = 8 sized per island by the syncer (inner.stepsPerIsland auto), one
    fragment, τ = 2 (overlapMode fixed: the fit at K < M is test_learner_overlap_fit's), no
    compression."""
    return parse_spec(
        {
            "islands": {"count": 2},
            "inner": {"steps": 8, "stepsPerIsland": "auto"},
            "sync": {
                "fragments": 1,
                "overlapSteps": 2,
                "overlapMode": "fixed",
                "compression": "none",
            },
        }
    )


def test_the_round_the_syncer_names_is_adopted_in_a_fresh_jobs_first_round() -> None:
    # H = 8 (inner.stepsPerIsland auto); the syncer names H_i = 4 for this (slow) island from
    # the start: taken at once, in place (nothing pushed yet), so the first push comes at
    # position 4 and then every 4 steps, each carrying 4 steps; each merge applied τ = 2 steps
    # after its push.
    spec = auto_rounds_spec()
    link = FakeLink(outer_lr=0.25)
    link.inner_steps = 4
    sync, w = make_sync(spec, link)
    applied_at, pushed_at = [], []
    for n in range(1, 17):
        before = len(link.pushes)
        if step(sync, w):
            applied_at.append(n)
        if len(link.pushes) > before:
            pushed_at.append(n)
    assert pushed_at == [4, 8, 12, 16]
    assert [meta.steps for _, meta, _ in link.pushes] == [4, 4, 4, 4]
    assert applied_at == [6, 10, 14]
    assert sync.round_steps == 4
    # τ stays below the round; the step cap is 4 x the longer of the two rounds + overlapSteps
    assert sync.overlap_fit.cap == 2
    assert sync.most_steps == 4 * 8 + 2
    # the drain's count in units of inner.steps' rounds: 16 steps at H / H_i = 2 each (the
    # first one counted before the round was adopted: at H, 1)
    assert sync.round_work == 1 + 15 * 2


def test_a_round_is_not_adopted_mid_round() -> None:
    # H = 8, H_i = 4 named after the first push: position 9..15 are no boundary of the 8-step
    # round; the next is 16, where the schedule becomes rounds of 4 (position 16 -> 8), and the
    # pushes carry 8, 8, then 4 steps.
    spec = auto_rounds_spec()
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(spec, link)
    for n in range(1, 21):
        if n == 9:
            link.inner_steps = 4
        step(sync, w)
        if n < 16:
            assert sync.round_steps == 8, n
    assert sync.round_steps == 4
    assert [meta.steps for _, meta, _ in link.pushes] == [8, 8, 4]


def test_a_round_named_past_its_end_in_the_first_round_is_cut_at_the_next_step() -> None:
    # H = 8, H_i = 3 named after step 5 (a probe's answer a step or two late): the first round
    # is cut at once, position 6 back to H_i - 1 = 2, so step 7 is position 3, fragment 0's
    # first sync point, and its push carries the 7 steps run; then a push every 3 steps, each
    # of 3, every merge applied τ = 2 steps after its push. Before issue 47's fix it waited for
    # the first round's end: a push of 8 steps at step 8.
    spec = auto_rounds_spec()
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(spec, link)
    applied_at, pushed_at = [], []
    for n in range(1, 17):
        if n == 6:
            link.inner_steps = 3
        before = len(link.pushes)
        if step(sync, w):
            applied_at.append(n)
        if len(link.pushes) > before:
            pushed_at.append(n)
    assert pushed_at == [7, 10, 13, 16]
    assert [meta.steps for _, meta, _ in link.pushes] == [7, 3, 3, 3]
    assert applied_at == [9, 12, 15]
    assert sync.round_steps == 3
    assert sync.position == 12  # step 16 is position 12: 4 rounds of 3
