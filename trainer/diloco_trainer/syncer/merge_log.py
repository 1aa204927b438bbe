"""What the syncer has merged: tokens per fragment, the learners' loss and the merge log.

Every merge is logged (the status document's recent "merges" and state_dir/merges.jsonl) with its
contributors (their lags in versions and rounds of work, work, staleness discount, vector scale,
raw and normalised weights) and the work fraction it carried, so it can be reproduced; each entry
is an api/documents.MergeRecord, the document the status and merges.jsonl carry.
merges.jsonl is rotated at MERGE_LOG_BYTES (merges.jsonl.1 .. .MERGE_LOG_FILES): a long job
keeps the most recent merges on disk, not all of them.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.documents import MergeContributor, MergeRecord
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.syncer import checkpoint as ckpt
from diloco_trainer.syncer.global_model import MergeResult
from diloco_trainer.syncer.records import Contribution

MERGE_LOG_FILE = "merges.jsonl"
RECENT_MERGES = 20
# merges.jsonl is rotated when it reaches this size; this many rotated files are kept.
MERGE_LOG_BYTES = 64 * 1024 * 1024
MERGE_LOG_FILES = 3


@dataclass(frozen=True)
class MergeLogSnapshot:
    """The merge log's figures as the status document shows them (MergeLog.snapshot)."""

    tokens: int
    loss: float | None
    count: int
    last_time: float | None
    recent: list[MergeRecord]


class MergeLog:
    """Merged tokens, the latest learner loss and the log of merges of one job."""

    def __init__(self, fragments: int, state_dir: Path) -> None:
        self.path = state_dir / MERGE_LOG_FILE
        self.fragment_tokens = [0.0] * fragments
        self.loss: float | None = None
        self.recent: deque[MergeRecord] = deque(maxlen=RECENT_MERGES)
        self.count = 0
        self.last_time: float | None = None

    @property
    def tokens(self) -> int:
        """Tokens merged into the global model (each fragment's merges, averaged over fragments)."""
        return round(sum(self.fragment_tokens) / len(self.fragment_tokens))

    def record(
        self,
        fragment: int,
        contributions: Sequence[Contribution],
        result: MergeResult,
        *,
        version: int,
        outer_step: int,
        time: float,
        quorum: int,
        grace: float,
        rule: str,
        seconds: float,
    ) -> MergeRecord:
        """Count a merge of `fragment` (its round's `contributions`, now at `version`) and
        return its log entry."""
        plan = result.plan
        tokens = sum(c.tokens for c in contributions)
        self.fragment_tokens[fragment] += tokens
        losses = [(c.loss, c.tokens) for c in contributions if c.loss is not None]
        if losses:
            self.loss = sum(v * t for v, t in losses) / sum(t for _, t in losses)
        self.count += 1
        self.last_time = time
        entry = MergeRecord(
            version=version,
            fragment=fragment,
            outer_step=outer_step,
            time=time,
            quorum=quorum,
            grace=grace,
            rule=rule,
            fraction=plan.fraction,
            complete=plan.complete,
            rounds=result.rounds,
            tokens=tokens,
            merge_seconds=seconds,
            contributors=[
                MergeContributor(
                    island=c.island,
                    base_version=c.base_version,
                    lag=c.lag,
                    tokens=c.tokens,
                    steps=c.steps,
                    loss=c.loss,
                    received_at=c.received_at,
                    work=work,
                    discount=discount,
                    scale=scale,
                    raw_weight=raw,
                    weight=share,
                )
                for c, work, discount, scale, raw, share in zip(
                    contributions,
                    plan.work,
                    plan.discounts,
                    plan.scales,
                    plan.weights,
                    plan.shares,
                    strict=True,
                )
            ],
        )
        self.recent.append(entry)
        return entry

    def snapshot(self) -> MergeLogSnapshot:
        """Its figures as they are now."""
        return MergeLogSnapshot(
            tokens=self.tokens,
            loss=self.loss,
            count=self.count,
            last_time=self.last_time,
            recent=list(self.recent),
        )

    def write(self, entry: MergeRecord) -> None:
        """Append an entry to merges.jsonl (blocking: call from a worker thread), rotating it
        first when it is full."""
        rotate(self.path, MERGE_LOG_BYTES, MERGE_LOG_FILES)
        ckpt.append_jsonl(self.path, entry.to_wire())

    def manifest(self) -> dict[str, Any]:
        """The checkpoint manifest's fields of this log (CheckpointManifest's names)."""
        return {
            "fragment_tokens": list(self.fragment_tokens),
            "tokens": self.tokens,
            "loss": self.loss,
            "merges": self.count,
            "last_merge_time": self.last_time,
        }

    def restore(self, manifest: CheckpointManifest) -> None:
        """Load the counters a checkpoint saved (manifest())."""
        if manifest.fragment_tokens is not None:
            self.fragment_tokens = [float(t) for t in manifest.fragment_tokens]
        self.loss = manifest.loss
        self.count = manifest.merges
        self.last_time = manifest.last_merge_time


def rotate(path: Path, max_bytes: int, files: int) -> bool:
    """When `path` holds max_bytes or more: path.(n-1) -> path.n .. path -> path.1 (the oldest
    beyond `files` is replaced); True when it rotated."""
    try:
        if path.stat().st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    for n in range(files - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))
    return True


def describe_merge(entry: MergeRecord) -> str:
    """A merge log entry as one log line."""
    parts = ", ".join(f"{c.island} w={c.weight:.3f} lag={c.lag}" for c in entry.contributors)
    return (
        f"merged fragment {entry.fragment} -> version {entry.version} (outer step "
        f"{entry.outer_step}, {entry.fraction:.3f} of a round, {entry.tokens} tokens, "
        f"{entry.merge_seconds:.3f}s): {parts}"
    )
