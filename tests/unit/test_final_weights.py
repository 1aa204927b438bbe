"""The trained model comes out: the syncer names its final checkpoint, the job's status carries
it (with its volume), and ttlSecondsAfterFinished over an emptyDir is warned about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from diloco_operator import api
from diloco_operator.final_weights import (
    AT_RISK,
    FINAL_CHECKPOINT,
    final_checkpoint,
    post_weight_events,
    weights_at_risk,
)
from diloco_operator.status import compute_status, status_patch
from diloco_trainer.api import contract
from diloco_trainer.api.documents import DocumentError, SyncerStatus
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .observations import SYNCER, observation, syncer_status
from .test_syncer import FakeClock, body, delta, make_spec, run, started

FINISHED = {
    **SYNCER,
    "finished": True,
    "checkpoint": {"path": f"{contract.STATE_MOUNT}/checkpoints/ckpt-000000012", "outerStep": 12},
}


def _spec(**fields: Any) -> api.DiLoCoJobSpec:
    return api.parse_job_spec({"image": "x", **fields})


def test_syncer_status_names_its_final_checkpoint_and_keeps_it_after_a_restart(
    tmp_path: Path,
) -> None:
    spec = make_spec(
        sync={"quorum": 1, "graceSeconds": 0}, stopAfter={"outerSteps": None, "tokens": 250}
    )

    async def finish() -> dict[str, Any]:
        syncer = await started(spec, tmp_path, FakeClock())
        assert (await syncer.status())["checkpoint"] is None  # a fresh start has none
        await syncer.islands.join("island-0", 1)
        for r in range(3):
            pushed = body(syncer, 0, "island-0", delta(syncer, 0, r), tokens=100)
            await syncer.receive_push(0, pushed)
            await syncer.tick()
        doc = await syncer.status()
        await syncer.stop()
        return doc

    async def restarted() -> dict[str, Any]:
        syncer = await started(spec, tmp_path, FakeClock())
        doc = await syncer.status()
        await syncer.stop()
        return doc

    final = run(finish())
    written = ckpt.list_checkpoints(tmp_path)[-1]
    assert final["finished"] is True
    assert final["checkpoint"] == {"path": str(written), "outerStep": 3}
    typed = SyncerStatus.from_json(final)
    assert typed.checkpoint is not None and typed.checkpoint.outer_step == 3
    assert typed.to_json() == final
    again = run(restarted())
    assert again["finished"] is True
    assert again["checkpoint"] == {"path": str(written), "outerStep": 3}


def test_status_names_the_final_checkpoint_on_its_volume() -> None:
    status = compute_status(observation(syncer=FINISHED), None)
    assert status.final_checkpoint == api.FinalCheckpoint(
        path="checkpoints/ckpt-000000012", outer_step=12, volume="emptyDir"
    )
    claimed = observation(syncer=FINISHED, spec={"syncer": {"checkpoint": {"claimName": "ck"}}})
    patch = status_patch(compute_status(claimed, None))
    assert patch["finalCheckpoint"] == {
        "path": "checkpoints/ckpt-000000012",
        "outerStep": 12,
        "volume": "persistentVolumeClaim/ck",
    }


def test_final_checkpoint_only_once_finished_and_carried_while_the_syncer_is_away() -> None:
    spec = _spec()
    finished = syncer_status(FINISHED)
    running = syncer_status({**FINISHED, "finished": False})
    assert final_checkpoint(spec, running, None) is None
    stored = final_checkpoint(spec, finished, None)
    assert stored is not None
    previous = {"finalCheckpoint": stored.model_dump(by_alias=True)}
    assert final_checkpoint(spec, None, previous) == stored
    # A finished syncer whose final checkpoint failed: the last one named stays.
    failed = syncer_status({**FINISHED, "checkpoint": None})
    assert final_checkpoint(spec, failed, previous) == stored
    bad = syncer_status({**FINISHED, "checkpoint": {"path": "/x", "outerStep": -1}})
    assert final_checkpoint(spec, bad, None) is None
    with pytest.raises(DocumentError, match=r"checkpoint\.outerStep"):  # refused when read
        syncer_status({**FINISHED, "checkpoint": {"path": "/x", "outerStep": "twelve"}})
    assert final_checkpoint(spec, None, {"finalCheckpoint": {"path": 3}}) is None
    remote = _spec(syncer={"endpoint": "https://syncer.example:8470"})
    assert final_checkpoint(remote, finished, None) is None


def test_ttl_over_an_empty_dir_is_warned_about() -> None:
    risky = weights_at_risk(_spec(ttlSecondsAfterFinished=60))
    assert risky is not None and "claimName" in risky and "diloco export" in risky
    assert weights_at_risk(_spec()) is None
    kept = _spec(ttlSecondsAfterFinished=60, syncer={"checkpoint": {"claimName": "ck"}})
    assert weights_at_risk(kept) is None


def test_weight_events_are_posted_once_per_job_and_message(caplog: Any) -> None:
    posted: dict[str, str] = {}
    job = {"metadata": {"name": "j", "namespace": "ns", "uid": "u1"}}
    spec = _spec(ttlSecondsAfterFinished=60)
    caplog.set_level("INFO", logger="diloco_operator")
    post_weight_events(posted, job, spec, {"phase": "Running", "finalCheckpoint": None})
    post_weight_events(posted, job, spec, {"phase": "Running", "finalCheckpoint": None})
    final = {"path": "checkpoints/ckpt-000000012", "outerStep": 12, "volume": "emptyDir"}
    post_weight_events(posted, job, spec, {"phase": "Succeeded", "finalCheckpoint": final})
    post_weight_events(posted, job, spec, {"phase": "Succeeded", "finalCheckpoint": final})
    reasons = [r.getMessage().split()[1] for r in caplog.records]
    assert reasons == [AT_RISK, FINAL_CHECKPOINT]
    assert "checkpoints/ckpt-000000012 on emptyDir" in caplog.records[-1].getMessage()
    # The same name again (a new uid) is a new job: warned again.
    post_weight_events(posted, {"metadata": {**job["metadata"], "uid": "u2"}}, spec, {})
    assert [r.getMessage().split()[1] for r in caplog.records][-1] == AT_RISK
