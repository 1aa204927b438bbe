"""The learner's step cap against a real syncer that stops answering (issue 22): the syncer
process is frozen (SIGSTOP: its sockets still accept, nothing is answered) while two decoupled
islands train. An honest learner used to step on, and once the syncer answered again its next
push carried every step since the frozen push, more than 4 x H + τ: refused as
steps_out_of_range, a refusal that counts towards dropping the island. Now each learner stops
stepping at the cap (it logs that it holds), and steps on once the syncer answers: no push is
refused and merges go on.

The freeze waits until both learners have had a merge applied: at K = 1 one island alone can
drive the outer step, and a learner still starting when the syncer freezes waits to join (it
neither steps nor holds). The job has no reachable end for the same reason: a tiny model's
merges take milliseconds, and a job that finished before the freeze would hold nothing."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.launch import Proc
from diloco_trainer.local.run import LocalRun

from .conftest import wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    start_synchronised,
    status_of,
)

pytestmark = pytest.mark.e2e

H, TAU = 4, 1
MOST = 4 * H + TAU  # core/push_bounds.max_push_steps, written out: 17 steps
NO_END = 1_000_000  # stopAfter.outerSteps: never reached; the test stops the run itself
AFTER = 6  # merges past the freeze that show the job going on
HOLDING = "holding inner steps until the syncer answers"
STEPPING_ON = "for the syncer; stepping on"


def learner_logs(run: LocalRun) -> list[Path]:
    return sorted(run.logs.glob("island-*-rank0.log"))


def last_step(text: str) -> int:
    """The schedule position of the latest progress line ("step N loss ...") in `text`."""
    found = re.findall(r" step (\d+) loss ", text)
    return int(found[-1]) if found else 0


def applied_a_merge(log: Path) -> bool:
    """The learner has joined, stepped, pushed and taken a merged version: it is training."""
    return re.search(r"applied version [1-9]", log.read_text()) is not None


def since(log: Path, offset: int) -> str:
    """What the learner logged after `offset` bytes (a tiny model holds for a few milliseconds
    now and then in normal running, so only what follows the freeze counts)."""
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def holds_now(log: Path) -> bool:
    """The learner's latest hold has not ended: it logged that it holds after its last "stepping
    on". A learner may be in a hold when the syncer freezes (under load a tiny model reaches the
    cap now and then in normal running); that hold then lasts the whole freeze, and its message
    came before the freeze."""
    text = log.read_text(errors="replace")
    return text.rfind(HOLDING) > text.rfind(STEPPING_ON)


def held_or_past_cap(at_freeze: dict[Path, tuple[int, int]]) -> bool:
    """Every learner, since the freeze, either holds, or has stepped well past the cap (what a
    learner without the cap does: its next push is then bound to be refused)."""
    for log, (offset, step) in at_freeze.items():
        if not holds_now(log) and last_step(since(log, offset)) < step + 2 * MOST:
            return False
    return True


def tails(logs: list[Path], lines: int = 15) -> str:
    """The last lines of each learner's log, for a failure's message."""
    return "\n".join(
        f"--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        for log in logs
    )


def test_learners_hold_at_the_step_cap_while_the_syncer_is_frozen(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": H},
        # K = 1 of 2 with overlap: decoupled learners never block for a merge, so a silent
        # syncer leaves them stepping (the case the cap is for). The late merge's hold at
        # H − 1 or ceil(H / 2) (sync.lateMergeHold auto) would first spend a wait budget (>= the
        # 30 s heartbeat timeout) per push before the cap: the cap alone here (the late hold:
        # tests/unit/test_learner_late_hold.py).
        sync={
            "quorum": 1,
            "overlapSteps": TAU,
            "heartbeatTimeoutSeconds": 30,
            "lateMergeHold": "off",
        },
        stopAfter={"outerSteps": NO_END},
        syncer={"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
    )
    run = local_run(spec)
    start_synchronised(run)
    wait_until(
        lambda: len(learner_logs(run)) == 2 and all(map(applied_a_merge, learner_logs(run))),
        timeout=300,
        what="both learners to apply a merge",
    )
    assert isinstance(run.syncer, Proc)
    syncer_pid = run.syncer.pid
    os.killpg(syncer_pid, signal.SIGSTOP)
    try:
        at_freeze = {
            log: (log.stat().st_size, last_step(log.read_text())) for log in learner_logs(run)
        }
        assert len(at_freeze) == 2
        try:
            wait_until(
                lambda: held_or_past_cap(at_freeze),
                timeout=180,
                interval=0.2,
                what="each learner to hold or step past the cap",
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\n{tails(list(at_freeze))}") from None
        held = {log: holds_now(log) for log in at_freeze}
    finally:
        os.killpg(syncer_pid, signal.SIGCONT)
    frozen_at = status_of(run)["outerStep"]

    def went_on() -> bool:
        texts = [since(log, offset) for log, (offset, _) in at_freeze.items()]
        return status_of(run)["outerStep"] >= frozen_at + AFTER and all(
            STEPPING_ON in text for text in texts
        )

    wait_until(went_on, timeout=300, what=f"{AFTER} merges after the freeze, both learners on")
    status = SyncerStatus.from_json(status_of(run))
    assert not status.finished and all(p.alive for p in run.learners)
    refused = {island: dict(reasons) for island, reasons in status.refusals.items() if reasons}
    assert not any(protocol.ERROR_STEPS_RANGE in r for r in refused.values()), refused
    for log, (offset, _) in at_freeze.items():
        text = since(log, offset)
        assert held[log], log.name  # it held at the cap while the syncer was frozen ...
        assert STEPPING_ON in text, log.name  # ... and went on by itself
    merges = (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    assert len(merges) >= frozen_at + AFTER
