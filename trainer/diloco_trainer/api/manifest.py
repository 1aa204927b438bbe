"""The manifest of a syncer checkpoint (ckpt-*/manifest.json), typed (torch-free).

The syncer assembles it as a CheckpointManifest (syncer/service/status_document.py) and every reader
parses it with CheckpointManifest.from_json: the syncer's start-up (syncer/service/startup.py) and
`diloco export`. The file on disk is the model's wire form plus what syncer/storage/checkpoint.py
stamps on it when it writes it (formatVersion, outerStep, integrity: hashes over the raw JSON, so
they are checked against the file's own bytes, not against this model).

Checkpoints written by older syncers lack some fields: each of those has the default that makes
the older behaviour (no work clocks, no outer progress: a merge counted as a round; no saved push
answers, norm history or guard figures). A field of the wrong type makes the checkpoint
unreadable (a DocumentError, which the loader treats as a corrupt checkpoint).
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


class SavedGuards(Document):
    """The guards' per-island figures a restart must not forget (syncer/intake/guards.py), so
    that an island cannot get a clean slate by waiting for the syncer to restart: the work
    evidence's movement per claimed step of each island's recent accepted pushes, and the
    detection's windows (each island's last judged pushes: their movement over the reference,
    whether each sat at the learned bound), from which who is named islandWorkUnsupported and
    islandAtBound follows; and each island's refusals in a row towards maxRefusals. Per fragment
    a map of island to its window, oldest first. The reader keeps only the islands the
    checkpoint has records of and each window's newest entries up to its length, so the
    figures stay as bounded as the running syncer's."""

    movement: list[dict[str, list[float]]] = Field(default_factory=list)
    carried: list[dict[str, list[float]]] = Field(default_factory=list)
    at_bound: list[dict[str, list[bool]]] = Field(default_factory=list)
    streaks: dict[str, int] = Field(default_factory=dict)


class SavedMergedPush(Document):
    """An island's latest merged push to one fragment (syncer/state/records.MergedPush): a
    push of it again on the same base carries its steps again (records.carried_again)."""

    fragment: int
    base: int
    tokens: float


class SavedCount(Document):
    """Where an island's heartbeat count stands against its record (syncer/state/targets.py's
    CountBound), kept so a restart reads the same learner's count in the same frame: `base`,
    the island's merged tokens at its last join (its learner counts from there and keeps
    counting across a syncer restart, which it rides out without joining again), and
    `refused`, the tokens of its pushes refused since (not trained again: its count runs
    ahead of its merged tokens by them for good); `merged`, its latest merged push to each
    fragment since that join (a learner that missed the merge of one across the restart
    pushes it again on the same base: records.carried_again)."""

    base: float = 0.0
    refused: float = 0.0
    merged: list[SavedMergedPush] = Field(default_factory=list)


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
    # Per island, its count's frame (SavedCount); absent (an older checkpoint): every restored
    # count starts from 0 and nothing refused, as before it was kept.
    counts: dict[str, SavedCount] = Field(default_factory=dict)
    spec_hash: str = ""
    codec: str = ""
    pull_compression: str = "none"
    push_answers: list[SavedAnswer] = Field(default_factory=list)
    norm_history: list[list[float]] = Field(default_factory=list)  # per fragment (guards.py)
    # None: a checkpoint from before the guards' figures were kept (they start afresh).
    guards: SavedGuards | None = None
    time: float = 0.0
    # Hashes of the files and of the manifest itself (checkpoint.py checks them on the raw JSON).
    integrity: dict[str, Any] | None = None
