"""Checks every pushed pseudo-gradient passes before it can touch the global model.

Any holder of the job's token, or an island whose training diverged, can push. A push that is
well formed (validation.py) is still refused, with 422 and a code naming the reason
(protocol.CONTRIBUTION_REFUSALS), when

- its decoded values are not finite: a codec's finite scale (int8 with 3e38) can decode to inf;
- its L2 norm is above the fragment's hard cap: syncer.guards.maxDeltaNorm, or 'auto', the most
  AdamW can move the fragment in one round (auto_norm_caps);
- its norm is above normFactor x the median over islands of each island's own median of recent
  accepted norms, once the fragment has warmupPushes of them, and above the floor of one honest
  AdamW round (norm_floors): a bound learned from the job's own history (NormHistory), so a
  blown-up Δ is refused long before it reaches the hard cap, and one a minority of islands
  cannot move: a flood of near-zero pushes cannot make honest pushes outliers, a ratchet cannot
  raise the bound the others are judged by;
- it points against the other islands' recent pushes: its cosine with the sum of their latest
  pushes' directions (one vote per island, sampled at fixed positions: direction.py) is below
  direction.AGAINST and a majority of them point against it each on its own, so no island can
  push the negation of the merged update up to the bound, and no minority can get an honest
  island's pushes refused by pushing against it;
- it claims more inner steps than one round of an island holds (STEP_ROUNDS x H + τ), or more
  tokens than those steps can carry (steps x batch x seqLen x the island's replicas): the merge
  weight grows with tokens² / steps, so an unbounded claim would take the whole merge;
- it claims more steps than the island can have taken by now (WorkRate: its wall-clock share at
  its step time, which a lie cannot make much shorter than the median island's), so no island
  can end a job early by claiming work back to back;
- in a job of fewer than MAJORITY_ISLANDS islands (with the movement cap on), its Δ moved less
  per claimed step than 1/EVIDENCE_RATIO of the other island's recent pushes do (WorkEvidence):
  what a push carries is evidence of the work it claims, so zero pushes that claim a round's
  most steps at a 1 ms step time earn no merge weight, no work fraction and no stopAfter tokens.

An island is not punished for one refusal (a diverging learner takes the global fragment and
recovers); maxRefusals refusals in a row drop it with the reason. Only refusals by rules no other
island moves count (the spec's caps and work bounds, non-finite values, and the learned bound
only when the push is an outlier by the island's own history as well), so no island can get
another dropped. The merge itself checks its
result (check_merged) before the outer step commits anything, and a merge that cannot be done
names the contributions it has to leave out (offenders) so the round goes on without them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from diloco_trainer.api import protocol
from diloco_trainer.api.manifest import SavedGuards
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.fold import abs_max
from diloco_trainer.core.push_bounds import STEP_ROUNDS, max_push_steps  # the learner's too
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake.direction import AGAINST, SAMPLE, Directions
from diloco_trainer.syncer.intake.payload import EncodedPayload

# AdamW moves an element by at most about lr per step (|m̂/√v̂| <= ~1.2 for betas (0.9, 0.95));
# the 'auto' cap allows four times that in every element at once.
ADAM_STEP_BOUND = 4.0
_T = TypeVar("_T")

# Accepted norms remembered per fragment and island for the learned bound (recent behaviour
# matters); an island's own median counts once it has OWN_MIN of them (one odd push cannot set a
# median of three).
ISLAND_WINDOW = 16
OWN_MIN = 3
REFUSED_STATUS = 422
# An island's claimed steps may run ahead of its step time by this factor (its stepTime is a
# recent average: warm-up, compiles and overlap make it uneven) ...
RATE_ALLOWANCE = 1.5
# ... and its step time counts as no less than the median island's over FASTEST (a claimed
# stepTime is the island's word; the median over islands is an honest majority's once at least
# MAJORITY_CLAIMS islands claim one: the median of two is half the liar's), nor less than
# MIN_STEP_TIME seconds. With fewer claims (a job of two) no island's claim moves another's bound.
FASTEST = 4.0
MIN_STEP_TIME = 1e-3
MAJORITY_CLAIMS = 3
# The learned norm bound is the median over islands of their own medians once at least
# MAJORITY_ISLANDS islands have norms of the fragment (f < M/2 cannot move it beyond the honest
# ones'); with fewer (a job of two: its median of two is half the attacker's) it is the smallest
# island's median, never below the floor of one AdamW round: one island of two can then push at
# most normFactor x the other's median (or the floor), so a ratchet gains nothing, and a
# near-zero flood lowers the other's bound to the floor only (an honest round's most).
MAJORITY_ISLANDS = 3
# Detection: an island whose last AT_BOUND_PUSHES judged pushes of a fragment were all at
# AT_BOUND x the learned bound or above it (refused) is reported (a health problem), the
# pattern of a ratchet or of an island spending the bound: honest pushes sit near the median.
AT_BOUND = 0.8
AT_BOUND_PUSHES = 8
# The most pushes (of a push's most steps) an island may claim at once per fragment.
BURST_PUSHES = 2
# Work evidence (a job of fewer than MAJORITY_ISLANDS islands with the movement cap on): a push
# whose Δ moved less than 1 / EVIDENCE_RATIO of the reference per claimed step is refused. The
# reference is the other islands' smallest median movement per claimed step, at most the movement
# cap's per-step share at MIN_LR_SHARE x inner.lr (the least a cosine schedule reaches:
# models/parts.MIN_LR_RATIO), so an island that pushes as much as the cap allows per claimed step
# cannot lift the bar the honest island is judged by above 1.5 x 0.1 / 32 = 0.0047 x lr per
# element and step: an honest AdamW step moves an element a tenth to a quarter of its lr (docs/
# adversaries.md), at least 0.01 x lr at the cosine's floor, twice that. Honest islands of one
# job move within a few times each other's figure per step; 32 leaves room for that.
EVIDENCE_RATIO = 32.0
MIN_LR_SHARE = 0.1
# An island whose last AT_BOUND_PUSHES judged pushes all moved less than 1 / FAINT_RATIO of the
# reference per claimed step is named too (the same health problem), though those above the bar
# are merged: an island that knows the bar can push faint noise just above it (bench/
# adversary.py's faint_claims; partial credit was built and taken out: docs/algorithm.md).
# Naming only by default: honest islands of one pace keep the largest figure of any 8 pushes in
# a row at 0.435 or more of the other's, but an honest island 3x faster under a cosine, further
# down its schedule, fell to 0.178 and was named in 5 of 16 honest jobs (bench/studies/
# faint_naming.py), so ending a job on it is syncer.guards.endOnFaint, off (docs/algorithm.md); an
# island pushing at the cap lifts the reference to 0.15 x lr per element and step, so an honest
# push at the cosine's floor (0.01 x lr) is then named under attack, never refused.
FAINT_RATIO = 4.0
# A saved figure is at most this (JSON has no infinity: a push judged against a reference of 0
# moved infinitely more than it); any figure that large reads the same to every rule here.
SAVED_MAX = 1e12


class ContributionRefused(Refused):
    """A well-formed push the guards refuse (422, code = the reason)."""

    def __init__(self, code: str, message: str, *, own_fault: bool = True) -> None:
        super().__init__(REFUSED_STATUS, message, code)
        # False: refused by a bound other islands' pushes set (gate.refused does not count it).
        self.own_fault = own_fault


@dataclass(frozen=True)
class DeltaStats:
    """What the guards need of a decoded pseudo-gradient."""

    norm: float  # L2 norm over every tensor (a lower bound when huge); nan when not finite
    finite: bool
    sample: Tensor | None = None  # direction.direction_sample when finite (None: not checked)


def delta_stats(payload: Mapping[str, Tensor]) -> DeltaStats:
    """The norm and finiteness of a decoded pseudo-gradient, without an fp64 copy: each tensor's
    max |x| first (inf/nan when not finite), its fp32 norm only when that cannot overflow, and
    its direction sample (direction.direction_sample's positions). A push kept encoded
    (payload.EncodedPayload) is read a slice at a time, with no decoded copy of it: its norm is
    then the slices' norms combined (the same up to rounding)."""
    total = 0.0
    numel = sum(t.numel() for t in _shapes(payload).values())
    stride = max(1, math.ceil(numel / SAMPLE))
    sample: list[Tensor] = []
    for name in sorted(_shapes(payload)):
        amax, sumsq = 0.0, 0.0
        for sl, piece in _pieces(payload, name):
            if not piece.numel():
                continue
            value = abs_max(piece)
            if not math.isfinite(value):
                return DeltaStats(math.nan, False)
            amax = max(amax, value)
            first = -(-sl.start // stride) * stride - sl.start  # the sample's positions
            if first < piece.numel():
                # a copy: an encoded push's slices share one buffer
                sample.append(piece[first::stride].float().clone())
            if amax <= 1e15:
                sumsq += float(torch.linalg.vector_norm(piece.float())) ** 2
        # Σx² could overflow fp32 beyond 1e15; |x|max alone is beyond any cap then
        total += amax * amax if amax > 1e15 else sumsq
    return DeltaStats(math.sqrt(total), True, torch.cat(sample) if sample else torch.zeros(0))


def _shapes(payload: Mapping[str, Tensor]) -> Mapping[str, torch.Size]:
    if isinstance(payload, EncodedPayload):
        return payload.expected
    return {name: t.shape for name, t in payload.items()}


def _pieces(payload: Mapping[str, Tensor], name: str) -> Iterator[tuple[slice, Tensor]]:
    """A tensor's decoded values: a slice at a time from an encoded push, else whole."""
    if isinstance(payload, EncodedPayload):
        yield from payload.slices(name)
        return
    t = payload[name]
    yield slice(0, t.numel()), t.reshape(-1)


def auto_norm_caps(
    spec: JobSpec, numels: Sequence[int], weight_norms: Sequence[float]
) -> list[float]:
    """Per fragment, the most AdamW can move it in one push: lr per step and element
    (ADAM_STEP_BOUND x), for STEP_ROUNDS x H + τ steps, plus weight decay of up to twice the
    fragment's weights, over 1 - mixAlpha (mixing keeps that share of the old deviation)."""
    steps = max_push_steps(spec)
    lr, wd = spec.inner.lr, spec.inner.weight_decay
    keep = 1.0 / (1.0 - spec.sync.mix_alpha)
    return [
        lr * steps * (ADAM_STEP_BOUND * math.sqrt(n) + 2.0 * wd * w) * keep
        for n, w in zip(numels, weight_norms, strict=True)
    ]


@dataclass(frozen=True)
class WorkBounds:
    """The work one push of an island may claim."""

    max_steps: int
    tokens_per_step: int  # batch x microBatches x seqLen, per replica

    @classmethod
    def from_spec(cls, spec: JobSpec) -> WorkBounds:
        return cls(max_push_steps(spec), spec.inner.tokens_per_step)

    def check(self, *, tokens: int, steps: int, replicas: int) -> None:
        """ContributionRefused when steps or tokens are more than one round allows."""
        if steps > self.max_steps:
            raise ContributionRefused(
                protocol.ERROR_STEPS_RANGE,
                f"metadata.steps {steps} is more than one push may carry ({self.max_steps}: "
                f"{STEP_ROUNDS} x inner.steps + sync.overlapSteps)",
            )
        most = steps * self.tokens_per_step * max(1, replicas)
        if tokens > most:
            raise ContributionRefused(
                protocol.ERROR_TOKENS_RANGE,
                f"metadata.tokens {tokens} is more than {steps} steps of {max(1, replicas)} "
                f"replica(s) can process ({most}: steps x inner.batchSize x inner.microBatches x "
                "inner.seqLen x replicas)",
            )


class WorkRate:
    """The steps each island may still claim: claims within one push's bounds, pushed back to
    back, would end a job (stopAfter) in seconds. A bucket per island holds BURST_PUSHES
    pushes' most per fragment (a learner cut off for a while sends its held pushes back to
    back) and fills at RATE_ALLOWANCE steps per step time of the island: what it last said
    (stepTime), but never less than the median island's over FASTEST, so a lie about its speed
    buys at most FASTEST x RATE_ALLOWANCE the median island's rate. The median counts once
    MAJORITY_CLAIMS islands claim a step time (own included): with f < M/2 it lies between
    honest claims, so a slow lie (stepTime 86400) cannot raise an honest island's floor above
    an honest claim / FASTEST; in a job of two it would be half the liar's, so there the floor
    is MIN_STEP_TIME only (README "Security": what M = 2 cannot promise)."""

    def __init__(self, burst: int, fragments: int) -> None:
        self.burst = float(BURST_PUSHES * burst * fragments)
        self.fragments = fragments  # each fragment's pushes carry the island's steps again
        self.buckets: dict[str, tuple[float, float]] = {}  # island -> (steps left, at)

    def step_time(self, claimed: float | None, islands: Sequence[float]) -> float:
        """The step time an island's credit fills at (seconds)."""
        known = [t for t in islands if t > 0]
        majority = len(known) >= MAJORITY_CLAIMS
        floor = statistics.median(known) / FASTEST if majority else MIN_STEP_TIME
        return max(claimed or 0.0, floor, MIN_STEP_TIME)

    def take(self, island: str, steps: int, step_time: float, now: float) -> None:
        """ContributionRefused when `steps` is more than the island's credit; else spent."""
        left, at = self.buckets.get(island, (self.burst, now))
        rate = RATE_ALLOWANCE * self.fragments / step_time
        left = min(self.burst, left + max(0.0, now - at) * rate)
        if steps > left:
            raise ContributionRefused(
                protocol.ERROR_STEPS_RANGE,
                f"metadata.steps {steps} is more than the island can have taken by now: "
                f"{left:.1f} steps of credit left, filling at {rate:.3g} steps/s "
                f"({RATE_ALLOWANCE:g} x {self.fragments} fragment(s) / {step_time:.3g} s a step)",
            )
        self.buckets[island] = (left - steps, now)


class WorkEvidence:
    """Each island's recent movement per claimed step (the norm of its accepted pushes' Δ over
    their steps), per fragment, and the bar a push's movement must clear for the steps it claims.

    At M = 2 a claimed step time is the island's own word, so its claimed work cannot be
    refuted by a vote; what its push carries can be: a Δ that moved nothing claimed work it did
    not do. The bar for island i is set by the other islands' figures (its own history cannot
    catch one that moved nothing from the start), capped by the spec's physics (`step_caps`), so
    no island can raise it above what the cap allows (class constants above); and a refusal by
    it never counts towards a drop (ContributionRefused.own_fault False): another island set it.
    """

    def __init__(self, step_caps: Sequence[float], window: int = ISLAND_WINDOW) -> None:
        self.step_caps = list(step_caps)
        self.window = window
        self.rates: list[dict[str, deque[float]]] = [{} for _ in self.step_caps]

    def reference(self, fragment: int, island: str) -> float | None:
        """The movement per step island is judged against: the smallest of the other islands'
        own medians (each with OWN_MIN pushes), at most the fragment's step cap; None before."""
        others = [
            statistics.median(d)
            for name, d in self.rates[fragment].items()
            if name != island and len(d) >= OWN_MIN
        ]
        if not others:
            return None
        return min(min(others), self.step_caps[fragment])

    def others(self, fragment: int, island: str) -> float | None:
        """The smallest of the other islands' own medians of movement per step (each with
        OWN_MIN pushes), not capped: pair_reference's figure; None before."""
        others = [
            statistics.median(d)
            for name, d in self.rates[fragment].items()
            if name != island and len(d) >= OWN_MIN
        ]
        return min(others) if others else None

    def bar(self, fragment: int, island: str, steps: int) -> float | None:
        """The least norm a push of `steps` claimed steps must have: steps x the reference /
        EVIDENCE_RATIO; None when nothing is judged (no reference yet, or no steps claimed)."""
        ref = self.reference(fragment, island)
        if ref is None or steps <= 0:
            return None
        return steps * ref / EVIDENCE_RATIO

    def record(self, fragment: int, island: str, norm: float, steps: int) -> None:
        if steps > 0:
            own = self.rates[fragment].setdefault(island, deque(maxlen=self.window))
            own.append(norm / steps)

    def saved(self) -> list[dict[str, list[float]]]:
        """Per fragment, each island's window (for checkpoints: SavedGuards.movement)."""
        return [{i: _saved(d) for i, d in sorted(f.items())} for f in self.rates]

    def restore(
        self, doc: Sequence[Mapping[str, Sequence[float]]], islands: Collection[str]
    ) -> None:
        """Load saved() (of `islands` only, each window's newest entries)."""
        for rates, saved in zip(self.rates, doc, strict=False):
            rates.update(_windows(saved, islands, self.window))


class NormHistory:
    """Recent accepted norms per fragment and island, and the robust median they give.

    Each island's window holds only its own accepted norms, and the job's statistic is the median
    over islands of each island's own median: with f of M islands (f < M/2) pushing whatever
    they like, it stays between the smallest and the largest honest island's median, so a flood
    of near-zero norms cannot lower it and a ratchet cannot raise it. Medians restored from a
    checkpoint stand in until the live islands have `warmup` norms again.
    """

    def __init__(self, fragments: int, window: int = ISLAND_WINDOW) -> None:
        self.window = window
        self.norms: list[dict[str, deque[float]]] = [{} for _ in range(fragments)]
        self.restored: list[list[float]] = [[] for _ in range(fragments)]

    def median(self, fragment: int, warmup: int) -> float | None:
        """The median over islands of each island's median, once the fragment has `warmup`
        norms (else the restored medians, else None); with fewer than MAJORITY_ISLANDS islands
        the smallest island's median (no majority: the median of two is half the larger)."""
        islands = [d for d in self.norms[fragment].values() if d]
        if sum(len(d) for d in islands) >= warmup:
            medians = [statistics.median(d) for d in islands]
            if len(medians) < MAJORITY_ISLANDS:
                return min(medians)
            return statistics.median(medians)
        restored = self.restored[fragment]
        if not restored:
            return None
        return min(restored) if len(restored) < MAJORITY_ISLANDS else statistics.median(restored)

    def own_median(self, fragment: int, island: str) -> float | None:
        """The island's own median, once it has OWN_MIN norms of the fragment."""
        own = self.norms[fragment].get(island)
        return statistics.median(own) if own is not None and len(own) >= OWN_MIN else None

    def record(self, fragment: int, island: str, norm: float) -> None:
        own = self.norms[fragment].setdefault(island, deque(maxlen=self.window))
        own.append(norm)

    def to_json(self) -> list[list[float]]:
        """Per fragment, each island's median (sorted by island), or the restored medians when
        no island has pushed since the start: what `median` needs after a restart."""
        out = []
        for f, islands in enumerate(self.norms):
            live = [statistics.median(islands[i]) for i in sorted(islands) if islands[i]]
            out.append(live or list(self.restored[f]))
        return out

    def restore(self, doc: Sequence[Sequence[float]]) -> None:
        """Load to_json() (or an older checkpoint's recent norms: the same median's input)."""
        for f, norms in enumerate(doc[: len(self.restored)]):
            self.restored[f] = [float(x) for x in norms if math.isfinite(float(x)) and x >= 0]


@dataclass
class ContributionGuard:
    """The checks of one job: work bounds, norm caps, the learned bound, refusal streaks."""

    work: WorkBounds
    caps: list[float]  # hard cap per fragment
    floors: list[float]  # the learned bound never goes below these (norm_floors)
    norm_factor: float
    warmup: int
    max_refusals: int
    history: NormHistory = field(init=False)
    rate: WorkRate = field(init=False)
    directions: Directions = field(init=False)
    # Work evidence (a job of two with the movement cap on), else None.
    evidence: WorkEvidence | None = None
    # syncer.guards.pairClip: with work evidence (a job of two), a push's Δ is held in its merge
    # to this x what the other island moves in its claimed steps, at most a round (pair_clip);
    # 0: off.
    pair_factor: float = 0.0
    # syncer.guards.pairCredit: with work evidence (a job of two), a push's merge credits at
    # most one round of its island's steps as work (pair_credit); False: all it claims.
    pair_credit_on: bool = False
    streaks: dict[str, int] = field(default_factory=dict)  # refusals in a row per island
    # Per (fragment, island): whether each of its last AT_BOUND_PUSHES judged pushes was at the
    # learned bound (AT_BOUND x it or above): the detection of suspects().
    at_bound: dict[tuple[int, str], deque[bool]] = field(default_factory=dict)
    # Per (fragment, island): each of its last AT_BOUND_PUSHES judged pushes' movement per
    # claimed step over the work evidence's reference: the detection of unsupported().
    carried: dict[tuple[int, str], deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.history = NormHistory(len(self.caps))
        self.rate = WorkRate(self.work.max_steps, len(self.caps))
        self.directions = Directions(len(self.caps))

    def take_steps(self, island: str, steps: int, step_time: float, now: float) -> None:
        """The island's claimed steps from its credit over time (WorkRate)."""
        self.rate.take(island, steps, step_time, now)

    def learned_bound(self, fragment: int) -> float | None:
        """normFactor x the median over islands, never below the fragment's floor; None
        before warm-up."""
        median = self.history.median(fragment, self.warmup)
        if median is None:
            return None
        return max(self.norm_factor * median, self.floors[fragment])

    def check_delta(self, fragment: int, island: str, stats: DeltaStats, steps: int = 0) -> None:
        """ContributionRefused unless the pseudo-gradient is finite, its norm within both the
        hard cap and the learned bound, and (work evidence) enough for its `steps`."""
        if not stats.finite:
            raise ContributionRefused(
                protocol.ERROR_NON_FINITE,
                f"push to fragment {fragment} decodes to NaN or Inf (a scale too large for fp32?)",
            )
        learned = self.learned_bound(fragment)
        if learned is not None:
            seen = self.at_bound.setdefault((fragment, island), deque(maxlen=AT_BOUND_PUSHES))
            seen.append(stats.norm >= AT_BOUND * learned)
        cap = self.caps[fragment]
        if stats.norm > cap:
            raise ContributionRefused(
                protocol.ERROR_NORM_CAP,
                f"push to fragment {fragment}: pseudo-gradient norm {stats.norm:.4g} is above the "
                f"cap {cap:.4g} (syncer.guards.maxDeltaNorm)",
            )
        learned = self.learned_bound(fragment)
        if learned is not None and stats.norm > learned:
            own = self.history.own_median(fragment, island)
            own_bound = None if own is None else max(self.norm_factor * own, self.floors[fragment])
            raise ContributionRefused(
                protocol.ERROR_NORM_OUTLIER,
                f"push to fragment {fragment}: pseudo-gradient norm {stats.norm:.4g} is above "
                f"{learned:.4g}: {self.norm_factor:g} x the median over islands of their recent "
                f"pushes (syncer.guards.normFactor), at least {self.floors[fragment]:.4g} (one "
                "round of AdamW at inner.lr per step and element)",
                # Only the island's own history can make this refusal count towards a drop:
                # the bound over islands is one no island can be dropped for alone.
                own_fault=own_bound is not None and stats.norm > own_bound,
            )
        self.check_evidence(fragment, island, stats.norm, steps)
        self.check_direction(fragment, island, stats)

    def contribution_clip(
        self, fragment: int, island: str, norm: float, steps: int, round_steps: int
    ) -> float:
        """What an accepted push's Δ is multiplied by in its merge: pair_clip against
        pair_reference (the other island's median movement per claimed step x the steps it
        claims, at most `round_steps`); 1 without work evidence (three or more islands, or the
        movement cap off) or with pairClip 0."""
        if self.evidence is None or self.pair_factor <= 0:
            return 1.0
        per_step = self.evidence.others(fragment, island)
        return pair_clip(norm, pair_reference(per_step, steps, round_steps), self.pair_factor)

    def credit_steps(self, steps: int, round_steps: int) -> int | None:
        """The most of an accepted push's `steps` its merge credits as work: pair_credit with
        work evidence (a job of two) and pairCredit on, else None (all of them)."""
        if self.evidence is None or not self.pair_credit_on:
            return None
        return pair_credit(steps, round_steps)

    def check_evidence(self, fragment: int, island: str, norm: float, steps: int) -> None:
        """ContributionRefused when the push moved less than the work evidence's bar for the
        steps it claims (WorkEvidence); never counted towards a drop: the other islands' pushes
        set the bar."""
        bar = None if self.evidence is None else self.evidence.bar(fragment, island, steps)
        if bar is None:
            return
        seen = self.carried.setdefault((fragment, island), deque(maxlen=AT_BOUND_PUSHES))
        # the share of the reference it moved per claimed step (bar x ratio = steps x reference)
        seen.append(norm / (bar * EVIDENCE_RATIO) if bar > 0 else math.inf)
        if norm < bar:
            raise ContributionRefused(
                protocol.ERROR_UNSUPPORTED_WORK,
                f"push to fragment {fragment}: pseudo-gradient norm {norm:.4g} is below "
                f"{bar:.4g}, 1/{EVIDENCE_RATIO:g} of what the other island's pushes move in the "
                f"{steps} steps it claims: the work it claims is not in what it carries",
                own_fault=False,
            )

    def check_direction(self, fragment: int, island: str, stats: DeltaStats) -> None:
        """ContributionRefused when the push points against the other islands' recent pushes
        and a majority of them against it on their own (direction.py); never counted towards a
        drop: the others' pushes decide it."""
        if stats.sample is None:
            return
        verdict = self.directions.judge(fragment, island, stats.sample)
        if verdict is not None and verdict.refused:
            raise ContributionRefused(
                protocol.ERROR_NORM_OUTLIER,
                f"push to fragment {fragment} points against the other islands' recent pushes "
                f"(cosine {verdict.cosine:.3f}, below {AGAINST:g}; {verdict.against} of "
                f"{verdict.others} each below {verdict.one_against:.3f}): not a descent they "
                "share",
                own_fault=False,
            )

    def suspects(self) -> dict[str, str]:
        """Islands whose last AT_BOUND_PUSHES judged pushes of a fragment were all at AT_BOUND x
        the learned bound or above it, each with what it did: a ratchet, or an island spending
        the bound the others' history gives it (honest pushes sit near the median, a tenth of
        the bound at normFactor 10). In a job of two the bound holds it, this names it."""
        out: dict[str, str] = {}
        for (fragment, island), seen in sorted(self.at_bound.items()):
            if island not in out and len(seen) == AT_BOUND_PUSHES and all(seen):
                out[island] = (
                    f"island {island}'s last {AT_BOUND_PUSHES} pushes to fragment {fragment} were "
                    f"all at {AT_BOUND:g} x the learned norm bound or above it (a ratchet, or an "
                    "island pushing as far as the bound lets it)"
                )
        return out

    def unsupported(self, ratio: float = EVIDENCE_RATIO) -> dict[str, str]:
        """Islands whose last AT_BOUND_PUSHES judged pushes of a fragment all moved less than
        1 / `ratio` of the work evidence's reference per claimed step, each with what it did: it
        claims work its pushes do not carry (zero pushes with a round's most steps, issue 46's
        fast claims at M = 2). At EVIDENCE_RATIO each of those pushes was refused; at
        FAINT_RATIO (faint()) those above the bar were merged."""
        out: dict[str, str] = {}
        for (fragment, island), seen in sorted(self.carried.items()):
            if island in out or len(seen) < AT_BOUND_PUSHES or max(seen) >= 1.0 / ratio:
                continue
            refused = ratio >= EVIDENCE_RATIO
            out[island] = (
                f"island {island}'s last {AT_BOUND_PUSHES} pushes to fragment {fragment} moved "
                f"less than 1/{ratio:g} of the other island's movement per claimed step (work "
                "claimed that its pushes do not carry); "
                + (
                    "refused, and it is left out of the islands a round spans"
                    if refused
                    else "those above 1/32 of it are merged with the weight their claims earn"
                )
            )
        return out

    def faint(self) -> dict[str, str]:
        """Islands whose recent pushes all moved less than 1/FAINT_RATIO of the reference per
        claimed step (named only, not refused: unsupported's bar is 1/EVIDENCE_RATIO)."""
        return self.unsupported(FAINT_RATIO)

    def faint_merged(self) -> dict[str, str]:
        """Islands whose last AT_BOUND_PUSHES judged pushes of a fragment all moved less than
        1/FAINT_RATIO of the reference per claimed step, at least one of them at or above the
        bar (1/EVIDENCE_RATIO: accepted, merged with the weight its claims earn): faint noise
        with claims, which a job of two cannot bound, only stop (gate.Gate.faint_end). An
        island whose pushes in that window were all refused merged none of them; unsupported()
        leaves it out of the rounds instead, and nothing need stop."""
        out: dict[str, str] = {}
        for (fragment, island), seen in sorted(self.carried.items()):
            if island in out or len(seen) < AT_BOUND_PUSHES:
                continue
            if 1.0 / EVIDENCE_RATIO <= max(seen) < 1.0 / FAINT_RATIO:
                out[island] = (
                    f"island {island}'s last {AT_BOUND_PUSHES} pushes to fragment {fragment} "
                    f"moved less than 1/{FAINT_RATIO:g} of the other island's movement per "
                    f"claimed step, and those above 1/{EVIDENCE_RATIO:g} of it were merged with "
                    "the weight their claims earn"
                )
        return out

    def forget(self, island: str) -> None:
        """An island dropped or gone: its detection starts again when it is back."""
        for table in (self.at_bound, self.carried):
            for key in [k for k in table if k[1] == island]:
                del table[key]

    def saved(self) -> SavedGuards:
        """The per-island figures a restart must keep (api/manifest.SavedGuards): the work
        evidence's movement, the detection's windows and the refusal streaks."""
        fragments = len(self.caps)
        return SavedGuards(
            movement=[] if self.evidence is None else self.evidence.saved(),
            carried=_by_fragment(self.carried, fragments, _saved),
            at_bound=_by_fragment(self.at_bound, fragments, list),
            streaks=dict(sorted(self.streaks.items())),
        )

    def restore(self, saved: SavedGuards | None, islands: Collection[str]) -> None:
        """Load saved() from a checkpoint whose island records are `islands` (an island the
        checkpoint has no record of is no island of the job's); None (an older checkpoint):
        nothing, the figures start afresh."""
        if saved is None:
            return
        if self.evidence is not None:
            self.evidence.restore(saved.movement, islands)
        for fragment, windows in enumerate(saved.carried[: len(self.caps)]):
            for island, d in _windows(windows, islands, AT_BOUND_PUSHES).items():
                self.carried[(fragment, island)] = d
        for fragment, flags in enumerate(saved.at_bound[: len(self.caps)]):
            for island, seen in flags.items():
                if island in islands:
                    self.at_bound[(fragment, island)] = deque(
                        (bool(x) for x in seen), maxlen=AT_BOUND_PUSHES
                    )
        self.streaks.update(
            {i: n for i, n in saved.streaks.items() if i in islands and 0 < n < self.max_refusals}
        )

    def accepted(self, fragment: int, island: str, stats: DeltaStats, steps: int = 0) -> None:
        self.history.record(fragment, island, stats.norm)
        if self.evidence is not None:
            self.evidence.record(fragment, island, stats.norm, steps)
        if stats.sample is not None:
            self.directions.record(fragment, island, stats.sample)
        self.streaks.pop(island, None)

    def refused(self, island: str, err: Refused) -> bool:
        """Count a refusal; True when the island has now been refused maxRefusals times in a
        row (the caller drops it, and the streak starts again). A refusal by a bound other
        islands' pushes set (ContributionRefused.own_fault False) neither counts nor resets."""
        if isinstance(err, ContributionRefused) and not err.own_fault:
            return False
        streak = self.streaks.get(island, 0) + 1
        if self.max_refusals and streak >= self.max_refusals:
            self.streaks.pop(island, None)
            return True
        self.streaks[island] = streak
        return False


def _saved(window: Sequence[float]) -> list[float]:
    """A window of figures as JSON can hold them (SAVED_MAX for an infinite one)."""
    return [min(float(x), SAVED_MAX) for x in window]


def _by_fragment(
    table: Mapping[tuple[int, str], Sequence[float]],
    fragments: int,
    saved: Callable[[Sequence[float]], list[_T]],
) -> list[dict[str, list[_T]]]:
    """A (fragment, island) table as SavedGuards keeps it: per fragment, island -> window."""
    out: list[dict[str, list[_T]]] = [{} for _ in range(fragments)]
    for (fragment, island), window in sorted(table.items()):
        out[fragment][island] = saved(window)
    return out


def _windows(
    doc: Mapping[str, Sequence[float]], islands: Collection[str], length: int
) -> dict[str, deque[float]]:
    """Saved windows of the job's `islands` only, each its newest `length` figures of at
    least 0 (a negative or NaN one, which no syncer writes, is left out), at most SAVED_MAX."""
    return {
        island: deque(_saved([x for x in window if float(x) >= 0]), maxlen=length)
        for island, window in doc.items()
        if island in islands
    }


def norm_floors(spec: JobSpec, numels: Sequence[int], caps: Sequence[float]) -> list[float]:
    """Per fragment, the least the learned bound can be: one round of AdamW (inner.steps) moving
    every element by inner.lr per step, lr x H x sqrt(numel), at most the hard cap. An honest
    round moves an element by at most about that (|m̂/√v̂| <= ~1), so no flood of small norms
    can make an honest push an outlier, and what the bound lets through is no more than one
    honest round could move."""
    lr, steps = spec.inner.lr, spec.inner.steps
    return [min(lr * steps * math.sqrt(n), cap) for n, cap in zip(numels, caps, strict=True)]


def movement_caps(spec: JobSpec, numels: Sequence[int]) -> list[float] | None:
    """Per fragment, the most a merge's pseudo-gradient per round of work (g, which the outer
    step applies as lr x φ x g: core/contributions.py) may be in a job of fewer than
    MAJORITY_ISLANDS islands: syncer.guards.movementFactor x one honest round of AdamW at its
    most, inner.lr x inner.steps x sqrt(numel) / (1 - sync.mixAlpha) (every element moved by
    lr each step, all in one direction; mixing keeps that share of the old deviation). None when
    the job has a majority to learn bounds from (three or more islands) or the factor is 0.

    Why the spec and not the job's history: with two islands either may be the bad one, so no
    statistic of their pushes is the honest one's (the smaller median can be flooded down, the
    larger ratcheted up); what one round of AdamW can move is the spec's, no island's word, and
    an honest round is within it (|m/sqrt(v)| <= ~1 per element, mostly far less: a tenth to a
    quarter measured). A bad island's push of one claimed step whose norm is at the learned
    bound is a g of H x that bound (its vector is scaled to one round of work): the clip bounds
    what each claimed round of its work moves the model to what an honest round can."""
    factor = spec.syncer.guards.movement_factor
    if factor <= 0 or spec.total_shards() >= MAJORITY_ISLANDS:
        return None
    lr, steps = spec.inner.lr, spec.inner.steps
    keep = 1.0 / (1.0 - spec.sync.mix_alpha)
    return [factor * lr * steps * math.sqrt(n) * keep for n in numels]


def pair_clip(norm: float, reference: float | None, factor: float) -> float:
    """What a push's pseudo-gradient is multiplied by in its merge in a job of two
    (syncer.guards.pairClip = `factor`): 1 when its norm is at most factor x `reference`, else
    factor x reference / norm; 1 when nothing judges it (factor 0, no reference yet, a norm of 0
    or not finite: the guard refuses such a push before). The reference (pair_reference) is
    what the other island moves in the steps the push claims, counting at most one round."""
    if factor <= 0 or reference is None or not (math.isfinite(norm) and norm > 0):
        return 1.0
    most = factor * reference
    return 1.0 if norm <= most else most / norm


def pair_credit(steps: int, round_steps: int) -> int | None:
    """The steps a push claiming `steps` is credited with as work in a job of two
    (syncer.guards.pairCredit): at most one round of its island's own (`round_steps`, H_i +
    sync.overlapSteps, which the syncer assigns, not the island); None when that is all it
    claims. Why: its merge carries φ = w·d / M of a round (w = credited steps / H) and every
    round φ completes folds the outer momentum once (core/outer.py), so an island claiming
    4 rounds a push at M = 2 made each merge of it alone fold twice, spending the honest
    island's momentum (issue 46's loud claims). Its Δ still moves θ by lr·d·Δ/M: the vector is
    scaled by 1 / w (core/contributions.credited_work). pair_credit(40, 12) == 12."""
    if steps <= round_steps:
        return None
    return max(1, round_steps)


def pair_reference(per_step: float | None, steps: int, round_steps: int) -> float | None:
    """The norm pair_clip holds a push of `steps` claimed steps to (before the factor): the
    other island's median movement per claimed step (WorkEvidence.others) x its steps, at most
    one round's (`round_steps`, the island's H_i + sync.overlapSteps). Why both: a push moves θ
    by lr x its Δ / M in the outer step whatever it claims (φ x g = Σ d_i Δ_i / M,
    core/contributions.py), so per step alone lets noise claiming 4 x H steps in one push kick
    the model 4 rounds' worth at once (the benchmark's loud_claims: 6.7 where the honest
    island's pushes move 1.5-3.2, at 0.167 a claimed step against the honest 0.15-0.31), and
    per push alone holds an island whose round is longer (stepsPerIsland auto: a 3x faster
    island's H_i) to a slower island's shorter pushes. None before there is a figure."""
    if per_step is None or steps <= 0:
        return None
    return per_step * min(steps, round_steps)


def clip_scale(norm: float, cap: float) -> float:
    """What a merged pseudo-gradient of `norm` is multiplied by to be at most `cap`: 1 when it
    is within (or its norm is 0), cap / norm above it; 0 for a norm that is not finite (its
    elements are bounded: merge_checks.MAX_MERGED_ABS, so only their sum of squares overflowed)."""
    if not math.isfinite(norm):
        return 0.0
    return 1.0 if norm <= cap else cap / norm


def make_guard(
    spec: JobSpec, numels: Sequence[int], weight_norms: Sequence[float]
) -> ContributionGuard:
    """The guard of a job whose fragments hold `numels` elements of norms `weight_norms`."""
    g = spec.syncer.guards
    if g.max_delta_norm == "auto":
        caps = auto_norm_caps(spec, numels, weight_norms)
    else:
        caps = [float(g.max_delta_norm)] * len(numels)
    moves = movement_caps(spec, numels)
    return ContributionGuard(
        work=WorkBounds.from_spec(spec),
        caps=caps,
        floors=norm_floors(spec, numels, caps),
        norm_factor=g.norm_factor,
        warmup=g.warmup_pushes,
        max_refusals=g.max_refusals,
        evidence=None if moves is None else WorkEvidence(evidence_step_caps(spec, moves)),
        pair_factor=g.pair_clip,
        pair_credit_on=g.pair_credit,
    )


def evidence_step_caps(spec: JobSpec, moves: Sequence[float]) -> list[float]:
    """Per fragment, the most the work evidence's reference per step can be: the movement cap
    of a round (movement_caps) per step, at MIN_LR_SHARE of inner.lr."""
    return [MIN_LR_SHARE * cap / spec.inner.steps for cap in moves]
