"""bench/adversary.py's outcomes and their report: each run against its seed's baseline at equal
honest tokens, and per adversary the mean of those ratios over the seeds with its spread, beside
the same figures of the honest rerun (none_again), which is what run-to-run noise alone gives.

The verdict on a mean reads its noise too: with n seeds, sample standard deviation s, standard
error se = s / sqrt(n) and the half-width of its 95% interval w = t(n - 1) x se (Student's t: a
handful of seeds estimates s poorly), the mean is judged within the target only when
|mean - 1| + w <= target (resolved: met), outside only when |mean - 1| - w > target (resolved:
MISSED), and otherwise "not resolved": a target is never called met on a mean its own noise could
carry past it.

Issue 46's "within 1%" at three islands is also read one-sided, as damage (no_worse): met only
when the interval's top, mean + w, is at most 1.01; an adversary whose runs end below the honest
one's is not held to the lower side, which two-sided judging at 1% would do.

Each seed has one baseline run, whose own noise is in every ratio of that seed; the adversary's
ratio over the honest rerun's of the same seed (`paired`) cancels it and compares two runs that
ended the same way (at the budget), one with the adversary and one without.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.harness.common import Report, Table, fmt_ratio, verdict
from bench.harness.decoupled_quality_report import interp

TARGET = 0.02  # eval loss within 2% of the baseline's at equal honest tokens
# Issue 46's done-when at three islands, "eval loss within 1%" of the honest run, read as damage:
# the mean ratio at most 1% above 1. An adversary's run whose loss is lower than the honest one's
# is not harm it did, so only the upper side is judged (no_worse).
DAMAGE = 0.01
# Student's t, two-sided 95%, by degrees of freedom (seeds - 1); beyond 10, 10's (conservative).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
T95_MORE = 2.228
BASELINE = "none"
CONTROL = "none_again"  # the honest job run again: run-to-run noise


@dataclass
class Outcome:
    """One run: the honest islands' merged tokens, the final eval loss, what the attack got."""

    variant: str
    seed: int
    honest_tokens: int
    eval_loss: float
    history: list[tuple[float, float]]  # (tokens merged, eval loss) after every outer step
    answers: dict[str, int]
    refusals: dict[str, dict[str, int]]
    honest_states: list[str]
    seconds: float
    status_busy: int = 0  # the harness's status polls answered 503 (asked again)
    # How the job ended when not at its budget: the syncer's quality guard (issue 46) names the
    # outer step of the checkpoint it kept; eval_loss is then that checkpoint's, the one exported.
    ended: str = ""
    # After the guard ended the job: the honest islands' tokens merged up to the outer step of
    # the checkpoint it kept (the merge log). The kept model holds only these, so "before it
    # degrades" (issue 46's other branch) reads it against the baseline here, beside the ratio
    # at the tokens the job merged before it ended.
    kept_tokens: int | None = None
    # The islands the syncer's detection named while the run was polled (health problem kind
    # -> islands: islandWorkUnsupported, islandAtBound), an honest one's name included.
    named: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """Ratios of one variant over seeds: their mean, standard error, least and most.

    >>> s = Spread.of([1.01, 0.99, 1.03, 0.97])  # sd: sqrt(0.002 / 3), se: sd / 2
    >>> round(s.mean, 6), s.n, round(s.sd, 6), round(s.se, 6), s.low, s.high
    (1.0, 4, 0.02582, 0.01291, 0.97, 1.03)
    >>> Spread.of([1.05]).se  # one seed: no estimate of its noise
    nan
    """

    n: int
    mean: float
    sd: float  # sample standard deviation (n - 1)
    low: float
    high: float

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Spread:
        sd = statistics.stdev(ratios) if len(ratios) > 1 else math.nan
        return cls(len(ratios), statistics.fmean(ratios), sd, min(ratios), max(ratios))

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n)

    @property
    def half_width(self) -> float:
        """Of the mean's 95% interval: t(n - 1) x se (NaN for one seed).

        >>> round(Spread.of([1.01, 0.99, 1.03, 0.97]).half_width, 6)  # 3.182 x 0.0129099
        0.041079
        """
        return T95.get(self.n - 1, T95_MORE) * self.se


