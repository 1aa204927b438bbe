"""Fill steps: an island at K = M steps through its merge waits (learner/step_plan.fills_drift for
every island, fills_wait past its cap for a slow one; docs/algorithm.md "Fill steps at K = M").

At K = M an island whose round H_i is below inner.steps (a slow island, inner.stepsPerIsland auto)
ends each round early by design (core/island_rounds.sized_steps: rounded down, with room) and
waited the rest of it for the merge. Here, while the merge it waits for has not come and a step
more delays none of its next pushes past the room, it takes a *fill step*: an inner step that
moves no schedule position, whose tokens count in the fragments' next pushes (the steps since a
push are kept when its merge is applied), then polls again. FragmentSync calls it at its waits
(`unfilled`), after its polls (`settle`), to move its schedule (`positions`) and to count its
rounds (`round_share`), and `pushed` at each push. No tensors: a few floats a fragment.

A slow island fills by the drift rule below first (issue 47): its round is rounded down to at
most 0.9 of the reference round, which leaves it under a step of slack a round beyond that room,
and fills_wait, which keeps every push 0.2 of a period early, took none of it (a 3x island at
H_i = 6 of 20: none in 6 emulated runs, its merged tokens 0.87-0.89 of its compute share). The
drift rule's cost is the same as at H: a merge at most one of its steps late (a slow step).

An island at H (identical speeds) has no such slack: its waits
are its peers' drift (a start-up offset, step-time noise, speed gaps between processes). It fills
them too while each fragment's next push carries at most FILL_ROOM x H fill steps
(step_plan.fills_drift), from the first merge on (no arrival history needed), and up to H
while the merge waited for is its fragment's first in a fresh job (the start-up offset:
step_plan.first_fill_cap); with inner.stepsPerIsland auto only (fixed: exactly H steps a round).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.learner.fragment_state import InFlight
from diloco_trainer.learner.phase_alignment import schedule_positions
from diloco_trainer.learner.step_plan import (
    FILL_ROOM,
    PERIOD_SAMPLES,
    FillFragment,
    drift_fill_cap,
    fills_drift,
    fills_wait,
    first_fill_cap,
    merge_period,
    steps_to_due,
)
from diloco_trainer.learner.syncer_restart import AfterRestart

log = logging.getLogger("diloco.learner")


class StopTarget(Protocol):
    """What a fill step reads of the learner's link: its stop target (the drain's)."""

    @property
    def stop_at(self) -> int | None: ...


class Versioned(Protocol):
    """What a fill step reads of a fragment's state: the merged version it holds (0 in a fresh
    job before its first merge)."""

    @property
    def version(self) -> int: ...


class Waiting(Protocol):
    """What a fill step reads of rank 0's FragmentSync (typed here: fragment_sync imports this
    module, and the rooms' modules import in one direction)."""

    waited: float

    @property
    def blocking(self) -> bool: ...
    @property
    def round_steps(self) -> int: ...
    @property
    def phase_pending(self) -> int: ...
    @property
    def restart(self) -> AfterRestart: ...
    @property
    def link(self) -> StopTarget: ...
    @property
    def inflight(self) -> Mapping[int, InFlight]: ...
    @property
    def step_time(self) -> float: ...
    @property
    def wall_step(self) -> float: ...
    @property
    def fragments(self) -> Sequence[Versioned]: ...
    @property
    def position(self) -> int: ...
    @property
    def offsets(self) -> Sequence[int]: ...

    def collect(self, f: int, *, block: float) -> bool: ...


