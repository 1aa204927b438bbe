"""Checks every pushed pseudo-gradient passes before it can touch the global model.

Any holder of the job's token, or an island whose training diverged, can push. A push that is
well formed (validation.py) is still refused, with 422 and a code naming the reason
(protocol.CONTRIBUTION_REFUSALS), when

- its decoded values are not finite: a codec's finite scale (int8 with 3e38) can decode to inf;
- its L2 norm is above the fragment's hard cap: syncer.guards.maxDeltaNorm, or 'auto', the most
  AdamW can move the fragment in one round (auto_norm_caps);
- its norm is above normFactor x the median of the fragment's recent accepted norms, once the
  fragment has warmupPushes of them: a bound learned from the job's own history (NormHistory),
  so a blown-up Δ is refused long before it reaches the hard cap;
- it claims more inner steps than one round of an island holds (STEP_ROUNDS x H + τ), or more
  tokens than those steps can carry (steps x batch x seqLen x the island's replicas): the merge
  weight grows with tokens² / steps, so an unbounded claim would take the whole merge.

An island is not punished for one refusal (a diverging learner takes the global fragment and
recovers); maxRefusals refusals in a row drop it with the reason. The merge itself checks its
result (check_merged) before the outer step commits anything, and a merge that cannot be done
names the contributions it has to leave out (offenders) so the round goes on without them.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.merge import contribution_weight
from diloco_trainer.syncer.records import Contribution, Refused

# A push may hold this many rounds of an island's steps (plus the overlap): a learner pushes each
# fragment once per H steps, a little later after phase alignment or a slow merge.
STEP_ROUNDS = 4
# AdamW moves an element by at most about lr per step (|m̂/√v̂| <= ~1.2 for betas (0.9, 0.95));
# the 'auto' cap allows four times that in every element at once.
ADAM_STEP_BOUND = 4.0
# Accepted norms remembered per fragment for the learned bound (recent behaviour matters).
NORM_WINDOW = 64
# A merged pseudo-gradient with an element beyond this is refused before the outer step: with
# finite weights and momentum the step then cannot overflow fp32 (max 3.4e38).
MAX_MERGED_ABS = 1e30
REFUSED_STATUS = 422


class ContributionRefused(Refused):
    """A well-formed push the guards refuse (422, code = the reason)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(REFUSED_STATUS, message, code)


class MergeInputError(ValueError):
    """A round that cannot be merged as it is (nothing has been changed)."""


@dataclass(frozen=True)
class DeltaStats:
    """What the guards need of a decoded pseudo-gradient."""

    norm: float  # L2 norm over every tensor (a lower bound when huge); nan when not finite
    finite: bool


def delta_stats(payload: Mapping[str, Tensor]) -> DeltaStats:
    """The norm and finiteness of a decoded pseudo-gradient, without an fp64 copy: each tensor's
    max |x| first (inf/nan when not finite), its fp32 norm only when that cannot overflow."""
    total = 0.0
    for t in payload.values():
        if not t.numel():
            continue
        amax = float(torch.linalg.vector_norm(t, ord=math.inf))
        if not math.isfinite(amax):
            return DeltaStats(math.nan, False)
        if amax > 1e15:  # Σx² could overflow fp32; |x|max alone is beyond any cap
            total += amax * amax
            continue
        total += float(torch.linalg.vector_norm(t.float())) ** 2
    return DeltaStats(math.sqrt(total), True)


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


def max_push_steps(spec: JobSpec) -> int:
    """The most inner steps one push may carry: STEP_ROUNDS x H + τ."""
    return STEP_ROUNDS * spec.inner.steps + (spec.sync.overlap_steps or 0)


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


class NormHistory:
    """Recent accepted norms per fragment, and the bound they give."""

    def __init__(self, fragments: int, window: int = NORM_WINDOW) -> None:
        self.norms: list[deque[float]] = [deque(maxlen=window) for _ in range(fragments)]

    def bound(self, fragment: int, factor: float, warmup: int) -> float | None:
        """factor x the median of the fragment's recent norms, once it has `warmup` of them."""
        norms = self.norms[fragment]
        if len(norms) < warmup:
            return None
        return factor * statistics.median(norms)

    def record(self, fragment: int, norm: float) -> None:
        self.norms[fragment].append(norm)

    def to_json(self) -> list[list[float]]:
        return [list(d) for d in self.norms]

    def restore(self, doc: Sequence[Sequence[float]]) -> None:
        for d, norms in zip(self.norms, doc, strict=False):
            d.extend(float(x) for x in norms if math.isfinite(float(x)) and float(x) >= 0)


