"""How much each island's pseudo-gradient counts in a merge, and how much of a round a merge is.

Pure functions; the syncer feeds them each contributor's counters and staleness, the merge
(merge.py) and the outer step (outer.py) consume the plan.

Work. A contributor that ran `steps` inner steps since it last received the fragment carries
w = steps / H island-rounds of work (H = inner.steps): steps, not tokens, because a round is H
steps whatever an island's batch (tokens enter the weights as quality, below). Its
pseudo-gradient Δ covers all of that work, so Δ / w is its pseudo-gradient per round.

Staleness. A contribution computed from an older version of the fragment lags by the rounds of
work merged into the fragment since that version (lag_rounds, counted by the syncer). Synchronous
DiLoCo's own pseudo-gradients miss up to one round (the peers merged in the same step), so only
the lag beyond one round is discounted, by (1 + excess)^-1/2 (the discount Async Local-SGD, arXiv
2401.09135, tried; it found harder rules, such as dropping old updates, no better). Identical
islands out of phase at K=1 lag (M−1)/M of a round: no discount; a 3x straggler among four
islands lags about 2.25 rounds: weight 0.67.

The plan. Contributor i gets mixing weight ρ_i = q_i·d_i, with q_i = contribution_weight (tokens
× tokens/steps for "tokens"/"rda", the work w_i for "mean") and d_i its discount; its vector is
scaled by 1/w_i; the merged g = Σ ρ_i (Δ_i / w_i) / Σ ρ_i (or RDA of the scaled vectors). The
merge carries φ = Σ w_i·d_i / M of a round, M the islands that count (active or contributing).
With equal batches the outer step then moves θ by lr·φ·g = lr·Σ d_i·Δ_i / M: every island's
pseudo-gradient counts once, as in a synchronous step, however merges group them, and the
discount is not normalised away (a lone stale push moves θ less). A merge of every island's full
round, none stale, has φ = 1 and g = their weighted mean: synchronous DiLoCo. A merge that
holds a push of every island the round spans is `complete`: it closes the open round of the outer
optimizer whatever its φ (core/outer.py).

Momentum share. A stale contribution's Δ moves θ (the gradient term, lr·φ·g) but feeds the outer
momentum only with its share s = (1 + lag)^-2 (lag in rounds of work; 1 when fresh), the merge's
share being its contributors', weighted by ρ_i (momentum_share). Why: the outer step is a
feedback loop, and a Δ computed from a base `lag` rounds old closes it that late; through
Nesterov momentum (β = 0.9: each Δ acts about 1/(1 − β) = 10 times over the next rounds) the
late loop oscillates. In a linear model of it (bench/studies/stale_momentum: one direction of
curvature, a round's inner steps covering a share a of the distance to the optimum, 4 islands
merged one at a time), the defaults lr 0.7 and β 0.9 give a round a spectral radius (the worst
over a in 0.1..1; > 1: the error grows) of 1.15 at a lag of one round and 1.25 at two with the
discount alone; with the share, at most 0.93 up to two rounds and 1.002 at four (maxStaleness),
and no more than before at any lag. The exponent is the least of 1, 1.5, 2 and 3 that stays
within 1.002 up to four rounds (1: 1.07; 1.5: 1.02). Measured: docs/algorithm.md, "Staleness".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_trainer.core.merge import MERGE_RULES, contribution_weight

# Staleness (rounds of work) every merge has anyway: synchronous DiLoCo's peers in one step.
FREE_LAG_ROUNDS = 1.0


def work_share(steps: int, inner_steps: int) -> float:
    """Island-rounds of work in a contribution: steps / H."""
    if inner_steps < 1:
        raise ValueError(f"inner.steps must be >= 1, got {inner_steps}")
    if steps < 0:
        raise ValueError(f"inner steps must be >= 0, got {steps}")
    return steps / inner_steps


def credited_work(steps: int, inner_steps: int, credit_steps: int | None = None) -> float:
    """The work w a contribution is credited with: work_share of its steps, at most
    `credit_steps` of them (None: all).

    Why the Δ still moves θ in full: its vector is scaled by 1/w and the merge carries
    φ = Σ w_i·d_i / M, so its gradient term is lr·φ·g = lr·d·Δ/M whatever w is (one contributor;
    with several under "mean", ρ_i = w_i·d_i and φ·g = Σ d_i·Δ_i / M). Only φ, the share of a
    round the outer optimizer counts, and so the momentum folds it triggers (core/outer.py), shrink.
    credited_work(40, 10, 12) == 1.2; credited_work(8, 10, 12) == 0.8."""
    w = work_share(steps, inner_steps)
    if credit_steps is None or steps <= credit_steps:
        return w
    if credit_steps < 1:
        raise ValueError(f"credited steps must be >= 1, got {credit_steps}")
    return credit_steps / inner_steps


def credited_tokens(tokens: float, steps: int, credit_steps: int | None = None) -> float:
    """The tokens a contribution spends of stopAfter.tokens: its `tokens` over its `steps`, at
    most `credit_steps` of them (syncer.guards.pairCredit's round, as credited_work; None: all).

    Why: the budget counts work, and a push credited one round of work folds the outer momentum
    once and moves θ by one push's Δ, whatever it claims; counted in full, a bad island of two
    claiming 4 rounds a push spent 4 rounds of the budget a push, and the job ended at 31-41k of
    its 102k honest tokens (issue 46). The tokens not credited are its learner's, never the
    job's: the syncer counts them as refused (targets.Pace.base), so a K < M target gives them
    back to train. credited_tokens(40960, 40, 12) == 12288.0; credited_tokens(8192, 8, 12) ==
    8192."""
    if credit_steps is None or steps <= credit_steps:
        return float(tokens)
    if credit_steps < 1:
        raise ValueError(f"credited steps must be >= 1, got {credit_steps}")
    return tokens * credit_steps / steps


def momentum_share(lag_rounds: float) -> float:
    """(1 + lag_rounds)^-2: the share of a contribution's Δ that enters the outer momentum (the
    module docstring says why); 1 for a fresh one, so K = M's merges are unchanged."""
    if not (math.isfinite(lag_rounds) and lag_rounds >= 0.0):
        raise ValueError(f"staleness lag must be finite and >= 0, got {lag_rounds}")
    return float((1.0 + lag_rounds) ** -2)


