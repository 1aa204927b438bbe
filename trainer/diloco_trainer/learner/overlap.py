"""How many steps a learner overlaps a push with (sync.overlapMode), fitted to the sync
latencies it measured, and the steps after a push at which it polls for and waits for the merge.

Each push is planned with the τ fitted when it was made (schedule.plan_step's windows), so a τ
that changes while another fragment is in flight moves no merge already planned.
"""

from __future__ import annotations

import logging
from collections import deque

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.grace import merge_wait_steps
from diloco_trainer.learner.schedule import Window, fit_overlap, poll_from_steps

log = logging.getLogger("diloco.learner")

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
        self.cap = cap
        self.blocking = blocking
        self.latencies: deque[float] = deque(maxlen=RECENT_SYNCS)
        self.tau: int | None = None  # the τ of the latest push

    def observe(self, latency: float | None) -> None:
        """A sync's latency (SyncResult.latency; None: not known, nothing changes)."""
        if latency is not None:
            self.latencies.append(latency)

    def fit(self, step_time: float) -> int:
        """τ for a push now (`step_time`: the wall seconds per inner step). A learner that does
        not block for its merge (K < M) keeps the cap: it never waits, so there is no wait to
        fit τ against, and its merges also wait out the syncer's grace window, which L leaves
        out (on gpt-tiny at K = 1 and 2 a fitted τ was 0.5-4.9% behind the cap at equal tokens
        in one run per seed: bench/log/2026-11-26.md, "sync.overlapMode auto")."""
        return fit_overlap(
            mode=self.spec.sync.overlap_mode if self.blocking else "fixed",
            cap=self.cap,
            latency=self.latency,
            step_time=step_time,
            inner_steps=self.spec.inner.steps,
            fragments=self.spec.sync.fragments,
        )

    @property
    def latest(self) -> int:
        """The τ of the latest push (overlapSteps before the first)."""
        return self.cap if self.tau is None else self.tau

    @property
    def latency(self) -> float | None:
        """The slowest recent sync latency (None: none measured)."""
        return max(self.latencies) if self.latencies else None

    def pushed(self, tau: int, step_time: float, position: int) -> None:
        """A push was made with τ: logged when it differs from the previous push's."""
        if tau != self.tau:
            latency = self.latency
            log.info(
                "step %d: pushes overlap %d step(s) from this one on (sync latency %s, %.3fs a "
                "step, at most %d: sync.overlapMode %s)",
                position,
                tau,
                "not measured yet" if latency is None else f"{latency:.3f}s",
                step_time,
                self.cap,
                self.spec.sync.overlap_mode if self.blocking else "fixed at K < M",
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
            merge_wait=self.spec.sync.merge_wait, overlap=tau, inner_steps=self.spec.inner.steps
        )
