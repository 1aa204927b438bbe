"""The learner's pure step schedule: which fragments are pushed, skipped, waited for or
applied after each inner step, how long to wait for a merged fragment, and where a joining
learner's schedule starts.

Schedule (steps counted from 1, see `plan_step`):
- Fragment f is *due* at inner step t when `fragments_due(t, H, offsets)` lists it. Then rank 0
  computes Δ_f = θ_global_f − θ_local_f in fp32 on the CPU, encodes it with the job's codec and
  pushes it in the background, with the base version and the tokens, steps, mean loss and step time
  counted since it last *received* fragment f (so nothing is counted twice).
- Training goes on for τ = sync.overlapSteps steps. After step t+τ the merged fragment is applied:
  θ_f ← α·θ_f,local + (1−α)·θ_f,global (α = sync.mixAlpha); θ_global_f becomes the new base and the
  fragment's counters restart.
- A fragment that is due while its previous push is still unapplied is skipped (its counters keep
  running), so a pseudo-gradient is never sent twice on the same base.

Waiting policy: at step t+τ rank 0 waits for a version newer than the pushed base (the background
task long-polls the syncer for it), but at most `wait_budget(...)` seconds: the larger of the
syncer's heartbeat timeout (after which a dead island no longer holds a quorum back) and three
times the recently measured push-to-merge time. If nothing arrived by then the learner keeps
training and applies the fragment after the first later step at which it has arrived (a
non-blocking check every step). So a learner never deadlocks on a syncer that is down or a quorum
that cannot form; it just trains locally until the syncer answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_trainer.core.fragments import fragments_due

# How many times the recent push-to-merge time a learner waits before it trains on without the
# merged fragment.
ROUND_TIME_FACTOR = 3.0


@dataclass(frozen=True)
class StepPlan:
    """What a learner does with its fragments after inner step `step`.

    push: due now and idle: compute Δ and push it.
    skip: due now, but the previous push of the fragment is not applied yet: keep accumulating.
    wait: the merged fragment is needed now: wait (bounded) for it, then apply it.
    poll: overdue (an earlier bounded wait ran out): apply it only if it has already arrived.
    """

    push: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()
    wait: tuple[int, ...] = ()
    poll: tuple[int, ...] = ()


def plan_step(
    step: int,
    *,
    inner_steps: int,
    offsets: Sequence[int],
    overlap: int,
    pushed_at: Mapping[int, int],
    abandoned: frozenset[int] = frozenset(),
) -> StepPlan:
    """Decide what happens to each fragment after inner step `step` (counted from 1).

    `pushed_at` maps each fragment with a push in flight (pushed, merged result not applied yet) to
    the step it was pushed at. A fragment pushed at step s is applied after step s + overlap; with
    overlap 0 that is the very step it is pushed at, so it appears in both `push` and `wait`.

    `abandoned` are in-flight fragments whose merged result is overdue by more than the wait
    budget (e.g. the syncer restarted and lost the pending push): when one is due again it is
    pushed afresh (same base, counters since the last receipt; the syncer replaces an island's
    pending push) instead of skipped, so a lost push cannot stall the fragment for good.
    """
    if step < 1:
        raise ValueError(f"inner steps are counted from 1, got {step}")
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    due = fragments_due(step, inner_steps, offsets)
    push = tuple(f for f in due if f not in pushed_at or f in abandoned)
    skip = tuple(f for f in due if f in pushed_at and f not in abandoned)
    apply_at = dict(pushed_at)
    apply_at.update({f: step for f in push})
    wait = tuple(sorted(f for f, s in apply_at.items() if s + overlap == step))
    poll = tuple(sorted(f for f, s in apply_at.items() if s + overlap < step))
    return StepPlan(push=push, skip=skip, wait=wait, poll=poll)


def wait_budget(round_times: Sequence[float], heartbeat_timeout: float) -> float:
    """Seconds to block for a merged fragment before training on without it.

    At least the heartbeat timeout (a dead island stops counting towards the quorum after that, so
    a reachable quorum merges within it) and at least ROUND_TIME_FACTOR times the slowest recent
    push-to-merge time (a legitimately slow quorum, e.g. K = M with a straggler).
    """
    if heartbeat_timeout <= 0:
        raise ValueError(f"sync.heartbeatTimeoutSeconds must be > 0, got {heartbeat_timeout}")
    recent = max((t for t in round_times if math.isfinite(t) and t >= 0), default=0.0)
    return max(heartbeat_timeout, ROUND_TIME_FACTOR * recent)


def schedule_start(versions: Sequence[int], inner_steps: int, offsets: Sequence[int]) -> int:
    """The inner step count a joining learner starts from, so that its first push is of the
    fragment the syncer merges next (and its own schedule is in phase with the others').

    Within a round fragments are due in the order of their positions (offset, or H for offset 0),
    so the fragment merged next is the first in that order with the lowest version. The learner
    starts right after the preceding position, giving it a full slot of training before that
    push. Why it matters: with a quorum of every island and F > 1, an island out of phase would
    wait for fragment f while another waits for fragment g from it, each blocking the other until
    the wait budget runs out. With F = 1, or everything at version v, the start is 0.
    """
    if len(versions) != len(offsets):
        raise ValueError(f"{len(versions)} versions for {len(offsets)} fragments")
    positions = [off % inner_steps or inner_steps for off in offsets]
    order = sorted(range(len(offsets)), key=lambda f: (positions[f], f))
    lowest = min(versions)
    nxt = next(f for f in order if versions[f] == lowest)
    return max([0, *(p for p in positions if p < positions[nxt])])
