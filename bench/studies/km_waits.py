"""K = M's waits, part by part: `python -m bench.studies.km_waits RUN_DIR ...` (issue 45).

Reads runs of bench/busy_link (each `--workdir`'s `seed*-k*-L*` folders, or such folders named
directly): the syncer's merge records (`syncer/merges.jsonl`: each push's arrival, the merge's
record time) and the learners' logs (each wait for a merge, each receipt's pull path:
`learner/syncer_link.PullPath` on the "applied version" line). Every blocking wait of a learner
is split, by the merge it waited for, at the moments that merge passed on its way:

1. peer: until its last push arrived at the syncer (the slowest peer; 0 when it was in first);
2. fold: until the syncer took the round to merge (the last push's checks and fold, the
   scheduler's wake: the merge record's `time`);
3. merge: until the merge was pullable (its `time` + `mergeSeconds`);
4. answer: until the learner's long-poll was answered (PullPath.answered_at: the syncer's wake
   and its body ready, less the request's one-way trip);
5. pull: the answer's transfer through the link and its decoding;
6. apply: the chain added into the held weights, the receipt made ready and the trim;
7. hand-over: from the result ready on the link's thread to the training thread's wait ending.

Island-seconds, summed over the run (the first merge of each fragment left out: start-up). Per
merge as well, whether waited for or not: the seconds from the merge's record to the pull's
answer, the pull, and the spread of the four islands' pulls of one merge (do they share the
link: each pull takes as long as all of them?). Nothing here is timed: it only reads logs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.harness.merge_waits import pushes_in

PARTS = ("peer", "fold", "merge", "answer", "pull", "apply", "hand-over")

_WAITED = re.compile(r"^(\S+ \S+) .*step \d+: waited ([\d.]+)s for fragment (\d+)")
_APPLIED = re.compile(
    r"^(\S+ \S+) .*step \d+: fragment (\d+) applied version (\d+) \(merged, .*pull ([\d.]+)s"
    r"(?: \((\d+) bytes\))?, rebuild ([\d.]+)s, receipt ready ([\d.]+)s"
    r"(?:, trim ([\d.]+)s)?, ready at ([\d.]+)\)"
)


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass(frozen=True)
class Receipt:
    """One merge as a learner received it (its "applied version" line)."""

    fragment: int
    version: int
    pull: float
    pull_bytes: int
    apply: float  # rebuild + receipt ready + trim
    ready_at: float
    logged_at: float

    @property
    def answered_at(self) -> float:
        return self.ready_at - self.apply - self.pull


@dataclass(frozen=True)
class Wait:
    fragment: int
    seconds: float
    ended_at: float
    version: int  # the merge it waited for (the receipt that followed it)


def receipts_and_waits(text: str) -> tuple[dict[tuple[int, int], Receipt], list[Wait]]:
    """A learner log's receipts by (fragment, version) and its waits, each tied to the receipt
    of the same fragment that came after it (waits with none are left out)."""
    receipts: dict[tuple[int, int], Receipt] = {}
    pending: list[tuple[int, float, float]] = []
    waits: list[Wait] = []
    for line in text.splitlines():
        if m := _WAITED.match(line):
            pending.append((int(m[3]), float(m[2]), _stamp(m[1])))
            continue
        if m := _APPLIED.match(line):
            f, v = int(m[2]), int(m[3])
            apply = float(m[6]) + float(m[7]) + float(m[8] or 0.0)
            receipts[(f, v)] = Receipt(
                f, v, float(m[4]), int(m[5] or 0), apply, float(m[9]), _stamp(m[1])
            )
            for w in [w for w in pending if w[0] == f]:
                waits.append(Wait(f, w[1], w[2], v))
                pending.remove(w)
    return receipts, waits


def split_wait(start: float, end: float, marks: Sequence[float]) -> list[float]:
    """[start, end] cut at `marks` (each clipped into the interval, and to no earlier than the
    mark before it: two clocks' stamps a few ms apart may cross): the seconds before the first
    mark, between each two, and after the last (len(marks) + 1 parts, summing to end - start)."""
    clipped: list[float] = []
    for m in marks:
        clipped.append(min(max(m, start, *clipped[-1:]), end))
    edges = [start, *clipped, end]
    return [b - a for a, b in itertools.pairwise(edges)]


@dataclass
class RunSplit:
    """One run's waits by part (island-seconds) and its merges' paths."""

    waits: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    first: float = 0.0  # island-seconds waited for each fragment's first merge (left out above)
    # Of `first`, the part before the merge's last push arrived: the slowest peer, at the first
    # merge its start-up offset, which no τ fitted to the link covers (issue 45, first45).
    first_peer: float = 0.0
    answer_after_merge: list[float] = field(default_factory=list)
    pulls: list[float] = field(default_factory=list)
    pull_bytes: list[int] = field(default_factory=list)
    applies: list[float] = field(default_factory=list)
    pull_spans: list[float] = field(default_factory=list)  # first answer to last pull's end
    # Each receipt's result ready on the link less its merge's last push at the syncer: what
    # an island that waits for the slowest peer waits after that peer's push came.
    after_last_push: list[float] = field(default_factory=list)

    @property
    def waited(self) -> float:
        return sum(self.waits.values())


def split_run(
    merges: Mapping[tuple[int, int], Mapping[str, object]],
    logs: Iterable[str],
) -> RunSplit:
    """RunSplit of one run: `merges` by (fragment, version) (merges.jsonl records), `logs` the
    learners' log texts."""
    out = RunSplit()
    firsts = {f: min(v for g, v in merges if g == f) for f, _ in merges}
    by_merge: dict[tuple[int, int], list[Receipt]] = {}
    for text in logs:
        receipts, waits = receipts_and_waits(text)
        for key, r in receipts.items():
            by_merge.setdefault(key, []).append(r)
        for w in waits:
            rec, got = merges.get((w.fragment, w.version)), receipts.get((w.fragment, w.version))
            if rec is None or got is None:
                continue
            last_push = max(float(c["receivedAt"]) for c in rec["contributors"])  # type: ignore[attr-defined]
            if w.version <= firsts[w.fragment]:
                out.first += w.seconds
                out.first_peer += split_wait(w.ended_at - w.seconds, w.ended_at, [last_push])[0]
                continue
            marks = [
                last_push,
                float(rec["time"]),  # type: ignore[arg-type]
                pullable(rec),
                got.answered_at,
                got.answered_at + got.pull,
                got.ready_at,
            ]
            parts = split_wait(w.ended_at - w.seconds, w.ended_at, marks)
            for part, s in zip(PARTS, parts, strict=True):
                out.waits[part] += s
    for key, rs in by_merge.items():
        rec = merges.get(key)
        if rec is None or key[1] <= firsts[key[0]]:
            continue
        last_push = max(float(c["receivedAt"]) for c in rec["contributors"])  # type: ignore[attr-defined]
        for r in rs:
            out.after_last_push.append(r.ready_at - last_push)
            out.answer_after_merge.append(r.answered_at - pullable(rec))
            out.pulls.append(r.pull)
            out.pull_bytes.append(r.pull_bytes)
            out.applies.append(r.apply)
        if len(rs) > 1:
            last = max(r.answered_at + r.pull for r in rs)
            out.pull_spans.append(last - min(r.answered_at for r in rs))
    return out


def windows_wall(folder: Path) -> float:
    """The wall seconds of every island's progress windows as bench/busy_link reads them (its
    utilisation's denominator: the first window left out)."""
    total = 0.0
    for log in folder.glob("island-*.log"):
        for m in list(_WINDOW.finditer(log.read_text(errors="replace")))[1:]:
            total += float(m[2]) + float(m[3]) + float(m[4])
    return total or float("nan")


def pullable(rec: Mapping[str, object]) -> float:
    """When a merge's new version was pullable: its record's time is when the round was taken
    (merger.take), and its mergeSeconds run from there to pullable."""
    return float(rec["time"]) + float(rec.get("mergeSeconds", 0.0))  # type: ignore[arg-type]


def read_run(folder: Path) -> RunSplit:
    merges: dict[tuple[int, int], dict[str, object]] = {}
    for line in (folder / "syncer" / "merges.jsonl").read_text().splitlines():
        rec = json.loads(line)
        merges[(int(rec["fragment"]), int(rec["version"]))] = rec
    logs = [p.read_text(errors="replace") for p in sorted(folder.glob("island-*.log"))]
    return split_run(merges, logs)


def _runs(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if (p / "syncer" / "merges.jsonl").exists():
            out.append(p)
        else:
            out.extend(sorted(q for q in p.glob("seed*-k*-L*") if (q / "syncer").is_dir()))
    return out


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    low, mid, high = (x * 1e3 for x in (min(values), statistics.median(values), max(values)))
    return f"{mid:.0f} ({low:.0f}-{high:.0f})"


def table(paths: Sequence[Path]) -> str:
    """Markdown: per run, its waits by part and its merges' paths."""
    head = (
        "| run | first merges' waits (island-s, % of windows; of them the slowest peer) | "
        "later waits | "
        + " | ".join(PARTS)
        + " | pullable -> answer ms | pull ms (bytes) | apply ms | 4 pulls' span ms "
        + "| last push -> ready ms |"
    )
    rows = [head, "|" + "---|" * (len(PARTS) + 8)]
    for folder in _runs(paths):
        s = read_run(folder)
        w = s.waited or float("nan")
        wall = windows_wall(folder)
        parts = " | ".join(f"{s.waits[p]:.2f} ({s.waits[p] / w:.0%})" for p in PARTS)
        size = statistics.median(s.pull_bytes) if s.pull_bytes else 0
        rows.append(
            f"| {folder.parent.name}/{folder.name} | {s.first:.2f} ({s.first / wall:.1%}; "
            f"peer {s.first_peer / (s.first or float('nan')):.0%}) | "
            f"{s.waited:.2f} ({s.waited / wall:.1%}) | {parts} | "
            f"{_ms(s.answer_after_merge)} | {_ms(s.pulls)} ({size:.0f}) | {_ms(s.applies)} | "
            f"{_ms(s.pull_spans)} | {_ms(s.after_last_push)} |"
        )
    return "\n".join(rows)


_WINDOW = re.compile(
    r"(\d+) steps: ([\d.]+)s training, ([\d.]+)s sync path, ([\d.]+)s waiting for the syncer"
)
_STEP_TIME = re.compile(r"(\d+) steps: ([\d.]+)s training")


@dataclass(frozen=True)
class Drift:
    """The slowest peer's drift at K = M in one run (task: is it step-time noise, a start-up
    offset that never closes, or round sizing?). Spreads: the last push of a merge less the
    first, seconds."""

    first_spread: float  # the first merge's (the islands' start-up offset)
    spreads: list[float]  # every later merge's
    last_shares: dict[str, float]  # island -> share of the later merges it pushed last
    step_times: dict[str, float]  # island -> its median training seconds a step (its windows)
    steps_between: float  # the median steps between an island's two pushes

    @property
    def speed_spread(self) -> float:
        """What steady speed differences alone would put between two pushes: the slowest
        island's median step time less the fastest's, times the steps between pushes."""
        times = list(self.step_times.values())
        return (max(times) - min(times)) * self.steps_between if times else math.nan


def drift(pushes: Mapping[str, Mapping[tuple[int, int], float]], logs: Mapping[str, str]) -> Drift:
    """Drift of one run from its islands' pushes ((fragment, base version) -> time,
    merge_waits.pushes_in) and log texts."""
    names = list(pushes)
    keys = set.intersection(*(set(p) for p in pushes.values())) if names else set()
    merges = sorted(
        (sorted((pushes[n][k], n) for n in names) for k in keys), key=lambda ts: ts[-1][0]
    )
    spreads = [ts[-1][0] - ts[0][0] for ts in merges]
    later = merges[1:]
    last = dict.fromkeys(names, 0.0)
    for ts in later:
        last[ts[-1][1]] += 1 / len(later)
    step_times = {}
    for name, text in logs.items():
        per = [float(m[2]) / int(m[1]) for m in _STEP_TIME.finditer(text)][1:]
        if per:
            step_times[name] = statistics.median(per)
    gaps = []
    for p in pushes.values():
        times = sorted(p.values())
        gaps += [b - a for a, b in itertools.pairwise(times)]
    per_step = statistics.median(step_times.values()) if step_times else math.nan
    between = statistics.median(gaps) / per_step if gaps and per_step > 0 else math.nan
    return Drift(spreads[0] if spreads else math.nan, spreads[1:], last, step_times, between)


def drift_table(paths: Sequence[Path]) -> str:
    """Markdown: per run, the drift's size and its candidates' sizes."""
    rows = [
        "| run | first merge's spread s | later spreads s, median (max) | last pusher: most "
        "often (share) | step time ms by island | steady speed gap x steps between pushes s |",
        "|---|---|---|---|---|---|",
    ]
    for folder in _runs(paths):
        logs: dict[str, str] = {}
        for log in sorted(folder.glob("island-*.log")):
            logs[log.name.split(".")[0]] = log.read_text(errors="replace")
        d = drift({n: pushes_in(t) for n, t in logs.items()}, logs)
        who, share = max(d.last_shares.items(), key=lambda kv: kv[1])
        times = ", ".join(f"{t * 1e3:.0f}" for t in d.step_times.values())
        later = f"{statistics.median(d.spreads):.3f} ({max(d.spreads):.3f})" if d.spreads else "-"
        rows.append(
            f"| {folder.parent.name}/{folder.name} | {d.first_spread:.3f} | {later} | {who} "
            f"({share:.0%}) | {times} | {d.speed_spread:.3f} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="busy_link workdirs or run folders")
    p.add_argument("--drift", action="store_true", help="the slowest peer's drift instead")
    args = p.parse_args(argv)
    print(drift_table(args.runs) if args.drift else table(args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
