"""A push's hand-over to the syncer link deferred to the next backward pass (issue 45:
SyncerLink.submit_later / start_deferred, InnerStep.run's before_backward): nothing runs before
the start, the outcome and a cancel pass through, one start runs every deferred coroutine, and the
learner's step calls the start after its forward and before its backward."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import SyncerLink


@pytest.fixture
def link() -> Iterator[SyncerLink]:
    """A learner's link whose syncer is never called."""
    made = SyncerLink(SyncerClient("http://127.0.0.1:9", "tok"), island="island-0", replicas=1)
    yield made
    made.close(leave=False)


def test_a_deferred_coroutine_runs_only_once_started_and_its_result_comes_back(
    link: SyncerLink,
) -> None:
    ran = threading.Event()

    async def work(value: int) -> int:
        ran.set()
        return value * 2

    first, second = link.submit_later(work(3)), link.submit_later(work(5))
    # Nothing starts before start_deferred: a coroutine submitted now has run once the loop has
    # gone round, so the deferred ones had the same chance to start, and did not.
    link.submit(asyncio.sleep(0)).result(timeout=10)
    assert not first.done() and not second.done() and not ran.is_set()
    link.start_deferred()
    assert first.result(timeout=10) == 6 and second.result(timeout=10) == 10
    link.start_deferred()  # nothing left: a no-op


def test_a_deferred_coroutines_exception_comes_back(link: SyncerLink) -> None:
    async def fails() -> None:
        raise ValueError("refused")

    future = link.submit_later(fails())
    link.start_deferred()
    with pytest.raises(ValueError, match="refused"):
        future.result(timeout=10)


def test_a_cancel_before_the_start_never_runs_it_and_after_it_cancels_the_task(
    link: SyncerLink,
) -> None:
    ran = threading.Event()
    started = threading.Event()
    cancelled = threading.Event()

    async def never() -> None:
        ran.set()

    async def long() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # runs until cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise

    early = link.submit_later(never())
    assert early.cancel()
    late = link.submit_later(long())
    link.start_deferred()
    assert started.wait(10)
    assert late.cancel()  # pending until the task ends, as run_coroutine_threadsafe's future
    assert cancelled.wait(10)
    assert not ran.is_set() and early.cancelled() and late.cancelled()


def test_the_step_starts_the_deferred_pushes_after_its_forward_before_its_backward() -> None:
    spec = parse_spec(
        {
            "model": {"preset": "gpt-tiny", "seed": 5},
            "data": {"evalTokens": 2048},
            "inner": {"steps": 4, "seqLen": 16, "lr": 1e-3, "microBatches": 2, "batchSize": 2},
            "sync": {"fragments": 1},
        }
    )
    env = LearnerEnv.offline(device="cpu", job_name="t")
    learner = Learner(spec, env, "cpu", threading.Event())
    grads_then: list[bool] = []

    def hand_over() -> None:
        # Called once a step, before any backward: every gradient is still unset.
        grads_then.append(any(p.grad is not None for p in learner.params.values()))

    assert learner.parts.train is not None
    learner.step.run(learner.parts.train, before_backward=hand_over)
    assert grads_then == [False]  # once, though two micro-batches ran two backward passes
    assert all(p.grad is not None for p in learner.params.values() if p.requires_grad)
    assert torch.isfinite(torch.stack([p.detach().sum() for p in learner.params.values()])).all()
