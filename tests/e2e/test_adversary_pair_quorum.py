"""A job of two at K = M = 2 with one real learner and one island that claims work its pushes do
not carry (issue 46's fast claims: zero pushes at a 1 ms step time). Once 3 of its pushes in a
row to the fragment are refused (`work_unsupported`; syncer/intake/refused_runs.py, before the
work evidence's 8 name it islandWorkUnsupported), it no longer counts towards the quorum, so the
honest learner's merges stop waiting for it and the job runs to its end. With a grace window of
an hour, a round that still waited for the named island would hold the honest learner for that
hour: the job finishing in minutes is the assertion (the unit tests in
tests/unit/test_syncer_work_evidence_restart.py hold the rule itself)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import free_port, start_learner
from diloco_trainer.syncer.intake.refused_runs import REFUSED_RUN

from .conftest import SyncerHandle, wait_until
from .test_adversary import filled, join_all, push_as

pytestmark = pytest.mark.e2e

HONEST, ADVERSARY = "island-0", "island-1"
H = 4
ROUNDS = 12


def test_a_named_island_no_longer_holds_the_honest_learners_rounds(
    make_spec: Callable[..., JobSpec],
    syncer_proc: Callable[..., SyncerHandle],
    tmp_path: Path,
) -> None:
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": H, "stepsPerIsland": "fixed"},
        # K = M: every round waits for both islands, up to an hour's grace
        sync={
            "quorum": 2,
            "graceSeconds": 3600,
            "heartbeatTimeoutSeconds": 3600,
            "fragments": 1,
            "overlapSteps": 0,
            "compression": "none",
        },
        stopAfter={"outerSteps": ROUNDS},
        syncer={"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": 1000},
    )
    handle = syncer_proc(spec)
    shapes = join_all(handle, (ADVERSARY,))
    zero = filled(shapes, 0.0)
    learner = start_learner(
        handle.files,
        syncer_url=handle.url,
        island=HONEST,
        island_index=0,
        log_file=tmp_path / f"{HONEST}.log",
        master_port=free_port(),
        job_name="test",
    )
    stop = threading.Event()
    answers: list[str] = []

    def adversary() -> None:
        # zero pushes claiming a round's H steps at 1 ms, back to back, until the job ends:
        # accepted while nothing judges them (the honest island's first 3 pushes), then
        # refused as work they do not carry
        while not stop.is_set():
            code, doc = push_as(handle, ADVERSARY, zero, steps=H, tokens=H * 64, step_time=0.001)
            answers.append(doc.get("code", "accepted") if code == 422 else str(code))
            stop.wait(0.2)

    thread = threading.Thread(target=adversary, daemon=True)
    thread.start()
    try:
        status = wait_until(
            lambda: (doc := handle.status())["finished"] and doc,
            timeout=300,
            what="the job's end (the honest learner's rounds no longer waiting for the adversary)",
        )
    finally:
        stop.set()
        thread.join(timeout=30)
        learner.stop(timeout=30)
    assert status["outerStep"] == ROUNDS
    assert answers.count(protocol.ERROR_UNSUPPORTED_WORK) >= REFUSED_RUN, answers
    left_out = f"islands left out of the rounds and the quorum: ['{ADVERSARY}']"
    assert left_out in handle.log_file.read_text()
    assert status["islands"][ADVERSARY]["state"] == protocol.STATE_ACTIVE  # named, not dropped
    merges = handle.merge_records()
    islands = [[c["island"] for c in m["contributors"]] for m in merges]
    # from some merge on, the honest learner's rounds close alone, complete
    alone = next(i for i, x in enumerate(islands) if x == [HONEST] and merges[i]["complete"])
    assert all(x == [HONEST] for x in islands[alone:]), islands
    assert len(islands) - alone >= ROUNDS // 2, islands