@dataclass
class ContributionGuard:
    """The checks of one job: work bounds, norm caps, the learned bound, refusal streaks."""

    work: WorkBounds
    caps: list[float]  # hard cap per fragment
    norm_factor: float
    warmup: int
    max_refusals: int
    history: NormHistory = field(init=False)
    streaks: dict[str, int] = field(default_factory=dict)  # refusals in a row per island

    def __post_init__(self) -> None:
        self.history = NormHistory(len(self.caps))

    def check_work(self, *, tokens: int, steps: int, replicas: int) -> None:
        self.work.check(tokens=tokens, steps=steps, replicas=replicas)

    def check_delta(self, fragment: int, stats: DeltaStats) -> None:
        """ContributionRefused unless the pseudo-gradient is finite and its norm within both
        the hard cap and the learned bound."""
        if not stats.finite:
            raise ContributionRefused(
                protocol.ERROR_NON_FINITE,
                f"push to fragment {fragment} decodes to NaN or Inf (a scale too large for fp32?)",
            )
        cap = self.caps[fragment]
        if stats.norm > cap:
            raise ContributionRefused(
                protocol.ERROR_NORM_CAP,
                f"push to fragment {fragment}: pseudo-gradient norm {stats.norm:.4g} is above the "
                f"cap {cap:.4g} (syncer.guards.maxDeltaNorm)",
            )
        learned = self.history.bound(fragment, self.norm_factor, self.warmup)
        if learned is not None and stats.norm > learned:
            raise ContributionRefused(
                protocol.ERROR_NORM_OUTLIER,
                f"push to fragment {fragment}: pseudo-gradient norm {stats.norm:.4g} is more than "
                f"{self.norm_factor:g} x the median of the fragment's recent pushes "
                f"({learned / self.norm_factor:.4g}; syncer.guards.normFactor)",
            )

    def accepted(self, fragment: int, island: str, stats: DeltaStats) -> None:
        self.history.record(fragment, stats.norm)
        self.streaks.pop(island, None)

    def refused(self, island: str) -> bool:
        """Count a refusal; True when the island has now been refused maxRefusals times in a
        row (the caller drops it, and the streak starts again)."""
        streak = self.streaks.get(island, 0) + 1
        if self.max_refusals and streak >= self.max_refusals:
            self.streaks.pop(island, None)
            return True
        self.streaks[island] = streak
        return False


def make_guard(
    spec: JobSpec, numels: Sequence[int], weight_norms: Sequence[float]
) -> ContributionGuard:
    """The guard of a job whose fragments hold `numels` elements of norms `weight_norms`."""
    g = spec.syncer.guards
    if g.max_delta_norm == "auto":
        caps = auto_norm_caps(spec, numels, weight_norms)
    else:
        caps = [float(g.max_delta_norm)] * len(numels)
    return ContributionGuard(
        work=WorkBounds.from_spec(spec),
        caps=caps,
        norm_factor=g.norm_factor,
        warmup=g.warmup_pushes,
        max_refusals=g.max_refusals,
    )


def check_merged(fragment: int, merged: Mapping[str, Tensor]) -> None:
    """MergeInputError unless every element of the merged pseudo-gradient is finite and below
    MAX_MERGED_ABS (then the outer step on finite weights and momentum stays finite)."""
    for name, t in merged.items():
        if not t.numel():
            continue
        amax = float(torch.linalg.vector_norm(t, ord=math.inf))
        if not (math.isfinite(amax) and amax <= MAX_MERGED_ABS):
            raise MergeInputError(
                f"merged pseudo-gradient of fragment {fragment} has |{name}| max {amax:.4g}"
            )


def offenders(contributions: Sequence[Contribution], rule: str) -> list[str]:
    """Islands whose contributions a merge cannot take: a weight that is not finite, or values
    that are not finite or beyond MAX_MERGED_ABS (they passed the guards only if the guards were
    bypassed or changed)."""
    bad = []
    for c in contributions:
        try:
            weight = contribution_weight(c.tokens, c.steps, rule)
        except (ValueError, OverflowError):
            weight = math.inf
        stats = delta_stats(c.payload)
        if not (math.isfinite(weight) and stats.finite and stats.norm <= MAX_MERGED_ABS):
            bad.append(c.island)
    return bad
