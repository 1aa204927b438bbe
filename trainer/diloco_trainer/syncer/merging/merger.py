"""A merge of one fragment's round, step by step (synchronous: the service runs the heavy steps
in worker threads and the others with its lock held; no event loop, no HTTP here).

1. take: the round's contributions (sorted by island, so a merge is reproducible), their lags in
   rounds of work, the islands a round of work spans (active ones and contributors since gone)
   and whether the merge holds every one of them (it then closes the round: core/outer.py).
2. prepare (worker thread): the merge plan and the merged pseudo-gradient, checked finite and
   bounded (GlobalModel.prepare_merge); nothing is applied yet.
3. recover, when prepare failed: the input was at fault, never the state (nothing was changed),
   so the contributions at fault (merge_checks.offenders; all of them when none is found) are taken
   out of the round, which merges later without them; a health problem, a metric, a log line.
4. commit (worker thread): the outer step carrying the work fraction, and θ_pub's update.
5. record: the round closes (version + 1, merged tokens credited, work clock; a push folded
   while the merge ran would be lost, so a fragment's pushes wait for its merge) in one step with
   the merge log's counters, so a status read while the arithmetic ran never sees a half-done
   merge; the entry (api/documents.MergeRecord) goes to merges.jsonl, and then (logged) the
   merge counts in the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.syncer.merging.global_model import GlobalModel, MergeResult, PreparedMerge
from diloco_trainer.syncer.merging.merge_checks import offenders
from diloco_trainer.syncer.merging.merge_log import MERGE_LOG, MergeLog
from diloco_trainer.syncer.state import MERGE, Contribution, Health, SyncerMetrics, SyncState

log = logging.getLogger("diloco.syncer")


@dataclass(frozen=True)
class MergeInput:
    """What a fragment's round gives its merge (taken with the lock held)."""

    fragment: int
    contributions: list[Contribution]
    lags: list[float]  # each contribution's staleness in rounds of work
    islands: int  # the islands a round of work spans
    complete: bool  # every one of them pushed: the merge closes the round
    quorum: int
    grace: float
    now: float  # the syncer's clock when the merge started


@dataclass(frozen=True)
class LeftOut:
    """A merge that could not be prepared: the islands whose contributions leave the round."""

    islands: list[str]
    error: Exception


class Merger:
    """The merge steps of one job's syncer (not thread-safe: see the module docstring)."""

    def __init__(
        self,
        model: GlobalModel,
        merge_log: MergeLog,
        *,
        rule: str,
        health: Health,
        metrics: SyncerMetrics,
    ) -> None:
        self.model = model
        self.merge_log = merge_log
        self.rule = rule
        self.health = health
        self.metrics = metrics

    def take(self, state: SyncState, f: int, now: float) -> MergeInput:
        """Step 1 (lock held): fragment f's round as a merge's input; the round stays open. The
        islands it spans: the active ones but those named unsupported or left out (SyncState.
        spanning: every recent push of theirs claimed work it did not carry, or was refused),
        and those that pushed."""
        contributions = state.peek_round(f)
        pushed = {c.island for c in contributions}
        spans = state.spanning() | pushed
        return MergeInput(
            fragment=f,
            contributions=contributions,
            lags=[state.lag_rounds(f, c.base_version) for c in contributions],
            islands=len(spans),
            complete=pushed == spans,
            quorum=state.effective_quorum(),
            grace=state.grace(f),
            now=now,
        )

    def prepare(self, merge: MergeInput) -> PreparedMerge | LeftOut:
        """Step 2 (worker thread): the merge computed and checked, or the contributions at
        fault when it cannot be."""
        try:
            return self.model.prepare_merge(
                merge.fragment,
                merge.contributions,
                lags=merge.lags,
                islands=merge.islands,
                complete=merge.complete,
            )
        except Exception as err:  # the input, never the state: nothing was changed
            bad = offenders(merge.contributions, self.rule)
            return LeftOut(bad or [c.island for c in merge.contributions], err)

    def recover(self, state: SyncState, merge: MergeInput, left: LeftOut) -> None:
        """Step 3 (lock held): take the contributions a merge could not take out of the round."""
        message = (
            f"merge of fragment {merge.fragment} failed ({type(left.error).__name__}: "
            f"{left.error}); left out the contributions of {', '.join(left.islands)}"
        )
        log.error("%s", message)
        self.health.report(MERGE, message)
        self.metrics.merge_failures.inc(len(left.islands))
        state.discard(merge.fragment, left.islands, merge.now)

    def record(
        self, state: SyncState, merge: MergeInput, result: MergeResult, seconds: float
    ) -> MergeRecord:
        """Step 5 (lock held): close the round and count the merge; returns its log entry (the
        caller writes it to merges.jsonl off the loop)."""
        f = merge.fragment
        # What the merge took: an island dropped while it ran left the round, not the merge.
        state.take_round(
            f,
            merge.now,
            rounds=result.rounds,
            clock=result.clock,
            merge_seconds=seconds,
            merged=merge.contributions,
        )
        entry = self.merge_log.record(
            f,
            merge.contributions,
            result,
            version=state.versions[f],
            outer_step=state.outer_step,
            time=merge.now,
            quorum=merge.quorum,
            grace=merge.grace,
            rule=self.rule,
            seconds=seconds,
        )
        return entry

    def logged(self, seconds: float) -> None:
        """After step 5's entry went to merges.jsonl: the merge counts as done (metrics, and
        a failed merge's health problem clears); a merge log that cannot be written is a health
        problem, not a failure (merge_log.py)."""
        self.metrics.merges.inc()
        self.metrics.merge_seconds.observe(seconds)
        self.health.clear(MERGE)
        if self.merge_log.problem is not None:
            self.health.report(MERGE_LOG, self.merge_log.problem)
        else:
            self.health.clear(MERGE_LOG)
