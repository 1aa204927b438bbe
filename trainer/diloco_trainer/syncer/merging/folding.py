"""Each fragment's round folded as its pushes arrive, and the pushes kept encoded.

Memory flat in the number of islands: an accepted push is folded into its fragment's accumulator
(core/fold.py) with the weight and scale its merge will give it (core/contributions.py: they
depend on its own tokens, steps and staleness only; staleness cannot change while its round is
open, as only this fragment's merge moves its clock, and that merge takes the round). The decoded
fp32 copy is then dropped; the contribution keeps its still-encoded tensors (EncodedPayload, the
int8 body at a quarter of fp32) for the rare merge that must leave an offender out, spilled to a
file under the state dir (`RoundFolds.spill_to`), so what a round holds in memory does not grow
with the number of islands; the file is deleted with the contribution.

The merge uses the fold when it holds exactly the round's contributions with the plan's weights
and scales; otherwise (a push replaced by its island's newer one, contributions left out by a
failed merge, a fold that failed) it merges the encoded payloads again the batch way, decoding a
tensor at a time. Either way the result is the batch merge's, up to rounding.

Synchronous: the push path folds in a worker thread with the service's lock held, the merge
takes the fold with the same lock held.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_trainer.core.contributions import Contributor, MergePlan, plan_merge
from diloco_trainer.core.fold import MergeFold, SlicedVectors
from diloco_trainer.syncer.intake import EncodedPayload
from diloco_trainer.syncer.state import Contribution

log = logging.getLogger("diloco.syncer")


@dataclass
class _Folded:
    fold: MergeFold
    # What went in, in order: the contributions (by identity) and their weight and scale.
    items: list[tuple[Contribution, float, float]] = field(default_factory=list)


class RoundFolds:
    """The folds of one job's open rounds, one per fragment with pushes (not thread-safe: the
    caller holds the service's lock)."""

    def __init__(
        self, fragments: int, *, rule: str, inner_steps: int, plain_names: frozenset[str]
    ) -> None:
        self.rule = rule
        self.inner_steps = inner_steps
        self.plain_names = plain_names
        self._folds: list[_Folded | None] = [None] * fragments
        self.spill_dir: Path | None = None  # where folded pushes' encoded tensors go (spill_to)
        # Where a fragment's new fold accumulates (global_model.py: the memory its next pull
        # body is written in); None: new tensors.
        self.buffers: Callable[[int], Mapping[str, torch.Tensor]] | None = None

    def spill_to(self, directory: Path) -> None:
        """Spill each folded push's encoded tensors to a file under `directory` (emptied now:
        what a previous process left there belongs to rounds that are gone)."""
        shutil.rmtree(directory, ignore_errors=True)
        self.spill_dir = directory

    def weight_and_scale(
        self, contribution: Contribution, lag_rounds: float
    ) -> tuple[float, float]:
        """The weight ρ and scale s the merge plan gives this contribution (core/contributions)."""
        plan = plan_merge(
            [Contributor(contribution.tokens, contribution.steps, lag_rounds)],
            rule=self.rule,
            inner_steps=self.inner_steps,
            islands=1,
        )
        return plan.weights[0], plan.scales[0]

    def add(
        self,
        f: int,
        contribution: Contribution,
        decoded: Mapping[str, torch.Tensor] | SlicedVectors,
        lag_rounds: float,
    ) -> bool:
        """Fold an accepted contribution's pseudo-gradient (decoded, or its EncodedPayload,
        decoded a slice at a time into the accumulator) into fragment f's round;
        False when it cannot be (logged; the fold is dropped and the merge merges the encoded
        payloads, which meets the same error where the merge's guards can handle it)."""
        folded = self._folds[f]
        try:
            weight, scale = self.weight_and_scale(contribution, lag_rounds)
            if folded is None:
                buffer = self.buffers(f) if self.buffers is not None else None
                folded = self._folds[f] = _Folded(MergeFold(self.rule, self.plain_names, buffer))
            folded.fold.add(decoded, weight, scale)
        except (ValueError, OverflowError) as err:
            log.warning("fragment %d: not folded (%s); its merge reads the pushes again", f, err)
            self._folds[f] = None
            return False
        folded.items.append((contribution, weight, scale))
        payload = contribution.payload
        if self.spill_dir is not None and isinstance(payload, EncodedPayload):
            try:
                payload.spill(self.spill_dir)
            except OSError as err:  # a full disk: the push stays in memory, nothing is lost
                log.warning("fragment %d: a push kept in memory (%s)", f, err)
        return True

    def take(
        self, f: int, contributions: Sequence[Contribution], plan: MergePlan
    ) -> MergeFold | None:
        """Fragment f's fold when it holds exactly `contributions` (by identity, any order) with
        `plan`'s weights and scales; None otherwise. The fold leaves either way: a round is
        merged from it once, or from the encoded payloads."""
        folded, self._folds[f] = self._folds[f], None
        if folded is None or len(folded.items) != len(contributions):
            return None
        planned = {
            id(c): (w, s) for c, w, s in zip(contributions, plan.weights, plan.scales, strict=True)
        }
        for c, w, s in folded.items:
            if planned.get(id(c)) != (w, s):
                return None
        return folded.fold

    def drop(self, f: int) -> None:
        """Forget fragment f's fold (its round changed in a way a fold cannot follow)."""
        self._folds[f] = None

    def held_bytes(self) -> int:
        """Bytes of the accumulators held (for tests and the benchmark)."""
        return sum(
            t.numel() * t.element_size()
            for folded in self._folds
            if folded is not None
            for t in folded.fold.acc.values()
        )
