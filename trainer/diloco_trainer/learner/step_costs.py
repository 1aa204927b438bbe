"""Where a learner's wall time goes between two progress lines: training, the DiLoCo work on the
training thread, and waiting for the syncer.

The learner logs its tokens/s every LOG_EVERY_STEPS steps over wall time, so a slow window says
that DiLoCo cost something but not what. Each step's wall time is split three ways:

- training: the inner step itself (forward, backward, AdamW; a deliberate straggler's sleep);
- sync path: rank 0's work after the step on the training thread, waits left out: computing and
  encoding Δ for a push, receiving a merged fragment and mixing it in, the island's control
  all-reduce and broadcasts, the bookkeeping;
- waiting: blocked on the syncer: a blocking learner (K = M, or τ = 0) waiting for the merge of
  its own push τ steps after it, or an island holding at the step cap.

Training is the plain loop's work; sync path is what DiLoCo costs the step path; waiting is what
the syncer's push-to-merge latency costs when it exceeds the overlap (bench/learner_overlap reads
the three from the log).

Beside the wall-clock split, a window carries the learner process's CPU seconds over it
(time.process_time: every thread of the process, the intra-op threads and the syncer link's
background threads included; other processes' load left out, waits cost none). On a machine
shared with other work, wall time says how loaded the machine was; CPU seconds per token is what
the learner itself spent, so bench/learner_overlap compares it with the plain loop's.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class WindowCosts:
    """Seconds spent in each part since the last progress line."""

    steps: int = 0
    training: float = 0.0
    sync_path: float = 0.0
    waiting: float = 0.0
    cpu: float = 0.0  # the process's CPU seconds over the window, set by the loop

    def add_step(self, training: float) -> None:
        """One inner step of `training` seconds."""
        self.steps += 1
        self.training += training

    def add_after(self, after_step: float, waited: float) -> None:
        """What followed a step: `after_step` seconds on the training thread (waits included),
        of which `waited` were blocked on the syncer."""
        after_step = max(after_step, 0.0)
        waited = min(max(waited, 0.0), after_step)
        self.sync_path += after_step - waited
        self.waiting += waited

    def line(self) -> str:
        """The progress line's tail, e.g. '20 steps: 1.200s training, 0.031s sync path, 3.750s
        waiting for the syncer; 2.41s cpu'. Milliseconds: a GPU's 20 steps of gpt-mini take
        0.28 s and their sync path 5-15 ms, which two decimals rounded to 0.01 s, a share
        between 2% and 5% (bench/log/2026-11-27.md, "learner_overlap on an NVIDIA H200 (issue
        21): longer jobs")."""
        return (
            f"{self.steps} steps: {self.training:.3f}s training, {self.sync_path:.3f}s sync "
            f"path, {self.waiting:.3f}s waiting for the syncer; {self.cpu:.2f}s cpu"
        )

    def waiting_share(self) -> float:
        """Waiting's share of the window's wall time (0 for an empty window)."""
        total = self.training + self.sync_path + self.waiting
        return self.waiting / total if total > 0 else 0.0


class WaitMeter:
    """The seconds rank 0 spends blocked on the syncer (issue 45: what the heartbeats report as
    `waiting`, the share of the learner's wall time its accelerators idled for merges).

    Counted: every blocking wait for a fragment's merge (FragmentSync.collect with a wait: a
    blocking learner's merge wait at its deadline, a slow island's wait after its fill steps,
    the step cap's hold, the late merge's hold at K < M, the drain's wait for its last merges).
    Not counted: a drained island's wait for the finish, the start-together wait, the joins.

    The training thread marks each wait's begin and end; the link's thread reads the share since
    its previous read (`share_since`, one mark per reader: each syncer shard's heartbeats), a
    wait still running counted up to the read, so a heartbeat sent during a long hold says so.
    Times are passed in (time.monotonic() in use), so the rule is tested with numbers."""

    def __init__(self, now: float) -> None:
        self._lock = threading.Lock()
        self._started = now
        self._done = 0.0  # seconds of the waits that ended
        self._since: float | None = None  # when the wait in progress began
        self._marks: dict[int, tuple[float, float]] = {}  # reader -> (time, waited) at its read

    def begin(self, now: float) -> None:
        """A wait begins (a wait already in progress goes on: waits do not nest)."""
        with self._lock:
            if self._since is None:
                self._since = now

    def end(self, now: float) -> None:
        """The wait in progress ends (none in progress: nothing)."""
        with self._lock:
            if self._since is not None:
                self._done += max(0.0, now - self._since)
                self._since = None

    def waited(self, now: float) -> float:
        """Seconds waited in all up to `now`, the wait in progress included."""
        with self._lock:
            return self._waited(now)

    def _waited(self, now: float) -> float:
        return self._done + (max(0.0, now - self._since) if self._since is not None else 0.0)

    def share_since(self, reader: int, now: float) -> float | None:
        """The share of the wall time from `reader`'s previous read (its first: the meter's
        start) to `now` spent waiting, in [0, 1] and rounded to 4 places; None when no time
        passed. Marks this read for the reader's next."""
        with self._lock:
            waited = self._waited(now)
            at, before = self._marks.get(reader, (self._started, 0.0))
            self._marks[reader] = (now, waited)
        if now <= at:
            return None
        return round(min(1.0, max(0.0, (waited - before) / (now - at))), 4)