class FillSteps:
    """One learner's fill steps: its merges' arrival times, the waits being filled, and whether
    the next inner step is a fill step."""

    def __init__(self, spec: JobSpec) -> None:
        islands = max(spec.islands.count, spec.total_shards())
        self.lock_step = spec.sync.quorum >= islands  # K = M
        self.inner_steps = spec.inner.steps
        self.arrivals: dict[int, list[float]] = {}  # per fragment, time.monotonic()
        self.filling: set[int] = set()  # fragments whose wait a fill step is taking
        # Per fragment, the fill steps taken since its last push (fills_drift's cap).
        self.since_push: dict[int, int] = {}
        # inner.stepsPerIsland fixed takes none: every island exactly H steps a round, a K = M
        # job's stopAfter.tokens met exactly and its runs repeatable (tests/e2e/test_repeatable).
        fixed = spec.inner.steps_per_island == "fixed"
        self.drift_cap = 0 if fixed else drift_fill_cap(spec.inner.steps, FILL_ROOM)
        # While the merge waited for is its fragment's first in a fresh job: the start-up
        # offset's wait, filled up to a round (step_plan.first_fill_cap, issue 45).
        self.first_cap = first_fill_cap(spec.inner.steps, self.drift_cap)
        self.next = False  # the next inner step is a fill step
        self.steps = 0  # fill steps taken (logged at exit)
        self.clock = time.monotonic  # a test may replace it

    def arrived(self, f: int, at: float) -> None:
        """Fragment f's merge came back at `at` (its push's time plus its sync's seconds)."""
        arrivals = self.arrivals.setdefault(f, [])
        arrivals.append(at)
        del arrivals[: -(PERIOD_SAMPLES + 1)]

    def pushed(self, f: int) -> None:
        """Fragment f was pushed: its next push carries no fill step yet."""
        self.since_push[f] = 0

    def positions(self, position: int, pending: int) -> tuple[list[int], int]:
        """The schedule positions the step just taken passes through (schedule_positions), none
        for a fill step; and the phase shift still pending."""
        if self.next:
            self.next = False
            return [], pending
        return schedule_positions(position, pending)

    def round_share(self, share: float) -> float:
        """A step's part of a round (`share`, H / H_i), none for a fill step: the K = M drain
        counts rounds, and a slow island's fill steps must not bring its drain forward."""
        return 0.0 if self.next else share

    def unfilled(self, sync: Waiting, waits: Iterable[int]) -> list[int]:
        """Of the fragments a plan waits for, those to wait for (or take, if back) now; the
        others' waits are filled (`fills`)."""
        out = []
        for f in waits:
            flight = sync.inflight.get(f)
            if flight is not None and not flight.future.done() and self.fills(sync, f):
                self.filling.add(f)
            else:
                out.append(f)
        return out

    def settle(self, sync: Waiting, done: list[int], budget: float) -> list[int]:
        """After the plan's polls (`done`: the fragments taken): each fragment whose wait was
        filled and is still not back is filled again or waited for (up to `budget`, as any
        merge wait); the ones taken now. The next step is a fill step while any is filled."""
        took = []
        for f in sorted(self.filling):
            if f in done or f not in sync.inflight:
                self.filling.discard(f)  # back: applied with the fill steps kept
            elif not self.fills(sync, f):
                self.filling.discard(f)
                started = time.monotonic()
                got = sync.collect(f, block=budget if sync.blocking else 0.0)
                waited = time.monotonic() - started
                sync.waited += waited
                # Logged as FragmentSync's own merge waits are (bench.studies.km_waits reads
                # them): a wait the fill steps could not cover is a wait all the same.
                if got:
                    took.append(f)
                    if waited > 0.05:
                        log.info(
                            "step %d: waited %.2fs for fragment %d (after %d fill steps)",
                            sync.position,
                            waited,
                            f,
                            self.since_push.get(f, 0),
                        )
        self.next = bool(self.filling)
        self.steps += self.next
        if self.next:
            for g in range(len(sync.fragments)):
                self.since_push[g] = self.since_push.get(g, 0) + 1
        return took

    def cap(self, sync: Waiting, f: int) -> int:
        """fills_drift's cap at a wait for fragment f's merge: a round (first_fill_cap) while
        that merge is the fragment's first in a fresh job (the learner holds version 0: the
        islands' start-up offset), else floor(room x H) (drift_fill_cap). A learner that joined
        a running job holds a later version: its first wait is drift, not the job's start."""
        return self.first_cap if sync.fragments[f].version == 0 else self.drift_cap

    def fills(self, sync: Waiting, f: int) -> bool:
        """Whether the wait for fragment f's merge (in flight, not back) is filled with a step
        at K = M only, with no phase shift, syncer restart or stop target under way (the drain's
        targets split the budget by H_i x tokens per step): any island while its pushes carry
        at most the cap, floor(room x H) or at a first merge H (`cap`, step_plan.fills_drift);
        a slow island (its round below inner.steps) past the cap too while every fragment's next
        push stays early by its merge period (step_plan.fills_wait, which needs every
        fragment's period known)."""
        if (
            not (sync.blocking and self.lock_step)
            or sync.phase_pending
            or sync.restart.push_again
            or sync.link.stop_at is not None
            or f not in sync.inflight
            or any(fl.again for fl in sync.inflight.values())
        ):
            return False
        # Every island fills by the drift rule first, a slow one too (issue 47): its slack is
        # under a step a round once rounded down, which fills_wait's room never lets it take.
        since = [self.since_push.get(g, 0) for g in range(len(sync.fragments))]
        if fills_drift(since_push=since, cap=self.cap(sync, f)):
            return True
        if sync.round_steps >= self.inner_steps:
            return False
        step_time = sync.step_time or sync.wall_step
        period = merge_period(self.arrivals.get(f, []))
        if period is None or step_time <= 0:
            return False
        fragments = []
        for g in range(len(sync.fragments)):
            arrivals = self.arrivals.get(g)
            if not arrivals:
                return False
            fragments.append(
                FillFragment(
                    due_in=steps_to_due(sync.position, sync.round_steps, sync.offsets[g]),
                    last_arrival=arrivals[-1],
                    in_flight=g in sync.inflight,
                )
            )
        return fills_wait(
            now=self.clock(),
            step_time=step_time,
            period=period,
            room=FILL_ROOM,
            fragments=fragments,
            waited=fragments[f],
        )
