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


@pytest.mark.parametrize(
    ("versions", "blocking", "waits"),
    [
        ([0, 0], False, True),  # fresh decoupled job
        ([0, 0], True, False),  # K = M: the first merge lines the islands up
        ([1, 0], False, False),  # a merge happened: join in phase with the merges instead
        ([0, 3], False, False),
    ],
)
def test_starts_together_only_in_a_fresh_decoupled_job(
    versions: list[int], blocking: bool, waits: bool
) -> None:
    assert starts_together(versions, blocking=blocking) is waits


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
