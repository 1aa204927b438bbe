"""Where a K < M run's link traffic goes: `python -m bench.studies.pull_chains RUN_DIR ...`
(issue 45).

Reads runs of bench/busy_link (each `--workdir`'s `seed*-k*-L*` folders, or such folders named
directly) and prints, per run, what makes the link carry more than a round of pushes and one
pull each: the syncer's merges (`syncer/merges.jsonl`), those of one island alone and the mean
contributors a merge; the learners' pulls of a merge ("applied version" lines): the versions each
carried (its version less the fragment's previous one at that learner: a chain of updates, or a
full fragment past the history) and their bytes; and the relay's bytes each way
(`relay-stats.json`, joins included). At K = M every merge holds every island and a pull carries
one version; at K = 1 over a link slower than the traffic, merges alone made each pull carry a
chain of 2-4 (bench/log/2026-11-30.md, "... pushes on their way (inflight18)"). Nothing here is
timed: it only reads files.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_APPLIED = re.compile(r"fragment (\d+) applied version (\d+) \(merged.*?\((\d+) bytes\)")


@dataclass
class Traffic:
    """One run's merges, pulls and link bytes."""

    name: str
    merges: int = 0
    alone: int = 0
    contributors: list[int] = field(default_factory=list)
    chains: list[int] = field(default_factory=list)  # versions a pull carried (after the first)
    pulled: int = 0  # bytes of the learners' pulls of merges
    up: int = 0  # the relay's bytes, learners to syncer
    down: int = 0  # ... and back

    def row(self) -> str:
        contrib = statistics.mean(self.contributors) if self.contributors else 0.0
        chain = statistics.mean(self.chains) if self.chains else 0.0
        long = sum(c >= 2 for c in self.chains)
        return (
            f"{self.name}: merges {self.merges}, alone {self.alone}, contributors a merge "
            f"{contrib:.2f}; versions a pull {chain:.2f} ({long} of {len(self.chains)} >= 2), "
            f"pulled {self.pulled / 1e6:.2f} MB; link up {self.up / 1e6:.2f} MB, down "
            f"{self.down / 1e6:.2f} MB"
        )


def read_run(path: Path) -> Traffic:
    """One run folder's figures (the module docstring)."""
    out = Traffic(path.name)
    for line in (path / "syncer" / "merges.jsonl").read_text().splitlines():
        if line.strip():
            merge = json.loads(line)
            out.merges += 1
            out.contributors.append(len(merge["contributors"]))
            out.alone += len(merge["contributors"]) == 1
    for log in sorted(path.glob("island-*.log")):
        last: dict[int, int] = {}
        for line in log.read_text(errors="replace").splitlines():
            if m := _APPLIED.search(line):
                fragment, version = int(m.group(1)), int(m.group(2))
                if fragment in last:
                    out.chains.append(version - last[fragment])
                last[fragment] = version
                out.pulled += int(m.group(3))
    stats = path / "relay-stats.json"
    if stats.exists():
        doc = json.loads(stats.read_text())
        out.up, out.down = int(doc["up"]), int(doc["down"])
    return out


def run_folders(paths: Sequence[str]) -> list[Path]:
    """The run folders named, or those under the workdirs named."""
    found = []
    for name in paths:
        path = Path(name)
        runs = [path] if (path / "syncer").is_dir() else sorted(path.glob("seed*-k*-L*"))
        found += [r for r in runs if (r / "syncer" / "merges.jsonl").exists()]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="busy_link workdirs or run folders")
    args = parser.parse_args(argv)
    for run in run_folders(args.runs):
        print(read_run(run).row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
