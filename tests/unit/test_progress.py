"""Progress figures carried while the syncer is away; island entries; number coercion."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from diloco_operator.status_progress import (
    Completion,
    carried_progress,
    duration,
    float_or_none,
    int_or_none,
    island_statuses,
    job_completion,
)
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import StopAfterSpec

from .observations import SYNCER, island, observation, syncer_status


def test_carried_progress_reads_the_syncer() -> None:
    progress = carried_progress(syncer_status(SYNCER), {"outerStep": 3})
    assert (progress.outer_step, progress.tokens) == (12, 4096)
    assert (progress.loss, progress.eval_loss) == (2.5, 2.7)
    assert progress.last_sync_time == "2025-01-01T00:00:00Z"


def test_carried_progress_keeps_stored_figures_while_syncer_away() -> None:
    stored = {"outerStep": 7, "tokens": 10, "loss": 1.5, "lastSyncTime": "2024-06-01T00:00:00Z"}
    progress = carried_progress(None, stored)
    assert (progress.outer_step, progress.tokens, progress.loss) == (7, 10, 1.5)
    assert progress.eval_loss is None and progress.last_sync_time == "2024-06-01T00:00:00Z"
    assert carried_progress(None, None).outer_step is None


def test_carried_progress_syncer_absence_of_a_figure_clears_it() -> None:
    progress = carried_progress(syncer_status({"outerStep": 2}), {"loss": 9.0, "lastSyncTime": "x"})
    assert progress.loss is None and progress.last_sync_time is None


def test_island_statuses_join_health_and_syncer_states() -> None:
    obs = observation(islands=[island("island-0"), island("island-1", ready=1)])
    first, second = island_statuses(obs, running=True)
    assert (first.name, first.state, first.in_quorum, first.healthy) == (
        "island-0",
        "active",
        True,
        True,
    )
    assert first.last_push == "2025-01-01T00:00:00Z"
    assert (second.state, second.in_quorum, second.ready_pods) == ("dropped", False, 1)
    assert not first.waiting_for_quota and not second.waiting_for_quota
    idle = island_statuses(observation(syncer=None), running=False)
    assert all(i.state == "unknown" and i.desired_pods == 0 for i in idle)


def test_island_statuses_unknown_state_for_strange_values() -> None:
    syncer = {"islands": {"island-0": {"state": "exploded"}}}
    (entry, _) = island_statuses(observation(syncer=syncer), running=True)
    assert entry.state == "unknown" and not entry.in_quorum


@pytest.mark.parametrize("flag", ["holding", "drained"])
def test_island_statuses_carry_the_learners_flags(flag: str) -> None:
    """An island whose learner holds at the step cap, or has drained its share of stopAfter
    (its heartbeats say so to the syncer), says so on its own entry; a syncer that does not
    report the flag (older) reads as not set."""
    syncer = {
        "islands": {
            "island-0": {"state": "active", flag: True},
            "island-1": {"state": "active"},
        }
    }
    first, second = island_statuses(observation(syncer=syncer), running=True)
    assert getattr(first, flag) and first.model_dump(by_alias=True)[flag] is True
    other = "drained" if flag == "holding" else "holding"
    assert not getattr(first, other)
    assert not getattr(second, flag)
    (idle, _) = island_statuses(observation(syncer=None), running=False)
    assert not getattr(idle, flag)


def test_number_coercion() -> None:
    assert int_or_none("12") == 12 and int_or_none(-3) == 0 and int_or_none("x") is None
    assert float_or_none("2.5") == 2.5 and float_or_none(None) is None
    assert float_or_none(math.nan) is None and float_or_none(math.inf) is None
    assert float_or_none("loss") is None


def _at(step: int, tokens: int, now: float, *, started: float = 1000.0) -> SyncerStatus:
    """The syncer's status at `now` (its clock), its first evaluation taken at `started`."""
    return SyncerStatus.from_json(
        {
            "outerStep": step,
            "versions": [step],
            "finished": False,
            "tokens": tokens,
            "time": now,
            "evalHistory": [{"outerStep": 0, "tokens": 0, "evalLoss": 5.6, "time": started}],
        }
    )


