"""What the chaos suite measures, read from a syncer's merge log (merges.jsonl, one merge record
a line: version, fragment, time, tokens, contributors) and its evaluation history: pure
functions, each with a unit test (tests/unit/test_chaos_measure.py).

- A merge is lost when the log holds a later merge of the same fragment and version: the syncer
  restarted from a checkpoint older than it and merged that version again.
- An island contributes again at the first merge after a time that holds its push; every island
  does at the first merge that holds all of theirs.
- The eval loss at a token count is read off the history by linear interpolation (two runs whose
  merges carried different tokens are compared at equal tokens).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def read_merges(path: Path) -> list[Record]:
    """merges.jsonl's records in file order (a half-written last line is left out)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def lost_merges(records: Sequence[Record], start: float, end: float) -> list[Record]:
    """Merges logged in [start, end) that a later merge of the same fragment and version
    replaced (rolled back by a restart from an older checkpoint)."""
    lost = []
    for i, rec in enumerate(records):
        if not start <= rec["time"] < end:
            continue
        key = (rec["fragment"], rec["version"])
        if any((r["fragment"], r["version"]) == key for r in records[i + 1 :]):
            lost.append(rec)
    return lost


def all_contribute_at(records: Iterable[Record], after: float, islands: set[str]) -> float | None:
    """The time of the first merge after `after` that holds a push of every island in
    `islands`, or None while there is none."""
    for rec in sorted(records, key=lambda r: r["time"]):
        contributors = {c["island"] for c in rec.get("contributors", [])}
        if rec["time"] > after and islands <= contributors:
            return float(rec["time"])
    return None


def loss_at_tokens(history: Sequence[tuple[int, float]], tokens: int) -> float:
    """The eval loss at `tokens`, interpolated linearly between the history's points (sorted by
    tokens); ValueError outside the history's range (no extrapolation)."""
    points = sorted(history)
    if not points or not points[0][0] <= tokens <= points[-1][0]:
        span = f"{points[0][0]}..{points[-1][0]}" if points else "nothing"
        raise ValueError(f"{tokens} tokens are outside the history ({span})")
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[-1][1]  # tokens equals the last point's


def losses_at_equal_tokens(
    chaos: Sequence[tuple[int, float]], calm: Sequence[tuple[int, float]], step: int
) -> list[tuple[int, float, float]]:
    """(tokens, chaos loss, calm loss) every `step` merged tokens where both histories reach,
    and at the chaos run's last evaluation: where along the run a gap opened and whether it
    closed (a gap at the end alone does not say which fault, or which rate, made it)."""
    if step <= 0:
        raise ValueError(f"step must be > 0, got {step}")
    if not chaos or not calm:
        return []
    top = min(max(t for t, _ in chaos), max(t for t, _ in calm))
    marks = list(range(step, top + 1, step))
    last = sorted(chaos)[-1][0]
    if last <= top and last not in marks:
        marks.append(last)
    return [(t, loss_at_tokens(chaos, t), loss_at_tokens(calm, t)) for t in marks]


def refusal_delta(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], *, restarted: bool
) -> dict[str, int]:
    """Refused pushes by reason between two status documents' `refusals` (counted since the
    syncer started: after a restart the later counts are all new)."""
    out: dict[str, int] = {}
    for island, reasons in after.items():
        for reason, count in reasons.items():
            old = 0 if restarted else before.get(island, {}).get(reason, 0)
            if count > old:
                out[reason] = out.get(reason, 0) + count - old
    return out
