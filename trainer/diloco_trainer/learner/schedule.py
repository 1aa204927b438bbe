"""The learner's pure step schedule: which fragments are pushed, skipped, waited for or
applied after each inner step, how long to wait for a merged fragment, and where a joining
learner's schedule starts.

Schedule (steps counted from 1, see `plan_step`):
- Fragment f is *due* at inner step t when `fragments_due(t, H, offsets)` lists it. Then rank 0
  computes Δ_f = θ_global_f − θ_local_f in fp32 on the CPU, encodes it with the job's codec and
  pushes it in the background, with the base version and the tokens, steps, mean loss and step time
  counted since it last *received* fragment f (so nothing is counted twice).
- Training goes on for τ = sync.overlapSteps steps. After step t+τ the merged fragment is applied,
  keeping the τ steps taken since the push: θ_f ← θ_global_f + (θ_f,now − θ_f,push) (mixing.py says
  why); θ_global_f becomes the new base and the fragment's counters keep only the steps since the
  push (they are in the next Δ). With sync.applyFrom "arrival" it is applied after the first
  step from t+1 at which it has arrived (`poll_from_steps`), keeping only the steps it took to
  come back; τ is then only where a blocking learner starts to wait.
- Steps are counted in schedule positions, which move one per inner step except while the island
  shifts its phase towards its peers' (see "phase alignment" below).
- A fragment that is due while its previous push is still unapplied is skipped (its counters keep
  running), so a pseudo-gradient is never sent twice on the same base.
- No fragment is pushed at a schedule position below H (plan_step says why): positions below H
  are a fresh job's first round, where fragment f > 0 then first syncs at H + f·H/F with
  1 + f/F rounds in its push. A learner that joins a running job starts at H or later
  (schedule_start), so it meets the merges the others push to.

Waiting policy: in a decoupled job (K < M, τ > 0) rank 0 never waits: it checks every step whether
the merge of its push has arrived and applies it then (`blocks_for_merge`). Otherwise, at step t+τ
rank 0 waits for the version the syncer named when it accepted the push (the background task
long-polls the syncer for it), but at most `wait_budget(...)` seconds: the larger of the
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
from typing import Any

from diloco_trainer.core.fragments import fragments_due
from diloco_trainer.core.grace import blocks_for_merge

__all__ = ["blocks_for_merge"]  # the learner's rule, kept in core so the syncer shares it

APPLY_FROMS = ("overlap", "arrival")  # sync.applyFrom
# An in-flight fragment's (first poll, wait deadline) in steps after its push (plan_step).
Window = tuple[int, int]


def poll_from_steps(*, apply_from: str, overlap: int) -> int:
    """Steps after its push from which an arrived merge of a fragment is applied (sync.applyFrom).

    "overlap" (the default): τ, so every merge keeps τ local steps on top of it, however early it
    came back. "arrival": the step after the push (min(1, τ): with τ = 0 the push step itself
    waits), so a merge back in L < τ steps keeps L steps, not τ. Why: at K = M on gpt-mini the τ = 5
    kept steps cost 1.0-1.6% of the loss against τ = 1 (bench/log/2026-11-26.md, "gpt-mini against
    torchft in real processes") (figure not found in the log), while the merges came back in a
    step or two; τ stays the most a learner trains on before it waits, so a slow syncer's latency
    is hidden as before.
    """
    if apply_from not in APPLY_FROMS:
        raise ValueError(
            f"sync.applyFrom must be one of {', '.join(APPLY_FROMS)}, got {apply_from!r}"
        )
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    return overlap if apply_from == "overlap" else min(1, overlap)


OVERLAP_MODES = ("auto", "fixed")  # sync.overlapMode
# sync.overlapMode auto leaves a learner waiting for its merges at most this share of a round's
# time: the overlap is the fewest steps that do.
OVERLAP_FREE_SHARE = 0.01
# sync.overlapMode auto's τ before any sync latency is measured (fit_overlap says why).
FIRST_OVERLAP = 1


def fit_overlap(
    *,
    mode: str,
    cap: int,
    latency: float | None,
    step_time: float,
    inner_steps: int,
    fragments: int,
) -> int:
    """τ for the next push (sync.overlapMode): the fewest inner steps that hide the sync's
    latency up to a wait of OVERLAP_FREE_SHARE of a round, at most `cap` (sync.overlapSteps).

    `latency` is the seconds from a push to its merged fragment being back, less any wait for
    peers: the push's own transfer, the syncer's merge (mergeSeconds) and the pull (None: not
    measured yet). A learner that blocks τ steps after each of its F pushes per round of H steps
    waits F·max(0, L − τ·t) a round, so τ = ceil((L − share·H·t/F) / t), clamped to 0..cap.
    "fixed": `cap`. "auto" with nothing measured yet (a job's first pushes): one step, at most
    `cap`: a wait for a slow first merge costs once per fragment, while kept steps in the first
    round, where the weights change fastest, cost most (gpt-mini at K = M, seeds 0 and 1: 1.0095x
    and 1.0014x of torchft's loss with the cap there, 1.0030x / 0.9990x and 0.9960x with one step).

    Why: every kept step is a step taken from a base the merge has moved, and on gpt-mini at K = M
    the τ = 5 kept steps cost 1.1-3.1% of the loss at equal tokens against τ = 0, where the merges
    came back within a step or two (bench/log/2026-11-26.md, "overlapSteps 0 on gpt-mini"); on a GPU
    whose merges take many steps the fit is the cap, as before.
    """
    if mode not in OVERLAP_MODES:
        raise ValueError(
            f"sync.overlapMode must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}"
        )
    if cap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {cap}")
    if mode == "fixed":
        return cap
    if latency is None or not math.isfinite(latency) or step_time <= 0:
        return min(cap, FIRST_OVERLAP)
    allowance = OVERLAP_FREE_SHARE * inner_steps * step_time / max(1, fragments)
    steps = (max(0.0, latency) - allowance) / step_time
    # A hair over a whole number is float noise, not a step more.
    return min(cap, max(0, math.ceil(steps - 1e-9)))


def sync_latency(
    *,
    push_seconds: float,
    push_bytes: int,
    merge_seconds: float | None,
    pull_bytes: int,
    pull_seconds: float | None = None,
    rebuild_seconds: float = 0.0,
) -> float | None:
    """A sync's latency less any wait for peers (what fit_overlap hides): the push's seconds
    (its transfer and the syncer's fold), the syncer's mergeSeconds for the version, the pull's
    own seconds (its time less the syncer's long-poll wait; when the syncer did not say it, its
    transfer at the push's rate, pull_bytes / push_bytes of the push's time) and the learner's
    rebuild of an update chain. None when the syncer did not say its mergeSeconds."""
    if merge_seconds is None:
        return None
    if pull_seconds is not None:
        pull = pull_seconds
    else:
        pull = push_seconds * pull_bytes / push_bytes if push_bytes > 0 else 0.0
    return max(0.0, push_seconds) + max(0.0, merge_seconds) + pull + max(0.0, rebuild_seconds)


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


def starts_fresh(versions: Sequence[int]) -> bool:
    """Whether a learner joining with these fragment versions starts with the job (nothing merged
    yet), so that its first round is every island's first round (see plan_step)."""
    return all(v == 0 for v in versions)


def plan_step(
    step: int,
    *,
    inner_steps: int,
    offsets: Sequence[int],
    overlap: int,
    pushed_at: Mapping[int, int],
    abandoned: frozenset[int] = frozenset(),
    deadline: int | None = None,
    poll_from: int | None = None,
    windows: Mapping[int, Window] | None = None,
) -> StepPlan:
    """Decide what happens to each fragment after inner step `step` (counted from 1).

    `pushed_at` maps each fragment with a push in flight (pushed, merged result not applied yet) to
    the step it was pushed at. A fragment pushed at step s is applied after step s + overlap; with
    overlap 0 that is the very step it is pushed at, so it appears in both `push` and `wait`.

    `abandoned` are in-flight fragments whose merged result is overdue by more than the wait
    budget (e.g. the syncer restarted and lost the pending push): when one is due again it is
    pushed afresh (same base, counters since the last receipt; the syncer replaces an island's
    pending push) instead of skipped, so a lost push cannot stall the fragment for good.

    `deadline` (core/grace.merge_wait_steps; the overlap when None) is how many steps after its
    push a fragment is waited for: from `overlap` steps after the push until then it is only
    polled (applied if it has arrived), so sync.mergeWait "nextPush" waits for a late merge
    just before the fragment is due again instead of τ steps after the push.

    `poll_from` (poll_from_steps; the overlap when None) is how many steps after its push a
    fragment is first polled: sync.applyFrom "arrival" polls from the step after the push, so a
    merge that came back early is applied then, before the wait at `deadline`.

    `windows` gives an in-flight fragment its own (poll_from, deadline), those of the τ it was
    pushed with (sync.overlapMode auto fits τ between pushes); a fragment pushed now, or one
    not in it, has `poll_from` and `deadline`.

    A fragment due at a step below H is skipped: those steps are a fresh job's first round
    (schedule_start starts every later join at H or later), so every island skips alike and each
    fragment's first push holds its stagger plus a whole round (1 + f/F rounds). Pushed at its
    first sync point, fragment f > 0 took an outer step on f/F of a round of a fresh model, and
    that early step was all that 2 streamed fragments cost at K = M in bench/studies/ablation
    (issue 23; docs/algorithm.md has the figures).
    """
    if step < 1:
        raise ValueError(f"inner steps are counted from 1, got {step}")
    if overlap < 0:
        raise ValueError(f"sync.overlapSteps must be >= 0, got {overlap}")
    deadline = overlap if deadline is None else deadline
    if deadline < overlap:
        raise ValueError(f"a merge's wait deadline ({deadline}) precedes the overlap ({overlap})")
    poll_from = overlap if poll_from is None else poll_from
    if not 0 <= poll_from <= overlap:
        raise ValueError(f"a merge's first poll ({poll_from}) is not within 0..{overlap}")
    for first, last in (windows or {}).values():
        if not 0 <= first <= last:
            raise ValueError(f"a merge's first poll ({first}) is not within 0..{last}")
    due = fragments_due(step, inner_steps, offsets)
    early = step < inner_steps  # a fresh job's first round: no push yet
    push = tuple(f for f in due if not early and (f not in pushed_at or f in abandoned))
    skip = tuple(f for f in due if f not in push)
    apply_at = dict(pushed_at)
    apply_at.update({f: step for f in push})
    window = {f: (poll_from, deadline) for f in apply_at}
    window.update({f: w for f, w in (windows or {}).items() if f in pushed_at and f not in push})
    wait = tuple(sorted(f for f, s in apply_at.items() if s + window[f][1] == step))
    poll = tuple(
        sorted(
            f for f, s in apply_at.items() if s + window[f][0] <= step and s + window[f][1] != step
        )
    )
    return StepPlan(push=push, skip=skip, wait=wait, poll=poll)


def plan_idle(
    position: int,
    *,
    overlap: int,
    pushed_at: Mapping[int, int],
    poll_from: int | None = None,
    windows: Mapping[int, Window] | None = None,
) -> StepPlan:
    """The plan for an inner step that does not move the schedule (a phase delay): nothing is
    due; fragments from their first poll on (`poll_from` steps after the push, as in plan_step;
    the overlap when None; an in-flight fragment's own from `windows`) are applied if they have
    arrived (no waiting)."""
    start = overlap if poll_from is None else poll_from
    first = {f: (windows or {}).get(f, (start, start))[0] for f in pushed_at}
    return StepPlan(poll=tuple(sorted(f for f, s in pushed_at.items() if s + first[f] <= position)))


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
    the wait budget runs out.

    A join into a running job (some fragment merged: not `starts_fresh`) starts a round later in
    the same phase, at H or later, so plan_step's first-round rule (no push below step H) is a
    fresh job's alone: a joiner must push at the sync points the running islands push at. A
    fresh job starts at 0; so, with F = 1 or everything at version v, does the phase.
    """
    if len(versions) != len(offsets):
        raise ValueError(f"{len(versions)} versions for {len(offsets)} fragments")
    positions = [off % inner_steps or inner_steps for off in offsets]
    order = sorted(range(len(offsets)), key=lambda f: (positions[f], f))
    lowest = min(versions)
    nxt = next(f for f in order if versions[f] == lowest)
    start = max([0, *(p for p in positions if p < positions[nxt])])
    return start if starts_fresh(versions) else start + inner_steps


# --- phase alignment ----------------------------------------------------------------------------
#
# Identical islands should push a fragment at the same moment, so that one merge carries all of
# their work (at K < M a lone push opens a merge of its own, and at K = 1 two islands a fraction of
# a second apart never meet again: every merge is one island's). Start-up skew is never absorbed by
# itself, because each island times its pushes by its own step count. So a learner that learns of
# a merge of a fragment it was not part of, between the version it last received and its push,
# made by a *leader* (an island at about its own speed whose name sorts before its own), moves its
# schedule onto the leader's:
#
#   x = (its push time − that merge's time), wrapped into [−R/2, R/2) with R = H · step time
#   (the wall time per step, everything between steps included),
#   (x > 0: it pushed after the leader; x < 0: it is early for the leader's next merge),
#   shift = −x in steps (PHASE_GAIN), at most H/4 per round (positive: delay, negative: advance).
#
# Why a leader, and not both islands moving halfway towards each other: each sees the other's
# lone merge, and two islands half a round apart each find the other "late" by R/2, minus the
# merge's own latency: both advance, and they stay half a round apart for ever (seen in a smoke
# run). With an order, the first island (by name) keeps its clock and every other one converges
# on it; when it leaves, the next one in the order is the leader. Islands much slower or faster
# than this one (a straggler) are never in phase with it and are ignored (PEER_SPEED_RATIO). The
# shift moves the schedule position a learner reports and pushes by, not its learning rate, and
# is taken one position per inner step (see schedule_positions).

# Merges by islands whose step time is within this factor of ours count for phase alignment.
PEER_SPEED_RATIO = 1.5
# Share of the measured offset a learner corrects per round. The whole of it: the leader does not
# move, so a reading's noise is not compounded. Half (tried) averages noise but converged too
# slowly for short jobs: in tests/e2e/test_quorum_quality.py (12 rounds) quorum 1 ended 4-8%
# behind quorum 3 with half against 2-4% with the whole.
PHASE_GAIN = 1.0


def _is_leader(islands: Mapping[str, Any], name: str, *, island: str, step_time: float) -> bool:
    """Whether `name` leads `island`: named before it, with a step time within
    PEER_SPEED_RATIO of its own (the syncer's status `islands`)."""
    other = islands.get(name, {}).get("stepTime")
    if not other or name >= island:
        return False
    return 1 / PEER_SPEED_RATIO <= float(other) / step_time <= PEER_SPEED_RATIO


def merge_lateness(
    status: Mapping[str, Any],
    *,
    fragment: int,
    island: str,
    base_version: int,
    accepted_version: int,
    pushed_ago: float,
    step_time: float,
) -> float | None:
    """Seconds by which this island's push of `fragment` came after the latest merge of it by a
    leader (an island at about its speed, named before it) that it was not part of, among
    versions base_version+1 .. accepted_version; None when there is none.

    `status` is the syncer's status document, read `pushed_ago` seconds after the push was
    accepted (so the push happened at status["time"] − pushed_ago on the syncer's clock).
    """
    if accepted_version <= base_version or step_time <= 0:
        return None
    islands = status.get("islands", {})
    pushed_at = float(status["time"]) - pushed_ago

    def leader(name: str) -> bool:
        return _is_leader(islands, name, island=island, step_time=step_time)

    def leaders(m: Mapping[str, Any]) -> list[str]:
        names = [str(c.get("island")) for c in m.get("contributors", [])]
        return [] if island in names else [n for n in names if leader(n)]

    merges = [
        m
        for m in status.get("merges", [])
        if m.get("fragment") == fragment
        and base_version < int(m.get("version", -1)) <= accepted_version
        and leaders(m)
    ]
    if not merges:
        return None
    # Follow the first island of all, not whichever leader merged last: a leader that is itself
    # still moving into phase is no fixed point (every follower chased every move in a run).
    first = min(n for m in merges for n in leaders(m))
    latest = max((m for m in merges if first in leaders(m)), key=lambda m: int(m["version"]))
    return pushed_at - float(latest["time"])


def lateness_within(
    status: Mapping[str, Any], *, fragment: int, version: int, island: str, step_time: float
) -> float | None:
    """Seconds by which this island's push reached the syncer after the first leader's (see
    merge_lateness) in their merge `version` of `fragment` (receivedAt, the syncer's clock;
    negative: before it); None when that merge is not in `status` or lacks either time.

    For learners that do not block, whose merge is `version` = the base of their next push. A
    grace window long enough to hold the whole round never makes an island miss a merge, so
    merge_lateness never fires: an island that started late stayed late for good and the
    islands ahead of it applied each merge most of a round after their push (examples/local.yaml
    at quorum 2: 1.05x quorum 3's loss). The reading is of the previous push: the learner skips
    readings of pushes made before its last shift, which would correct the same offset twice.
    """
    if step_time <= 0:
        return None
    islands = status.get("islands", {})

    def leader(name: str) -> bool:
        return _is_leader(islands, name, island=island, step_time=step_time)

    for m in status.get("merges", []):
        if m.get("fragment") != fragment or int(m.get("version", -1)) != version:
            continue
        at = {str(c.get("island")): c.get("receivedAt") for c in m.get("contributors", [])}
        firsts = sorted(n for n, t in at.items() if t is not None and leader(n))
        if at.get(island) is None or not firsts:
            return None
        return float(at[island]) - float(at[firsts[0]])
    return None


# A reading within a merge (lateness_within) moves the schedule only when it is at least this
# share of a round. Those readings are of pushes that met in one merge, so their noise is all
# there is once islands are in phase: on two shared cores they jitter by 1-6 steps a round at
# H = 30 (0.02-0.17 s at 0.027 s a step), and correcting each one made identical islands chase
# each other (advance 6, delay 1, delay 2, advance 4, ...), their work per push 24-33 steps, and
# K = 1 ended 1.5-4% behind K = M (bench/log/2026-11-24.md, "decoupled_quality — 2026-11-24 09:48").
# An offset under an eighth of a round costs the islands ahead at most that many steps of staleness
# on the merge they apply; the offset the rule exists for (a start-up lag of 10-18 steps of 50 in
# examples/local.yaml) is well above it. Readings of a missed merge (merge_lateness) have no dead
# band: missing one is news.
WITHIN_DEADBAND = 1 / 8


def phase_shift(
    lateness: float, *, inner_steps: int, step_time: float, within: bool = False
) -> int:
    """Steps to move this island's schedule by, given `lateness` (see merge_lateness, or
    lateness_within when `within`): positive delays its next pushes, negative brings them
    forward; 0 when under half a step, or for a reading within a merge under WITHIN_DEADBAND of
    a round."""
    if inner_steps < 1 or step_time <= 0 or not math.isfinite(lateness):
        return 0
    period = inner_steps * step_time
    x = (lateness + period / 2) % period - period / 2  # into [−R/2, R/2)
    if within and abs(x) < WITHIN_DEADBAND * period:
        return 0
    steps = round(-PHASE_GAIN * x / step_time)
    limit = inner_steps // 4
    return max(-limit, min(limit, steps))


def schedule_positions(position: int, pending: int) -> tuple[list[int], int]:
    """The schedule positions one inner step passes through, and the shift still pending.

    Normally one (position + 1). While a delay is pending (pending > 0) a step passes through
    none: the island trains without moving its schedule. While an advance is pending
    (pending < 0) a step passes through two, so the pushes due at both happen one step early.
    """
    if pending > 0:
        return [], pending - 1
    if pending < 0:
        return [position + 1, position + 2], pending + 1
    return [position + 1], 0


def rewarm_factor(steps_run: int, *, warmup_steps: int, joined_mid_job: bool) -> float:
    """Multiplier on the inner learning rate after a learner (re)joins a running job.

    A restarted learner has a fresh AdamW (its state died with the process: learners keep no
    checkpoint), exactly like every learner at the job's start, so it gets the same linear
    warm-up (inner.warmupSteps) again on top of the schedule's rate: a fresh Adam's first steps
    are about lr in size in every coordinate. An island that joins at the start (or a job without
    warm-up) is not affected.
    """
    if not joined_mid_job or warmup_steps <= 0 or steps_run >= warmup_steps:
        return 1.0
    return (steps_run + 1) / warmup_steps
