"""learner/start_together.py: which learners wait for the job's other islands before their
first step, and how the wait ends. The syncer's side is a stand-in answering awaitedIslands from
a list (the real link is in tests/e2e/test_start_together.py); what is checked is when the wait
returns."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

import pytest
from diloco_trainer.api.protocol import SyncerError
from diloco_trainer.learner.start_together import starts_together, wait_for_peers

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync


@pytest.mark.parametrize(
    ("versions", "lock_step", "waits"),
    [
        ([0, 0], False, True),  # fresh decoupled job
        ([0, 0], True, False),  # K = M: the first merge lines the islands up
        ([1, 0], False, False),  # a merge happened: join in phase with the merges instead
        ([0, 3], False, False),
    ],
)
def test_starts_together_only_in_a_fresh_decoupled_job(
    versions: list[int], lock_step: bool, waits: bool
) -> None:
    assert starts_together(versions, lock_step=lock_step) is waits


def test_a_decoupled_job_without_overlap_starts_together_too() -> None:
    """K = 2 of 4 with overlapSteps 0 blocks for its merges (core/grace.blocks_for_merge) but a
    merge needs only 2 pushes: its islands start together as with overlap (before, only
    learners that did not block did); K = M with overlap does not (its first merge lines them
    up)."""
    decoupled = make_spec(quorum=2, overlapSteps=0, overlapMode="fixed")
    decoupled = decoupled.model_copy(
        update={"islands": decoupled.islands.model_copy(update={"count": 4})}
    )
    sync, _ = make_sync(decoupled, FakeLink(outer_lr=1.0))
    assert sync.blocking and not sync.fill.lock_step
    assert starts_together([0, 0], lock_step=sync.fill.lock_step)
    synchronous = decoupled.model_copy(
        update={"sync": decoupled.sync.model_copy(update={"quorum": 4, "overlapSteps": 2})}
    )
    sync, _ = make_sync(synchronous, FakeLink(outer_lr=1.0))
    assert sync.blocking and sync.fill.lock_step
    assert not starts_together([0, 0], lock_step=sync.fill.lock_step)


class Answers:
    """What the syncer says on each ask: a number of awaited islands, or an error."""

    def __init__(self, answers: list[int | Exception]) -> None:
        self.answers = answers
        self.asked = 0

    async def awaited(self) -> int:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    def submit(self, coro: Coroutine[Any, Any, int]) -> concurrent.futures.Future[int]:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        try:
            coro.send(None)
        except StopIteration as done:
            future.set_result(done.value)
        except Exception as err:  # handed over as the future's, as asyncio does
            future.set_exception(err)
        return future


def wait(answers: Answers, budget: float = 60.0, stop: threading.Event | None = None) -> int:
    return wait_for_peers(answers, budget=budget, stop=stop or threading.Event(), poll=0.001)  # type: ignore[arg-type]


def test_the_wait_ends_once_no_island_is_awaited() -> None:
    answers = Answers([2, 1, 1, 0])
    assert wait(answers) == 0 and answers.asked == 4


def test_the_wait_ends_at_its_budget_with_islands_still_awaited() -> None:
    answers = Answers([1])
    assert wait(answers, budget=0.02) == 1 and answers.asked >= 2


def test_the_wait_ends_at_once_when_the_syncer_does_not_answer_or_on_a_stop() -> None:
    assert wait(Answers([SyncerError(503, "unavailable")])) == -1
    stop = threading.Event()
    stop.set()
    answers = Answers([1])
    assert wait(answers, stop=stop) == -1 and answers.asked == 0
