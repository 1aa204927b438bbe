"""How stale a run's merges were, from its syncer's merges.jsonl (api/documents.MergeRecord lines):
the pushes' lags in versions, how many merges held a single island, the least momentum share
(core/contributions.momentum_share) and whether any island's round was resized
(inner.stepsPerIsland) in its learners' logs. bench/busy_link shows it per run (issue 45: at
K = 1 over a slow link the merges' staleness is what the outer momentum turned into an
oscillation)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

MERGE_LOG = "merges.jsonl"
RESIZED = "rounds of "  # a learner's log line when it adopts another H_i (fragment_sync.py)


@dataclass(frozen=True)
class MergeStaleness:
    """A run's merges: count, single-island ones, lag in versions (mean, max), least momentum
    share (1.0 where the log predates the field), and the islands whose round was resized."""

    merges: int = 0
    single: int = 0
    lag_mean: float = 0.0
    lag_max: int = 0
    momentum_min: float = 1.0
    resized: int = 0

    def cell(self) -> str:
        """One table cell: 'lag 1.8/6, 41/59 alone, momentum >= 0.25' (mean/max lag in
        versions, merges of one island, the least momentum share; ', H_i resized: 2' when
        islands' rounds were resized)."""
        if not self.merges:
            return "n/a"
        text = (
            f"lag {self.lag_mean:.1f}/{self.lag_max}, {self.single}/{self.merges} alone, "
            f"momentum >= {self.momentum_min:.2f}"
        )
        return text + (f", H_i resized: {self.resized}" if self.resized else "")


def merge_staleness(state_dir: Path, learner_logs: list[Path] | None = None) -> MergeStaleness:
    """Read `state_dir`/merges.jsonl (rotated files are not read: a benchmark's run is short)."""
    path = state_dir / MERGE_LOG
    if not path.exists():
        return MergeStaleness()
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lags = [int(c.get("lag", 0)) for r in records for c in r.get("contributors", [])]
    resized = sum(
        1
        for log in learner_logs or []
        if log.exists() and RESIZED in log.read_text(errors="replace")
    )
    return MergeStaleness(
        merges=len(records),
        single=sum(1 for r in records if len(r.get("contributors", [])) == 1),
        lag_mean=statistics.mean(lags) if lags else 0.0,
        lag_max=max(lags, default=0),
        momentum_min=min((float(r.get("momentum", 1.0)) for r in records), default=1.0),
        resized=resized,
    )