def judge(s: Spread, target: float = TARGET) -> str:
    """The verdict on a mean ratio, its noise read (module docstring).

    >>> judge(Spread(5, 1.005, 0.01, 0.99, 1.02))  # w = 2.776 x 0.447% = 1.24%; 0.5% + w <= 2%
    'met'
    >>> judge(Spread(5, 1.05, 0.01, 1.04, 1.06))  # 5% - 1.24% > 2%
    'MISSED'
    >>> judge(Spread(5, 1.015, 0.01, 0.99, 1.04))  # 1.5% + 1.24% > 2%, 1.5% - 1.24% < 2%
    'not resolved'
    >>> judge(Spread(1, 1.0, math.nan, 1.0, 1.0))
    'not resolved'
    """
    off = abs(s.mean - 1.0)
    if math.isnan(s.se):
        return "not resolved"
    if off + s.half_width <= target:
        return verdict(True)
    if off - s.half_width > target:
        return verdict(False)
    return "not resolved"


def upper_bound(s: Spread) -> float:
    """The top of the mean's 95% interval, mean + w. Read alone it is a one-sided bound at
    97.5% (w takes the two-sided t), so no looser than a one-sided 95% one.

    >>> round(upper_bound(Spread.of([0.97, 0.98, 0.99, 1.0, 1.01])), 6)  # 0.99 + 1.9629%
    1.009629
    """
    return s.mean + s.half_width


def no_worse(s: Spread, target: float = DAMAGE) -> str:
    """The one-sided verdict: met when the whole interval lies at or below 1 + target (mean + w
    <= 1 + target), MISSED when it lies above (mean - w > 1 + target), else not resolved. A mean
    below 1 does not count against it, as it does in judge.

    >>> s = Spread.of([0.97, 0.98, 0.99, 1.0, 1.01])  # w = 2.776 x 1.5811% / sqrt 5 = 1.9629%
    >>> no_worse(s), judge(s, DAMAGE)  # 0.99 + 1.96% <= 1.01; two-sided 1% + 1.96% > 1%
    ('met', 'not resolved')
    >>> no_worse(Spread.of([0.99, 1.0, 1.01, 1.02, 1.03]))  # 1.01 + 1.96% > 1.01 > 1.01 - 1.96%
    'not resolved'
    >>> no_worse(Spread.of([1.02, 1.03, 1.04, 1.05, 1.06]))  # 1.04 - 1.96% = 1.0204 > 1.01
    'MISSED'
    >>> no_worse(Spread(1, 0.9, math.nan, 0.9, 0.9))
    'not resolved'
    """
    if math.isnan(s.se):
        return "not resolved"
    if upper_bound(s) <= 1.0 + target:
        return verdict(True)
    if s.mean - s.half_width > 1.0 + target:
        return verdict(False)
    return "not resolved"


def seeds_to_resolve(s: Spread, target: float = TARGET, most: int = 100) -> int | None:
    """The fewest seeds at which a mean this far from 1, with this spread, would be judged met
    (t(n - 1) x sd / sqrt(n) <= target - |mean - 1|); None when the mean itself is past the
    target, its spread unknown, or more than `most` would be needed.

    >>> # margin 2% - 0.5% = 1.5%; n=4: 3.182 x 1% / 2 = 1.59% (no), n=5: 2.776 x 1% / 2.236 = 1.24%
    >>> seeds_to_resolve(Spread(3, 1.005, 0.01, 0.99, 1.02))
    5
    >>> seeds_to_resolve(Spread(3, 1.025, 0.01, 1.01, 1.04)) is None
    True
    """
    off = abs(s.mean - 1.0)
    if off >= target or math.isnan(s.sd):
        return None
    for n in range(2, most + 1):
        if T95.get(n - 1, T95_MORE) * s.sd / math.sqrt(n) <= target - off:
            return n
    return None


