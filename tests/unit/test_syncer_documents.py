"""The syncer writes its disk documents through their models, and reads them back the same way:
a real checkpoint's manifest and merges.jsonl lines are CheckpointManifest and MergeRecord
documents whose wire form is what is on disk; an older manifest reads with the older meanings;
a malformed one is refused naming the field; a push's metadata is read once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.documents import DocumentError, IslandStatus, MergeRecord
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.core import payloads
from diloco_trainer.syncer.merging.merge_log import MERGE_LOG_FILE
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import IslandRecord
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .test_syncer import FakeClock, body, delta, make_spec, run, started


def _two_merges(tmp_path: Path) -> Syncer:
    async def scenario() -> Syncer:
        spec = make_spec(islands={"count": 1}, sync={"quorum": 1})
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for seed in range(2):
            pushed = body(syncer, 0, "island-0", delta(syncer, 0, seed), push_id=f"p{seed}")
            await syncer.receive_push(0, pushed)
            await syncer.tick()
        await syncer.stop()  # the final checkpoint
        return syncer

    return run(scenario())


def test_syncer_documents_on_disk_are_their_models_wire_form(tmp_path: Path) -> None:
    syncer = _two_merges(tmp_path)
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None
    # Parsed and written back, the manifest is what is on disk, key for key.
    assert loaded.document.to_wire() == loaded.manifest
    assert loaded.document.versions == [2] and loaded.document.outer_step == 2
    assert loaded.document.job_name == "unit"
    saved = loaded.document.push_answers
    assert [(a.island, a.push_id, a.answer.version) for a in saved] == [
        ("island-0", "p0", 0),
        ("island-0", "p1", 1),
    ]
    lines = (tmp_path / MERGE_LOG_FILE).read_text().splitlines()
    records = [MergeRecord.from_json(json.loads(line)) for line in lines]
    assert [r.to_wire() for r in records] == [json.loads(line) for line in lines]
    assert [(r.version, r.fragment, r.tokens) for r in records] == [(1, 0, 100), (2, 0, 100)]
    assert [c.island for r in records for c in r.contributors] == ["island-0", "island-0"]
    assert records == list(syncer.merge_log.recent)


def test_syncer_documents_older_manifest_reads_with_older_meanings() -> None:
    # What a syncer before rounds of work, saved answers and norm history wrote.
    older = CheckpointManifest.from_json(
        {"versions": [3, 2], "outerStep": 2, "formatVersion": 1, "fragmentTokens": [30.0, 20.0]}
    )
    assert older.outer_progress is None  # each merge was a round (GlobalModel.restore)
    assert (older.work_clocks, older.push_answers, older.norm_history) == ([], [], [])
    assert older.islands == {} and older.pull_compression == "none"


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"outerStep": 1}, "versions"),
        ({"versions": "3"}, "versions"),
        ({"versions": [1], "islands": {"island-0": {"joins": 1}}}, "islands.island-0.state"),
        ({"versions": [1], "pushAnswers": [{"island": "island-0"}]}, "pushAnswers.0.fragment"),
    ],
)
def test_syncer_documents_malformed_manifest_is_refused_naming_the_field(
    doc: dict[str, Any], field: str
) -> None:
    with pytest.raises(DocumentError) as err:
        CheckpointManifest.from_json(doc)
    assert field in str(err.value)


def test_syncer_documents_a_push_header_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island's credential: who may push is checked on the same reading of the header that
    the metadata is parsed from (before, the body's header was read for each)."""
    reads: list[int] = []
    real = protocol.read_metadata

    def counted(raw: bytes) -> dict[str, str]:
        reads.append(len(raw))
        return real(raw)

    # Every reader of a safetensors header in the trainer goes through one of these two names.
    monkeypatch.setattr(protocol, "read_metadata", counted)
    monkeypatch.setattr(payloads, "read_metadata", counted)

    async def scenario() -> dict[str, Any]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        island = credentials.Principal(credentials.ISLAND, "island-0")
        pushed = body(syncer, 0, "island-0", delta(syncer, 0, 1))
        answer = await syncer.receive_push(0, pushed, island)
        await syncer.stop()
        return answer

    answer = run(scenario())
    assert answer["accepted"] is True and len(reads) == 1


def test_island_status_holding_is_read_from_the_entry_and_absent_by_default() -> None:
    """An island's `holding` (its learner at the step cap) is read when the syncer sends it; an
    entry without it (a syncer before the field) is not holding and comes back as it was; a
    holding that is no JSON boolean makes the document malformed, naming the field."""
    assert IslandStatus.from_json({"state": "active", "holding": True}).holding
    plain = IslandStatus.from_json({"state": "active"})
    assert not plain.holding and "holding" not in plain.to_wire()
    with pytest.raises(DocumentError, match="holding"):
        IslandStatus.from_json({"state": "active", "holding": "yes"})
    # `drained` (learner/drain.py) the same way.
    assert IslandStatus.from_json({"state": "active", "drained": True}).drained
    assert not plain.drained and "drained" not in plain.to_wire()
    with pytest.raises(DocumentError, match="drained"):
        IslandStatus.from_json({"state": "active", "drained": 1})


def test_island_status_waiting_round_trips_as_a_share_and_is_unknown_when_absent() -> None:
    """An island's `waiting` (the share of its learner's wall time blocked on the syncer, as its
    latest heartbeat said) is read as a number in [0, 1] and written back as it was read; absent
    or null (a syncer or learner before the field) it is unknown (None), never 0; a share
    outside [0, 1] or no number makes the document malformed, naming the field."""
    entry = IslandStatus.from_json({"state": "active", "waiting": 0.375})
    assert entry.waiting == 0.375 and entry.to_wire() == {"state": "active", "waiting": 0.375}
    assert IslandStatus.from_json(entry.to_wire()) == entry
    assert IslandStatus.from_json({"state": "active", "waiting": 1}).waiting == 1.0
    plain = IslandStatus.from_json({"state": "active"})
    assert plain.waiting is None and "waiting" not in plain.to_wire()
    assert IslandStatus.from_json({"state": "active", "waiting": None}).waiting is None
    for bad in (-0.5, 1.01, "x", [0.5]):
        with pytest.raises(DocumentError, match="waiting"):
            IslandStatus.from_json({"state": "active", "waiting": bad})
    # The syncer's record -> its status entry on the wire -> what the operator reads.
    record = IslandRecord("island-0", waiting=0.5)
    wire = json.loads(json.dumps(record.to_status().to_wire()))
    assert IslandStatus.from_json(wire).waiting == 0.5
    assert IslandStatus.from_json(IslandRecord("island-0").to_status().to_wire()).waiting is None
