"""The manifest of a syncer checkpoint (ckpt-*/manifest.json), typed (torch-free).

The syncer assembles it as a CheckpointManifest (syncer/service/status_document.py) and every reader
parses it with CheckpointManifest.from_json: the syncer's start-up (syncer/service/startup.py) and
`diloco export`. The file on disk is the model's wire form plus what syncer/storage/checkpoint.py
stamps on it when it writes it (formatVersion, outerStep, integrity: hashes over the raw JSON, so
they are checked against the file's own bytes, not against this model).

Checkpoints written by older syncers lack some fields: each of those has the default that makes
the older behaviour (no work clocks, no outer progress: a merge counted as a round; no saved push
answers or norm history). A field of the wrong type makes the checkpoint unreadable (a
DocumentError, which the loader treats as a corrupt checkpoint).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from diloco_trainer.api.documents import Document, EvalPoint, IslandStatus, PushAnswer


class SavedAnswer(Document):
    """The answer to one merged push, kept so a retry after a restart is a duplicate."""

    island: str
    fragment: int
    push_id: str
    answer: PushAnswer


class CheckpointManifest(Document):
    """What a syncer checkpoint holds besides its tensors."""

    versions: list[int]  # each fragment's version when it was written
    outer_step: int = 0  # stamped by the writer (checkpoint.save_checkpoint)
    format_version: int | None = None  # stamped by the writer
    job_name: str = ""
    fragments: list[list[str]] | None = None  # the parameter names of each fragment
    # The outer optimizer's progress per fragment: {"f": {"rounds", "accumulated"}} (None: a
    # checkpoint from before rounds of work were counted; each merge was a round).
    outer_progress: dict[str, dict[str, float]] | None = None
    # Per fragment, [version, work clock] pairs (the staleness of pushes in rounds of work).
    work_clocks: list[list[list[float]]] = Field(default_factory=list)
    # The merge log's counters (syncer/merging/merge_log.py).
    fragment_tokens: list[float] | None = None
    tokens: int = 0
    loss: float | None = None
    merges: int = 0
    last_merge_time: float | None = None
    initial_eval_loss: float | None = None
    eval_history: list[EvalPoint] = Field(default_factory=list)
    islands: dict[str, IslandStatus] = Field(default_factory=dict)
    spec_hash: str = ""
    codec: str = ""
    pull_compression: str = "none"
    push_answers: list[SavedAnswer] = Field(default_factory=list)
    norm_history: list[list[float]] = Field(default_factory=list)  # per fragment (guards.py)
    time: float = 0.0
    # Hashes of the files and of the manifest itself (checkpoint.py checks them on the raw JSON).
    integrity: dict[str, Any] | None = None