def base_of(outcomes: Sequence[Outcome], o: Outcome) -> Outcome:
    """The baseline run of `o`'s seed."""
    return next(b for b in outcomes if b.seed == o.seed and b.variant == BASELINE)


def ratio_of(outcomes: Sequence[Outcome], o: Outcome) -> tuple[float, float]:
    """`o`'s final eval loss over its seed's baseline's at o's honest tokens; and that loss."""
    at = interp(base_of(outcomes, o).history, o.honest_tokens)
    return o.eval_loss / at, at


def spreads(outcomes: Sequence[Outcome]) -> dict[str, Spread]:
    """Per variant (the baseline's own ratio is 1 by construction: left out), its ratios over
    the seeds whose baseline ran."""
    seeds = {o.seed for o in outcomes if o.variant == BASELINE}
    by: dict[str, list[float]] = {}
    for o in outcomes:
        if o.variant != BASELINE and o.seed in seeds:
            by.setdefault(o.variant, []).append(ratio_of(outcomes, o)[0])
    return {v: Spread.of(r) for v, r in by.items()}


def paired(outcomes: Sequence[Outcome]) -> dict[str, Spread]:
    """Per adversary, over the seeds that ran it, the honest rerun and the baseline: its ratio
    over the honest rerun's (both against that seed's one baseline, so the baseline's own noise
    cancels): how far the adversary's run is from a run without it that ended the same way."""
    ratio = {(o.seed, o.variant): ratio_of(outcomes, o)[0] for o in outcomes if _based(outcomes, o)}
    by: dict[str, list[float]] = {}
    for (seed, variant), r in ratio.items():
        if variant not in (BASELINE, CONTROL) and (seed, CONTROL) in ratio:
            by.setdefault(variant, []).append(r / ratio[(seed, CONTROL)])
    return {v: Spread.of(r) for v, r in by.items()}


def _needed(s: Spread, pair: Spread | None) -> str:
    """Seeds that would resolve the verdict against the baseline / against the honest rerun."""
    ns = [seeds_to_resolve(x) if x is not None else None for x in (s, pair)]
    return " / ".join("-" if n is None else str(n) for n in ns)


def _based(outcomes: Sequence[Outcome], o: Outcome) -> bool:
    return any(b.seed == o.seed and b.variant == BASELINE for b in outcomes)


def _band(s: Spread) -> str:
    return f"{fmt_ratio(s.mean, 4)} ± {100 * s.half_width:.2f}%"


def _damage(s: Spread, pair: Spread | None) -> str:
    """no_worse's cell: the upper bound and verdict against the baseline / the honest rerun."""
    cells = [f"{fmt_ratio(upper_bound(x), 4)} {no_worse(x)}" for x in (s, pair) if x is not None]
    return " / ".join(cells + ["-"] * (2 - len(cells)))


def per_run_table(outcomes: Sequence[Outcome]) -> tuple[Table, float]:
    """Each run against its baseline; and the largest deviation of any one run."""
    table = Table(
        "Each run: eval loss with one adversary of the job's islands, against the baseline at "
        "equal honest tokens (same seed, same invocation)",
        [
            "seed",
            "adversary",
            "honest tokens",
            "eval loss",
            "baseline at those tokens",
            "ratio",
            "adversary's answers",
            "refused",
            "honest islands",
            "status polls 503",
            "wall s",
            "named",
            "ended by",
        ],
    )
    worst = 0.0
    seeds = {o.seed for o in outcomes if o.variant == BASELINE}
    for o in (o for o in outcomes if o.seed in seeds):  # a seed without its baseline: no ratio
        r, at = ratio_of(outcomes, o)
        worst = max(worst, abs(r - 1.0))
        refused = {k: v for d in o.refusals.values() for k, v in d.items()}
        table.add(
            o.seed,
            o.variant,
            o.honest_tokens,
            f"{o.eval_loss:.4f}",
            f"{at:.4f}",
            fmt_ratio(r, 4),
            ", ".join(f"{k}: {v}" for k, v in sorted(o.answers.items())) or "-",
            ", ".join(f"{k}: {v}" for k, v in sorted(refused.items())) or "-",
            "/".join(o.honest_states),
            o.status_busy,
            f"{o.seconds:.0f}",
            "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(o.named.items())) or "-",
            ended_cell(outcomes, o),
        )
    return table, worst


