"""The end of a job: each island trains its part of stopAfter, pushes the work its fragments
still hold, and says when all of it is merged (drained), so the final weights hold every token
the islands processed and stopAfter is met to the step.

Why. Without it the syncer finishes at the first merge that reaches the budget, and the steps
each island took after its last push of each fragment never reach the weights: the τ overlapped
steps and, with F streamed fragments, the part of a round the later fragments' pushes are behind.
On gpt-mini that was ~5% of the budget (648K tokens processed, 630K merged: bench/log/2026-11-27.md,
"gpt-mini at K = M read on two token axes").

The share. Only where every merge needs every island (sync.quorum >= the islands): the islands
then run in lock step, so each trains 1/M of the budget, `share_steps` inner steps counted over
the island's life (its merged work at join plus the steps since). At K < M islands run at their
own pace and an equal share would idle the fast ones behind a straggler: there the syncer,
which hears every island's count, splits what is left of the budget by pace once it is near and
sends each island its stop target in its heartbeat answers (syncer/state/targets.py); the island
drains when its count reaches it; at K = M, once the budget is split, past its share and
without a target yet, it asks for one every FINISH_POLL_SECONDS (DrainTrigger.asks_now: the
syncer sets them once every island still training has heard of the split). Without a target
(an island that joined after they were set, one whose pace the syncer did not hear within three
heartbeat intervals of its join, or a budget reached before two heartbeats measured a pace) the
syncer's own rule stands: the job ends at the first merge that reaches the budget.

The drain (rank 0, `drain`, in place of the step's `after_step`): say in a heartbeat that the
island holds (it pushes nothing more until its merges come, as a learner at the step cap: the
syncer closes rounds crossed with a peer draining at the same moment, syncer/state/crossed.py),
take the merges of the pushes in flight (a push now, from the same base, would carry their work
twice) and install their weights on rank 0 (its push reads them; every rank gets them from the
caller), push every fragment that holds steps since its base (a partial round: the syncer merges
it at its work fraction, core/contributions.py) but one whose merge is still late, take those
merges, then tell the syncer in a heartbeat that the island drained (syncer/state/rounds.py:
it waits for drained islands no more, and finishes once every active island has drained at the
budget). The island then waits for the finish; if it does not come within the wait budget (work
was lost: an island was dropped with its part undone; or an island is not draining), it says so,
stops saying drained and trains on under the syncer's rule, until stopAfter is reached; so does
one whose merge came too late to be pushed on. Work a syncer restart took back (it resumed
from an older checkpoint) is trained before the drain instead: the loop leaves
FragmentSync.lost_work out of the share's count (fragment_state.MergedSteps).
"""

from __future__ import annotations

import logging
import math
import time

from torch import Tensor

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.island_rounds import RoundLimits
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.step_plan import wait_budget

log = logging.getLogger("diloco.learner")
# A drained island asks whether the job finished this often (one heartbeat each time).
FINISH_POLL_SECONDS = 0.25
Weights = dict[str, Tensor]


