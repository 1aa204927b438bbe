"""Which of rank 0's syncs in flight a syncer restart makes it push again at once, and on which
version (docs/algorithm.md, "A syncer restart", rules 1 and 2): the pure rule that
FragmentSync.resend_lost and FragmentSync.collect apply to every sync they look at.

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
from typing import Any

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