def ended_cell(outcomes: Sequence[Outcome], o: Outcome) -> str:
    """How the run ended; after a guard's end, its kept model against the baseline at the
    honest tokens that model holds.

    >>> base = Outcome("none", 0, 100, 2.0, [(0.0, 4.0), (100.0, 2.0)], {}, {}, [], 1.0)
    >>> o = Outcome("x", 0, 100, 3.3, [], {}, {}, [], 1.0, ended="guard", kept_tokens=50)
    >>> ended_cell([base, o], o)  # the baseline at 50 tokens: 3.0
    'guard; kept model 1.1000x the baseline at its 50 honest tokens'
    """
    if o.kept_tokens is None:
        return o.ended or "budget"
    at = interp(base_of(outcomes, o).history, o.kept_tokens)
    return (
        f"{o.ended}; kept model {fmt_ratio(o.eval_loss / at, 4)} the baseline at its "
        f"{o.kept_tokens} honest tokens"
    )


def honest_tokens_upto(
    merges: Sequence[dict[str, object]], honest: Sequence[str], step: int
) -> int:
    """The honest islands' tokens in the merges (a merge log's records) up to outer step `step`.

    >>> log = [{"outerStep": 1, "contributors": [{"island": "island-0", "tokens": 5}]},
    ...        {"outerStep": 3, "contributors": [{"island": "island-0", "tokens": 10},
    ...                                          {"island": "island-1", "tokens": 20}]}]
    >>> honest_tokens_upto(log, ["island-0"], 1), honest_tokens_upto(log, ["island-0"], 3)
    (5, 15)
    """
    total = 0
    for m in merges:
        if int(str(m["outerStep"])) <= step:
            contributors = m["contributors"]
            assert isinstance(contributors, list)
            total += sum(int(c["tokens"]) for c in contributors if c["island"] in honest)
    return total


def mean_table(by: dict[str, Spread], pairs: dict[str, Spread]) -> Table:
    """Per adversary: the mean ratio over seeds, its noise and spread, the honest rerun's, and
    its ratio to the honest rerun paired by seed."""
    table = Table(
        "Per adversary over the seeds: mean of the per-seed ratios to the baseline (± its 95% "
        "interval) and their range, the honest rerun's (none_again) beside it, and the adversary's "
        "run over the honest rerun of the same seed",
        [
            "adversary",
            "seeds",
            "mean ratio ± 95%",
            "range",
            "honest rerun: mean ± 95% (range)",
            "within 2% of the baseline",
            "over the honest rerun: mean ± 95%",
            "within 2% of the honest rerun",
            "seeds that would resolve it (this spread)",
            f"no worse than {100 * DAMAGE:.0f}% (one-sided): upper bound of the 95% interval, "
            "of the baseline / of the honest rerun",
        ],
    )
    control = by.get(CONTROL)
    rerun = (
        f"{_band(control)} ({fmt_ratio(control.low, 4)} - {fmt_ratio(control.high, 4)})"
        if control
        else "not measured"
    )
    for variant, s in by.items():
        pair = pairs.get(variant)
        table.add(
            variant,
            s.n,
            _band(s),
            f"{fmt_ratio(s.low, 4)} - {fmt_ratio(s.high, 4)}",
            rerun,
            judge(s),
            _band(pair) if pair else "-",
            judge(pair) if pair else "-",
            _needed(s, pair),
            _damage(s, pair),
        )
    return table


