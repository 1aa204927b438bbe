"""K = 1 over a link slower than its traffic: the steps a learner keeps past its push (issue 45).

Two parts, both offline (no training):

1. Read bench/busy_link's run folders (`--workdir`: one folder per run, `seed0-k1-L160` and so
   on, each with the learners' logs and the syncer's merges.jsonl and log) and give per run what
   the merges and the learners saw: merges (complete ones, ones of a lone island, the first
   partial one), the pushes' lag in versions, the syncer's staleness discount and momentum share,
   the inner steps a push carried, the steps a learner trained between a push and the arrival of
   its merge (its *kept* steps: `sync.lateMergeRule keep` installs θ_global + (θ_now − θ_push),
   so those steps, trained from the weights before the merge, go into the next push), the pull's
   chain of versions (its bytes over a one-version pull of that fragment), the holds at the step
   cap, the holds for a merge late by ceil(H/2) steps (sync.lateMergeHold) and the syncer's eval
   loss by outer step.
2. A linear model of the outer loop (as bench/studies/stale_momentum: one direction of curvature,
   error e = θ − θ*, a round's inner steps covering a share a of it) with every island in every
   merge (lag 0, momentum share 1: what the syncer sees as fresh) but a share k of each round's
   inner steps trained before the island installed its base, i.e. from the previous round's
   weights: Δ_t = a·(k·e_{t−1} + (1 − k)·e_t) to first order. A round: m ← β·m + s·Δ,
   e ← e − lr·(Δ + β·m) (Nesterov, core/outer.py), s the share of Δ that enters the momentum. The
   table gives the spectral radius of that map (> 1: the global model's error grows), the worst
   over a in 0.1..1, by k, for s = 1 (what a fresh push gets) and s = (1 + k)^-2 (the momentum
   share, were the kept steps counted as lag).

    python -m bench.studies.kept_steps --runs RUN_DIR/seed0-k1-L0 RUN_DIR/seed0-k1-L160 --no-record
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish

SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # a: what a round's inner steps cover of e
KEPT = (0.0, 0.17, 0.3, 0.5, 0.63, 0.7, 1.0)  # k: the share of a round trained before its base

_PUSH = re.compile(r"step (\d+): fragment (\d+) pushed \(base version (\d+), .* in (\d+) steps")
_APPLY = re.compile(r"step (\d+): fragment (\d+) applied version (\d+) .*\((\d+) bytes\)")
_HELD = re.compile(r"held ([\d.]+)s for the syncer")
# A K < M learner's hold for a merge late by ceil(H/2) steps (sync.lateMergeHold auto).
_LATE = re.compile(r"held ([\d.]+)s for its merge|not merged within [\d.]+s of a hold")
_EVAL = re.compile(r"eval at outer step (\d+) \((\d+) tokens\): loss ([\d.]+)")


def kept_radius(lr: float, beta: float, a: float, k: float, share: float) -> float:
    """The spectral radius of a round's map of (e_t, e_{t−1}, m) (the module docstring)."""
    delta = np.array([a * (1.0 - k), a * k, 0.0])  # Δ as a row over (e_t, e_{t−1}, m)
    m_new = beta * np.array([0.0, 0.0, 1.0]) + share * delta
    e_new = np.array([1.0, 0.0, 0.0]) - lr * (delta + beta * m_new)
    step = np.array([e_new, [1.0, 0.0, 0.0], m_new])
    return float(max(abs(np.linalg.eigvals(step))))


def worst_radius(lr: float, beta: float, k: float, share: float) -> float:
    """kept_radius's worst over SHARES."""
    return max(kept_radius(lr, beta, a, k, share) for a in SHARES)


@dataclass
class RunFigures:
    """What one busy_link run folder says (part 1 of the module docstring)."""

    name: str
    inner_steps: int = 30  # H, for k = kept / H
    merges: int = 0
    complete: int = 0  # after the first two (each fragment's first, every island in it)
    alone: int = 0  # of those, merges of one island's push
    later: int = 0  # merges after the first two
    first_partial: int | None = None  # index of the first merge that is not complete
    lags: list[int] = field(default_factory=list)  # versions behind, every push merged
    discounts: list[float] = field(default_factory=list)
    momentum: list[float] = field(default_factory=list)  # per merge
    push_steps: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # steps from a push to its merge's arrival
    chains: list[float] = field(default_factory=list)  # pull bytes / one version's
    holds: int = 0
    held_s: float = 0.0
    late_holds: int = 0  # holds for a late merge (sync.lateMergeHold), budget-ended ones too
    late_held_s: float = 0.0
    evals: list[tuple[int, int, float]] = field(default_factory=list)  # (outer step, tokens, loss)

    def row(self) -> list[str]:
        """The run's row of the table."""
        mean = statistics.fmean
        return [
            self.name,
            f"{self.merges} ({self.complete}/{self.later} complete, {self.alone} alone)",
            "-" if self.first_partial is None else str(self.first_partial),
            f"{mean(self.lags):.2f}/{max(self.lags)}" if self.lags else "-",
            f"{mean(self.discounts):.3f}" if self.discounts else "-",
            f"{mean(self.momentum):.2f}/{min(self.momentum):.2f}" if self.momentum else "-",
            f"{mean(self.push_steps):.1f}/{max(self.push_steps)}" if self.push_steps else "-",
            f"{mean(self.kept):.1f}/{max(self.kept)} ({mean(self.kept) / self.inner_steps:.2f})"
            if self.kept
            else "-",
            f"{mean(self.chains):.2f}/{max(self.chains):.2f}" if self.chains else "-",
            f"{self.holds}, {self.held_s:.1f} s",
            f"{self.late_holds}, {self.late_held_s:.1f} s",
            " ".join(f"{loss:.2f}" for _, _, loss in self.evals),
        ]


