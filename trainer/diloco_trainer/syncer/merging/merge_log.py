"""What the syncer has merged: tokens per fragment, the learners' loss and the merge log.

Every merge is logged (the status document's recent "merges" and state_dir/merges.jsonl) with its
contributors (their lags in versions and rounds of work, work, staleness discount, vector scale,
raw and normalised weights) and the work fraction it carried, so it can be reproduced; each entry
is an api/documents.MergeRecord, the document the status and merges.jsonl carry.
merges.jsonl is rotated at MERGE_LOG_BYTES (merges.jsonl.1 .. .MERGE_LOG_FILES): a long job
keeps the most recent merges on disk, not all of them.

Writing it fails soft: merges.jsonl is a record for people, not what a restart recovers from
(the checkpoints are), so a full or read-only disk must not stop the syncer (a failed syncer
skips its final checkpoint, which loses merges). An entry that cannot be written is kept (up to
UNWRITTEN_ENTRIES, the oldest dropped and counted) and written with the next one that can;
`problem` says what failed until then (merge.py reports it as the MERGE_LOG health problem), and
a half-written line is cut off again so the file stays one JSON document a line. At a stop,
`close` writes the kept entries if the log can be written again, and otherwise says on the
syncer's log (stderr) how many are lost with the process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.documents import MergeContributor, MergeRecord
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.core.contributions import credited_tokens
from diloco_trainer.syncer.merging.global_model import MergeResult
from diloco_trainer.syncer.state import Contribution

MERGE_LOG_FILE = "merges.jsonl"
RECENT_MERGES = 20
# Each fragment's last merges kept for GET /v1/fragments/{f}/merges (phase alignment reads the
# merges between a push's base and the version it went into, and the one before: a few at most,
# even at K = 1, where each island's push can open a merge of its own).
RECENT_OF_FRAGMENT = 8
# merges.jsonl is rotated when it reaches this size; this many rotated files are kept.
MERGE_LOG_BYTES = 64 * 1024 * 1024
MERGE_LOG_FILES = 3
# Entries kept in memory while merges.jsonl cannot be written.
UNWRITTEN_ENTRIES = 1000
# The health problem (health.py's kinds) while merges.jsonl cannot be written.
MERGE_LOG = "mergeLog"

log = logging.getLogger("diloco.syncer")


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
        self.of_fragment = [deque[MergeRecord](maxlen=RECENT_OF_FRAGMENT) for _ in range(fragments)]
        self.count = 0
        self.last_time: float | None = None
        self.unwritten: deque[MergeRecord] = deque(maxlen=UNWRITTEN_ENTRIES)
        self.dropped = 0  # entries never written: more than UNWRITTEN_ENTRIES were waiting
        self.problem: str | None = None  # why the last write failed; None once one succeeds

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
        # What each spends of stopAfter.tokens: its tokens, at most its credited round's
        # (syncer.guards.pairCredit; core/contributions.credited_tokens).
        credited = sum(credited_tokens(c.tokens, c.steps, c.budget_steps) for c in contributions)
        self.fragment_tokens[fragment] += credited
        tokens = round(credited)
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
            momentum=plan.momentum,
            complete=plan.complete,
            rounds=result.rounds,
            tokens=tokens,
            merge_seconds=seconds,
            movement=result.movement,
            clip=result.clip,
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
                    kept_steps=c.kept_steps,
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
        self.of_fragment[fragment].append(entry)
        return entry

    def merges_of(self, fragment: int, from_version: int = 0) -> list[MergeRecord]:
        """The fragment's kept merges (RECENT_OF_FRAGMENT) of `from_version` or later, oldest
        first."""
        return [m for m in self.of_fragment[fragment] if m.version >= from_version]

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
        """Append an entry, and any earlier ones that could not be written, to merges.jsonl
        (blocking: call from a worker thread), rotating it first when it is full. Never raises
        for the disk: an OSError sets `problem` and keeps the entries for the next write."""
        if len(self.unwritten) == UNWRITTEN_ENTRIES:
            self.dropped += 1
        self.unwritten.append(entry)
        try:
            size = self._append_unwritten()
        except OSError as err:
            self.problem = (
                f"cannot write {self.path}: {err}; {len(self.unwritten)} merge(s) kept to write "
                f"later, {self.dropped} dropped (the checkpoints hold the state)"
            )
            log.error("%s", self.problem)
            return
        self.unwritten.clear()
        if self.problem is not None:
            log.warning("%s is written again (%d bytes)", self.path, size)
        self.problem = None

    def close(self) -> int:
        """At a stop (blocking: call from a worker thread): write the entries kept while the log
        could not be written, if it can be now; the number lost with the process (0 when none
        was waiting or they were written), and an error line on the syncer's log saying so."""
        if not self.unwritten and not self.dropped:
            return 0
        kept = len(self.unwritten)
        try:
            if kept:
                self._append_unwritten()
        except OSError as err:
            lost = kept + self.dropped
            log.error(
                "stopping with %d merge log entries never written to %s (%d kept in memory, "
                "%d dropped earlier): %s; the checkpoints hold the state",
                lost,
                self.path,
                kept,
                self.dropped,
                err,
            )
            return lost
        self.unwritten.clear()
        self.problem = None
        if self.dropped:
            log.error(
                "stopping: %d merge log entries kept were written to %s at stop, %d dropped "
                "earlier are lost (more than %d waited)",
                kept,
                self.path,
                self.dropped,
                UNWRITTEN_ENTRIES,
            )
        else:
            log.warning("stopping: %d merge log entries kept were written to %s", kept, self.path)
        return self.dropped

    def _append_unwritten(self) -> int:
        """The waiting entries appended in one write; a failed write is cut back off."""
        rotate(self.path, MERGE_LOG_BYTES, MERGE_LOG_FILES)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(e.to_wire(), sort_keys=True) + "\n" for e in self.unwritten)
        with self.path.open("a") as f:
            start = f.tell()
            try:
                f.write(lines)
                f.flush()
                with contextlib.suppress(OSError):
                    os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(start)  # no half line left for the next write to follow
                raise
            return f.tell()

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
        f"{entry.outer_step}, {entry.fraction:.3f} of a round"
        + (f" ({entry.momentum:.3f} of it into the momentum)" if entry.momentum < 1.0 else "")
        + f", {entry.tokens} tokens, {entry.merge_seconds:.3f}s): {parts}"
    )
