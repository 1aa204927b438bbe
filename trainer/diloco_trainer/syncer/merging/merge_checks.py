"""The checks of a merge's input and result: which contributions are at fault when a round
cannot be merged (offenders), and a merged pseudo-gradient that the outer step may apply
(check_merged: finite, below MAX_MERGED_ABS in every element)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import Tensor

from diloco_trainer.core.fold import abs_max
from diloco_trainer.core.merge import contribution_weight
from diloco_trainer.syncer.intake import delta_stats
from diloco_trainer.syncer.state import Contribution

# A merged pseudo-gradient with an element beyond this is refused before the outer step: with
# finite weights and momentum the step then cannot overflow fp32 (max 3.4e38).
MAX_MERGED_ABS = 1e30


class MergeInputError(ValueError):
    """A round that cannot be merged as it is (nothing has been changed)."""


def check_merged(fragment: int, merged: Mapping[str, Tensor]) -> None:
    """MergeInputError unless every element of the merged pseudo-gradient is finite and below
    MAX_MERGED_ABS (then the outer step on finite weights and momentum stays finite)."""
    for name, t in merged.items():
        if not t.numel():
            continue
        amax = abs_max(t)
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
