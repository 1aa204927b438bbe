"""The quality guard's signal in bench/adversary.py's runs (issue 46): could a threshold on the
eval loss over the best so far stop one bad island of two before it degrades the model, and leave
every honest run alone?

Reads a `python -m bench.adversary --workdir DIR` directory (its outcomes.jsonl, and each run's
syncer log and merge log) and replays syncer.qualityGuard's rule (syncer/state/quality.py:
`judged`, `tripped`; the best's checkpoint rule, `best_due`) on
every run's evaluations, one after every outer step:

- the largest margin at which the guard trips on the run at a patience and warm-up (it trips at
  every margin below it: the rule's comparison is strict), `trip_margin`;
- for a setting (margin / patience / warm-up), where it trips and which model the job keeps
  (the best checkpoint before the trip), `replay`;
- the run's eval loss over the baseline's (the 'none' run of the same seed) at equal honest
  tokens, at every evaluation: the honest island's tokens up to that outer step are read from
  the merge log (its contributions' tokens), so a kept model is compared at the tokens it
  holds, not at the tokens the job merged before it ended (bench/adversary.py's ratio).

    python -m bench.studies.guard_signal --workdir DIR [--workdir DIR2 ...] --islands 2
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.syncer.state.quality import Kept, best_due, judged, tripped

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish
from bench.harness.decoupled_quality_report import interp

# The syncer's evaluation lines (syncer/service/jobs.py): "eval at outer step 6 (56320 tokens):
# loss 3.2559" and the final one's "final eval at ...".
EVAL_LINE = re.compile(r"eval at outer step (\d+) \((\d+) tokens\): loss ([0-9.]+)")
INITIAL_LINE = re.compile(r"initial eval loss ([0-9.]+)")
# bench/adversary.py's checkpoint cadence (syncer.checkpoint.everyOuterSteps).
CHECKPOINT_EVERY = 5
# margin/patience/warmupOuterSteps: the defaults, and the first defaults (bench/log/2026-11-29.md,
# "quality guard: honest swings of tiny jobs").
DEFAULT_SETTINGS = ("0.25/5/20", "0.05/3/0")
# The honest-only runs of bench/adversary.py (every other variant attacks).
HONEST_VARIANTS = ("none", "none_again")
# patience/warmupOuterSteps pairs whose largest tripping margin each run's row shows.
DEFAULT_WINDOWS = ("1/0", "3/0", "3/10", "5/0", "5/20")


@dataclass(frozen=True)
class Evaluation:
    step: int  # outer step
    honest: int  # the honest islands' tokens merged up to it
    loss: float


@dataclass(frozen=True)
class Setting:
    margin: float
    patience: int
    warmup: int

    @classmethod
    def parse(cls, text: str) -> Setting:
        margin, patience, warmup = text.split("/")
        return cls(float(margin), int(patience), int(warmup))

    def __str__(self) -> str:
        return f"{self.margin:g}/{self.patience}/{self.warmup}"


@dataclass(frozen=True)
class Replay:
    """Where the guard tripped (None: never) and the best checkpoint it kept then (None: the
    initial weights), as indices into the evaluations."""

    trip: int | None
    kept: int | None


def trip_margin(
    losses: Sequence[float], steps: Sequence[int], *, patience: int, warmup: int
) -> tuple[float, int | None]:
    """The largest margin at which the guard at `patience` and `warmup` trips on these
    evaluations (index 0 the initial weights'), and the index where it trips at just under it:
    the most, over windows of `patience` consecutive judged evaluations, of the window's least
    loss over the least loss before it, less 1. The guard trips at margin m exactly when m is
    below it (strict comparison); (-inf, None) when no window exists.

    >>> m, i = trip_margin([4.0, 2.0, 2.4, 2.2, 1.9], [0, 1, 2, 3, 4], patience=2, warmup=0)
    >>> round(m, 6), i  # the window (2.4, 2.2) over the best 2.0
    (0.1, 3)
    >>> m, i = trip_margin([4.0, 2.0, 2.4, 2.2, 1.9], [0, 1, 2, 3, 4], patience=2, warmup=2)
    >>> round(m, 6), i  # only (2.2, 1.9) is judged: 1.9 is below the best
    (-0.05, 4)
    """
    best, where = -math.inf, None
    for end in range(patience, len(losses)):
        start = end - patience + 1
        if not all(judged(steps[j], warmup) for j in range(start, end + 1)):
            continue
        rise = min(losses[start : end + 1]) / min(losses[:start]) - 1
        if rise > best:
            best, where = rise, end
    return best, where


def replay(losses: Sequence[float], steps: Sequence[int], setting: Setting) -> Replay:
    """syncer/service/jobs.py's _judge on these evaluations in order (index 0 the initial
    weights', never checkpointed): a new best is checkpointed when `best_due`, an evaluation
    after the warm-up that is no new best is judged with the ones since the best
    (state/quality.tripped). The first trip, and the best checkpoint before it.

    >>> replay([4.0, 2.0, 2.4, 2.2, 1.9], [0, 1, 2, 3, 4], Setting(0.05, 2, 0))
    Replay(trip=3, kept=1)
    >>> replay([4.0, 2.0, 2.4, 2.2, 1.9], [0, 1, 2, 3, 4], Setting(0.15, 2, 0))
    Replay(trip=None, kept=1)
    """
    best_loss, since_best = losses[0], list[float]()
    kept: int | None = None
    for i in range(1, len(losses)):
        loss, step = losses[i], steps[i]
        if loss < best_loss:
            best_loss, since_best = loss, []
            held = None if kept is None else Kept(steps[kept], losses[kept])
            due = best_due(step, loss, held, every=CHECKPOINT_EVERY, margin=setting.margin)
            if step > 0 and due:
                kept = i
            continue
        if not judged(step, setting.warmup):
            continue
        since_best = [*since_best, loss][-setting.patience :]
        if tripped([best_loss, *since_best], margin=setting.margin, patience=setting.patience):
            return Replay(trip=i, kept=kept)
    return Replay(trip=None, kept=kept)


def read_run(run_dir: Path, honest: Sequence[str] | None) -> list[Evaluation]:
    """A run's evaluations from its syncer log (a bench.adversary run's syncer.*.log, or a
    `diloco run` folder's logs/syncer.log), with the honest islands' tokens (None: every
    island's) merged up to each one's outer step (its merge log)."""
    steps_tokens: dict[int, int] = {}
    merges = run_dir / "syncer" / "merges.jsonl"
    total = 0
    for line in merges.read_text().splitlines():
        m = json.loads(line)
        total += sum(
            int(c["tokens"]) for c in m["contributors"] if honest is None or c["island"] in honest
        )
        steps_tokens[int(m["outerStep"])] = total
    out: list[Evaluation] = []
    logs = sorted(run_dir.glob("syncer.*.log")) or sorted(run_dir.glob("logs/syncer*.log"))
    for log in logs:
        for line in log.read_text().splitlines():
            if (init := INITIAL_LINE.search(line)) is not None and not out:
                out.append(Evaluation(0, 0, float(init.group(1))))
            elif (ev := EVAL_LINE.search(line)) is not None:
                step = int(ev.group(1))
                honest_tokens = max((t for s, t in steps_tokens.items() if s <= step), default=0)
                out.append(Evaluation(step, honest_tokens, float(ev.group(3))))
    return out


def fmt_rise(value: float, where: int | None, evals: Sequence[Evaluation]) -> str:
    if where is None:
        return "-"
    return f"{value * 100:+.1f}% (step {evals[where].step})"


def separation(
    honest: Sequence[tuple[float, str]], attacks: Sequence[tuple[float, str]]
) -> tuple[tuple[float, str], tuple[float, str], bool]:
    """Per window: the largest margin an honest run trips the guard at, the least an attack
    does, and whether a margin between them exists that trips every attack and no honest run
    (the attack's least above the honest largest).

    >>> separation([(0.02, "a"), (0.08, "b")], [(0.086, "c"), (0.13, "d")])
    ((0.08, 'b'), (0.086, 'c'), True)
    >>> separation([(0.209, "b")], [(0.086, "c")])[2]
    False
    """
    top, low = max(honest), min(attacks)
    return top, low, low[0] > top[0]


def study(
    roots: Sequence[Path],
    islands: int,
    settings: Sequence[Setting],
    honest_runs: Sequence[Path] = (),
    windows: Sequence[tuple[int, int]] = ((1, 0), (3, 0), (5, 0), (5, 20)),
) -> tuple[Table, Table, Table]:
    honest = [f"island-{i}" for i in range(islands - 1)]
    # Per window: (margin, run) of the honest runs and of the attacks.
    found: dict[tuple[int, int], tuple[list[tuple[float, str]], list[tuple[float, str]]]] = {
        w: ([], []) for w in windows
    }

    def margins(evals: Sequence[Evaluation], label: str, is_honest: bool) -> list[str]:
        losses, steps = [e.loss for e in evals], [e.step for e in evals]
        cells = []
        for p, w in windows:
            margin, where = trip_margin(losses, steps, patience=p, warmup=w)
            found[(p, w)][0 if is_honest else 1].append((margin, label))
            cells.append(fmt_rise(margin, where, evals))
        return cells

    signal = Table(
        "Each run: the largest margin at which the guard would trip (margin/patience/warm-up "
        "below it), and the run against its seed's baseline at equal honest tokens",
        [
            "run",
            "seed",
            "variant",
            "outer steps",
            *(f"patience {p}, warm-up {w}" for p, w in windows),
            "worst eval over the baseline at its honest tokens (step)",
            "final eval over the baseline",
        ],
    )
    trips = Table(
        "Each setting on each run: where the guard trips, the model kept, and that model over "
        "the baseline at the honest tokens it holds",
        [
            "run",
            "seed",
            "variant",
            "setting",
            "trips at outer step",
            "kept (outer step, honest tokens)",
            "kept model over the baseline at its honest tokens",
            "worst eval before the trip over the baseline",
        ],
    )
    for root in roots:
        outcomes = [
            json.loads(line)
            for line in (root / "outcomes.jsonl").read_text().split("\n")
            if line.strip()
        ]
        baselines = {
            o["seed"]: sorted((float(t), float(loss)) for t, loss in o["history"])
            for o in outcomes
            if o["variant"] == "none"
        }
        for o in outcomes:
            seed, variant = int(o["seed"]), str(o["variant"])
            evals = read_run(root / f"{variant}-{seed}", honest)
            losses = [e.loss for e in evals]
            steps = [e.step for e in evals]
            base = baselines.get(seed, [])

            def over(e: Evaluation, base: list[tuple[float, float]] = base) -> float:
                return e.loss / interp(base, e.honest)

            ratios = [over(e) for e in evals]
            worst = max(range(len(evals)), key=lambda i: ratios[i])
            signal.add(
                root.name,
                seed,
                variant,
                evals[-1].step,
                *margins(evals, f"{variant} {seed}", variant in HONEST_VARIANTS),
                f"{ratios[worst]:.4f}x ({evals[worst].step})",
                f"{ratios[-1]:.4f}x",
            )
            for setting in settings:
                r = replay(losses, steps, setting)
                if r.trip is None:
                    trips.add(root.name, seed, variant, setting, "-", "-", "-", "-")
                    continue
                kept = evals[r.kept] if r.kept is not None else evals[0]
                before = max(ratios[: r.trip + 1])
                trips.add(
                    root.name,
                    seed,
                    variant,
                    setting,
                    evals[r.trip].step,
                    f"{kept.step}, {kept.honest}",
                    f"{over(kept):.4f}x",
                    f"{before:.4f}x",
                )
    for run in honest_runs:  # `diloco run` folders: every island honest, no baseline
        evals = read_run(run, None)
        losses = [e.loss for e in evals]
        steps = [e.step for e in evals]
        cells = margins(evals, run.name, True)
        signal.add(run.name, "-", "honest (diloco run)", evals[-1].step, *cells, "-", "-")
        for setting in settings:
            r = replay(losses, steps, setting)
            where = "-" if r.trip is None else evals[r.trip].step
            trips.add(run.name, "-", "honest (diloco run)", setting, where, "-", "-", "-")
    split = Table(
        "Per patience and warm-up: the largest margin an honest run trips the guard at, the "
        "least an attack does, and whether a margin between them trips every attack and no "
        "honest run",
        ["patience, warm-up", "honest: largest (run)", "attacks: least (run)", "separated"],
    )
    for (p, w), (honest_margins, attack_margins) in found.items():
        if not honest_margins or not attack_margins:
            continue
        top, low, apart = separation(honest_margins, attack_margins)

        def pct(x: float) -> str:
            return "-" if x == -math.inf else f"{x * 100:+.1f}%"

        split.add(
            f"{p}, {w}",
            f"{pct(top[0])} ({top[1]})",
            f"{pct(low[0])} ({low[1]})",
            "yes" if apart else "no",
        )
    return signal, trips, split


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "")
    p.add_argument(
        "--runs",
        type=Path,
        nargs="+",
        required=True,
        help="bench.adversary --workdir directories to read",
    )
    p.add_argument(
        "--honest",
        type=Path,
        nargs="*",
        default=[],
        help="`diloco run` folders of honest jobs (every island honest) to replay too",
    )
    p.add_argument("--islands", type=int, default=2, help="the runs' --islands")
    p.add_argument(
        "--settings",
        nargs="+",
        default=list(DEFAULT_SETTINGS),
        help="guard settings to replay, margin/patience/warmupOuterSteps",
    )
    p.add_argument(
        "--windows",
        nargs="+",
        default=list(DEFAULT_WINDOWS),
        help="patience/warmupOuterSteps pairs whose largest tripping margin each run shows",
    )
    args = p.parse_args(argv)
    windows = [(int(a), int(b)) for a, b in (w.split("/") for w in args.windows)]
    with LoadMonitor() as load:
        signal, trips, split = study(
            args.runs,
            args.islands,
            [Setting.parse(s) for s in args.settings],
            args.honest,
            windows,
        )
    report = Report(
        "studies/guard_signal",
        "syncer.qualityGuard's rule replayed on bench/adversary.py's runs: the margin each run "
        "would trip it at, against the honest runs' (issue 46, one bad island of two).",
        tables=[split, signal, trips],
        notes=[
            "A margin cell: the guard at that patience and warm-up trips on the run at every "
            "margin below the figure (and at the outer step named), at none above it; '-': no "
            "window of that many judged evaluations.",
            "Over the baseline: the run's eval loss over the 'none' run's of the same seed at "
            "the honest island's tokens merged up to that outer step (the merge log), linear "
            "between the baseline's evaluations.",
            "Kept: the best checkpoint the guard would export (jobs.py's cadence of the best, "
            f"every {CHECKPOINT_EVERY} outer steps beyond the regular ones); step 0 is the "
            "initial weights.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
