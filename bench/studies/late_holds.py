"""Where a K < M run's utilisation goes over a slow link: `python -m bench.studies.late_holds
--mbit MBIT --base L0_RUN RUN_DIR ...` (issue 45, kone100).

Reads runs of bench/busy_link (`seed*-k*-L*` folders) and prints, per run, the split of the
learners' progress windows (training / sync path / waiting, as busy_link's utilisation), the late
holds (sync.lateMergeHold: how many, their seconds and share of the windows, at which bound) and
the learners' link judgements (`OverlapFit.judge_link`'s log line: how often the link was judged
slower than its traffic), and the offered share of the link: the traffic of the same seed's
unlimited run (`--base`: its relay bytes, the same steps with every merge of one version) over the
link's rate (`--mbit`), over this run's own compute (its islands' training seconds / M). That
offered L is what the nominal L of a pinned link becomes on this host at this load: the link can
carry at most 1 / L of the traffic a round's compute makes, so no rule keeps the accelerators
busier than about that without fewer bytes. Nothing here is timed: it only reads files.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.busy_link import Split, window_split

_HELD = re.compile(r"the bound, (ceil\(H/2\)|H - 1) = \d+ of \d+.*?; held ([\d.]+)s for its merge")
_PUSHED = re.compile(r"step (\d+): fragment \d+ pushed \(base version \d+, (\d+) bytes")
_PULLED = re.compile(r"step (\d+): fragment \d+ applied version \d+ \(merged.*?\((\d+) bytes\)")
_JUDGED = re.compile(
    r"sync\(s\) of ([\d.]+)s x (\d+) fragment\(s\) (outlast|fit in) a round of (\d+) steps of "
    r"([\d.]+)s: a merge late by"
)


@dataclass
class Holds:
    """One run's windows, late holds and link judgements, over every island."""

    name: str
    split: Split
    islands: int
    holds_half: int  # holds at B = ceil(H/2) (the link judged slower than its traffic)
    holds_last: int  # holds at B = H - 1
    held_seconds: float
    judged_slow: int  # judgements that flipped to "slower than its traffic"
    judged_fits: int  # ... and back
    ratios: list[float]  # F x the mean sync latency / the round, at each judgement logged
    relay_bytes: int
    sync_bytes: int  # the islands' pushes and pulled merges (their log lines), joins left out
    steps: int  # the islands' last steps, summed

    @property
    def bytes_a_step(self) -> float:
        """Sync bytes per inner step, every island's together (pushes and pulled merges)."""
        return self.sync_bytes / self.steps if self.steps else float("nan")

    def offered(self, base_bytes_a_step: float, mbit: float) -> float:
        """The unlimited run's sync bytes a step x this run's steps in its windows / the link's
        rate / this run's compute per island (its windows' training seconds / M)."""
        compute = self.split.training / max(1, self.islands)
        traffic = base_bytes_a_step * self.split.steps
        return traffic / (mbit * 1e6 / 8) / compute if compute > 0 else float("nan")

    def row(self, base_bytes: float | None, mbit: float | None) -> str:
        s = self.split
        wall = s.wall or float("nan")
        judged = ""
        if self.ratios:
            judged = f" (F x sync latency / round {min(self.ratios):.2f}-{max(self.ratios):.2f})"
        offered = ""
        if base_bytes and mbit:
            share = self.offered(base_bytes, mbit)
            offered = f"; offered L {share:.0%} (1/L {1 / share:.3f})"
        return (
            f"{self.name}: utilisation {s.utilisation:.3f}, sync path {s.sync_path / wall:.1%}, "
            f"waiting {s.waiting / wall:.1%}; holds {self.holds_half} at ceil(H/2) + "
            f"{self.holds_last} at H - 1, {self.held_seconds:.1f}s ({self.held_seconds / wall:.1%} "
            f"of the windows, every island's own hold counted); link judged slower "
            f"{self.judged_slow}x, back to fits {self.judged_fits}x{judged}; relay "
            f"{self.relay_bytes / 1e6:.2f} MB{offered}"
        )


def read_run(path: Path) -> Holds:
    """One run folder's figures (the module docstring)."""
    split, half, last, held, slow, fits, islands = Split(), 0, 0, 0.0, 0, 0, 0
    sync_bytes, steps, ratios = 0, 0, []
    for log in sorted(path.glob("island-*.log")):
        text = log.read_text(errors="replace")
        islands += 1
        moved = [*_PUSHED.findall(text), *_PULLED.findall(text)]
        sync_bytes += sum(int(b) for _, b in moved)
        steps += max((int(st) for st, _ in moved), default=0)
        split = split + window_split(text)
        for m in _HELD.finditer(text):
            half += m.group(1) == "ceil(H/2)"
            last += m.group(1) == "H - 1"
            held += float(m.group(2))
        for m in _JUDGED.finditer(text):
            slow += m.group(3) == "outlast"
            fits += m.group(3) == "fit in"
            ratios.append(
                float(m.group(1)) * int(m.group(2)) / (int(m.group(4)) * float(m.group(5)))
            )
    stats = path / "relay-stats.json"
    relay = 0
    if stats.exists():
        doc = json.loads(stats.read_text())
        relay = int(doc["up"]) + int(doc["down"])
    return Holds(
        path.name, split, islands, half, last, held, slow, fits, ratios, relay, sync_bytes, steps
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="busy_link run folders")
    parser.add_argument("--mbit", type=float, help="the link's rate (Mbit/s) of the runs named")
    parser.add_argument("--base", help="the same seed's unlimited run folder (offered L)")
    args = parser.parse_args(argv)
    base = read_run(Path(args.base)).bytes_a_step if args.base else None
    for run in args.runs:
        print(read_run(Path(run)).row(base, args.mbit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
