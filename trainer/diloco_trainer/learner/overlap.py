"""How many steps a learner overlaps a push with (sync.overlapMode), fitted to the sync
latencies it measured, and the steps after a push at which it polls for and waits for the merge:
the pure rule (`fit_overlap`, and `sync_latency`: the latency it hides) and its keeper per
learner (`OverlapFit`).

Each push is planned with the τ fitted when it was made (step_plan.plan_step's windows), so a τ
that changes while another fragment is in flight moves no merge already planned.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.compress import CODECS, wire_bytes_per_value
from diloco_trainer.core.grace import merge_wait_steps
from diloco_trainer.learner.step_plan import Window, link_bound, poll_from_steps

log = logging.getLogger("diloco.learner")

OVERLAP_MODES = ("auto", "fixed")  # sync.overlapMode
OVERLAP_COVERS = ("sync", "merge")  # sync.overlapCovers
# sync.overlapMode auto leaves a learner waiting for its merges at most this share of a round's
# time: the overlap is the fewest steps that do.
OVERLAP_FREE_SHARE = 0.01
# sync.overlapMode auto's τ before any sync latency is measured and with no estimate from the
# join (fit_overlap says why).
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
    "fixed": `cap`. "auto" with nothing measured yet: OverlapFit passes a blocking learner's
    estimate from its join (join_latency) as `latency`; with none (None), one step, at most
    `cap`: kept steps in the first round, where the weights change fastest, cost most (gpt-mini
    at K = M, seeds 0 and 1: 1.0095x and 1.0014x of torchft's loss with the cap there, 1.0030x /
    0.9990x and 0.9960x with one step), but the cap was H − 1, not the latency's few steps.

    Why: every kept step is a step taken from a base the merge has moved, and on gpt-mini at
    K = M the τ = 5 kept steps cost 1.1-3.1% of the loss at equal tokens against τ = 0, where the
    merges came back within a step or two (bench/log/2026-11-26.md, "overlapSteps 0 on gpt-mini");
    on a GPU whose merges take many steps the fit is the cap, as before.
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


def join_latency(
    *,
    pull_bytes: Sequence[int],
    pull_seconds: Sequence[float | None],
    values: int,
    fragments: int,
    push_codec: str,
    pull_codec: str,
) -> float | None:
    """A sync's latency estimated from the join's pull of every fragment's global weights,
    before any sync is measured: the join's seconds per byte, Σs / Σbytes (`pull_seconds`: each
    pull's own seconds, no long-poll wait in them; `pull_bytes`: its body), times the bytes one
    sync of a mean fragment moves, a push up and its merge down: values / F x (b_push + b_pull),
    b a codec's wire bytes per value (compress.wire_bytes_per_value: int8 1 + 4/128, none 4).
    None when there was no pull, no byte, or a pull's seconds are not known (an older syncer):
    fit_overlap then takes FIRST_OVERLAP.

    Why: the join moved each fragment over the same link as the syncs will, with the islands
    joining within a second of each other as they push, so its pulls share the link as a sync's
    pushes and pulls do. Its body is the full fp32 weights, 4 bytes a value, where a sync moves
    the push's and the pull's codec (int8 both ways by default: the join's bytes, unscaled,
    read 0.51-0.83 s for syncs of 0.35-0.47 s at L = 50%, and fitted τ to the cap, 29). Left
    out: the requests' round trips, the syncer's merge and the wait for peers, so it reads low
    (at gpt-tiny, L = 50%: 0.2 s for syncs of 0.3-0.5 s); the fill steps cover the rest, up to a
    round at a fragment's first merge (step_plan.first_fill_cap), and a low first τ keeps few
    of the first round's steps, where kept steps cost most. At K = M the first push of each
    fragment was made with τ = 1 and waited a whole sync for its merge (docs/algorithm.md, "The
    first push's overlap")."""
    if not pull_seconds or len(pull_bytes) != len(pull_seconds) or fragments < 1:
        return None
    known = [s for s in pull_seconds if s is not None and math.isfinite(s)]
    total = sum(pull_bytes)
    if len(known) != len(pull_seconds) or total <= 0 or values <= 0:
        return None
    per_byte = sum(max(0.0, s) for s in known) / total
    sync_bytes = (
        values / fragments * (wire_bytes_per_value(push_codec) + wire_bytes_per_value(pull_codec))
    )
    return per_byte * sync_bytes


def auto_overlap_cap(*, overlap_steps: int, inner_steps: int) -> int:
    """The most steps sync.overlapMode auto overlaps a blocking learner's push with: H − 1 (the
    merge is then still back before the fragment is due again), or sync.overlapSteps if larger;
    0 when sync.overlapSteps is 0 (no overlap asked for: plain DiLoCo).

    Why not overlapSteps (min(5, H/4) by default), as before issue 45: on a GPU a merge took
    10-20 steps, and over a slow link a sync may take most of a round, so five steps left a
    blocking learner idle 31-38% of the time (issue 45, gpt-125m bf16 on an H200). The fit
    still takes the fewest steps that hide the measured latency, so a fast sync keeps few
    steps."""
    if overlap_steps < 0 or inner_steps < 1:
        raise ValueError(
            f"overlap steps must be >= 0 and inner steps >= 1, got {overlap_steps}, {inner_steps}"
        )
    return max(overlap_steps, inner_steps - 1) if overlap_steps else 0


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


def covered_latency(*, covers: str, latency: float | None, seconds: float) -> float | None:
    """The latency sync.overlapMode auto fits τ to (sync.overlapCovers), from a sync's
    SyncResult: "sync", its own latency without any wait for peers (`latency`: push, merge,
    pull; sync_latency), the rule of issue 21; "merge", the whole push-to-merge time
    (`seconds`), the wait for the peers' pushes included, which over a link the islands share
    (a syncer's ingress) is mostly the link carrying the other pushes before the merge can run
    (bench/busy_link). None when the syncer did not say its merge time (latency None), as
    before."""
    if covers not in OVERLAP_COVERS:
        raise ValueError(
            f"sync.overlapCovers must be one of {', '.join(OVERLAP_COVERS)}, got {covers!r}"
        )
    if latency is None:
        return None
    return latency if covers == "sync" else max(latency, seconds)


# The latencies fit_overlap sees: the slowest of the learner's last few syncs (two rounds at
# F = 2), so one quick merge does not undo a τ a slow one needed.
RECENT_SYNCS = 4


class OverlapFit:
    """τ for the next push, from sync.overlapSteps (the cap), sync.overlapMode and the recent
    sync latencies; and the (first poll, wait) window a τ gives."""

    def __init__(self, spec: JobSpec, *, blocking: bool) -> None:
        cap = spec.sync.overlap_steps
        assert cap is not None, "JobSpec resolves sync.overlapSteps"
        self.spec = spec
        self.spec_cap = cap
        self.cap = cap
        self.blocking = blocking
        # The island's round H_i (inner.stepsPerIsland; set_round), inner.steps at first.
        self.inner_steps = spec.inner.steps
        # sync.overlapMode auto's cap for a learner that blocks (auto_overlap_cap).
        self.auto_cap = auto_overlap_cap(overlap_steps=cap, inner_steps=spec.inner.steps)
        self.latencies: deque[float] = deque(maxlen=RECENT_SYNCS)
        # The recent syncs' own latencies (SyncResult.latency, never a wait for peers whatever
        # sync.overlapCovers says): what step_plan.link_bound reads for sync.lateMergeHold.
        self.net_latencies: deque[float] = deque(maxlen=RECENT_SYNCS)
        self.tau: int | None = None  # the τ of the latest push
        # The latency estimated from the join's pulls (join_latency), fitted to by a blocking
        # learner's pushes until a sync is measured; None: no estimate.
        self.join_estimate: float | None = None
        # step_plan.link_bound's answer at the latest sync measured (judge_link): whether a
        # late merge is held for from ceil(H_i / 2) steps (sync.lateMergeHold auto).
        self.slow_link = False

    def set_round(self, inner_steps: int) -> None:
        """The island's round is now `inner_steps` (H_i): τ stays below it, so a push's merge is
        applied before the fragment is due again (overlapSteps larger than a short round: H_i −
        1; none stays none)."""
        self.inner_steps = inner_steps
        self.cap = min(self.spec_cap, max(0, inner_steps - 1))
        self.auto_cap = auto_overlap_cap(overlap_steps=self.cap, inner_steps=inner_steps)

    def joined(
        self,
        *,
        pull_bytes: Sequence[int],
        pull_seconds: Sequence[float | None],
        values: int,
        pull_codec: str,
    ) -> None:
        """The join's pulls (one a fragment: body bytes, own seconds), the model's values and
        the pull codec the syncer named: the estimate a blocking learner's first pushes fit τ
        to (join_latency)."""
        if pull_codec not in CODECS:  # a codec this learner does not know: no estimate
            self.join_estimate = None
            return
        self.join_estimate = join_latency(
            pull_bytes=pull_bytes,
            pull_seconds=pull_seconds,
            values=values,
            fragments=max(1, len(pull_bytes)),
            push_codec=self.spec.sync.compression,
            pull_codec=pull_codec,
        )

    def observe(self, latency: float | None, *, net: float | None = None) -> None:
        """A sync's latency (covered_latency's; None: not known, nothing changes) and its own
        latency without waits for peers (`net`: SyncResult.latency)."""
        if latency is not None:
            self.latencies.append(latency)
        if net is not None:
            self.net_latencies.append(net)

    def fit(self, step_time: float) -> int:
        """τ for a push now (`step_time`: the wall seconds per inner step), fitted to the recent
        sync latencies by sync.overlapMode auto whether the learner blocks or not; only the cap
        differs. A blocking learner (K = M) goes up to auto_overlap_cap (H − 1), not
        overlapSteps. One that does not block (K < M) stays at most overlapSteps: it never
        waits, so τ is only where it starts to apply an arrived merge (step_plan.poll_from_steps),
        and a fitted τ below the cap keeps fewer stale steps under a merge that is back sooner
        (issue 47: on bench/user_models' n-gram MLP at K = 1 the fixed τ = 5 kept 4.6-8.2 steps a
        push against K = 4's fitted 1.6-2.6, bench/log/2026-11-30.md, "heldout_quorum (issue 47):
        the default quorum against K = M on users' models through model.entrypoint
        (heldout47)"). A merge later than τ is applied when it arrives, as before."""
        mode = self.spec.sync.overlap_mode
        return fit_overlap(
            mode=mode,
            cap=self.auto_cap if mode == "auto" and self.blocking else self.cap,
            latency=self.fit_latency,
            step_time=step_time,
            inner_steps=self.inner_steps,
            fragments=self.spec.sync.fragments,
        )

    def judge_link(self, step_time: float, position: int) -> bool:
        """step_plan.link_bound over the recent syncs' own latencies, this island's round H_i
        and `step_time` (wall seconds a step, no hold in it), kept in `slow_link` until the next
        sync is measured (so it moves once a sync at most, not with each step's time) and
        logged when it changes."""
        bound = link_bound(
            self.net_latencies,
            fragments=self.spec.sync.fragments,
            inner_steps=self.inner_steps,
            step_time=step_time,
        )
        if bound != self.slow_link:
            self.slow_link = bound
            mean = sum(self.net_latencies) / max(1, len(self.net_latencies))
            log.info(
                "step %d: %d sync(s) of %.3fs x %d fragment(s) %s a round of %d steps of "
                "%.3fs: a merge late by %s is held for (sync.lateMergeHold auto)",
                position,
                len(self.net_latencies),
                mean,
                self.spec.sync.fragments,
                "outlast" if bound else "fit in",
                self.inner_steps,
                step_time,
                "ceil(H/2) steps, the link slower than its traffic" if bound else "H - 1 steps",
            )
        return bound

    @property
    def latest(self) -> int:
        """The τ of the latest push (overlapSteps before the first)."""
        return self.cap if self.tau is None else self.tau

    @property
    def latency(self) -> float | None:
        """The slowest recent sync latency (None: none measured)."""
        return max(self.latencies) if self.latencies else None

    @property
    def fit_latency(self) -> float | None:
        """The latency τ is fitted to: the measured one (`latency`), or before any is measured
        the join's estimate for a blocking learner (K = M: its first push of each fragment
        waits for the merge). A learner that does not block keeps FIRST_OVERLAP until its first
        merge: τ is only where it starts to apply an arrived merge."""
        if self.latencies or not self.blocking:
            return self.latency
        return self.join_estimate

    def pushed(self, tau: int, step_time: float, position: int) -> None:
        """A push was made with τ: logged when it differs from the previous push's."""
        if tau != self.tau:
            latency = self.fit_latency
            if latency is None:
                said = "not measured yet"
            elif self.latencies:
                said = f"{latency:.3f}s"
            else:
                said = f"{latency:.3f}s estimated from the join's pulls"
            log.info(
                "step %d: pushes overlap %d step(s) from this one on (sync latency %s, %.3fs a "
                "step, at most %d: sync.overlapMode %s)",
                position,
                tau,
                said,
                step_time,
                self.auto_cap
                if self.blocking and self.spec.sync.overlap_mode == "auto"
                else self.cap,
                self.spec.sync.overlap_mode
                if self.blocking
                else f"{self.spec.sync.overlap_mode}, K < M",
            )
            self.tau = tau

    def window(self, tau: int) -> Window:
        """(first poll, wait deadline) in steps after a push made with τ: sync.applyFrom and
        sync.mergeWait (core/grace.merge_wait_steps) for a learner that blocks, τ for one that
        only polls."""
        first = poll_from_steps(apply_from=self.spec.sync.apply_from, overlap=tau)
        if not self.blocking:
            return first, tau
        return first, merge_wait_steps(
            merge_wait=self.spec.sync.merge_wait, overlap=tau, inner_steps=self.inner_steps
        )
