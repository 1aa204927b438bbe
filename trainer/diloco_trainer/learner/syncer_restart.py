"""What a syncer restart leaves rank 0 to do and to count (docs/algorithm.md, "A syncer
restart"): which of its syncs in flight it pushes again at once, and on which version (rules 1
and 2: the pure rule that FragmentSync.resend_lost and FragmentSync.collect apply to every sync
they look at), and AfterRestart, the state between a restart's first sign and the pushes it
makes again, with the count of the island's merged steps the restart took back.

Why at once, for a refused push too (the test of a 2-island K = M job under load,
tests/e2e/test_learner_restart.py, failed about 1 run in 6): a push the restarted syncer lost
was pushed again as soon as its sync ended, even while rank 0 waited for another fragment's
merge, but a push it refused as ahead was pushed again only once its result was received, at
the fragment's next merge wait or sync point. An island that waited meanwhile for the other
fragment's merge, whose peer in turn waited for this fragment's push again, held both islands
until a 20 s wait budget ran out.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from diloco_trainer.learner.fragment_state import MergedSteps
from diloco_trainer.learner.syncer_link import PushLost, SyncResult

# How a sync in flight ended: its result, the exception it raised, or None (not ended, or
# cancelled: an overdue push's, replaced already).
Outcome = SyncResult | BaseException | None


def sync_outcome(future: concurrent.futures.Future[Any]) -> Outcome:
    """How the sync behind `future` ended, without waiting."""
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    return error if error is not None else future.result()


def resend_version(outcome: Outcome, base: int) -> int | None:
    """The version a fragment's push is made again on, at once, after its sync ended with
    `outcome` while the fragment's base is version `base`; None when it is not pushed again now.

    - Lost with the restart (PushLost, the restarted syncer at version v): on v when the syncer
      is behind the base (0 <= v < base: the base is a merge the restart lost too, counted as
      the syncer's version, so that the push is taken and not refused as ahead), else on the base.
    - Refused as ahead of the restarted syncer (SyncResult.restarted, its fragment at v < base):
      on v, the refused push's steps and all since in it (pushed on the base the syncer lost,
      its Δ is what a pull keeping every step since the base would give).
    - Anything else: None. That includes a refusal whose syncer is not behind the base (it
      forgot the island, 404, or merged past the base meanwhile): its fragment is received and
      pushed again from there (FragmentSync._push_again).
    """
    if isinstance(outcome, PushLost):
        return outcome.version if 0 <= outcome.version < base else base
    if isinstance(outcome, SyncResult) and outcome.restarted:
        version = outcome.pulled.version
        return version if 0 <= version < base else None
    return None


def resend_note(outcome: Outcome, version: int) -> str:
    """The learner's line for a push made again on `version` after `outcome`."""
    why = outcome.outcome if isinstance(outcome, SyncResult) else str(outcome)
    return f"{why}; pushing it again now, on version {version}"


@dataclass
class AfterRestart:
    """Rank 0's state across a syncer restart (FragmentSync.restart): what it still has to push
    again or make up, and per fragment the island's steps merged into it and those restarts took
    back. Kept apart from the sync's schedule: every field but the counts is empty between
    restarts, and the counts only matter once one happened (the drain's share, lost_work)."""

    # Set when a sync shows that the syncer restarted (a lost push, a push refused as ahead):
    # the next after_step makes up the merges it lost (FragmentSync._make_up).
    seen: bool = False
    # Fragments whose push a restarted syncer refused (SyncResult.restarted) but is not behind
    # the base of (resend_lost takes those), received from it: pushed again as soon as their
    # receipt is installed (after_step), unless a push came first (the drain's).
    push_again: set[int] = field(default_factory=set)
    # Receipts of pushes made again, taken at the fragment's sync point (_plan) for after_step.
    early: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    # Fragments made up after a restart (_make_up): their next sync point's push is made.
    skip_once: set[int] = field(default_factory=set)
    # Per fragment: this island's steps merged into it (drain.py's share counts steps), and
    # those a syncer restart took back (lost_work).
    merged: list[MergedSteps] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)

    def joined(self, versions: list[int]) -> None:
        """The island joined with each fragment at `versions` (in fragment order): counts start."""
        self.merged = [MergedSteps(v) for v in versions]
        self.lost = [0] * len(versions)

    def refused(self, f: int) -> None:
        """Fragment f's push was refused by a restarted syncer not behind its base: it is pushed
        again once its receipt is installed."""
        self.push_again.add(f)
        self.seen = True

    def take_early(self) -> dict[int, dict[str, Tensor]]:
        """The receipts taken early at sync points since the last call, handed over once."""
        out, self.early = self.early, {}
        return out

    def count_merged(
        self, f: int, result: SyncResult, *, held: int, carried: int, round_steps: int
    ) -> None:
        """Keep the count of this island's steps merged into fragment f after a receipt of
        `result` (the base was version `held`, the push carried `carried` steps): a merge adds
        them; a restarted syncer's fragment takes back the merges it lost, and the refused
        push's steps are lost too (its receipt keeps only the steps since)."""
        if not self.merged:
            return
        if result.outcome == "merged":
            self.merged[f].merged(result.pulled.version, carried)
        elif result.restarted:
            self.roll_back(f, held, result.pulled.version, round_steps=round_steps, carried=carried)

    def roll_back(
        self, f: int, held: int, version: int, *, round_steps: int, carried: int = 0
    ) -> None:
        """Fragment f went back from version `held` to the restarted syncer's `version`
        (MergedSteps.rolled_back), and a refused push's `carried` steps with it."""
        if not self.merged:
            return
        back = self.merged[f].rolled_back(version, held=held, round_steps=round_steps)
        self.lost[f] += back + carried

    def lost_work(self, per_step: float) -> float:
        """The steps restarts took back from the fragment that lost the most, at `per_step`
        units of work a step (FragmentSync.lost_work: the drain's share counts round_work, and
        the job's outer step is its least merged fragment's)."""
        return max(self.lost, default=0) * per_step
