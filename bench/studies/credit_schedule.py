"""Partial credit in a job of two (issue 46): which credit reference keeps every honest push in
full through the lr schedule and still cuts faint claims? A model, not a run: no learner and no
syncer, only the schedule (models/parts.inner_lr of a parsed spec) and the movement each push
would have.

The model. An honest island's push of n steps from inner step s moves c x sum(lr over them):
AdamW's update scales with lr (docs/algorithm.md, "Partial credit"), and c, its movement per
unit of lr, is 1 for an island at H_i = H and sqrt(H / H_i) otherwise (a random walk's: a round
3x shorter moves sqrt(3) more per step). The movement cap's share per step (the reference's most,
guards.evidence_step_caps) is taken as c x inner.lr, the figure the benchmark's honest islands
sat at (their pushes were credited against the cap: bench/log/2026-11-29.md, 14:43 UTC). A faint
island (bench/adversary.py's faint_claims) claims 4 x H steps a push, each 1/16 of the cap, and
pushes as often as the honest island. Islands push in turn: each push is judged against the
other island's pushes so far, then recorded. The credit is min(1, 4 x movement per claimed step
/ reference), the reference one of:
- median: the other island's median movement per step over its last 16 pushes (taken out in
  41d08ec: it lags a cosine);
- other_place: its median movement per unit of lr times the mean lr of its next steps, at its
  own place in the schedule (adv7, 93c90ef: not landed);
- own_place: the same per-lr median times the mean lr of the judged push's own steps, at the
  judged island's place (the sum of its own claims).

    python -m bench.studies.credit_schedule
    python -m bench.studies.credit_schedule --no-record
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.api.spec import parse_spec
from diloco_trainer.models.parts import inner_lr

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish

CREDIT_RATIO = 4.0  # full credit down to 1/4 of the reference per claimed step
WINDOW = 16  # the syncer's window of pushes per island (guards.ISLAND_WINDOW)
OWN_MIN = 3  # pushes before an island's figures judge the other (guards.OWN_MIN)
FAINT = 1.0 / 16  # the benchmark's faint claims: 1/16 of the cap's figure per claimed step
RULES = ("median", "other_place", "own_place")


def lr_sum(lr_at: Callable[[int], float], start: int, steps: int) -> float:
    return math.fsum(lr_at(s) for s in range(start, start + steps))


@dataclass
class Island:
    """One island of the model: H_i steps a push, its movement per unit of lr, or faint."""

    steps: int
    c: float
    faint: bool = False
    place: int = 0  # the inner step its next push starts at (the sum of its claims)
    per_step: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    per_lr: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last: int = 0


def reference(rule: str, other: Island, judged: Island, lr_at: Callable[[int], float]) -> float:
    if rule == "median":
        return statistics.median(other.per_step)
    start, n = (other.place, other.last) if rule == "other_place" else (judged.place, judged.steps)
    return statistics.median(other.per_lr) * lr_sum(lr_at, start, n) / n


def simulate(
    rule: str, islands: Sequence[Island], pushes: int, lr_at: Callable[[int], float], peak: float
) -> list[list[float]]:
    """Each island's credits, pushing in turn `pushes` times each."""
    cap = peak  # the cap's share per step: c = 1 at inner.lr
    credits: list[list[float]] = [[] for _ in islands]
    for _ in range(pushes):
        for i, me in enumerate(islands):
            n = me.steps
            lrs = lr_sum(lr_at, me.place, n)
            norm = n * FAINT * cap if me.faint else me.c * lrs
            other = islands[1 - i]
            if len(other.per_step) >= OWN_MIN:
                ref = min(reference(rule, other, me, lr_at), cap)
                credits[i].append(min(1.0, CREDIT_RATIO * norm / n / ref))
            me.per_step.append(norm / n)
            me.per_lr.append(norm / lrs)
            me.place += n
            me.last = n
    return credits


def schedule(steps: int, rounds: int | None, warmup: int) -> Callable[[int], float]:
    stop: dict[str, Any] = {"outerSteps": rounds} if rounds else {"tokens": 10**9}
    spec = parse_spec(
        {
            "model": {"preset": "gpt-tiny"},
            "islands": {"count": 2},
            "inner": {"steps": steps, "lr": 1.0, "warmupSteps": warmup},
            "stopAfter": stop,
        }
    )
    return functools.partial(inner_lr, spec)


def scenarios(h: int) -> list[tuple[str, int | None, list[tuple[int, bool]]]]:
    """(name, rounds of the cosine or None for a flat lr, [(H_i, faint) per island])."""
    return [
        ("honest 1:1, cosine", 10, [(h, False), (h, False)]),
        ("honest 1:3 (H_i = H/3 for the slow one), cosine", 40, [(h, False), (h // 3, False)]),
        ("honest 1:3, flat lr", None, [(h, False), (h // 3, False)]),
        ("faint claims (4 x H a push) vs honest 1, cosine", 10, [(h, False), (4 * h, True)]),
    ]


def table(h: int, warmup: int) -> Table:
    t = Table(
        f"Credits by rule (H = {h}, warm-up {warmup}, a cosine over the rounds named, pushes "
        "in turn; honest: the least credit of either honest island; faint: its mean credit)",
        ["scenario", *RULES],
    )
    for name, rounds, members in scenarios(h):
        row = []
        for rule in RULES:
            islands = [Island(n, math.sqrt(h / n), faint) for n, faint in members]
            total = (rounds or 40) * h
            pushes = total // min(n for n, _ in members)
            credits = simulate(rule, islands, pushes, schedule(h, rounds, warmup), 1.0)
            if any(f for _, f in members):
                got = [c for (_, f), cs in zip(members, credits, strict=True) if f for c in cs]
                row.append(f"faint {statistics.mean(got):.3f}")
            else:
                row.append(f"{min(min(cs) for cs in credits):.3f}")
        t.add(name, *row)
    return t


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "")
    p.add_argument("--inner-steps", type=int, default=12, help="H (a multiple of 3)")
    p.add_argument("--warmup", type=int, default=10, help="inner.warmupSteps")
    args = p.parse_args(argv)
    with LoadMonitor() as load:
        t = table(args.inner_steps, args.warmup)
    report = Report(
        "studies/credit_schedule",
        "Which partial-credit reference keeps honest pushes in full through the lr schedule "
        "and still cuts faint claims (a model of the syncer's rule, no processes).",
        tables=[t],
        notes=[
            "Full credit is 1.000; honest columns want 1.000, the faint row wants well below 1 "
            "(the benchmark's faint claims cost 1.09-1.28x the honest run's loss credited in "
            "full, 1.01-1.02x credited a quarter).",
            "own_place lets an island's own claims set the lr it is judged at: faint claims of "
            "4 x H a push reach the cosine's floor four times sooner than the honest island.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