def share_steps(spec: JobSpec, *, tokens_per_step: int) -> int | None:
    """Inner steps one island trains before it drains: stopAfter.outerSteps x H, or
    stopAfter.tokens / (M x the island's tokens per step) rounded down (at least 1), the fewer;
    None when islands keep no share (K < M, or no stopAfter). With an override pinning a round
    other than H (RoundLimits.pins_differ) no token share: the syncer's stop target ends the
    island's part. inner.stepsPerIsland auto keeps it, as fixed does: it counts only while every
    island's round is H, which the syncer says (split_budget, DrainTrigger.due).
    Counted in rounds of H (the loop's round_work), the outer-step share is exact whatever the
    H_i. Rounded down, the islands stay
    within the budget: no merge reaches it before every island's last push is in, and the job
    ends once all have drained (syncer/targets.drained_at_budget)."""
    islands = max(spec.islands.count, spec.total_shards())
    if spec.sync.quorum < islands:
        return None
    stop = spec.stop_after
    shares = []
    if stop.outer_steps is not None:
        shares.append(stop.outer_steps * spec.inner.steps)
    # Pinned rounds of different lengths: 1/M of the budget each would assume rounds of H; the
    # syncer, which knows every island's H_i, sends each its stop target instead
    # (syncer/state/targets.py, split by tokens per round). Measured ones (auto) may stay H.
    if stop.tokens is not None and not RoundLimits.from_spec(spec).pins_differ:
        shares.append(max(1, stop.tokens // (islands * max(1, tokens_per_step))))
    return min(shares, default=None)


class DrainTrigger:
    """When rank 0 drains, once: at its share of stopAfter (K = M: `share` inner steps over
    the island's life, `steps_before` of them merged before this process joined) unless the
    syncer split the budget (`split`: the islands' rounds differ, core/island_rounds.
    split_budget), or once its count of processed tokens reaches the syncer's stop target (K < M,
    or K = M split; syncer/state/targets.py). After a drain that did not end the job, never
    again: the island trains on."""

    def __init__(self, *, share: int | None, steps_before: int) -> None:
        self.share = share
        self.steps_before = steps_before
        self.done = False
        self.asked_at = -math.inf  # when it last asked the syncer for its target (asks_now)

    def asks_now(self, steps_run: int, stop_at: int | None, *, split: bool, now: float) -> bool:
        """Whether to heartbeat now, outside the timer: the budget is split (K = M, rounds
        that differ), this island is past its share and has no stop target yet. The syncer
        sets the targets once every island still training has heard of the split
        (syncer/state/targets.ready_to_split); heard at the timer's next beat, up to
        LEARNER_BEAT_SECONDS later, the island trains on past what is left meanwhile. Asked
        every FINISH_POLL_SECONDS, its target comes within one. `now`: time.monotonic()."""
        if self.done or not split or stop_at is not None or self.share is None:
            return False
        if self.steps_before + steps_run < self.share or now - self.asked_at < FINISH_POLL_SECONDS:
            return False
        self.asked_at = now
        return True

    def due(self, steps_run: int, tokens: int, stop_at: int | None, *, split: bool = False) -> bool:
        """After `steps_run` steps of this process and `tokens` processed (its count); `split`:
        the syncer said the budget is split per island (its share is then off: a fast island
        beside a slower one's short rounds has more than 1/M of the budget to train)."""
        if self.done:
            return False
        shared = (
            not split and self.share is not None and self.steps_before + steps_run >= self.share
        )
        self.done = shared or (stop_at is not None and tokens >= stop_at)
        return self.done


def drain(sync: FragmentSync) -> dict[int, Weights]:
    """Push what the island's fragments hold and take the merges (see the module docstring);
    the weights of each fragment to apply now, as FragmentSync.after_step returns them. Then
    wait for the finish, up to the wait budget."""
    budget = wait_budget(sync.round_times, sync.spec.sync.heartbeat_timeout_seconds)
    out: dict[int, Weights] = {}
    # Two islands that reach their drains together may each hold a push of a different
    # fragment in flight, each merge waiting for the other island's push of that fragment,
    # which it makes only once its own merge came: rounds crossed. Said holding, the syncer
    # merges such a round without the island it lacks (crossed.py). Before, at K = 2 of 3 both
    # waited out the budget (4 s) and pushed again on the same bases; the pushes in flight
    # merged too, so 12 steps merged twice and the job ended 352 tokens past its budget (CI
    # rehearsal of a821ac3, tests/e2e/test_drain.py).
    sync.link.progress["holding"] = True
    sync.link.submit(sync.link.report_now())
    _take_inflight(sync, budget, out)
    # A push reads Δ = θ_global − θ_local from the parameters, so the receipts' weights
    # (θ_global + the steps since each push) must be in them first. Pushed from the weights
    # before the receipts, the drain's Δ also held θ_global − θ_push, the merge's own move,
    # while its counters held only the steps since the push: a push of one step carried a
    # round or more of movement (5.6x one AdamW step in tests/e2e/test_drain.py, issue 46).
    sync.install(out)
    # A fragment whose merge is still late is not pushed again: that push may yet merge, and
    # one again on its base carries its steps a second time (the syncer merges both).
    late = sorted(sync.inflight)
    pushed = [
        f
        for f, state in enumerate(sync.fragments)
        if state.counters.steps > 0 and f not in sync.inflight
    ]
    for f in pushed:
        sync.push(f, sync.position, (0, 0))
    log.info(
        "step %d: this island's part of the job is done (its share of stopAfter, or at K < M "
        "the syncer's stop target): draining (fragment(s) %s pushed%s)",
        sync.position,
        pushed,
        f"; the merge of fragment(s) {late} is late, not pushed again" if late else "",
    )
    merged = _take_inflight(sync, budget, out)
    sync.link.progress["holding"] = False
    held = [f for f, state in enumerate(sync.fragments) if state.counters.steps > 0]
    if merged and held:
        # A late merge came: the steps since its push are not pushed, so the island has not
        # drained; it trains on and pushes them with its next round.
        log.warning("fragment(s) %s: steps since a late merge not pushed; training on", held)
    if merged and not held and not sync.stop.is_set():
        sync.link.progress["drained"] = True
        sync.link.submit(sync.link.report_now())
        _wait_finished(sync, budget)
    return out


def _take_inflight(sync: FragmentSync, budget: float, out: dict[int, Weights]) -> bool:
    """Collect and receive every fragment in flight (up to `budget` s each, until one does not
    come; those after it only if they came already) into `out`; whether all of them came."""
    came = True
    for f in sorted(sync.inflight):
        if not sync.collect(f, block=budget if came else 0.0):
            if not (sync.finished() or sync.stop.is_set()):
                log.warning("fragment %d: its merge did not come within %.0fs", f, budget)
            came = False
            continue
        target = sync.receive(f)
        if sync.shards is None:  # sharded: every rank has installed its rows already
            out[f] = target
    return came


def _wait_finished(sync: FragmentSync, budget: float) -> None:
    """Wait for the finish, asking the syncer in a heartbeat every FINISH_POLL_SECONDS (its
    answer says finished: a drained island has no pull in flight to hear it from); past
    `budget`, stop saying drained and train on."""
    deadline = time.monotonic() + budget
    while not (sync.finished() or sync.stop.is_set()) and time.monotonic() < deadline:
        if not sync.link.finished.wait(timeout=FINISH_POLL_SECONDS):
            sync.link.submit(sync.link.report_now())
    if sync.finished() or sync.stop.is_set():
        return
    sync.link.progress["drained"] = False
    log.warning(
        "drained, but the job did not finish within %.0fs (work was lost to a syncer restart "
        "or a dropped island, or an island has not drained); training on until stopAfter",
        budget,
    )