def read_run(path: Path, inner_steps: int = 30) -> RunFigures:
    """Read one run folder (the module docstring, part 1). `inner_steps`: H, for k."""
    out = RunFigures(path.name, inner_steps)
    merges = [json.loads(line) for line in (path / "syncer" / "merges.jsonl").open()]
    out.merges = len(merges)
    for i, m in enumerate(merges):
        if not m["complete"] and out.first_partial is None:
            out.first_partial = i
        if i < 2:  # each fragment's first merge: every island, fresh, by construction
            continue
        out.later += 1
        out.complete += bool(m["complete"])
        out.alone += len(m["contributors"]) == 1
        out.momentum.append(float(m["momentum"]))
        for c in m["contributors"]:
            out.lags.append(int(c["lag"]))
            out.discounts.append(float(c["discount"]))
    for line in (path / "syncer.log").open():
        if e := _EVAL.search(line):
            out.evals.append((int(e.group(1)), int(e.group(2)), float(e.group(3))))
    for log in sorted(path.glob("island-*.log")):
        pushed: dict[int, int] = {}
        one_version: dict[int, int] = {}  # a fragment's first pull after its join: one version
        for line in log.open():
            if p := _PUSH.search(line):
                pushed[int(p.group(2))] = int(p.group(1))
                out.push_steps.append(int(p.group(4)))
            elif a := _APPLY.search(line):
                step, frag, size = int(a.group(1)), int(a.group(2)), int(a.group(4))
                if frag in pushed:
                    out.kept.append(step - pushed[frag])
                base = one_version.setdefault(frag, size)
                out.chains.append(size / base)
            elif h := _HELD.search(line):
                out.holds += 1
                out.held_s += float(h.group(1))
            elif late := _LATE.search(line):
                out.late_holds += 1
                out.late_held_s += float(late.group(1) or 0.0)
    return out


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(__doc__ or "")
    p.add_argument("--runs", nargs="*", default=[], type=Path, help="busy_link run folders")
    p.add_argument("--lr", type=float, default=0.7, help="outer.lr")
    p.add_argument("--momentum", type=float, default=0.9, help="outer.momentum (Nesterov)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tables = []
    with LoadMonitor() as load:
        if args.runs:
            runs = Table(
                "busy_link runs: merges, staleness, pushes, kept steps, pulls, holds, eval loss",
                [
                    "run",
                    "merges",
                    "first partial",
                    "lag mean/max (versions)",
                    "discount mean",
                    "momentum share mean/min",
                    "steps a push mean/max",
                    "kept steps mean/max (k)",
                    "pull chain mean/max",
                    "holds",
                    "late-merge holds",
                    "eval loss by outer step",
                ],
            )
            for path in args.runs:
                runs.add(*read_run(path).row())
            tables.append(runs)
        model = Table(
            f"Spectral radius of a round of the outer loop (lr {args.lr}, Nesterov β "
            f"{args.momentum}), every island in every merge, a share k of a round's inner steps "
            f"trained before its base, worst over a in {SHARES[0]}..{SHARES[-1]}",
            ["k", "share 1 (fresh: today)", "share (1 + k)^-2"],
        )
        for k in KEPT:
            model.add(
                f"{k:.2f}",
                f"{worst_radius(args.lr, args.momentum, k, 1.0):.3f}",
                f"{worst_radius(args.lr, args.momentum, k, (1.0 + k) ** -2):.3f}",
            )
        tables.append(model)
    report = Report(
        "kept_steps",
        "K = 1 over a busy link: what the merges and learners saw, and a linear model of the "
        "outer loop fed by steps trained before their base (issue 45).",
        tables=tables,
        notes=[
            "k = kept steps / H (30, busy_link's); a: a round's inner steps' share of the error."
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