def test_job_completion_progress_and_eta_from_the_syncer() -> None:
    # 5 of 20 outer steps in 100 s since the syncer started: 300 s to go at that pace.
    done = job_completion(StopAfterSpec(outer_steps=20), _at(5, 1000, 1100.0), None)
    assert done == Completion(progress="25%", eta="5m00s")
    # The nearer limit counts: tokens are 3/4 of theirs.
    both = StopAfterSpec(outer_steps=20, tokens=1300)
    assert job_completion(both, _at(5, 975, 1100.0), None) == Completion("75%", "33s")
    assert job_completion(both, _at(20, 1300, 1500.0), None) == Completion("100%", "0s")
    # Nothing merged yet: a progress, no pace.
    assert job_completion(both, _at(0, 0, 1001.0), None) == Completion("0%", None)
    assert duration(7300) == "2h01m" and duration(200_000) == "2d07h"


def test_job_completion_without_a_limit_or_a_syncer() -> None:
    assert job_completion(StopAfterSpec(), _at(5, 1000, 1100.0), None) == Completion(None, None)
    # Syncer away: the stored progress is kept, the ETA dropped (nothing to time it by).
    stored = {"progress": "40%", "eta": "1m00s"}
    assert job_completion(StopAfterSpec(outer_steps=10), None, stored) == Completion("40%", None)
    assert job_completion(StopAfterSpec(outer_steps=10), None, None) == Completion(None, None)


def test_island_statuses_an_island_kueue_has_not_admitted_waits_for_quota() -> None:
    gated = replace(island("island-1", ready=0), gated=2, queued=True)
    admitted_not_ready = replace(island("island-0", ready=1), queued=True)
    first, second = island_statuses(observation(islands=[admitted_not_ready, gated]), running=True)
    # Gated pods (Kueue's admission gate) and none Ready: waiting for quota, not failed.
    assert second.waiting_for_quota and not second.healthy
    # Pods admitted (no gate) but not Ready yet: an ordinary unhealthy island.
    assert not first.waiting_for_quota


def test_island_statuses_carry_each_islands_round_and_step_time() -> None:
    """The syncer's stepTime and innerSteps (inner.stepsPerIsland) on each island's entry, and
    the wide column's summary in island order; an older syncer's status without them reads as
    not reported ('-')."""
    from diloco_operator.status_progress import rounds_summary

    syncer = {
        "islands": {
            "island-0": {"state": "active", "stepTime": 0.05, "innerSteps": 30},
            "island-1": {"state": "active", "stepTime": 0.15, "innerSteps": 10},
        }
    }
    first, second = island_statuses(observation(syncer=syncer), running=True)
    assert (first.step_time, first.inner_steps) == (0.05, 30)
    assert (second.step_time, second.inner_steps) == (0.15, 10)
    dumped = second.model_dump(by_alias=True)
    assert (dumped["stepTime"], dumped["innerSteps"]) == (0.15, 10)
    assert rounds_summary([first, second]) == "30@0.05s 10@0.15s"
    old = island_statuses(observation(syncer={"islands": {"island-0": {"state": "active"}}}), True)
    assert (old[0].step_time, old[0].inner_steps) == (None, None)
    assert rounds_summary(old).startswith("-@- ")
    assert rounds_summary([]) is None


def test_island_statuses_carry_each_islands_waiting_share() -> None:
    """The syncer's `waiting` (the share of the learner's wall time blocked on the syncer) on
    each island's entry and in the wide column's summary, whole percents in island order; a
    syncer or learner that does not report it reads as not reported ('-'), never 0%."""
    from diloco_operator.status_progress import waiting_summary

    syncer = {
        "islands": {
            "island-0": {"state": "active", "waiting": 0.625},
            "island-1": {"state": "active", "waiting": 0.004},
        }
    }
    first, second = island_statuses(observation(syncer=syncer), running=True)
    assert (first.waiting, second.waiting) == (0.625, 0.004)
    assert first.model_dump(by_alias=True)["waiting"] == 0.625
    assert waiting_summary([first, second]) == "62% 0%"  # 62.5 rounds to even
    old = island_statuses(observation(syncer={"islands": {"island-0": {"state": "active"}}}), True)
    assert [e.waiting for e in old] == [None, None]
    assert waiting_summary(old) == "- -"
    assert waiting_summary([]) is None