# The parts of the sync path that SyncPathPhases names, in the order its line gives them.
SYNC_PATH_PHASES = (
    "push",
    "receipt",
    "plan",
    "report",
    "progress",
    "control",
    "apply",
    "drain",
)


@dataclass
class SyncPathPhases:
    """The whole job's sync path on the training thread, part by part (issue 45: at gpt-tiny's
    few-ms steps a fixed cost per step or per sync weighs a share of the step, and the window
    split says only that the sync path took it, not which part):

    - push: making a push (its Δ and encoding, or the copy a deferred encoding starts from, and
      its hand-over to the syncer link), `FragmentSync.push`;
    - receipt: installing an arrived merge as the base and the weights to go on from,
      `FragmentSync.receive`;
    - plan: the rest of `after_step` and the drain check: the schedule, the plan of the step,
      polling for merges (the waits left out: they are waiting, not sync path);
    - report: the step's counters and the heartbeat figures handed to the link;
    - progress: the progress line every LOG_EVERY_STEPS steps;
    - control: the island's control all-reduce (one rank alone: nothing to exchange);
    - apply: installing the merged fragments' weights in the parameters (every rank);
    - drain: the end of the island's part of the job (drain.py), its waits for the last merges
      and the finish included (no progress line follows it).

    Seconds and calls of each; the learner logs `line()` once, when it exits."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SYNC_PATH_PHASES, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SYNC_PATH_PHASES, 0))

    def add(self, phase: str, seconds: float) -> None:
        """One call of `phase` that took `seconds` (a negative clock difference counts as 0)."""
        if phase not in self.seconds:
            raise ValueError(f"no sync path phase {phase!r} (known: {SYNC_PATH_PHASES})")
        self.seconds[phase] += max(seconds, 0.0)
        self.calls[phase] += 1

    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self, steps: int) -> str:
        """E.g. 'sync path by part over 240 steps: push 0.031s (16 calls, 1.94 ms each), ...,
        in all 0.052s (0.22 ms a step)': what a user reads to see which part to look at."""
        parts = [
            f"{phase} {self.seconds[phase]:.3f}s ({self.calls[phase]} calls, "
            f"{1e3 * self.seconds[phase] / self.calls[phase]:.2f} ms each)"
            for phase in SYNC_PATH_PHASES
            if self.calls[phase]
        ]
        per_step = 1e3 * self.total() / steps if steps > 0 else 0.0
        return (
            f"sync path by part over {steps} steps: {', '.join(parts) or 'none'}; in all "
            f"{self.total():.3f}s ({per_step:.2f} ms a step)"
        )


def timed_part(part: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A method of an object with a `phases` (SyncPathPhases) counted as one call of `part`,
    however it returns or raises (FragmentSync.push, FragmentSync.receive)."""

    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def timed(self: Any, *args: Any, **kwargs: Any) -> T:
            began = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.phases.add(part, time.perf_counter() - began)

        return timed

    return wrap


# A window that waited this share of its time for merges gets the hint below (once a job).
WAIT_HINT_SHARE = 0.2


def wait_hint(
    costs: WindowCosts, *, merge_wait: str, overlap_mode: str, tau: int | None
) -> str | None:
    """What to change when a blocking learner spends a large share of a window waiting for the
    merges of its own pushes (its steps are faster than the syncer's round trip: a GPU island
    beside a CPU syncer, bench/log/2026-11-27.md, "learner_overlap in a job on an NVIDIA H100"), or
    None. Holds at the step cap are waits too, but the hint is worded for the merge waits that the
    default rule makes. `tau` is the overlap of the island's latest push (OverlapFit.tau): under
    sync.overlapMode auto it is fitted to the measured sync latency up to H − 1, so a wait left
    over means a merge slower than a round, not a small fixed cap (issue 45)."""
    share = costs.waiting_share()
    if share < WAIT_HINT_SHARE or merge_wait != "overlap":
        return None
    steps = "its" if tau is None else f"the {tau}"
    if overlap_mode == "fixed":
        rule = "(sync.overlapMode fixed: sync.overlapSteps)"
        remedies = "sync.overlapMode: auto (fits the overlap to the measured latency), "
    else:
        rule = "(sync.overlapMode auto: fitted to the measured sync latency, at most H − 1)"
        remedies = "a longer round (inner.steps) so a round covers a sync, "
    return (
        f"this island waited {share:.0%} of its last {costs.steps} steps for the syncer's "
        f"merges: they take longer than {steps} steps it trains past each push {rule}. "
        "To train on meanwhile: sync.mergeWait: nextPush (waits only when the fragment is due "
        f"again), {remedies}or sync.quorum below the number of islands (docs/learner.md, "
        "'On a GPU')"
    )
