"""A syncer's disk problems reach the job (issue 22): a real in-process syncer whose merge log
and checkpoints cannot be written goes on merging, and its status document, read by the
operator's own policies, sets the job's SyncerHealthy condition to False naming both problems
(MergeLogFailing was reported as 'Other' before), with no ?strict=1 probe involved."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from diloco_operator.conditions import syncer_health
from diloco_trainer.syncer.merging import merge_log
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .observations import syncer_view
from .test_syncer import FakeClock, make_spec, run, started
from .test_syncer_guards_service import ALONE, honest_round


def test_syncer_disk_problems_reach_the_job_as_a_condition(tmp_path: Path) -> None:
    spec = make_spec(sync=ALONE, syncer={"checkpoint": {"everyOuterSteps": 1}})

    async def scenario() -> dict[str, Any]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await honest_round(syncer, seed=0)
        # Real faults, as a full or read-only disk gives them (root included): neither the
        # merge log nor a checkpoint folder can be created where a file or folder stands.
        (tmp_path / merge_log.MERGE_LOG_FILE).unlink()
        (tmp_path / merge_log.MERGE_LOG_FILE).mkdir()
        shutil.rmtree(tmp_path / ckpt.CHECKPOINTS_DIR)
        (tmp_path / ckpt.CHECKPOINTS_DIR).write_text("not a folder")
        await honest_round(syncer, seed=1)
        await honest_round(syncer, seed=2)
        doc = await syncer.status()
        await syncer.stop()
        return doc

    doc = run(scenario())
    assert doc["failure"] is None and doc["versions"] == [3]  # merges went on
    kinds = {p["kind"]: p["count"] for p in doc["health"]["problems"]}
    assert kinds == {merge_log.MERGE_LOG: 2, "checkpoint": 2}
    view = syncer_view(doc)
    healthy, reason, message = syncer_health(view)
    assert not healthy and reason in ("MergeLogFailing", "CheckpointFailing")
    assert sorted(message.removeprefix("syncer health problems: ").split(", ")) == [
        "CheckpointFailing (2 times)",
        "MergeLogFailing (2 times)",
    ]
