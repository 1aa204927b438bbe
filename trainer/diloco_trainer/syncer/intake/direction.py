"""A push's direction against the other islands' recent pushes (the guards' direction check).

The norm bounds (guards.py) cannot see where a push points: an island that pulls the global
weights sees the last merged update and can push its negation, scaled up to the learned bound,
and with its merge weight move the model backwards ("sign flip"). Honest islands train the same
model on the same distribution from the same weights, so their pseudo-gradients agree in
direction: the cosine of one island's push with the others' is positive, near zero late in
training, and never anywhere near -1.

The check is cheap: each push is sampled at SAMPLE fixed positions (every stride-th element of
each tensor, in name order: the same positions for every push of a fragment), and compared with
the n other islands' latest accepted pushes (one vote per island, however often it pushes, so a
flooding island cannot become the reference), only with n >= MIN_OTHERS of them. A push is
refused when both

- its cosine with the sum of their unit samples (the consensus) is below AGAINST, and
- a strict majority of them (more than n / 2) point against it each on its own: its cosine with
  that island's sample is below AGAINST / sqrt(n) (what each of n orthogonal votes sees of a
  push at exactly AGAINST to their sum: cos(p, sum) = sum of cos(p, u_i) / sqrt(n)).

The second rule is the one that keeps the check from being turned against an honest island: an
adversary that knows an island's direction can push against it (cosine near -1 with that island
alone) while staying above AGAINST against the consensus itself; with n = 2 its one vote then
pulled the honest island's consensus below AGAINST, and every push of that island was refused.
A majority of the others that excludes the island judged must now point against it, and with
f < M/2 adversaries (at most n / 2 of the n others) such a majority holds at least one honest
island pointing against it on its own: an adversary's votes alone never refuse anybody. A sign
flip of the others' descent still is refused: against each of n_h honest votes it is at about
-1/sqrt(n_h) or below, under AGAINST / sqrt(n) for n_h >= n / 2 (and -0.707 for n = 2).

A refusal by this check is one other islands' pushes decide, so it never counts towards dropping
the island (guards.ContributionRefused.own_fault).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Elements sampled from a push (the cosine of samples this long is within about 1/sqrt(SAMPLE)
# of the full vectors'); the samples kept are SAMPLE x 4 bytes per island and fragment.
SAMPLE = 16384
# A push whose cosine with the other islands' latest pushes is below this is refused: pointing
# against them (sign flip, ascent), not a different but honest view of the same descent.
AGAINST = -0.5
# Other islands' pushes needed before the check applies: with one other island there is no
# majority to compare with. Each island's latest push counts however old it is: aging by the
# pushes since would let a flooding island push the others' votes out (training's direction
# drifts slowly: an old honest vote still points along a descent, cosine >= 0 with today's).
MIN_OTHERS = 2


def direction_sample(payload: Mapping[str, Tensor], size: int = SAMPLE) -> Tensor:
    """Every stride-th element of each tensor (sorted by name), stride = ceil(total / size):
    the same positions for every push of a fragment; fp32."""
    total = sum(t.numel() for t in payload.values())
    stride = max(1, math.ceil(total / size))
    parts = [
        payload[n].reshape(-1)[::stride].float() for n in sorted(payload) if payload[n].numel()
    ]
    return torch.cat(parts) if parts else torch.zeros(0)


def cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b) in fp64; 0 when either is zero (no direction)."""
    na, nb = (
        float(torch.linalg.vector_norm(a.double())),
        float(torch.linalg.vector_norm(b.double())),
    )
    if na == 0.0 or nb == 0.0 or not (math.isfinite(na) and math.isfinite(nb)):
        return 0.0
    return float(a.double() @ b.double()) / (na * nb)


def consensus(samples: Sequence[Tensor]) -> Tensor:
    """The sum of the samples' unit vectors (zero samples left out): one vote each."""
    out = torch.zeros_like(samples[0], dtype=torch.float64)
    for s in samples:
        norm = float(torch.linalg.vector_norm(s.double()))
        if norm > 0.0 and math.isfinite(norm):
            out += s.double() / norm
    return out


class Directions:
    """Each island's latest accepted push sample, per fragment (as many as the syncer keeps
    island records: admission.py bounds them)."""

    def __init__(self, fragments: int) -> None:
        self.latest: list[dict[str, Tensor]] = [{} for _ in range(fragments)]

    def record(self, fragment: int, island: str, sample: Tensor) -> None:
        self.latest[fragment][island] = sample

    def others(self, fragment: int, island: str, sample: Tensor) -> list[Tensor]:
        """The other islands' latest samples of the same shape as `sample`."""
        return [
            s
            for name, s in self.latest[fragment].items()
            if name != island and s.shape == sample.shape
        ]

    def against_others(self, fragment: int, island: str, sample: Tensor) -> float | None:
        """The push's cosine with the other islands' recent pushes, or None with fewer than
        MIN_OTHERS of them."""
        others = self.others(fragment, island, sample)
        if len(others) < MIN_OTHERS:
            return None
        return cosine(sample, consensus(others))

    def judge(self, fragment: int, island: str, sample: Tensor) -> DirectionVerdict | None:
        """The push against the other islands (the module's two rules), or None with fewer than
        MIN_OTHERS of them."""
        others = self.others(fragment, island, sample)
        if len(others) < MIN_OTHERS:
            return None
        each = [cosine(sample, s) for s in others]
        one = AGAINST / math.sqrt(len(others))
        return DirectionVerdict(
            cosine=cosine(sample, consensus(others)),
            against=sum(1 for c in each if c < one),
            others=len(others),
        )


@dataclass(frozen=True)
class DirectionVerdict:
    """A push's direction against the n other islands' latest pushes."""

    cosine: float  # with their consensus (the sum of their unit samples)
    against: int  # how many of them point against it on their own (below AGAINST / sqrt(n))
    others: int  # n

    @property
    def refused(self) -> bool:
        """Below AGAINST against the consensus, and a strict majority of them against it."""
        return self.cosine < AGAINST and 2 * self.against > self.others

    @property
    def one_against(self) -> float:
        """The threshold of one vote: AGAINST / sqrt(n)."""
        return AGAINST / math.sqrt(self.others)