def overall(verdicts: dict[str, str]) -> str:
    """The target's verdict over every adversary's mean.

    >>> overall({"flood": "met", "ratchet": "met"})
    'met'
    >>> overall({"flood": "met", "ratchet": "MISSED"})
    'MISSED (ratchet)'
    >>> overall({"flood": "not resolved", "ratchet": "met"})
    'not resolved (flood)'
    """
    missed = [v for v, j in verdicts.items() if j == verdict(False)]
    if missed:
        return f"{verdict(False)} ({', '.join(missed)})"
    open_ = [v for v, j in verdicts.items() if j != verdict(True)]
    return f"not resolved ({', '.join(open_)})" if open_ else verdict(True)


def report(outcomes: Sequence[Outcome], args: argparse.Namespace) -> Report:
    runs, worst = per_run_table(outcomes)
    by = spreads(outcomes)
    attacks = {v: s for v, s in by.items() if v != CONTROL}
    verdicts = {v: judge(s) for v, s in attacks.items()}
    pairs = paired(outcomes)
    seeds = sorted({o.seed for o in outcomes if o.variant == BASELINE})
    means = ", ".join(f"{v} {_band(s)} ({verdicts[v]})" for v, s in attacks.items())
    control = f"; the honest rerun {_band(by[CONTROL])}" if CONTROL in by else ""
    over = ", ".join(f"{v} {_band(s)} ({judge(s)})" for v, s in pairs.items())
    over_verdict = overall({v: judge(s) for v, s in pairs.items()})
    summary = (
        f"{getattr(args, 'islands', 3) - 1} honest island(s) and one adversary, {args.preset}, "
        f"H={args.inner_steps}, "
        f"{args.steps} steps per honest island, seeds {seeds}. Mean ratio over the seeds of the "
        f"eval loss to the baseline's at equal honest tokens (± its 95% interval): {means}"
        f"{control}. Target, each mean within {100 * TARGET:.0f}% with its noise read: "
        f"{overall(verdicts)}. "
        + (f"Over the honest rerun of the same seed: {over}; {over_verdict}. " if pairs else "")
        + f"Largest deviation of any single run from the baseline: {100 * worst:.2f}%. "
        + f"No worse than {100 * DAMAGE:.0f}% (one-sided, issue 46 at three islands): "
        + ", ".join(f"{v} {no_worse(s)}" for v, s in attacks.items())
        + (
            f"; over the honest rerun: {', '.join(f'{v} {no_worse(s)}' for v, s in pairs.items())}"
            if pairs
            else ""
        )
        + "."
    )
    notes = [
        "Honest tokens: the honest islands' merged tokens at the finish (status islands."
        "mergedTokens); an adversary's accepted claims count towards stopAfter.tokens, so they "
        "can be fewer than the baseline's, and the baseline's loss is read at them.",
        "adversary's answers: its pushes accepted, else their HTTP statuses (200: answered after "
        "the job finished; 403: after it was dropped); reopened: held connections the syncer "
        "closed or answered, opened again.",
        "Verdict on a mean (bench/harness/adversary_report.judge): met when |mean - 1| + w <= 2%, "
        "MISSED when |mean - 1| - w > 2%, else not resolved; w = t(seeds - 1) x sample sd / "
        "sqrt(seeds), the 95% interval's half-width (Student's t). "
        "Every ratio of a seed shares that seed's one baseline run, whose own noise is in them.",
        f"No worse than {100 * DAMAGE:.0f}% (bench/harness/adversary_report.no_worse; issue 46's "
        "'within 1%' at three islands read as damage): met when mean + w <= 1 + "
        f"{DAMAGE:g}, MISSED when mean - w > 1 + {DAMAGE:g}, else not resolved; a mean below 1 "
        "is not held against an adversary. mean + w alone is a one-sided bound at 97.5%.",
    ]
    return Report("bench/adversary.py", summary, [mean_table(by, paired(outcomes)), runs], notes)