def staleness_discount(lag_rounds: float) -> float:
    """(1 + max(0, lag_rounds − 1))^-1/2: only staleness beyond one round is discounted."""
    if not (math.isfinite(lag_rounds) and lag_rounds >= 0.0):
        raise ValueError(f"staleness lag must be finite and >= 0, got {lag_rounds}")
    return float((1.0 + max(0.0, lag_rounds - FREE_LAG_ROUNDS)) ** -0.5)


@dataclass(frozen=True)
class Contributor:
    """What the plan needs of one pending contribution."""

    tokens: int
    steps: int
    lag_rounds: float = 0.0
    # A factor on its vector (syncer.guards.pairClip's, in (0, 1]): its scale is clip / w_i.
    clip: float = 1.0
    # The most of its steps its work w_i counts (syncer.guards.pairCredit in a job of two: one
    # round of its own, H_i + sync.overlapSteps), its weight ρ_i scaled alike; None: all of
    # them (credited_work).
    credit_steps: int | None = None


@dataclass(frozen=True)
class MergePlan:
    """Weights, vector scales and work fraction of one merge (see the module docstring)."""

    weights: list[float]  # ρ_i, not normalised (merge_pseudo_gradients normalises)
    scales: list[float]  # 1 / w_i (0 for a contribution without work)
    work: list[float]  # w_i
    discounts: list[float]  # d_i
    fraction: float  # φ
    complete: bool = False  # every island the round spans is in it: it closes the round
    # The share of φ·g that enters the outer momentum: the contributors' momentum_share,
    # weighted by their ρ_i (1 when none is stale).
    momentum: float = 1.0

    @property
    def shares(self) -> list[float]:
        """Normalised mixing weights (for the merge log)."""
        total = sum(self.weights)
        return [w / total if total > 0 else 0.0 for w in self.weights]


def plan_merge(
    contributors: Sequence[Contributor],
    *,
    rule: str,
    inner_steps: int,
    islands: int,
    complete: bool = False,
) -> MergePlan:
    """The plan of a merge of `contributors` among `islands` islands (M >= 1); `complete`
    when they are every one of them."""
    if rule not in MERGE_RULES:
        raise ValueError(f"sync.merge {rule!r} is unknown; choose one of {list(MERGE_RULES)}")
    if islands < 1:
        raise ValueError(f"a merge needs at least one island, got {islands}")
    work = [credited_work(c.steps, inner_steps, c.credit_steps) for c in contributors]
    discounts = [staleness_discount(c.lag_rounds) for c in contributors]
    weights, scales = [], []
    for c, w, d in zip(contributors, work, discounts, strict=True):
        quality = w if rule == "mean" else contribution_weight(c.tokens, c.steps, rule)
        if rule != "mean" and w > 0 and c.credit_steps is not None and c.steps > c.credit_steps:
            # A credited contribution weighs as its credited steps' share of its tokens would
            # (tokens x c / s over c steps: quality x c / s), so ρ_i stays ∝ w_i·d_i at equal
            # batches and φ·g = Σ d_i·Δ_i / M still holds (credited_work says why).
            quality *= c.credit_steps / c.steps
        weights.append(quality * d if w > 0 else 0.0)
        scales.append(c.clip / w if w > 0 else 0.0)
    fraction = sum(w * d for w, d in zip(work, discounts, strict=True)) / islands
    shares = [momentum_share(c.lag_rounds) for c in contributors]
    total = sum(weights)
    # Exact for one contributor (K = 1's merges); with several, g's parts are weighted by ρ_i,
    # so the buffer gets each one's share of its part when their per-round Δs are alike.
    momentum = sum(r * s for r, s in zip(weights, shares, strict=True)) / total if total else 1.0
    if all(s == 1.0 for s in shares):
        momentum = 1.0  # bit for bit as before, not a float sum that rounds to 1 − ε
    return MergePlan(weights, scales, work, discounts, fraction, complete, momentum)
