"""The learner's step cap against a real syncer that stops answering (issue 22): the syncer
process is frozen (SIGSTOP: its sockets still accept, nothing is answered) while two decoupled
islands train. An honest learner used to step on, and once the syncer answered again its next
push carried every step since the frozen push, more than 4 x H + τ: refused as
steps_out_of_range, a refusal that counts towards dropping the island. Now each learner stops
stepping at the cap (it logs that it holds), and steps on once the syncer answers: no push is
refused and the job finishes on its own."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.launch import Proc
from diloco_trainer.local.run import LocalRun

from .conftest import wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
    start_synchronised,
    status_of,
)

pytestmark = pytest.mark.e2e

H, TAU = 4, 1
MOST = 4 * H + TAU  # core/push_bounds.max_push_steps, written out: 17 steps
OUTER_STEPS = 12
HOLDING = "holding inner steps until the syncer answers"
STEPPING_ON = "for the syncer; stepping on"


def learner_logs(run: LocalRun) -> list[Path]:
    return sorted(run.logs.glob("island-*-rank0.log"))


def last_step(log: Path) -> int:
    """The schedule position of the learner's latest progress line ("step N loss ...")."""
    found = re.findall(r" step (\d+) loss ", log.read_text())
    return int(found[-1]) if found else 0


def held_or_past_cap(run: LocalRun, at_freeze: dict[Path, int]) -> bool:
    """Every learner either holds, or has stepped well past the cap since the freeze (what a
    learner without the cap does: its next push is then bound to be refused)."""
    return all(
        HOLDING in log.read_text() or last_step(log) >= at_freeze[log] + 2 * MOST
        for log in at_freeze
    )


def test_learners_hold_at_the_step_cap_while_the_syncer_is_frozen(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": H},
        # K = 1 of 2 with overlap: decoupled learners never block for a merge, so a silent
        # syncer leaves them stepping (the case the cap is for).
        sync={"quorum": 1, "overlapSteps": TAU, "heartbeatTimeoutSeconds": 30},
        stopAfter={"outerSteps": OUTER_STEPS},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )
    run = local_run(spec)
    start_synchronised(run)
    wait_until(lambda: status_of(run)["outerStep"] >= 2, timeout=300, what="two merges")
    assert isinstance(run.syncer, Proc)
    syncer_pid = run.syncer.pid
    os.killpg(syncer_pid, signal.SIGSTOP)
    try:
        at_freeze = {log: last_step(log) for log in learner_logs(run)}
        assert len(at_freeze) == 2
        wait_until(
            lambda: held_or_past_cap(run, at_freeze),
            timeout=180,
            interval=0.2,
            what="each learner to hold or step past the cap",
        )
    finally:
        os.killpg(syncer_pid, signal.SIGCONT)
    status = run_to_finish(run, timeout=600)

    assert status.outer_step == OUTER_STEPS
    refused = {island: dict(reasons) for island, reasons in status.refusals.items() if reasons}
    assert not any(protocol.ERROR_STEPS_RANGE in r for r in refused.values()), refused
    for log in learner_logs(run):
        text = log.read_text()
        assert HOLDING in text, log.name  # it held at the cap ...
        assert STEPPING_ON in text, log.name  # ... and went on by itself
    merges = (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    assert len(merges) >= OUTER_STEPS
